"""Plan-level refinement for hybrid Skrull, as compiled kernels: an iterated local search on the slowest DP rank,
across micro-batches.

GDS decides each micro-batch on its own, and the busiest CP rank of each sets its time; a DP rank's time is the sum
over its micro-batches and the iteration the slowest DP rank's. Every micro-batch leaves slack on its other CP
ranks, and every other DP rank slack against the slowest, which no per-micro-batch search can use.

**Local search.** Each step takes a sequence that touches the critical (slowest) CP rank of one of the slowest DP
rank's micro-batches, the one whose removal cuts its micro-batch most first, and costs, exactly under the cost
model (``costing.rank_time_s``, collectives' fixed costs included):

* every **swap** with a sequence of another micro-batch of any DP rank, each taking the other's place (``_best_swap``),
  and
* every **move**, at any degree whose tokens fit a bucket per rank, onto any aligned block of any micro-batch of any
  DP rank, its own included, where it fits in memory (``_best_move``).

The first sequence with a swap or move that makes the slower of the (one or two) DP ranks it changes faster than
the slowest DP rank was, by at least ``MIN_PLAN_GAIN``, takes its best one (the swap on ties). A sequence with none
is not costed again until its micro-batch changes (a don't-look bit). Swaps do most of the work: a long sequence on
a critical rank trades places with a shorter one elsewhere, which fine-tunes both micro-batches. Candidates are
bounded before they are costed (each changed block's heaviest rank with no communication exposed,
``costing.rank_compute_time_s``, never above ``rank_time_s``), so the choice is the one costing every candidate
would make.

**Iterated local search.** When no sequence improves, a kick (``_kick``: a random swap of a sequence of the slowest
DP rank with one of another micro-batch, whatever it does to the time) moves the best plan out of its local
optimum, the local search runs again, and the better plan is kept. The random numbers come from a fixed seed.

**Search budget.** Each costing of a sequence, and each kick, spends one unit; the search stops when the budget is
spent. The same budget always gives the same plan, and since a larger budget only runs the same search longer and
keeps the best plan seen, it never gives a worse one. What a budget buys: docs/benchmarks.md, "Search budget".

State (axes as in ``costing``): the plan's ``Places`` arrays, updated in place; per micro-batch and CP rank the
``RankSums`` and ``T_r`` (M, C); each micro-batch's time and size (M); each DP rank's time.

One module of about 560 lines for one search: every kernel here reads and updates that one state, and the moves,
the swaps and the kicks are read against each other.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import numpy.typing as npt
from numba import types

from scheduler_service.core.costing import (
    SUMS,
    TABLES,
    CostTables,
    RankSums,
    block_index,
    block_max,
    clear_row,
    empty_sums,
    place,
    place_delta,
    rank_compute_time_s,
    rank_time_s,
    sum_rank_time_s,
    sums_of_places,
)
from scheduler_service.core.jit import FLOAT_1D, FLOAT_2D, INT_1D, INT_2D, kernel
from scheduler_service.core.plan import Places, PlanningProblem

__all__ = ["DEFAULT_BUDGET", "MIN_PLAN_GAIN", "refine_places", "refine_plan"]

# The default search budget on a batch of 256 sequences, and at most its work on larger ones (a costing is
# O(sequences + micro-batches), about 320 there), so the search's time stays about the same. 192 units are the
# least at which every make bench case plans at least as well as a local search of 128 costings without kicks.
DEFAULT_BUDGET = 192
_DEFAULT_WORK_PER_COSTING = 320
MIN_PLAN_GAIN = 1e-4  # a step must make the slowest DP rank it changes at least 0.01 % faster
KICK_ATTEMPTS = 64  # random pairs drawn for one perturbation before it gives up

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]


class _State(NamedTuple):
    """A plan under refinement (module docstring)."""

    tables: CostTables
    micro_batch: IntArray  # (N,)
    degree: IntArray  # (N,)
    first_rank: IntArray  # (N,)
    dp_rank_of: IntArray  # (M,)
    sums: RankSums  # (M, C)
    times_s: FloatArray  # (M, C)
    micro_batch_times_s: FloatArray  # (M,)
    micro_batch_sizes: IntArray  # (M,)
    dp_times_s: FloatArray  # (dp_size,)


STATE = types.NamedTuple([TABLES, INT_1D, INT_1D, INT_1D, INT_1D, SUMS, FLOAT_2D, FLOAT_1D, INT_1D, FLOAT_1D], _State)


@kernel(types.void(STATE, types.int64))
def _retime(state: _State, m: int) -> None:
    """Micro-batch ``m``'s times from its sums (exact zeros once it is empty)."""
    tables, sums, times_s = state.tables, state.sums, state.times_s
    if state.micro_batch_sizes[m] == 0:
        clear_row(sums, m)
    slowest_s = 0.0
    for r in range(tables.cp_size):
        times_s[m, r] = sum_rank_time_s(tables, sums, m, r)
        slowest_s = max(slowest_s, times_s[m, r])
    state.micro_batch_times_s[m] = slowest_s


