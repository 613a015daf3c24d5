"""Megatron's dynamic CP as Megatron plans it (the port, held to the original's recorded schedules) and as Megatron
runs it (``dynamic_cp.megatron_estimate``, term by term)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from scheduler_service.core.dynamic_cp import dynamic_cp, megatron_estimate
from scheduler_service.core.errors import BaselineCannotPlanError
from scheduler_service.core.megatron_dcp import get_groups_and_subsamples
from scheduler_service.core.plan import PlanningProblem, make_problem
from scheduler_service.core.simulate import simulate
from tests.problem_builders import ADDITIVE_PROFILE

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "megatron" / "dynamic_cp.json").read_text())


def test_fixtures_name_the_megatron_commit_they_were_recorded_at() -> None:
    assert FIXTURE["megatron_commit"] == "d48bd6be0a85cc0d6d3cc71e8750cf357cc6bdb1"
    assert FIXTURE["function"].endswith("DefaultDynamicCPScheduler.get_groups_and_subsamples")


@pytest.mark.parametrize("case", FIXTURE["cases"], ids=[case["name"] for case in FIXTURE["cases"]])
def test_port_schedules_every_fixture_exactly_as_megatron_did(case: dict) -> None:  # type: ignore[type-arg]
    pool = case["dp_size"] * case["cp_size"]
    schedule = get_groups_and_subsamples(list(enumerate(case["lengths"])), pool, case["max_seqlen_per_rank"])
    assert schedule == case["sample_id_groups"]


def test_short_sequences_run_whole_on_single_ranks() -> None:
    # issue 43: sixteen 100-token sequences at DP 2 × CP 4 are not sharded over the pool
    problem = make_problem(sequence_lengths=[100] * 16, dp_size=2, cp_size=4, model="qwen2.5-0.5b", bucket_size=8000)
    (spanning,) = dynamic_cp(problem).spanning
    assert spanning.micro_batch.local == tuple((rank, rank + 8) for rank in range(8))
    assert spanning.micro_batch.distributed == () and spanning.micro_batch.sharded == ()


def test_plan_places_each_sequence_on_its_megatron_group() -> None:
    case = next(case for case in FIXTURE["cases"] if case["name"] == "chatqa2-dp4-cp8-0")
    problem = make_problem(sequence_lengths=case["lengths"], dp_size=case["dp_size"], cp_size=case["cp_size"],
                           model="qwen2.5-0.5b", bucket_size=case["max_seqlen_per_rank"])
    plan = dynamic_cp(problem)
    assert len(plan.spanning) == len(case["sample_id_groups"])
    for spanning, ranks_ids in zip(plan.spanning, case["sample_id_groups"], strict=True):
        packed = [[] for _ in ranks_ids]  # type: list[list[int]]
        for index, degree, first in spanning.micro_batch.places():
            for rank in range(first, first + degree):
                packed[rank].append(index)
        assert [sorted(ids) for ids in packed] == [sorted(ids) for ids in ranks_ids]


@pytest.mark.parametrize(("dp_size", "cp_size"), [(1, 1), (3, 2), (3, 6)])
def test_refuses_pools_megatron_does_not_run_by_name(dp_size: int, cp_size: int) -> None:
    # [150, 225] over 18 ranks of 31 tokens makes the original's fill step raise IndexError
    problem = make_problem(sequence_lengths=[15, 22], dp_size=dp_size, cp_size=cp_size, model="tiny",
                           bucket_size=31)
    with pytest.raises(BaselineCannotPlanError, match=rf"dynamic_cp cannot plan .* = {dp_size * cp_size}"):
        dynamic_cp(problem)


def _one_round(problem: PlanningProblem) -> tuple[float, float]:
    """(as Megatron runs it, as Skrull's trainer runs it) of a batch dynamic CP plans in one micro-batch."""
    plan = dynamic_cp(problem)
    assert len(plan.spanning or plan.dp_ranks[0].micro_batches) == 1
    return megatron_estimate(problem, plan).iteration_time_s, simulate(problem, plan).iteration_time_s


def test_a_round_of_whole_sequences_costs_what_the_simulator_says() -> None:
    # every group of one rank: no communication, the same compute, β and lockstep over the pool
    problem = make_problem(sequence_lengths=[900, 700, 500, 300] * 4, dp_size=2, cp_size=2, model="qwen2.5-0.5b",
                           bucket_size=4000, profile=ADDITIVE_PROFILE)
    megatron_s, skrull_trainer_s = _one_round(problem)
    assert megatron_s == pytest.approx(skrull_trainer_s, rel=1e-12)


def test_ring_overlap_and_backward_volume_price_a_sharded_sequence() -> None:
    # one sequence over the whole pool of 4: its ring hides (s-1)/s of its own attention; its backward moves K/V
    # and dK/dV; Skrull's trainer hides nothing behind it (no whole sequence on the ranks) and moves dK/dV only
    length, pool = 60_000, 4
    problem = make_problem(sequence_lengths=[length], dp_size=2, cp_size=2, model="qwen2.5-7b",
                           bucket_size=length // pool, profile=ADDITIVE_PROFILE)
    world = problem.span_problem(2)
    tables, d = world.tables, world.tables.degree_row[pool]
    all_gather = tables.all_gather_s_per_token[d] * length + tables.all_gather_fixed_s[d]
    reduce_scatter = tables.reduce_scatter_s_per_token[d] * length + tables.reduce_scatter_fixed_s[d]
    attention_s = tables.alpha_s_per_flop * float(world.perf.placement_attention_flops(np.array([length]), pool)[0])
    share, hidden = tables.attention_forward_share, (pool - 1) / pool
    compute_s = tables.alpha_s_per_flop * tables.rank_flops[d, 0] + tables.beta_s
    expected = compute_s + (max(0.0, all_gather - hidden * share * attention_s)
                            + max(0.0, all_gather + reduce_scatter - hidden * (1 - share) * attention_s))
    megatron_s, skrull_trainer_s = _one_round(problem)
    assert megatron_s == pytest.approx(expected, rel=1e-12)
    assert skrull_trainer_s == pytest.approx(compute_s + all_gather + reduce_scatter, rel=1e-12)


def test_micro_batches_run_in_lockstep_one_after_another() -> None:
    case = next(case for case in FIXTURE["cases"] if case["name"] == "longtail64k-dp4-cp8-0")
    problem = make_problem(sequence_lengths=case["lengths"], dp_size=4, cp_size=8, model="qwen2.5-0.5b",
                           bucket_size=case["max_seqlen_per_rank"], profile=ADDITIVE_PROFILE)
    estimate = megatron_estimate(problem, dynamic_cp(problem))
    assert len(estimate.micro_batch_times_s) == len(case["sample_id_groups"]) > 1
    assert estimate.iteration_time_s == pytest.approx(sum(estimate.micro_batch_times_s))
