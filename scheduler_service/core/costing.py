"""What a place costs: the cost tables of one global batch, per-rank sums, and ``T_r``, as compiled kernels.

A sequence's **place** is a degree and a first CP rank: kept whole on CP rank ``first_rank`` (degree 1), or
zigzag-sharded over the aligned block of ``degree`` ranks that starts at ``first_rank`` (``degree`` divides
``cp_size`` and ``first_rank`` is a multiple of it; degree ``cp_size`` is the whole CP group, first rank 0). Every
scheduler, the refinement, the simulator and CP-SAT's read-back speak of places this way; ``plan.MicroBatch``
converts them to and from the wire's ``local`` / ``distributed`` / ``sharded`` lists.

Array axes, for this module and every kernel module of the core:

    N  the sequences of the global batch (index k)
    D  the degrees a place can have, ascending: 1, each hybrid block size, cp_size (index d)
    C  the CP ranks of a micro-batch (index r)
    M  micro-batches (index m)
    B  the aligned blocks of every degree, numbered degree by degree from ``block_offset[degree]`` (index b)
    K  the sequences of one micro-batch

Each CP rank of a micro-batch computes, as one packed row, its share of every sequence placed on it
(``rank_flops[d, k]``: the whole sequence at degree 1, else ``1/degree`` of it with attention at the efficiency of
its query chunks; ``PerformanceModel.placement_flops``), pays the fixed cost ``β`` once, and takes part in one
all-gather (forward) and one reduce-scatter (backward) per block it holds a shard of, each paying the block's
fixed collective cost once per micro-batch. Local attention hides the collectives: the all-gathers behind its
forward, the reduce-scatters behind its backward (``PerformanceModel.exposed_comm_s``). So, with ``W_r`` the rank's
FLOP-equivalents (``rank_time_s``):

    T_r = max(F, α·W_r + β + max(0, ΣAG − T_attn,fwd(local_r)) + max(0, ΣRS − T_attn,bwd(local_r)))

and 0 for a rank without work; ``F`` is the launch-bound floor (``PerformanceModel.compute_floor_s``: the host's
dispatch, which the device's work overlaps on a GPU; 0 in additive profiles). With **token buckets** (a trainer
that replays CUDA graphs captured per bucket pads each rank's row to the smallest bucket that holds it), ``W_r``
also counts the padding: the linear layers' FLOP-equivalents of every padded token (``padding_flops``), so that
the planner fills buckets rather than pays for padding it does not see. ``T_r`` never falls when work is added to
the rank (a token added costs at least what its padding did): the searches rely on it.
Memory is counted in exact integers, in units of 1/C token: a rank holds ``bucket_size · C`` units and a sequence
of S tokens at degree s costs ``S · C/s`` on each rank of its block.
"""

from __future__ import annotations

from typing import NamedTuple

import numba
import numpy as np
import numpy.typing as npt
from numba import types

from scheduler_service.core.jit import FLOAT_1D, FLOAT_2D, INT_1D, kernel
from scheduler_service.core.perf_model import ATTENTION_FORWARD_SHARE, PerformanceModel

__all__ = [
    "SUMS",
    "TABLES",
    "CostTables",
    "RankSums",
    "block_degrees",
    "block_index",
    "block_max",
    "changed_micro_batch_time_s",
    "clear_row",
    "cost_tables",
    "empty_sums",
    "exposed_comm_s",
    "micro_batch_time_s",
    "padding_flops",
    "place",
    "place_degrees",
    "place_delta",
    "rank_compute_time_s",
    "rank_time_s",
    "rank_times_s",
    "scheme_rank_time_s",
    "sum_rank_time_s",
    "sums_of_places",
    "token_bucket_sizes",
]

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]


def block_degrees(cp_size: int) -> tuple[int, ...]:
    """Sizes a hybrid group may have: the divisors ``s`` of ``cp_size`` with ``2 <= s < cp_size``, ascending."""
    return tuple(s for s in range(2, cp_size) if cp_size % s == 0)


def place_degrees(cp_size: int) -> tuple[int, ...]:
    """The degrees a place can have (axis D): 1, each hybrid block size, and the whole group."""
    return (1, *block_degrees(cp_size), cp_size) if cp_size > 1 else (1,)