@kernel(types.void(STATE))
def _sum_dp_times(state: _State) -> None:
    """Each DP rank's time: its micro-batches' times, summed in their order."""
    dp_rank_of, micro_batch_times_s, dp_times_s = state.dp_rank_of, state.micro_batch_times_s, state.dp_times_s
    dp_times_s[:] = 0.0
    for m in range(dp_rank_of.shape[0]):
        dp_times_s[dp_rank_of[m]] += micro_batch_times_s[m]


@kernel(STATE(TABLES, INT_1D, INT_1D, INT_1D, INT_1D, types.int64))
def _new_state(tables: CostTables, micro_batch: IntArray, degree: IntArray, first_rank: IntArray,
               dp_rank_of: IntArray, dp_size: int) -> _State:
    num_micro_batches = dp_rank_of.shape[0]
    sums = empty_sums(tables, num_micro_batches)
    sums_of_places(tables, sums, micro_batch, degree, first_rank)
    sizes = np.zeros(num_micro_batches, dtype=np.int64)
    for k in range(micro_batch.shape[0]):
        if micro_batch[k] >= 0:
            sizes[micro_batch[k]] += 1
    state = _State(tables, micro_batch, degree, first_rank, dp_rank_of, sums,
                   np.zeros((num_micro_batches, tables.cp_size)), np.zeros(num_micro_batches), sizes,
                   np.zeros(dp_size))
    for m in range(num_micro_batches):
        _retime(state, m)
    _sum_dp_times(state)
    return state


@kernel(types.void(STATE, types.int64, types.int64, types.int64, types.int64))
def _move_sequence(state: _State, k: int, m: int, degree: int, first_rank: int) -> None:
    """Take sequence ``k`` off its place and put it at (``degree``, ``first_rank``) in micro-batch ``m``."""
    micro_batch, degree_of, first_rank_of, sizes = (state.micro_batch, state.degree, state.first_rank,
                                                    state.micro_batch_sizes)
    source = micro_batch[k]
    place(state.tables, state.sums, source, k, degree_of[k], first_rank_of[k], -1)
    sizes[source] -= 1
    place(state.tables, state.sums, m, k, degree, first_rank, 1)
    sizes[m] += 1
    micro_batch[k], degree_of[k], first_rank_of[k] = m, degree, first_rank


