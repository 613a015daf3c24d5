"""What a Trainer's arguments become under Skrull: the DP × CP split, the global batch, and the refusals.

A Trainer's batch is counted per device: ``per_device_train_batch_size`` sequences a forward pass,
``gradient_accumulation_steps`` passes a step, on every data-parallel process. Skrull plans each step's *global*
batch over all ranks: how many micro-batches each DP rank runs, and which sequences each holds, up to
``SkrullArguments.bucket_size`` tokens per CP rank. So, at start (``trainer_layout``):

* the global batch is ``SkrullArguments.global_batch``, else the Trainer's own total
  ``per_device_train_batch_size × gradient_accumulation_steps × dp`` (a script keeps its optimizer steps), or
  ``× dp × cp`` with ``SkrullArguments.batch_per_process`` (the same whatever the CP degree); both given and
  disagreeing is refused; rank 0's line at start says what the settings would give at every CP degree
  (``batch_mapping``);
* the Trainer's loop then reads one batch a step, the whole global batch on every rank
  (``per_device_train_batch_size`` becomes the global batch, ``gradient_accumulation_steps`` 1), and rank 0 logs
  what each field now means;
* what cannot mean anything under Skrull is refused by name, with the setting that replaces it: a CP degree that
  does not divide the world, samplers that group lengths (the plan balances them), a batch size found by trial
  (``auto_find_batch_size``), a mean loss per device (``average_tokens_across_devices=False``), NEFTune (its noise
  scales with a forward's row length, a padded batch's there and a packed micro-batch's shard here), label
  smoothing (it shifts the already shifted targets), DDP's buffer broadcast (a collective in every forward, and
  ranks run different numbers of micro-batches), DeepSpeed, accelerate's own context parallelism, FSDP1, batches
  dispatched from rank 0, and several GPUs in one process (``nn.DataParallel``).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from transformers import TrainingArguments

from trainer_client.distributed import ParallelDims
from trainer_client.hf.arguments import SkrullArguments

__all__ = ["TrainerLayout", "batch_mapping", "trainer_layout"]

LENGTH_SAMPLERS = ("group_by_length", "batch_rebalance")


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainerLayout:
    """The split of the world, the sequences of one optimizer step, and what rank 0 says about them at start."""

    dims: ParallelDims
    global_batch: int
    explanation: str


def trainer_layout(args: TrainingArguments, skrull: SkrullArguments) -> TrainerLayout:
    """Check ``args`` against Skrull (``ValueError`` naming the field and what replaces it) and set the fields whose
    meaning changes: ``per_device_train_batch_size`` to the global batch, ``gradient_accumulation_steps`` to 1.
    Called before the accelerator exists, which reads them."""
    world_size = args.world_size
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size != launched:
        raise ValueError(f"use_cpu: torchrun launched {launched} processes and accelerate trains with {world_size}, "
                         "each alone: without GPUs, accelerate joins the processes only with use_cpu=True; set it")
    if world_size % skrull.cp:
        raise ValueError(f"SkrullArguments.cp {skrull.cp} does not divide the world size {world_size}: the world is "
                         f"dp × cp processes; launch a multiple of {skrull.cp} (torchrun --nproc-per-node), or give "
                         f"a cp that divides {world_size}")
    dims = ParallelDims(dp_size=world_size // skrull.cp, cp_size=skrull.cp)
    _refuse_what_skrull_replaces(args)
    # The processes per_device_train_batch_size counts for: each DP rank (a CP group shares one), or each process.
    per_step = (args.per_device_train_batch_size * args.gradient_accumulation_steps
                * (world_size if skrull.batch_per_process else dims.dp_size))
    from_trainer = (f"per_device_train_batch_size {args.per_device_train_batch_size} × gradient_accumulation_steps "
                    f"{args.gradient_accumulation_steps} × dp {dims.dp_size}"
                    + (f" × cp {dims.cp_size}" if skrull.batch_per_process else ""))
    if skrull.global_batch is not None and skrull.global_batch != per_step and not _batch_left_default(args):
        raise ValueError(f"{from_trainer} = {per_step} sequences per optimizer step contradicts SkrullArguments."
                         f"global_batch {skrull.global_batch}: Skrull plans each global batch's micro-batches itself; "
                         "give the global batch once, as SkrullArguments.global_batch with "
                         "per_device_train_batch_size and gradient_accumulation_steps left at their defaults, or "
                         "through them alone")
    global_batch = skrull.global_batch if skrull.global_batch is not None else per_step
    origin = "SkrullArguments.global_batch" if skrull.global_batch is not None else from_trainer
    explanation = (
        f"Skrull: dp {dims.dp_size} × cp {dims.cp_size} over {world_size} processes; every optimizer step trains a "
        f"global batch of {global_batch} sequences ({origin}), planned over all ranks in micro-batches of at most "
        f"SkrullArguments.bucket_size {skrull.bucket_size} tokens per CP rank, as many per DP rank as its sequences "
        f"need. {batch_mapping(args, skrull, world_size)}. "
        f"So per_device_train_batch_size is now {global_batch} (every rank reads the whole global batch) and "
        "gradient_accumulation_steps 1 (one planned step per batch); the plan, not the sampler, balances lengths; "
        f"an evaluation batch of per_device_eval_batch_size {args.per_device_eval_batch_size} sequences is planned "
        "over all ranks the same way")
    args.per_device_train_batch_size = global_batch
    args.gradient_accumulation_steps = 1
    return TrainerLayout(dims=dims, global_batch=global_batch, explanation=explanation)


def batch_mapping(args: TrainingArguments, skrull: SkrullArguments, world_size: int) -> str:
    """One sentence: the global batch the Trainer's batch settings give at each DP × CP split of ``world_size``
    processes (read before ``trainer_layout`` sets them)."""
    if skrull.global_batch is not None:
        return f"SkrullArguments.global_batch gives the global batch, {skrull.global_batch} sequences at every cp"
    per_dp_rank = args.per_device_train_batch_size * args.gradient_accumulation_steps
    processes = f"{world_size} process{'es' if world_size > 1 else ''}"
    if skrull.batch_per_process:
        return (f"per_device_train_batch_size counts sequences per process (SkrullArguments.batch_per_process): over "
                f"{processes} these settings train {per_dp_rank * world_size} sequences at every cp")
    at_each_cp = ", ".join(f"{per_dp_rank * (world_size // cp)} at cp {cp}"
                           for cp in range(1, world_size + 1) if world_size % cp == 0)
    return (f"per_device_train_batch_size counts sequences per DP rank, which the cp processes of a CP group share: "
            f"over {processes} these settings train {at_each_cp} (SkrullArguments.batch_per_process=True keeps "
            f"{per_dp_rank * world_size} at every cp)")


def _batch_left_default(args: TrainingArguments) -> bool:
    """``per_device_train_batch_size`` and ``gradient_accumulation_steps`` at their class's defaults: the global
    batch is then ``SkrullArguments.global_batch``'s alone."""
    defaults = {field.name: field.default for field in dataclasses.fields(args)}
    return all(getattr(args, name) == defaults[name]
               for name in ("per_device_train_batch_size", "gradient_accumulation_steps"))


