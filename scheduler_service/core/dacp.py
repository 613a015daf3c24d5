"""DACP: classify a micro-batch's sequences as local (whole on one CP rank) or
distributed (zigzag-sharded over the CP group) and place the local ones.

Memory is tracked in exact integers: one unit is 1/N of a token, so a CP rank
holds ``C·N`` units, a local sequence costs ``S·N`` on its rank and a
distributed one ``S`` on every rank (eq. 7 multiplied through by N). Every
placement checks its cost first, so no rank ever goes negative: that is the
memory bound, by construction, in every algorithm here.

* ``dacp_paper`` — Algorithm 1 with the roll-back of Algorithm 3 as the text
  means it: the rolled-back sequence frees its whole length on its rank and
  takes S/N on every rank (the published pseudo-code updates one bucket with
  S/N − S). A roll-back is only taken when the shard fits on every rank.
* ``dacp_round_robin`` — the RR case-study scheduler (appendix B.2).
* ``dacp_balanced`` — binary Skrull (``skrull_binary``): distribute the k
  longest sequences for a few k (and for k = all: static CP is always a
  candidate, so a micro-batch never does worse than sharding everything under
  the cost model), place the rest largest-first on the least-loaded rank with
  room (LPT under the memory bound), keep the cheapest k under the cost model,
  then improve it with bounded move/swap steps off the slowest rank (at most
  16, O(K log K) each, each kept only if the time falls).
* ``dacp_hybrid`` — Skrull's default: a dual approximation over degrees. Under
  a grid of caps on every rank's load, each sequence takes the smallest degree
  (1, a hybrid block size, or the whole group) that fits the cap and a bucket,
  and goes to the best-fitting aligned block; the binary decision is a
  candidate too, the cheapest under the cost model wins, and it is refined
  like the binary one.

Both search their candidates for many micro-batches at once, vectorised
(``dacp_search``); ``balanced_candidates`` and ``hybrid_candidates`` are that
batched form, which GDS uses for a whole global batch.

Memory units in the hybrid case: a sequence sharded over a block of ``s``
ranks costs ``S·N/s`` on each of them (``s`` divides ``N``), so the bound stays
exact in integers.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from scheduler_service.core.dacp_search import (
    LOCAL,
    Rows,
    SearchArrays,
    binary_rows,
    hybrid_rows,
    row_times_s,
    static_rows,
)
from scheduler_service.core.plan import MicroBatch, PlanningProblem, ShardedGroup
from scheduler_service.core.simulate import rank_time_s

__all__ = ["Candidate", "Decided", "balanced_candidates", "dacp_balanced", "dacp_hybrid", "dacp_paper",
           "dacp_round_robin", "hybrid_and_balanced_candidates", "hybrid_candidates", "static_candidates"]

DISTRIBUTED = -1
MAX_REFINEMENT_STEPS = 16
MIN_REFINEMENT_GAIN = 1e-3  # a move must cut the busiest rank's load by at least 0.1%


def _micro_batch(placement: dict[int, int], cp_size: int) -> MicroBatch:
    local: list[list[int]] = [[] for _ in range(cp_size)]
    distributed = []
    for index in sorted(placement):
        rank = placement[index]
        if rank == DISTRIBUTED:
            distributed.append(index)
        else:
            local[rank].append(index)
    return MicroBatch(local=tuple(map(tuple, local)), distributed=tuple(distributed))


def _roll_back(
    rank: int, order: Sequence[int], placement: dict[int, int], remaining: list[int], loads: list[float],
    problem: PlanningProblem,
) -> bool:
    """Algorithm 3's RollBack, fixed: shard the first local sequence of ``rank`` whose shard fits everywhere."""
    cp_size = problem.cp_size
    for index in order:
        if placement.get(index) != rank:
            continue
        tokens = problem.sequence_lengths[index]
        if any(remaining[r] < tokens for r in range(cp_size) if r != rank):
            continue
        placement[index] = DISTRIBUTED
        remaining[rank] += tokens * cp_size  # its whole length leaves this rank ...
        for r in range(cp_size):
            remaining[r] -= tokens  # ... and 1/N of it lands on every rank
        flops = problem.flops_list[index]
        loads[rank] -= flops
        for r in range(cp_size):
            loads[r] += flops / cp_size
        return True
    return False


