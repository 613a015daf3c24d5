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
* ``dacp_balanced`` — Skrull's default: distribute the k longest sequences for
  a few k (and for k = all: static CP is always a candidate, so a micro-batch
  never does worse than sharding everything under the cost model), place the
  rest largest-first on the least-loaded rank with room
  (LPT under the memory bound), keep the cheapest k under the cost model, then
  improve it with bounded move/swap steps. Cost: O(k_max · K · N) for the
  candidates plus at most 16 refinement steps of O(K² / N) each.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence

from scheduler_service.core.plan import MicroBatch, PlanningProblem
from scheduler_service.core.simulate import micro_batch_time_s

__all__ = ["dacp_balanced", "dacp_paper", "dacp_round_robin"]

DISTRIBUTED = -1
EXTRA_DISTRIBUTION_CANDIDATES = 2  # k values tried beyond the sequences too heavy to place locally
GOOD_ENOUGH = 1.005  # stop searching within 0.5% of the perfectly balanced lower bound
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


class _Placement:
    """A candidate DACP decision with the sums the cost model needs."""

    __slots__ = ("distributed_flops", "distributed_tokens", "loads", "placement", "remaining", "time_s")

    def __init__(self, cp_size: int, capacity: int) -> None:
        self.placement: dict[int, int] = {}
        self.loads = [0.0] * cp_size
        self.remaining = [capacity] * cp_size
        self.distributed_tokens = 0
        self.distributed_flops = 0.0
        self.time_s = 0.0

    def distribute(self, index: int, tokens: int, flops: float) -> bool:
        if min(self.remaining) < tokens:
            return False
        self.placement[index] = DISTRIBUTED
        for rank in range(len(self.remaining)):
            self.remaining[rank] -= tokens
        self.distributed_tokens += tokens
        self.distributed_flops += flops
        return True

    def place(self, index: int, rank: int, tokens_units: int, flops: float) -> None:
        self.placement[index] = rank
        self.remaining[rank] -= tokens_units
        self.loads[rank] += flops


def _largest_first(
    problem: PlanningProblem, order: Sequence[int], num_distributed: int, distributed_tokens: int,
    distributed_flops: float,
) -> _Placement | None:
    """Shard ``order[:num_distributed]`` (whose sums the caller keeps), then LPT-place the rest under the
    memory bound; a sequence that fits on no rank is sharded too."""
    cp_size, lengths, flops = problem.cp_size, problem.sequence_lengths, problem.flops_list
    capacity = problem.bucket_size * cp_size
    if distributed_tokens > capacity:
        return None
    candidate = _Placement(cp_size, capacity - distributed_tokens)
    candidate.placement = dict.fromkeys(order[:num_distributed], DISTRIBUTED)
    candidate.distributed_tokens, candidate.distributed_flops = distributed_tokens, distributed_flops
    loads, remaining, ranks = candidate.loads, candidate.remaining, range(cp_size)
    for index in order[num_distributed:]:
        units = lengths[index] * cp_size
        best_rank, best_load = -1, math.inf
        for rank in ranks:
            if remaining[rank] >= units and loads[rank] < best_load:
                best_rank, best_load = rank, loads[rank]
        if best_rank >= 0:
            candidate.placement[index] = best_rank
            remaining[best_rank] -= units
            loads[best_rank] += flops[index]
        elif not candidate.distribute(index, lengths[index], flops[index]):
            return None
    return candidate


def _refine(problem: PlanningProblem, candidate: _Placement) -> None:
    """Bounded local search: move or swap local sequences off the most loaded rank while that lowers its load."""
    cp_size, lengths, flops = problem.cp_size, problem.sequence_lengths, problem.flops_list
    for _ in range(MAX_REFINEMENT_STEPS):
        loads, remaining = candidate.loads, candidate.remaining
        busiest = max(range(cp_size), key=loads.__getitem__)
        members: list[list[int]] = [[] for _ in range(cp_size)]
        for index, rank in candidate.placement.items():
            if rank != DISTRIBUTED:
                members[rank].append(index)
        best_gain = 0.0
        best_move: tuple[int, int | None, int] | None = None
        for other in range(cp_size):
            if other == busiest:
                continue
            gap = loads[busiest] - loads[other]
            for a in members[busiest]:
                units_a = lengths[a] * cp_size
                # move a: the pair's max load drops by min(F_a, gap - F_a) when F_a < gap
                if flops[a] < gap and remaining[other] >= units_a:
                    gain = min(flops[a], gap - flops[a])
                    if gain > best_gain:
                        best_gain, best_move = gain, (a, None, other)
                for b in members[other]:
                    delta = flops[a] - flops[b]
                    units_b = lengths[b] * cp_size
                    if 0 < delta < gap and remaining[other] + units_b >= units_a \
                            and remaining[busiest] + units_a >= units_b:
                        gain = min(delta, gap - delta)
                        if gain > best_gain:
                            best_gain, best_move = gain, (a, b, other)
        if best_move is None or best_gain < loads[busiest] * MIN_REFINEMENT_GAIN:
            return
        moved, swapped, other = best_move
        candidate.place(moved, other, lengths[moved] * cp_size, flops[moved])
        candidate.remaining[busiest] += lengths[moved] * cp_size
        candidate.loads[busiest] -= flops[moved]
        if swapped is not None:
            candidate.place(swapped, busiest, lengths[swapped] * cp_size, flops[swapped])
            candidate.remaining[other] += lengths[swapped] * cp_size
            candidate.loads[other] -= flops[swapped]


def dacp_balanced(problem: PlanningProblem, indices: Sequence[int], *, refine: bool = True) -> MicroBatch | None:
    """Skrull's DACP: the cheapest of a few "shard the k longest" decisions, LPT-placed and (optionally) refined."""
    cp_size, lengths, flops, perf = problem.cp_size, problem.sequence_lengths, problem.flops_list, problem.perf
    order = sorted(indices, key=lambda k: (-lengths[k], k))  # longest (= most FLOPs) first
    fair_share = sum(flops[k] for k in order) / cp_size
    lower_bound_s = perf.compute_time_s(fair_share)  # every FLOP split evenly, no communication exposed
    # Sequences that cannot be local, or that alone exceed a rank's fair share, are the ones worth sharding.
    num_forced = sum(1 for k in order if lengths[k] > problem.bucket_size)  # can never be local
    num_heavy = sum(1 for k in order if lengths[k] > problem.bucket_size or flops[k] > fair_share)
    # k = number of longest sequences sharded up front; sharding all of them is always a candidate,
    # and it fits whenever the micro-batch's tokens do.
    candidates = [*range(num_forced, min(num_heavy + EXTRA_DISTRIBUTION_CANDIDATES, len(order)) + 1), len(order)]
    prefix_tokens = [0, *itertools.accumulate(lengths[k] for k in order)]
    prefix_flops = [0.0, *itertools.accumulate(flops[k] for k in order)]
    best: _Placement | None = None
    for num_distributed in dict.fromkeys(candidates):  # ordered and without repeats
        candidate = _largest_first(problem, order, num_distributed, prefix_tokens[num_distributed],
                                   prefix_flops[num_distributed])
        if candidate is None:
            continue
        candidate.time_s = micro_batch_time_s(perf, cp_size, candidate.loads, candidate.distributed_tokens,
                                              candidate.distributed_flops)
        if best is None or candidate.time_s < best.time_s:
            best = candidate
            if best.time_s <= lower_bound_s * GOOD_ENOUGH:
                break
    if best is None:
        return None
    if refine:
        _refine(problem, best)
    return _micro_batch(best.placement, cp_size)
