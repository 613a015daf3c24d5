"""Baseline schedulers: static context parallelism, every sequence sharded.

* ``deepspeed`` — the paper's baseline (DeepSpeed ZeRO-2 + static CP): DP
  ranks take contiguous slices of the batch; each sequence is its own
  micro-batch, sharded over the whole CP group.
* ``sorted_batching`` — LongAlign's sorted batching: sort by length, DP ranks
  take contiguous slices of the sorted order, consecutive sequences are packed
  into micro-batches of at most C·N tokens.
* ``balanced`` — token-balanced packing as ROLL and verl do it: Karmarkar–Karp
  (largest differencing) over DP ranks, then over the fewest micro-batches of
  at most C·N tokens each.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

import numpy as np

from scheduler_service.core.plan import DPRankPlan, MicroBatch, Plan, PlanningProblem

__all__ = ["balanced", "contiguous_slices", "deepspeed", "karmarkar_karp", "pack_in_order", "sorted_batching"]


def _sharded(problem: PlanningProblem, indices: Sequence[int]) -> MicroBatch:
    return MicroBatch(local=((),) * problem.cp_size, distributed=tuple(sorted(indices)))


def _plan(micro_batches_per_rank: list[list[list[int]]], problem: PlanningProblem) -> Plan:
    return Plan(dp_ranks=tuple(
        DPRankPlan(micro_batches=tuple(_sharded(problem, group) for group in groups if group))
        for groups in micro_batches_per_rank
    ))


def contiguous_slices(indices: Sequence[int], num_parts: int) -> list[list[int]]:
    """Split in order into ``num_parts`` runs whose sizes differ by at most one."""
    return [list(map(int, part)) for part in np.array_split(np.asarray(indices, dtype=np.int64), num_parts)]


def deepspeed(problem: PlanningProblem) -> Plan:
    slices = contiguous_slices(range(problem.num_sequences), problem.dp_size)
    return _plan([[[index] for index in share] for share in slices], problem)


def pack_in_order(problem: PlanningProblem, share: Sequence[int]) -> list[list[int]]:
    """Sequence packing: consecutive sequences share a micro-batch while it holds at most C·N tokens."""
    groups: list[list[int]] = []
    tokens = 0
    for index in share:
        length = int(problem.lengths[index])
        if not groups or tokens + length > problem.micro_batch_capacity:
            groups.append([])
            tokens = 0
        groups[-1].append(index)
        tokens += length
    return groups


def sorted_batching(problem: PlanningProblem) -> Plan:
    ascending = sorted(range(problem.num_sequences), key=lambda k: (problem.lengths[k], k))
    return _plan([pack_in_order(problem, share) for share in contiguous_slices(ascending, problem.dp_size)], problem)


def karmarkar_karp(indices: Sequence[int], weights: Sequence[int], num_parts: int) -> list[list[int]]:
    """k-way largest differencing: repeatedly merge the two partial partitions with the largest spread,
    pairing the heaviest subset of one with the lightest of the other."""
    if not indices:
        return [[] for _ in range(num_parts)]
    heap: list[tuple[int, int, list[tuple[int, list[int]]]]] = []
    for counter, index in enumerate(indices):
        subsets = [(int(weights[index]), [index])] + [(0, []) for _ in range(num_parts - 1)]
        heapq.heappush(heap, (-int(weights[index]), counter, subsets))
    counter = len(indices)
    while len(heap) > 1:
        _, _, first = heapq.heappop(heap)
        _, _, second = heapq.heappop(heap)
        first.sort(key=lambda subset: -subset[0])
        second.sort(key=lambda subset: subset[0])
        merged = [(a[0] + b[0], a[1] + b[1]) for a, b in zip(first, second, strict=True)]
        spread = max(s for s, _ in merged) - min(s for s, _ in merged)
        counter += 1
        heapq.heappush(heap, (-spread, counter, merged))
    return [sorted(members) for _, members in heap[0][2]]


def balanced(problem: PlanningProblem) -> Plan:
    lengths = [int(n) for n in problem.lengths]
    shares = karmarkar_karp(list(range(problem.num_sequences)), lengths, problem.dp_size)
    per_rank = []
    for share in shares:
        count = max(1, math.ceil(sum(lengths[k] for k in share) / problem.micro_batch_capacity)) if share else 0
        while share:
            groups = karmarkar_karp(share, lengths, count)
            if max(sum(lengths[k] for k in group) for group in groups) <= problem.micro_batch_capacity:
                break
            count += 1
        per_rank.append(groups if share else [])
    return _plan(per_rank, problem)