@kernel(types.float64(STATE, types.int64), inline=True)
def _time_without(state: _State, k: int) -> float:
    """Sequence ``k``'s micro-batch's time without it: only the ranks of its block change."""
    tables, sums, times_s = state.tables, state.sums, state.times_s
    m, degree, first_rank = state.micro_batch[k], state.degree[k], state.first_rank[k]
    work, attention, all_gather, reduce_scatter, unit_count = place_delta(
        tables, k, degree, sums.block_members[m, block_index(tables, degree, first_rank)], -1)
    work_flops, attention_flops, all_gather_s, reduce_scatter_s, units = (sums.work_flops, sums.attention_flops,
                                                                          sums.all_gather_s, sums.reduce_scatter_s,
                                                                          sums.units)
    slowest_s = 0.0
    for r in range(tables.cp_size):
        if first_rank <= r < first_rank + degree:
            time_s = rank_time_s(tables, work_flops[m, r] + work, attention_flops[m, r] + attention,
                                 all_gather_s[m, r] + all_gather, reduce_scatter_s[m, r] + reduce_scatter,
                                 units[m, r] + unit_count)
        else:
            time_s = times_s[m, r]
        slowest_s = max(slowest_s, time_s)
    return slowest_s


@kernel(types.Tuple((INT_1D, FLOAT_1D))(STATE, types.int64))
def _critical_sequences(state: _State, slowest: int) -> tuple[IntArray, FloatArray]:
    """The sequences on the critical CP rank of a micro-batch of DP rank ``slowest``, the one whose removal cuts
    its micro-batch most first (ties by index), and how much each cut."""
    micro_batch, degree, first_rank, dp_rank_of = state.micro_batch, state.degree, state.first_rank, state.dp_rank_of
    times_s, micro_batch_times_s = state.times_s, state.micro_batch_times_s
    critical = np.empty(dp_rank_of.shape[0], dtype=np.int64)
    for m in range(dp_rank_of.shape[0]):
        critical[m] = np.argmax(times_s[m])
    num_sequences = micro_batch.shape[0]
    candidates = np.empty(num_sequences, dtype=np.int64)
    cuts_s = np.empty(num_sequences)
    count = 0
    for k in range(num_sequences):
        m = micro_batch[k]
        if m >= 0 and dp_rank_of[m] == slowest and first_rank[k] <= critical[m] < first_rank[k] + degree[k]:
            candidates[count] = k
            cuts_s[count] = micro_batch_times_s[m] - _time_without(state, k)
            count += 1
    order = np.argsort(-cuts_s[:count], kind="mergesort")
    return candidates[:count][order], cuts_s[:count][order]


@kernel(types.UniTuple(FLOAT_2D, 2)(STATE))
def _block_extremes(state: _State) -> tuple[FloatArray, FloatArray]:
    """(M, B) each, for every aligned block of every micro-batch: its heaviest rank's work, and the slowest time of
    the ranks outside it. Computed once per step (the plan changes only between steps) and read by every swap."""
    tables, work, times_s = state.tables, state.sums.work_flops, state.times_s
    cp_size = tables.cp_size
    heaviest = np.zeros((state.dp_rank_of.shape[0], tables.num_blocks))
    others_s = np.zeros((state.dp_rank_of.shape[0], tables.num_blocks))
    for m in range(heaviest.shape[0]):
        for degree in tables.degrees:
            for first_rank in range(0, cp_size, degree):
                b = tables.block_offset[degree] + first_rank // degree
                for r in range(cp_size):
                    if first_rank <= r < first_rank + degree:
                        heaviest[m, b] = max(heaviest[m, b], work[m, r])
                    else:
                        others_s[m, b] = max(others_s[m, b], times_s[m, r])
    return heaviest, others_s


@kernel(types.UniTuple(types.float64, 5)(INT_1D, FLOAT_2D, FLOAT_1D, FLOAT_1D, FLOAT_1D, types.int64, types.int64,
                                          types.int64, types.int64, types.int64), inline=True)
