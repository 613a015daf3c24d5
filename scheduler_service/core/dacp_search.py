"""The candidate search behind binary and hybrid DACP, vectorised over micro-batches and candidates.

Each row of the arrays here is one candidate decision for one micro-batch. Both greedy placements are sequential
in a micro-batch's sequences but independent across rows, so one step places the j-th sequence of every row of a
whole global batch in a few dozen numpy operations, where a Python loop would visit every rank of every candidate
of every micro-batch (README, "Planning latency").

* ``binary_rows`` — "shard the k longest over the whole CP group, place the rest largest-first on the least-loaded
  rank with room (LPT under the memory bound), shard a sequence that fits on no rank", for the few k worth trying.
* ``hybrid_rows`` — the dual approximation over degrees: under a cap on every rank's load, each sequence takes
  the smallest degree (1, an aligned block, the whole group) whose per-rank share fits the cap and whose tokens
  fit a bucket per rank; widest first, heaviest first within a degree, each goes to the best-fitting aligned
  block where it stays under the cap, escalating its degree when no block has room. A grid of caps between the
  balanced load and the best binary decision's busiest rank, and one above it (below the binary decision's time
  as a load), one row each.

Memory is in exact integer units of 1/N token: a CP rank holds ``C·N``, a sequence sharded over ``s`` ranks
costs ``S·N/s`` on each (``s`` divides ``N``), so the memory bound holds by construction in every row.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from scheduler_service.core.plan import PlanningProblem
from scheduler_service.core.simulate import rank_time_s

__all__ = ["LOCAL", "Rows", "SearchArrays", "binary_rows", "hybrid_rows", "row_times_s", "static_rows"]

EXTRA_DISTRIBUTION_CANDIDATES = 2  # k values tried beyond the sequences too heavy to place locally
CAP_CANDIDATES = 8  # caps tried per micro-batch, evenly spaced strictly between the balanced load and the binary one
CAP_CANDIDATES_ABOVE = 1  # and between the binary decision's busiest load and its time as a load
CAP_TOLERANCE = 1.005  # no hybrid search where the binary decision is within 0.5% of the balanced load

LOCAL = 0  # ``Rows.degree`` of a sequence kept whole on one rank
IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]


@dataclass(frozen=True, slots=True)
class SearchArrays:
    """The problem's per-sequence figures as arrays, with one zero-cost padding sequence at index ``n`` so that
    micro-batches of different sizes share one rectangular array; and, per place a sequence can take (``LOCAL``,
    then each sharding degree: ``slot[degree]`` is its row), what it costs there, so one update can put each row's
    sequence at a place of its own."""

    lengths: IntArray
    local_attention: FloatArray
    area: FloatArray
    padding: int
    longest_first_rank: IntArray  # each sequence's position in the batch sorted longest first, ties by index
    slot: IntArray  # (cp_size + 1,) row of ``LOCAL`` and of each sharding degree in the arrays below
    shares: FloatArray  # (places, n + 1) per-rank share of each sequence at that place
    all_gather_per_token: FloatArray  # (places,) collectives' costs: none for ``LOCAL``
    all_gather_fixed: FloatArray
    reduce_scatter_per_token: FloatArray
    reduce_scatter_fixed: FloatArray
    group_offset: IntArray  # (places,) row of the place's first aligned block in ``Rows.has_group``
    degree: IntArray  # (places,) ``LOCAL`` or the degree
    width: IntArray  # (places,) ranks of one of its blocks
    units_per_token: IntArray  # (places,) memory units a token costs on each rank of its block
    block_of_rank: IntArray  # (cp_size, places) the index of the place's block each CP rank is in

    @classmethod
    def of(cls, problem: PlanningProblem) -> SearchArrays:
        def padded(values: Sequence[float]) -> FloatArray:
            return np.append(np.asarray(values, dtype=np.float64), 0.0)

        sharding = _group_degrees(problem)
        slot = np.zeros(problem.cp_size + 1, dtype=np.int64)
        slot[list(sharding)] = np.arange(1, len(sharding) + 1)
        collectives = [problem.perf.collective_cost(degree) for degree in sharding]

        def per_place(cost: str) -> FloatArray:
            return np.array([0.0, *(getattr(collective, cost) for collective in collectives)])

        widths, ranks = np.array([1, *sharding], dtype=np.int64), np.arange(problem.cp_size)
        offsets = _group_offsets(problem)
        longest_first = np.lexsort((np.arange(problem.num_sequences), -problem.lengths))
        longest_first_rank = np.empty(problem.num_sequences, dtype=np.int64)
        longest_first_rank[longest_first] = np.arange(problem.num_sequences)
        return cls(
            lengths=np.append(problem.lengths, 0), local_attention=padded(problem.local_attention),
            area=padded(problem.area), padding=problem.num_sequences, longest_first_rank=longest_first_rank, slot=slot,
            shares=np.array([padded(problem.placement[degree]) for degree in (1, *sharding)]),
            all_gather_per_token=per_place("all_gather_s_per_token"), all_gather_fixed=per_place("all_gather_fixed_s"),
            reduce_scatter_per_token=per_place("reduce_scatter_s_per_token"),
            reduce_scatter_fixed=per_place("reduce_scatter_fixed_s"),
            group_offset=np.array([0, *(offsets[degree] for degree in sharding)], dtype=np.int64),
            degree=np.array([LOCAL, *sharding], dtype=np.int64), width=widths,
            units_per_token=problem.cp_size // widths,
            block_of_rank=ranks[:, None] // widths[None, :])

    def share(self, degree: int) -> FloatArray:
        """Each sequence's cost on each rank when kept whole (degree 1) or sharded over ``degree`` ranks."""
        return self.shares[self.slot[degree]]