class CostTables(NamedTuple):
    """One global batch's costs, as the kernels read them (built once per batch by ``cost_tables``)."""

    lengths: IntArray  # (N,) tokens
    rank_flops: FloatArray  # (D, N) FLOP-equivalents each rank of the block computes for the sequence at degree d
    local_attention_flops: FloatArray  # (N,) the attention part of rank_flops[0]: what hides a rank's collectives
    # (N,) the least rank-FLOP-equivalents a sequence can cost: degree · rank_flops over the degrees s it fits
    # (S <= s·C); its cost at the cheapest place, spread over the ranks it occupies
    area: FloatArray
    degrees: IntArray  # (D,)
    degree_row: IntArray  # (C + 1,) d of each degree, -1 where a number is not a degree
    block_offset: IntArray  # (C + 1,) b of the first block of each degree
    all_gather_s_per_token: FloatArray  # (D,) a block's collectives over all layers, per token sharded over it ...
    all_gather_fixed_s: FloatArray  # (D,) ... and once per micro-batch where it has a sequence (0 at degree 1)
    reduce_scatter_s_per_token: FloatArray  # (D,)
    reduce_scatter_fixed_s: FloatArray  # (D,)
    alpha_s_per_flop: float
    beta_s: float  # β·L, paid once per micro-batch by each CP rank with work
    floor_s: float  # F = floor·L: no CP rank with work takes less (0: the additive form)
    bucket_units: IntArray  # (U,) the token buckets a rank's row is padded to, ascending, in units; empty: none
    pad_flops_per_unit: float  # what a padding token costs (the linear layers' FLOP-equivalents), per unit; 0: none
    attention_forward_share: float
    cp_size: int
    bucket_size: int
    num_blocks: int  # B

    @property
    def capacity_units(self) -> int:
        """What one CP rank holds, in units of 1/C token."""
        return self.bucket_size * self.cp_size


