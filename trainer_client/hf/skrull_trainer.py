"""Skrull inside transformers' ``Trainer``: ``SkrullTrainer`` plans every optimizer step and runs it with DACP.

The Trainer keeps doing what it does (its optimizer and schedule, clipping, callbacks, ``report_to``, logging,
checkpoints and their resume, ``save_model``, ``push_to_hub``, PEFT models, accelerate's DDP or FSDP2); Skrull
replaces the steps that decide which rank trains which tokens. Per optimizer step:

1. the data loader gives every rank the whole global batch (``get_train_dataloader``: accelerate's dealing of
   batches to ranks undone, as transformers undoes it for its own rank-aware sampler), each example collated alone
   into one sequence (``collator.SequenceCollator``); ``gradient_accumulation_steps`` is 1 (``layout.py``), so the
   Trainer's loop calls ``training_step`` once per global batch;
2. ``training_step`` plans the batch with ``loop.SkrullBatches``, exactly as the bundled trainer and a loop of one's
   own do (rank 0 asks the scheduler service, else the embedded planner, and broadcasts the plan; every rank checks
   it), then runs this rank's micro-batches in plan order, each packed for DACP on a background thread one ahead,
   with the padding micro-batches its gradient reduction needs (``padding_rule``);
3. each micro-batch's loss is its summed token loss divided by the loss tokens of the whole global batch (the same
   on every rank: each holds the batch) and multiplied by the world size, as the Trainer itself does with
   ``average_tokens_across_devices``: DDP and FSDP2 average gradients over all DP × CP ranks, so their sum remains,
   whatever each rank's micro-batch count (docs/design.md, "Training equivalence");
4. gradients are reduced once, in the backward of each rank's last micro-batch: DDP's all-reduce, after ``no_sync``
   for the others; FSDP2's reduce-scatter, scheduled as the bundled trainer schedules it
   (``parallelize.prepare_micro_batch``).

The DP × CP split is the world's (``layout.trainer_layout``): accelerate's DDP and FSDP2 reduce over the whole world,
which is the flattened ("dp", "cp") mesh ``init_parallel`` builds over the same process group, DP-major; the CP
groups, and the blocks hybrid and spanning micro-batches shard over, are that mesh's. ``evaluate`` and ``predict``
plan their batches the same way and report the mean token loss (``evaluation_loop``). The model computes with DACP
attention inside ``train`` and evaluation only (``attention_interface.dacp_attention``).

On SIGINT or SIGTERM to any rank (``components/stop.py``), every rank finishes the optimizer step, the Trainer saves
its checkpoint there (unless ``save_strategy="no"``) and leaves its loop (``StopOnSignal``), and ``train`` raises
``TrainingStopped``: a ``SystemExit`` with status 128 + the signal, which ends a script quietly. A second Ctrl-C
abandons the step, but not a save in progress: the Trainer marks no checkpoint whole, and
``resume_from_checkpoint=True`` takes the newest folder, so a save cut short would be resumed.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Sized
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import datasets
import torch
from accelerate.data_loader import BatchSamplerShard
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, IterableDataset
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, EvalLoopOutput, TrainOutput, get_last_checkpoint

from scheduler_service.contract.profiles import profile_or_name
from scheduler_service.core.memory import Sharding
from trainer_client.components.stop import TrainingStopped, graceful_stops, saved_whole, stop_agreed
from trainer_client.dacp.packing import PackedMicroBatch
from trainer_client.data import GlobalBatch
from trainer_client.distributed import init_parallel
from trainer_client.hf.arguments import SkrullArguments
from trainer_client.hf.attention_interface import check_replaceable, dacp_attention
from trainer_client.hf.collator import SequenceCollator, check_collator
from trainer_client.hf.layout import trainer_layout
from trainer_client.hf.versions import check_versions
from trainer_client.loop import SkrullBatches
from trainer_client.models.model import config_shape, model_inputs
from trainer_client.models.parallelize import prepare_micro_batch, reshard

__all__ = ["SkrullTrainer", "SkrullTrainerMixin", "StopOnSignal", "every_rank_reads_every_batch", "padding_rule"]

logger = logging.getLogger("trainer_client.hf")

_MIXED_PRECISION = {"bf16": torch.bfloat16, "fp16": torch.float16}

if TYPE_CHECKING:
    _TrainerBase = Trainer  # the mixin's methods use the Trainer's, whichever Trainer it joins
else:
    _TrainerBase = object


class SkrullTrainerMixin(_TrainerBase):
    """Skrull's planning, packing and loss for a ``transformers.Trainer`` or a subclass of it (TRL's trainers):
    ``class MyTrainer(SkrullTrainerMixin, Trainer)``, constructed with ``skrull=SkrullArguments(...)`` beside the
    Trainer's own arguments. Everything Skrull cannot run is refused at construction, before any step."""

    tested_packages: tuple[str, ...] = ("transformers", "accelerate")

    def __init__(self, *args: Any, skrull: SkrullArguments, **kwargs: Any) -> None:
        check_versions(self.tested_packages)
        self.skrull = skrull
        super().__init__(*args, **kwargs)
        self.check_inputs()
        base = self.transformers_model
        self.parallel = init_parallel(self.layout.dims, timeout_s=self.args.ddp_timeout,
                                      device_type=self.args.device.type)
        pad_token_id = getattr(self.processing_class, "pad_token_id", None) or base.config.pad_token_id or 0
        self.skrull_batches = SkrullBatches(
            self.parallel, model=config_shape(base.config, name=base.name_or_path or type(base).__name__),
            bucket_size=skrull.bucket_size, scheduler=skrull.scheduler, scheduler_url=skrull.scheduler_url,
            profile=profile_or_name(skrull.profile), sharding=padding_rule(self), pad_token_id=pad_token_id,
            plan_timeout_s=skrull.plan_timeout_s, plan_attempts=skrull.plan_attempts, spanning=skrull.spanning,
            schemes=skrull.schemes)
        self.data_collator = SequenceCollator(self.data_collator)
        self.stop_on_signal = StopOnSignal(self.parallel.object_group)
        self.add_callback(self.stop_on_signal)  # after the user's callbacks: it decides last at each step's end
        # What the layers compute in, for DACP's kernel to be chosen once per micro-batch (model.model_inputs).
        self.compute_dtype = _MIXED_PRECISION.get(self.accelerator.mixed_precision, base.dtype)
        if self.is_world_process_zero():
            logger.warning("%s", self.layout.explanation)

    def create_accelerator_and_postprocess(self) -> None:
        """The Trainer's first step with its arguments: Skrull reads and checks them here (``trainer_layout``),
        before the accelerator reads the ones it sets."""
        self.layout = trainer_layout(self.args, self.skrull)
        super().create_accelerator_and_postprocess()

    def check_inputs(self) -> None:
        """Raise ``ValueError`` for a model, loss, metric or data set Skrull cannot train, naming it; keep the
        transformers model whose attention DACP replaces (a PEFT model's base) as ``transformers_model``."""
        self.transformers_model = check_replaceable(self.model)
        refusals = {
            "model_init": (self.model_init is not None,
                           "Skrull checks and switches the attention of the model it is given: pass the model"),
            "compute_loss_func": (self.compute_loss_func is not None,
                                  "it gets the logits and labels of a padded batch; Skrull's micro-batches are packed "
                                  "rows whose targets are shifted already: subclass and override micro_batch_loss"),
            "compute_metrics": (self.compute_metrics is not None,
                                "it needs the logits of padded batches; Skrull evaluates planned, packed batches "
                                "and reports their mean token loss (eval_loss)"),
            "model": (not self.model_accepts_loss_kwargs,
                      f"{type(self.model).__name__}'s forward takes no num_items_in_batch, so its loss would be a "
                      "mean per micro-batch; Skrull divides by the whole global batch's loss tokens"),
            "train_dataset": (isinstance(self.train_dataset, IterableDataset | datasets.IterableDataset),
                              "an iterable data set is split between the ranks; every Skrull rank reads the whole "
                              "global batch: give a map-style data set (datasets.Dataset)"),
        }
        for name, (refused, reason) in refusals.items():
            if refused:
                raise ValueError(f"{name}: {reason}")
        dataset = self.train_dataset
        if dataset is not None:
            if isinstance(dataset, datasets.Dataset):
                dataset = self._remove_unused_columns(dataset, description="training")
            num_examples = min(2, len(cast(Sized, dataset)))  # a map-style data set (the iterable ones are refused)
            check_collator(self.data_collator, [dataset[index] for index in range(num_examples)])

    # ------------------------------------------------------------------------------------------------ data

    def get_train_dataloader(self) -> DataLoader:
        """The Trainer's data loader (its sampler, its seeded shuffling, its workers), every global batch whole on
        every rank."""
        return every_rank_reads_every_batch(super().get_train_dataloader())

    def get_eval_dataloader(self, eval_dataset: Any = None) -> DataLoader:
        return every_rank_reads_every_batch(super().get_eval_dataloader(eval_dataset))

    def get_test_dataloader(self, test_dataset: Any) -> DataLoader:
        return every_rank_reads_every_batch(super().get_test_dataloader(test_dataset))

    def get_total_train_batch_size(self, args: Any) -> int:
        """The sequences of one optimizer step: the global batch, which every rank reads whole."""
        return self.layout.global_batch

    # ------------------------------------------------------------------------------------------------ compute

    def train(self, *args: Any, **kwargs: Any) -> TrainOutput:
        """The Trainer's ``train``; on SIGINT or SIGTERM it raises ``TrainingStopped`` once the Trainer saved and
        stopped at the step's end (module docstring), rank 0 having logged what it saved and how to resume."""
        self.stop_on_signal.signal = None
        try:
            with dacp_attention(self.transformers_model), graceful_stops():
                output = super().train(*args, **kwargs)
                if self.stop_on_signal.signal is not None:
                    checkpoint = (self.output_dir / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
                                  if self.args.save_strategy != "no" else None)
                    raise TrainingStopped(self.stop_on_signal.signal, checkpoint=checkpoint)
        except TrainingStopped as stopped:
            if self.is_world_process_zero():
                logger.warning("%s", self.stop_line(stopped))
            raise
        return output

    def stop_line(self, stopped: TrainingStopped) -> str:
        """What a stop saved and how to resume it, as rank 0 logs it."""
        done, steps = self.state.global_step, self.state.max_steps
        where = f"during step {done + 1} of {steps}" if stopped.abandoned else f"after step {done} of {steps}"
        if stopped.checkpoint is not None:
            saved = f"saved {stopped.checkpoint}"
        elif stopped.abandoned:
            saved = "the step was abandoned"
        else:
            saved = 'nothing saved (save_strategy="no")'
        newest = get_last_checkpoint(self.output_dir) if self.output_dir.is_dir() else None
        resume = (f"resume with trainer.train(resume_from_checkpoint=True), which takes {newest}" if newest is not None
                  else "no checkpoint to resume from")
        return f"stopped by {stopped.how()} {where}: {saved}; {resume}"

    @property
    def output_dir(self) -> Path:
        """Where the Trainer saves its checkpoints (its arguments' ``output_dir``; ``trainer_output`` by default)."""
        return Path(self.args.output_dir or "trainer_output")

    def _save_checkpoint(self, model: nn.Module, trial: Any) -> None:
        """The Trainer's save, whole: a second signal waits for its end (module docstring)."""
        with saved_whole():
            super()._save_checkpoint(model, trial)

    def training_step(self, model: nn.Module, inputs: dict[str, Any],
                      num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor:
        """Plan ``inputs``' global batch and run this rank's micro-batches of it, forward and backward, in plan order;
        returns their summed loss (the Trainer averages it over the ranks for its logs: the batch's mean token loss).
        The Trainer's ``num_items_in_batch`` is None here: the normaliser is the global batch's own."""
        model.train()
        if isinstance(model, DistributedDataParallel):
            # DDP broadcasts buffers in every forward, a collective per micro-batch, and ranks run different numbers
            # of micro-batches; nothing trains the buffers (RoPE's frequencies), so they stay as DDP synced them at
            # its start. Set on the module, as torch 2.13 deprecates the argument the Trainer would pass it through.
            model.broadcast_buffers = False
        optimizer_train = getattr(self.optimizer, "train", None)
        if callable(optimizer_train):  # schedule-free optimizers, as the Trainer does
            optimizer_train()
        batch = GlobalBatch(step=self.state.global_step, samples=inputs["samples"])
        loss = torch.zeros((), device=self.args.device)
        input_ids_T = []
        with self.skrull_batches.plan(batch) as share:
            packs = share.micro_batches
            for index, pack in enumerate(packs):
                with self.gradient_sync(model, is_last=index == len(packs) - 1):
                    with self.compute_loss_context_manager():
                        micro_loss = self.micro_batch_loss(model, self.micro_batch_inputs(pack),
                                                           num_loss_tokens=max(batch.num_loss_tokens, 1))
                    self.accelerator.backward(micro_loss)
                loss += micro_loss.detach()
                input_ids_T.append(pack.input_ids_T)
        self.record_token_metrics(batch.num_tokens, training=True)
        # The Trainer counts FLOPs and tokens seen from the step's inputs after this: this rank's packed tokens.
        inputs["input_ids"] = torch.cat(input_ids_T)
        return loss

    def gradient_sync(self, model: nn.Module, *, is_last: bool) -> AbstractContextManager[Any]:
        """Where this rank's micro-batch reduces gradients: in its last one only (FSDP2 under zero3: every one)."""
        if self.is_fsdp_enabled:
            prepare_micro_batch(model, sharding=padding_rule(self), is_last=is_last)
            return nullcontext()
        return nullcontext() if is_last else self.accelerator.no_sync(model)

    def micro_batch_inputs(self, pack: PackedMicroBatch) -> dict[str, Any]:
        """The model's keyword arguments for one packed micro-batch: its tokens, positions and DACP metadata
        (``model.model_inputs``), and its next-token targets, shifted already: ``shift_labels`` (which the model's
        loss takes as they are) and ``labels`` (without which it computes no loss)."""
        targets_1T = pack.targets_T.unsqueeze(0)
        return {**model_inputs(pack, self.skrull.attention_backend, compute_dtype=self.compute_dtype),
                "labels": targets_1T, "shift_labels": targets_1T}

    def micro_batch_loss(self, model: nn.Module, inputs: dict[str, Any], *, num_loss_tokens: int) -> torch.Tensor:
        """One micro-batch's loss as the Trainer computes it (``compute_loss``: the model's own loss): the summed
        token loss over ``num_loss_tokens``, times the world size (``average_tokens_across_devices``)."""
        loss = self.compute_loss(model, inputs, num_items_in_batch=num_loss_tokens)
        assert isinstance(loss, torch.Tensor)
        return loss

    def record_token_metrics(self, num_tokens: int, *, training: bool) -> None:
        """After a training step's (``training``) or an evaluation's micro-batches of ``num_tokens`` tokens: what a
        trainer logs about them beside the loss (TRL's entropy and token accuracy); the Trainer logs nothing more."""

    # ------------------------------------------------------------------------------------------------ evaluation

    def evaluation_loop(self, dataloader: DataLoader, description: str, prediction_loss_only: bool | None = None,
                        ignore_keys: list[str] | None = None, metric_key_prefix: str = "eval") -> EvalLoopOutput:
        """The held-out loss as Skrull trains: every batch planned and packed over all ranks as a training batch,
        forward only, and the mean token loss of the whole set, ``{prefix}_loss``, the same on every rank. The model
        runs as it is (sharded in place under FSDP2; without gradients, DDP's wrapper is not needed)."""
        model = self.model
        assert model is not None  # the Trainer refuses to start without one
        model.eval()
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.args.device)
        num_loss_tokens = num_tokens = num_samples = 0
        with dacp_attention(self.transformers_model), torch.no_grad(), self.accelerator.autocast():
            for inputs in dataloader:
                batch = GlobalBatch(step=self.state.global_step, samples=inputs["samples"])
                with self.skrull_batches.plan(batch) as share:
                    for pack in share.micro_batches:
                        if pack.is_idle:  # this rank holds no token of it (replicated): no peer waits for it
                            continue
                        # Divided by 1: the summed token loss (times the world size, undone below).
                        loss_sum += self.micro_batch_loss(model, self.micro_batch_inputs(pack),
                                                          num_loss_tokens=1).double()
                num_loss_tokens += batch.num_loss_tokens
                num_tokens += batch.num_tokens
                num_samples += len(batch.samples)
        reshard(model)  # FSDP2 under zero2 keeps the parameters gathered after a forward; the next step gathers afresh
        torch.distributed.all_reduce(loss_sum)
        self.record_token_metrics(num_tokens, training=False)
        loss = float(loss_sum.item()) / self.accelerator.num_processes / max(num_loss_tokens, 1)
        # No predictions, as the Trainer's own loop gives none without compute_metrics (its type says otherwise).
        return EvalLoopOutput(predictions=None, label_ids=None,  # type: ignore[arg-type]
                              metrics={f"{metric_key_prefix}_loss": loss}, num_samples=num_samples)

    def end(self) -> None:
        """Close the planner (its connection to the service), then the Trainer's end: the trackers, the process
        group."""
        self.skrull_batches.close()
        super().end()


