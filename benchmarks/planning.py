"""Planning benchmark: simulated iteration time of every scheduler on the paper's Figure 3 settings and on
long-heavy shapes, hybrid vs binary Skrull, each scheduler's ratio to a lower bound, the gap to CP-SAT on
small batches, how often each Skrull plans the proven optimum of tiny batches, and planning latency.

Run ``python -m benchmarks.planning`` (``--full`` for more batches). Lengths come from the Table-1-shaped
samplers (an approximation of the real data sets) and are capped at ``bucket_size × cp_size``, as a
trainer truncates what cannot fit. Times are the performance model's estimates under the shipped
``h100-paper`` profile, not measurements; speedups are ratios measured in the same run.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from scheduler_service.core import gds
from scheduler_service.core.plan import Plan, PlanningProblem, make_problem
from scheduler_service.core.planner import HEURISTIC_SCHEDULERS
from scheduler_service.core.samplers import sample_lengths
from scheduler_service.core.simulate import iteration_lower_bound_s, simulate

PAPER_SPEEDUP = {"qwen2.5-0.5b": 5.50, "qwen2.5-7b": 2.03}  # Skrull paper, section 5.2: mean over DeepSpeed


@dataclass(frozen=True)
class Case:
    dataset: str
    model: str
    bucket_size: int
    dp_size: int
    cp_size: int
    batch_size: int  # per DP rank, as in the paper's <DP, CP, BatchSize>

    @property
    def label(self) -> str:
        return f"{self.model} {self.dataset} <DP={self.dp_size},CP={self.cp_size},BS={self.batch_size}>"


FIGURE_3 = [
    Case(dataset, "qwen2.5-0.5b", 26_000, 4, 8, 64) for dataset in ("wikipedia", "lmsys", "chatqa2")
] + [
    Case("wikipedia", "qwen2.5-7b", 13_000, 4, 8, 64),
    Case("lmsys", "qwen2.5-7b", 13_000, 4, 8, 64),
    Case("chatqa2", "qwen2.5-7b", 13_000, 2, 16, 40),
]

LONG_HEAVY = [
    Case("chatqa2", "qwen2.5-7b", 13_000, 4, 8, 64),
    Case("longtail64k", "qwen2.5-0.5b", 26_000, 4, 8, 32),
    Case("longtail64k", "qwen2.5-7b", 13_000, 4, 8, 32),
    Case("docmix", "qwen2.5-0.5b", 26_000, 4, 8, 64),
    Case("docmix", "qwen2.5-7b", 13_000, 2, 16, 40),
]

VARIANTS: dict[str, Callable[[PlanningProblem], Plan]] = {
    **{name.value: scheduler for name, scheduler in HEURISTIC_SCHEDULERS.items()},
    "dacp_only": gds.dacp_only,
    "gds_only": gds.gds_only,
}


def sample_problem(case: Case, rng: np.random.Generator, num_sequences: int | None = None) -> PlanningProblem:
    count = num_sequences or case.dp_size * case.batch_size
    lengths = sample_lengths(case.dataset, count, rng, max_length=case.bucket_size * case.cp_size)
    return make_problem(sequence_lengths=lengths.tolist(), dp_size=case.dp_size, cp_size=case.cp_size,
                        model=case.model, bucket_size=case.bucket_size)


def cp_imbalance(problem: PlanningProblem, plan: Plan) -> tuple[float, float]:
    """Mean over micro-batches of (slowest CP rank / mean CP rank) in time and in tokens."""
    time_ratios, token_ratios = [], []
    for dp_rank in simulate(problem, plan).dp_ranks:
        for mb in dp_rank.micro_batches:
            times = [rank.time_s for rank in mb.cp_ranks]
            tokens = [rank.tokens for rank in mb.cp_ranks]
            time_ratios.append(max(times) / statistics.fmean(times))
            token_ratios.append(max(tokens) / statistics.fmean(tokens))
    return statistics.fmean(time_ratios), statistics.fmean(token_ratios)


def speedup_table(title: str, cases: list[Case], names: list[str], num_batches: int, seed: int) -> None:
    print(f"\n## {title}: simulated speedup over deepspeed (mean over {num_batches} sampled global batches)\n")
    print(f"| case | {' | '.join(names)} | paper (Skrull) | hybrid / binary |")
    print(f"|---|{'---|' * len(names)}---|---|")
    overall: dict[str, list[float]] = {name: [] for name in names}
    to_bound: dict[str, list[float]] = {name: [] for name in names}
    imbalance: dict[str, list[tuple[float, float]]] = {"skrull": [], "skrull_binary": [], "skrull_paper": []}
    for case in cases:
        rng = np.random.default_rng(seed)
        speedups: dict[str, list[float]] = {name: [] for name in names}
        for _ in range(num_batches):
            problem = sample_problem(case, rng)
            baseline_s = simulate(problem, VARIANTS["deepspeed"](problem)).iteration_time_s
            lower_bound_s = iteration_lower_bound_s(problem)
            for name in names:
                plan = VARIANTS[name](problem)
                time_s = simulate(problem, plan).iteration_time_s
                speedups[name].append(baseline_s / time_s)
                to_bound[name].append(time_s / lower_bound_s)
                if name in imbalance:
                    imbalance[name].append(cp_imbalance(problem, plan))
        means = {name: statistics.fmean(values) for name, values in speedups.items()}
        for name in names:
            overall[name].extend(speedups[name])
        ratio = statistics.fmean(a / b for a, b in zip(speedups["skrull"], speedups["skrull_binary"], strict=True))
        cells = " | ".join(f"{means[name]:.2f}x" for name in names)
        paper = f"{PAPER_SPEEDUP[case.model]:.2f}x (model mean)" if case in FIGURE_3 else "–"
        print(f"| {case.label} | {cells} | {paper} | {ratio:.2f}x |")
    cells = " | ".join(f"{statistics.fmean(overall[name]):.2f}x" for name in names)
    print(f"| **mean of all cases** | {cells} | {'3.76x' if cases is FIGURE_3 else '–'} | |")
    print("\nRatio to the lower bound (iteration_lower_bound_s: every sequence at its cheapest placement, work spread "
          "evenly over all ranks; 1.00 would be perfect), mean over all batches:")
    print("  " + "   ".join(f"{name} {statistics.fmean(to_bound[name]):.3f}" for name in names))
    print("CP balance inside micro-batches (mean of slowest/mean CP rank; 1.00 is perfect):")
    for name, values in imbalance.items():
        print(f"  {name:<13} time {statistics.fmean(v[0] for v in values):.3f}   "
              f"tokens {statistics.fmean(v[1] for v in values):.3f}")


def cpsat_gap(num_batches: int, seed: int, time_limit_s: float) -> None:
    try:
        from scheduler_service.core import cpsat
    except ImportError as error:  # ortools missing: the service extra is not installed
        print(f"\n(CP-SAT comparison skipped: {error})")
        return
    print(f"\n## skrull vs CP-SAT on small batches (12 sequences, time limit {time_limit_s:.0f} s)\n")
    print("CP-SAT searches each space exactly: the hybrid one (whole, sharded over an aligned block of CP ranks, or "
          "over the whole group) warm-started from skrull, and the binary one (whole, or over the whole group) "
          "warm-started from skrull_binary. A gap to the bound is at most what a better plan could gain.\n")
    print("| case | skrull ms | hybrid cpsat best ms | bound ms | status | skrull vs best | skrull vs bound "
          "| skrull_binary ms | binary cpsat best ms | bound ms | status | skrull_binary vs best |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for case in (Case("lmsys", "qwen2.5-0.5b", 26_000, 2, 4, 6), Case("chatqa2", "qwen2.5-0.5b", 26_000, 2, 4, 6)):
        rng = np.random.default_rng(seed)
        for batch in range(num_batches):
            problem = sample_problem(case, rng, num_sequences=12)
            cells = []
            for plan, hybrid in ((gds.skrull(problem), True), (gds.skrull_binary(problem), False)):
                heuristic_s = simulate(problem, plan).iteration_time_s
                solution = cpsat.solve(problem, time_limit_s=time_limit_s, hint=plan, hybrid=hybrid)
                best_s = simulate(problem, solution.plan).iteration_time_s
                bound_s = solution.report.bound_s or 0.0
                cells += [f"{heuristic_s * 1e3:.1f}", f"{best_s * 1e3:.1f}", f"{bound_s * 1e3:.1f}",
                          solution.report.status, f"{heuristic_s / best_s - 1:+.1%}"]
                if hybrid:
                    cells.append(f"{heuristic_s / bound_s - 1:+.1%}" if bound_s else "-")
            print(f"| {case.dataset} #{batch} DP=2 CP=4 | {' | '.join(cells)} |")


def tiny_batch_optimality(num_batches: int, seed: int) -> None:
    """How often each Skrull plans the proven optimum of its space, on batches small enough for CP-SAT to prove it:
    3–6 sequences of log-normal lengths around the bucket size, DP 1–2, CP 4 or 8, 0.5B or 7B."""
    try:
        from scheduler_service.core import cpsat
    except ImportError as error:  # ortools missing: the service extra is not installed
        print(f"\n(tiny-batch optimality skipped: {error})")
        return
    rng = np.random.default_rng(seed)
    found: dict[str, list[float]] = {"skrull": [], "skrull_binary": []}
    unproven = 0
    for _ in range(num_batches):
        cp_size, bucket_size = int(rng.choice([4, 8])), int(rng.choice([2048, 4096, 8192]))
        lengths = np.exp(rng.normal(np.log(1.2 * bucket_size), 1.0, int(rng.integers(3, 7)))) + 50
        problem = make_problem(sequence_lengths=np.minimum(lengths, bucket_size * cp_size).astype(int).tolist(),
                               dp_size=int(rng.integers(1, 3)), cp_size=cp_size,
                               model=str(rng.choice(["qwen2.5-0.5b", "qwen2.5-7b"])), bucket_size=bucket_size)
        for name, hybrid in (("skrull", True), ("skrull_binary", False)):
            plan = VARIANTS[name](problem)
            solution = cpsat.solve(problem, time_limit_s=20.0, hint=plan, hybrid=hybrid)
            unproven += solution.report.status != "OPTIMAL"
            optimum_s = simulate(problem, solution.plan).iteration_time_s
            found[name].append(simulate(problem, plan).iteration_time_s / optimum_s - 1)
    print(f"\n## Tiny batches: each Skrull against the proven optimum of its space ({num_batches} batches)\n")
    print(f"Random 3–6-sequence batches, DP 1–2, CP 4 or 8 (CP-SAT left {unproven} of {2 * num_batches} unproven).\n")
    print("| scheduler | space | optimal | mean gap | 90th percentile gap | worst gap |")
    print("|---|---|---|---|---|---|")
    for name, space in (("skrull", "hybrid"), ("skrull_binary", "binary")):
        gaps = np.array(found[name])
        print(f"| {name} | {space} | {int((gaps < 1e-6).sum())} of {gaps.size} | {gaps.mean():+.2%} | "
              f"{np.percentile(gaps, 90):+.2%} | {gaps.max():+.2%} |")


def latency_table(seed: int, repeats: int) -> None:
    print(f"\n## Planning latency (DP=4, CP=8, qwen2.5-0.5b, bucket 26K; {repeats} calls each)\n")
    print("Wall-clock percentiles, and the median of the process's CPU time (what a shared machine cannot "
          "inflate).\n")
    print("| sequences | dataset | skrull p50 ms | skrull p99 ms | skrull CPU p50 ms "
          "| skrull_binary p50 ms | skrull_binary p99 ms | skrull_binary CPU p50 ms |")
    print("|---|---|---|---|---|---|---|---|")
    for num_sequences in (64, 256, 1024, 4096):
        for dataset in ("lmsys", "chatqa2"):
            case = Case(dataset, "qwen2.5-0.5b", 26_000, 4, 8, num_sequences // 4)
            rng = np.random.default_rng(seed)
            problems = [sample_problem(case, rng) for _ in range(8)]
            calls = repeats if num_sequences <= 256 else max(repeats // 20, 5)
            cells = []
            for scheduler in (gds.skrull, gds.skrull_binary):
                wall, cpu = [], []
                for call in range(calls):
                    started, started_cpu = time.perf_counter(), time.process_time()
                    scheduler(problems[call % len(problems)])
                    wall.append(time.perf_counter() - started)
                    cpu.append(time.process_time() - started_cpu)
                p50, p99 = np.percentile(wall, [50, 99]) * 1e3
                cells += [f"{p50:.2f}", f"{p99:.2f}", f"{np.median(cpu) * 1e3:.2f}"]
            print(f"| {num_sequences} | {dataset} | {' | '.join(cells)} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="more batches and calls (slower)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    num_batches = 20 if args.full else 5
    names = ["skrull", "skrull_binary", "skrull_paper", "round_robin", "balanced", "sorted", "dacp_only",
             "gds_only"]
    speedup_table("Figure 3 cases", FIGURE_3, names, num_batches, args.seed)
    speedup_table("Long-heavy shapes", LONG_HEAVY, ["skrull", "skrull_binary", "skrull_paper", "balanced"],
                  num_batches, args.seed)
    cpsat_gap(3 if args.full else 2, args.seed, time_limit_s=20.0 if args.full else 5.0)
    tiny_batch_optimality(120 if args.full else 40, args.seed)
    latency_table(args.seed, repeats=400 if args.full else 100)


if __name__ == "__main__":
    main()
