"""Skrull's training client: torchrun DP × CP training with DACP attention and plans from the scheduler.

Modules, one concept each:

* ``dacp``, the sub-package a loop of your own reuses: ``dacp.zigzag`` (which tokens a CP rank owns),
  ``dacp.packing`` (a CP rank's row of a micro-batch), ``dacp.attention`` (DACP attention), ``dacp.prefetch``
  (micro-batches packed and copied to the device ahead of the step);
* the model: ``model`` (transformers model + attention registration), ``lora`` (adapters), ``loss`` (the chunked
  loss of a micro-batch, its forward and backward), ``loading`` (the trained module on every rank without a full
  copy per rank), ``parallelize`` (activation checkpointing, compiled blocks, FSDP, the gradient all-reduce),
  ``torch_compat`` (the torch calls that differ between the supported releases);
* the run: ``data`` (global batches), ``hub`` (Hugging Face Hub ids: the snapshot in the cache each reads),
  ``plan_client`` (service client, embedded fallback, profile registration, feedback), ``distributed`` (mesh, process
  launcher), ``config`` (the trainer's settings), ``choices`` (the closed sets they name, without torch),
  ``foreign_keys`` (TRL's, transformers' and axolotl's names of them), ``optim``
  (the schedule and clipping), ``trainer`` (the loop), ``loop`` (Skrull's plans, packing and loss normaliser for a
  training loop of your own), ``step_metrics`` (what a step measures), ``reporting`` (where rank 0 writes it: the
  metrics file and the experiment trackers), ``data_check`` (every record checked before step 0), ``evaluation``
  (held-out loss), ``checkpoint`` (DCP save and resume), ``run_identity`` (what a checkpoint must share with the run
  that resumes it), ``export`` (a Hugging Face model folder from the trained model or a checkpoint), ``train`` (the
  entrypoint: ``skrull-train``, or one torchrun rank), ``demo`` (the end-to-end job);
* profiles: ``profile`` (the profiler's command) over the sub-package ``profiler``: ``profiler.sweeps`` (what it
  measures), ``profiler.document`` (the file it writes) and ``profiler.measure`` (its timing and memory probes);
  ``auto_profile`` (``--profile auto``: measured by the run itself, cached per machine and layout);
* the layout advisor's command: ``advise`` (``skrull-advise``) over ``advise_inputs`` (a data set's lengths as
  this trainer encodes them, a checkpoint's shape, a profile file).
* the sub-package ``hf``: Skrull inside transformers' ``Trainer`` and TRL's ``SFTTrainer`` (``SkrullTrainer``,
  ``SkrullSFTTrainer``), imported only by a script that uses them.

Public names resolve lazily, so ``import trainer_client`` does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "AttentionBackend",
    "DacpMetadata",
    "GlobalBatch",
    "MicroBatchTiming",
    "PackedMicroBatch",
    "ParallelContext",
    "ParallelDims",
    "PlanClient",
    "PlanClientError",
    "PlanDecision",
    "PlanRejected",
    "PlanSource",
    "PlanTimeout",
    "PlanUnavailable",
    "PlanningFailed",
    "ProfileOptions",
    "RankBatch",
    "Sample",
    "Sharding",
    "SkrullBatches",
    "TrainConfig",
    "Trainer",
    "build_model",
    "dacp_attn_varlen_func",
    "init_parallel",
    "measure_profile",
    "model_inputs",
    "pack_micro_batch",
    "padded_length",
    "register_dacp_attention",
    "run_micro_batch",
    "varlen_causal_attn_func",
    "zigzag_positions",
]

_MODULE_OF = {
    "AttentionBackend": "dacp.attention",
    "dacp_attn_varlen_func": "dacp.attention",
    "varlen_causal_attn_func": "dacp.attention",
    "DacpMetadata": "dacp.packing",
    "PackedMicroBatch": "dacp.packing",
    "pack_micro_batch": "dacp.packing",
    "GlobalBatch": "data",
    "Sample": "data",
    "PlanClient": "plan_client",
    "PlanClientError": "plan_client",
    "PlanDecision": "plan_client",
    "PlanRejected": "plan_client",
    "PlanSource": "plan_client",
    "PlanTimeout": "plan_client",
    "PlanUnavailable": "plan_client",
    "TrainConfig": "config",
    "Trainer": "trainer",
    "build_model": "model",
    "register_dacp_attention": "model",
    "model_inputs": "model",
    "RankBatch": "loop",
    "SkrullBatches": "loop",
    "PlanningFailed": "loop",
    "ParallelContext": "distributed",
    "ParallelDims": "distributed",
    "init_parallel": "distributed",
    "Sharding": "parallelize",
    "padded_length": "dacp.zigzag",
    "zigzag_positions": "dacp.zigzag",
    "run_micro_batch": "loss",
    "MicroBatchTiming": "plan_client",
    "ProfileOptions": "profile",
    "measure_profile": "profile",
}


def __getattr__(name: str) -> Any:
    if name not in _MODULE_OF:
        raise AttributeError(f"module 'trainer_client' has no attribute {name!r}")
    return getattr(importlib.import_module(f"trainer_client.{_MODULE_OF[name]}"), name)
