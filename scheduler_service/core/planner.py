"""The planner: one entry point from a validated problem to a checked, simulated plan.

The service, the CLI and the trainer's embedded fallback all call ``make_plan``,
so one request gets one answer wherever it is planned.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from scheduler_service.core import baselines, gds, static_sp
from scheduler_service.core.check import check_places, check_plan, check_schemes
from scheduler_service.core.dynamic_cp import dynamic_cp
from scheduler_service.core.errors import UnknownSchedulerError
from scheduler_service.core.plan import Plan, PlanningProblem, SchedulerName, SolverReport, make_problem
from scheduler_service.core.samplers import DATASETS, sample_lengths
from scheduler_service.core.schemes import BlockChanges, choose_for_places, choose_schemes
from scheduler_service.core.simulate import (
    LowerBounds,
    PlanEstimate,
    estimate_places,
    estimate_plan,
    iteration_lower_bounds_s,
    simulate,
)
from scheduler_service.core.spanning import (
    plan_with_spanning,
    spanned_beyond_groups,
    spanned_if_faster,
    with_needed_spanning,
)

__all__ = ["HEURISTIC_SCHEDULERS", "SCHEME_CHOOSERS", "PlanResult", "make_plan", "parse_scheduler", "schedule",
           "skrull", "warm_up"]

DEFAULT_CPSAT_TIME_LIMIT_S = 10.0


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanResult:
    scheduler: SchedulerName
    problem: PlanningProblem
    plan: Plan
    estimate: PlanEstimate
    baseline_time_s: float  # the deepspeed plan of the same batch
    solve_time_s: float
    solver: SolverReport | None = None
    lower_bound_s: float  # no plan of this batch is faster under the model (simulate.iteration_lower_bound_s)

    @property
    def speedup_vs_deepspeed(self) -> float:
        return self.baseline_time_s / self.estimate.iteration_time_s


def skrull(problem: PlanningProblem, *, budget: int | None = None) -> Plan:
    """Skrull: GDS + hybrid DACP within CP groups (``gds.skrull``), with spanning micro-batches for the sequences
    that need them and where the simulator finds them faster (``spanning.plan_with_spanning``)."""
    return plan_with_spanning(problem, lambda part: gds.skrull(part, budget=budget))


HEURISTIC_SCHEDULERS: dict[SchedulerName, Callable[[PlanningProblem], Plan]] = {
    SchedulerName.SKRULL: skrull,
    SchedulerName.SKRULL_BINARY: gds.skrull_binary,
    SchedulerName.SKRULL_PAPER: gds.skrull_paper,
    SchedulerName.DEEPSPEED: baselines.deepspeed,
    SchedulerName.SORTED: baselines.sorted_batching,
    SchedulerName.ROUND_ROBIN: gds.round_robin,
    SchedulerName.BALANCED: baselines.balanced,
    SchedulerName.DYNAMIC_CP: dynamic_cp,
    SchedulerName.GROUP_BY_LENGTH: baselines.group_by_length,
    SchedulerName.BATCH_REBALANCE: baselines.batch_rebalance,
    SchedulerName.ULYSSES: static_sp.ulysses,
    SchedulerName.USP: static_sp.usp,
}

# Peers' schedulers, planned as their own systems plan (the whole pool for dynamic CP; within CP groups, refusing a
# sequence no CP group holds, for the HF samplers and the static SP of XTuner/SWIFT and USP); every other scheduler
# plans within CP groups, and the sequences no CP group holds are given spanning micro-batches around it
# (``spanning.with_needed_spanning``).
_PEER_SCHEDULERS = frozenset({SchedulerName.DYNAMIC_CP, SchedulerName.GROUP_BY_LENGTH, SchedulerName.BATCH_REBALANCE,
                              SchedulerName.ULYSSES, SchedulerName.USP})


def parse_scheduler(name: str | SchedulerName) -> SchedulerName:
    try:
        return SchedulerName(name)
    except ValueError:
        raise UnknownSchedulerError(str(name), [s.value for s in SchedulerName]) from None


def schedule(
    problem: PlanningProblem, scheduler: str | SchedulerName, *, time_limit_s: float = DEFAULT_CPSAT_TIME_LIMIT_S,
    search_budget: int | None = None,
) -> tuple[Plan, SolverReport | None]:
    """The raw plan of one scheduler (unchecked), with the solver's report for cpsat."""
    name = parse_scheduler(scheduler)
    if name is SchedulerName.SKRULL:
        return skrull(problem, budget=search_budget), None
    if name is SchedulerName.CPSAT:
        from scheduler_service.core import cpsat  # ortools is only needed for offline comparison

        reports: list[SolverReport] = []

        def solve(part: PlanningProblem) -> Plan:
            # the hybrid space, warm-started from the default scheduler's plan: never worse than skrull
            solution = cpsat.solve(part, time_limit_s=time_limit_s, hint=gds.skrull(part, budget=search_budget),
                                   hybrid=True)
            reports.append(solution.report)
            return solution.plan

        plan = with_needed_spanning(problem, solve)
        return plan, reports[0] if reports else None
    if name in _PEER_SCHEDULERS:
        return HEURISTIC_SCHEDULERS[name](problem), None
    return with_needed_spanning(problem, HEURISTIC_SCHEDULERS[name]), None


