"""The simulator: a plan's estimated time under the performance model.

Each CP rank of a micro-batch costs ``T_r`` (``costing.rank_time_s``: its share of every sequence placed on it,
``β`` once, and the collectives local attention does not hide). The trainer overlaps exactly what the model hides
for a rank in one collective. A rank in several waits for each gather just before its group's attention, so a
later gather also hides behind an earlier group's attention: for such ranks the model is pessimistic. A
micro-batch takes the max over CP ranks (eq. 1); a DP rank the sum over its micro-batches; an iteration the max
over DP ranks (eq. 8).

A spanning micro-batch (``plan.SpanningMicroBatch``) is priced as a micro-batch of its block's
``num_dp_ranks × cp_size`` ranks (``PlanningProblem.span_problem``). The replicas run the spanning ones first, in
plan order, each starting when the last of its replicas is free (``spanning_ready_s``); a replica's time is when its
own micro-batches end after that.

The per-rank sums come from the same kernels the searches use (``costing.sums_of_places``); the per-rank
breakdown of each micro-batch (``MicroBatchEstimate.cp_ranks``) is built when it is read, since most callers only
need the times.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import numpy.typing as npt
from numba import types

from scheduler_service.core.check import spanning_widths
from scheduler_service.core.costing import (
    TABLES,
    CostTables,
    RankSums,
    empty_sums,
    exposed_comm_s,
    padding_flops,
    place_degrees,
    rank_times_s,
    sums_of_places,
)
from scheduler_service.core.jit import FLOAT_3D, INT_1D, INT_2D, kernel
from scheduler_service.core.plan import DPRankPlan, MicroBatch, Places, Plan, PlanningProblem, SpanningMicroBatch
from scheduler_service.core.schemes import CHANGES, NO_CHANGES, BlockChanges, apply_changes, scheme_changes

__all__ = [
    "CPRankEstimate",
    "DPRankEstimate",
    "LowerBounds",
    "MicroBatchEstimate",
    "PlanEstimate",
    "dp_rank_times_s",
    "estimate_places",
    "estimate_plan",
    "iteration_lower_bound_s",
    "iteration_lower_bounds_s",
    "micro_batch_sums",
    "micro_batch_time_s",
    "simulate",
    "spanning_ready_s",
]

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True, kw_only=True, slots=True)
class CPRankEstimate:
    local_tokens: int
    tokens: float  # local + distributed / N + each group's tokens / its size: the memory-bound quantity
    local_compute_s: float  # whole sequences kept on this rank
    distributed_compute_s: float  # this rank's share of the sequences sharded over the whole CP group
    sharded_compute_s: float  # this rank's share of its hybrid groups' sequences
    fixed_s: float  # β: once per micro-batch with work
    padding_s: float  # the rank's row padded to its token bucket (0 without buckets)
    comm_s: float  # every collective this rank takes part in, forward and backward
    exposed_comm_s: float  # the part local attention does not hide
    launch_bound_s: float  # what the launch-bound floor adds beyond the device's work (0 when compute-bound)
    time_s: float  # local + distributed + sharded + fixed + padding + exposed_comm + launch_bound


@dataclass(frozen=True, slots=True)
class _PerRank:
    """A plan's per micro-batch and CP rank figures, (M, C) each: what the breakdowns are read from."""

    tables: CostTables
    sums: RankSums
    times_s: FloatArray
    compute_flops: FloatArray  # (3, M, C): local, distributed, sharded
    local_tokens: IntArray

    def cp_rank(self, m: int, r: int) -> CPRankEstimate:
        tables, sums = self.tables, self.sums
        alpha = tables.alpha_s_per_flop
        all_gather_s, reduce_scatter_s = float(sums.all_gather_s[m, r]), float(sums.reduce_scatter_s[m, r])
        unhidden_s = float(sums.exposed_s[m, r])
        comm_s = all_gather_s + reduce_scatter_s + unhidden_s
        time_s = float(self.times_s[m, r])
        busy = sums.work_flops[m, r] > 0
        fixed_s = tables.beta_s if busy else 0.0
        padding_s = alpha * padding_flops(tables, int(sums.units[m, r])) if busy else 0.0
        local_s, distributed_s, sharded_s = (alpha * float(self.compute_flops[part, m, r]) for part in range(3))
        exposed_s = (exposed_comm_s(tables, float(sums.attention_flops[m, r]), all_gather_s, reduce_scatter_s)
                     + unhidden_s if comm_s else 0.0)
        device_s = local_s + distributed_s + sharded_s + fixed_s + padding_s + exposed_s
        return CPRankEstimate(
            local_tokens=int(self.local_tokens[m, r]), tokens=int(sums.units[m, r]) / tables.cp_size,
            local_compute_s=local_s, distributed_compute_s=distributed_s, sharded_compute_s=sharded_s,
            fixed_s=fixed_s, padding_s=padding_s, comm_s=comm_s, exposed_comm_s=exposed_s,
            launch_bound_s=max(0.0, time_s - device_s) if busy else 0.0, time_s=time_s)


