"""Planning benchmark: simulated iteration time of every scheduler on the paper's Figure 3 settings and on
long-heavy shapes, hybrid vs binary Skrull, each scheduler's ratio to a lower bound, the gap to CP-SAT on
small batches, how often each Skrull plans the proven optimum of tiny batches, what larger search budgets gain,
how many micro-batches GDS cuts, planning latency, Skrull against its peers: Megatron-Core's dynamic CP (its
own schedule, priced as Megatron runs it) and the Hugging Face Trainer's length-aware samplers, and what choosing each
collective's scheme (all-gather-KV, Ulysses or 2D) gains, against the static Ulysses and 2D (USP) of the seed systems.

Run ``python -m benchmarks.planning`` (``--full`` for more batches, ``--batches N`` for N, ``--tables`` for some of
the tables). Lengths come from the Table-1-shaped samplers (an approximation of the real data sets) and are capped at
``bucket_size × cp_size``, as a trainer truncates what cannot fit. Times are the performance model's estimates under
a shipped profile (``--profile``, default the planner's default ``h100-eager``: an H100 running this project's eager
trainer, its compute measured; ``h100-paper`` is the paper's setting, an optimised engine's assumed compute), not
measurements; speedups are ratios measured in the same run.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from scheduler_service.core import baselines, gds
from scheduler_service.core.choices import CollectiveScheme
from scheduler_service.core.dynamic_cp import dynamic_cp, megatron_estimate
from scheduler_service.core.errors import BaselineCannotPlanError
from scheduler_service.core.gds_search import min_micro_batches
from scheduler_service.core.plan import Collective, Plan, PlanningProblem, make_problem
from scheduler_service.core.plan_refine import DEFAULT_BUDGET
from scheduler_service.core.planner import HEURISTIC_SCHEDULERS, PlanResult, make_plan, warm_up
from scheduler_service.core.profile import DEFAULT_PROFILE, builtin_profiles
from scheduler_service.core.samplers import sample_lengths
from scheduler_service.core.schemes import choose_schemes
from scheduler_service.core.simulate import MicroBatchEstimate, iteration_lower_bound_s, simulate, spanning_ready_s
from scheduler_service.core.static_sp import ulysses, usp

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
    "skrull_in_groups": gds.skrull,  # Skrull before spanning micro-batches: every sequence within one CP group
    "dacp_only": gds.dacp_only,
    "gds_only": gds.gds_only,
}


def sample_problem(case: Case, rng: np.random.Generator, profile: str,
                   num_sequences: int | None = None) -> PlanningProblem:
    count = num_sequences or case.dp_size * case.batch_size
    lengths = sample_lengths(case.dataset, count, rng, max_length=case.bucket_size * case.cp_size)
    return make_problem(sequence_lengths=lengths.tolist(), dp_size=case.dp_size, cp_size=case.cp_size,
                        model=case.model, bucket_size=case.bucket_size, profile=profile)


def cp_imbalance(problem: PlanningProblem, plan: Plan) -> tuple[float, float]:
    """Mean over micro-batches (spanning ones over their blocks' ranks) of (slowest rank / mean rank) in time and in
    tokens."""
    time_ratios, token_ratios = [], []
    estimate = simulate(problem, plan)
    for mb in [*estimate.spanning, *(mb for dp_rank in estimate.dp_ranks for mb in dp_rank.micro_batches)]:
        times = [rank.time_s for rank in mb.cp_ranks]
        tokens = [rank.tokens for rank in mb.cp_ranks]
        time_ratios.append(max(times) / statistics.fmean(times))
        token_ratios.append(max(tokens) / statistics.fmean(tokens))
    return statistics.fmean(time_ratios), statistics.fmean(token_ratios)


def speedup_table(title: str, cases: list[Case], names: list[str], num_batches: int, seed: int,
                  profile: str) -> None:
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
            problem = sample_problem(case, rng, profile)
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


def geomean(values: list[float]) -> float:
    return float(np.exp(np.mean(np.log(values))))


def spanning_table(cases: list[Case], num_batches: int, seed: int, profile: str) -> None:
    """Skrull with spanning micro-batches against Skrull within CP groups, on the same batches (lengths capped at
    one CP group, as elsewhere here)."""
    print(f"\n## Beyond one CP group: simulated iteration time ratios (geometric mean over {num_batches} batches; "
          "above 1: skrull is faster)\n")
    print("| case | skrull_in_groups / skrull | worst | batches spanned |")
    print("|---|---|---|---|")
    for case in cases:
        rng = np.random.default_rng(seed)
        in_groups, spanned = [], 0
        for _ in range(num_batches):
            problem = sample_problem(case, rng, profile)
            skrull_plan = VARIANTS["skrull"](problem)
            spanned += bool(skrull_plan.spanning)
            in_groups.append(simulate(problem, VARIANTS["skrull_in_groups"](problem)).iteration_time_s
                             / simulate(problem, skrull_plan).iteration_time_s)
        print(f"| {case.label} | {geomean(in_groups):.3f}x | {min(in_groups):.3f}x | {spanned}/{num_batches} |")


@dataclass
class PeerRatios:
    """One peer's iteration time over Skrull's on each batch it could plan, and the refusals it named."""

    ratios: list[float]
    refusals: list[str]

    def cells(self, num_batches: int) -> str:
        if not self.ratios:
            return f"– | – | – | {len(self.refusals)}/{num_batches} |"
        faster = sum(ratio < 1 for ratio in self.ratios)
        return (f"{geomean(self.ratios):.3f}x | {min(self.ratios):.3f}x | {faster} | "
                f"{len(self.refusals)}/{num_batches} |")


def _peer_ratio(peer: PeerRatios, problem: PlanningProblem, time_of: Callable[[PlanningProblem], float],
                skrull_s: float) -> None:
    try:
        peer.ratios.append(time_of(problem) / skrull_s)
    except BaselineCannotPlanError as error:
        peer.refusals.append(error.reason)


def peers_table(cases: list[Case], num_batches: int, seed: int, profile: str, *, uncapped: bool = False) -> None:
    """Skrull against the peers on the same batches, each peer as its own system runs it: Megatron's dynamic CP
    priced as Megatron runs its plan (``megatron_estimate``; beside it, the same plan as this project's trainer
    runs it), the HF Trainer's samplers by the simulator. ``uncapped``: lengths up to the world's capacity."""
    def simulated(scheduler: Callable[[PlanningProblem], Plan]) -> Callable[[PlanningProblem], float]:
        return lambda problem: simulate(problem, scheduler(problem)).iteration_time_s

    peers: dict[str, Callable[[PlanningProblem], float]] = {
        "dynamic_cp as Megatron runs it":
            lambda problem: megatron_estimate(problem, dynamic_cp(problem)).iteration_time_s,
        "dynamic_cp's plan run by Skrull's trainer": simulated(dynamic_cp),
        "group_by_length": simulated(baselines.group_by_length),
        "batch_rebalance": simulated(baselines.batch_rebalance),
    }
    scope = "lengths up to the world's capacity" if uncapped else "lengths capped at one CP group"
    print(f"\n## Against the peers ({scope}): peer / skrull simulated iteration time, geometric mean over the "
          f"{num_batches} batches each peer plans, its best batch against skrull (below 1: the peer is faster), how "
          f"many batches it plans faster, and how many it refuses\n")
    print("| case | " + " | ".join(f"{name} | best | faster | refused" for name in peers) + " |")
    print("|---|" + "---|---|---|---|" * len(peers))
    reasons: dict[str, str] = {}
    for case in cases:
        rng = np.random.default_rng(seed + uncapped)
        found = {name: PeerRatios([], []) for name in peers}
        for _ in range(num_batches):
            if uncapped:
                lengths = sample_lengths(case.dataset, case.dp_size * case.batch_size, rng,
                                         max_length=case.bucket_size * case.cp_size * case.dp_size)
                problem = make_problem(sequence_lengths=lengths.tolist(), dp_size=case.dp_size, cp_size=case.cp_size,
                                       model=case.model, bucket_size=case.bucket_size, profile=profile)
            else:
                problem = sample_problem(case, rng, profile)
            skrull_s = simulate(problem, VARIANTS["skrull"](problem)).iteration_time_s
            for name, time_of in peers.items():
                _peer_ratio(found[name], problem, time_of, skrull_s)
        print(f"| {case.label} | " + " ".join(found[name].cells(num_batches) for name in peers))
        for name, peer in found.items():
            if peer.refusals:
                reasons.setdefault(f"{name} on {case.label}", peer.refusals[0])
    for where, reason in reasons.items():
        print(f"- {where} refuses, e.g.: {reason}")


# The shipped profiles with all_to_all tables, the ones that can price Ulysses and 2D: the schemes table runs under
# each of them (the run's --profile first), since the choice depends on the all-to-all as much as on the compute.
SCHEME_PROFILES = ("h100-eager", "h100-paper")

# Megatron "ties" Skrull where its time is within this share of Skrull's: below it the model cannot tell them apart.
TIE = 1e-3


def plan_collectives(plan: Plan) -> list[Collective]:
    """Every collective of a plan, the spanning micro-batches' and each DP rank's."""
    micro_batches = [*(spanning.micro_batch for spanning in plan.spanning),
                     *(micro_batch for dp_plan in plan.dp_ranks for micro_batch in dp_plan.micro_batches)]
    return [collective for micro_batch in micro_batches for collective in micro_batch.collectives()]


@dataclass
class SchemeCase:
    """One case's batches in the schemes table: Skrull without the choice over Skrull with it, the schemes its
    collectives got, and each static or dynamic peer against Skrull with the choice (and Megatron against Skrull
    without it, the comparison before the choice)."""

    without: list[float]
    collectives: dict[CollectiveScheme, int]
    peers: dict[str, PeerRatios]
    megatron_before: list[float]
    # Per batch Megatron beats: (Megatron as it runs, its plan run by Skrull's trainer with the choice, Skrull's
    # plan with every transfer hidden), each over Skrull with the choice: what its ring overlap and what its groups
    # win, apart, and the most any overlap could give Skrull's own plan.
    megatron_wins: list[tuple[float, float, float]] = field(default_factory=list)
    degrees: tuple[int, ...] = ()  # the Ulysses degrees above 1 a collective over the whole CP group may have


def _megatron_plan_in_skrull_s(problem: PlanningProblem, megatron_plan: Plan) -> float:
    """Megatron's plan (its groups and rounds) run by Skrull's trainer, each collective's scheme chosen as Skrull
    chooses its own: what Megatron's groups are worth without its ring overlap."""
    chosen, _ = choose_schemes(problem, megatron_plan)
    return simulate(problem, chosen).iteration_time_s


def _all_hidden_s(result: PlanResult) -> float:
    """The iteration time of a planned batch were every transfer hidden: each micro-batch as long as its slowest rank
    without its exposed communication (at least the launch-bound floor where the rank has work), what a scheme that
    overlapped all of it (a ring's, ideally) would leave."""
    floor_s = result.problem.perf.compute_floor_s

    def hidden_s(micro_batch: MicroBatchEstimate) -> float:
        return max(max(floor_s if rank.time_s > 0 else 0.0, rank.time_s - rank.launch_bound_s - rank.exposed_comm_s)
                   for rank in micro_batch.cp_ranks)

    estimate = result.estimate
    ready_s = spanning_ready_s(result.plan.spanning, [hidden_s(mb) for mb in estimate.spanning],
                               result.problem.dp_size)
    return max(ready_s[dp] + sum(map(hidden_s, rank.micro_batches)) for dp, rank in enumerate(estimate.dp_ranks))


def _scheme_case(case: Case, num_batches: int, seed: int, profile: str) -> SchemeCase:
    rng = np.random.default_rng(seed)
    found = SchemeCase([], dict.fromkeys(CollectiveScheme, 0),
                       {name: PeerRatios([], []) for name in ("ulysses", "usp", "megatron")}, [])
    static: dict[str, Callable[[PlanningProblem], float]] = {
        "ulysses": lambda problem: simulate(problem, ulysses(problem)).iteration_time_s,
        "usp": lambda problem: simulate(problem, usp(problem)).iteration_time_s,
    }
    for _ in range(num_batches):
        problem = sample_problem(case, rng, profile)
        found.degrees = problem.perf.ulysses_degrees(case.cp_size)
        chosen = make_plan(problem, "skrull")  # the whole planner, the choice included, as a service plans
        skrull_s = chosen.estimate.iteration_time_s
        without_s = make_plan(problem, "skrull", schemes=False).estimate.iteration_time_s
        found.without.append(without_s / skrull_s)
        for collective in plan_collectives(chosen.plan):
            found.collectives[CollectiveScheme.of(collective.degree, collective.ulysses_degree)] += 1
        for name, time_of in static.items():
            _peer_ratio(found.peers[name], problem, time_of, skrull_s)
        try:
            megatron_plan = dynamic_cp(problem)
        except BaselineCannotPlanError as error:
            found.peers["megatron"].refusals.append(error.reason)
        else:
            megatron_s = megatron_estimate(problem, megatron_plan).iteration_time_s
            found.peers["megatron"].ratios.append(megatron_s / skrull_s)
            found.megatron_before.append(megatron_s / without_s)
            if megatron_s < skrull_s:
                in_skrull_s = _megatron_plan_in_skrull_s(problem, megatron_plan)
                found.megatron_wins.append((megatron_s / skrull_s, in_skrull_s / skrull_s,
                                            _all_hidden_s(chosen) / skrull_s))
    return found


def _ties_or_beats(ratios: list[float]) -> str:
    if not ratios:
        return "– | – | –"
    beats = sum(ratio < 1 for ratio in ratios)
    ties = sum(1 <= ratio <= 1 + TIE for ratio in ratios)
    return f"{beats} + {ties} | {min(ratios):.3f}x | {geomean(ratios):.3f}x"


def schemes_table(cases: list[Case], num_batches: int, seed: int, profile: str) -> None:
    """What choosing each collective's scheme gains Skrull (``make_plan``'s ``schemes``), which schemes it chooses,
    and Skrull with the choice against the seed systems' static Ulysses (XTuner, SWIFT) and 2D (USP) and against
    Megatron's dynamic CP as Megatron runs it. A peer that cannot plan a batch is counted and its reason named."""
    print(f"\n## Collective schemes under {profile}: skrull without the choice (all-gather-KV only) / skrull with it, "
          f"the share of its collectives given Ulysses and 2D, and each peer / skrull with the choice (geometric mean "
          f"over the {num_batches} batches each plans, its best batch: below 1 the peer is faster, how many it plans "
          f"faster, how many it refuses). u > 1 allowed: the Ulysses degrees the model's heads split evenly over "
          f"and the profile's all-to-all prices, for a collective over the whole CP group (smaller blocks: their "
          f"divisors)\n")
    print("| case | u > 1 allowed | without / with | best | batches faster | collectives per batch | Ulysses | 2D | "
          "ulysses | best | faster | refused | usp | best | faster | refused | dynamic_cp as Megatron runs it | best | "
          "faster | refused |")
    print("|---|---|---|---|---|---|---|---|" + "---|---|---|---|" * 3)
    results: dict[Case, SchemeCase] = {}
    refusals: dict[str, dict[str, int]] = {}
    for case in cases:
        found = results[case] = _scheme_case(case, num_batches, seed, profile)
        total = sum(found.collectives.values())
        shares = " | ".join(f"{found.collectives[scheme] / total:.1%}" if total else "–"
                            for scheme in (CollectiveScheme.ULYSSES, CollectiveScheme.TWO_D))
        faster = sum(ratio > 1 + 1e-9 for ratio in found.without)
        print(f"| {case.label} | {', '.join(map(str, found.degrees)) or 'none'} | {geomean(found.without):.3f}x | "
              f"{max(found.without):.3f}x | {faster} | {total / num_batches:.1f} | {shares} | "
              + " ".join(peer.cells(num_batches) for peer in found.peers.values()))
        for name, peer in found.peers.items():
            for reason in peer.refusals:
                counts = refusals.setdefault(name, {})
                counts[reason] = counts.get(reason, 0) + 1
    for name, counts in refusals.items():
        for reason, count in counts.items():
            print(f"- {name} refused {count}: {reason}")
    heavy_7b = [case for case in cases if case in LONG_HEAVY and case.model == "qwen2.5-7b"
                and (case.dp_size, case.cp_size) == (4, 8)]
    if not heavy_7b:
        return
    print(f"\nMegatron's dynamic CP against skrull on the 7B long-heavy cases at DP 4 × CP 8, before the choice "
          f"(skrull all-gather-KV only) and after: batches Megatron beats (below 1) + ties (within {TIE:.1%}), of "
          f"{num_batches}, and its best ratio (the worst batch for skrull)\n")
    print("| case | before: beats + ties | best ratio | geometric mean | after: beats + ties | best ratio | "
          "geometric mean |")
    print("|---|---|---|---|---|---|---|")
    for case in heavy_7b:
        before, after = results[case].megatron_before, results[case].peers["megatron"].ratios
        print(f"| {case.label} | {_ties_or_beats(before)} | {_ties_or_beats(after)} |")
    print("\nWhy Megatron still wins those batches, its two effects apart: its plan run by Skrull's trainer (its "
          "groups and rounds, each collective's scheme chosen as Skrull chooses its own, no ring overlap) over "
          "skrull, and Megatron as it runs over that (what its ring overlap, a sharded sequence's transfer hidden "
          "behind its own attention, wins); and skrull's plan were every transfer hidden (the most any overlap, a "
          "ring's ideally, could give it), with the batches where that is at least Megatron's equal\n")
    print("| case | batches Megatron beats | its plan in Skrull's trainer / skrull: median | faster than skrull's | "
          "ring overlap: median | Megatron as it runs / skrull: median | skrull, all hidden / skrull: median | "
          "at least Megatron's equal |")
    print("|---|---|---|---|---|---|---|---|")
    for case in heavy_7b:
        wins = results[case].megatron_wins
        if not wins:
            print(f"| {case.label} | 0 | – | – | – | – | – | – |")
            continue
        as_run, in_skrull, all_hidden = zip(*wins, strict=True)
        print(f"| {case.label} | {len(wins)} | {statistics.median(in_skrull):.3f}x | "
              f"{sum(ratio < 1 for ratio in in_skrull)} | "
              f"{statistics.median(run / plan for run, plan, _ in wins):.3f}x | {statistics.median(as_run):.3f}x | "
              f"{statistics.median(all_hidden):.3f}x | {sum(hidden <= run for run, _, hidden in wins)} |")


def cpsat_gap(num_batches: int, seed: int, time_limit_s: float, profile: str) -> None:
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
            problem = sample_problem(case, rng, profile, num_sequences=12)
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


def tiny_batch_optimality(num_batches: int, seed: int, profile: str) -> None:
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
                               model=str(rng.choice(["qwen2.5-0.5b", "qwen2.5-7b"])), bucket_size=bucket_size,
                               profile=profile)
        for name, hybrid in (("skrull", True), ("skrull_binary", False)):
            # CP-SAT's space is plans within CP groups: Skrull's there, without spanning micro-batches
            plan = VARIANTS["skrull_in_groups" if hybrid else name](problem)
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