RankChoice = Callable[[list[int], list[float], int], int]


def _greedy_with_roll_back(problem: PlanningProblem, order: Sequence[int], choose: RankChoice) -> MicroBatch | None:
    """The loop Algorithm 1 and appendix B.2 share: place each sequence on ``choose``'s rank if it fits
    there, else shard it if the shard fits everywhere, else roll back on the fullest rank and retry."""
    cp_size, lengths, flops = problem.cp_size, problem.sequence_lengths, problem.flops_list
    remaining = [problem.bucket_size * cp_size] * cp_size  # RB, in 1/N-token units
    loads = [0.0] * cp_size  # L
    placement: dict[int, int] = {}
    position = 0
    while position < len(order):
        index = order[position]
        tokens = lengths[index]
        rank = choose(remaining, loads, tokens * cp_size)
        if remaining[rank] >= tokens * cp_size:  # Alg. 1 lines 7-8 / 11-12: UpdateLocal
            placement[index] = rank
            remaining[rank] -= tokens * cp_size
            loads[rank] += flops[index]
        elif min(remaining) >= tokens:  # lines 14-16: UpdateAll
            placement[index] = DISTRIBUTED
            for r in range(cp_size):
                remaining[r] -= tokens
                loads[r] += flops[index] / cp_size
        else:  # line 18: roll back on the fullest rank, then retry this sequence
            fullest = min(range(cp_size), key=remaining.__getitem__)
            if not _roll_back(fullest, order, placement, remaining, loads, problem):
                return None
            continue
        position += 1
    return _micro_batch(placement, cp_size)


def _least_loaded_else_most_room(remaining: list[int], loads: list[float], units: int) -> int:
    rank = min(range(len(loads)), key=loads.__getitem__)  # Alg. 1 line 6
    if remaining[rank] < units:
        rank = max(range(len(remaining)), key=remaining.__getitem__)  # line 10
    return rank


def _most_room(remaining: list[int], loads: list[float], units: int) -> int:
    return max(range(len(remaining)), key=remaining.__getitem__)


def dacp_paper(problem: PlanningProblem, indices: Sequence[int]) -> MicroBatch | None:
    """Algorithm 1 (with the fixed roll-back); ``None`` when it fails, as GDS expects."""
    ascending = sorted(indices, key=lambda k: (problem.sequence_lengths[k], k))  # line 1
    return _greedy_with_roll_back(problem, ascending, _least_loaded_else_most_room)


def dacp_round_robin(problem: PlanningProblem, indices: Sequence[int]) -> MicroBatch | None:
    """Appendix B.2: each sequence to the bucket with the most room, else sharded, else roll back."""
    return _greedy_with_roll_back(problem, list(indices), _most_room)


Block = tuple[int, int]  # (first CP rank, degree) of a group of ranks; (0, cp_size) is the whole CP group