@dataclass(frozen=True, kw_only=True, slots=True)
class MicroBatchEstimate:
    """A micro-batch's time, set by its critical CP rank, and every CP rank's breakdown."""

    time_s: float
    critical_cp_rank: int
    _per_rank: _PerRank
    _m: int

    @property
    def cp_ranks(self) -> tuple[CPRankEstimate, ...]:
        return tuple(self._per_rank.cp_rank(self._m, r) for r in range(self._per_rank.tables.cp_size))

    @property
    def critical(self) -> CPRankEstimate:
        return self._per_rank.cp_rank(self._m, self.critical_cp_rank)


@dataclass(frozen=True, kw_only=True, slots=True)
class DPRankEstimate:
    time_s: float  # when its last micro-batch ends: its spanning ones (waits included), then its own
    micro_batches: tuple[MicroBatchEstimate, ...]  # its own


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanEstimate:
    iteration_time_s: float
    dp_ranks: tuple[DPRankEstimate, ...]
    peak_rank_tokens: float  # the most tokens a CP rank holds in any micro-batch (``CPRankEstimate.tokens``)
    spanning: tuple[MicroBatchEstimate, ...] = ()  # of ``Plan.spanning``, in order; ``cp_ranks`` over the block


@kernel(types.void(TABLES, INT_1D, INT_1D, INT_1D, FLOAT_3D, INT_2D))
def _compute_by_kind(tables: CostTables, micro_batch: IntArray, degree: IntArray, first_rank: IntArray,
                     compute_flops: FloatArray, local_tokens: IntArray) -> None:
    """Each rank's FLOP-equivalents of its local, distributed and sharded sequences, and its local tokens."""
    for k in range(micro_batch.shape[0]):
        m = micro_batch[k]
        if m < 0:
            continue
        kind = 0 if degree[k] == 1 else 1 if degree[k] == tables.cp_size else 2
        for r in range(first_rank[k], first_rank[k] + degree[k]):
            compute_flops[kind, m, r] += tables.rank_flops[tables.degree_row[degree[k]], k]
        if degree[k] == 1:
            local_tokens[m, first_rank[k]] += tables.lengths[k]


@kernel(types.void(TABLES, CHANGES, FLOAT_3D))
def _changed_compute(tables: CostTables, changes: BlockChanges, compute_flops: FloatArray) -> None:
    """``_compute_by_kind``'s sums with what the collectives' schemes change in their ranks' work."""
    for k in range(changes.micro_batch.shape[0]):
        kind = 1 if changes.degree[k] == tables.cp_size else 2
        for r in range(changes.first_rank[k], changes.first_rank[k] + changes.degree[k]):
            compute_flops[kind, changes.micro_batch[k], r] += changes.work_flops[k]