def budget_table(cases: list[Case], num_batches: int, seed: int, budgets: tuple[int, ...], profile: str) -> None:
    """What a larger search budget gains: the iterated local search after the refinement stops improving."""
    print(f"\n## Search budget: skrull's ratio to the lower bound (mean over {num_batches} batches) and its median "
          "planning time\n")
    print(f"The default budget is {DEFAULT_BUDGET} units on batches of up to about 300 sequences and micro-batches "
          "(less on larger ones); a larger budget never plans worse.\n")
    print(f"| case | default | {' | '.join(str(budget) for budget in budgets)} |")
    print(f"|---|---|{'---|' * len(budgets)}")
    for case in cases:
        rng = np.random.default_rng(seed)
        ratios: dict[int | None, list[float]] = {budget: [] for budget in (None, *budgets)}
        times_s: dict[int | None, list[float]] = {budget: [] for budget in (None, *budgets)}
        for _ in range(num_batches):
            problem = sample_problem(case, rng, profile)
            lower_bound_s = iteration_lower_bound_s(problem)
            for budget in ratios:
                started = time.process_time()
                plan = gds.skrull(problem, budget=budget)
                times_s[budget].append(time.process_time() - started)
                ratios[budget].append(simulate(problem, plan).iteration_time_s / lower_bound_s)
        cells = [f"{statistics.fmean(ratios[budget]):.4f} ({statistics.median(times_s[budget]) * 1e3:.1f} ms)"
                 for budget in ratios]
        print(f"| {case.label} | {' | '.join(cells)} |")