class _Placement:
    """One micro-batch's chosen DACP decision, as Python lists for the refinement's scalar moves: where each
    sequence went, and the per-rank sums the cost model and the memory bound need."""

    __slots__ = ("all_gather", "attention", "cp_size", "groups", "loads", "placement", "reduce_scatter",
                 "remaining")

    def __init__(self, problem: PlanningProblem, rows: Rows, row: int) -> None:
        """The search's row ``row``: its sums as they are, its sequences' places from its degree and first rank."""
        self.cp_size = problem.cp_size
        self.placement: dict[int, int] = {}  # local sequences: index -> CP rank
        self.groups: dict[Block, list[int]] = {}  # sharded sequences by block (distributed: (0, cp_size))
        padding = problem.num_sequences
        for index, degree, first in zip(rows.order[row].tolist(), rows.degree[:, row].tolist(),
                                        rows.first[:, row].tolist(), strict=True):
            if index == padding:  # the rest of the row is padding
                break
            if degree == LOCAL:
                self.placement[index] = first
            else:
                self.groups.setdefault((first, degree), []).append(index)
        self.loads: list[float] = rows.loads[:, row].tolist()  # FLOP-equivalents per rank
        self.attention: list[float] = rows.attention[:, row].tolist()  # local attention: what hides collectives
        self.all_gather: list[float] = rows.all_gather[:, row].tolist()  # seconds of collectives per rank, forward
        self.reduce_scatter: list[float] = rows.reduce_scatter[:, row].tolist()  # and backward
        self.remaining: list[int] = rows.remaining[:, row].tolist()  # memory units (1/N token) left per rank

    def place(self, problem: PlanningProblem, index: int, rank: int) -> None:
        self.placement[index] = rank
        self.remaining[rank] -= problem.sequence_lengths[index] * self.cp_size
        self.loads[rank] += problem.placement[1][index]
        self.attention[rank] += problem.local_attention[index]

    def unplace(self, problem: PlanningProblem, index: int) -> int:
        rank = self.placement.pop(index)
        self.remaining[rank] += problem.sequence_lengths[index] * self.cp_size
        self.loads[rank] -= problem.placement[1][index]
        self.attention[rank] -= problem.local_attention[index]
        return rank

    def rank_times_s(self, problem: PlanningProblem) -> list[float]:
        times_s = rank_time_s(problem, np.array(self.loads), np.array(self.attention), np.array(self.all_gather),
                              np.array(self.reduce_scatter))
        return times_s.tolist()

    def evaluate(self, problem: PlanningProblem) -> float:
        return max(self.rank_times_s(problem))

    def micro_batch(self) -> MicroBatch:
        local: list[list[int]] = [[] for _ in range(self.cp_size)]
        for index in sorted(self.placement):
            local[self.placement[index]].append(index)
        distributed = sorted(self.groups.get((0, self.cp_size), ()))
        sharded = tuple(
            ShardedGroup(cp_ranks=tuple(range(first, first + degree)), sequences=tuple(sorted(members)))
            for (first, degree), members in sorted(self.groups.items()) if degree < self.cp_size
        )
        return MicroBatch(local=tuple(map(tuple, local)), distributed=tuple(distributed), sharded=sharded)


_Exchange = tuple[float, int, int | None, int]  # (gain, sequence off the busiest rank, its swap partner or None, rank)


def _refine(problem: PlanningProblem, candidate: _Placement) -> bool:
    """Bounded local search: move or swap local sequences off the slowest rank while that lowers the micro-batch's
    time; whether anything moved. Moves are chosen by load, and a load moved can still cost time (the receiving
    rank's collectives may be less hidden), so each is kept only if the time falls."""
    costs = problem.placement[1]
    members: list[list[tuple[float, int]]] = [[] for _ in range(problem.cp_size)]  # per rank, (cost, index) ascending
    for index, rank in candidate.placement.items():
        members[rank].append((costs[index], index))
    for ranked in members:
        ranked.sort()
    times_s = candidate.rank_times_s(problem)
    for step in range(MAX_REFINEMENT_STEPS):
        slowest = max(range(problem.cp_size), key=times_s.__getitem__)
        move = _best_move(problem, candidate, members, slowest)
        if move is None or move[0] < candidate.loads[slowest] * MIN_REFINEMENT_GAIN:
            return step > 0
        _, moved, swapped, other = move
        _relocate(problem, candidate, members, moved, other)
        if swapped is not None:
            _relocate(problem, candidate, members, swapped, slowest)
        moved_times_s = candidate.rank_times_s(problem)
        if max(moved_times_s) >= max(times_s):
            if swapped is not None:
                _relocate(problem, candidate, members, swapped, other)
            _relocate(problem, candidate, members, moved, slowest)
            return step > 0
        times_s = moved_times_s
    return True


