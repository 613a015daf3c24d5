"""What a CPU run pays that its profile must price (``make bench-cpu-costs``): the two costs that made ``make demo``
run slower than predicted, each against what it was before the fix, in the same run.

1. **Sharded attention.** A CP rank of a sequence zigzag-sharded over 2 runs two query chunks of ``S/4`` tokens
   against their causal prefix (chunks 0 and 3 on rank 0, 1 and 2 on rank 1). Timed per rank (forward and
   backward of one layer of tiny Qwen2's attention: 4 query heads, 2 K/V heads, head dim 16, float32, one thread):
   one SDPA call per chunk with a boolean bottom-right mask, and two flash calls merged by log-sum-exp
   (``dacp.kernels._BottomRightCausalCPU``). The trainer runs the masked call below
   ``dacp.kernels.CPU_SPLIT_MIN_QUERIES`` queries a chunk and the two calls from there (the masked call alone
   before 2 December 2026). Each against half the whole sequence's causal attention, what the performance model
   prices a rank at (efficiency 1).
2. **Collective latency on gloo.** Two processes, one thread each, an all-gather and a reduce-scatter of 4 KiB
   (a small sequence's K/V in one layer), launched and waited as DACP attention does, back to back: the median
   (what the profiler priced before) and the mean (what a step pays, and what it prices now).

Each time is the median of ``--repeats`` runs (the collectives: the median and the mean of ``--collective-runs``).
"""

from __future__ import annotations

import argparse
import functools
import multiprocessing
import statistics
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from trainer_client.dacp.kernels import _BottomRightCausalCPU
from trainer_client.distributed import spawn_ranks
from trainer_client.distributed.torch_compat import torch_apis
from trainer_client.profiler.measure import timed_runs

__all__ = ["main"]

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16  # tiny Qwen2's attention
SEQUENCE_LENGTHS = (256, 512, 1024, 2048, 4096)
COLLECTIVE_BYTES = 4096


def _median_ms(fn: Callable[[], object], repeats: int) -> float:
    return statistics.median(timed_runs(fn, device=torch.device("cpu"), warmup=1, repeats=repeats)) * 1e3


def _attention_ms(num_q: int, num_k: int, kernel: str, repeats: int) -> float:
    """Forward and backward of one chunk of ``num_q`` queries against ``num_k`` keys, causal aligned bottom-right."""
    generator = torch.Generator().manual_seed(num_q + num_k)
    q = torch.randn(1, HEADS, num_q, HEAD_DIM, generator=generator).requires_grad_()
    k = torch.randn(1, KV_HEADS, num_k, HEAD_DIM, generator=generator).requires_grad_()
    v = torch.randn(1, KV_HEADS, num_k, HEAD_DIM, generator=generator).requires_grad_()

    def run() -> None:
        if kernel == "whole":
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        elif kernel == "masked":
            mask = torch.ones(num_q, num_k, dtype=torch.bool).tril(diagonal=num_k - num_q)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        else:
            out = _BottomRightCausalCPU.apply(q, k, v, None)
        out.sum().backward()

    return _median_ms(run, repeats)


def attention_table(repeats: int) -> list[str]:
    rows = ["| tokens | whole ÷ 2, ms | masked call: slowest rank, ms (÷ whole/2) | two flash calls: slowest rank, ms "
            "(÷ whole/2) |", "|---|---|---|---|"]
    for length in SEQUENCE_LENGTHS:
        chunk = length // 4
        half_whole = _attention_ms(length, length, "whole", repeats) / 2
        per_kernel = []
        for kernel in ("masked", "split"):
            ranks = [_attention_ms(chunk, chunk, "whole", repeats) + _attention_ms(chunk, length, kernel, repeats),
                     _attention_ms(chunk, 2 * chunk, kernel, repeats) + _attention_ms(chunk, 3 * chunk, kernel,
                                                                                       repeats)]
            per_kernel.append(max(ranks))
        rows.append(f"| {length:,} | {half_whole:.1f} | " + " | ".join(
            f"{ms:.1f} ({ms / half_whole:.2f}x)" for ms in per_kernel) + " |")
    return rows


def _launch_and_wait(launch: Callable[[], Any]) -> None:
    launch().wait()


def _collectives(runs: int, out: list[str]) -> None:
    torch.set_num_threads(1)
    full, shard = torch.ones(COLLECTIVE_BYTES // 4), torch.ones(COLLECTIVE_BYTES // 8)
    launches = {
        "all-gather": lambda: torch_apis().all_gather_single(full, shard, group=None, async_op=True),
        "reduce-scatter": lambda: torch_apis().reduce_scatter_single(shard, full, group=None, async_op=True),
    }
    for name, launch in launches.items():
        times = timed_runs(functools.partial(_launch_and_wait, launch), device=torch.device("cpu"), warmup=10,
                           repeats=runs)
        median, mean = statistics.median(times) * 1e6, statistics.fmean(times) * 1e6
        if dist.get_rank() == 0:
            out.append(f"| {name} | {median:,.0f} | {mean:,.0f} | {mean / median:.2f} |")


def collective_table(runs: int) -> list[str]:
    with multiprocessing.Manager() as manager:
        rows = manager.list()
        spawn_ranks(_collectives, 2, runs, rows)
        measured = list(rows)
    return [f"| {COLLECTIVE_BYTES:,} B on gloo, 2 ranks | median µs | mean µs | mean ÷ median |", "|---|---|---|---|",
            *measured]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cpu_costs", description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7, help="timed runs of each attention call")
    parser.add_argument("--collective-runs", type=int, default=300, help="timed runs of each collective")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, one thread\n")
    print("\n".join(attention_table(args.repeats)))
    print()
    print("\n".join(collective_table(args.collective_runs)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
