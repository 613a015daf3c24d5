"""The Hugging Face Trainer's samplers as baselines: the ports equal transformers' own functions output for output,
and the schedulers built on them keep the memory bound with the fewest accumulation steps, or refuse by name."""

from __future__ import annotations

import random

import pytest
import torch
from transformers.trainer_pt_utils import BatchRebalanceSampler as TransformersBatchRebalanceSampler
from transformers.trainer_pt_utils import get_length_grouped_indices as transformers_length_grouped_indices

from scheduler_service.core import baselines
from scheduler_service.core.check import find_violations
from scheduler_service.core.errors import BaselineCannotPlanError
from scheduler_service.core.hf_samplers import BatchRebalanceSampler, get_length_grouped_indices
from scheduler_service.core.plan import Plan, PlanningProblem, make_problem
from tests.problem_builders import ADDITIVE_PROFILE


def _batches(count: int) -> list[tuple[int, int, list[int]]]:
    """(dp_size, grad_accum, lengths) of log-uniform lengths, seeded."""
    rng = random.Random(43)
    batches = []
    for _ in range(count):
        dp_size, grad_accum = rng.choice([1, 2, 4, 8]), rng.choice([1, 2, 3, 4, 8])
        lengths = [int(10 ** rng.uniform(1, 5)) for _ in range(rng.randint(dp_size * grad_accum, 300))]
        batches.append((dp_size, grad_accum, lengths))
    return batches


@pytest.mark.parametrize(("dp_size", "grad_accum", "lengths"), _batches(200))
def test_batch_rebalance_port_assigns_as_transformers_does(dp_size: int, grad_accum: int, lengths: list[int]) -> None:
    indices = random.Random(len(lengths)).sample(range(1000, 1000 + len(lengths)), len(lengths))
    theirs = TransformersBatchRebalanceSampler(lengths=lengths, effective_batch_size=len(lengths), dp_size=dp_size,
                                               grad_accum=grad_accum)._assign(indices, lengths)
    ours = BatchRebalanceSampler(effective_batch_size=len(lengths), dp_size=dp_size,
                                 grad_accum=grad_accum)._assign(indices, lengths)
    assert ours == theirs


@pytest.mark.parametrize(("seed", "batch_size"), [(seed, 1 + seed % 37) for seed in range(100)])
def test_length_grouped_indices_port_orders_as_transformers_does(seed: int, batch_size: int) -> None:
    lengths = [int(10 ** random.Random(seed + i).uniform(1, 5)) for i in range(7 * seed + 3)]
    theirs = transformers_length_grouped_indices(lengths, batch_size, generator=torch.Generator().manual_seed(seed))
    permutation = torch.randperm(len(lengths), generator=torch.Generator().manual_seed(seed)).tolist()
    assert get_length_grouped_indices(lengths, batch_size, permutation) == theirs


def _problem(lengths: list[int], *, dp_size: int = 2, cp_size: int = 2, bucket_size: int = 4096) -> PlanningProblem:
    return make_problem(sequence_lengths=lengths, dp_size=dp_size, cp_size=cp_size, model="qwen2.5-0.5b",
                        bucket_size=bucket_size, profile=ADDITIVE_PROFILE)


def _tokens_per_micro_batch(problem: PlanningProblem, plan: Plan) -> list[int]:
    return [sum(problem.sequence_lengths[k] for k in mb.distributed)
            for dp_rank in plan.dp_ranks for mb in dp_rank.micro_batches]


@pytest.mark.parametrize("scheduler", [baselines.group_by_length, baselines.batch_rebalance])
def test_hf_plans_shard_every_sequence_over_the_group_within_the_bound(scheduler) -> None:  # type: ignore[no-untyped-def]
    lengths = [int(10 ** random.Random(i).uniform(2, 3.9)) for i in range(64)]
    problem = _problem(lengths)
    plan = scheduler(problem)
    assert find_violations(plan, sequence_lengths=problem.sequence_lengths, dp_size=2, cp_size=2,
                           bucket_size=4096) == []
    assert all(mb.local == ((), ()) for dp_rank in plan.dp_ranks for mb in dp_rank.micro_batches)
    assert max(_tokens_per_micro_batch(problem, plan)) <= problem.micro_batch_capacity


def test_batch_rebalance_takes_the_fewest_accumulation_steps_that_fit() -> None:
    lengths = [3000, 2900, 2500, 2000, 1200, 900, 800, 700, 500, 300, 200, 100]
    problem = _problem(lengths, dp_size=2, cp_size=1, bucket_size=4000)
    plan = baselines.batch_rebalance(problem)
    steps = len(plan.dp_ranks[0].micro_batches)
    assert steps == len(plan.dp_ranks[1].micro_batches) > 1
    fewer = BatchRebalanceSampler(effective_batch_size=12, dp_size=2, grad_accum=steps - 1)._assign(range(12), lengths)
    assert max(sum(lengths[k] for k in group) for rank in fewer for group in rank) > 4000


def test_group_by_length_deals_per_device_batches_round_robin() -> None:
    lengths = [100, 800, 300, 700, 200, 600, 400, 500]
    plan = baselines.group_by_length(_problem(lengths, dp_size=2, cp_size=1, bucket_size=100_000))
    # one accumulation step: the step's batch sorted by length, per-device batches of 4 dealt rank 0 first
    assert [mb.distributed for dp_rank in plan.dp_ranks for mb in dp_rank.micro_batches] == [(1, 3, 5, 7),
                                                                                            (0, 2, 4, 6)]


@pytest.mark.parametrize("scheduler", [baselines.group_by_length, baselines.batch_rebalance])
def test_a_sequence_no_cp_group_holds_is_refused_by_name(scheduler) -> None:  # type: ignore[no-untyped-def]
    problem = _problem([100, 9000, 200], dp_size=2, cp_size=2, bucket_size=4096)  # 9000 > 2 × 4096: spanning only
    with pytest.raises(BaselineCannotPlanError, match=r"sequence 1 has 9000 tokens and one CP group holds 8192"):
        scheduler(problem)