def _swap_delta(lengths: IntArray, rank_flops: FloatArray, local_attention_flops: FloatArray,
                all_gather_s_per_token: FloatArray, reduce_scatter_s_per_token: FloatArray, cp_size: int, d: int,
                degree: int, out_k: int, in_k: int) -> tuple[float, float, float, float, float]:
    """What ``in_k`` taking ``out_k``'s place at ``degree`` (row ``d`` of the tables) changes on each rank of the
    block: (work, local attention, all-gather, reduce-scatter, memory units). The block keeps its member count, so
    no fixed collective cost changes."""
    return (rank_flops[d, in_k] - rank_flops[d, out_k],
            (degree == 1) * (local_attention_flops[in_k] - local_attention_flops[out_k]),
            all_gather_s_per_token[d] * lengths[in_k] - all_gather_s_per_token[d] * lengths[out_k],
            reduce_scatter_s_per_token[d] * lengths[in_k] - reduce_scatter_s_per_token[d] * lengths[out_k],
            float((lengths[in_k] - lengths[out_k]) * (cp_size // degree)))


@kernel(types.float64(TABLES, FLOAT_2D, FLOAT_2D, FLOAT_2D, FLOAT_2D, INT_2D, types.int64, types.int64, types.int64,
                      types.UniTuple(types.float64, 5), types.float64), inline=True)
def _swapped_time_s(tables: CostTables, work_flops: FloatArray, attention_flops: FloatArray,
                    all_gather_s: FloatArray, reduce_scatter_s: FloatArray, units: IntArray, m: int, degree: int,
                    first_rank: int, delta: tuple[float, float, float, float, float], others_s: float) -> float:
    """Micro-batch ``m``'s time with the block of ``degree`` ranks from ``first_rank`` changed by ``delta``
    (``_swap_delta``), its other ranks taking ``others_s`` at most; ``inf`` where the block's memory overflows. It
    runs in the swap search's inner loop, so it takes the sums' arrays, read once outside the loop (reading an
    array of a tuple inside a loop costs reference counting on every pass)."""
    capacity = tables.bucket_size * tables.cp_size
    slowest_s = others_s
    for r in range(first_rank, first_rank + degree):
        if units[m, r] + delta[4] > capacity:
            return np.inf
        slowest_s = max(slowest_s, rank_time_s(tables, work_flops[m, r] + delta[0], attention_flops[m, r] + delta[1],
                                               all_gather_s[m, r] + delta[2], reduce_scatter_s[m, r] + delta[3],
                                               units[m, r] + int(delta[4])))
    return slowest_s


@kernel(types.boolean(TABLES, STATE, types.int64, types.int64))
def _swap_fits(tables: CostTables, state: _State, out_k: int, in_k: int) -> bool:
    """Whether ``in_k`` fits ``out_k``'s place in memory."""
    sums = state.sums
    d, degree = tables.degree_row[state.degree[out_k]], state.degree[out_k]
    delta = _swap_delta(tables.lengths, tables.rank_flops, tables.local_attention_flops,
                        tables.all_gather_s_per_token, tables.reduce_scatter_s_per_token, tables.cp_size, d, degree,
                        out_k, in_k)
    return _swapped_time_s(tables, sums.work_flops, sums.attention_flops, sums.all_gather_s, sums.reduce_scatter_s,
                           sums.units, state.micro_batch[out_k], degree, state.first_rank[out_k], delta,
                           0.0) < np.inf


@kernel(types.Tuple((types.float64, types.int64))(STATE, types.int64, types.int64, types.float64, FLOAT_2D,
                                                    FLOAT_2D))
def _best_swap(state: _State, x: int, slowest: int, threshold_s: float, block_heaviest: FloatArray,
               block_others_s: FloatArray) -> tuple[float, int]:
    """The swap of ``x`` (on DP rank ``slowest``) with a sequence of another micro-batch that leaves the slowest DP
    rank it changes fastest, if under ``threshold_s``: (that time, the partner), or (inf, -1)."""
    tables, sums = state.tables, state.sums
    # every array the loop reads, read here once: reading an array field inside a loop costs reference counting
    lengths, rank_flops, local_attention_flops = tables.lengths, tables.rank_flops, tables.local_attention_flops
    degree_row, block_offset, bucket_size, cp_size = (tables.degree_row, tables.block_offset, tables.bucket_size,
                                                      tables.cp_size)
    all_gather_s_per_token = tables.all_gather_s_per_token
    reduce_scatter_s_per_token = tables.reduce_scatter_s_per_token
    work, attention, all_gather, reduce_scatter, units = (sums.work_flops, sums.attention_flops, sums.all_gather_s,
                                                          sums.reduce_scatter_s, sums.units)
    micro_batch, degree, first_rank, dp_rank_of = state.micro_batch, state.degree, state.first_rank, state.dp_rank_of
    micro_batch_times_s, dp_times_s = state.micro_batch_times_s, state.dp_times_s
    a, degree_x, first_x = micro_batch[x], degree[x], first_rank[x]
    d_x = degree_row[degree_x]
    block_x = block_offset[degree_x] + first_x // degree_x
    heaviest_x, others_a_s = block_heaviest[a, block_x], block_others_s[a, block_x]
    slowest_dp_s = dp_times_s[slowest]
    best_s, best_y = np.inf, -1
    for y in range(micro_batch.shape[0]):
        b = micro_batch[y]
        if b < 0 or b == a:
            continue
        degree_y, first_y = degree[y], first_rank[y]
        d_y = degree_row[degree_y]
        # y must fit x's place and cost less there, and x must fit y's place
        if (lengths[y] > degree_x * bucket_size or lengths[x] > degree_y * bucket_size
                or rank_flops[d_x, y] >= rank_flops[d_x, x]):
            continue
        in_slowest = dp_rank_of[b] == slowest
        # a lower bound first: each changed block's heaviest rank, no communication exposed (the loads change by
        # the same difference _swapped_time_s adds, so the bound never exceeds its time)
        block_y = block_offset[degree_y] + first_y // degree_y
        heaviest_y, others_b_s = block_heaviest[b, block_y], block_others_s[b, block_y]
        change_a = max(rank_compute_time_s(tables, heaviest_x + (rank_flops[d_x, y] - rank_flops[d_x, x])),
                       others_a_s) - micro_batch_times_s[a]
        change_b = max(rank_compute_time_s(tables, heaviest_y + (rank_flops[d_y, x] - rank_flops[d_y, y])),
                       others_b_s) - micro_batch_times_s[b]
        if in_slowest:
            bound_s = slowest_dp_s + change_a + change_b
        else:
            bound_s = max(slowest_dp_s + change_a, dp_times_s[dp_rank_of[b]] + change_b)
        if bound_s >= min(threshold_s, best_s):
            continue
        delta_a = _swap_delta(lengths, rank_flops, local_attention_flops, all_gather_s_per_token,
                              reduce_scatter_s_per_token, cp_size, d_x, degree_x, x, y)
        delta_b = _swap_delta(lengths, rank_flops, local_attention_flops, all_gather_s_per_token,
                              reduce_scatter_s_per_token, cp_size, d_y, degree_y, y, x)
        change_a = _swapped_time_s(tables, work, attention, all_gather, reduce_scatter, units, a, degree_x,
                                   first_x, delta_a, others_a_s) - micro_batch_times_s[a]
        change_b = _swapped_time_s(tables, work, attention, all_gather, reduce_scatter, units, b, degree_y,
                                   first_y, delta_b, others_b_s) - micro_batch_times_s[b]
        if in_slowest:
            score_s = slowest_dp_s + change_a + change_b
        else:
            score_s = max(slowest_dp_s + change_a, dp_times_s[dp_rank_of[b]] + change_b)
        if score_s < best_s:
            best_s, best_y = score_s, y
    if best_s >= threshold_s:
        return np.inf, -1
    return best_s, best_y


@kernel(types.Tuple((types.float64, types.int64, types.int64, types.int64))(
    STATE, types.int64, types.int64, types.float64, types.float64))
def _best_move(state: _State, x: int, slowest: int, threshold_s: float,
               cut_s: float) -> tuple[float, int, int, int]:
    """Where ``x`` (on DP rank ``slowest``, whose micro-batch it cuts by ``cut_s``) goes best, at any degree it fits
    and onto any aligned block of any micro-batch where it fits in memory, scored by the time of the slowest DP rank
    the move changes: (that time, micro-batch, degree, first rank), or (inf, -1, 0, 0) if nothing beats
    ``threshold_s``. Ties go to the first micro-batch, then the smaller degree, then the first block.

    Adding work never makes a rank faster (its own attention hides at most its own communication), so a move into
    micro-batch m scores at least its DP rank's time, and a block at least its heaviest rank's compute with x's
    share added: micro-batches and blocks whose bound cannot beat the best so far are not costed."""
    tables, sums = state.tables, state.sums
    cp_size, degrees, capacity = tables.cp_size, tables.degrees, tables.bucket_size * tables.cp_size
    work, attention, all_gather, reduce_scatter, units, block_members = (
        sums.work_flops, sums.attention_flops, sums.all_gather_s, sums.reduce_scatter_s, sums.units,
        sums.block_members)
    times_s, dp_times_s, dp_rank_of = state.times_s, state.dp_times_s, state.dp_rank_of
    source, degree_x, first_x = state.micro_batch[x], state.degree[x], state.first_rank[x]
    block_x = block_index(tables, degree_x, first_x)
    removed = place_delta(tables, x, degree_x, block_members[source, block_x], -1)
    slowest_after_s = dp_times_s[slowest] - cut_s
    best = (threshold_s, -1, 0, 0)
    base_work = np.empty(cp_size)
    base_attention = np.empty(cp_size)
    base_all_gather = np.empty(cp_size)
    base_reduce_scatter = np.empty(cp_size)
    base_units = np.empty(cp_size, dtype=np.int64)
    base_times_s = np.empty(cp_size)
    for m in range(dp_rank_of.shape[0]):
        dp_time_s = slowest_after_s if dp_rank_of[m] == slowest else dp_times_s[dp_rank_of[m]]
        if max(dp_time_s, slowest_after_s) >= best[0]:
            continue
        # micro-batch m as it would be without x
        for r in range(cp_size):
            base_work[r] = work[m, r]
            base_attention[r] = attention[m, r]
            base_all_gather[r] = all_gather[m, r]
            base_reduce_scatter[r] = reduce_scatter[m, r]
            base_units[r] = units[m, r]
            base_times_s[r] = times_s[m, r]
            if m == source and first_x <= r < first_x + degree_x:
                base_work[r] += removed[0]
                base_attention[r] += removed[1]
                base_all_gather[r] += removed[2]
                base_reduce_scatter[r] += removed[3]
                base_units[r] += removed[4]
                base_times_s[r] = rank_time_s(tables, base_work[r], base_attention[r], base_all_gather[r],
                                              base_reduce_scatter[r], base_units[r])
        base_micro_batch_s = base_times_s.max()
        for degree in degrees:
            if tables.lengths[x] > degree * tables.bucket_size:
                continue
            joining = place_delta(tables, x, degree, 1, 1)  # onto a block that has sequences already
            opening = place_delta(tables, x, degree, 0, 1)  # onto an empty one: its collectives' fixed costs too
            # the busiest and second busiest blocks of this degree, before x arrives
            busiest_s, second_s = 0.0, 0.0
            for first_rank in range(0, cp_size, degree):
                block_s = block_max(base_times_s, first_rank, degree)
                if block_s >= busiest_s:
                    busiest_s, second_s = block_s, busiest_s
                elif block_s > second_s:
                    second_s = block_s
            for first_rank in range(0, cp_size, degree):
                others_s = second_s if block_max(base_times_s, first_rank, degree) >= busiest_s else busiest_s
                lower_s = max(others_s, rank_compute_time_s(tables, block_max(base_work, first_rank, degree)
                                                            + joining[0]))
                if max(dp_time_s - base_micro_batch_s + lower_s, slowest_after_s) >= best[0]:
                    continue
                b = block_index(tables, degree, first_rank)
                members_before = block_members[m, b]
                if m == source and b == block_x:
                    members_before -= 1  # x itself leaves it
                added = opening if members_before == 0 else joining
                micro_batch_s = others_s
                fits = True
                for r in range(first_rank, first_rank + degree):
                    if base_units[r] + added[4] > capacity:
                        fits = False
                        break
                    micro_batch_s = max(micro_batch_s, rank_time_s(
                        tables, base_work[r] + added[0], base_attention[r] + added[1],
                        base_all_gather[r] + added[2], base_reduce_scatter[r] + added[3], base_units[r] + added[4]))
                if not fits:
                    continue
                score_s = max(dp_time_s - base_micro_batch_s + micro_batch_s, slowest_after_s)
                if score_s < best[0]:
                    best = (score_s, m, degree, first_rank)
    if best[1] < 0:
        return np.inf, -1, 0, 0
    return best


@kernel(types.UniTuple(types.int64, 2)(STATE, types.int64, types.int64, types.int64, types.int64, types.int64))
def _apply(state: _State, x: int, y: int, m: int, degree: int, first_rank: int) -> tuple[int, int]:
    """Swap ``x`` with ``y`` (``y >= 0``), or move ``x`` to (``m``, ``degree``, ``first_rank``); the two
    micro-batches it changed, retimed."""
    a = state.micro_batch[x]
    if y >= 0:
        b, degree_x, first_x = state.micro_batch[y], state.degree[x], state.first_rank[x]
        _move_sequence(state, x, b, state.degree[y], state.first_rank[y])
        _move_sequence(state, y, a, degree_x, first_x)
    else:
        b = m
        _move_sequence(state, x, m, degree, first_rank)
    _retime(state, a)
    _retime(state, b)
    _sum_dp_times(state)
    return a, b


@kernel(types.int64(STATE, types.int64))
def _local_search(state: _State, budget: int) -> int:
    """The steps of the module docstring until no sequence improves or the budget is spent; what is left of it."""
    tables, dp_times_s = state.tables, state.dp_times_s
    settled = np.zeros(state.micro_batch.shape[0], dtype=np.bool_)  # don't-look bits
    while budget > 0:
        slowest = int(np.argmax(dp_times_s))
        threshold_s = dp_times_s[slowest] * (1 - MIN_PLAN_GAIN)
        candidates, cuts_s = _critical_sequences(state, slowest)
        block_heaviest = block_others_s = np.zeros((0, tables.num_blocks))
        found = False
        for i in range(candidates.shape[0]):
            x = candidates[i]
            if cuts_s[i] <= 0 or budget <= 0:
                break
            if settled[x]:
                continue
            budget -= 1
            if block_heaviest.shape[0] == 0:
                block_heaviest, block_others_s = _block_extremes(state)
            swap_s, y = _best_swap(state, x, slowest, threshold_s, block_heaviest, block_others_s)
            move_s, m, degree, first_rank = _best_move(state, x, slowest, threshold_s, cuts_s[i])
            if y >= 0 and swap_s <= move_s:
                changed = _apply(state, x, y, -1, 0, 0)
            elif m >= 0:
                changed = _apply(state, x, -1, m, degree, first_rank)
            else:
                settled[x] = True
                continue
            micro_batch = state.micro_batch
            for k in range(micro_batch.shape[0]):
                if micro_batch[k] == changed[0] or micro_batch[k] == changed[1]:
                    settled[k] = False
            found = True
            break
        if not found:
            break
    return budget


@kernel(types.int64(types.int64))
def _next_random(seed: int) -> int:
    """Park and Miller's minimal standard generator: the same numbers compiled and in Python (no overflow)."""
    return seed * 48271 % 2147483647


@kernel(types.Tuple((types.int64, types.boolean))(STATE, types.int64))
def _kick(state: _State, seed: int) -> tuple[int, bool]:
    """Iterated local search's step out of a local optimum: swap a random sequence of the slowest DP rank with a
    random sequence of another micro-batch where each fits the other's place (bucket and memory), whatever that
    does to the time. The next random state, and whether a swap was made (``KICK_ATTEMPTS`` pairs are drawn)."""
    tables, micro_batch, degree = state.tables, state.micro_batch, state.degree
    num_sequences = micro_batch.shape[0]
    slowest = np.argmax(state.dp_times_s)
    for _ in range(KICK_ATTEMPTS):
        seed = _next_random(seed)
        x = seed % num_sequences
        seed = _next_random(seed)
        y = seed % num_sequences
        a, b = micro_batch[x], micro_batch[y]
        if a < 0 or b < 0 or a == b or state.dp_rank_of[a] != slowest:
            continue
        if (tables.lengths[y] > degree[x] * tables.bucket_size
                or tables.lengths[x] > degree[y] * tables.bucket_size
                or not _swap_fits(tables, state, x, y) or not _swap_fits(tables, state, y, x)):
            continue
        _apply(state, x, y, -1, 0, 0)
        return seed, True
    return seed, False


@kernel(types.float64(TABLES, INT_1D, INT_1D, INT_1D, INT_1D, types.int64, types.int64))
def refine_places(tables: CostTables, micro_batch: IntArray, degree: IntArray, first_rank: IntArray,
                  dp_rank_of: IntArray, dp_size: int, budget: int) -> float:
    """Refine the plan ``micro_batch``, ``degree``, ``first_rank`` in place (emptied micro-batches stay, empty)
    within ``budget`` units of search work (module docstring); its iteration time under the cost model, never
    higher than before."""
    state = _new_state(tables, micro_batch, degree, first_rank, dp_rank_of, dp_size)
    if dp_rank_of.shape[0] == 0 or tables.degrees.shape[0] == 1:
        return state.dp_times_s.max()
    budget = _local_search(state, budget)
    best_s = state.dp_times_s.max()
    best_micro_batch, best_degree, best_first_rank = micro_batch.copy(), degree.copy(), first_rank.copy()
    seed = 1
    while budget > 0:  # iterated local search: kick the best plan, search again, keep what is better
        budget -= 1
        seed, kicked = _kick(state, seed)
        if kicked:
            budget = _local_search(state, budget)
            if state.dp_times_s.max() < best_s:
                best_s = state.dp_times_s.max()
                best_micro_batch[:] = state.micro_batch
                best_degree[:] = state.degree
                best_first_rank[:] = state.first_rank
                continue
        state = _new_state(tables, best_micro_batch.copy(), best_degree.copy(), best_first_rank.copy(), dp_rank_of,
                           dp_size)
    micro_batch[:] = best_micro_batch
    degree[:] = best_degree
    first_rank[:] = best_first_rank
    return best_s


def refine_plan(problem: PlanningProblem, places: Places, *, budget: int | None = None) -> tuple[Places, float]:
    """``places`` refined within ``budget`` units of search work (module docstring), and its iteration time under
    the cost model, never higher than before; ``places`` itself is left as it was. ``None``: ``DEFAULT_BUDGET`` on a
    batch of a few hundred sequences and micro-batches, less on larger ones, whose costings are dearer."""
    refined = Places(places.micro_batch.copy(), places.degree.copy(), places.first_rank.copy(),
                     places.dp_rank.copy())
    if budget is None:
        work = problem.num_sequences + places.num_micro_batches
        budget = max(1, min(DEFAULT_BUDGET, DEFAULT_BUDGET * _DEFAULT_WORK_PER_COSTING // work))
    time_s = refine_places(problem.tables, refined.micro_batch, refined.degree, refined.first_rank,
                           refined.dp_rank, problem.dp_size, budget)
    # micro-batches a move emptied are dropped, the others renumbered in order
    used = np.bincount(refined.micro_batch[refined.micro_batch >= 0], minlength=refined.num_micro_batches) > 0
    number = np.cumsum(used) - 1
    scheduled = refined.micro_batch >= 0
    refined.micro_batch[scheduled] = number[refined.micro_batch[scheduled]]
    return Places(refined.micro_batch, refined.degree, refined.first_rank, refined.dp_rank[used]), time_s
