"""Plan-level refinement: swaps and moves across micro-batches and DP ranks never break a plan or slow it down."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings

from scheduler_service.core import gds
from scheduler_service.core.check import find_violations
from scheduler_service.core.plan import DPRankPlan, MicroBatch, Plan, PlanningProblem, make_problem
from scheduler_service.core.plan_refine import refine_plan
from scheduler_service.core.simulate import simulate
from tests.test_dacp_groups import hybrid_problems


def as_plan(dp_ranks: list[list[MicroBatch]]) -> Plan:
    return Plan(dp_ranks=tuple(DPRankPlan(micro_batches=tuple(micro_batches)) for micro_batches in dp_ranks))


def unrefined_hybrid_plan(problem: PlanningProblem) -> Plan:
    """What ``skrull`` refines: GDS's hybrid plan, each micro-batch decided on its own."""
    split = gds._split(problem, problem.area)
    return gds._assemble(problem, split, gds.hybrid_and_balanced_candidates(problem, split.groups, [])[0])[0]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problem=hybrid_problems(max_sequences=32))
def test_a_refined_plan_is_valid_timed_as_the_simulator_and_never_slower(problem: PlanningProblem) -> None:
    plan = unrefined_hybrid_plan(problem)
    refined, time_s = refine_plan(problem, [list(dp_rank.micro_batches) for dp_rank in plan.dp_ranks])
    refined_plan = as_plan(refined)
    assert find_violations(refined_plan, sequence_lengths=problem.sequence_lengths, dp_size=problem.dp_size,
                           cp_size=problem.cp_size, bucket_size=problem.bucket_size) == []
    assert time_s == pytest.approx(simulate(problem, refined_plan).iteration_time_s, rel=1e-9)
    assert time_s <= simulate(problem, plan).iteration_time_s * (1 + 1e-12)


def test_a_swap_across_micro_batches_pairs_the_long_sequences() -> None:
    # Each micro-batch pairs a long sequence with a short one, so both take a long one's time; swapping a long one
    # into the other micro-batch makes one micro-batch long and the other short.
    problem = make_problem(sequence_lengths=[16_000, 16_000, 500, 500], dp_size=1, cp_size=2,
                           model="qwen2.5-0.5b", bucket_size=20_000)
    paired = [[MicroBatch(local=((0,), (2,)), distributed=()), MicroBatch(local=((1,), (3,)), distributed=())]]
    refined, time_s = refine_plan(problem, paired)
    assert time_s < 0.6 * simulate(problem, as_plan(paired)).iteration_time_s
    assert sorted(sorted(micro_batch.indices()) for micro_batch in refined[0]) == [[0, 1], [2, 3]]


def test_a_move_takes_work_off_the_slowest_dp_rank() -> None:
    problem = make_problem(sequence_lengths=[8_000, 8_000, 8_000, 8_000], dp_size=2, cp_size=2,
                           model="qwen2.5-0.5b", bucket_size=20_000)
    lopsided = [[MicroBatch(local=((0, 1), (2,)), distributed=())], [MicroBatch(local=((3,), ()), distributed=())]]
    refined, time_s = refine_plan(problem, lopsided)
    assert time_s < simulate(problem, as_plan(lopsided)).iteration_time_s
    assert sorted(len(micro_batch.indices()) for dp_rank in refined for micro_batch in dp_rank) == [2, 2]
