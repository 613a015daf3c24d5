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
* ``group_by_length`` and ``batch_rebalance`` — what a Hugging Face Trainer user
  has: transformers' ``LengthGroupedSampler`` and ``BatchRebalanceSampler``
  (``hf_samplers``, ported and held to transformers' outputs) choose each DP
  rank's micro-batches; accelerate deals the per-device batches to the ranks.
  Each micro-batch is packed without padding (TRL's ``padding_free``, the
  stronger of the two collators) and sharded over the CP group, the static
  degree of transformers' context parallelism. The samplers know no memory
  bound: each batch takes the fewest accumulation steps whose micro-batches all
  hold at most C·N tokens (a Trainer run fixes one for all its batches, so this
  is the most a user could get). A sequence no CP group holds is refused by
  name: neither sampler shards wider than the CP group.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
from numba import types

from scheduler_service.core.costing import TABLES, CostTables, clear_row, empty_sums, micro_batch_time_s, place
from scheduler_service.core.errors import BaselineCannotPlanError
from scheduler_service.core.gds_search import min_micro_batches
from scheduler_service.core.hf_samplers import batch_rebalance_groups, get_length_grouped_indices
from scheduler_service.core.jit import kernel
from scheduler_service.core.partition import karmarkar_karp
from scheduler_service.core.plan import DPRankPlan, MicroBatch, Plan, PlanningProblem

__all__ = [
    "balanced",
    "batch_rebalance",
    "contiguous_slices",
    "deepspeed",
    "deepspeed_time_s",
    "group_by_length",
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
            # one each is the finest split (a sequence no CP group holds is spanned before: with_needed_spanning)
            if count == len(share) or max(sum(lengths[k] for k in group) for group in groups) \
                    <= problem.micro_batch_capacity:
                break
            count = min(len(share), count + max(1, count // 4))  # geometric: O(log n) tries, ends at one each
        per_rank.append(groups)
    return _plan(per_rank, problem)


def _fitting_accumulation(problem: PlanningProblem, scheduler: str, max_grad_accum: int,
                          micro_batches_at: Callable[[int], list[list[list[int]]]]) -> Plan:
    """The plan of the fewest accumulation steps ``g`` (1, 2, …, ``max_grad_accum``) whose micro-batches, per rank
    ``micro_batches_at(g)``, all hold at most C·N tokens."""
    capacity = problem.micro_batch_capacity
    longest = int(np.argmax(problem.lengths))
    if problem.lengths[longest] > capacity:
        raise BaselineCannotPlanError(
            scheduler, f"sequence {longest} has {problem.lengths[longest]} tokens and one CP group holds {capacity} "
            f"(bucket_size {problem.bucket_size} × cp_size {problem.cp_size}); transformers' samplers shard no "
            f"sequence wider than the CP group")
    heaviest: list[int] = []
    for grad_accum in range(1, max_grad_accum + 1):
        per_rank = micro_batches_at(grad_accum)
        heaviest = max((group for groups in per_rank for group in groups),
                       key=lambda group: sum(problem.sequence_lengths[k] for k in group))
        if sum(problem.sequence_lengths[k] for k in heaviest) <= capacity:
            return _plan(per_rank, problem)
    raise BaselineCannotPlanError(
        scheduler, f"even at {max_grad_accum} accumulation steps a micro-batch holds sequences {sorted(heaviest)}, "
        f"{sum(problem.sequence_lengths[k] for k in heaviest)} tokens, and one CP group holds {capacity}")


def group_by_length(problem: PlanningProblem) -> Plan:
    """transformers' ``group_by_length``: ``get_length_grouped_indices`` with the Trainer's ``batch_size``
    (per-device batch × accumulation steps), cut into per-device batches, dealt round-robin to the DP ranks as
    accelerate's ``BatchSamplerShard`` deals them. In a Trainer run its mega-batches hold 50 steps' sequences, so a
    step's batch is a length-sorted slice of one; planning one step, its mega-batch is the step's batch
    (``mega_batch_mult = dp_size``), taken in the batch's own order (the data's shuffle)."""
    num_sequences, dp_size = problem.num_sequences, problem.dp_size

    def micro_batches_at(grad_accum: int) -> list[list[list[int]]]:
        per_device = -(-num_sequences // (dp_size * grad_accum))
        order = get_length_grouped_indices(problem.sequence_lengths, per_device * grad_accum, range(num_sequences),
                                           mega_batch_mult=dp_size)
        per_rank: list[list[list[int]]] = [[] for _ in range(dp_size)]
        for batch, start in enumerate(range(0, num_sequences, per_device)):
            per_rank[batch % dp_size].append(order[start:start + per_device])
        return per_rank

    return _fitting_accumulation(problem, "group_by_length", -(-num_sequences // dp_size), micro_batches_at)


def batch_rebalance(problem: PlanningProblem) -> Plan:
    """transformers' ``batch_rebalance``: ``BatchRebalanceSampler``'s assignment of the batch, each rank's
    accumulation slots in order."""
    num_sequences, dp_size = problem.num_sequences, problem.dp_size
    if num_sequences < dp_size:
        raise BaselineCannotPlanError(
            "batch_rebalance", f"{num_sequences} sequences cannot give each of {dp_size} DP ranks a micro-batch; "
            f"BatchRebalanceSampler needs at least one sequence per rank and accumulation step")

    def micro_batches_at(grad_accum: int) -> list[list[list[int]]]:
        return batch_rebalance_groups(problem.sequence_lengths, dp_size=dp_size, grad_accum=grad_accum)

    return _fitting_accumulation(problem, "batch_rebalance", num_sequences // dp_size, micro_batches_at)