class StopOnSignal(TrainerCallback):
    """At each optimizer step's end, every rank learns whether any got SIGINT or SIGTERM (``stop.stop_agreed``, over
    ``group``, a gloo group); then the Trainer saves its checkpoint there (unless ``save_strategy="no"``) and leaves its
    loop, and ``signal`` says which signal it was. A signal in the last step lets the run end as usual."""

    def __init__(self, group: torch.distributed.ProcessGroup) -> None:
        self.group = group
        self.signal: signal.Signals | None = None

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        if state.global_step >= state.max_steps:
            return
        self.signal = stop_agreed(self.group)
        if self.signal is not None:
            control.should_save = args.save_strategy != "no"
            control.should_training_stop = True


class SkrullTrainer(SkrullTrainerMixin, Trainer):
    """``transformers.Trainer`` with Skrull's plans: ``SkrullTrainer(model=..., args=TrainingArguments(...),
    train_dataset=..., skrull=SkrullArguments(bucket_size=4096, cp=2))`` under ``torchrun``."""


def every_rank_reads_every_batch(dataloader: DataLoader) -> DataLoader:
    """accelerate deals each batch of a Trainer's data loader to one rank (``BatchSamplerShard``); Skrull plans every
    batch over all ranks, so each rank reads every batch, whole: the dealer made a passthrough, as transformers makes
    it for its own rank-aware ``BatchRebalanceSampler``, and without repeating examples to even out the last batch."""
    sampler = dataloader.batch_sampler
    if isinstance(sampler, BatchSamplerShard):
        sampler.num_processes, sampler.process_index, sampler.even_batches = 1, 0, False
    return dataloader


def padding_rule(trainer: Trainer) -> Sharding:
    """The padding micro-batches a run needs, named by the bundled trainer's sharding mode whose rule it is
    (``parallelize.num_padding_micro_batches``): ``zero3`` under FSDP2 resharding after every forward, whose
    parameter gathers make every rank run as many micro-batches; ``zero2`` otherwise, under FSDP2 keeping them
    gathered (one gather and one reduction per unit and step) and under DDP (one all-reduce, in the backward of each
    rank's last micro-batch) alike: every rank runs at least one, every rank of a CP group the same ones."""
    fsdp_plugin = trainer.accelerator.state.fsdp_plugin if trainer.is_fsdp_enabled else None
    if fsdp_plugin is not None and fsdp_plugin.reshard_after_forward:
        return Sharding.ZERO3
    return Sharding.ZERO2