def token_bucket_sizes(bucket_size: int, count: int) -> tuple[int, ...]:
    """The ``count`` token buckets of a rank holding ``bucket_size`` tokens: ``bucket_size`` and its halves, each
    rounded up to a multiple of 64 tokens (kernel tiles), ascending; the largest is ``bucket_size`` itself, so that
    every row the memory bound admits fits one."""
    sizes = {bucket_size, *(min(bucket_size, -(-bucket_size // (2 ** k) // 64) * 64) for k in range(1, count))}
    return tuple(sorted(sizes)) if count else ()


def cost_tables(perf: PerformanceModel, lengths: IntArray, cp_size: int, bucket_size: int,
                token_buckets: int = 0) -> CostTables:
    degrees = place_degrees(cp_size)
    degree_row = np.full(cp_size + 1, -1, dtype=np.int64)
    block_offset = np.zeros(cp_size + 1, dtype=np.int64)
    num_blocks = 0
    for row, degree in enumerate(degrees):
        degree_row[degree] = row
        block_offset[degree] = num_blocks
        num_blocks += cp_size // degree
    collectives = [perf.collective_cost(degree) for degree in degrees]

    def per_degree(cost: str) -> FloatArray:
        return np.array([getattr(collective, cost) for collective in collectives], dtype=np.float64)

    lengths = np.ascontiguousarray(lengths, dtype=np.int64)
    degree_column = np.array(degrees, dtype=np.int64)[:, None]
    rank_flops = np.ascontiguousarray([perf.placement_flops(lengths, degree) for degree in degrees], dtype=np.float64)
    area = np.where(lengths <= degree_column * bucket_size, degree_column * rank_flops, np.inf).min(axis=0)
    return CostTables(
        lengths=lengths, rank_flops=rank_flops,
        local_attention_flops=np.ascontiguousarray(perf.local_attention_flops(lengths), dtype=np.float64),
        area=np.ascontiguousarray(area), degrees=np.array(degrees, dtype=np.int64), degree_row=degree_row,
        block_offset=block_offset,
        all_gather_s_per_token=per_degree("all_gather_s_per_token"),
        all_gather_fixed_s=per_degree("all_gather_fixed_s"),
        reduce_scatter_s_per_token=per_degree("reduce_scatter_s_per_token"),
        reduce_scatter_fixed_s=per_degree("reduce_scatter_fixed_s"),
        alpha_s_per_flop=float(perf.profile.compute.alpha_s_per_flop), beta_s=float(perf.compute_beta_s),
        floor_s=float(perf.compute_floor_s),
        bucket_units=np.array(token_bucket_sizes(bucket_size, token_buckets), dtype=np.int64) * cp_size,
        pad_flops_per_unit=float(perf.padding_flops_per_token) / cp_size if token_buckets else 0.0,
        attention_forward_share=ATTENTION_FORWARD_SHARE, cp_size=cp_size, bucket_size=bucket_size,
        num_blocks=num_blocks)


# The numba types of the two, for kernel signatures (every instance has these: contiguous int64 / float64 arrays)
TABLES = numba.typeof(CostTables(
    lengths=np.zeros(1, dtype=np.int64), rank_flops=np.zeros((1, 1)), local_attention_flops=np.zeros(1),
    area=np.zeros(1), degrees=np.ones(1, dtype=np.int64), degree_row=np.zeros(2, dtype=np.int64),
    block_offset=np.zeros(2, dtype=np.int64), all_gather_s_per_token=np.zeros(1), all_gather_fixed_s=np.zeros(1),
    reduce_scatter_s_per_token=np.zeros(1), reduce_scatter_fixed_s=np.zeros(1), alpha_s_per_flop=1.0, beta_s=0.0,
    floor_s=0.0, bucket_units=np.zeros(0, dtype=np.int64), pad_flops_per_unit=0.0,
    attention_forward_share=ATTENTION_FORWARD_SHARE, cp_size=1, bucket_size=1, num_blocks=1))


class RankSums(NamedTuple):
    """Per micro-batch and CP rank, the sums ``T_r`` and the memory bound need, and each block's sequence count."""

    work_flops: FloatArray  # (M, C)
    attention_flops: FloatArray  # (M, C) local attention
    all_gather_s: FloatArray  # (M, C)
    reduce_scatter_s: FloatArray  # (M, C)
    units: IntArray  # (M, C) memory, in 1/C token
    block_members: IntArray  # (M, B) sequences placed on each block
    # (M, C) communication nothing hides: a Ulysses or 2D collective's (``schemes``); the searches place by
    # all-gather-KV alone and leave it 0
    exposed_s: FloatArray


SUMS = numba.typeof(RankSums(np.zeros((1, 1)), np.zeros((1, 1)), np.zeros((1, 1)), np.zeros((1, 1)),
                             np.zeros((1, 1), dtype=np.int64), np.zeros((1, 1), dtype=np.int64), np.zeros((1, 1))))


@kernel(SUMS(TABLES, types.int64))
def empty_sums(tables: CostTables, num_micro_batches: int) -> RankSums:
    """The sums of ``num_micro_batches`` empty micro-batches."""
    shape = (num_micro_batches, tables.cp_size)
    return RankSums(np.zeros(shape), np.zeros(shape), np.zeros(shape), np.zeros(shape),
                    np.zeros(shape, dtype=np.int64), np.zeros((num_micro_batches, tables.num_blocks), dtype=np.int64),
                    np.zeros(shape))


@kernel(types.void(SUMS, types.int64))
def clear_row(sums: RankSums, m: int) -> None:
    """Micro-batch ``m``'s sums back to an empty micro-batch's (exact zeros)."""
    sums.work_flops[m, :] = 0.0
    sums.attention_flops[m, :] = 0.0
    sums.all_gather_s[m, :] = 0.0
    sums.reduce_scatter_s[m, :] = 0.0
    sums.units[m, :] = 0
    sums.block_members[m, :] = 0
    sums.exposed_s[m, :] = 0.0


@kernel(types.float64(FLOAT_1D, types.int64, types.int64))
def block_max(values: FloatArray, first_rank: int, degree: int) -> float:
    """The largest of ``values`` over the block of ``degree`` ranks from ``first_rank`` (a loop, not a slice's
    reduction: this runs in the searches' innermost loops)."""
    largest = values[first_rank]
    for r in range(first_rank + 1, first_rank + degree):
        largest = max(largest, values[r])
    return largest


@kernel(types.int64(TABLES, types.int64, types.int64), inline=True)
def block_index(tables: CostTables, degree: int, first_rank: int) -> int:
    """b of the aligned block of ``degree`` ranks that starts at ``first_rank``."""
    return tables.block_offset[degree] + first_rank // degree


@kernel(types.Tuple((types.float64, types.float64, types.float64, types.float64, types.int64))(
    TABLES, types.int64, types.int64, types.int64, types.int64), inline=True)
def place_delta(tables: CostTables, k: int, degree: int, block_members_before: int,
                sign: int) -> tuple[float, float, float, float, int]:
    """What adding (``sign`` 1) or taking away (``sign`` -1) sequence ``k`` at ``degree`` changes on each rank of
    its block, which held ``block_members_before`` sequences: (work, local attention, all-gather, reduce-scatter,
    memory units). A block's collectives pay their fixed cost with its first sequence, and get it back with its
    last; a single rank's collectives cost nothing (``CostTables``), so no branch is needed for them."""
    d = tables.degree_row[degree]
    length = tables.lengths[k]
    pays_fixed = block_members_before == (0 if sign > 0 else 1)
    return (sign * tables.rank_flops[d, k],
            sign * (degree == 1) * tables.local_attention_flops[k],
            sign * (tables.all_gather_s_per_token[d] * length + pays_fixed * tables.all_gather_fixed_s[d]),
            sign * (tables.reduce_scatter_s_per_token[d] * length + pays_fixed * tables.reduce_scatter_fixed_s[d]),
            sign * length * (tables.cp_size // degree))


@kernel(types.void(TABLES, SUMS, types.int64, types.int64, types.int64, types.int64, types.int64), inline=True)
def place(tables: CostTables, sums: RankSums, m: int, k: int, degree: int, first_rank: int, sign: int) -> None:
    """Add (``sign`` 1) or take away (``sign`` -1) sequence ``k`` at its place in micro-batch ``m``'s sums."""
    work, attention, all_gather, reduce_scatter, units, block_members = (
        sums.work_flops, sums.attention_flops, sums.all_gather_s, sums.reduce_scatter_s, sums.units,
        sums.block_members)
    b = block_index(tables, degree, first_rank)
    work_flops, attention_flops, all_gather_s, reduce_scatter_s, unit_count = place_delta(
        tables, k, degree, block_members[m, b], sign)
    block_members[m, b] += sign
    for r in range(first_rank, first_rank + degree):
        work[m, r] += work_flops
        attention[m, r] += attention_flops
        all_gather[m, r] += all_gather_s
        reduce_scatter[m, r] += reduce_scatter_s
        units[m, r] += unit_count


@kernel(types.float64(TABLES, types.float64, types.float64, types.float64), inline=True)
def exposed_comm_s(tables: CostTables, attention_flops: float, all_gather_s: float, reduce_scatter_s: float) -> float:
    """Communication local attention leaves visible: the all-gathers hide behind its forward, the reduce-scatters
    behind its backward (the trainer's two overlaps, and no other)."""
    attention_s = tables.alpha_s_per_flop * attention_flops
    forward_s = attention_s * tables.attention_forward_share
    return max(0.0, all_gather_s - forward_s) + max(0.0, reduce_scatter_s - (attention_s - forward_s))


@kernel(types.float64(TABLES, types.int64), inline=True)
def padding_flops(tables: CostTables, units: int) -> float:
    """What padding a row of ``units`` (memory units) to its token bucket costs: the linear layers' FLOP-equivalents
    of the padding tokens; 0 without buckets. The memory bound keeps a row within the largest bucket."""
    if tables.pad_flops_per_unit == 0.0:  # no buckets: the array field is not read (a read in a loop costs refcounts)
        return 0.0
    for bucket in tables.bucket_units:
        if units <= bucket:
            return (bucket - units) * tables.pad_flops_per_unit
    return 0.0


@kernel(types.float64(TABLES, types.float64, types.float64, types.float64, types.float64, types.int64),
        inline=True)
def rank_time_s(tables: CostTables, work_flops: float, attention_flops: float, all_gather_s: float,
                reduce_scatter_s: float, units: int) -> float:
    """``T_r`` (module docstring): the one cost function of every scheduler, the refinement and the simulator, for
    a rank holding ``units`` of memory, whose collectives are all-gather-KV."""
    return scheme_rank_time_s(tables, work_flops, attention_flops, all_gather_s, reduce_scatter_s, 0.0, units)


@kernel(types.float64(TABLES, types.float64, types.float64, types.float64, types.float64, types.float64,
                      types.int64), inline=True)
def scheme_rank_time_s(tables: CostTables, work_flops: float, attention_flops: float, all_gather_s: float,
                       reduce_scatter_s: float, exposed_s: float, units: int) -> float:
    """``T_r`` with ``exposed_s`` of communication nothing hides (a Ulysses or 2D collective's, ``schemes``); the
    hidden parts of its communication are in ``all_gather_s`` (forward) and ``reduce_scatter_s`` (backward)."""
    if work_flops <= 0.0:
        return 0.0
    return max(tables.floor_s, tables.alpha_s_per_flop * (work_flops + padding_flops(tables, units)) + tables.beta_s
               + exposed_comm_s(tables, attention_flops, all_gather_s, reduce_scatter_s) + exposed_s)


@kernel(types.float64(TABLES, types.float64), inline=True)
def rank_compute_time_s(tables: CostTables, work_flops: float) -> float:
    """``T_r`` without its exposed communication: never above it, and monotone in the work, so a search can bound a
    block by its heaviest rank and skip what cannot win."""
    if work_flops <= 0.0:
        return 0.0
    return max(tables.floor_s, tables.alpha_s_per_flop * work_flops + tables.beta_s)


@kernel(types.float64(TABLES, SUMS, types.int64, types.int64))
def sum_rank_time_s(tables: CostTables, sums: RankSums, m: int, r: int) -> float:
    """``T_r`` of CP rank ``r`` of micro-batch ``m``."""
    return scheme_rank_time_s(tables, sums.work_flops[m, r], sums.attention_flops[m, r], sums.all_gather_s[m, r],
                              sums.reduce_scatter_s[m, r], sums.exposed_s[m, r], sums.units[m, r])


@kernel(types.float64(TABLES, SUMS, types.int64, types.int64, types.int64, types.float64, types.float64,
                      types.float64, types.float64))
def changed_micro_batch_time_s(tables: CostTables, sums: RankSums, m: int, first_rank: int, degree: int,
                               work_flops: float, all_gather_s: float, reduce_scatter_s: float,
                               exposed_s: float) -> float:
    """``micro_batch_time_s`` were each rank of the block of ``degree`` ranks from ``first_rank`` to compute
    ``work_flops`` more, hide ``all_gather_s`` and ``reduce_scatter_s`` more and expose ``exposed_s`` more (a
    collective's change of scheme, ``schemes``), without changing ``sums``."""
    slowest_s = 0.0
    for r in range(tables.cp_size):
        if first_rank <= r < first_rank + degree:
            time_s = scheme_rank_time_s(tables, sums.work_flops[m, r] + work_flops, sums.attention_flops[m, r],
                                        sums.all_gather_s[m, r] + all_gather_s,
                                        sums.reduce_scatter_s[m, r] + reduce_scatter_s,
                                        sums.exposed_s[m, r] + exposed_s, sums.units[m, r])
        else:
            time_s = sum_rank_time_s(tables, sums, m, r)
        slowest_s = max(slowest_s, time_s)
    return slowest_s


@kernel(types.void(TABLES, SUMS, FLOAT_2D))
def rank_times_s(tables: CostTables, sums: RankSums, times_s: FloatArray) -> None:
    """``T_r`` of every CP rank of every micro-batch, into ``times_s`` (M, C)."""
    for m in range(times_s.shape[0]):
        for r in range(tables.cp_size):
            times_s[m, r] = sum_rank_time_s(tables, sums, m, r)


@kernel(types.float64(TABLES, SUMS, types.int64))
def micro_batch_time_s(tables: CostTables, sums: RankSums, m: int) -> float:
    """The slowest CP rank's ``T_r`` (eq. 1)."""
    slowest_s = 0.0
    for r in range(tables.cp_size):
        slowest_s = max(slowest_s, sum_rank_time_s(tables, sums, m, r))
    return slowest_s


@kernel(types.void(TABLES, SUMS, INT_1D, INT_1D, INT_1D))
def sums_of_places(tables: CostTables, sums: RankSums, micro_batch: IntArray, degree: IntArray,
                   first_rank: IntArray) -> None:
    """Add every scheduled sequence (``micro_batch[k] >= 0``) at its place, in index order."""
    for k in range(micro_batch.shape[0]):
        if micro_batch[k] >= 0:
            place(tables, sums, micro_batch[k], k, degree[k], first_rank[k], 1)
