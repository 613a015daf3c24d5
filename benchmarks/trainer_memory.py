"""Memory per rank of training under each sharding mode (CPU, 4 gloo ranks, dp 2 × cp 2, fp32).

``python -m benchmarks.trainer_memory`` runs, for each model and ``--sharding``, a fresh 4-process job that
builds the trainer and trains two steps (``synthetic:lmsys``, global batch 8, bucket 1024: the same data and
plans in every mode), and reports per mode the largest rank's

* peak resident memory (``ru_maxrss``) and its growth over the process before the model was built (the
  runtime itself, torch and transformers, is ~0.4 GB per process on CPU): what the process really held, allocator
  slack and freed-but-kept pages included;
* weights + gradients + AdamW states it keeps after the step, counted tensor by tensor (local shards), and that
  per parameter beside the static bytes per parameter the planner's memory model charges at the step's peak
  (``scheduler_service.core.memory.static_bytes_per_parameter``).

CPU has no allocator peak counter like CUDA's; PyTorch's ``MemTracker`` follows module calls and refuses a
module called once per micro-batch, and misses FSDP's storage resizes; hence RSS.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from scheduler_service.core.memory import ActivationCheckpointing, Sharding, static_bytes_per_parameter
from trainer_client.config import TrainConfig
from trainer_client.distributed import ParallelDims, init_parallel, spawn_gloo
from trainer_client.trainer import Trainer

DP, CP = 2, 2


def _local_bytes(tensors: Sequence[torch.Tensor]) -> int:
    total = 0
    for tensor in tensors:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        total += local.numel() * local.element_size()
    return total


def _rss_bytes() -> int:
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # KiB on Linux


def _measure(out: Path, model: str, sharding: Sharding, checkpointing: str) -> None:
    parallel = init_parallel(ParallelDims.of(TrainConfig(dp=DP, cp=CP)))
    before = _rss_bytes()
    config = TrainConfig(dp=DP, cp=CP, model=model, global_batch=8, steps=2, bucket_size=1024, progress=False,
                         sharding=sharding, activation_checkpointing=ActivationCheckpointing(checkpointing))
    trainer = Trainer(config, parallel)
    trainer.train()
    params = list(trainer.module.parameters())
    states = [v for s in trainer.optimizer.state.values() for v in s.values()
              if isinstance(v, torch.Tensor) and v.ndim > 0]
    state = _local_bytes(params) + _local_bytes([p.grad for p in params if p.grad is not None]) + _local_bytes(states)
    measured = torch.tensor([_rss_bytes(), _rss_bytes() - before, state], dtype=torch.float64)
    dist.all_reduce(measured, op=dist.ReduceOp.MAX)
    trainer.close()
    if parallel.is_main:
        static = static_bytes_per_parameter(sharding, compute_bytes=4)
        out.write_text(json.dumps({
            "model": model, "sharding": sharding.value, "num_parameters": sum(p.numel() for p in params),
            "peak_rss_bytes": int(measured[0]), "rss_growth_bytes": int(measured[1]), "state_bytes": int(measured[2]),
            "model_bytes_per_parameter": static.replicated + static.sharded / (DP * CP)}))
    dist.barrier()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.trainer_memory", description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny,small")
    parser.add_argument("--activation-checkpointing", default="none")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as work:
        out = Path(work) / "row.json"
        for model in args.models.split(","):
            for sharding in Sharding:  # one job each: the peak RSS is the process's
                spawn_gloo(_measure, DP * CP, out, model, sharding, args.activation_checkpointing)
                rows.append(json.loads(out.read_text()))
    print(f"memory per rank (largest rank), dp {DP} × cp {CP}, fp32, CPU, activation checkpointing "
          f"{args.activation_checkpointing}")
    print(f"{'model':<6} {'params':>9} {'sharding':<8} {'peak RSS MiB':>12} {'growth MiB':>10} {'state MiB':>9} "
          f"{'state B/param':>13} {'model B/param at peak':>21}")
    for row in rows:
        print(f"{row['model']:<6} {row['num_parameters']:>9} {row['sharding']:<8} "
              f"{row['peak_rss_bytes'] / 2**20:>12.1f} {row['rss_growth_bytes'] / 2**20:>10.1f} "
              f"{row['state_bytes'] / 2**20:>9.2f} {row['state_bytes'] / row['num_parameters']:>13.2f} "
              f"{row['model_bytes_per_parameter']:>21.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
