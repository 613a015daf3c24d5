"""DACP's search for Skrull, as compiled kernels: where each sequence of one micro-batch runs.

A micro-batch's sequences come longest first (ties by index); each kernel writes every sequence's place (degree and
first CP rank, ``costing``) into the arrays beside them and returns the micro-batch's time under the cost model,
``inf`` where it found no decision within the memory bound. Axes as in ``costing`` (K: the micro-batch's sequences,
C: CP ranks, D: degrees). Every placement checks memory first, in exact units, so every decision is within the
bound by construction.

* ``binary_decision`` (binary Skrull) — for each k worth trying, shard the k longest over the whole CP group and
  place the rest largest first on the least-loaded rank with room (LPT under the memory bound), sharding one that
  fits on no rank; the cheapest k wins. k runs from the sequences too long to be kept whole to those heavier than an
  even share and ``EXTRA_DISTRIBUTION_CANDIDATES`` more, then all of them: static CP is always a candidate, so a
  micro-batch is never slower than sharding everything, and it fits whenever its tokens do.
* ``hybrid_decision`` (Skrull's default) — a dual approximation over degrees, as for scheduling moldable tasks:
  under a cap on every rank's load, each sequence takes the smallest degree (1, a hybrid block size, the whole
  group) whose tokens fit a bucket per rank and whose share fits the cap; widest first, heaviest share first within
  a degree, each goes to the best-fitting aligned block (the most loaded one where it stays under the cap and fits
  in memory), escalating its degree where no block has room.
* ``best_decision`` — the binary decision, then (hybrid search) packings under ``CAP_CANDIDATES`` caps evenly
  spaced between the balanced load (every sequence at its cheapest placement, spread evenly: nothing does better)
  and the binary decision's busiest rank, and ``CAP_CANDIDATES_ABOVE`` between that rank and the binary decision's
  time as a load (a packing whose busiest rank computes more can still be faster where its smaller groups expose
  less communication; a rank whose compute alone outlasts the binary decision cannot win). The cheapest wins; the
  binary decision on ties, so hybrid is never slower.
* ``refine_micro_batch`` — a bounded local search: move or swap whole sequences off the slowest rank while that
  lowers the micro-batch's time (at most ``MAX_REFINEMENT_STEPS`` steps; a move is kept only if the time falls,
  since the receiving rank's collectives may be hidden less).

Each kernel works in row 0 of a one-micro-batch ``RankSums`` its caller provides (``replay_decision`` rebuilds it
from a decision), so a whole global batch is searched without allocating per micro-batch.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
from numba import types

from scheduler_service.core.costing import (
    SUMS,
    TABLES,
    CostTables,
    RankSums,
    block_max,
    clear_row,
    micro_batch_time_s,
    place,
    rank_time_s,
)
from scheduler_service.core.jit import FLOAT_1D, INT_1D, kernel

__all__ = [
    "BINARY",
    "CAP_CANDIDATES",
    "CAP_CANDIDATES_ABOVE",
    "HYBRID",
    "STATIC",
    "best_decision",
    "best_exchange",
    "binary_decision",
    "hybrid_decision",
    "refine_micro_batch",
    "replay_decision",
]

# Search spaces of ``best_decision``
STATIC = 0  # every sequence sharded over the whole CP group (static CP; GDS's ablation)
BINARY = 1  # whole on one CP rank, or sharded over the whole group
HYBRID = 2  # whole, sharded over an aligned block of CP ranks, or over the whole group

EXTRA_DISTRIBUTION_CANDIDATES = 2  # k values tried beyond the sequences too heavy to place locally
CAP_CANDIDATES = 8  # caps evenly spaced strictly between the balanced load and the binary decision's busiest rank
CAP_CANDIDATES_ABOVE = 1  # caps between that rank and the binary decision's time as a load
CAP_TOLERANCE = 1.005  # no caps where the bounds they lie between are within 0.5 % of each other
MAX_REFINEMENT_STEPS = 16
MIN_REFINEMENT_GAIN = 1e-3  # a move must cut the busiest rank's load by at least 0.1 %

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]


@kernel(types.boolean(INT_1D, types.int64, types.int64, types.int64, types.int64))
def _fits_block(units: IntArray, first_rank: int, degree: int, more_units: int, capacity: int) -> bool:
    """Whether ``more_units`` fit on every rank of the block, whose ranks hold ``units``."""
    for r in range(first_rank, first_rank + degree):  # noqa: SIM110 (a kernel loops; numba compiles no generator)
        if units[r] + more_units > capacity:
            return False
    return True


@kernel(types.void(INT_1D, INT_1D))
def _copy(source: IntArray, destination: IntArray) -> None:
    for j in range(source.shape[0]):
        destination[j] = source[j]


@kernel(types.float64(TABLES, INT_1D, types.int64, SUMS, INT_1D, INT_1D))
def _shard_longest_then_lpt(tables: CostTables, members: IntArray, num_sharded: int, sums: RankSums,
                            degree: IntArray, first_rank: IntArray) -> float:
    """One binary candidate: the ``num_sharded`` longest over the whole group, the rest LPT under the memory bound;
    its time, ``inf`` where a sequence fits nowhere."""
    cp_size, lengths = tables.cp_size, tables.lengths
    capacity = tables.bucket_size * cp_size
    work, units = sums.work_flops[0], sums.units[0]
    clear_row(sums, 0)
    for j in range(members.shape[0]):
        k = members[j]
        rank = -1
        if j >= num_sharded:  # the least-loaded rank with room for the whole sequence (the first on ties)
            for r in range(cp_size):
                if units[r] + lengths[k] * cp_size <= capacity and (rank < 0 or work[r] < work[rank]):
                    rank = r
        if rank >= 0:
            degree[j], first_rank[j] = 1, rank
        elif _fits_block(units, 0, cp_size, lengths[k], capacity):
            degree[j], first_rank[j] = cp_size, 0
        else:
            return np.inf
        place(tables, sums, 0, k, degree[j], first_rank[j], 1)
    return micro_batch_time_s(tables, sums, 0)


@kernel(types.float64(TABLES, INT_1D, SUMS, INT_1D, INT_1D))
def binary_decision(tables: CostTables, members: IntArray, sums: RankSums, degree: IntArray,
                    first_rank: IntArray) -> float:
    """The cheapest "shard the k longest, LPT the rest" decision (module docstring); its time."""
    lengths, whole_flops = tables.lengths, tables.rank_flops[0]
    num_members = members.shape[0]
    total_flops = 0.0
    for j in range(num_members):
        total_flops += whole_flops[members[j]]
    fair_share = total_flops / tables.cp_size
    num_forced = 0  # too long to be kept whole: they come first
    num_heavy = 0
    for j in range(num_members):
        k = members[j]
        too_long = lengths[k] > tables.bucket_size
        num_forced += too_long
        num_heavy += too_long or whole_flops[k] > fair_share
    highest = min(num_heavy + EXTRA_DISTRIBUTION_CANDIDATES, num_members)
    trial_degree = np.empty(num_members, dtype=np.int64)
    trial_first_rank = np.empty(num_members, dtype=np.int64)
    best_s = np.inf
    for candidate in range(num_forced, highest + 2):
        if candidate > highest and highest == num_members:
            break
        num_sharded = candidate if candidate <= highest else num_members  # and last static CP, whenever distinct
        time_s = _shard_longest_then_lpt(tables, members, num_sharded, sums, trial_degree, trial_first_rank)
        if time_s < best_s:
            best_s = time_s
            _copy(trial_degree, degree)
            _copy(trial_first_rank, first_rank)
    return best_s


@kernel(types.int64(FLOAT_1D, INT_1D, types.int64, types.float64, types.int64, types.float64, types.int64))
def _best_fit_block(work: FloatArray, units: IntArray, degree: int, share: float, more_units: int, cap: float,
                    capacity: int) -> int:
    """The first rank of the aligned block of ``degree`` ranks (whose ranks hold ``work`` and ``units``) where a
    piece of ``share`` and ``more_units`` fits in memory and keeps every rank under ``cap``, and whose busiest rank
    is the most loaded such (the first on ties); -1 if none."""
    best_first_rank = -1
    best_load = -np.inf
    for first_rank in range(0, work.shape[0], degree):
        block_load = block_max(work, first_rank, degree)
        if (block_load <= cap - share and block_load > best_load
                and _fits_block(units, first_rank, degree, more_units, capacity)):
            best_first_rank, best_load = first_rank, block_load
    return best_first_rank


@kernel(types.float64(TABLES, INT_1D, types.float64, SUMS, INT_1D, INT_1D))
def hybrid_decision(tables: CostTables, members: IntArray, cap: float, sums: RankSums, degree: IntArray,
                    first_rank: IntArray) -> float:
    """The packing under ``cap`` (module docstring); its time, ``inf`` where a sequence fits nowhere."""
    lengths, rank_flops, degrees, cp_size = tables.lengths, tables.rank_flops, tables.degrees, tables.cp_size
    capacity = tables.bucket_size * cp_size
    num_members, num_degrees = members.shape[0], degrees.shape[0]
    smallest = np.empty(num_members, dtype=np.int64)  # d of the smallest degree that fits the bucket and the cap
    for j in range(num_members):
        k = members[j]
        smallest[j] = -1
        for d in range(num_degrees):
            if lengths[k] <= degrees[d] * tables.bucket_size and rank_flops[d, k] <= cap:
                smallest[j] = d
                break
        if smallest[j] < 0:
            return np.inf
    # widest first; within a degree in the members' order, longest first (heaviest first: a share grows with length)
    order = np.empty(num_members, dtype=np.int64)
    placed = 0
    for d in range(num_degrees - 1, -1, -1):
        for j in range(num_members):
            if smallest[j] == d:
                order[placed] = j
                placed += 1
    work, units = sums.work_flops[0], sums.units[0]
    clear_row(sums, 0)
    for position in order:
        k = members[position]
        degree[position] = 0
        for d in range(smallest[position], num_degrees):
            block_first_rank = _best_fit_block(work, units, degrees[d], rank_flops[d, k],
                                               lengths[k] * (cp_size // degrees[d]), cap, capacity)
            if block_first_rank >= 0:
                degree[position], first_rank[position] = degrees[d], block_first_rank
                break
        if degree[position] == 0:
            return np.inf
        place(tables, sums, 0, k, degree[position], first_rank[position], 1)
    return micro_batch_time_s(tables, sums, 0)


@kernel(types.void(TABLES, INT_1D, INT_1D, INT_1D, SUMS))
def replay_decision(tables: CostTables, members: IntArray, degree: IntArray, first_rank: IntArray,
                    sums: RankSums) -> None:
    """Row 0 of ``sums`` for the decision ``degree``, ``first_rank``."""
    clear_row(sums, 0)
    for j in range(members.shape[0]):
        place(tables, sums, 0, members[j], degree[j], first_rank[j], 1)


@kernel(types.float64(TABLES, INT_1D, SUMS, INT_1D, INT_1D))
def _static_decision(tables: CostTables, members: IntArray, sums: RankSums, degree: IntArray,
                     first_rank: IntArray) -> float:
    """Every sequence sharded over the whole CP group; its time, ``inf`` where the tokens do not fit."""
    clear_row(sums, 0)
    for j in range(members.shape[0]):
        degree[j], first_rank[j] = tables.cp_size, 0
        if not _fits_block(sums.units[0], 0, tables.cp_size, tables.lengths[members[j]],
                           tables.bucket_size * tables.cp_size):
            return np.inf
        place(tables, sums, 0, members[j], tables.cp_size, 0, 1)
    return micro_batch_time_s(tables, sums, 0)


@kernel(types.float64(TABLES, INT_1D, types.int64, SUMS, INT_1D, INT_1D))
def best_decision(tables: CostTables, members: IntArray, space: int, sums: RankSums, degree: IntArray,
                  first_rank: IntArray) -> float:
    """The cheapest decision of the search ``space`` (module docstring) into ``degree``, ``first_rank``; its
    time."""
    if space == STATIC:
        return _static_decision(tables, members, sums, degree, first_rank)
    best_s = binary_decision(tables, members, sums, degree, first_rank)
    if space == BINARY or best_s == np.inf or tables.degrees.shape[0] <= 2:
        return best_s
    # the caps' bounds: the balanced load, the binary decision's busiest rank, its time as a load
    num_members = members.shape[0]
    low = 0.0
    heaviest_whole = 0.0
    for j in range(num_members):
        low += tables.area[members[j]]
        heaviest_whole = max(heaviest_whole, tables.rank_flops[0, members[j]])
    low /= tables.cp_size
    if heaviest_whole <= low:  # every cap above the balanced load keeps every sequence whole: LPT does as well
        return best_s
    replay_decision(tables, members, degree, first_rank, sums)
    high = sums.work_flops[0].max()
    ceiling = (best_s - tables.beta_s) / tables.alpha_s_per_flop
    trial_degree = np.empty(num_members, dtype=np.int64)
    trial_first_rank = np.empty(num_members, dtype=np.int64)
    for i in range(CAP_CANDIDATES + CAP_CANDIDATES_ABOVE):
        if i < CAP_CANDIDATES:
            if high <= low * CAP_TOLERANCE:
                continue
            cap = low + (high - low) * ((i + 1) / (CAP_CANDIDATES + 1))
        else:
            if ceiling <= high * CAP_TOLERANCE:
                continue
            cap = high + (ceiling - high) * ((i - CAP_CANDIDATES + 1) / (CAP_CANDIDATES_ABOVE + 1))
        time_s = hybrid_decision(tables, members, cap, sums, trial_degree, trial_first_rank)
        if time_s < best_s:
            best_s = time_s
            _copy(trial_degree, degree)
            _copy(trial_first_rank, first_rank)
    return best_s


@kernel(types.float64(types.float64, types.float64))
def _swap_gain(delta: float, gap: float) -> float:
    """How much handing ``delta`` FLOP-equivalents to a rank ``gap`` below lowers the pair's max load."""
    return min(delta, gap - delta) if 0.0 < delta < gap else 0.0


