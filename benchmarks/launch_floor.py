"""Where the launch-bound floor's figure comes from: one model, one process, micro-batches below the floor timed the
ways the profiler and the trainer meet them (``python -m benchmarks.launch_floor --device cuda``).

On one H200 the profiler's floor-bound points took 98–125 ms (median ~105 ms), while the real micro-batches of the
accuracy run below 2k tokens took 94–165 ms (median ~121 ms). The profiler times each case after a warm-up of the
same case, on round lengths (512, 1024, ...); the trainer meets new lengths at every micro-batch. Each variant below
changes one of those, so the table says which the gap comes from:

* ``repeated, round``: the profiler's practice: one sequence of 512, 1024 or 2048 tokens, one warm-up, timed runs;
* ``repeated, odd``: the same with odd lengths (509, 1021, 2039);
* ``first of each length``: 24 odd lengths of 300–2000 tokens, each run once without a warm-up of its own;
* ``first of each length, gc off``: the same with Python's garbage collector off;
* ``accuracy's micro-batches``: the one-sequence micro-batches of ``deepspeed`` plans of LMSys-shaped batches, timed
  as ``benchmarks.accuracy`` times them (a warm-up, the median of two runs).

Every time is a CUDA-event time of forward and backward on the trainer's layout (``accuracy.run_amid_step``).
"""

from __future__ import annotations

import argparse
import functools
import gc
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from benchmarks.accuracy import run_amid_step
from scheduler_service.core.plan import make_problem
from scheduler_service.core.planner import make_plan
from scheduler_service.core.samplers import sample_lengths
from trainer_client.dacp.packing import PackedMicroBatch, pack_micro_batch
from trainer_client.distributed import ParallelDims, init_parallel
from trainer_client.models.loading import ModelLayout, build_training_module
from trainer_client.models.parallelize import ActivationCheckpointing, Sharding
from trainer_client.profiler.measure import local_pack, random_samples, timed_runs

__all__ = ["main"]


@dataclass(frozen=True, slots=True)
class Variant:
    name: str
    times_s: list[float]

    def row(self) -> str:
        ms = sorted(t * 1e3 for t in self.times_s)
        deciles = statistics.quantiles(ms, n=10) if len(ms) > 1 else [ms[0]] * 9
        return (f"| {self.name} | {len(ms)} | {statistics.median(ms):.1f} | {deciles[0]:.1f} | {deciles[-1]:.1f} | "
                f"{ms[0]:.1f} | {ms[-1]:.1f} |")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.launch_floor", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-0.5b")
    parser.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    parser.add_argument("--batches", type=int, default=2, help="LMSys-shaped global batches of 32 for the last row")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    parallel = init_parallel(ParallelDims(dp_size=1, cp_size=1), device_type=args.device)
    device = parallel.device
    layout = ModelLayout.on(device, dtype=None, sharding=Sharding.ZERO2,
                            activation_checkpointing=ActivationCheckpointing.NONE)
    model = build_training_module(args.model, parallel=parallel, layout=layout, seed=args.seed)
    vocab_size = model.lm.config.vocab_size
    tiny = args.model == "tiny"  # the CPU rehearsal: lengths a tenth as long

    step = functools.partial(run_amid_step, model, layout)  # timed as benchmarks.accuracy times it

    def pack_of(length: int, seed: int) -> PackedMicroBatch:
        return local_pack((length // 10 if tiny else length,), vocab_size=vocab_size, device=device, seed=seed)

    def timed(lengths: Sequence[int], *, warmup: int, repeats: int) -> list[float]:
        return [t for index, length in enumerate(lengths)
                for t in timed_runs(functools.partial(step, pack_of(length, index)), device=device, warmup=warmup,
                                    repeats=repeats)]

    step(pack_of(64, 0))  # the weights gathered, the kernels loaded
    rng = np.random.default_rng(args.seed)
    odd = [int(length) | 1 for length in rng.integers(300, 2000, size=24)]
    variants = [
        Variant("repeated, round (the profiler's practice)", timed((512, 1024, 2048), warmup=1, repeats=3)),
        Variant("repeated, odd", timed((509, 1021, 2039), warmup=1, repeats=3)),
        Variant("first of each length", timed(odd, warmup=0, repeats=1)),
        Variant("first of each length, gc off", _gc_off(lambda: timed([n + 2 for n in odd], warmup=0, repeats=1))),
        Variant("accuracy's micro-batches (deepspeed, LMSys)", _accuracy_times(
            step, args, vocab_size=vocab_size, device=device, rng=rng)),
    ]
    print(f"{args.model} on {device}, one process, bf16 where CUDA; ms per micro-batch (forward + backward)")
    print("| variant | runs | median | p10 | p90 | min | max |")
    print("|---|---|---|---|---|---|---|")
    for variant in variants:
        print(variant.row())
    return 0


def _gc_off(run: Callable[[], list[float]]) -> list[float]:
    gc.disable()
    try:
        return run()
    finally:
        gc.enable()


def _accuracy_times(step: Callable[[PackedMicroBatch], None], args: argparse.Namespace, *, vocab_size: int,
                    device: torch.device, rng: np.random.Generator) -> list[float]:
    """The micro-batches under 2k tokens of ``deepspeed`` plans, timed as ``benchmarks.accuracy`` times them."""
    times = []
    for batch in range(args.batches):
        lengths = sample_lengths("lmsys", 32, rng, max_length=16384).tolist()
        samples = random_samples(lengths, vocab_size=vocab_size, seed=args.seed + batch)
        problem = make_problem(sequence_lengths=lengths, dp_size=1, cp_size=1, model=args.model, bucket_size=16384)
        for micro_batch in make_plan(problem, "deepspeed").plan.dp_ranks[0].micro_batches:
            pack = pack_micro_batch(samples, micro_batch, cp_size=1, cp_rank=0).to(device)
            if pack.num_tokens < 2048:
                times.append(statistics.median(timed_runs(functools.partial(step, pack), device=device,
                                                          warmup=1, repeats=2)))
    return times


if __name__ == "__main__":
    sys.exit(main())
