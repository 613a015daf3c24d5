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

from collections.abc import Sequence

import numpy as np
from numba import types

from scheduler_service.core.costing import TABLES, CostTables, clear_row, empty_sums, micro_batch_time_s, place
from scheduler_service.core.gds_search import min_micro_batches
from scheduler_service.core.jit import kernel
from scheduler_service.core.partition import karmarkar_karp
from scheduler_service.core.plan import DPRankPlan, MicroBatch, Plan, PlanningProblem

__all__ = [
    "balanced",
    "contiguous_slices",
    "deepspeed",
    "deepspeed_time_s",
    "pack_in_order",
    "shard_all",
    "sorted_batching",
]


def shard_all(problem: PlanningProblem, indices: Sequence[int]) -> MicroBatch:
    """Static context parallelism: every sequence of the micro-batch sharded over the CP group."""
    return MicroBatch(local=((),) * problem.cp_size, distributed=tuple(sorted(indices)))


def _plan(micro_batches_per_rank: list[list[list[int]]], problem: PlanningProblem) -> Plan:
    return Plan(dp_ranks=tuple(
        DPRankPlan(micro_batches=tuple(shard_all(problem, group) for group in groups if group))
        for groups in micro_batches_per_rank
    ))


def contiguous_slices(indices: Sequence[int], num_parts: int) -> list[list[int]]:
    """Split in order into ``num_parts`` runs whose sizes differ by at most one."""
    return [list(map(int, part)) for part in np.array_split(np.asarray(indices, dtype=np.int64), num_parts)]


def _deepspeed_micro_batches(problem: PlanningProblem) -> list[list[list[int]]]:
    return [[[index] for index in share] for share in contiguous_slices(range(problem.num_sequences),
                                                                        problem.dp_size)]


def deepspeed(problem: PlanningProblem) -> Plan:
    return _plan(_deepspeed_micro_batches(problem), problem)


@kernel(types.float64(TABLES, types.int64))
def _deepspeed_time_s(tables: CostTables, dp_size: int) -> float:
    """The deepspeed plan's iteration time: contiguous DP slices (``contiguous_slices``), each sequence its own
    micro-batch sharded over the whole CP group."""
    num_sequences = tables.lengths.shape[0]
    sums = empty_sums(tables, 1)
    slowest_s, start = 0.0, 0
    for dp_rank in range(dp_size):
        end = start + num_sequences // dp_size + (dp_rank < num_sequences % dp_size)
        dp_rank_s = 0.0
        for k in range(start, end):
            clear_row(sums, 0)
            place(tables, sums, 0, k, tables.cp_size, 0, 1)
            dp_rank_s += micro_batch_time_s(tables, sums, 0)
        slowest_s, start = max(slowest_s, dp_rank_s), end
    return slowest_s


def deepspeed_time_s(problem: PlanningProblem) -> float:
    """``simulate(problem, deepspeed(problem)).iteration_time_s``, compiled: every answer reports its speedup over
    this baseline, whose one-sequence micro-batches cost more to simulate one by one than Skrull costs to plan."""
    return _deepspeed_time_s(problem.tables, problem.dp_size)


def pack_in_order(problem: PlanningProblem, share: Sequence[int]) -> list[list[int]]:
    """Sequence packing: consecutive sequences share a micro-batch while it holds at most C·N tokens."""
    groups: list[list[int]] = []
    tokens = 0
    for index in share:
        length = problem.sequence_lengths[index]
        if not groups or tokens + length > problem.micro_batch_capacity:
            groups.append([])
            tokens = 0
        groups[-1].append(index)
        tokens += length
    return groups


def sorted_batching(problem: PlanningProblem) -> Plan:
    ascending = sorted(range(problem.num_sequences), key=lambda k: (problem.sequence_lengths[k], k))
    return _plan([pack_in_order(problem, share) for share in contiguous_slices(ascending, problem.dp_size)], problem)


def balanced(problem: PlanningProblem) -> Plan:
    lengths = problem.sequence_lengths
    shares = karmarkar_karp(list(range(problem.num_sequences)), lengths, problem.dp_size)
    per_rank = []
    for share in shares:
        groups: list[list[int]] = []
        count = min_micro_batches(problem.lengths[np.asarray(share, dtype=np.int64)], problem.micro_batch_capacity)
        while share:
            groups = karmarkar_karp(share, lengths, count)
            if max(sum(lengths[k] for k in group) for group in groups) <= problem.micro_batch_capacity:
                break
            count = min(len(share), count + max(1, count // 4))  # geometric: O(log n) tries, ends at one each
        per_rank.append(groups)
    return _plan(per_rank, problem)