def micro_batch_counts(cases: list[Case], num_batches: int, seed: int, profile: str) -> None:
    """How many micro-batches GDS cuts each DP rank's share into, against the fewest its tokens allow."""
    print(f"\n## Micro-batches per DP rank: skrull's against the memory minimum ({num_batches} batches)\n")
    print("The memory minimum of a share: its tokens over C·N, and one micro-batch per sequence over half of that. "
          "GDS takes the fewest whose longest-first spread fits, or one more where that is cheaper.\n")
    print("| case | skrull, mean | memory minimum, mean | shares at the minimum |")
    print("|---|---|---|---|")
    for case in cases:
        rng = np.random.default_rng(seed)
        counts, minima = [], []
        for _ in range(num_batches):
            problem = sample_problem(case, rng, profile)
            for dp_rank in gds.skrull(problem).dp_ranks:
                indices = [index for micro_batch in dp_rank.micro_batches for index in micro_batch.indices()]
                counts.append(len(dp_rank.micro_batches))
                minima.append(min_micro_batches(problem.lengths[np.asarray(indices, dtype=np.int64)],
                                                problem.micro_batch_capacity))
        at_minimum = np.mean(np.array(counts) == np.array(minima))
        print(f"| {case.label} | {statistics.fmean(counts):.2f} | {statistics.fmean(minima):.2f} | "
              f"{at_minimum:.0%} |")


