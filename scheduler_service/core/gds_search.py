"""GDS for Skrull, as one compiled kernel: a global batch split over DP ranks, cut into micro-batches, and every
micro-batch decided by DACP's search (``dacp_search``).

1. **Split.** LPT over DP ranks on a weight per sequence (``partition.lpt_parts``): the cheapest-placement cost
   (``CostTables.area``) for the hybrid search, FLOPs for the binary one.
2. **Cuts.** For each DP rank's share, the fewest micro-batches whose tokens spread (``spread_longest_first``:
   longest first onto the micro-batch with the fewest tokens, which pairs long sequences with short ones and keeps
   each within ``C·N``), found by growing the count geometrically from the memory minimum until one spreads, then
   bisecting back down; and ``EXTRA_MICRO_BATCH_COUNTS`` more micro-batches (each where its spread fits). Where
   rows are padded to token buckets (``CostTables.bucket_units``), each count is also cut by first fit
   (``fill_longest_first``): an even spread leaves every micro-batch's bucket partly empty, first fit fills all but
   the last, whose remainder takes a small bucket.
3. **Search.** Every micro-batch of every cut: ``dacp_search.best_decision`` in the requested space.
4. **Assemble.** Per share, the cut whose micro-batches' times sum least (the first on ties); its micro-batches
   refined (``dacp_search.refine_micro_batch``) and numbered, DP rank by DP rank.

The result is the plan as ``plan.Places`` arrays (axes as in ``costing``) and its iteration time under the cost
model.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
from numba import types

from scheduler_service.core.costing import TABLES, CostTables, empty_sums
from scheduler_service.core.dacp_search import best_decision, refine_micro_batch
from scheduler_service.core.jit import FLOAT_1D, INT_1D, kernel
from scheduler_service.core.partition import lpt_parts, replace_lightest

__all__ = ["EXTRA_MICRO_BATCH_COUNTS", "fewest_that_spread", "fill_longest_first", "min_micro_batches", "plan_gds",
           "spread_longest_first"]

EXTRA_MICRO_BATCH_COUNTS = 1  # counts tried beyond the fewest that spread

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]


@kernel(types.int64(INT_1D, types.int64))
def min_micro_batches(lengths: IntArray, capacity: int) -> int:
    """No fewer micro-batches can hold sequences of these ``lengths``: their tokens over the capacity ``C·N``, and
    one each for the sequences longer than half of it (no two of them fit together)."""
    if lengths.shape[0] == 0:
        return 0
    over_half = 0
    for length in lengths:
        over_half += 2 * length > capacity
    return max(1, -(-lengths.sum() // capacity), over_half)


@kernel(types.boolean(INT_1D, INT_1D, types.int64, types.int64, INT_1D))
def spread_longest_first(lengths: IntArray, longest_first: IntArray, count: int, capacity: int,
                         group_of: IntArray) -> bool:
    """Each sequence of ``longest_first`` onto the micro-batch (of ``count``) with the fewest tokens (the first on
    ties), into ``group_of`` (by position); whether every micro-batch stays within ``capacity`` tokens."""
    tokens, groups = np.zeros(count), np.arange(count)  # a heap of (tokens, micro-batch), fewest first
    for position in range(longest_first.shape[0]):
        if tokens[0] + lengths[longest_first[position]] > capacity:
            return False
        group_of[position] = groups[0]
        replace_lightest(tokens, groups, tokens[0] + lengths[longest_first[position]])
    return True


@kernel(types.int64(INT_1D, INT_1D, types.int64, types.int64, INT_1D))
def fill_longest_first(lengths: IntArray, longest_first: IntArray, count: int, capacity: int,
                       group_of: IntArray) -> int:
    """Each sequence of ``longest_first`` into the first micro-batch (of ``count``) with room for it (first fit
    decreasing), into ``group_of`` (by position); how many micro-batches it filled (at most ``count``), 0 where a
    sequence fits none."""
    tokens = np.zeros(count, dtype=np.int64)
    used = 0
    for position in range(longest_first.shape[0]):
        length = lengths[longest_first[position]]
        group = 0
        while group < count and tokens[group] + length > capacity:
            group += 1
        if group == count:
            return 0
        tokens[group] += length
        group_of[position] = group
        used = max(used, group + 1)
    return used


@kernel(types.int64(INT_1D, INT_1D, types.int64, INT_1D))
def fewest_that_spread(lengths: IntArray, longest_first: IntArray, capacity: int, group_of: IntArray) -> int:
    """The fewest micro-batches whose spread fits (``group_of`` holds that spread); 0 if none does."""
    num_sequences = longest_first.shape[0]
    count = min_micro_batches(lengths[longest_first], capacity)
    failed = count - 1
    while not spread_longest_first(lengths, longest_first, count, capacity, group_of):
        if count == num_sequences:
            return 0
        failed, count = count, min(num_sequences, count + max(1, count // 8))  # geometric: O(log n) spreads ...
    while count - failed > 1:  # ... then bisect back down to the fewest that spreads
        middle = (failed + count) // 2
        if spread_longest_first(lengths, longest_first, middle, capacity, group_of):
            count = middle
        else:
            failed = middle
    spread_longest_first(lengths, longest_first, count, capacity, group_of)
    return count


@kernel(types.float64(TABLES, INT_1D, INT_1D, types.int64, INT_1D, INT_1D))
def _search_cut(tables: CostTables, members: IntArray, group_start: IntArray, space: int, degree: IntArray,
                first_rank: IntArray) -> float:
    """Every micro-batch of one cut (``members[group_start[g]:group_start[g + 1]]``, longest first) decided in
    ``space``, into ``degree`` and ``first_rank``; the cut's time, ``inf`` if one has no decision."""
    sums = empty_sums(tables, 1)
    total_s = 0.0
    for g in range(group_start.shape[0] - 1):
        start, end = group_start[g], group_start[g + 1]
        total_s += best_decision(tables, members[start:end], space, sums, degree[start:end], first_rank[start:end])
    return total_s


