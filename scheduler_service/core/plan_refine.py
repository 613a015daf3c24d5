"""Plan-level refinement for hybrid Skrull: a local search on the slowest DP rank, across micro-batches.

GDS decides each micro-batch on its own, and the busiest CP rank of each sets its time; a DP rank's time is the sum
over its micro-batches and the iteration the slowest DP rank's. Every micro-batch leaves slack on its other CP
ranks, and every other DP rank slack against the slowest, which no per-micro-batch search can use. Each step takes a
sequence that touches the busiest CP rank of one of the slowest DP rank's micro-batches (the one whose removal cuts
its micro-batch most first) and costs

* every swap with a sequence of another micro-batch (of any DP rank), each taking the other's place (rank or block),
  and
* every move, at any degree whose tokens fit a bucket per rank, onto any aligned block of any micro-batch of any DP
  rank (its own included) where it fits in memory;

the first sequence with a swap or move that makes the slower of the (one or two) DP ranks it changes faster than the
slowest DP rank was, by at least ``MIN_PLAN_GAIN``, takes its best one. A sequence with none is not costed again
until its micro-batch changes (a don't-look bit); a work budget bounds the sequences costed. The candidates of a
sequence are costed at once, exactly under the cost model (``rank_time_s``, collectives' fixed costs included), as
arrays over CP ranks × sequences (swaps) or CP ranks × micro-batches (moves). Swaps do most of the work: a long
sequence on a critical rank trades places with a shorter one elsewhere, which fine-tunes both micro-batches.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from scheduler_service.core.plan import MicroBatch, PlanningProblem, ShardedGroup
from scheduler_service.core.simulate import rank_compute_time_s, rank_time_s

__all__ = ["refine_plan"]

# At most this many sequences are costed, each against every swap and move (on 256-sequence batches the gain levels
# off there), and at most their array work on such a batch (a costing is O(sequences + micro-batches), about 320
# there): larger batches cost fewer sequences, so the refinement's time stays about the same.
MAX_PLAN_EVALUATIONS = 128
MAX_PLAN_WORK = MAX_PLAN_EVALUATIONS * 320
MIN_PLAN_GAIN = 1e-4  # a step must make the slowest DP rank it changes at least 0.01 % faster

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]
Array = npt.NDArray[Any]  # float64, or int64 for memory units


class _Sums(NamedTuple):
    """Per-rank sums: the inputs of ``rank_time_s`` (floats) and the memory units (1/N token, integers), as arrays
    with the CP ranks on the first axis (numpy reduces over a leading axis of 8 rows several times faster than over
    a trailing one of 8 columns)."""

    loads: Array
    attention: Array
    all_gather: Array
    reduce_scatter: Array
    units: Array

    def times_s(self, problem: PlanningProblem) -> FloatArray:
        return rank_time_s(problem, self.loads, self.attention, self.all_gather, self.reduce_scatter)


class _Move(NamedTuple):
    score_s: float  # the time of the slowest DP rank the move changes
    sequence: int
    micro_batch: int
    first: int  # of the block of ranks it moves onto
    degree_index: int


class _Swap(NamedTuple):
    score_s: float  # the time of the slowest DP rank the swap changes
    sequence: int
    partner: int


class _State:
    """Every micro-batch's per-rank sums (CP ranks × the micro-batches of every DP rank), and where each sequence
    is."""

    def __init__(self, problem: PlanningProblem, dp_ranks: Sequence[Sequence[MicroBatch]]) -> None:
        cp_size, degrees = problem.cp_size, problem.degrees
        self.problem = problem
        self.owner = np.asarray([dp for dp, micro_batches in enumerate(dp_ranks) for _ in micro_batches],
                                dtype=np.int64)
        num_micro_batches, self.num_dp = len(self.owner), len(dp_ranks)
        self.degree_index = {degree: index for index, degree in enumerate(degrees)}
        self.degrees = np.asarray(degrees, dtype=np.int64)
        self.group_offset = np.zeros(len(degrees), dtype=np.int64)  # first row of a degree's blocks in ``counts``
        num_groups = 0
        for index, degree in enumerate(degrees):
            if degree > 1:
                self.group_offset[index] = num_groups
                num_groups += cp_size // degree

        def per_degree(cost: str) -> FloatArray:  # a single rank's "collective" costs nothing
            return np.array([getattr(problem.perf.collective_cost(degree), cost) for degree in degrees])

        self.all_gather_per_token = per_degree("all_gather_s_per_token")
        self.all_gather_fixed = per_degree("all_gather_fixed_s")
        self.reduce_scatter_per_token = per_degree("reduce_scatter_s_per_token")
        self.reduce_scatter_fixed = per_degree("reduce_scatter_fixed_s")
        ranks = np.arange(cp_size)
        # rank_group[degree index, rank]: the row in ``counts`` of the rank's block of that degree (0 for single ranks)
        self.rank_group = np.array([self.group_offset[index] + ranks // degree if degree > 1 else 0 * ranks
                                    for index, degree in enumerate(degrees)])
        # block_mask[:, degree index, first rank]: the CP ranks of the block of that degree starting there
        self.block_mask = np.array([[(ranks >= first) & (ranks < first + degree) for first in range(cp_size)]
                                    for degree in degrees]).transpose(2, 0, 1).copy()
        self.units_per_token = cp_size // self.degrees
        self.share_of = np.array([problem.placement[degree] for degree in degrees])  # (degrees, sequences)
        self.lengths = problem.lengths
        self.attention_of = np.asarray(problem.local_attention)
        shape = (cp_size, num_micro_batches)
        self.sums = _Sums(np.zeros(shape), np.zeros(shape), np.zeros(shape), np.zeros(shape),
                          np.zeros(shape, dtype=np.int64))
        self.counts = np.zeros((max(num_groups, 1), num_micro_batches), dtype=np.int64)  # sequences per block
        self.micro_batch_of = np.full(problem.num_sequences, -1, dtype=np.int64)
        self.first_of = np.zeros(problem.num_sequences, dtype=np.int64)
        self.degree_index_of = np.zeros(problem.num_sequences, dtype=np.int64)
        self._place_all([(row, index, first, self.degree_index[degree])
                         for row, micro_batch in enumerate(mb for micro_batches in dp_ranks for mb in micro_batches)
                         for index, first, degree in _places(micro_batch, cp_size)])
        self.times = self.sums.times_s(problem)
        self.micro_batch_times = self.times.max(axis=0, initial=0.0)
        self.dp_times = np.bincount(self.owner, weights=self.micro_batch_times, minlength=self.num_dp)

    def _place_all(self, places: list[tuple[int, int, int, int]]) -> None:
        """Put every (micro-batch row, sequence, first rank, degree index) at once."""
        cp_size = self.problem.cp_size
        if not places:
            return
        rows, indices, firsts, degree_indices = np.array(places, dtype=np.int64).T
        self.micro_batch_of[indices], self.first_of[indices] = rows, firsts
        self.degree_index_of[indices] = degree_indices
        in_block = self.block_mask[:, degree_indices, firsts]
        for sums, alone in zip(self.sums, self.scalars(indices, degree_indices), strict=True):
            np.add.at(sums.T, rows, (in_block * alone).T)  # into the micro-batches' columns, through a view
        sharded = self.degrees[degree_indices] > 1
        np.add.at(self.counts, (self.group_of(firsts, degree_indices)[sharded], rows[sharded]), 1)
        # each block's fixed collective costs, once per micro-batch where it has a sequence
        fixed = np.zeros((2, cp_size, self.counts.shape[0]))
        for degree_index, degree in enumerate(self.problem.degrees):
            for first in range(0, cp_size, degree) if degree > 1 else ():
                group = self.group_offset[degree_index] + first // degree
                fixed[:, :, group] = np.outer((self.all_gather_fixed[degree_index],
                                               self.reduce_scatter_fixed[degree_index]),
                                              self.block_mask[:, degree_index, first])
        self.sums.all_gather[:] += fixed[0] @ (self.counts > 0)
        self.sums.reduce_scatter[:] += fixed[1] @ (self.counts > 0)

    def scalars(self, indices: IntArray, degree_indices: IntArray) -> _Sums:
        """What each sequence adds on every rank of its block at that degree, fixed collective costs left out."""
        lengths = self.lengths[indices]
        return _Sums(self.share_of[degree_indices, indices], (degree_indices == 0) * self.attention_of[indices],
                     self.all_gather_per_token[degree_indices] * lengths,
                     self.reduce_scatter_per_token[degree_indices] * lengths,
                     lengths * self.units_per_token[degree_indices])

    def group_of(self, first: IntArray, degree_index: IntArray) -> IntArray:
        """The row in ``counts`` of each block (0 for single ranks, which have none)."""
        sharded = self.degrees[degree_index] > 1
        return np.where(sharded, self.group_offset[degree_index] + first // self.degrees[degree_index], 0)

    def add(self, micro_batch: int, index: int, first: int, degree_index: int) -> None:
        self._update(micro_batch, index, first, degree_index, 1)
        self.micro_batch_of[index], self.first_of[index], self.degree_index_of[index] = micro_batch, first, degree_index

    def remove(self, index: int) -> int:
        micro_batch = int(self.micro_batch_of[index])
        self._update(micro_batch, index, int(self.first_of[index]), int(self.degree_index_of[index]), -1)
        self.micro_batch_of[index] = -1
        return micro_batch

    def _update(self, micro_batch: int, index: int, first: int, degree_index: int, sign: int) -> None:
        degree = int(self.degrees[degree_index])
        block = slice(first, first + degree)
        length = int(self.lengths[index])
        self.sums.loads[block, micro_batch] += sign * self.share_of[degree_index, index]
        if degree == 1:
            self.sums.attention[first, micro_batch] += sign * self.attention_of[index]
        else:
            group = self.group_offset[degree_index] + first // degree
            fixed = self.counts[group, micro_batch] == (0 if sign > 0 else 1)  # the block's first or last sequence
            self.sums.all_gather[block, micro_batch] += sign * (self.all_gather_per_token[degree_index] * length
                                                                + fixed * self.all_gather_fixed[degree_index])
            self.sums.reduce_scatter[block, micro_batch] += sign * (self.reduce_scatter_per_token[degree_index] * length
                                                                    + fixed * self.reduce_scatter_fixed[degree_index])
            self.counts[group, micro_batch] += sign
        self.sums.units[block, micro_batch] += sign * length * int(self.units_per_token[degree_index])

    def retime(self, micro_batches: set[int]) -> None:
        for micro_batch in micro_batches:
            if not (self.micro_batch_of == micro_batch).any():  # exact zeros for an emptied micro-batch
                for sums in self.sums:
                    sums[:, micro_batch] = 0
            self.times[:, micro_batch] = _Sums(*(sums[:, micro_batch] for sums in self.sums)).times_s(self.problem)
            self.micro_batch_times[micro_batch] = self.times[:, micro_batch].max()
        self.dp_times = np.bincount(self.owner, weights=self.micro_batch_times, minlength=self.num_dp)

    def micro_batches(self) -> list[list[MicroBatch]]:
        """Every DP rank's micro-batches as they stand now (emptied ones dropped)."""
        cp_size = self.problem.cp_size
        placed = np.flatnonzero(self.micro_batch_of >= 0)
        placed = placed[np.argsort(self.micro_batch_of[placed], kind="stable")]  # by micro-batch, then index
        members: dict[int, list[int]] = {}
        for index, micro_batch in zip(placed.tolist(), self.micro_batch_of[placed].tolist(), strict=True):
            members.setdefault(micro_batch, []).append(index)
        refined: list[list[MicroBatch]] = [[] for _ in range(self.num_dp)]
        for micro_batch, indices in members.items():
            local: list[list[int]] = [[] for _ in range(cp_size)]
            distributed: list[int] = []
            sharded: dict[tuple[int, int], list[int]] = {}
            for index in indices:
                first, degree = int(self.first_of[index]), int(self.degrees[self.degree_index_of[index]])
                if degree == 1:
                    local[first].append(index)
                elif degree == cp_size:
                    distributed.append(index)
                else:
                    sharded.setdefault((first, degree), []).append(index)
            refined[int(self.owner[micro_batch])].append(MicroBatch(
                local=tuple(map(tuple, local)), distributed=tuple(distributed), sharded=tuple(
                    ShardedGroup(cp_ranks=tuple(range(first, first + degree)), sequences=tuple(group))
                    for (first, degree), group in sorted(sharded.items()))))
        return refined