@dataclass(frozen=True)
class Latency:
    """Percentiles over a case's batches, in ms: of the first call of each batch (wall-clock), and of each batch's
    fastest of its calls in CPU time (what the batch itself costs, whatever else the machine ran)."""

    p50_ms: float
    p99_ms: float
    own_p50_ms: float
    own_p99_ms: float


def _latencies(problems: list[PlanningProblem], variants: list[tuple[str, bool]], rounds: int) -> list[Latency]:
    """Each variant's latency: every batch planned once per round by each variant (scheduler, ``schemes``:
    ``make_plan``'s; False: no choice of collective schemes, the planner's cost before it), the variants taking
    turns batch by batch, so that a slow spell of a shared machine slows them alike."""
    first: list[list[float]] = [[] for _ in variants]
    own = np.full((len(variants), len(problems)), np.inf)
    for round_ in range(rounds):
        for index, problem in enumerate(problems):
            for variant, (scheduler, schemes) in enumerate(variants):
                started, started_cpu = time.perf_counter(), time.process_time()
                make_plan(problem, scheduler, schemes=schemes)
                if round_ == 0:
                    first[variant].append(time.perf_counter() - started)
                own[variant, index] = min(own[variant, index], time.process_time() - started_cpu)
    latencies = []
    for variant in range(len(variants)):
        p50, p99 = np.percentile(first[variant], [50, 99]) * 1e3
        own_p50, own_p99 = np.percentile(own[variant], [50, 99]) * 1e3
        latencies.append(Latency(float(p50), float(p99), float(own_p50), float(own_p99)))
    return latencies