@kernel(types.float64(TABLES, INT_1D, INT_1D, INT_1D, INT_1D))
def _refine_cut(tables: CostTables, members: IntArray, group_start: IntArray, degree: IntArray,
                first_rank: IntArray) -> float:
    """Every micro-batch of a decided cut refined; the cut's time."""
    sums = empty_sums(tables, 1)
    total_s = 0.0
    for g in range(group_start.shape[0] - 1):
        start, end = group_start[g], group_start[g + 1]
        total_s += refine_micro_batch(tables, members[start:end], degree[start:end], first_rank[start:end], sums)
    return total_s


@kernel(types.UniTuple(INT_1D, 2)(INT_1D, INT_1D, types.int64))
def _grouped(longest_first: IntArray, group_of: IntArray, count: int) -> tuple[IntArray, IntArray]:
    """The sequences of each micro-batch together, longest first within it, and where each micro-batch starts (a
    counting sort by micro-batch)."""
    group_start = np.zeros(count + 1, dtype=np.int64)
    for group in group_of:
        group_start[group + 1] += 1
    group_start = np.cumsum(group_start)
    filled = group_start[:-1].copy()
    members = np.empty(longest_first.shape[0], dtype=np.int64)
    for position in range(longest_first.shape[0]):
        members[filled[group_of[position]]] = longest_first[position]
        filled[group_of[position]] += 1
    return members, group_start


@kernel(types.Tuple((INT_1D, INT_1D, INT_1D, INT_1D, types.float64, types.int64))(
    TABLES, FLOAT_1D, types.int64, types.int64))
def plan_gds(tables: CostTables, weights: FloatArray, dp_size: int,
             space: int) -> tuple[IntArray, IntArray, IntArray, IntArray, float, int]:
    """GDS (module docstring) in the DACP search ``space``: every sequence's micro-batch, degree and first CP rank,
    each micro-batch's DP rank, the iteration time; and the first DP rank whose share no cut fits (-1 if none)."""
    num_sequences = tables.lengths.shape[0]
    capacity = tables.bucket_size * tables.cp_size
    micro_batch = np.full(num_sequences, -1, dtype=np.int64)
    degree = np.zeros(num_sequences, dtype=np.int64)
    first_rank = np.zeros(num_sequences, dtype=np.int64)
    dp_rank_of = np.zeros(num_sequences, dtype=np.int64)  # at most one micro-batch per sequence
    num_micro_batches = 0
    iteration_s = 0.0
    part_of = lpt_parts(weights, dp_size)
    longest_first_all = np.argsort(-tables.lengths, kind="mergesort")  # ties by index
    for dp_rank in range(dp_size):
        longest_first = longest_first_all[part_of[longest_first_all] == dp_rank]
        num_members = longest_first.shape[0]
        if num_members == 0:
            continue
        group_of = np.empty(num_members, dtype=np.int64)
        fewest = fewest_that_spread(tables.lengths, longest_first, capacity, group_of)
        if fewest == 0:
            return micro_batch, degree, first_rank, dp_rank_of[:0], np.inf, dp_rank
        best_s = np.inf
        best_members, best_group_start = longest_first, np.zeros(1, dtype=np.int64)
        best_degree, best_first_rank = degree, first_rank  # replaced by the first cut that has a decision
        cuts_per_count = 2 if tables.bucket_units.shape[0] else 1  # the even spread, and by buckets first fit
        for count in range(fewest, min(fewest + EXTRA_MICRO_BATCH_COUNTS, num_members) + 1):
            for cut in range(cuts_per_count):
                if cut == 0:
                    if count > fewest and not spread_longest_first(tables.lengths, longest_first, count, capacity,
                                                                   group_of):
                        continue
                    cut_count = count
                else:
                    cut_count = fill_longest_first(tables.lengths, longest_first, count, capacity, group_of)
                    if cut_count == 0:
                        continue
                members, group_start = _grouped(longest_first, group_of, cut_count)
                cut_degree = np.empty(num_members, dtype=np.int64)
                cut_first_rank = np.empty(num_members, dtype=np.int64)
                cut_s = _search_cut(tables, members, group_start, space, cut_degree, cut_first_rank)
                if cut_s < best_s:
                    best_s, best_members, best_group_start = cut_s, members, group_start
                    best_degree, best_first_rank = cut_degree, cut_first_rank
        if best_s == np.inf:
            return micro_batch, degree, first_rank, dp_rank_of[:0], np.inf, dp_rank
        dp_rank_s = _refine_cut(tables, best_members, best_group_start, best_degree, best_first_rank)
        for g in range(best_group_start.shape[0] - 1):
            for position in range(best_group_start[g], best_group_start[g + 1]):
                k = best_members[position]
                micro_batch[k] = num_micro_batches
                degree[k], first_rank[k] = best_degree[position], best_first_rank[position]
            dp_rank_of[num_micro_batches] = dp_rank
            num_micro_batches += 1
        iteration_s = max(iteration_s, dp_rank_s)
    return micro_batch, degree, first_rank, dp_rank_of[:num_micro_batches], iteration_s, -1