@kernel(types.Tuple((types.float64, types.int64, types.int64, types.int64))(
    TABLES, INT_1D, INT_1D, INT_1D, SUMS, types.int64))
def best_exchange(tables: CostTables, members: IntArray, degree: IntArray, first_rank: IntArray, sums: RankSums,
                   busiest: int) -> tuple[float, int, int, int]:
    """The move or swap of whole sequences that lowers rank ``busiest``'s pair maximum the most within the memory
    bound: (gain, position of the sequence taken off ``busiest``, position of its swap partner or -1, the other
    rank); position -1 when nothing gains.

    Moving ``a`` to a rank ``gap`` below lowers the pair's max load by ``min(F_a, gap - F_a)``, swapping it with
    ``b`` by ``min(δ, gap - δ)`` with ``δ = F_a - F_b`` (a move is a swap with a partner of cost 0). A gain is at
    most ``gap / 2`` and at most ``F_a``, so a rank or a sequence that cannot beat the best gain so far is
    skipped."""
    cp_size, lengths, whole_flops = tables.cp_size, tables.lengths, tables.rank_flops[0]
    work, units = sums.work_flops[0], sums.units[0]
    capacity = tables.bucket_size * cp_size
    # the whole sequences of each rank (positions in ``members``), by a counting sort
    rank_start = np.zeros(cp_size + 1, dtype=np.int64)
    for j in range(members.shape[0]):
        if degree[j] == 1:
            rank_start[first_rank[j] + 1] += 1
    rank_start = np.cumsum(rank_start)
    filled = rank_start[:-1].copy()
    on_rank = np.empty(rank_start[-1], dtype=np.int64)
    for j in range(members.shape[0]):
        if degree[j] == 1:
            on_rank[filled[first_rank[j]]] = j
            filled[first_rank[j]] += 1
    best_gain, best_a, best_b, best_other = 0.0, -1, -1, -1
    for other in range(cp_size):
        gap = work[busiest] - work[other]
        if other == busiest or gap / 2 <= best_gain:
            continue
        room_other, room_busiest = capacity - units[other], capacity - units[busiest]
        for a in on_rank[rank_start[busiest]:rank_start[busiest + 1]]:
            cost_a = whole_flops[members[a]]
            if cost_a <= best_gain:
                continue
            units_a = lengths[members[a]] * cp_size
            gain = _swap_gain(cost_a, gap)
            if gain > best_gain and room_other >= units_a:
                best_gain, best_a, best_b, best_other = gain, a, -1, other
            for b in on_rank[rank_start[other]:rank_start[other + 1]]:
                gain = _swap_gain(cost_a - whole_flops[members[b]], gap)
                units_b = lengths[members[b]] * cp_size
                if gain > best_gain and room_other + units_b >= units_a and room_busiest + units_a >= units_b:
                    best_gain, best_a, best_b, best_other = gain, a, b, other
    return best_gain, best_a, best_b, best_other