# Skrull's schedulers give each collective its fastest scheme (``schemes.choose_schemes``); the others run as their
# systems do, all-gather-KV (``deepspeed``, the samplers, Megatron's ring priced as its own) or their one static
# scheme (``ulysses``, ``usp``).
SCHEME_CHOOSERS = frozenset({SchedulerName.SKRULL, SchedulerName.SKRULL_BINARY, SchedulerName.CPSAT})


def make_plan(
    problem: PlanningProblem, scheduler: str | SchedulerName = SchedulerName.SKRULL, *,
    time_limit_s: float = DEFAULT_CPSAT_TIME_LIMIT_S, search_budget: int | None = None, schemes: bool = True,
) -> PlanResult:
    """Schedule, check (every plan, every scheduler) and simulate one global batch. The compiled schedulers'
    places are checked as arrays before the plan is built from them; any other plan is checked as it is.
    ``schemes``: Skrull's schedulers choose each collective's scheme (``SCHEME_CHOOSERS``) where the problem allows
    it (``PlanningProblem.schemes``); False: all-gather-KV everywhere, as before the choice (``make bench`` compares
    the two)."""
    name = parse_scheduler(scheduler)
    started = time.perf_counter()
    report = None
    choosing = schemes and problem.schemes and name in SCHEME_CHOOSERS
    within_groups = not problem.too_long_for_a_replica()
    bounds = iteration_lower_bounds_s(problem)
    if within_groups and (name is SchedulerName.SKRULL or name is SchedulerName.SKRULL_BINARY):
        plan, estimate = _skrull(problem, name, bounds, choosing=choosing, search_budget=search_budget)
    else:
        plan, report = schedule(problem, name, time_limit_s=time_limit_s, search_budget=search_budget)
        check_plan(plan, sequence_lengths=problem.sequence_lengths, dp_size=problem.dp_size,
                   cp_size=problem.cp_size, bucket_size=problem.bucket_size)
        chosen, changes = _with_schemes(problem, plan) if choosing else (plan, None)
        estimate = estimate_plan(problem, chosen, changes=changes)
        if report is not None and choosing and _schemes_may_apply(problem):  # CP-SAT proved its bound over
            report = dataclasses.replace(  # all-gather-KV plans: the model's bound over every scheme is one, and
                # optimality over every scheme is not proven
                report, status="FEASIBLE" if report.status == "OPTIMAL" else report.status,
                objective_s=estimate.iteration_time_s,
                bound_s=None if report.bound_s is None else min(report.bound_s, bounds.any_plan_s))
        plan = chosen
    solve_time_s = time.perf_counter() - started
    if name is SchedulerName.DEEPSPEED:
        baseline_time_s = estimate.iteration_time_s
    elif not within_groups:
        baseline_time_s = simulate(problem, with_needed_spanning(problem, baselines.deepspeed)).iteration_time_s
    else:
        baseline_time_s = baselines.deepspeed_time_s(problem)
    return PlanResult(scheduler=name, problem=problem, plan=plan, estimate=estimate, baseline_time_s=baseline_time_s,
                      solve_time_s=solve_time_s, solver=report, lower_bound_s=bounds.any_plan_s)