def _rank_times_of(problem: PlanningProblem, places: Places, micro_batches: Sequence[MicroBatch] = (),
                   changes: BlockChanges | None = None, rows: Sequence[int] | None = None,
                   ) -> tuple[RankSums, FloatArray, BlockChanges]:
    """The per micro-batch and CP rank sums of ``places`` with the schemes of its ``micro_batches`` (micro-batch
    ``i`` in row ``rows[i]``, by default as ``Plan.from_places`` orders the places, ``Places.plan_order``; none:
    all-gather-KV) or the ``changes`` they make when the caller has them (``schemes.choose_for_places``), their
    ``T_r`` (M, C), and the changes (``schemes.scheme_changes``)."""
    tables = problem.tables
    sums = empty_sums(tables, places.num_micro_batches)
    sums_of_places(tables, sums, places.micro_batch, places.degree, places.first_rank)
    if changes is None:
        changes = (scheme_changes(problem, micro_batches, places.plan_order() if rows is None else rows)
                   if micro_batches else NO_CHANGES)
    if len(changes.micro_batch):
        apply_changes(sums, changes)
    times_s = np.zeros((places.num_micro_batches, tables.cp_size))
    rank_times_s(tables, sums, times_s)
    return sums, times_s, changes


def _own_micro_batches(plan: Plan) -> list[MicroBatch]:
    """The plan's own micro-batches in place order, where any has a scheme other than all-gather-KV; else none."""
    own = [micro_batch for dp_plan in plan.dp_ranks for micro_batch in dp_plan.micro_batches]
    return own if any(c.ulysses_degree != 1 for mb in own for c in mb.collectives()) else []


def dp_rank_times_s(problem: PlanningProblem, places: Places) -> FloatArray:
    """(DP,) each DP rank's time in the plan ``places``: the sum of its micro-batches' (``estimate_places``'s
    ``DPRankEstimate.time_s``, without the breakdowns a search that compares plans does not read)."""
    _, times_s, _ = _rank_times_of(problem, places)
    busiest_s = times_s.max(axis=1, initial=0.0)  # numpy's stubs type a weighted bincount as integers: it is float64
    return np.bincount(places.dp_rank, weights=busiest_s, minlength=problem.dp_size).astype(np.float64, copy=False)


def estimate_places(problem: PlanningProblem, places: Places, micro_batches: Sequence[MicroBatch] = (),
                    changes: BlockChanges | None = None,
                    rows: Sequence[int] | None = None) -> PlanEstimate:
    """Estimated times of every micro-batch, DP rank and the iteration of the plan ``places``, its collectives by
    the schemes of ``micro_batches`` (its micro-batches in plan order; none: all-gather-KV), or by the ``changes``
    those schemes make, where the caller has them; ``rows``: as ``_rank_times_of``'s."""
    tables = problem.tables
    num_micro_batches = places.num_micro_batches
    sums, times_s, changes = _rank_times_of(problem, places, micro_batches, changes, rows)
    compute_flops = np.zeros((3, num_micro_batches, tables.cp_size))
    local_tokens = np.zeros((num_micro_batches, tables.cp_size), dtype=np.int64)
    _compute_by_kind(tables, places.micro_batch, places.degree, places.first_rank, compute_flops, local_tokens)
    if len(changes.micro_batch):
        _changed_compute(tables, changes, compute_flops)
    per_rank = _PerRank(tables, sums, times_s, compute_flops, local_tokens)
    critical = times_s.argmax(axis=1).tolist() if tables.cp_size else []
    micro_batch_times_s = times_s.max(axis=1, initial=0.0).tolist()
    by_dp_rank: list[list[MicroBatchEstimate]] = [[] for _ in range(problem.dp_size)]
    for m, dp_rank in enumerate(places.dp_rank.tolist()):
        by_dp_rank[dp_rank].append(MicroBatchEstimate(time_s=micro_batch_times_s[m], critical_cp_rank=critical[m],
                                                      _per_rank=per_rank, _m=m))
    dp_ranks = tuple(DPRankEstimate(time_s=sum(mb.time_s for mb in micro_batches), micro_batches=tuple(micro_batches))
                     for micro_batches in by_dp_rank)
    return PlanEstimate(iteration_time_s=max(rank.time_s for rank in dp_ranks), dp_ranks=dp_ranks,
                        peak_rank_tokens=int(sums.units.max(initial=0)) / tables.cp_size)


