"""Token buckets (a trainer replaying CUDA graphs pads each rank's row to the smallest bucket that holds it): the
buckets, the padding's price, and plans that stay valid and never pay for padding they could avoid."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler_service.core.check import find_violations
from scheduler_service.core.costing import token_bucket_sizes
from scheduler_service.core.errors import InvalidRequestError
from scheduler_service.core.plan import PlanningProblem, SchedulerName, make_problem
from scheduler_service.core.planner import HEURISTIC_SCHEDULERS, make_plan
from scheduler_service.core.simulate import simulate
from tests.problem_builders import ADDITIVE_PROFILE


def test_buckets_are_the_bucket_size_and_its_halves_in_tiles_of_64() -> None:
    assert token_bucket_sizes(26_000, 4) == (3264, 6528, 13056, 26000)
    assert token_bucket_sizes(4096, 1) == (4096,)
    assert token_bucket_sizes(4096, 0) == ()
    assert token_bucket_sizes(100, 3) == (64, 100)  # halves that round to the same tile are one bucket


def test_a_rank_is_priced_at_its_padded_bucket() -> None:
    kwargs = dict(sequence_lengths=[3000, 500], dp_size=1, cp_size=1, model="qwen2.5-0.5b", bucket_size=8192,
                  profile=ADDITIVE_PROFILE)
    packed, padded = make_problem(**kwargs), make_problem(**kwargs, token_buckets=3)  # buckets 2048, 4096, 8192
    plan = HEURISTIC_SCHEDULERS[SchedulerName.DEEPSPEED](packed)  # one sequence per micro-batch
    estimate = simulate(padded, plan)
    expected = {3000: 4096 - 3000, 500: 2048 - 500}
    per_token_s = padded.alpha_s_per_flop * padded.perf.padding_flops_per_token
    for micro_batch, rank in zip(plan.dp_ranks[0].micro_batches, estimate.dp_ranks[0].micro_batches, strict=True):
        (index,) = micro_batch.indices()
        assert rank.critical.padding_s == pytest.approx(expected[padded.sequence_lengths[index]] * per_token_s)
        assert rank.time_s == pytest.approx(simulate(packed, plan).dp_ranks[0].micro_batches[
            plan.dp_ranks[0].micro_batches.index(micro_batch)].time_s + rank.critical.padding_s)


def test_without_buckets_nothing_is_padded() -> None:
    problem = make_problem(sequence_lengths=[3000, 500], dp_size=1, cp_size=2, model="qwen2.5-0.5b",
                           bucket_size=8192)
    estimate = make_plan(problem).estimate
    assert all(rank.padding_s == 0.0 for dp_rank in estimate.dp_ranks for mb in dp_rank.micro_batches
               for rank in mb.cp_ranks)


@st.composite
def bucketed_problems(draw: st.DrawFn) -> PlanningProblem:
    cp_size = draw(st.sampled_from([1, 2, 4]))
    bucket_size = draw(st.integers(256, 8192))
    lengths = draw(st.lists(st.integers(1, bucket_size * cp_size), min_size=1, max_size=24))
    return make_problem(sequence_lengths=lengths, dp_size=draw(st.integers(1, 3)), cp_size=cp_size,
                        model="qwen2.5-0.5b", bucket_size=bucket_size, token_buckets=draw(st.integers(1, 4)),
                        profile=draw(st.sampled_from([ADDITIVE_PROFILE, "h100-eager"])))


@pytest.mark.parametrize("scheduler", [SchedulerName.SKRULL, SchedulerName.SKRULL_BINARY, SchedulerName.BALANCED])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problem=bucketed_problems())
def test_bucketed_plans_pass_the_checker(scheduler: SchedulerName, problem: PlanningProblem) -> None:
    plan = make_plan(problem, scheduler).plan  # checked inside; rows within BucketSize, the largest bucket
    assert find_violations(plan, sequence_lengths=problem.sequence_lengths, dp_size=problem.dp_size,
                           cp_size=problem.cp_size, bucket_size=problem.bucket_size) == []


def test_the_planner_fills_buckets_when_it_prices_them() -> None:
    # 40 sequences of 600 tokens on one rank of 8192: packed plans cut anywhere; bucketed ones fill buckets
    lengths = [600] * 40
    packed = make_problem(sequence_lengths=lengths, dp_size=1, cp_size=1, model="qwen2.5-7b", bucket_size=8192,
                          profile=ADDITIVE_PROFILE)
    padded = make_problem(sequence_lengths=lengths, dp_size=1, cp_size=1, model="qwen2.5-7b", bucket_size=8192,
                          profile=ADDITIVE_PROFILE, token_buckets=4)
    planned_unaware = simulate(padded, make_plan(packed).plan).iteration_time_s
    assert make_plan(padded).estimate.iteration_time_s <= planned_unaware * (1 + 1e-12)
    buckets = np.array(token_bucket_sizes(8192, 4))
    rows = [sum(lengths[k] for k in mb.indices()) for mb in make_plan(padded).plan.dp_ranks[0].micro_batches]
    waste = sum(int(buckets[buckets >= row].min()) - row for row in rows)
    assert waste < 600 * len(rows)  # no micro-batch leaves a whole sequence's room of its bucket unfilled


def test_cpsat_refuses_buckets_it_does_not_model() -> None:
    problem = make_problem(sequence_lengths=[300, 200], dp_size=1, cp_size=2, model="tiny", bucket_size=512,
                           token_buckets=2)
    with pytest.raises(InvalidRequestError, match="cpsat does not model token buckets"):
        make_plan(problem, SchedulerName.CPSAT)