@dataclass(slots=True)
class Rows:
    """Candidate decisions, one per row, and the per-rank sums the cost model and the memory bound need.

    Per-rank sums are rank-major, ``(N, R)``: every step reduces over a handful of ranks for hundreds of rows, which
    numpy does as a few contiguous vector operations, and a dense update uses whole-array masks rather than gathers.
    ``degree[j, r]`` and ``first[j, r]`` (step-major, so a step writes one contiguous row) say where the row's j-th
    sequence ``order[r, j]`` went: ``LOCAL``, whole on rank ``first``; a degree, sharded over the aligned block of
    that many ranks starting at ``first`` (with ``cp_size`` 1, a whole-group shard has degree 1 too)."""

    micro_batch: IntArray  # (R,) which micro-batch each row decides
    order: IntArray  # (R, K) the sequences in placement order; ``padding`` past a micro-batch's size
    loads: FloatArray  # (N, R) FLOP-equivalents per rank
    attention: FloatArray  # (N, R) local attention FLOP-equivalents per rank: what hides the collectives
    all_gather: FloatArray  # (N, R) seconds of collectives per rank, forward
    reduce_scatter: FloatArray  # (N, R) and backward
    remaining: IntArray  # (N, R) memory units left per rank
    has_group: BoolArray  # (G, R) whether the row already pays a block's fixed collective cost
    degree: IntArray  # (K, R)
    first: IntArray  # (K, R)
    valid: BoolArray  # (R,) False once a sequence found no room

    @classmethod
    def empty(cls, problem: PlanningProblem, micro_batch: IntArray, order: IntArray) -> Rows:
        shape = (problem.cp_size, len(micro_batch))
        return cls(micro_batch=micro_batch, order=order, loads=np.zeros(shape), attention=np.zeros(shape),
                   all_gather=np.zeros(shape), reduce_scatter=np.zeros(shape),
                   remaining=np.full(shape, problem.bucket_size * problem.cp_size, dtype=np.int64),
                   has_group=np.zeros((_num_groups(problem), len(micro_batch)), dtype=np.bool_),
                   degree=np.zeros(order.shape[::-1], dtype=np.int64),
                   first=np.zeros(order.shape[::-1], dtype=np.int64),
                   valid=np.ones(len(micro_batch), dtype=np.bool_))

    def take(self, rows: IntArray | slice) -> Rows:
        """These rows; a slice gives views, so updating them updates these rows (see ``steps``)."""
        return Rows(micro_batch=self.micro_batch[rows], order=self.order[rows], loads=self.loads[:, rows],
                    attention=self.attention[:, rows], all_gather=self.all_gather[:, rows],
                    reduce_scatter=self.reduce_scatter[:, rows], remaining=self.remaining[:, rows],
                    has_group=self.has_group[:, rows], degree=self.degree[:, rows], first=self.first[:, rows],
                    valid=self.valid[rows])

    def steps(self, row_sizes: IntArray, num_steps: int) -> Iterator[tuple[int, int, Rows]]:
        """Each step, with how many rows still have a sequence to place at it and those rows as views (updating them
        updates these rows). Rows are ordered by decreasing micro-batch size (``row_sizes``), so those are a prefix,
        and steps with the same prefix share one view."""
        counts = np.searchsorted(-row_sizes, -np.arange(num_steps), side="left")  # rows longer than each step
        active, previous = self, -1
        for step, count in enumerate(counts.tolist()):
            if count != previous:
                active, previous = self.take(slice(count)), count
            yield step, count, active

    def put(self, arrays: SearchArrays, selected: BoolArray, step: int, degree: int | IntArray,
            blocks: IntArray) -> None:
        """Put the ``step``-th sequence of each selected row at ``degree`` (one for every row, or one per row):
        ``LOCAL``, whole on rank ``blocks``; else sharded over the aligned block of that many ranks with index
        ``blocks``, paying the block's fixed collective cost once per row. Rows of other places add exact zeros."""
        num_selected = np.count_nonzero(selected)
        if not num_selected:
            return
        # a sparse selection (shards, late steps) updates its columns only; a dense one every column, masked
        sparse = num_selected * 4 < selected.size
        columns, mask = (np.flatnonzero(selected), True) if sparse else (slice(None), selected)
        local: bool | BoolArray
        if np.ndim(degree):
            slot = arrays.slot[np.asarray(degree)[columns]]
            block_of_rank = arrays.block_of_rank[:, slot]
            is_local = slot == 0
            local = mask & is_local
            any_local, any_sharded = bool(np.any(local)), bool(np.any(mask & ~is_local))
        else:  # one place: no per-row choice to mask
            slot = arrays.slot[degree]
            block_of_rank = arrays.block_of_rank[:, slot, None]
            any_local = local = bool(slot == 0)
            any_sharded = not any_local
        sequences, blocks = self.order[columns, step], blocks[columns]
        tokens = arrays.lengths[sequences]
        in_block = (block_of_rank == blocks) & mask
        self.loads[:, columns] += in_block * arrays.shares[slot, sequences]
        self.remaining[:, columns] -= in_block * (tokens * arrays.units_per_token[slot])
        if any_local:
            self.attention[:, columns] += (in_block & local) * arrays.local_attention[sequences]
        if any_sharded:
            sharded = mask & np.logical_not(local)
            every_column = np.arange(selected.size)[columns]
            group = np.where(sharded, arrays.group_offset[slot] + blocks, 0)  # a row not sharded changes no block
            is_new = sharded & ~self.has_group[group, every_column]
            self.has_group[group, every_column] |= sharded
            self.all_gather[:, columns] += in_block * (arrays.all_gather_per_token[slot] * tokens
                                                       + arrays.all_gather_fixed[slot] * is_new)
            self.reduce_scatter[:, columns] += in_block * (arrays.reduce_scatter_per_token[slot] * tokens
                                                           + arrays.reduce_scatter_fixed[slot] * is_new)
        if sparse:
            self.degree[step, columns] = arrays.degree[slot]
            self.first[step, columns] = blocks * arrays.width[slot]
        else:
            np.copyto(self.degree[step], arrays.degree[slot], where=mask)
            np.copyto(self.first[step], blocks * arrays.width[slot], where=mask)

    def shard_prefix_over_group(self, problem: PlanningProblem, arrays: SearchArrays, counts: IntArray) -> None:
        """Shard each row's first ``counts`` sequences over the whole CP group at once (from prefix sums); a row
        whose prefix does not fit in memory is invalid."""
        cp_size = problem.cp_size
        prefix = np.arange(self.order.shape[1])[None, :] < counts[:, None]
        tokens = (arrays.lengths[self.order] * prefix).sum(axis=1)
        shares = (arrays.share(cp_size)[self.order] * prefix).sum(axis=1)
        collective = problem.perf.collective_cost(cp_size)
        any_sharded = counts > 0
        self.loads += shares
        self.remaining -= tokens
        self.all_gather += np.where(any_sharded, collective.all_gather_s_per_token * tokens
                                    + collective.all_gather_fixed_s, 0.0)
        self.reduce_scatter += np.where(any_sharded, collective.reduce_scatter_s_per_token * tokens
                                        + collective.reduce_scatter_fixed_s, 0.0)
        self.has_group[_group_offsets(problem)[cp_size]] = any_sharded
        self.degree[prefix.T] = cp_size
        self.valid &= self.remaining.min(axis=0) >= 0


