"""The plan checker catches every kind of contract violation."""

import pytest

from scheduler_service.core.check import check_plan, find_violations
from scheduler_service.core.errors import PlanCheckError
from scheduler_service.core.plan import DPRankPlan, MicroBatch, Plan

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