def _best_move(problem: PlanningProblem, candidate: _Placement, members: list[list[tuple[float, int]]],
               busiest: int) -> _Exchange | None:
    """The move or swap of local sequences that lowers the load of rank ``busiest`` the most within the memory
    bound.

    Moving ``a`` to a rank ``gap`` below the busiest lowers the pair's max load by ``min(F_a, gap - F_a)``,
    swapping it with ``b`` by ``min(δ, gap - δ)`` with ``δ = F_a - F_b`` (a move is a swap with a partner of cost
    0): both peak at ``δ = gap / 2``. Each rank's sequences are sorted by cost, so the best partner of ``a`` is
    found by bisecting for that target and walking outwards, nearest first, until one fits the memory bound or
    none can beat the best gain so far: O(K log K) per step where comparing every pair was O(K² / N). A gain is at
    most ``gap / 2`` and at most ``F_a``, so ranks are visited by decreasing gap and the busiest rank's sequences by
    decreasing cost, and each loop stops where no later one can beat the best gain found."""
    cp_size, lengths = problem.cp_size, problem.sequence_lengths
    loads, remaining = candidate.loads, candidate.remaining
    best: _Exchange | None = None
    best_gain = 0.0
    for other in sorted(range(cp_size), key=loads.__getitem__):
        gap = loads[busiest] - loads[other]
        if gap / 2 <= best_gain:  # ``busiest`` itself, and every rank after it, too
            break
        partners: list[tuple[float, int | None]] = [(0.0, None), *members[other]]
        for cost_a, a in reversed(members[busiest]):
            if cost_a <= best_gain:
                break
            units_a = lengths[a] * cp_size
            right = bisect.bisect_left(partners, (cost_a - gap / 2,))
            left = right - 1
            while True:
                gain_left = _swap_gain(cost_a - partners[left][0], gap) if left >= 0 else 0.0
                gain_right = _swap_gain(cost_a - partners[right][0], gap) if right < len(partners) else 0.0
                gain = max(gain_left, gain_right)
                if gain <= best_gain:
                    break
                side = left if gain_left >= gain_right else right
                b = partners[side][1]
                units_b = 0 if b is None else lengths[b] * cp_size
                if remaining[other] + units_b >= units_a and remaining[busiest] + units_a >= units_b:
                    best, best_gain = (gain, a, b, other), gain
                    break
                if side == left:
                    left -= 1
                else:
                    right += 1
    return best


def _swap_gain(delta: float, gap: float) -> float:
    """How much handing ``delta`` FLOP-equivalents to a rank ``gap`` below lowers the pair's max load."""
    return min(delta, gap - delta) if 0 < delta < gap else 0.0


def _relocate(problem: PlanningProblem, candidate: _Placement, members: list[list[tuple[float, int]]], index: int,
              rank: int) -> None:
    entry = (problem.placement[1][index], index)
    members[candidate.unplace(problem, index)].remove(entry)
    candidate.place(problem, index, rank)
    bisect.insort(members[rank], entry)


class Decided(NamedTuple):
    """A micro-batch's DACP decision and its time under the cost model."""

    micro_batch: MicroBatch
    time_s: float


@dataclass(frozen=True, slots=True)
class Candidate:
    """A micro-batch's cheapest decision found by the search and its time under the cost model. GDS compares
    micro-batchings by these times and builds (and refines) only the micro-batches of the ones it keeps."""

    problem: PlanningProblem
    rows: Rows
    row: int
    time_s: float

    def decide(self, *, refine: bool = True) -> Decided:
        placement = _Placement(self.problem, self.rows, self.row)
        moved = refine and _refine(self.problem, placement)
        return Decided(placement.micro_batch(), placement.evaluate(self.problem) if moved else self.time_s)


def _best_row_per_micro_batch(rows: Rows, times_s: npt.NDArray[np.float64], num_micro_batches: int,
                              ) -> npt.NDArray[np.int64]:
    """Each micro-batch's cheapest row (the first on ties), or -1 where every row failed."""
    by_time = np.lexsort((np.arange(len(times_s)), times_s, rows.micro_batch))
    micro_batches, first = np.unique(rows.micro_batch[by_time], return_index=True)
    best = np.full(num_micro_batches, -1, dtype=np.int64)
    chosen = by_time[first]
    best[micro_batches] = np.where(np.isfinite(times_s[chosen]), chosen, -1)
    return best