@functools.cache
def _group_layout(cp_size: int, group_degrees: tuple[int, ...]) -> tuple[dict[int, int], int]:
    offsets, row = {}, 0
    for degree in group_degrees:
        offsets[degree] = row
        row += cp_size // degree
    return offsets, row


def _group_degrees(problem: PlanningProblem) -> tuple[int, ...]:
    """The degrees sequences are sharded over: every block size and the whole group (of 1 rank when cp_size is 1)."""
    return tuple(sorted({*problem.degrees[1:], problem.cp_size}))


def _group_offsets(problem: PlanningProblem) -> dict[int, int]:
    """Row of each sharding degree's first aligned block in ``Rows.has_group``."""
    return _group_layout(problem.cp_size, _group_degrees(problem))[0]


def _num_groups(problem: PlanningProblem) -> int:
    return _group_layout(problem.cp_size, _group_degrees(problem))[1]


def row_times_s(problem: PlanningProblem, rows: Rows) -> FloatArray:
    """Each row's micro-batch time under the cost model (the slowest rank's ``rank_time_s``); inf if invalid."""
    times = rank_time_s(problem, rows.loads, rows.attention, rows.all_gather, rows.reduce_scatter).max(axis=0)
    return np.where(rows.valid, times, np.inf)


def _padded_orders(groups: Sequence[Sequence[int]], arrays: SearchArrays) -> IntArray:
    """One row per micro-batch: its sequences longest first (ties by index), then padding."""
    sizes = np.fromiter(map(len, groups), dtype=np.int64, count=len(groups))
    members = np.fromiter(itertools.chain.from_iterable(groups), dtype=np.int64, count=int(sizes.sum()))
    owner = np.repeat(np.arange(len(groups)), sizes)
    by_owner_then_length = np.argsort(owner * (arrays.padding + 1) + arrays.longest_first_rank[members])
    members, owner = members[by_owner_then_length], owner[by_owner_then_length]
    orders = np.full((len(groups), int(sizes.max())), arrays.padding, dtype=np.int64)
    orders[owner, np.arange(len(members)) - (np.cumsum(sizes) - sizes)[owner]] = members
    return orders