def _refuse_what_skrull_replaces(args: TrainingArguments) -> None:
    """Raise ``ValueError`` for the first setting that has no meaning under Skrull, naming what replaces it."""
    refusals = {
        "train_sampling_strategy": (
            args.train_sampling_strategy in LENGTH_SAMPLERS,
            f"{args.train_sampling_strategy!r} groups sequences by length for per-device batches; Skrull's plan "
            "balances every global batch's lengths over the ranks and micro-batches (SkrullArguments.scheduler): "
            "use 'random' or 'sequential'"),
        "auto_find_batch_size": (
            args.auto_find_batch_size,
            "Skrull bounds a micro-batch by tokens, SkrullArguments.bucket_size per CP rank, not by a per-device "
            "batch to shrink on out-of-memory: set it False and size bucket_size to the memory"),
        "average_tokens_across_devices": (
            not args.average_tokens_across_devices,
            "Skrull divides every micro-batch's summed token loss by the loss tokens of the whole global batch, "
            "whichever ranks train them: set it True (its default)"),
        "neftune_noise_alpha": (
            args.neftune_noise_alpha is not None,
            "NEFTune's noise is alpha / sqrt(row length × hidden size) of a forward's row, in the Trainer and TRL a "
            "padded batch's length (TRL's padding_free: the whole flattened batch); a Skrull row is a packed "
            "micro-batch's shard on one CP rank, so the same alpha would train with another noise: leave it None"),
        "label_smoothing_factor": (
            args.label_smoothing_factor != 0,
            "label smoothing shifts the labels again, and Skrull's packed targets are shifted already: set it 0"),
        "ddp_broadcast_buffers": (
            args.ddp_broadcast_buffers is True,
            "DDP would broadcast the buffers in every forward, a collective per micro-batch, and Skrull's ranks run "
            "different numbers of micro-batches: leave it unset (Skrull turns the broadcast off; nothing trains the "
            "buffers, such as RoPE's frequencies, so they stay as every rank built them)"),
        "deepspeed": (
            bool(args.deepspeed),
            "Skrull trains through accelerate's DDP, or FSDP2 (fsdp=True; fsdp_config reshard_after_forward "
            "True or False)"),
        "parallelism_config": (
            args.parallelism_config is not None,
            "accelerate's context parallelism shards every sequence and replaces the mask of packed ones; "
            "Skrull's is SkrullArguments.cp (DACP: each sequence over as few ranks as it needs)"),
        "fsdp_config": (
            bool(args.fsdp) and args.fsdp_plugin_args is not None and args.fsdp_plugin_args["fsdp_version"] != 2,
            "Skrull shards with FSDP2: set fsdp_config version 2 (the default)"),
        "accelerator_config": (
            getattr(args.accelerator_config, "dispatch_batches", None) is True,
            "dispatch_batches sends each rank a slice of rank 0's batch; every Skrull rank reads the whole global "
            "batch: leave dispatch_batches unset"),
        "n_gpu": (
            args.n_gpu > 1,
            f"{args.n_gpu} GPUs in one process would train through nn.DataParallel; launch one process per GPU "
            "(torchrun)"),
    }
    for name, (refused, reason) in refusals.items():
        if refused:
            raise ValueError(f"{name}: {reason}")