def spanning_ready_s(spanning: Sequence[SpanningMicroBatch], times_s: Sequence[float], dp_size: int) -> list[float]:
    """When each DP replica has run its spanning micro-batches (of ``times_s``): in plan order, each starting when
    the last of its replicas is free."""
    ready_s = [0.0] * dp_size
    for spanning_micro_batch, time_s in zip(spanning, times_s, strict=True):
        end_s = max(ready_s[dp_rank] for dp_rank in spanning_micro_batch.dp_ranks) + time_s
        for dp_rank in spanning_micro_batch.dp_ranks:
            ready_s[dp_rank] = end_s
    return ready_s


def _spanning_estimates(problem: PlanningProblem, spanning: Sequence[SpanningMicroBatch]) \
        -> tuple[list[MicroBatchEstimate], float]:
    """Each spanning micro-batch's estimate over its block (one ``estimate_places`` per block width), in order,
    and the most tokens a rank of theirs holds."""
    estimates: list[MicroBatchEstimate | None] = [None] * len(spanning)
    peak_tokens = 0.0
    for width in sorted({s.num_dp_ranks for s in spanning}):
        positions = [p for p, s in enumerate(spanning) if s.num_dp_ranks == width]
        block_plan = Plan(dp_ranks=(DPRankPlan(micro_batches=tuple(spanning[p].micro_batch for p in positions)),))
        block_estimate = estimate_places(problem.span_problem(width), block_plan.places(problem.num_sequences),
                                         _own_micro_batches(block_plan))
        for p, estimate in zip(positions, block_estimate.dp_ranks[0].micro_batches, strict=True):
            estimates[p] = estimate
        peak_tokens = max(peak_tokens, block_estimate.peak_rank_tokens)
    return [estimate for estimate in estimates if estimate is not None], peak_tokens


def estimate_plan(problem: PlanningProblem, plan: Plan, places: Places | None = None,
                  changes: BlockChanges | None = None) -> PlanEstimate:
    """``estimate_places`` of a plan that may hold spanning micro-batches (``places``: its own micro-batches' places,
    when the caller has them; ``changes``: what their schemes change, by micro-batch number of those places)."""
    own_micro_batches = _own_micro_batches(plan) if changes is None else []
    # the plan's own places number its micro-batches in order, empty ones too (a plan the checker would refuse)
    own = estimate_places(problem, plan.places(problem.num_sequences) if places is None else places,
                          own_micro_batches, changes, range(len(own_micro_batches)) if places is None else None)
    if not plan.spanning:
        return own
    spanning, spanning_peak = _spanning_estimates(problem, plan.spanning)
    ready_s = spanning_ready_s(plan.spanning, [estimate.time_s for estimate in spanning], problem.dp_size)
    dp_ranks = tuple(DPRankEstimate(time_s=ready_s[dp_rank] + rank.time_s, micro_batches=rank.micro_batches)
                     for dp_rank, rank in enumerate(own.dp_ranks))
    return PlanEstimate(iteration_time_s=max(rank.time_s for rank in dp_ranks), dp_ranks=dp_ranks,
                        peak_rank_tokens=max(own.peak_rank_tokens, spanning_peak), spanning=tuple(spanning))


def simulate(problem: PlanningProblem, plan: Plan) -> PlanEstimate:
    """Estimated times of every micro-batch (spanning ones included), DP rank and the iteration."""
    return estimate_plan(problem, plan)


