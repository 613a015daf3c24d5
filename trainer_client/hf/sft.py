"""Skrull inside TRL's ``SFTTrainer``: TRL's data path, Skrull's plans.

``SkrullSFTTrainer`` is ``SFTTrainer`` with ``SkrullTrainerMixin`` (``skrull_trainer``): TRL still prepares the data
(chat templates, ``assistant_only_loss`` and ``completion_only_loss`` masks built into the labels, ``max_length``
truncation) and still computes the loss through its fused LM head (the LM head applied and the log-probabilities
taken a chunk of tokens at a time, so a long row's logits are never held whole); Skrull plans each global batch,
packs its micro-batches and normalises their loss by the global batch's loss tokens. TRL's entropy and token
accuracy are summed over the step's micro-batches and reduced once per step (once per evaluation), not once per
micro-batch: ranks run different numbers of micro-batches, so no collective may sit inside one.

TRL's own packing is refused by name (``check_sft_config``): it packs documents into ``max_length`` rows before
Skrull sees them, as one sequence each, where Skrull's plan already packs (``bucket_size`` tokens per CP rank), each
document kept apart by DACP attention. Refusing, rather than quietly turning it off, makes the user see that
``max_length`` then truncates each sequence instead of sizing a packed row. So is what a Skrull micro-batch cannot
hold: ``padding_free`` (a packing collator), the DFT loss, activation offloading and MoE auxiliary losses (a
per-micro-batch mean, which a plan's varying micro-batch counts would weigh differently on every rank).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from transformers import TrainingArguments
from trl import SFTTrainer

from trainer_client.hf.arguments import SkrullArguments
from trainer_client.hf.skrull_trainer import SkrullTrainerMixin
from trainer_client.hf.versions import check_versions

__all__ = ["SkrullSFTTrainer", "check_sft_config"]


def check_sft_config(args: TrainingArguments) -> None:
    """Raise ``ValueError`` for an ``SFTConfig`` setting Skrull replaces or cannot run, naming it, before TRL
    prepares any data."""
    refusals = {
        "packing": (getattr(args, "packing", False) or getattr(args, "eval_packing", None),
                    "TRL would pack documents into max_length rows before Skrull sees them; Skrull's plan packs "
                    "(SkrullArguments.bucket_size tokens per CP rank) and keeps every document apart: set "
                    "packing=False (and eval_packing), max_length then truncates each sequence"),
        "padding_free": (getattr(args, "padding_free", False),
                         "TRL's padding-free collator flattens a batch into one row; Skrull's plan packs the "
                         "sequences: set padding_free=False"),
        "loss_type": (getattr(args, "loss_type", "nll") != "nll",
                      f"{getattr(args, 'loss_type', None)!r}: Skrull trains TRL's nll loss"),
        "activation_offloading": (getattr(args, "activation_offloading", False),
                                  "not supported with Skrull's packed micro-batches: set it False"),
    }
    for name, (refused, reason) in refusals.items():
        if refused:
            raise ValueError(f"{name}: {reason}")


class SkrullSFTTrainer(SkrullTrainerMixin, SFTTrainer):
    """TRL's ``SFTTrainer`` with Skrull's plans: ``SkrullSFTTrainer(model=..., args=SFTConfig(...),
    train_dataset=..., skrull=SkrullArguments(bucket_size=4096, cp=2))`` under ``torchrun``."""

    def __init__(self, model: Any, args: TrainingArguments | None = None, *positional: Any,
                 skrull: SkrullArguments, **kwargs: Any) -> None:
        check_versions(("trl",))
        if args is not None:
            check_sft_config(args)
        super().__init__(model, args, *positional, skrull=skrull, **kwargs)
        # [loss tokens, entropy, correct top-1 predictions] of the micro-batches since the last record
        self._token_sums = torch.zeros(3, dtype=torch.float64, device=self.args.device)

    def check_inputs(self) -> None:
        if self.aux_loss_enabled:
            raise ValueError("router_aux_loss_coef: a MoE load-balancing loss is a mean per micro-batch, which "
                             "Skrull's plans (a varying number of micro-batches per rank) would weigh unevenly: set "
                             "router_aux_loss_coef=0.0")
        super().check_inputs()

    def micro_batch_loss(self, model: nn.Module, inputs: dict[str, Any], *, num_loss_tokens: int) -> torch.Tensor:
        """TRL's loss through its fused LM head (the pre-shifted ``shift_labels`` scored as they are): the summed
        negative log-likelihood over ``num_loss_tokens``, times the world size as TRL scales it
        (``average_tokens_across_devices``); its token statistics are summed for ``record_token_metrics``."""
        outputs = model(**inputs, fused_lm_head=True, num_items_in_batch=num_loss_tokens)
        self._token_sums += torch.stack([outputs.label_mask.sum(), outputs.entropy.detach().sum(),
                                         outputs.is_top1.sum()]).double()
        loss: torch.Tensor = outputs.loss * self.accelerator.num_processes
        return loss

    def record_token_metrics(self, num_tokens: int, *, training: bool) -> None:
        """TRL's ``entropy``, ``mean_token_accuracy`` and ``num_tokens``, of the whole step (or evaluation): the
        sums of every rank's micro-batches, reduced in one collective."""
        dist.all_reduce(self._token_sums)
        num_valid, entropy, num_correct = self._token_sums.tolist()
        self._token_sums.zero_()
        mode = "train" if training else "eval"
        self._metrics[mode]["entropy"].append(entropy / num_valid if num_valid else 0.0)
        self._metrics[mode]["mean_token_accuracy"].append(num_correct / num_valid if num_valid else 0.0)
        if training:
            self._total_train_tokens += num_tokens
        self._metrics[mode]["num_tokens"] = [self._total_train_tokens]
