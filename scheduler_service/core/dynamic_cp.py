"""Megatron-Core's dynamic context parallelism, as a baseline: every micro-batch over the whole DP × CP pool.

Megatron-LM's dev branch (``megatron/core/datasets/data_schedule.py``, ``DefaultDynamicCPScheduler``, and
``data_schedule_utils.next_hdp_group_packing_aware``) schedules a global batch in rounds; each round is one
micro-batch of every one of the pool's ``P = dp_size × cp_size`` ranks:

1. Each sequence needs a group of ``c(L) = 2^ceil(log2(L / m))`` ranks (at least 1), ``m`` the tokens one rank
   holds (here ``bucket_size``).
2. A round takes the remaining sequences longest first. The first opens a group of ``c`` ranks at rank 0. Each next
   one goes to the candidate that keeps the round's heaviest rank lightest, among: every group already open whose
   size is ``c(L)``, ``2c(L)``, … (each of its ranks still within ``m`` tokens after adding ``L / size``), and a new
   group of that size on the lowest free ranks; workload ``L² / size`` per member rank. A candidate whose heaviest
   rank would exceed 1.05 × (longest length × m) is not taken; ties keep the first (smallest size, "add" before
   "new"). What no candidate takes waits for the next round.
3. Idle ranks are filled by doubling the first of the smallest groups (its sequences then over twice the ranks)
   and shifting the later groups, until every rank has work; where no group can double, the round is instead the
   longest sequences over the whole pool while they fit.

A round is a spanning micro-batch over every DP replica (``plan.SpanningMicroBatch``), each sequence sharded over
its group (a group of one rank keeps it whole), so the simulator prices Megatron's plan with Skrull's cost model.
Megatron's groups are aligned blocks of a power-of-two pool; on other pools a round whose group would straddle an
aligned block falls back to step 3's whole-pool round.
"""

from __future__ import annotations

import math

from scheduler_service.core.plan import DPRankPlan, MicroBatch, Plan, PlanningProblem, SpanningMicroBatch

__all__ = ["dynamic_cp"]

_WORKLOAD_CAP_DELTA = 0.05  # Megatron's _DYNAMIC_CP_WORKLOAD_CAP_DELTA


def _group_size(length: int, rank_tokens: int) -> int:
    return max(1, 1 << math.ceil(math.log2(length / rank_tokens))) if length > rank_tokens else 1


class _Round:
    """One round under construction: its groups (first rank, size, members) and per-rank tokens and workload."""

    def __init__(self, pool: int) -> None:
        self.pool = pool
        self.groups: list[tuple[int, int, list[int]]] = []
        self.tokens = [0.0] * pool
        self.work = [0.0] * pool
        self.used = [False] * pool

    def add(self, group: int | None, first: int, size: int, index: int, length: int) -> None:
        if group is None:
            self.groups.append((first, size, [index]))
            for r in range(first, first + size):
                self.used[r] = True
        else:
            self.groups[group][2].append(index)
        for r in range(first, first + size):
            self.tokens[r] += length / size
            self.work[r] += length * length / size


def _free_block(round_: _Round, size: int) -> int | None:
    """The lowest ``size`` free ranks, if they are an aligned block (Megatron takes the lowest free ranks; on a
    power-of-two pool filled in this order they always are)."""
    free = [r for r in range(round_.pool) if not round_.used[r]]
    if len(free) < size:
        return None
    first = free[0]
    return first if first % size == 0 and free[size - 1] == first + size - 1 else None


def _next_round(lengths: list[int], order: list[int], pool: int, rank_tokens: int) -> tuple[_Round, list[int]]:
    """One round from ``order`` (longest first): the round, and what waits for the next."""
    round_ = _Round(pool)
    cap = lengths[order[0]] * rank_tokens * (1 + _WORKLOAD_CAP_DELTA)
    leftovers: list[int] = []
    for index in order:
        length = lengths[index]
        best: tuple[float, int | None, int, int] | None = None  # (heaviest rank, group, first rank, size)
        size = _group_size(length, rank_tokens)
        while size <= pool:
            if pool % size:  # not an aligned block of this pool: Megatron's pools are powers of two
                size *= 2
                continue
            load = length * length / size
            for group, (first, group_size, _) in enumerate(round_.groups):
                if group_size != size or round_.tokens[first] + length / size > rank_tokens:
                    continue
                heaviest = max(max(round_.work[r] + load for r in range(first, first + size)), max(round_.work))
                if heaviest <= cap and (best is None or heaviest < best[0]):
                    best = (heaviest, group, first, size)
            first_free = _free_block(round_, size)
            if first_free is not None:
                heaviest = max(load, max(round_.work))
                if heaviest <= cap and (best is None or heaviest < best[0]):
                    best = (heaviest, None, first_free, size)
            size *= 2
        if best is None:
            leftovers.append(index)
        else:
            round_.add(best[1], best[2], best[3], index, length)
    return round_, leftovers


def _fill_idle(round_: _Round) -> bool:
    """Double the first of the smallest groups while ranks are idle; False when no group can double."""
    while not all(round_.used):
        groups = sorted(range(len(round_.groups)), key=lambda g: (round_.groups[g][1], g))
        for g in groups:
            first, size, members = round_.groups[g]
            if first % (2 * size) == 0 and round_.pool % (2 * size) == 0:
                later = [(f + size, s, m) for f, s, m in round_.groups[g + 1:]]
                if any(f % s or f + s > round_.pool for f, s, _ in later):
                    continue
                round_.groups[g:] = [(first, 2 * size, members), *later]
                round_.used = [False] * round_.pool
                for f, s, _ in round_.groups:
                    for r in range(f, f + s):
                        round_.used[r] = True
                break
        else:
            return False
    return True


def _whole_pool_round(lengths: list[int], order: list[int], pool: int,
                      rank_tokens: int) -> tuple[_Round, list[int]]:
    round_ = _Round(pool)
    taken = 0
    for index in order:
        if round_.tokens[0] + lengths[index] / pool > rank_tokens:
            break
        round_.add(0 if round_.groups else None, 0, pool, index, lengths[index])
        taken += 1
    return round_, order[taken:]


def dynamic_cp(problem: PlanningProblem) -> Plan:
    """Megatron dynamic CP's plan of ``problem`` (module docstring): every round a spanning micro-batch over all DP
    replicas (or, with one DP replica, a micro-batch of its CP group)."""
    lengths = list(problem.sequence_lengths)
    pool = problem.dp_size * problem.cp_size
    order = sorted(range(len(lengths)), key=lambda k: (-lengths[k], k))
    micro_batches: list[MicroBatch] = []
    while order:
        round_, leftovers = _next_round(lengths, order, pool, problem.bucket_size)
        if not _fill_idle(round_):
            round_, leftovers = _whole_pool_round(lengths, order, pool, problem.bucket_size)
        micro_batches.append(MicroBatch.from_places(
            [(index, size, first) for first, size, members in round_.groups for index in members], pool))
        order = leftovers
    if problem.dp_size == 1:
        return Plan(dp_ranks=(DPRankPlan(micro_batches=tuple(micro_batches)),))
    return Plan(dp_ranks=tuple(DPRankPlan(micro_batches=()) for _ in range(problem.dp_size)),
                spanning=tuple(SpanningMicroBatch(first_dp_rank=0, num_dp_ranks=problem.dp_size, micro_batch=mb)
                               for mb in micro_batches))