def micro_batch_sums(problem: PlanningProblem, micro_batch: MicroBatch) -> RankSums:
    """One micro-batch's per-rank sums (M = 1); ``problem`` only needs its sequences."""
    places = Plan(dp_ranks=(DPRankPlan(micro_batches=(micro_batch,)),)).places(problem.num_sequences)
    sums = empty_sums(problem.tables, 1)
    sums_of_places(problem.tables, sums, places.micro_batch, places.degree, places.first_rank)
    return sums


def micro_batch_time_s(problem: PlanningProblem, micro_batch: MicroBatch) -> float:
    """The slowest CP rank's ``T_r``, its collectives by their schemes."""
    sums = micro_batch_sums(problem, micro_batch)
    apply_changes(sums, scheme_changes(problem, [micro_batch]))
    times_s = np.zeros((1, problem.cp_size))
    rank_times_s(problem.tables, sums, times_s)
    return float(times_s.max())


class LowerBounds(NamedTuple):
    """No plan of the batch is faster than ``any_plan_s``; no plan whose blocks all stay within one CP group (no
    spanning micro-batch) is faster than ``within_groups_s`` (infinite where a sequence needs spanning)."""

    any_plan_s: float
    within_groups_s: float


def iteration_lower_bound_s(problem: PlanningProblem) -> float:
    """No plan is faster (``iteration_lower_bounds_s``)."""
    return iteration_lower_bounds_s(problem).any_plan_s