@kernel(types.void(TABLES, INT_1D, INT_1D, SUMS, types.int64, types.int64))
def _relocate(tables: CostTables, members: IntArray, first_rank: IntArray, sums: RankSums, j: int,
              rank: int) -> None:
    """Move the whole sequence at position ``j`` onto CP rank ``rank``."""
    place(tables, sums, 0, members[j], 1, first_rank[j], -1)
    first_rank[j] = rank
    place(tables, sums, 0, members[j], 1, rank, 1)


@kernel(types.Tuple((types.int64, types.float64))(TABLES, SUMS))
def _slowest_rank(tables: CostTables, sums: RankSums) -> tuple[int, float]:
    """The slowest CP rank of the micro-batch in row 0 (the first on ties), and its time."""
    work, attention, all_gather, reduce_scatter, units = (sums.work_flops[0], sums.attention_flops[0],
                                                          sums.all_gather_s[0], sums.reduce_scatter_s[0], sums.units[0])
    slowest, slowest_s = 0, -1.0
    for r in range(tables.cp_size):
        time_s = rank_time_s(tables, work[r], attention[r], all_gather[r], reduce_scatter[r], units[r])
        if time_s > slowest_s:
            slowest, slowest_s = r, time_s
    return slowest, slowest_s


@kernel(types.float64(TABLES, INT_1D, INT_1D, INT_1D, SUMS))
def refine_micro_batch(tables: CostTables, members: IntArray, degree: IntArray, first_rank: IntArray,
                       sums: RankSums) -> float:
    """The refinement of DACP (module docstring) on the decision ``degree``, ``first_rank``, which it updates; the
    micro-batch's time."""
    replay_decision(tables, members, degree, first_rank, sums)
    slowest, slowest_s = _slowest_rank(tables, sums)
    for _ in range(MAX_REFINEMENT_STEPS):
        gain, a, b, other = best_exchange(tables, members, degree, first_rank, sums, slowest)
        if a < 0 or gain < sums.work_flops[0, slowest] * MIN_REFINEMENT_GAIN:
            break
        _relocate(tables, members, first_rank, sums, a, other)
        if b >= 0:
            _relocate(tables, members, first_rank, sums, b, slowest)
        moved_slowest, moved_s = _slowest_rank(tables, sums)
        if moved_s >= slowest_s:  # the receiving rank got slower than the busiest was: undo, stop
            if b >= 0:
                _relocate(tables, members, first_rank, sums, b, other)
            _relocate(tables, members, first_rank, sums, a, slowest)
            break
        slowest, slowest_s = moved_slowest, moved_s
    return max(slowest_s, 0.0)
