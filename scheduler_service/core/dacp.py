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
  then improve it with bounded move/swap steps. Cost: O(k_max · K · N) for the
  candidates plus at most 16 refinement steps of O(K² / N) each.
* ``dacp_hybrid`` — Skrull's default: a dual approximation over degrees. It
  bisects on a cap on every rank's load; under a cap, each sequence takes the
  smallest degree (1, a hybrid block size, or the whole group) whose share of
  its work fits the cap and whose share of its tokens fits a bucket, and widest
  first, it goes to the best-fitting aligned block where it stays under the cap
  (a sequence that fits nowhere takes the next larger degree). The binary
  decision is a candidate too, and the cheapest under the cost model wins,
  then it is refined like the binary one. Cost: at most 8 packings of
  O(K · N) on top of ``dacp_balanced``.

Memory units in the hybrid case: a sequence sharded over a block of ``s``
ranks costs ``S·N/s`` on each of them (``s`` divides ``N``), so the bound stays
exact in integers.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence

from scheduler_service.core.plan import MicroBatch, PlanningProblem, ShardedGroup
from scheduler_service.core.simulate import rank_time_s

__all__ = ["dacp_balanced", "dacp_hybrid", "dacp_paper", "dacp_round_robin"]

DISTRIBUTED = -1
EXTRA_DISTRIBUTION_CANDIDATES = 2  # k values tried beyond the sequences too heavy to place locally
CAP_TOLERANCE = 1.005  # stop bisecting the load cap once its bracket is within 0.5%
GOOD_ENOUGH = 1.005  # stop searching within 0.5% of the perfectly balanced lower bound
MAX_CAP_BISECTIONS = 8
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
    """A candidate DACP decision with the per-rank sums the cost model and the memory bound need.

    Whole-group shards add the same to every rank, so they are kept as one shared offset (``shared_*``): sharding
    over the whole group is O(1), and per-rank comparisons of loads are unchanged by it."""

    __slots__ = ("all_gather", "attention", "cp_size", "groups", "loads", "placement", "reduce_scatter",
                 "remaining", "shared_all_gather", "shared_load", "shared_reduce_scatter", "shared_units", "time_s")

    def __init__(self, cp_size: int, capacity: int) -> None:
        self.cp_size = cp_size
        self.placement: dict[int, int] = {}  # local sequences: index -> CP rank
        self.groups: dict[Block, list[int]] = {}  # sharded sequences by block (distributed: (0, cp_size))
        self.loads = [0.0] * cp_size  # FLOP-equivalents per rank (placement costs), besides the shared load
        self.attention = [0.0] * cp_size  # local attention FLOP-equivalents per rank: what hides collectives
        self.all_gather = [0.0] * cp_size  # seconds of collectives per rank, forward, besides the shared ones
        self.reduce_scatter = [0.0] * cp_size  # and backward
        self.remaining = [capacity] * cp_size  # memory units (1/N token) before the shared units
        self.shared_units = 0
        self.shared_load = 0.0
        self.shared_all_gather = 0.0
        self.shared_reduce_scatter = 0.0
        self.time_s = math.inf

    def fits(self, block: Block, tokens: int) -> bool:
        first, degree = block
        need = tokens * (self.cp_size // degree) + self.shared_units
        return min(self.remaining[first:first + degree]) >= need

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

    def shard(self, problem: PlanningProblem, index: int, block: Block) -> None:
        first, degree = block
        tokens = problem.sequence_lengths[index]
        collective = problem.perf.collective_cost(degree)
        is_new = block not in self.groups
        self.groups.setdefault(block, []).append(index)
        flops = problem.placement[degree][index]
        all_gather = collective.all_gather_s_per_token * tokens + (collective.all_gather_fixed_s if is_new else 0.0)
        reduce_scatter = (collective.reduce_scatter_s_per_token * tokens
                          + (collective.reduce_scatter_fixed_s if is_new else 0.0))
        if degree == self.cp_size:
            self.shared_units += tokens
            self.shared_load += flops
            self.shared_all_gather += all_gather
            self.shared_reduce_scatter += reduce_scatter
            return
        units = tokens * (self.cp_size // degree)
        for r in range(first, first + degree):
            self.remaining[r] -= units
            self.loads[r] += flops
            self.all_gather[r] += all_gather
            self.reduce_scatter[r] += reduce_scatter

    def shard_over_group(self, problem: PlanningProblem, indices: Sequence[int], tokens: int, flops: float) -> None:
        """``shard`` over the whole CP group for many sequences at once, given their summed tokens and costs."""
        if not indices:
            return
        collective = problem.perf.collective_cost(self.cp_size)
        is_new = (0, self.cp_size) not in self.groups
        self.groups.setdefault((0, self.cp_size), []).extend(indices)
        self.shared_units += tokens
        self.shared_load += flops
        self.shared_all_gather += collective.all_gather_s_per_token * tokens + (
            collective.all_gather_fixed_s if is_new else 0.0)
        self.shared_reduce_scatter += collective.reduce_scatter_s_per_token * tokens + (
            collective.reduce_scatter_fixed_s if is_new else 0.0)

    def evaluate(self, problem: PlanningProblem) -> float:
        load, all_gather, reduce_scatter = self.shared_load, self.shared_all_gather, self.shared_reduce_scatter
        self.time_s = max(
            rank_time_s(problem, self.loads[r] + load, self.attention[r], self.all_gather[r] + all_gather,
                        self.reduce_scatter[r] + reduce_scatter)
            for r in range(self.cp_size)
        )
        return self.time_s

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


def _least_loaded_with_room(candidate: _Placement, units: int) -> int:
    best_rank, best_load = -1, math.inf
    loads, remaining, need = candidate.loads, candidate.remaining, units + candidate.shared_units
    for rank in range(candidate.cp_size):
        if remaining[rank] >= need and loads[rank] < best_load:
            best_rank, best_load = rank, loads[rank]
    return best_rank


def _largest_first(
    problem: PlanningProblem, order: Sequence[int], num_distributed: int, prefix_tokens: Sequence[int],
    prefix_flops: Sequence[float],
) -> _Placement | None:
    """Shard ``order[:num_distributed]`` over the whole CP group (their sums from the prefix sums), then LPT-place
    the rest under the memory bound; a sequence that fits on no rank is sharded too."""
    cp_size, lengths = problem.cp_size, problem.sequence_lengths
    if prefix_tokens[num_distributed] > problem.bucket_size * cp_size:
        return None
    candidate = _Placement(cp_size, problem.bucket_size * cp_size)
    candidate.shard_over_group(problem, order[:num_distributed], prefix_tokens[num_distributed],
                               prefix_flops[num_distributed])
    whole_group = (0, cp_size)
    for index in order[num_distributed:]:
        rank = _least_loaded_with_room(candidate, lengths[index] * cp_size)
        if rank >= 0:
            candidate.place(problem, index, rank)
        elif candidate.fits(whole_group, lengths[index]):
            candidate.shard(problem, index, whole_group)
        else:
            return None
    return candidate


def _refine(problem: PlanningProblem, candidate: _Placement) -> None:
    """Bounded local search: move or swap local sequences off the most loaded rank while that lowers its load."""
    cp_size, lengths, costs = problem.cp_size, problem.sequence_lengths, problem.placement[1]
    for _ in range(MAX_REFINEMENT_STEPS):
        loads, shared = candidate.loads, candidate.shared_units
        remaining = [units - shared for units in candidate.remaining]
        busiest = max(range(cp_size), key=loads.__getitem__)
        members: list[list[int]] = [[] for _ in range(cp_size)]
        for index, rank in candidate.placement.items():
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
                if costs[a] < gap and remaining[other] >= units_a:
                    gain = min(costs[a], gap - costs[a])
                    if gain > best_gain:
                        best_gain, best_move = gain, (a, None, other)
                for b in members[other]:
                    delta = costs[a] - costs[b]
                    units_b = lengths[b] * cp_size
                    if 0 < delta < gap and remaining[other] + units_b >= units_a \
                            and remaining[busiest] + units_a >= units_b:
                        gain = min(delta, gap - delta)
                        if gain > best_gain:
                            best_gain, best_move = gain, (a, b, other)
        if best_move is None or best_gain < loads[busiest] * MIN_REFINEMENT_GAIN:
            return
        moved, swapped, other = best_move
        candidate.unplace(problem, moved)
        if swapped is not None:
            candidate.unplace(problem, swapped)
            candidate.place(problem, swapped, busiest)
        candidate.place(problem, moved, other)


def _lower_bound_s(problem: PlanningProblem, indices: Sequence[int]) -> float:
    """No decision beats every sequence at its cheapest placement, spread evenly, no communication exposed."""
    return rank_time_s(problem, sum(problem.area[k] for k in indices) / problem.cp_size, 0.0, 0.0, 0.0)


def _binary_candidates(problem: PlanningProblem, order: Sequence[int], lower_bound_s: float) -> _Placement | None:
    """The cheapest of "shard the k longest over the whole group" for the few k worth trying."""
    lengths, costs = problem.sequence_lengths, problem.placement[1]
    fair_share = sum(costs[k] for k in order) / problem.cp_size
    # Sequences that cannot be local, or that alone exceed a rank's fair share, are the ones worth sharding.
    num_forced = sum(1 for k in order if lengths[k] > problem.bucket_size)  # can never be local
    num_heavy = sum(1 for k in order if lengths[k] > problem.bucket_size or costs[k] > fair_share)
    # k = number of longest sequences sharded up front; sharding all of them is always a candidate,
    # and it fits whenever the micro-batch's tokens do.
    candidates = [*range(num_forced, min(num_heavy + EXTRA_DISTRIBUTION_CANDIDATES, len(order)) + 1), len(order)]
    shard_costs = problem.placement[problem.cp_size]
    prefix_tokens = [0, *itertools.accumulate(lengths[k] for k in order)]
    prefix_flops = [0.0, *itertools.accumulate(shard_costs[k] for k in order)]
    best: _Placement | None = None
    for num_distributed in dict.fromkeys(candidates):  # ordered and without repeats
        candidate = _largest_first(problem, order, num_distributed, prefix_tokens, prefix_flops)
        if candidate is None:
            continue
        if best is None or candidate.evaluate(problem) < best.time_s:
            best = candidate
            if best.time_s <= lower_bound_s * GOOD_ENOUGH:
                break
    return best


def _finish(problem: PlanningProblem, best: _Placement | None, refine: bool) -> MicroBatch | None:
    if best is None:
        return None
    if refine:
        _refine(problem, best)
    return best.micro_batch()


def dacp_balanced(problem: PlanningProblem, indices: Sequence[int], *, refine: bool = True) -> MicroBatch | None:
    """Binary Skrull's DACP: the cheapest of a few "shard the k longest" decisions, LPT-placed and refined."""
    order = sorted(indices, key=lambda k: (-problem.sequence_lengths[k], k))  # longest (= most FLOPs) first
    return _finish(problem, _binary_candidates(problem, order, _lower_bound_s(problem, order)), refine)


def _best_fit_block(problem: PlanningProblem, candidate: _Placement, index: int, degree: int,
                    cap_flops: float) -> int:
    """The first rank of the aligned block of ``degree`` ranks where the sequence's tokens fit and its share keeps
    every rank under the cap, and whose busiest rank is the most loaded such (best fit); -1 when there is none."""
    share, tokens = problem.placement[degree][index], problem.sequence_lengths[index]
    loads, remaining = candidate.loads, candidate.remaining
    need = tokens * (problem.cp_size // degree) + candidate.shared_units
    room = cap_flops - candidate.shared_load - share  # the busiest rank of the block may carry at most this
    best_first, best_load = -1, -math.inf
    if degree == 1:  # the common case, without slices
        for rank, load in enumerate(loads):
            if best_load < load <= room and remaining[rank] >= need:
                best_first, best_load = rank, load
        return best_first
    for first in range(0, problem.cp_size, degree):  # the aligned blocks (plan.cp_blocks)
        last = first + degree
        load = max(loads[first:last])
        if best_load < load <= room and min(remaining[first:last]) >= need:
            best_first, best_load = first, load
    return best_first


def _pack_under_cap(problem: PlanningProblem, order: Sequence[int], cap_flops: float) -> _Placement | None:
    """Place every sequence so that no rank's load exceeds ``cap_flops``, or ``None``.

    Each sequence starts at the smallest degree whose per-rank share fits the cap and whose tokens fit a bucket
    per rank. Widest first (aligned blocks then never fragment: a block is free or holds wider groups' shares),
    heaviest share first within a degree, each goes to its best-fit block; one that fits nowhere takes the next
    larger degree."""
    lengths, degrees, bucket_size = problem.sequence_lengths, problem.degrees, problem.bucket_size
    chosen: dict[int, int] = {}
    for index in order:
        degree = next((degree for degree in degrees if lengths[index] <= degree * bucket_size
                       and problem.placement[degree][index] <= cap_flops), 0)
        if not degree:
            return None
        chosen[index] = degree
    candidate = _Placement(problem.cp_size, bucket_size * problem.cp_size)
    for index in sorted(order, key=lambda k: (-chosen[k], -problem.placement[chosen[k]][k], k)):
        for degree in degrees[degrees.index(chosen[index]):]:
            first = _best_fit_block(problem, candidate, index, degree, cap_flops)
            if first < 0:
                continue
            if degree == 1:
                candidate.place(problem, index, first)
            else:
                candidate.shard(problem, index, (first, degree))
            break
        else:
            return None
    return candidate


def dacp_hybrid(problem: PlanningProblem, indices: Sequence[int], *, refine: bool = True) -> MicroBatch | None:
    """Hybrid Skrull's DACP: each sequence at the degree that suits it, groups side by side; never worse than the
    binary decision under the cost model (that is a candidate too).

    A dual approximation, as for moldable tasks: bisect on a cap on every rank's load between the balanced load
    (every sequence at its cheapest placement, spread evenly: no placement does better) and the best binary
    decision's busiest rank, packing under each cap (``_pack_under_cap``). A lower cap forces finer pieces, which
    pack memory and load better but pay more communication and shorter, less efficient attention chunks; every
    packing found is evaluated under the cost model and the cheapest decision wins."""
    order = sorted(indices, key=lambda k: (-problem.sequence_lengths[k], k))
    lower_bound_s = _lower_bound_s(problem, order)
    best = _binary_candidates(problem, order, lower_bound_s)
    if best is None or len(problem.degrees) <= 2:  # no room for tokens, or no block between a rank and the group
        return _finish(problem, best, refine)
    low = sum(problem.area[k] for k in order) / problem.cp_size
    high = max(best.loads) + best.shared_load
    for _ in range(MAX_CAP_BISECTIONS):
        if high <= low * CAP_TOLERANCE or best.time_s <= lower_bound_s * GOOD_ENOUGH:
            break
        cap = (low + high) / 2
        packed = _pack_under_cap(problem, order, cap)
        if packed is None:
            low = cap
            continue
        high = cap
        if packed.evaluate(problem) < best.time_s:
            best = packed
    return _finish(problem, best, refine)