def iteration_lower_bounds_s(problem: PlanningProblem) -> LowerBounds:
    """No plan is faster: every sequence at its cheapest placement (``area``) and the work spread evenly over all
    DP × CP ranks (the max replaced by the mean), no communication exposed, one β per micro-batch of the fewest
    micro-batches the tokens need; no faster than the costliest sequence at its cheapest placement; and no faster
    than the launch-bound floor of as many micro-batches as the busiest DP rank must run (at least the fewest
    micro-batches the tokens need, over the DP ranks). That is the bound within CP groups. Where blocks may span DP
    replicas, the longest sequence may be placed on a block of the whole world, and a sequence no CP group holds is
    placed only there (``_world_placements``): the bound over any plan. The bound within groups then also counts
    the costliest sequence's own communication (``_costliest_with_own_communication_s``)."""
    num_ranks = problem.dp_size * problem.cp_size
    min_micro_batches = -(-int(problem.lengths.sum()) // problem.micro_batch_capacity)
    degrees = np.asarray(problem.degrees)[:, None]
    # every scheme's compute: a collective of any scheme is no cheaper than its sequences' cheapest share
    rank_flops = problem.cheapest_rank_flops()
    fits = problem.lengths <= degrees * problem.bucket_size
    cheapest_flops = np.where(fits, rank_flops, np.inf).min(axis=0)
    area = np.where(fits, degrees * rank_flops, np.inf).min(axis=0)

    def bound_s(area: FloatArray, cheapest_flops: FloatArray) -> tuple[float, float]:
        """(the larger of the spread and floor terms, the costliest-sequence term)."""
        spread_s = (problem.alpha_s_per_flop * float(area.sum()) / num_ranks
                    + problem.beta_s * min_micro_batches / problem.dp_size)
        floor_bound_s = problem.floor_s * -(-min_micro_batches // problem.dp_size)
        longest_s = max(problem.floor_s, problem.alpha_s_per_flop * float(cheapest_flops.max()) + problem.beta_s)
        return max(spread_s, floor_bound_s), longest_s

    others_s, longest_s = bound_s(area, cheapest_flops)
    within_groups_s = max(others_s, longest_s)
    # the world's blocks only lower the costliest-sequence term: repriced where that term sets the bound, or where
    # a sequence no CP group holds has no placement yet
    if problem.spanning and (longest_s > others_s or problem.too_long_for_a_replica()):
        within_groups_s = max(others_s, _costliest_with_own_communication_s(problem))
        return LowerBounds(max(*bound_s(*_world_placements(problem, area, cheapest_flops))), within_groups_s)
    return LowerBounds(within_groups_s, within_groups_s)


def _costliest_with_own_communication_s(problem: PlanningProblem) -> float:
    """The costliest-sequence term within CP groups with each placement's own communication: ``T_r`` hides a rank's
    all-gathers and reduce-scatters (a Ulysses collective's hidden all-to-alls too) only behind local attention,
    which is work of other sequences on the rank (``costing.exposed_comm_s``: forward and backward shares sum to
    1). So a rank of a sharded sequence's block takes at least ``α·its share + β`` plus its collective's whole
    communication, which the sequence alone sets at least (coefficients are never negative), and a sequence costs
    at least the cheapest of that over its placements: every degree that holds it and every scheme there.
    Computed only where a spanning plan is compared with the bound within groups
    (``spanning.spanned_beyond_groups``): the bound over every plan reads the compute alone."""
    lengths = problem.lengths.astype(np.float64)
    cheapest_s = np.full(len(lengths), np.inf)
    for degree in problem.degrees:
        fits = problem.lengths <= degree * problem.bucket_size
        for ulysses_degree in (1, *problem.perf.ulysses_degrees(degree)):
            comm = problem.perf.scheme_comm(degree, ulysses_degree)
            assert comm is not None  # all-gather-KV is always priced; ulysses_degrees only where the profile can
            own_s = sum(fit.slope * lengths + fit.intercept
                        for fit in (comm.hidden_forward, comm.hidden_backward, comm.exposed))
            placed_s = (problem.alpha_s_per_flop * problem.scheme_rank_flops(degree, ulysses_degree)
                        + problem.beta_s + own_s)
            cheapest_s = np.minimum(cheapest_s, np.where(fits, placed_s, np.inf))
    return max(problem.floor_s, float(cheapest_s.max()))


def _world_placements(problem: PlanningProblem, area: FloatArray,
                      cheapest_flops: FloatArray) -> tuple[FloatArray, FloatArray]:
    """``area`` and ``cheapest_flops`` where spanning blocks (of every width up to the whole world) are placements
    too. Spreading a sequence
    wider never lowers its area (its total work over its ranks), so the sequences priced again are those no CP group
    holds (whose area is otherwise infinite) and those that set the costliest-sequence term: the longest first (a
    rank's share of a sequence falls with the degree and grows with the length), then, while the costliest share is
    a sequence not yet priced so (an equally long one; a shorter one the CP group holds whole, above the longest's
    share of the world), every such sequence, until the costliest is one priced on the world's blocks."""
    # every degree a spanning block's places have: blocks of each spanning width (check.spanning_widths)
    world_degrees = np.asarray(sorted({degree for width in (1, *spanning_widths(problem.dp_size))
                                       for degree in place_degrees(width * problem.cp_size)}))[:, None]
    repriced = np.zeros(len(problem.lengths), dtype=bool)
    pending = np.unique(np.array([*problem.too_long_for_a_replica(), np.argmax(problem.lengths)], dtype=np.int64))
    while pending.size:
        lengths = problem.lengths[pending]
        rank_flops = np.asarray([np.minimum.reduce([problem.perf.placement_flops(lengths, int(degree), u)
                                                    for u in (1, *problem.perf.ulysses_degrees(int(degree)))])
                                 for degree in world_degrees[:, 0]])
        fits = lengths <= world_degrees * problem.bucket_size
        area[pending] = np.minimum(area[pending], np.where(fits, world_degrees * rank_flops, np.inf).min(axis=0))
        cheapest_flops[pending] = np.minimum(cheapest_flops[pending], np.where(fits, rank_flops, np.inf).min(axis=0))
        repriced[pending] = True
        pending = np.flatnonzero(~repriced & (cheapest_flops > cheapest_flops[repriced].max()))
    return area, cheapest_flops