def _skrull(problem: PlanningProblem, name: SchedulerName, bounds: LowerBounds, *, choosing: bool,
            search_budget: int | None) -> tuple[Plan, PlanEstimate]:
    """Skrull's plan of a batch every CP group holds, checked, its schemes chosen where ``choosing``, and its
    estimate. The compiled searches' places are checked as arrays before the plan is built from them. Where a
    spanning plan could beat every plan within CP groups, one is looked for before the plan within groups is
    refined (``spanning.spanned_beyond_groups``)."""
    schedule = functools.partial(gds.skrull, budget=search_budget)
    spanned = None
    if name is SchedulerName.SKRULL:
        searched = gds.search(problem)
        # a spanning plan faster than any plan within CP groups can be needs no refined plan to be compared with
        spanned = spanned_beyond_groups(problem, searched.faster(), bounds, schedule)
        if spanned is None:
            places = gds.skrull_places(problem, budget=search_budget, searched=searched)
    else:
        places = gds.skrull_binary_places(problem)
    if spanned is None:
        # the places' plan, its schemes chosen from them before it is built
        choice = choose_for_places(problem, places) if choosing else None
        plan = Plan.from_places(places, dp_size=problem.dp_size, cp_size=problem.cp_size,
                                ulysses_degrees=choice.ulysses_degrees if choice else None)
        if choice and choice.ulysses_degrees:
            check_schemes(plan, heads=problem.perf.model.heads)
        estimate = estimate_places(problem, places, changes=choice.changes if choice else None)
        # spanning candidates are simulated as all-gather-KV against these places with their schemes: a spanning
        # plan is taken where it wins without the choice, which it then gets too
        spanned = (spanned_if_faster(problem, places, estimate, schedule)
                   if name is SchedulerName.SKRULL else None)
        if spanned is None:  # the places are the plan: checked as they are, once
            check_places(places, sequence_lengths=problem.lengths, dp_size=problem.dp_size, cp_size=problem.cp_size,
                         bucket_size=problem.bucket_size)
            return plan, estimate
    # spanning micro-batches beside (some of) the replicas' own: the plan is checked whole
    spanned_plan, spanned_estimate = spanned
    check_plan(spanned_plan, sequence_lengths=problem.sequence_lengths, dp_size=problem.dp_size,
               cp_size=problem.cp_size, bucket_size=problem.bucket_size)
    plan, changes = _with_schemes(problem, spanned_plan) if choosing else (spanned_plan, None)
    # estimated again only where the choice changed a collective (the spanned plan is all-gather-KV)
    return plan, spanned_estimate if plan is spanned_plan else estimate_plan(problem, plan, changes=changes)


def _schemes_may_apply(problem: PlanningProblem) -> bool:
    """Whether a collective of the problem's plans may be Ulysses or 2D (some block size has a degree for it)."""
    return any(problem.perf.ulysses_degrees(degree) for degree in problem.degrees if degree > 1)


def _with_schemes(problem: PlanningProblem, plan: Plan) -> tuple[Plan, BlockChanges]:
    """``plan`` with its collectives' schemes chosen (``schemes.choose_schemes``) and checked against the model's
    heads, and the changes they make (``estimate_plan``'s)."""
    chosen, changes = choose_schemes(problem, plan)
    if chosen is not plan:  # the same places, other schemes
        check_schemes(chosen, heads=problem.perf.model.heads)
    return chosen, changes


def warm_up() -> float:
    """Compile every kernel the planners call (or load it from the JIT cache, ``jit``) before the first real batch
    pays for it: what a service does before it reports ready and a trainer at start. It plans a small batch with
    each scheduler and reads its estimate, then with ``skrull`` a batch of every length distribution at the
    benchmarks' shape, one of them with a sequence only a spanning block holds: the paths that only large or
    imbalanced batches take (the refinement of long micro-batches, the spanning candidates) compile here too
    (``tests/test_kernels.py`` checks that no kernel compiles after it). The seconds it took."""
    started = time.perf_counter()
    problem = make_problem(sequence_lengths=[3000, 1200, 700, 90, 5000, 40], dp_size=2, cp_size=4, model="tiny",
                           bucket_size=2048)
    for name in SchedulerName:
        if name is not SchedulerName.CPSAT:
            result = make_plan(problem, name)
            estimate = result.estimate
            (estimate.spanning + estimate.dp_ranks[0].micro_batches)[0].critical  # noqa: B018 (the breakdown's too)
    for seed, dataset in enumerate(DATASETS):
        lengths = sample_lengths(dataset, _WARM_UP_SEQUENCES, np.random.default_rng(seed),
                                 max_length=_WARM_UP_BUCKET_SIZE * _WARM_UP_CP_SIZE).tolist()
        if seed == 0:
            lengths[0] = _WARM_UP_BUCKET_SIZE * _WARM_UP_CP_SIZE * 2  # only a block of two replicas holds it
        make_plan(make_problem(sequence_lengths=lengths, dp_size=4, cp_size=_WARM_UP_CP_SIZE, model="qwen2.5-0.5b",
                               bucket_size=_WARM_UP_BUCKET_SIZE))
    return time.perf_counter() - started


_WARM_UP_SEQUENCES, _WARM_UP_CP_SIZE, _WARM_UP_BUCKET_SIZE = 256, 8, 26_000  # the benchmarks' shape