def _candidates(problem: PlanningProblem, groups: Sequence[Sequence[int]], *, num_hybrid: int,
                ) -> list[Candidate | None]:
    """The binary search for every group, and the hybrid one for the first ``num_hybrid``."""
    if not groups:
        return []
    arrays = SearchArrays.of(problem)
    rows = binary_rows(problem, arrays, groups)
    times_s = row_times_s(problem, rows)
    best = _best_row_per_micro_batch(rows, times_s, len(groups))
    chosen: list[tuple[Rows, int, float] | None] = [
        None if row < 0 else (rows, row, float(times_s[row])) for row in best.tolist()]
    searched = np.flatnonzero(best[:num_hybrid] >= 0)  # the tokens of the others do not fit
    if searched.size and len(problem.degrees) > 2:  # a block between a rank and the group
        packed = hybrid_rows(problem, arrays, [groups[i] for i in searched.tolist()], rows.take(best[searched]),
                             times_s[best[searched]])
        packed_times_s = row_times_s(problem, packed)
        packed_best = _best_row_per_micro_batch(packed, packed_times_s, len(searched))
        for micro_batch, row in zip(searched.tolist(), packed_best.tolist(), strict=True):
            if row >= 0 and packed_times_s[row] < times_s[best[micro_batch]]:
                chosen[micro_batch] = (packed, row, float(packed_times_s[row]))
    return [None if choice is None else Candidate(problem, *choice) for choice in chosen]


def balanced_candidates(problem: PlanningProblem, groups: Sequence[Sequence[int]]) -> list[Candidate | None]:
    """Binary Skrull's DACP for many micro-batches at once: the cheapest of a few "shard the k longest"
    decisions, LPT-placed; ``None`` for a micro-batch whose tokens do not fit."""
    return _candidates(problem, groups, num_hybrid=0)


def hybrid_candidates(problem: PlanningProblem, groups: Sequence[Sequence[int]]) -> list[Candidate | None]:
    """Hybrid Skrull's DACP for many micro-batches at once: each sequence at the degree that suits it, groups side
    by side; never worse than the binary decision under the cost model (that is a candidate too).

    A dual approximation, as for moldable tasks: pack under caps on every rank's load between the balanced load
    and the best binary decision's busiest rank, and one above it bounded by the binary decision's time
    (``dacp_search.hybrid_rows``). A lower cap forces finer pieces,
    which pack memory and load better but pay more communication and shorter, less efficient attention chunks;
    every packing is evaluated under the cost model and the cheapest decision wins."""
    return _candidates(problem, groups, num_hybrid=len(groups))


def hybrid_and_balanced_candidates(problem: PlanningProblem, hybrid_groups: Sequence[Sequence[int]],
                                   balanced_groups: Sequence[Sequence[int]],
                                   ) -> tuple[list[Candidate | None], list[Candidate | None]]:
    """``hybrid_candidates`` and ``balanced_candidates`` in one batched pass over the sequences (``skrull`` plans
    both and keeps the cheaper plan)."""
    found = _candidates(problem, [*hybrid_groups, *balanced_groups], num_hybrid=len(hybrid_groups))
    return found[:len(hybrid_groups)], found[len(hybrid_groups):]


def static_candidates(problem: PlanningProblem, groups: Sequence[Sequence[int]]) -> list[Candidate | None]:
    """Every sequence sharded over the whole CP group (static CP), for many micro-batches: GDS's ablation."""
    if not groups:
        return []
    rows = static_rows(problem, SearchArrays.of(problem), groups)
    times_s = row_times_s(problem, rows)
    return [Candidate(problem, rows, row, float(time_s)) if math.isfinite(time_s) else None
            for row, time_s in enumerate(times_s.tolist())]


def dacp_balanced(problem: PlanningProblem, indices: Sequence[int], *, refine: bool = True) -> MicroBatch | None:
    """``balanced_candidates`` for one micro-batch, refined."""
    candidate = balanced_candidates(problem, [indices])[0]
    return None if candidate is None else candidate.decide(refine=refine).micro_batch


def dacp_hybrid(problem: PlanningProblem, indices: Sequence[int], *, refine: bool = True) -> MicroBatch | None:
    """``hybrid_candidates`` for one micro-batch, refined."""
    candidate = hybrid_candidates(problem, [indices])[0]
    return None if candidate is None else candidate.decide(refine=refine).micro_batch
