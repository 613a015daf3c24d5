"""Hybrid DACP in the core: groups on aligned blocks, exact memory, never worse than binary, a true lower bound."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler_service.core import baselines, dacp, dacp_search, gds
from scheduler_service.core.check import find_violations
from scheduler_service.core.costing import empty_sums, rank_time_s
from scheduler_service.core.dacp_search import BINARY, CAP_CANDIDATES, HYBRID, STATIC
from scheduler_service.core.errors import BaselineCannotPlanError
from scheduler_service.core.gds_search import spread_longest_first
from scheduler_service.core.plan import DPRankPlan, MicroBatch, Plan, PlanningProblem, ShardedGroup, make_problem
from scheduler_service.core.planner import HEURISTIC_SCHEDULERS, make_plan, schedule
from scheduler_service.core.simulate import (
    iteration_lower_bound_s,
    iteration_lower_bounds_s,
    micro_batch_sums,
    micro_batch_time_s,
    simulate,
)
from tests.problem_builders import (
    ADDITIVE_PROFILE,
    LAUNCH_BOUND_FLOOR_S_PER_LAYER,
    ProblemFactory,
    hybrid_problems,
    refusal_is_the_peers_own,
    with_floor,
)

LENGTHS = [9000, 7000, 5000, 3000]


def one_micro_batch(micro_batch: MicroBatch) -> Plan:
    return Plan(dp_ranks=(DPRankPlan(micro_batches=(micro_batch,)),))


def check(micro_batch: MicroBatch, *, cp_size: int = 4, bucket_size: int = 10_000) -> list[str]:
    return find_violations(one_micro_batch(micro_batch), sequence_lengths=LENGTHS, dp_size=1, cp_size=cp_size,
                           bucket_size=bucket_size)


def group(cp_ranks: tuple[int, ...], *sequences: int) -> ShardedGroup:
    return ShardedGroup(cp_ranks=cp_ranks, sequences=sequences)


def test_checker_accepts_groups_on_aligned_blocks_side_by_side() -> None:
    micro_batch = MicroBatch(local=((), (), (3,), ()), distributed=(2,),
                             sharded=(group((0, 1), 0), group((2, 3), 1)))
    assert check(micro_batch) == []


@pytest.mark.parametrize("cp_ranks", [(1, 2), (0, 2), (0, 1, 2), (0, 1, 2, 3), (4, 5), (3,)])
def test_checker_rejects_a_group_that_is_not_an_aligned_block_of_a_dividing_size(cp_ranks: tuple[int, ...]) -> None:
    micro_batch = MicroBatch(local=((1, 2, 3), (), (), ()), distributed=(), sharded=(group(cp_ranks, 0),))
    found = check(micro_batch, bucket_size=100_000)
    assert len(found) == 1 and "dp_ranks[0].micro_batches[0].sharded[0]" in found[0]


def test_checker_counts_a_rank_in_two_groups_exactly() -> None:
    # CP rank 0 holds 9000/2 + 7000/2 = 8000 tokens: fits 8000 exactly, not 7999.
    micro_batch = MicroBatch(local=((), (), (2,), (3,)), distributed=(), sharded=(group((0, 1), 0, 1),))
    assert check(micro_batch, bucket_size=8000) == []
    over = MicroBatch(local=((), (), (2,), (3,)), distributed=(), sharded=(group((0, 1), 0), group((0, 1), 1)))
    found = check(over, bucket_size=7999)
    assert found == [
        "dp_ranks[0].micro_batches[0] CP rank 0 holds 0 local + 0/4 distributed + 9000/2 sharded over [0, 1] + "
        "7000/2 sharded over [0, 1] tokens > bucket_size 7999",
        "dp_ranks[0].micro_batches[0] CP rank 1 holds 0 local + 0/4 distributed + 9000/2 sharded over [0, 1] + "
        "7000/2 sharded over [0, 1] tokens > bucket_size 7999",
    ]


def test_checker_finds_a_sequence_both_local_and_in_a_group() -> None:
    micro_batch = MicroBatch(local=((0,), (1,), (2,), (3,)), distributed=(), sharded=(group((0, 1), 0),))
    assert any("sequence 0 is scheduled twice" in v for v in check(micro_batch, bucket_size=100_000))


def spread(problem: PlanningProblem, count: int) -> list[list[int]]:
    """GDS's cut of all the problem's sequences into ``count`` micro-batches (none if the tokens do not fit)."""
    longest_first = np.lexsort((np.arange(problem.num_sequences), -problem.lengths))
    group_of = np.empty(problem.num_sequences, dtype=np.int64)
    if not spread_longest_first(problem.lengths, longest_first, count, problem.micro_batch_capacity, group_of):
        return []
    groups = [longest_first[group_of == group].tolist() for group in range(count)]
    return [group for group in groups if group]


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problem=hybrid_problems())
def test_hybrid_dacp_keeps_the_exact_bound_and_is_never_slower_than_binary(problem: PlanningProblem) -> None:
    for micro_batch_indices in spread(problem, -(-sum(problem.sequence_lengths) // problem.micro_batch_capacity) * 2):
        hybrid = dacp.dacp_hybrid(problem, micro_batch_indices, refine=False)
        binary = dacp.dacp_balanced(problem, micro_batch_indices, refine=False)
        assert hybrid is not None and binary is not None
        assert sorted(hybrid.indices()) == sorted(micro_batch_indices)
        plan = one_micro_batch(hybrid)
        lengths = [n if i in micro_batch_indices else 1 for i, n in enumerate(problem.sequence_lengths)]
        found = find_violations(plan, sequence_lengths=lengths, dp_size=1, cp_size=problem.cp_size,
                                bucket_size=problem.bucket_size)
        assert [v for v in found if "not scheduled" not in v] == []
        assert micro_batch_time_s(problem, hybrid) <= micro_batch_time_s(problem, binary) * (1 + 1e-12)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problem=hybrid_problems())
def test_a_decision_is_timed_as_the_simulator_times_it_and_refining_never_slows_it(problem: PlanningProblem) -> None:
    for group in spread(problem, -(-sum(problem.sequence_lengths) // problem.micro_batch_capacity) * 2):
        for space in (HYBRID, BINARY, STATIC):
            decided, refined = dacp.decide(problem, group, space, refine=False), dacp.decide(problem, group, space)
            assert decided is not None and refined is not None
            for micro_batch, time_s in (decided, refined):
                assert sorted(micro_batch.indices()) == sorted(group)
                assert time_s == pytest.approx(micro_batch_time_s(problem, micro_batch), rel=1e-9)
            assert refined[1] <= decided[1] * (1 + 1e-12)


@pytest.mark.parametrize(("lengths", "bucket_size"), [
    ([2000, 1728, 725, 13], 6492),  # moving the 13-token sequence onto rank 0 raised the time
    ([528, 1226, 215, 1276, 811, 5927, 25, 5013], 6122),  # the move lowers the load, not the time
])
def test_the_refinement_keeps_a_move_only_if_the_time_falls(lengths: list[int], bucket_size: int) -> None:
    # A move off the slowest rank lowers its load, but the receiving rank's collectives (it is in a block of
    # ranks) may be hidden less: its time can rise above the old maximum.
    problem = make_problem(sequence_lengths=lengths, dp_size=1, cp_size=4, model="qwen2.5-0.5b",
                           bucket_size=bucket_size)
    decided, refined = (dacp.decide(problem, range(len(lengths)), HYBRID, refine=refine) for refine in (False, True))
    assert decided is not None and refined is not None
    assert micro_batch_time_s(problem, refined[0]) <= decided[1] * (1 + 1e-12)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problem=hybrid_problems())
def test_no_scheduler_beats_the_iteration_lower_bound(problem: PlanningProblem) -> None:
    lower_bound_s = iteration_lower_bound_s(problem)
    for name, scheduler in HEURISTIC_SCHEDULERS.items():
        try:
            plan = scheduler(problem)
        except BaselineCannotPlanError as error:  # a peer that cannot plan the batch plans nothing to bound
            assert refusal_is_the_peers_own(name, problem, error), error
            continue
        assert simulate(problem, plan).iteration_time_s >= lower_bound_s * (1 - 1e-12)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problem=hybrid_problems())
def test_no_plan_within_cp_groups_beats_the_bound_within_groups(problem: PlanningProblem) -> None:
    """The bound within groups is at least the bound over every plan, and no scheduler's plan with no spanning
    micro-batch (asked with spanning refused; Megatron's pools span the world whatever a client runs), nor Skrull's
    with its schemes chosen, beats it: the planner skips refining a plan within groups on it."""
    bounds = iteration_lower_bounds_s(problem)
    assert bounds.any_plan_s <= bounds.within_groups_s
    within_groups = dataclasses.replace(problem, spanning=False)
    for name, scheduler in HEURISTIC_SCHEDULERS.items():
        try:
            plan = scheduler(within_groups)
        except BaselineCannotPlanError as error:
            assert refusal_is_the_peers_own(name, within_groups, error), error
            continue
        if not plan.spanning:
            assert simulate(problem, plan).iteration_time_s >= bounds.within_groups_s * (1 - 1e-12), name
    # nor Skrull's, each collective's scheme chosen as the planner chooses them
    assert make_plan(within_groups).estimate.iteration_time_s >= bounds.within_groups_s * (1 - 1e-12)


@pytest.mark.parametrize("profile", ["h100-eager", "h100-paper"])
@pytest.mark.parametrize("lengths", [(40_000,), (40_000, 300), (60_000, 40_000)])
def test_the_bound_within_groups_is_the_plan_of_a_sequence_no_local_attention_hides(
        lengths: tuple[int, ...], profile: str) -> None:
    """A sequence that must be sharded, with nothing or too little beside it to hide its collective behind, takes
    its share, β and its whole communication: the bound within groups counts all three, so the best plan within
    groups meets it (compute alone would bound it about 4 % low)."""
    problem = make_problem(sequence_lengths=list(lengths), dp_size=2, cp_size=4, model="qwen2.5-0.5b",
                           bucket_size=26_000, profile=profile)
    within_groups = make_plan(dataclasses.replace(problem, spanning=False))
    assert within_groups.estimate.iteration_time_s == pytest.approx(
        iteration_lower_bounds_s(problem).within_groups_s, rel=1e-9)


@pytest.mark.parametrize("lengths", [(196, 196), (196, 190), (300, 250, 100)])
def test_the_lower_bound_prices_every_sequence_a_spanning_block_runs_cheaper(lengths: tuple[int, ...]) -> None:
    """Three replicas of one rank: a spanning block over all three runs two sequences (equally long, as the search
    above found, or not) in one micro-batch, and one over two replicas runs a sequence no replica holds. The bound
    prices every sequence whose share sets its costliest term on such blocks, of every spanning width."""
    problem = make_problem(sequence_lengths=lengths, dp_size=3, cp_size=1, model="qwen2.5-7b", bucket_size=256,
                           profile=with_floor(LAUNCH_BOUND_FLOOR_S_PER_LAYER))
    lower_bound_s = iteration_lower_bound_s(problem)
    for name in HEURISTIC_SCHEDULERS:
        try:
            plan, _ = schedule(problem, name)
        except BaselineCannotPlanError as error:
            assert refusal_is_the_peers_own(name, problem, error), error
            continue
        assert simulate(problem, plan).iteration_time_s >= lower_bound_s * (1 - 1e-12), name


def test_the_balanced_baseline_ends_with_one_micro_batch_each_when_a_sequence_overfills_one() -> None:
    """Called alone (the planner spans such a sequence first), it stops at the finest split instead of looking for
    a finer one forever."""
    problem = make_problem(sequence_lengths=[300, 100], dp_size=2, cp_size=1, model="tiny", bucket_size=256)
    assert [len(rank.micro_batches) for rank in baselines.balanced(problem).dp_ranks] == [1, 1]


def test_hybrid_shards_mid_length_sequences_over_blocks_where_that_is_cheaper(problem_of: ProblemFactory) -> None:
    # Four 24K sequences on cp 8 with 16K-token buckets, under the H100 profile: none fits whole, and binary
    # Skrull shards each over all 8 ranks in 1.5K-token attention chunks at low efficiency with full-group
    # collectives; blocks of 2 run them side by side in 6K-token chunks.
    problem = problem_of([24_576] * 4, dp_size=1, cp_size=8, bucket_size=16_384)
    hybrid, binary = make_plan(problem, "skrull"), make_plan(problem, "skrull_binary")
    groups = [g for mb in hybrid.plan.dp_ranks[0].micro_batches for g in mb.sharded]
    assert groups and all(g.degree < problem.cp_size for g in groups)
    assert hybrid.estimate.iteration_time_s < binary.estimate.iteration_time_s
    assert all(not mb.sharded for mb in binary.plan.dp_ranks[0].micro_batches)


def test_hybrid_tries_caps_above_the_binary_decisions_busiest_load() -> None:
    # 7000 and 6000 tokens on cp 4 with 4096-token buckets: side by side on blocks of 2 they beat sharding both over
    # all 4 ranks (the hybrid CP-SAT optimum of test_cpsat's batch is exactly this), but that packing's busiest
    # rank computes more than the highest cap below the binary decision's busiest rank allows: only a cap above
    # that rank, bounded by the binary decision's time, finds it.
    problem = make_problem(sequence_lengths=[12_000, 7_000, 6_000, 900], dp_size=1, cp_size=4,
                           model="qwen2.5-0.5b", bucket_size=4096, profile=ADDITIVE_PROFILE)
    indices = [1, 2]
    binary = dacp.dacp_balanced(problem, indices)
    hybrid = dacp.dacp_hybrid(problem, indices)
    assert binary is not None and hybrid is not None
    assert sorted(group.degree for group in hybrid.sharded) == [2, 2]
    assert micro_batch_time_s(problem, hybrid) < micro_batch_time_s(problem, binary)
    hybrid_busiest, binary_busiest = (micro_batch_sums(problem, micro_batch).work_flops.max()
                                      for micro_batch in (hybrid, binary))
    balanced = problem.area[indices].sum() / problem.cp_size
    highest_cap_below = balanced + (binary_busiest - balanced) * CAP_CANDIDATES / (CAP_CANDIDATES + 1)
    assert hybrid_busiest > highest_cap_below


def test_binary_and_paper_schedulers_never_form_groups(problem_of: ProblemFactory) -> None:
    problem = problem_of([16_384] * 8 + [300] * 20, dp_size=2, cp_size=8, bucket_size=16_384)
    for name in ("skrull_binary", "skrull_paper", "round_robin", "deepspeed", "sorted", "balanced"):
        plan = HEURISTIC_SCHEDULERS[name](problem)  # type: ignore[index]
        assert all(not mb.sharded for dp_rank in plan.dp_ranks for mb in dp_rank.micro_batches), name


def test_hybrid_packs_a_mix_of_mid_length_sequences_close_to_the_balanced_bound() -> None:
    # A ChatQA2-like micro-batch on cp 16 with 13K-token buckets: pieces of whole-block shares are coarse, so
    # placing each on the least-loaded block left ranks idle (18% over the bound); packing under a cap on every
    # rank's load forces finer pieces exactly where they are needed.
    lengths = [26_294, 23_781, 20_462, 18_471, 14_688, 12_643, 11_696, 10_493, 9_537, 3_241, 1_139, 928, 117, 46]
    problem = make_problem(sequence_lengths=lengths, dp_size=1, cp_size=16, model="qwen2.5-7b", bucket_size=13_000)
    indices = range(len(lengths))
    balanced_s = rank_time_s(problem.tables, float(problem.area.sum()) / problem.cp_size, 0.0, 0.0, 0.0, 0)
    hybrid = dacp.dacp_hybrid(problem, indices)
    binary = dacp.dacp_balanced(problem, indices)
    assert hybrid is not None and binary is not None
    assert micro_batch_time_s(problem, binary) > 1.3 * balanced_s
    assert micro_batch_time_s(problem, hybrid) < 1.15 * balanced_s
    assert {group.degree for group in hybrid.sharded} <= {2, 4, 8}


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problem=hybrid_problems())
def test_skrull_is_never_slower_than_binary_skrull(problem: PlanningProblem) -> None:
    hybrid_s = simulate(problem, gds.skrull(problem)).iteration_time_s
    assert hybrid_s <= simulate(problem, gds.skrull_binary(problem)).iteration_time_s * (1 + 1e-12)


def brute_force_best_gain(problem: PlanningProblem, ranks: list[int], busiest: int) -> float:
    """The refinement's specification: the largest drop of the busiest rank's pair maximum over every move and
    swap of whole sequences (sequence k on CP rank ``ranks[k]``) that keeps both ranks within the memory bound.
    Every pair is tried: a move is a swap with nothing (cost 0, no tokens)."""
    cp_size = problem.cp_size
    on_rank = np.asarray(ranks)
    costs = np.asarray(problem.rank_flops_at(1), dtype=np.float64)
    units = np.asarray(problem.sequence_lengths, dtype=np.int64) * cp_size
    loads = np.bincount(on_rank, weights=costs, minlength=cp_size)
    remaining = problem.bucket_size * cp_size - np.bincount(on_rank, weights=units, minlength=cp_size)
    ours = on_rank == busiest
    best = 0.0
    for other in range(cp_size):
        if other == busiest:
            continue
        gap = loads[busiest] - loads[other]
        theirs = on_rank == other
        their_costs = np.append(0.0, costs[theirs])
        their_units = np.append(0, units[theirs])
        delta = costs[ours][:, None] - their_costs[None, :]
        fits = ((remaining[other] + their_units[None, :] >= units[ours][:, None])
                & (remaining[busiest] + units[ours][:, None] >= their_units[None, :]))
        improving = fits & (delta > 0) & (delta < gap)
        if improving.any():
            best = max(best, float(np.minimum(delta, gap - delta)[improving].max()))
    return best


@st.composite
def crowded_placements(draw: st.DrawFn) -> tuple[PlanningProblem, list[int]]:
    """Sequences placed whole on drawn CP ranks, every rank then topped up with short ones until the next would not
    fit: memory decides which swaps are possible (a rank has room for a token count, not for a long sequence)."""
    cp_size = draw(st.sampled_from([2, 4, 8]))
    lengths = draw(st.lists(st.one_of(st.integers(1, 256), st.integers(1_024, 4_096)), min_size=1, max_size=40))
    ranks = draw(st.lists(st.integers(0, cp_size - 1), min_size=len(lengths), max_size=len(lengths)))
    bucket_size = max(sum(n for n, r in zip(lengths, ranks, strict=True) if r == rank) for rank in range(cp_size))
    bucket_size += draw(st.integers(0, 4_096))
    filler = draw(st.integers(16, 512))
    for rank in range(cp_size):
        free = bucket_size - sum(n for n, r in zip(lengths, ranks, strict=True) if r == rank)
        lengths += [filler] * (free // filler)
        ranks += [rank] * (free // filler)
    problem = make_problem(sequence_lengths=lengths, dp_size=1, cp_size=cp_size, bucket_size=bucket_size,
                           model=draw(st.sampled_from(["tiny", "qwen2.5-7b"])))
    return problem, ranks


@settings(max_examples=100, deadline=None)
@given(crowded=crowded_placements())
def test_the_refinement_finds_the_best_move_or_swap_of_every_pair(crowded: tuple[PlanningProblem, list[int]]) -> None:
    problem, ranks = crowded
    members = np.arange(problem.num_sequences, dtype=np.int64)
    degree = np.ones(problem.num_sequences, dtype=np.int64)
    first_rank = np.array(ranks, dtype=np.int64)
    sums = empty_sums(problem.tables, 1)
    dacp_search.replay_decision(problem.tables, members, degree, first_rank, sums)
    for busiest in range(problem.cp_size):
        gain, moved, _, _ = dacp_search.best_exchange(problem.tables, members, degree, first_rank, sums, busiest)
        expected = brute_force_best_gain(problem, ranks, busiest)
        assert (0.0 if moved < 0 else gain) == pytest.approx(expected, rel=1e-12, abs=0.0)