def _places(micro_batch: MicroBatch, cp_size: int) -> list[tuple[int, int, int]]:
    """(sequence, first CP rank, degree) of every sequence of the micro-batch."""
    return [*((index, rank, 1) for rank, local in enumerate(micro_batch.local) for index in local),
            *((index, 0, cp_size) for index in micro_batch.distributed),
            *((index, group.cp_ranks[0], group.degree) for group in micro_batch.sharded for index in group.sequences)]


def refine_plan(problem: PlanningProblem, dp_ranks: Sequence[Sequence[MicroBatch]],
                ) -> tuple[list[list[MicroBatch]], float]:
    """The refined micro-batches of every DP rank, and the iteration time under the cost model (never higher)."""
    state = _State(problem, dp_ranks)
    if len(state.owner) == 0 or len(problem.degrees) < 2:
        return [list(micro_batches) for micro_batches in dp_ranks], float(state.dp_times.max(initial=0.0))
    budget = max(1, min(MAX_PLAN_EVALUATIONS, MAX_PLAN_WORK // (problem.num_sequences + len(state.owner))))
    settled = np.zeros(problem.num_sequences, dtype=np.bool_)  # no improving action until its micro-batch changes
    while budget > 0:
        slowest = int(state.dp_times.argmax())
        threshold_s = float(state.dp_times[slowest]) * (1 - MIN_PLAN_GAIN)
        critical = _Critical.of(state, slowest)
        action: _Move | _Swap | None = None
        partners: _Partners | None = None
        for i in np.argsort(-critical.cuts_s, kind="stable").tolist():
            index = int(critical.indices[i])
            if critical.cuts_s[i] <= 0 or budget <= 0:
                break
            if settled[index]:
                continue
            budget -= 1
            if partners is None:
                partners = _Partners(state, slowest)
            found = [found for found in (
                _best_swap(state, index, threshold_s, partners),
                _best_move(state, index, int(critical.groups[i]), slowest, threshold_s, float(critical.cuts_s[i]),
                           _Sums(*(sums[:, i] for sums in critical.without)), critical.without_times_s[:, i]),
            ) if found is not None]
            if found:
                action = min(found, key=lambda found: found.score_s)
                break
            settled[index] = True
        if action is None:
            break
        for micro_batch in _apply(state, action):
            settled[state.micro_batch_of == micro_batch] = False
    return state.micro_batches(), float(state.dp_times.max())


class _Critical(NamedTuple):
    """The sequences on the critical CP rank of a micro-batch of the slowest DP rank: what a step may take off."""

    indices: IntArray
    groups: IntArray  # each one's block row in ``_State.counts``
    without: _Sums  # each one's micro-batch without it, (CP ranks, sequences)
    without_times_s: FloatArray
    cuts_s: FloatArray  # how much faster its micro-batch is without it

    @classmethod
    def of(cls, state: _State, slowest: int) -> _Critical:
        critical = state.times.argmax(axis=0)
        micro_batch_of = state.micro_batch_of
        on_critical = (micro_batch_of >= 0) & (state.owner[micro_batch_of] == slowest) \
            & (state.first_of <= critical[micro_batch_of]) \
            & (critical[micro_batch_of] < state.first_of + state.degrees[state.degree_index_of])
        indices = np.flatnonzero(on_critical)
        sources = micro_batch_of[indices]
        firsts, degree_indices = state.first_of[indices], state.degree_index_of[indices]
        groups = state.group_of(firsts, degree_indices)
        # each one's share of its micro-batch's sums, with its block's fixed collective cost if it is the last
        alone = state.scalars(indices, degree_indices)
        in_block = state.block_mask[:, degree_indices, firsts]
        last = (state.degrees[degree_indices] > 1) & (state.counts[groups, sources] == 1)
        own = _Sums(in_block * alone.loads, in_block * alone.attention,
                    in_block * (alone.all_gather + last * state.all_gather_fixed[degree_indices]),
                    in_block * (alone.reduce_scatter + last * state.reduce_scatter_fixed[degree_indices]),
                    in_block * alone.units)
        without = _Sums(*(sums[:, sources] - mine for sums, mine in zip(state.sums, own, strict=True)))
        without_times_s = without.times_s(state.problem)
        return cls(indices=indices, groups=groups, without=without, without_times_s=without_times_s,
                   cuts_s=state.micro_batch_times[sources] - without_times_s.max(axis=0, initial=0.0))


def _apply(state: _State, action: _Move | _Swap) -> set[int]:
    """Carry out the move or swap; the micro-batches it changed."""
    if isinstance(action, _Move):
        source = state.remove(action.sequence)
        state.add(action.micro_batch, action.sequence, action.first, action.degree_index)
        changed = {source, action.micro_batch}
    else:
        x, y = action.sequence, action.partner
        place_x = (int(state.first_of[x]), int(state.degree_index_of[x]))
        place_y = (int(state.first_of[y]), int(state.degree_index_of[y]))
        a, b = state.remove(x), state.remove(y)
        state.add(a, y, *place_x)
        state.add(b, x, *place_y)
        changed = {a, b}
    state.retime(changed)
    return changed


def _best_move(state: _State, index: int, source_group: int, slowest: int, threshold_s: float, cut_s: float,
               without: _Sums, without_times: FloatArray) -> _Move | None:
    """Where sequence ``index``, taken off its micro-batch (whose rows then are ``without``), goes best, scored by
    the time of the slowest DP rank the move changes; ``None`` if no place beats ``threshold_s``."""
    problem = state.problem
    cp_size, bucket_size = problem.cp_size, problem.bucket_size
    source = int(state.micro_batch_of[index])
    length = int(state.lengths[index])
    base = _Sums(*(sums.copy() for sums in state.sums))
    for sums, row in zip(base, without, strict=True):
        sums[:, source] = row
    base_times = state.times.copy()
    base_times[:, source] = without_times
    counts = state.counts
    if state.degrees[state.degree_index_of[index]] > 1:
        counts = state.counts.copy()
        counts[source_group, source] -= 1
    base_micro_batch_times = base_times.max(axis=0)
    dp_times = state.dp_times.copy()
    dp_times[slowest] -= cut_s
    owner = state.owner
    # every degree at once, (degrees, CP ranks, micro-batches): the sequence added to the block of each rank
    first_in_block = (counts == 0)[state.rank_group]
    local = state.degrees == 1
    per_rank = _Sums(
        base.loads + state.share_of[:, index][:, None, None],
        base.attention + (local * state.attention_of[index])[:, None, None],
        base.all_gather + ((state.all_gather_per_token * length)[:, None, None]
                           + state.all_gather_fixed[:, None, None] * first_in_block),
        base.reduce_scatter + ((state.reduce_scatter_per_token * length)[:, None, None]
                               + state.reduce_scatter_fixed[:, None, None] * first_in_block),
        base.units + (length * state.units_per_token)[:, None, None])
    times_s = per_rank.times_s(problem)
    best: _Move | None = None
    best_score_s = threshold_s
    for degree_index, degree in enumerate(problem.degrees):
        if length > degree * bucket_size:
            continue
        num_blocks = cp_size // degree
        shape = (num_blocks, degree, len(owner))
        room = per_rank.units[degree_index].reshape(shape).max(axis=1) <= bucket_size * cp_size
        block_time_s = times_s[degree_index].reshape(shape).max(axis=1)
        if num_blocks > 1:  # the micro-batch's new time: the block's new time, or the busiest other block's
            block_before_s = base_times.reshape(shape).max(axis=1)
            ordered = np.sort(block_before_s, axis=0)
            busiest, second = ordered[-1:], ordered[-2:-1]
            micro_batch_time_s = np.maximum(block_time_s, np.where(block_before_s >= busiest, second, busiest))
        else:
            micro_batch_time_s = block_time_s
        receiver_s = (dp_times[owner] - base_micro_batch_times) + micro_batch_time_s  # its DP rank's time
        # (micro-batches, blocks), so that ties go to the first micro-batch, then the first block
        score_s = np.where(room, np.maximum(receiver_s, dp_times[slowest]), np.inf).T
        flat = int(score_s.argmin())
        if score_s.flat[flat] < best_score_s:
            target, block = divmod(flat, num_blocks)
            best_score_s = float(score_s.flat[flat])
            best = _Move(best_score_s, index, target, block * degree, degree_index)
    return best


class _Partners:
    """Every placed sequence as a swap partner: what does not depend on the sequence swapped with it, computed once
    per step (the state changes only between steps)."""

    def __init__(self, state: _State, slowest: int) -> None:
        problem = state.problem
        self.indices = np.flatnonzero(state.micro_batch_of >= 0)
        self.micro_batch = state.micro_batch_of[self.indices]
        self.degree_index = state.degree_index_of[self.indices]
        self.first = state.first_of[self.indices]
        self.lengths = state.lengths[self.indices]
        self.own_loads = state.share_of[self.degree_index, self.indices]
        self.room = state.degrees[self.degree_index] * problem.bucket_size  # the longest their place holds
        # the heaviest rank of each partner's block: with x in the partner's place, it bounds that micro-batch's time
        block_heaviest = np.concatenate([state.sums.loads.reshape(problem.cp_size // degree, degree, -1).max(axis=1)
                                         for degree in problem.degrees])  # (every block of every degree, micro-batches)
        first_block = np.cumsum([0, *(problem.cp_size // degree for degree in problem.degrees[:-1])])
        self.heaviest = block_heaviest[first_block[self.degree_index] + self.first // state.degrees[self.degree_index],
                                       self.micro_batch]
        self.micro_batch_times = state.micro_batch_times[self.micro_batch]
        owner = state.owner[self.micro_batch]
        self.in_slowest = owner == slowest
        self.dp_times = state.dp_times[owner]
        self._at_degree: dict[int, tuple[_Sums, BoolArray]] = {}

    def at_degree(self, state: _State, degree_index: int) -> tuple[_Sums, BoolArray]:
        """Each partner's contribution at a place of that degree, and whether its tokens fit there."""
        found = self._at_degree.get(degree_index)
        if found is None:
            found = (state.scalars(self.indices, np.full(len(self.indices), degree_index)),
                     self.lengths <= state.degrees[degree_index] * state.problem.bucket_size)
            self._at_degree[degree_index] = found
        return found


def _best_swap(state: _State, x: int, threshold_s: float, partners: _Partners) -> _Swap | None:
    """Sequence ``x`` (in a micro-batch of the slowest DP rank) swaps places with the best sequence of another
    micro-batch, scored by the time of the slowest DP rank the swap changes; ``None`` if no swap beats
    ``threshold_s``. A swap keeps every block's member count, so no collective's fixed cost changes.

    Both micro-batches' new times are first bounded from below by the heaviest rank of each changed block with no
    communication exposed (``rank_compute_time_s``), one number per partner; only the partners whose bound beats
    ``threshold_s`` are costed exactly over their CP ranks. The bound never exceeds the exact score, so the choice
    is the one costing every partner would make."""
    problem = state.problem
    capacity = problem.bucket_size * problem.cp_size
    a, first_x, degree_index_x = int(state.micro_batch_of[x]), int(state.first_of[x]), int(state.degree_index_of[x])
    length_x = int(state.lengths[x])
    partner_at_x, partner_fits_x = partners.at_degree(state, degree_index_x)
    x_at_x = state.scalars(np.array([x]), np.array([degree_index_x]))
    # the partner must cost less than x at x's place, or x's micro-batch cannot get faster
    feasible = partner_fits_x & (length_x <= partners.room) & (partners.micro_batch != a) \
        & (partner_at_x.loads < x_at_x.loads)
    x_at_partner_loads = state.share_of[partners.degree_index, x]
    # only the ranks of x's block change in its micro-batch: its other ranks keep their times (and their memory,
    # which is within the bound)
    block_x = slice(first_x, first_x + int(state.degrees[degree_index_x]))
    times_a = state.times[:, a]
    others_a_s = max(times_a[:block_x.start].max(initial=0.0), times_a[block_x.stop:].max(initial=0.0))
    dp_max_s = state.dp_times.max()
    lower_a = np.maximum(rank_compute_time_s(problem, state.sums.loads[block_x, a].max()
                                             + (partner_at_x.loads - x_at_x.loads)), others_a_s)
    lower_b = rank_compute_time_s(problem, partners.heaviest + (x_at_partner_loads - partners.own_loads))
    lower_change_a = lower_a - state.micro_batch_times[a]
    lower_change_b = lower_b - partners.micro_batch_times
    lower_s = np.where(partners.in_slowest, dp_max_s + lower_change_a + lower_change_b,
                       np.maximum(dp_max_s + lower_change_a, partners.dp_times + lower_change_b))
    costed = np.flatnonzero(feasible & (lower_s < threshold_s))
    if not costed.size:
        return None
    indices, micro_batches, degree_indices = (partners.indices[costed], partners.micro_batch[costed],
                                              partners.degree_index[costed])
    rows_a = _Sums(*(sums[block_x, a, None] + (gained[costed] - lost)
                     for sums, gained, lost in zip(state.sums, partner_at_x, x_at_x, strict=True)))
    mask = state.block_mask[:, degree_indices, partners.first[costed]]
    x_at_partner = state.scalars(np.full(len(costed), x), degree_indices)
    partner_at_own = state.scalars(indices, degree_indices)
    rows_b = _Sums(*(sums[:, micro_batches] + mask * (gained - lost)
                     for sums, gained, lost in zip(state.sums, x_at_partner, partner_at_own, strict=True)))
    fits = (rows_a.units.max(axis=0) <= capacity) & (rows_b.units.max(axis=0) <= capacity)
    change_a = np.maximum(rows_a.times_s(problem).max(axis=0), others_a_s) - state.micro_batch_times[a]
    change_b = rows_b.times_s(problem).max(axis=0) - partners.micro_batch_times[costed]
    in_slowest = partners.in_slowest[costed]
    slowest_s = dp_max_s + change_a + in_slowest * change_b
    other_s = np.where(in_slowest, -np.inf, partners.dp_times[costed] + change_b)
    score_s = np.where(fits, np.maximum(slowest_s, other_s), np.inf)
    best = int(score_s.argmin())
    if score_s[best] >= threshold_s:
        return None
    return _Swap(float(score_s[best]), x, int(indices[best]))
