"""DACP: where each sequence of one micro-batch runs: kept whole on one CP rank ("local"), or sharded over the CP
group ("distributed") or, in hybrid DACP, over an aligned block of it.

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
* ``dacp_balanced`` and ``dacp_hybrid`` — Skrull's binary and hybrid DACP for one
  micro-batch: the compiled search of ``dacp_search`` (which GDS runs for every
  micro-batch of a global batch at once, ``gds_search``), refined.

Places are (degree, first CP rank) as everywhere in the core (``costing``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from scheduler_service.core.costing import empty_sums
from scheduler_service.core.dacp_search import BINARY, HYBRID, best_decision, refine_micro_batch
from scheduler_service.core.plan import MicroBatch, PlanningProblem

__all__ = ["dacp_balanced", "dacp_hybrid", "dacp_paper", "dacp_round_robin", "decide"]

Place = tuple[int, int]  # (degree, first CP rank)


def _roll_back(
    rank: int, order: Sequence[int], placement: dict[int, Place], remaining: list[int], loads: list[float],
    problem: PlanningProblem, flops: dict[int, float],
) -> bool:
    """Algorithm 3's RollBack, fixed: shard the first local sequence of ``rank`` whose shard fits everywhere. A
    roll-back frees S·(N − 1) units on the rank: nothing on a CP group of one rank."""
    cp_size = problem.cp_size
    if cp_size == 1:
        return False
    for index in order:
        if placement.get(index) != (1, rank):
            continue
        tokens = problem.sequence_lengths[index]
        if any(remaining[r] < tokens for r in range(cp_size) if r != rank):
            continue
        placement[index] = (cp_size, 0)
        remaining[rank] += tokens * cp_size  # its whole length leaves this rank ...
        for r in range(cp_size):
            remaining[r] -= tokens  # ... and 1/N of it lands on every rank
        loads[rank] -= flops[index]
        for r in range(cp_size):
            loads[r] += flops[index] / cp_size
        return True
    return False


RankChoice = Callable[[list[int], list[float], int], int]


def _greedy_with_roll_back(problem: PlanningProblem, order: Sequence[int], choose: RankChoice) -> MicroBatch | None:
    """The loop Algorithm 1 and appendix B.2 share: place each sequence on ``choose``'s rank if it fits
    there, else shard it if the shard fits everywhere, else roll back on the fullest rank and retry."""
    cp_size, lengths = problem.cp_size, problem.sequence_lengths
    flops = dict(zip(order, problem.flops[list(order)].tolist(), strict=True))
    remaining = [problem.bucket_size * cp_size] * cp_size  # RB, in 1/N-token units
    loads = [0.0] * cp_size  # L
    placement: dict[int, Place] = {}
    position = 0
    while position < len(order):
        index = order[position]
        tokens = lengths[index]
        rank = choose(remaining, loads, tokens * cp_size)
        if remaining[rank] >= tokens * cp_size:  # Alg. 1 lines 7-8 / 11-12: UpdateLocal
            placement[index] = (1, rank)
            remaining[rank] -= tokens * cp_size
            loads[rank] += flops[index]
        elif min(remaining) >= tokens:  # lines 14-16: UpdateAll
            placement[index] = (cp_size, 0)
            for r in range(cp_size):
                remaining[r] -= tokens
                loads[r] += flops[index] / cp_size
        else:  # line 18: roll back on the fullest rank, then retry this sequence
            fullest = min(range(cp_size), key=remaining.__getitem__)
            if not _roll_back(fullest, order, placement, remaining, loads, problem, flops):
                return None
            continue
        position += 1
    return MicroBatch.from_places([(index, *place) for index, place in placement.items()], cp_size)


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


def decide(problem: PlanningProblem, indices: Sequence[int], space: int, *,
           refine: bool = True) -> tuple[MicroBatch, float] | None:
    """One micro-batch's decision in a DACP search space (``dacp_search.best_decision``, its sequences longest
    first, ties by index), refined if asked, and its time under the cost model; ``None`` when its tokens do not
    fit."""
    members = np.asarray(indices, dtype=np.int64)
    members = np.ascontiguousarray(members[np.lexsort((members, -problem.lengths[members]))])
    degree = np.empty(len(members), dtype=np.int64)
    first_rank = np.empty(len(members), dtype=np.int64)
    sums = empty_sums(problem.tables, 1)
    time_s = best_decision(problem.tables, members, space, sums, degree, first_rank)
    if time_s == np.inf:
        return None
    if refine:
        time_s = refine_micro_batch(problem.tables, members, degree, first_rank, sums)
    places = list(zip(members.tolist(), degree.tolist(), first_rank.tolist(), strict=True))
    return MicroBatch.from_places(places, problem.cp_size), time_s


def dacp_balanced(problem: PlanningProblem, indices: Sequence[int], *, refine: bool = True) -> MicroBatch | None:
    """Binary Skrull's DACP for one micro-batch (``decide`` in the binary space); ``None`` when its tokens do not
    fit."""
    decided = decide(problem, indices, BINARY, refine=refine)
    return None if decided is None else decided[0]


def dacp_hybrid(problem: PlanningProblem, indices: Sequence[int], *, refine: bool = True) -> MicroBatch | None:
    """Hybrid Skrull's DACP for one micro-batch (``decide`` in the hybrid space); ``None`` when its tokens do not
    fit."""
    decided = decide(problem, indices, HYBRID, refine=refine)
    return None if decided is None else decided[0]