def binary_rows(problem: PlanningProblem, arrays: SearchArrays, groups: Sequence[Sequence[int]]) -> Rows:
    """Every micro-batch's binary candidates: for each k worth trying, the k longest sharded over the whole group,
    the rest LPT-placed under the memory bound (sharded when no rank has room)."""
    cp_size, bucket_size = problem.cp_size, problem.bucket_size
    orders = _padded_orders(groups, arrays)
    lengths = arrays.lengths[orders]
    local_costs = arrays.share(1)[orders]
    fair_share = local_costs.sum(axis=1, keepdims=True) / cp_size
    num_forced = (lengths > bucket_size).sum(axis=1)  # can never be local
    num_heavy = ((lengths > bucket_size) | (local_costs > fair_share)).sum(axis=1)
    sizes = np.array([len(group) for group in groups])
    by_size = np.argsort(-sizes, kind="stable")  # largest micro-batches first: see Rows.steps
    # k from the sequences too long to be local up to the heavy ones and a few more, then all of them (static CP
    # is always a candidate, and it fits whenever the micro-batch's tokens do)
    lowest = num_forced[by_size]
    highest = np.minimum(num_heavy[by_size] + EXTRA_DISTRIBUTION_CANDIDATES, sizes[by_size])
    with_all = sizes[by_size] > highest
    counts = highest - lowest + 1 + with_all
    micro_batch = np.repeat(by_size, counts)
    ends = np.cumsum(counts)
    position = np.arange(ends[-1]) - np.repeat(ends - counts, counts)
    forced = np.where(np.repeat(with_all, counts) & (position == np.repeat(counts - 1, counts)),
                      np.repeat(sizes[by_size], counts), np.repeat(lowest, counts) + position)
    rows = Rows.empty(problem, micro_batch, orders[micro_batch])
    rows.shard_prefix_over_group(problem, arrays, forced)
    for step, count, active in rows.steps(sizes[rows.micro_batch], orders.shape[1]):
        pending = active.valid & (step >= forced[:count])
        if not pending.any():
            continue
        tokens = arrays.lengths[active.order[:, step]]
        has_room = active.remaining >= tokens * cp_size
        ranks = np.where(has_room, active.loads, np.inf).argmin(axis=0)
        local = pending & has_room[ranks, np.arange(len(ranks))]
        sharded = pending & ~local & (active.remaining.min(axis=0) >= tokens)
        active.valid &= ~(pending & ~local & ~sharded)
        active.put(arrays, local, step, LOCAL, ranks)
        if sharded.any():
            active.put(arrays, sharded, step, cp_size, np.zeros(len(ranks), dtype=np.int64))
    return rows


