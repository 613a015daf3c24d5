"""Skrull's training client: torchrun DP × CP training with DACP attention and plans from the scheduler.

Sub-packages and top-level modules, layer by layer from the bottom up (docs/development.md, "Where code goes"; a
module loads nothing of a layer above its own, ``tests/test_trainer_layers.py``):

* configuration, which imports nothing of the rest (no torch): ``config`` (the trainer's settings), ``flags``
  (the command line generated from them), ``config_file`` (a YAML, TOML or JSON file of them, the flags over it),
  ``config_choices`` (the closed sets and defaults they name) and ``foreign_keys`` (TRL's, transformers' and axolotl's
  names of them);
* processes and plans: ``distributed`` (the ("dp", "cp") mesh and its process groups, a failure told to every rank,
  the process launcher; ``distributed.torch_compat``: the torch calls that differ between the supported releases);
  ``planning``: ``planning.client`` (the scheduler service over HTTP) and ``planning.source`` (rank 0's plans: the
  service's, the embedded core's as fallback, profile registration, feedback); ``hub`` (Hugging Face Hub ids of
  models, tokenizers and data sets: the snapshot in the cache each reads);
* data and DACP: ``data`` (global batches of records or synthetic lengths: ``data.samples``, ``data.encoding``,
  ``data.records``, ``data.sources``; ``data.record_check``, every record checked before the first step;
  ``data.evaluation``, held-out loss); ``dacp``, what a loop of your own reuses: ``dacp.zigzag`` (which tokens a CP
  rank owns), ``dacp.packing`` (a CP rank's row of a micro-batch), ``dacp.attention`` (DACP attention),
  ``dacp.prefetch`` (micro-batches packed and copied to the device ahead of the step);
* models: ``models``: ``models.model`` (transformers model + attention registration), ``models.lora`` (adapters),
  ``models.loss`` (the chunked loss of a micro-batch, its forward and backward), ``models.parallelize`` (activation
  checkpointing, compiled blocks, FSDP, the gradient all-reduce, applied to the model from outside),
  ``models.loading`` (the trained module on every rank without a full copy per rank);
* components, profiler, advisor: ``components``: ``optim`` (AdamW, the schedule, clipping), ``step_metrics`` (what
  a step measures), ``reporting`` (where rank 0 writes it: the metrics file and the experiment trackers),
  ``checkpoint`` (DCP save and resume), ``run_identity`` (what a checkpoint must share with the run that resumes
  it), ``stop`` (SIGINT and SIGTERM: every rank saves at the step boundary and stops), ``model_export`` (a Hugging Face
  model folder from the trained model or a checkpoint); ``profiler``: ``profiler.command`` (``skrull-profile``,
  ``python -m trainer_client.profile``) over ``profiler.sweeps`` (what it measures), ``profiler.document`` (the
  file it writes) and ``profiler.measure`` (its timing and memory probes); ``profiler.auto`` (``--profile auto``:
  measured by the run itself, cached per machine and layout); ``advise``: the layout advisor's command
  (``skrull-advise``, ``python -m trainer_client.advise``) over ``advise.inputs`` (a data set's lengths as this
  trainer encodes them, a checkpoint's shape, a profile file);
* the loop and its commands: ``loop`` (Skrull's plans, packing and loss normaliser, for ``Trainer`` and a training
  loop of your own), ``trainer`` (the bundled loop), ``train`` (the entrypoint: ``skrull-train``, or one torchrun
  rank), ``demo`` (the end-to-end job), ``chat_tokenizer`` (``skrull-tokenizer``: a small chat tokenizer made
  offline); ``profile`` and ``export`` keep ``python -m trainer_client.profile`` and ``python -m
  trainer_client.export`` running the commands that moved into ``profiler`` and ``components``; ``cli_reference``
  writes the commands' reference page from their parsers; ``hf``: Skrull inside transformers' ``Trainer`` and
  TRL's ``SFTTrainer`` (``SkrullTrainer``, ``SkrullSFTTrainer``), imported only by a script that uses them.

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
    "AttentionBackend": "dacp.kernels",
    "dacp_attn_varlen_func": "dacp.attention",
    "varlen_causal_attn_func": "dacp.kernels",
    "DacpMetadata": "dacp.packing",
    "PackedMicroBatch": "dacp.packing",
    "pack_micro_batch": "dacp.packing",
    "GlobalBatch": "data",
    "Sample": "data",
    "PlanClient": "planning.client",
    "PlanClientError": "planning.client",
    "PlanDecision": "planning.source",
    "PlanRejected": "planning.client",
    "PlanSource": "planning.source",
    "PlanTimeout": "planning.client",
    "PlanUnavailable": "planning.client",
    "TrainConfig": "config",
    "Trainer": "trainer",
    "build_model": "models.model",
    "register_dacp_attention": "models.model",
    "model_inputs": "models.model",
    "RankBatch": "loop",
    "SkrullBatches": "loop",
    "PlanningFailed": "loop",
    "ParallelContext": "distributed",
    "ParallelDims": "distributed",
    "init_parallel": "distributed",
    "Sharding": "models.parallelize",
    "padded_length": "dacp.zigzag",
    "zigzag_positions": "dacp.zigzag",
    "run_micro_batch": "models.loss",
    "MicroBatchTiming": "planning.source",
    "ProfileOptions": "profiler.command",
    "measure_profile": "profiler.command",
}


def __getattr__(name: str) -> Any:
    if name not in _MODULE_OF:
        raise AttributeError(f"module 'trainer_client' has no attribute {name!r}")
    return getattr(importlib.import_module(f"trainer_client.{_MODULE_OF[name]}"), name)