def latency_table(seed: int, batches: int, profile: str, rounds: int = 3) -> None:
    """The whole ``make_plan`` (plan, check, choose each collective's scheme, estimate), as a service calls it, and
    beside it skrull without the choice of schemes: what the choice adds to a request."""
    print(f"\n## Planning latency (the whole make_plan: plan, check, choose the collectives' schemes, estimate; DP=4, "
          f"CP=8, qwen2.5-0.5b, bucket 26K; {batches} different batches of 256 sequences or fewer, each planned "
          f"{rounds} times by each column's planner, the planners taking turns batch by batch, after warm_up as a "
          "service after start-up)\n")
    print("Percentiles over the batches: of each batch's first call (wall-clock), and of each batch's own cost, the "
          "fastest of its calls in CPU time (what a shared machine's other work does not add to). skrull without the "
          "choice is make_plan with schemes=False (all-gather-KV only): skrull's own p50 over its own p50 is what the "
          "choice of collective schemes costs. skrull_paper is a plain-Python implementation of the paper's "
          "Algorithms 1-3: the last column is skrull's p50 over its p50 in the same run (below 1: faster than the "
          "paper's heuristic).\n")
    print("| sequences | dataset | skrull p50 ms | p99 ms | p99 / p50 | own p50 ms | own p99 ms | own p99 / p50 "
          "| skrull_binary p50 ms | p99 ms | skrull without the choice p50 ms | own p50 ms | skrull / without (own) "
          "| skrull_paper p50 ms | skrull / skrull_paper |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for num_sequences in (64, 256, 1024, 4096):
        for dataset in ("lmsys", "chatqa2"):
            case = Case(dataset, "qwen2.5-0.5b", 26_000, 4, 8, num_sequences // 4)
            rng = np.random.default_rng(seed)
            count = batches if num_sequences <= 256 else max(batches // 20, 5)
            problems = [sample_problem(case, rng, profile) for _ in range(count)]
            skrull, binary, paper, without = _latencies(problems, [("skrull", True), ("skrull_binary", True),
                                                                   ("skrull_paper", True), ("skrull", False)], rounds)
            print(f"| {num_sequences} | {dataset} | {skrull.p50_ms:.2f} | {skrull.p99_ms:.2f} | "
                  f"{skrull.p99_ms / skrull.p50_ms:.2f} | {skrull.own_p50_ms:.2f} | {skrull.own_p99_ms:.2f} | "
                  f"{skrull.own_p99_ms / skrull.own_p50_ms:.2f} | {binary.p50_ms:.2f} | {binary.p99_ms:.2f} | "
                  f"{without.p50_ms:.2f} | {without.own_p50_ms:.2f} | {skrull.own_p50_ms / without.own_p50_ms:.2f} | "
                  f"{paper.p50_ms:.2f} | "
                  f"{skrull.p50_ms / paper.p50_ms:.2f} |")


TABLES = ("speedup", "spanning", "peers", "schemes", "cpsat", "tiny", "budget", "micro-batches", "latency")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="more batches and calls (slower)")
    parser.add_argument("--batches", type=int, default=None,
                        help="sampled global batches per case (default 5, 20 with --full)")
    parser.add_argument("--latency-batches", type=int, default=None,
                        help="batches per row of the latency table (default 100, 400 with --full)")
    parser.add_argument("--tables", nargs="+", choices=TABLES, default=list(TABLES), metavar="TABLE",
                        help=f"the tables to print, in the usual order (default all: {', '.join(TABLES)})")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", default=DEFAULT_PROFILE, choices=sorted(builtin_profiles()),
                        help="the shipped profile that prices every plan (the schemes table adds the other shipped "
                             "profiles with all_to_all tables)")
    args = parser.parse_args(argv)
    num_batches = args.batches or (20 if args.full else 5)
    tables = set(args.tables)
    print(f"Profile: {args.profile}")
    if "speedup" in tables:
        names = ["skrull", "skrull_binary", "skrull_paper", "round_robin", "balanced", "sorted", "dacp_only",
                 "gds_only"]
        speedup_table("Figure 3 cases", FIGURE_3, names, num_batches, args.seed, args.profile)
        speedup_table("Long-heavy shapes", LONG_HEAVY, ["skrull", "skrull_binary", "skrull_paper", "balanced"],
                      num_batches, args.seed, args.profile)
    if "spanning" in tables:
        spanning_table(FIGURE_3 + LONG_HEAVY, num_batches, args.seed, args.profile)
    if "peers" in tables:
        peers_table(FIGURE_3 + LONG_HEAVY, num_batches, args.seed, args.profile)
        peers_table(FIGURE_3 + LONG_HEAVY, num_batches, args.seed, args.profile, uncapped=True)
    if "schemes" in tables:
        for profile in dict.fromkeys((args.profile, *SCHEME_PROFILES)):
            schemes_table(FIGURE_3 + LONG_HEAVY, num_batches, args.seed, profile)
    if "cpsat" in tables:
        cpsat_gap(3 if args.full else 2, args.seed, time_limit_s=20.0 if args.full else 5.0, profile=args.profile)
    if "tiny" in tables:
        tiny_batch_optimality(120 if args.full else 40, args.seed, args.profile)
    if "budget" in tables:
        budget_table(FIGURE_3 + LONG_HEAVY, num_batches, args.seed, budgets=(512, 2048), profile=args.profile)
    if "micro-batches" in tables:
        micro_batch_counts(FIGURE_3 + LONG_HEAVY, num_batches, args.seed, args.profile)
    if "latency" in tables:
        warm_up()  # the kernels compiled (or loaded) before anything is timed
        latency_table(args.seed, batches=args.latency_batches or (400 if args.full else 100), profile=args.profile)


if __name__ == "__main__":
    main()