def static_rows(problem: PlanningProblem, arrays: SearchArrays, groups: Sequence[Sequence[int]]) -> Rows:
    """One row per micro-batch with every sequence sharded over the whole CP group (static CP)."""
    orders = _padded_orders(groups, arrays)
    rows = Rows.empty(problem, np.arange(len(groups), dtype=np.int64), orders)
    rows.shard_prefix_over_group(problem, arrays, np.array([len(group) for group in groups], dtype=np.int64))
    return rows


def hybrid_rows(problem: PlanningProblem, arrays: SearchArrays, groups: Sequence[Sequence[int]],
                binary_best: Rows, binary_best_times_s: FloatArray) -> Rows:
    """Every micro-batch's packings under a grid of caps between its balanced load (every sequence at its
    cheapest placement, spread evenly: no decision does better) and the busiest rank of its best binary decision
    (``binary_best``, one row per micro-batch in the order of ``groups``, timed ``binary_best_times_s``), and above
    that busiest rank, up to the binary decision's time as a load: a packing whose busiest rank computes more can
    still be faster where its smaller groups expose less communication, and the grid below stops a step short of
    the binary load, but a rank whose compute alone outlasts the binary decision cannot win. No rows where those
    bounds already agree."""
    cp_size, bucket_size, degrees = problem.cp_size, problem.bucket_size, problem.degrees
    orders = _padded_orders(groups, arrays)
    low = arrays.area[orders].sum(axis=1) / cp_size
    high = binary_best.loads.max(axis=0)
    ceiling = (binary_best_times_s - problem.beta_s) / problem.alpha_s_per_flop
    # a cap above the balanced load leaves every sequence whose whole cost is under it at degree 1: where that is
    # all of them, a packing is a local best fit, which the binary decision's refinement already matches
    needs_blocks = arrays.share(1)[orders].max(axis=1) > low
    below = np.flatnonzero((high > low * CAP_TOLERANCE) & needs_blocks)
    above = np.flatnonzero((ceiling > high * CAP_TOLERANCE) & needs_blocks)
    inner = np.arange(1, CAP_CANDIDATES + 1) / (CAP_CANDIDATES + 1)
    outer = np.arange(1, CAP_CANDIDATES_ABOVE + 1) / (CAP_CANDIDATES_ABOVE + 1)
    micro_batch = np.concatenate([np.repeat(below, CAP_CANDIDATES), np.repeat(above, CAP_CANDIDATES_ABOVE)])
    caps = np.concatenate([(low[below, None] + (high - low)[below, None] * inner).ravel(),
                           (high[above, None] + (ceiling - high)[above, None] * outer).ravel()])
    sizes = np.array([len(group) for group in groups])
    by_size = np.lexsort((caps, micro_batch, -sizes[micro_batch]))  # largest micro-batches first: Rows.steps
    micro_batch, caps = micro_batch[by_size], caps[by_size]
    sequences = orders[micro_batch, :int(sizes[micro_batch].max(initial=0))]
    lengths = arrays.lengths[sequences]
    # the smallest degree whose tokens fit a bucket per rank and whose share fits the cap (0: none)
    chosen = np.zeros(sequences.shape, dtype=np.int64)
    for degree in reversed(degrees):
        fits = (lengths <= degree * bucket_size) & (arrays.share(degree)[sequences] <= caps[:, None])
        chosen = np.where(fits, degree, chosen)
    is_padding = sequences == arrays.padding
    chosen_share = np.zeros(sequences.shape)
    for degree in degrees:
        chosen_share = np.where(chosen == degree, arrays.share(degree)[sequences], chosen_share)
    # widest first, heaviest share first within a degree, padding last
    placement_order = np.lexsort((sequences, -chosen_share, -chosen, is_padding), axis=-1)
    ordered = np.take_along_axis(sequences, placement_order, axis=1)
    rows = Rows.empty(problem, micro_batch, ordered)
    rows.valid &= ~((chosen == 0) & ~is_padding).any(axis=1)
    ordered_chosen = np.take_along_axis(chosen, placement_order, axis=1)
    for step, count, active in rows.steps(sizes[micro_batch], ordered.shape[1]):
        active_caps, active_chosen = caps[:count], ordered_chosen[:count, step]
        place = np.full(count, -1, dtype=np.int64)  # LOCAL or a sharding degree, -1 while none is found
        blocks = np.zeros(count, dtype=np.int64)
        for degree in degrees:  # each row's rows of sums stay as they are until its place is found: one update
            candidates = active.valid & (place < 0) & (active_chosen <= degree)
            if not candidates.any():
                continue
            best, found = _best_fit_blocks(problem, arrays, active, candidates, step, degree, active_caps)
            place[found] = LOCAL if degree == 1 else degree
            blocks[found] = best[found]
        found = place >= 0
        active.valid &= found
        active.put(arrays, found, step, np.maximum(place, LOCAL), blocks)
    return rows


def _best_fit_blocks(problem: PlanningProblem, arrays: SearchArrays, rows: Rows, candidates: BoolArray, step: int,
                     degree: int, caps: FloatArray) -> tuple[IntArray, BoolArray]:
    """For each candidate row, the aligned block of ``degree`` ranks where its ``step``-th sequence's tokens fit
    and its share keeps every rank under the cap, and whose busiest rank is the most loaded such (best fit; the
    first on ties), with whether there is one."""
    cp_size, num_rows = problem.cp_size, len(caps)
    sequences = rows.order[:, step]
    num_blocks = cp_size // degree
    if degree == 1:  # each rank is a block
        block_loads, block_room = rows.loads, rows.remaining
    else:
        shape = (num_blocks, degree, num_rows)
        block_loads = rows.loads.reshape(shape).max(axis=1)
        block_room = rows.remaining.reshape(shape).min(axis=1)
    fits = ((block_loads <= caps - arrays.share(degree)[sequences])
            & (block_room >= arrays.lengths[sequences] * num_blocks) & candidates)
    if num_blocks == 1:
        return np.zeros(num_rows, dtype=np.int64), fits[0]
    return np.where(fits, block_loads, -np.inf).argmax(axis=0), np.logical_or.reduce(fits, axis=0)
