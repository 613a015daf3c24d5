"""Plan-level refinement: swaps and moves across micro-batches and DP ranks never break a plan or slow it down."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings

from scheduler_service.core import gds, plan_refine
from scheduler_service.core.check import find_violations
from scheduler_service.core.dacp_search import HYBRID
from scheduler_service.core.plan import (
    DPRankPlan,
    MicroBatch,
    Plan,
    PlanningProblem,
    ShardedGroup,
    make_problem,
)
from scheduler_service.core.plan_refine import refine_plan
from scheduler_service.core.simulate import simulate
from tests.problem_builders import ADDITIVE_PROFILE, hybrid_problems


def as_plan(dp_ranks: list[list[MicroBatch]]) -> Plan:
    return Plan(dp_ranks=tuple(DPRankPlan(micro_batches=tuple(micro_batches)) for micro_batches in dp_ranks))


def refined(problem: PlanningProblem, plan: Plan, budget: int = 128) -> tuple[Plan, float]:
    places, time_s = refine_plan(problem, plan.places(problem.num_sequences), budget=budget)
    return Plan.from_places(places, dp_size=problem.dp_size, cp_size=problem.cp_size), time_s


def unrefined_hybrid_plan(problem: PlanningProblem) -> Plan:
    """What ``skrull`` refines: GDS's hybrid plan, each micro-batch decided on its own."""
    places, _ = gds.gds_places(problem, problem.area, HYBRID)
    return Plan.from_places(places, dp_size=problem.dp_size, cp_size=problem.cp_size)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problem=hybrid_problems(max_sequences=32))
def test_a_refined_plan_is_valid_timed_as_the_simulator_and_never_slower(problem: PlanningProblem) -> None:
    plan = unrefined_hybrid_plan(problem)
    refined_plan, time_s = refined(problem, plan)
    assert find_violations(refined_plan, sequence_lengths=problem.sequence_lengths, dp_size=problem.dp_size,
                           cp_size=problem.cp_size, bucket_size=problem.bucket_size) == []
    assert time_s == pytest.approx(simulate(problem, refined_plan).iteration_time_s, rel=1e-9)
    assert time_s <= simulate(problem, plan).iteration_time_s * (1 + 1e-12)


def test_a_swap_across_micro_batches_pairs_the_long_sequences() -> None:
    # Each micro-batch pairs a long sequence with a short one, so both take a long one's time; swapping a long one
    # into the other micro-batch makes one micro-batch long and the other short.
    problem = make_problem(sequence_lengths=[16_000, 16_000, 500, 500], dp_size=1, cp_size=2,
                           model="qwen2.5-0.5b", bucket_size=20_000, profile=ADDITIVE_PROFILE)
    paired = as_plan([[MicroBatch(local=((0,), (2,)), distributed=()), MicroBatch(local=((1,), (3,)), distributed=())]])
    refined_plan, time_s = refined(problem, paired)
    assert time_s < 0.6 * simulate(problem, paired).iteration_time_s
    assert sorted(sorted(micro_batch.indices()) for micro_batch in refined_plan.dp_ranks[0].micro_batches) == [
        [0, 1], [2, 3]]


def test_a_move_takes_work_off_the_slowest_dp_rank() -> None:
    problem = make_problem(sequence_lengths=[8_000, 8_000, 8_000, 8_000], dp_size=2, cp_size=2,
                           model="qwen2.5-0.5b", bucket_size=20_000)
    lopsided = as_plan([[MicroBatch(local=((0, 1), (2,)), distributed=())],
                        [MicroBatch(local=((3,), ()), distributed=())]])
    refined_plan, time_s = refined(problem, lopsided)
    assert time_s < simulate(problem, lopsided).iteration_time_s
    assert sorted(len(micro_batch.indices()) for dp_rank in refined_plan.dp_ranks
                  for micro_batch in dp_rank.micro_batches) == [2, 2]


def swapped(plan: Plan, x: int, y: int) -> Plan:
    """``plan`` with sequences ``x`` and ``y`` in each other's places."""
    def places(indices: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(sorted({x: y, y: x}.get(index, index) for index in indices))

    return Plan(dp_ranks=tuple(DPRankPlan(micro_batches=tuple(
        MicroBatch(local=tuple(map(places, micro_batch.local)), distributed=places(micro_batch.distributed),
                   sharded=tuple(ShardedGroup(cp_ranks=group.cp_ranks, sequences=places(group.sequences))
                                 for group in micro_batch.sharded))
        for micro_batch in dp_rank.micro_batches)) for dp_rank in plan.dp_ranks))


def brute_force_best_swap_s(problem: PlanningProblem, plan: Plan, x: int) -> float:
    """Every swap of ``x`` with a sequence of another micro-batch that costs less than ``x`` at its place and keeps
    both micro-batches in memory, simulated whole: the least time of the slowest DP rank it changes (inf if none)."""
    where = {index: (dp_rank, number, micro_batch) for dp_rank, dp_plan in enumerate(plan.dp_ranks)
             for number, micro_batch in enumerate(dp_plan.micro_batches) for index in micro_batch.indices()}

    def degree_of(index: int) -> int:
        micro_batch = where[index][2]
        if index in micro_batch.distributed:
            return problem.cp_size
        return next((group.degree for group in micro_batch.sharded if index in group.sequences), 1)

    best_s = float("inf")
    for y in range(problem.num_sequences):
        costs_at_x = problem.rank_flops_at(degree_of(x))
        if where[y][:2] == where[x][:2] or costs_at_x[y] >= costs_at_x[x]:
            continue
        candidate = swapped(plan, x, y)
        if find_violations(candidate, sequence_lengths=problem.sequence_lengths, dp_size=problem.dp_size,
                           cp_size=problem.cp_size, bucket_size=problem.bucket_size):
            continue
        dp_times_s = [dp_rank.time_s for dp_rank in simulate(problem, candidate).dp_ranks]
        best_s = min(best_s, max(dp_times_s[where[x][0]], dp_times_s[where[y][0]]))
    return best_s


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problem=hybrid_problems(max_sequences=20))
def test_the_bounded_swap_search_finds_the_swap_costing_every_partner_finds(problem: PlanningProblem) -> None:
    # With the threshold just above the best swap's time, a bound that ever exceeded a partner's exact time could
    # skip the best partner; just below it, nothing may be found.
    plan = unrefined_hybrid_plan(problem)
    places = plan.places(problem.num_sequences)
    if places.num_micro_batches == 0 or len(problem.degrees) < 2:
        return
    state = plan_refine._new_state(problem.tables, places.micro_batch, places.degree, places.first_rank,
                                   places.dp_rank, problem.dp_size)
    slowest = int(state.dp_times_s.argmax())
    extremes = plan_refine._block_extremes(state)
    for x in (index for micro_batch in plan.dp_ranks[slowest].micro_batches for index in micro_batch.indices()):
        best_s = brute_force_best_swap_s(problem, plan, x)
        if best_s == float("inf"):
            assert plan_refine._best_swap(state, x, slowest, float("inf"), *extremes)[1] == -1
            continue
        found_s, partner = plan_refine._best_swap(state, x, slowest, best_s * (1 + 1e-9), *extremes)
        assert partner >= 0 and found_s == pytest.approx(best_s, rel=1e-9)
        assert plan_refine._best_swap(state, x, slowest, best_s * (1 - 1e-9), *extremes)[1] == -1
