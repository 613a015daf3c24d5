"""The exact CP-SAT scheduler: valid plans, true optima on tiny batches, true lower bounds."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator, Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_service.core import cpsat
from scheduler_service.core.check import check_plan
from scheduler_service.core.errors import InvalidRequestError, PlanCheckError
from scheduler_service.core.gds import skrull, skrull_binary
from scheduler_service.core.plan import (
    DPRankPlan,
    MicroBatch,
    Plan,
    PlanningProblem,
    ShardedGroup,
    SpanningMicroBatch,
    block_degrees,
    cp_blocks,
    make_problem,
)
from scheduler_service.core.planner import make_plan
from scheduler_service.core.simulate import simulate
from tests.problem_builders import ADDITIVE_PROFILE, LAUNCH_BOUND_FLOOR_S_PER_LAYER, with_floor

pytestmark = pytest.mark.cpsat

# The model floors every cost to whole nanoseconds, so its optimum may trail the true one by about a
# nanosecond per sequence and fixed cost; 100 ns is far above that and far below any real difference.
QUANTISATION_TOLERANCE_S = 1e-7


def _problem(lengths: Sequence[int], *, dp_size: int, cp_size: int, bucket_size: int | None,
             floor_s_per_layer: float = 0.0) -> PlanningProblem:
    return make_problem(sequence_lengths=list(lengths), dp_size=dp_size, cp_size=cp_size, model="qwen2.5-0.5b",
                        bucket_size=bucket_size,
                        profile=with_floor(floor_s_per_layer) if floor_s_per_layer else ADDITIVE_PROFILE)


def _one_sequence_per_micro_batch(problem: PlanningProblem) -> Plan:
    """A plan that is always valid: every sequence alone, distributed, dealt round-robin over DP ranks."""
    return Plan(dp_ranks=tuple(
        DPRankPlan(micro_batches=tuple(
            MicroBatch(local=((),) * problem.cp_size, distributed=(index,))
            for index in range(dp_rank, problem.num_sequences, problem.dp_size)
        ))
        for dp_rank in range(problem.dp_size)
    ))


def _assert_valid(problem: PlanningProblem, plan: Plan) -> None:
    check_plan(plan, sequence_lengths=problem.sequence_lengths, dp_size=problem.dp_size, cp_size=problem.cp_size,
               bucket_size=problem.bucket_size)


def _long_tailed_lengths(seed: int, num_sequences: int, cap: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(min(length, cap)) for length in np.exp(rng.normal(np.log(3000), 1.5, num_sequences)) + 16]


# -- brute force, written without reference to the CP-SAT model --------------------------------------------------

def _set_partitions(items: list[int]) -> Iterator[list[list[int]]]:
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for partition in _set_partitions(rest):
        yield [[first], *partition]
        for position in range(len(partition)):
            yield [*partition[:position], [first, *partition[position]], *partition[position + 1:]]


def _fits(problem: PlanningProblem, micro_batch: MicroBatch) -> bool:
    """The memory bound of docs/design.md, "Wire contract", on every CP rank, in tokens × N."""
    lengths, cp_size = problem.sequence_lengths, problem.cp_size
    distributed_tokens = sum(lengths[index] for index in micro_batch.distributed)
    return all(
        cp_size * sum(lengths[index] for index in rank_local) + distributed_tokens + sum(
            cp_size // group.degree * sum(lengths[index] for index in group.sequences)
            for group in micro_batch.sharded if cp_rank in group.cp_ranks)
        <= cp_size * problem.bucket_size
        for cp_rank, rank_local in enumerate(micro_batch.local))


def _places(cp_size: int, *, hybrid: bool) -> list[tuple[int, ...]]:
    """Where a sequence can go in a micro-batch, as the CP ranks it runs on: each rank whole, each aligned block
    (hybrid only), and the whole group (listed last)."""
    blocks = [block for degree in block_degrees(cp_size) for block in cp_blocks(cp_size, degree)] if hybrid else []
    return [*((rank,) for rank in range(cp_size)), *blocks, tuple(range(cp_size))]


def _best_micro_batch(problem: PlanningProblem, members: tuple[int, ...], *, hybrid: bool = False,
                      ) -> MicroBatch | None:
    """The fastest feasible placement of ``members`` as one micro-batch, by trying every placement."""
    best, best_time_s = None, float("inf")
    places = _places(problem.cp_size, hybrid=hybrid)
    whole_group = len(places) - 1
    for placement in itertools.product(range(len(places)), repeat=len(members)):
        at = [tuple(m for m, chosen in zip(members, placement, strict=True) if chosen == place)
              for place in range(len(places))]
        micro_batch = MicroBatch(
            local=tuple(at[:problem.cp_size]),
            distributed=at[whole_group],
            sharded=tuple(ShardedGroup(cp_ranks=places[place], sequences=at[place])
                          for place in range(problem.cp_size, whole_group) if at[place]),
        )
        if not _fits(problem, micro_batch):
            continue
        time_s = simulate(problem, Plan(dp_ranks=(DPRankPlan(micro_batches=(micro_batch,)),))).iteration_time_s
        if time_s < best_time_s:
            best, best_time_s = micro_batch, time_s
    return best


def _brute_force(problem: PlanningProblem, *, hybrid: bool = False) -> tuple[float, Plan]:
    """Every split of the batch into micro-batches, every DP rank for each, every placement inside each."""
    best_micro_batch: dict[tuple[int, ...], MicroBatch | None] = {}
    best_time_s, best_plan = float("inf"), None
    for partition in _set_partitions(list(range(problem.num_sequences))):
        micro_batches: list[MicroBatch] = []
        for block in partition:
            members = tuple(sorted(block))
            if members not in best_micro_batch:
                best_micro_batch[members] = _best_micro_batch(problem, members, hybrid=hybrid)
            best = best_micro_batch[members]
            if best is None:  # these sequences do not fit in one micro-batch
                break
            micro_batches.append(best)
        else:
            for owners in itertools.product(range(problem.dp_size), repeat=len(micro_batches)):
                plan = Plan(dp_ranks=tuple(
                    DPRankPlan(micro_batches=tuple(mb for mb, owner in zip(micro_batches, owners, strict=True)
                                                   if owner == dp_rank))
                    for dp_rank in range(problem.dp_size)
                ))
                time_s = simulate(problem, plan).iteration_time_s
                if time_s < best_time_s:
                    best_time_s, best_plan = time_s, plan
    assert best_plan is not None
    return best_time_s, best_plan


def _brute_force_spanning(problem: PlanningProblem) -> float:
    """The fastest plan of a batch of two DP replicas when a micro-batch may also span both (docs/design.md,
    "Blocks that span DP replicas"): every split into micro-batches, each micro-batch on either replica or over
    both, every placement inside each."""
    assert problem.dp_size == 2
    span = problem.span_problem(2)
    best_micro_batch: dict[tuple[tuple[int, ...], int], MicroBatch | None] = {}

    def best(members: tuple[int, ...], owner: int) -> MicroBatch | None:
        if (members, owner < 2) not in best_micro_batch:
            best_micro_batch[members, owner < 2] = _best_micro_batch(problem if owner < 2 else span, members,
                                                                     hybrid=True)
        return best_micro_batch[members, owner < 2]

    best_time_s = float("inf")
    for partition in _set_partitions(list(range(problem.num_sequences))):
        blocks = [tuple(sorted(block)) for block in partition]
        for owners in itertools.product(range(3), repeat=len(blocks)):  # replica 0, replica 1, or both
            micro_batches = [best(block, owner) for block, owner in zip(blocks, owners, strict=True)]
            if any(micro_batch is None for micro_batch in micro_batches):
                continue
            plan = Plan(
                dp_ranks=tuple(DPRankPlan(micro_batches=tuple(
                    mb for mb, owner in zip(micro_batches, owners, strict=True) if owner == dp_rank and mb))
                    for dp_rank in range(2)),
                spanning=tuple(SpanningMicroBatch(first_dp_rank=0, num_dp_ranks=2, micro_batch=mb)
                               for mb, owner in zip(micro_batches, owners, strict=True) if owner == 2 and mb))
            best_time_s = min(best_time_s, simulate(problem, plan).iteration_time_s)
    return best_time_s


TINY_BATCHES = [
    # (lengths, dp_size, cp_size, bucket_size): memory binds in each, so placement and splitting matter.
    ([3000, 2500, 1800, 900, 400], 1, 2, 2600),
    ([5000, 3100, 3000, 700, 650], 2, 1, 6000),
    ([4200, 2600, 2500, 1200, 300], 2, 2, 2700),
    ([6000, 2000, 1900, 1800, 500, 120], 2, 2, 3200),
    ([1500, 1400, 1300, 1200, 1100, 1000], 2, 2, 1600),
    ([3500, 900, 800, 200, 150, 100], 1, 2, 2000),
]


@pytest.mark.parametrize("floor_s_per_layer", [0.0, LAUNCH_BOUND_FLOOR_S_PER_LAYER], ids=["additive", "floor"])
@pytest.mark.parametrize(("lengths", "dp_size", "cp_size", "bucket_size"), TINY_BATCHES)
def test_cpsat_matches_brute_force_on_tiny_batches(
    lengths: list[int], dp_size: int, cp_size: int, bucket_size: int, floor_s_per_layer: float
) -> None:
    problem = _problem(lengths, dp_size=dp_size, cp_size=cp_size, bucket_size=bucket_size,
                       floor_s_per_layer=floor_s_per_layer)
    optimum_s, optimal_plan = _brute_force(problem)
    _assert_valid(problem, optimal_plan)

    solution = cpsat.solve(problem, time_limit_s=30.0, hint=_one_sequence_per_micro_batch(problem))

    _assert_valid(problem, solution.plan)
    assert solution.report.status == "OPTIMAL"
    assert solution.report.objective_s == pytest.approx(optimum_s, abs=QUANTISATION_TOLERANCE_S)
    assert solution.report.objective_s == simulate(problem, solution.plan).iteration_time_s
    assert solution.report.bound_s is not None
    assert solution.report.bound_s <= optimum_s


@pytest.mark.parametrize(("seed", "dp_size", "cp_size", "bucket_size"), [(0, 2, 4, None), (2, 4, 8, 4096)])
def test_proves_optimality_on_a_sixteen_sequence_batch(
    seed: int, dp_size: int, cp_size: int, bucket_size: int | None
) -> None:
    cap = cp_size * (bucket_size or _problem([1], dp_size=dp_size, cp_size=cp_size, bucket_size=None).bucket_size)
    problem = _problem(_long_tailed_lengths(seed, 16, cap), dp_size=dp_size, cp_size=cp_size, bucket_size=bucket_size)
    hint = _one_sequence_per_micro_batch(problem)

    solution = cpsat.solve(problem, time_limit_s=60.0, hint=hint)

    _assert_valid(problem, solution.plan)
    assert solution.report.status == "OPTIMAL"
    assert solution.report.bound_s is not None and solution.report.objective_s is not None
    assert solution.report.bound_s == pytest.approx(solution.report.objective_s, abs=QUANTISATION_TOLERANCE_S)
    assert solution.report.objective_s < simulate(problem, hint).iteration_time_s


def test_bound_is_below_the_objective_and_below_any_other_plan() -> None:
    problem = _problem(_long_tailed_lengths(1, 12, 4 * 4096), dp_size=2, cp_size=4, bucket_size=4096)
    hint = _one_sequence_per_micro_batch(problem)

    started_s = time.perf_counter()
    report = cpsat.solve(problem, time_limit_s=1.0, hint=hint).report
    elapsed_s = time.perf_counter() - started_s

    assert report.bound_s is not None and report.objective_s is not None
    assert 0.0 < report.bound_s <= report.objective_s
    assert report.bound_s <= simulate(problem, hint).iteration_time_s
    # the solver's own clock, in seconds: inside the call that ran it (not milliseconds, not a constant)
    assert 0.0 < report.wall_time_s <= elapsed_s


def test_returns_the_hint_or_better_when_the_time_limit_is_tiny() -> None:
    problem = _problem(_long_tailed_lengths(2, 16, 8 * 41302), dp_size=4, cp_size=8, bucket_size=None)
    hint = _one_sequence_per_micro_batch(problem)

    solution = cpsat.solve(problem, time_limit_s=0.0, hint=hint)

    _assert_valid(problem, solution.plan)
    assert solution.report.status in {"OPTIMAL", "FEASIBLE", "UNKNOWN"}
    assert solution.report.objective_s is not None
    assert solution.report.objective_s == simulate(problem, solution.plan).iteration_time_s
    assert solution.report.objective_s <= simulate(problem, hint).iteration_time_s
    if solution.report.status == "UNKNOWN":
        assert solution.plan == hint


def test_solves_without_a_hint_and_leaves_extra_dp_ranks_empty() -> None:
    problem = _problem([5000, 300, 2200], dp_size=4, cp_size=2, bucket_size=3000)

    solution = cpsat.solve(problem, time_limit_s=10.0)

    _assert_valid(problem, solution.plan)
    assert solution.report.status == "OPTIMAL"
    assert len(solution.plan.dp_ranks) == 4
    assert sum(1 for dp_rank in solution.plan.dp_ranks if not dp_rank.micro_batches) >= 1


def test_rejects_a_batch_too_large_for_the_exact_model() -> None:
    problem = _problem([100] * 300, dp_size=4, cp_size=8, bucket_size=4096)

    with pytest.raises(InvalidRequestError, match="placement booleans"):
        cpsat.solve(problem, time_limit_s=1.0)


def test_rejects_an_invalid_hint() -> None:
    problem = _problem([1000, 2000], dp_size=1, cp_size=2, bucket_size=4000)
    missing_a_sequence = Plan(dp_ranks=(DPRankPlan(micro_batches=(MicroBatch(local=((0,), ()), distributed=()),)),))

    with pytest.raises(PlanCheckError):
        cpsat.solve(problem, time_limit_s=1.0, hint=missing_a_sequence)


def test_rejects_a_hint_with_spanning_micro_batches() -> None:
    problem = _problem([6000, 500, 400, 300, 200], dp_size=2, cp_size=1, bucket_size=6000)
    spanned = make_plan(problem).plan
    assert spanned.spanning  # one replica would run the 6000-token sequence alone
    with pytest.raises(ValueError, match="spanning micro-batches"):
        cpsat.solve(problem, time_limit_s=1.0, hint=spanned)


SMALL_CP_SIZES = st.integers(min_value=1, max_value=4)


@st.composite
def _small_problems(draw: st.DrawFn, cp_sizes: st.SearchStrategy[int] = SMALL_CP_SIZES,
                    max_dp_size: int = 3) -> PlanningProblem:
    dp_size = draw(st.integers(min_value=1, max_value=max_dp_size))
    cp_size = draw(cp_sizes)
    bucket_size = draw(st.integers(min_value=500, max_value=3000))
    lengths = draw(st.lists(st.integers(min_value=1, max_value=bucket_size * cp_size), min_size=1, max_size=7))
    return _problem(lengths, dp_size=dp_size, cp_size=cp_size, bucket_size=bucket_size)


@settings(max_examples=15, deadline=None)
@given(problem=_small_problems())
def test_plans_pass_the_checker_and_never_lose_to_the_hint(problem: PlanningProblem) -> None:
    hint = _one_sequence_per_micro_batch(problem)

    solution = cpsat.solve(problem, time_limit_s=2.0, hint=hint)

    _assert_valid(problem, solution.plan)
    assert solution.report.objective_s is not None and solution.report.bound_s is not None
    assert solution.report.bound_s <= solution.report.objective_s <= simulate(problem, hint).iteration_time_s


def test_same_problem_gives_the_same_plan_when_stopped_before_optimality() -> None:
    """The contract's determinism holds for cpsat too: the stop is CP-SAT's deterministic time, not the clock."""
    problem = _problem(_long_tailed_lengths(1, 12, 4 * 4096), dp_size=2, cp_size=4, bucket_size=4096)
    hint = _one_sequence_per_micro_batch(problem)

    first = cpsat.solve(problem, time_limit_s=1.0, hint=hint)
    second = cpsat.solve(problem, time_limit_s=1.0, hint=hint)

    assert first.report.status == "FEASIBLE"  # stopped by the limit: the case a wall-clock limit made random
    assert second.plan == first.plan
    assert second.report.objective_s == first.report.objective_s


# -- the hybrid space ------------------------------------------------------------------------------------------------

HYBRID_TINY_BATCHES = [
    # (lengths, dp_size, cp_size, bucket_size): mid-length sequences that fit a block of 2 but not one rank.
    ([12000, 7000, 6000, 900], 1, 4, 4096),
    ([9000, 5000, 4000, 1500, 700], 1, 4, 3000),
    ([7000, 6500, 3000, 2500, 800], 2, 4, 4096),
]


@pytest.mark.parametrize(("lengths", "dp_size", "cp_size", "bucket_size"), HYBRID_TINY_BATCHES)
def test_hybrid_cpsat_matches_brute_force_over_every_block_on_tiny_batches(
    lengths: list[int], dp_size: int, cp_size: int, bucket_size: int
) -> None:
    problem = _problem(lengths, dp_size=dp_size, cp_size=cp_size, bucket_size=bucket_size)
    optimum_s, optimal_plan = _brute_force(problem, hybrid=True)
    _assert_valid(problem, optimal_plan)

    solution = cpsat.solve(problem, time_limit_s=30.0, hint=_one_sequence_per_micro_batch(problem), hybrid=True)

    _assert_valid(problem, solution.plan)
    assert solution.report.status == "OPTIMAL"
    assert solution.report.objective_s == pytest.approx(optimum_s, abs=QUANTISATION_TOLERANCE_S)
    assert solution.report.objective_s == simulate(problem, solution.plan).iteration_time_s
    # proven optimal, the model's time is the simulator's: a cost the model missed would show here
    assert solution.report.bound_s == pytest.approx(optimum_s, abs=QUANTISATION_TOLERANCE_S)
    binary_s = cpsat.solve(problem, time_limit_s=30.0).report.objective_s
    assert binary_s is not None and optimum_s <= binary_s + QUANTISATION_TOLERANCE_S


def test_the_hybrid_optimum_of_a_batch_uses_a_block_and_beats_the_binary_one() -> None:
    """The precondition that gives the brute-force test above its teeth: blocks matter on these batches."""
    problem = _problem(*HYBRID_TINY_BATCHES[0][:1], dp_size=1, cp_size=4, bucket_size=4096)
    hybrid = cpsat.solve(problem, time_limit_s=30.0, hint=skrull(problem), hybrid=True)
    binary = cpsat.solve(problem, time_limit_s=30.0, hint=skrull_binary(problem))
    assert hybrid.report.status == binary.report.status == "OPTIMAL"
    assert any(mb.sharded for dp_rank in hybrid.plan.dp_ranks for mb in dp_rank.micro_batches)
    assert hybrid.report.objective_s is not None and binary.report.objective_s is not None
    assert hybrid.report.objective_s < binary.report.objective_s


def test_the_binary_space_rejects_a_hint_with_hybrid_groups() -> None:
    problem = _problem(*HYBRID_TINY_BATCHES[0][:1], dp_size=1, cp_size=4, bucket_size=4096)
    hint = cpsat.solve(problem, time_limit_s=30.0, hybrid=True).plan
    assert any(mb.sharded for dp_rank in hint.dp_ranks for mb in dp_rank.micro_batches)

    with pytest.raises(ValueError, match="hybrid groups"):
        cpsat.solve(problem, time_limit_s=1.0, hint=hint)


@settings(max_examples=12, deadline=None)
@given(problem=_small_problems(cp_sizes=st.sampled_from([4, 6, 8]), max_dp_size=2))
def test_hybrid_plans_pass_the_checker_and_never_lose_to_skrull(problem: PlanningProblem) -> None:
    hint = skrull(problem)

    solution = cpsat.solve(problem, time_limit_s=1.0, hint=hint, hybrid=True)

    _assert_valid(problem, solution.plan)
    assert solution.report.objective_s is not None and solution.report.bound_s is not None
    assert solution.report.objective_s == simulate(problem, solution.plan).iteration_time_s
    assert solution.report.bound_s <= solution.report.objective_s <= simulate(problem, hint).iteration_time_s


SPANNING_BATCHES = [
    # (lengths, cp_size, bucket_size) of two DP replicas: one replica would run the long sequence alone, or no CP
    # group holds it
    ([6000, 500, 400, 300, 200], 1, 6000),
    ([5000, 3100, 3000, 700, 650], 1, 6000),
    ([9000, 500, 400, 300], 2, 3000),
    ([7000, 3000, 600, 500], 2, 4000),
    ([12000, 800, 700], 2, 3500),
]


@pytest.mark.parametrize("floor_s_per_layer", [0.0, LAUNCH_BOUND_FLOOR_S_PER_LAYER], ids=["additive", "floor"])
@pytest.mark.parametrize(("lengths", "cp_size", "bucket_size"), SPANNING_BATCHES)
def test_skrull_loses_no_more_to_the_spanning_optimum_than_to_the_optimum_within_groups(
    lengths: list[int], cp_size: int, bucket_size: int, floor_s_per_layer: float
) -> None:
    problem = _problem(lengths, dp_size=2, cp_size=cp_size, bucket_size=bucket_size,
                       floor_s_per_layer=floor_s_per_layer)
    skrull_s = make_plan(problem).estimate.iteration_time_s
    gap_within_groups = 1.0  # today's: how far Skrull within CP groups is from the optimum within CP groups
    if not problem.too_long_for_a_replica():
        gap_within_groups = max(1.0, simulate(problem, skrull(problem)).iteration_time_s
                                / _brute_force(problem, hybrid=True)[0])
    assert skrull_s <= _brute_force_spanning(problem) * gap_within_groups + QUANTISATION_TOLERANCE_S
