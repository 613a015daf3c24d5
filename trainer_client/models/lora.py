"""LoRA through ``peft``: low-rank adapters trained on a frozen model (``--lora-rank``).

``apply_lora`` injects the adapters into the transformers model in place (``peft.get_peft_model``), before the
trainer shards it: FSDP2 shards per parameter, so frozen base weights and trained adapters share its units, and
activation checkpointing wraps the same decoder layers. The model keeps its class and its decoder, so packing,
DACP attention and the chunked loss see no difference; only the adapters carry gradients and AdamW state, which
``scheduler_service.core.memory`` counts when it derives the BucketSize.

``lora_B`` starts at zero (peft's default), so the first step's model is the base model, and adapter dropout is
0, so a micro-batch's loss depends on its tokens alone and every scheduler trains the same model.

Export (``model_export``) merges the adapters into the weights (``merge_and_unload``) in one process after the
shards are gathered, since merging under FSDP is not supported, or writes the adapter alone
(``PeftModel.save_pretrained``) for the base model folder it was trained on.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any

import torch
from transformers import PreTrainedModel

from scheduler_service.core.memory import LORA_TARGETS, LoraShape
from trainer_client.config import TrainConfig, check_lora_projections

if TYPE_CHECKING:
    from peft import PeftModel

__all__ = ["LORA_TARGETS", "LoraExport", "LoraSettings", "apply_lora", "check_lora_targets"]


class LoraExport(StrEnum):
    """What ``--output-dir`` holds after a LoRA run: the merged model, or the adapter for its base model."""

    MERGED = "merged"
    ADAPTER = "adapter"


@dataclass(frozen=True, kw_only=True, slots=True)
class LoraSettings:
    """``--lora-rank``, ``--lora-alpha`` and ``--lora-targets``: adapters of ``rank`` scaled by ``alpha / rank``."""

    rank: int
    alpha: int
    targets: tuple[str, ...] = LORA_TARGETS

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"--lora-rank must be positive, got {self.rank}")
        if not self.alpha > 0:
            raise ValueError(f"--lora-alpha must be positive, got {self.alpha}")
        check_lora_projections(self.targets)

    @classmethod
    def of(cls, config: TrainConfig) -> LoraSettings | None:
        """The adapters ``--lora-rank``, ``--lora-alpha`` (default 2 × rank) and ``--lora-targets`` give; ``None``
        without ``--lora-rank``: full fine-tuning."""
        if config.lora_rank is None:
            return None
        alpha = config.lora_alpha if config.lora_alpha is not None else 2 * config.lora_rank
        return cls(rank=config.lora_rank, alpha=alpha, targets=config.lora_targets)

    @property
    def shape(self) -> LoraShape:
        """What the memory model needs: the rank and the projections adapted."""
        return LoraShape(rank=self.rank, targets=self.targets)

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "alpha": self.alpha, "targets": list(self.targets)}

    @classmethod
    def from_json(cls, fields: Mapping[str, Any]) -> LoraSettings:
        return cls(rank=int(fields["rank"]), alpha=int(fields["alpha"]), targets=tuple(fields["targets"]))


def check_lora_targets(lm: torch.nn.Module, targets: tuple[str, ...]) -> None:
    """Raise ``ValueError`` naming ``--lora-targets`` unless every target names a linear layer of ``lm``: checked
    on every rank before any step, where peft would raise deep inside its injection."""
    linear_names = {name.rsplit(".", 1)[-1] for name, module in lm.named_modules()
                    if isinstance(module, torch.nn.Linear)}
    missing = [target for target in targets if target not in linear_names]
    if missing:
        raise ValueError(f"--lora-targets {','.join(missing)} names no linear layer of this model; its linear "
                         f"layers are {','.join(sorted(linear_names))}")


def apply_lora(lm: PreTrainedModel, settings: LoraSettings) -> PeftModel:
    """Freeze ``lm`` and inject the adapters into it in place; returns the peft wrapper (for export), whose
    ``base_model.model`` is ``lm``. peft is imported here, not with the module: it takes a second or more per
    process, which runs without LoRA need not pay."""
    from peft import LoraConfig, PeftModel, get_peft_model

    check_lora_targets(lm, settings.targets)
    config = LoraConfig(r=settings.rank, lora_alpha=settings.alpha, target_modules=list(settings.targets),
                        lora_dropout=0.0, bias="none")
    with warnings.catch_warnings():  # peft 0.21 asks transformers 5 a deprecated question while it injects
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        peft_model = get_peft_model(lm, config)
    assert isinstance(peft_model, PeftModel)
    return peft_model
