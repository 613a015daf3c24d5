"""The plan checker catches every kind of contract violation."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from scheduler_service.core import baselines, gds
from scheduler_service.core.check import check_places, check_plan, find_violations
from scheduler_service.core.errors import PlanCheckError
from scheduler_service.core.plan import (
    DPRankPlan,
    MicroBatch,
    Places,
    Plan,
    PlanningProblem,
    SpanningMicroBatch,
    make_problem,
)
from tests.problem_builders import hybrid_problems

LENGTHS = [100, 200, 300, 400]


def violations(plan: Plan, dp_size: int = 1, cp_size: int = 2, bucket_size: int = 500) -> list[str]:
    return find_violations(plan, sequence_lengths=LENGTHS, dp_size=dp_size, cp_size=cp_size, bucket_size=bucket_size)


def one_rank(*micro_batches: MicroBatch) -> Plan:
    return Plan(dp_ranks=(DPRankPlan(micro_batches=micro_batches),))


def test_accepts_a_valid_plan() -> None:
    plan = one_rank(MicroBatch(local=((0, 1), (2,)), distributed=(3,)))
    assert violations(plan) == []
    check_plan(plan, sequence_lengths=LENGTHS, dp_size=1, cp_size=2, bucket_size=500)


def test_rejects_a_missing_and_a_duplicated_sequence() -> None:
    plan = one_rank(MicroBatch(local=((0,), (0,)), distributed=(2, 3)))
    found = violations(plan, bucket_size=10_000)
    assert any("sequence 0 is scheduled twice" in v for v in found)
    assert any("1 sequences are not scheduled: 1" in v for v in found)


def test_rejects_wrong_number_of_dp_entries_and_local_lists() -> None:
    plan = one_rank(MicroBatch(local=((0, 1, 2, 3),), distributed=()))
    found = violations(plan, dp_size=2, bucket_size=10_000)
    assert any("2 DP entries" in v or "dp_size is 2" in v for v in found)
    assert any("1 local lists; cp_size is 2" in v for v in found)


def test_rejects_a_rank_over_the_memory_bound() -> None:
    # rank 0: 300 + 400 local = 700 > 500; rank 1 holds 100 + 200/2 distributed = 200 fine
    plan = one_rank(MicroBatch(local=((2, 3), (0,)), distributed=(1,)))
    found = violations(plan)
    assert found == [
        "dp_ranks[0].micro_batches[0] CP rank 0 holds 700 local + 200/2 distributed tokens > bucket_size 500"
    ]


def test_memory_bound_is_exact_for_fractional_shards() -> None:
    # 300 local + 401/2 = 500.5 > 500 must fail; 300 + 400/2 = 500 must pass
    lengths = [300, 401, 400]
    over = Plan(dp_ranks=(DPRankPlan(micro_batches=(MicroBatch(local=((0,), ()), distributed=(1,)),
                                                    MicroBatch(local=((), (2,)), distributed=()))),))
    assert find_violations(over, sequence_lengths=lengths, dp_size=1, cp_size=2, bucket_size=500)
    fits = Plan(dp_ranks=(DPRankPlan(micro_batches=(MicroBatch(local=((0,), ()), distributed=(2,)),
                                                    MicroBatch(local=((1,), ()), distributed=()))),))
    assert not find_violations(fits, sequence_lengths=lengths, dp_size=1, cp_size=2, bucket_size=500)


def test_rejects_out_of_range_indices_and_empty_micro_batches() -> None:
    plan = one_rank(MicroBatch(local=((0, 1), (2, 3)), distributed=(9,)), MicroBatch(local=((), ()), distributed=()))
    found = violations(plan, bucket_size=10_000)
    assert any("names index 9" in v for v in found)
    assert any("micro_batches[1] is empty" in v for v in found)


def test_check_plan_raises_with_every_violation_listed() -> None:
    with pytest.raises(PlanCheckError) as caught:
        check_plan(one_rank(), sequence_lengths=LENGTHS, dp_size=2, cp_size=2, bucket_size=500)
    assert len(caught.value.violations) == 2


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problem=hybrid_problems(max_sequences=24))
def test_a_plan_and_its_places_convert_both_ways_and_check_alike(problem: PlanningProblem) -> None:
    # a plan the compiled schedulers build from places comes back whole; any other keeps its places (on one CP
    # rank "distributed" and "local" are the same place)
    for scheduler in (gds.skrull, baselines.deepspeed):
        plan = scheduler(problem)
        places = plan.places(problem.num_sequences)
        rebuilt = Plan.from_places(places, dp_size=problem.dp_size, cp_size=problem.cp_size)
        assert rebuilt == plan or scheduler is baselines.deepspeed
        again = rebuilt.places(problem.num_sequences)
        for field in ("micro_batch", "degree", "first_rank", "dp_rank"):
            assert np.array_equal(getattr(places, field), getattr(again, field))
        check_places(places, sequence_lengths=problem.lengths, dp_size=problem.dp_size, cp_size=problem.cp_size,
                     bucket_size=problem.bucket_size)


def test_places_over_the_bucket_are_refused_with_the_checkers_sentences() -> None:
    problem = make_problem(sequence_lengths=[3000, 2000], dp_size=1, cp_size=2, model="tiny", bucket_size=4000)
    both_on_rank_0 = Places(np.array([0, 0]), np.array([1, 1]), np.array([0, 0]), np.array([0]))
    with pytest.raises(PlanCheckError, match="CP rank 0 holds 5000 local"):
        check_places(both_on_rank_0, sequence_lengths=problem.lengths, dp_size=1, cp_size=2, bucket_size=4000)
    misaligned = Places(np.array([0, 0]), np.array([1, 2]), np.array([0, 1]), np.array([0]))
    with pytest.raises(PlanCheckError):
        check_places(misaligned, sequence_lengths=problem.lengths, dp_size=1, cp_size=4, bucket_size=4000)


def _spanning_plan(first_dp_rank: int, num_dp_ranks: int, local: tuple[tuple[int, ...], ...],
                   distributed: tuple[int, ...] = (), dp_size: int = 4) -> Plan:
    return Plan(dp_ranks=(DPRankPlan(micro_batches=()),) * dp_size, spanning=(SpanningMicroBatch(
        first_dp_rank=first_dp_rank, num_dp_ranks=num_dp_ranks,
        micro_batch=MicroBatch(local=local, distributed=distributed)),))


def test_a_spanning_block_must_be_aligned_replicas_of_an_allowed_width() -> None:
    def violations(plan: Plan) -> list[str]:
        return find_violations(plan, sequence_lengths=[10, 20], dp_size=4, cp_size=2, bucket_size=100)

    assert violations(_spanning_plan(0, 2, ((0,), (1,), (), ()))) == []
    assert "spanning[0] DP replicas 1..2 are not an aligned block of dp_size 4" in violations(
        _spanning_plan(1, 2, ((0,), (1,), (), ())))[0]
    assert "spanning[0] spans 3 DP replica(s); a spanning block of dp_size 4 spans 2, 4" in violations(
        _spanning_plan(0, 3, ((0,), (1,), (), (), (), ())))[0]
    assert "its block has 4 ranks" in violations(_spanning_plan(0, 2, ((0,), (1,))))[0]


def test_a_rank_of_a_spanning_block_over_the_bound_is_named_by_its_world_rank() -> None:
    plan = _spanning_plan(2, 2, ((), (), (0,), ()), distributed=(1,))
    assert find_violations(plan, sequence_lengths=[90, 80], dp_size=4, cp_size=2, bucket_size=100) == [
        "spanning[0] (DP replicas 2..3, world ranks 4..7) world rank 6 (block rank 2) holds 90 local + 80/4 "
        "distributed tokens > bucket_size 100"]
