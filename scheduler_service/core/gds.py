"""GDS: split a global batch over DP ranks and into memory-bounded micro-batches.

* ``skrull_paper`` — Algorithm 2 as published: bin-pack FLOPs over DP ranks
  (greedy, in batch order, onto the least-loaded rank: the paper leaves
  ``Binpack`` unspecified), sort each share ascending, cut it into ``m``
  strided micro-batches ``Subset[j::m]`` starting from
  ``m = ⌈tokens / (C·N)⌉`` and growing ``m`` until every micro-batch fits and
  Algorithm 1 (``dacp_paper``) succeeds on each.
* ``round_robin`` — the same GDS with the RR DACP of appendix B.2.
* ``skrull`` — the default, hybrid. DP balancing by LPT on each sequence's
  cheapest placement cost (its rank-FLOP-equivalents at the degree that costs
  least, ``PlanningProblem.area``; largest first onto the least-loaded rank).
  For each DP share it tries the memory-minimal micro-batch count and one more,
  each cut by spreading tokens (longest first onto the micro-batch with the
  fewest tokens, which pairs long with short and keeps each under C·N; it
  matched or beat the strided cut in our measurements at half the cost); every
  micro-batch of every share and cut is searched in one batched
  ``hybrid_and_balanced_candidates`` call, and each share's cheapest cut under
  the cost model is built (and refined). The assembled plan is then refined
  across micro-batches and DP ranks (``plan_refine``: bounded swaps and moves of
  single sequences off the slowest DP rank's critical CP ranks into other
  micro-batches' slack).
  Binary Skrull's plan is a candidate too (its DP split and cuts differ), so
  ``skrull`` is never slower than ``skrull_binary`` under the cost model.
  Measured cost: see the README's planning-latency table.
* ``skrull_binary`` — the same GDS with LPT on FLOPs and binary DACP
  (``balanced_candidates``): whole, or sharded over the whole CP group.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from scheduler_service.core.baselines import contiguous_slices, min_micro_batches, pack_in_order
from scheduler_service.core.dacp import (
    Candidate,
    balanced_candidates,
    dacp_balanced,
    dacp_paper,
    dacp_round_robin,
    hybrid_and_balanced_candidates,
    static_candidates,
)
from scheduler_service.core.errors import InfeasiblePlanError
from scheduler_service.core.partition import lpt_partition
from scheduler_service.core.plan import DPRankPlan, MicroBatch, Plan, PlanningProblem
from scheduler_service.core.plan_refine import refine_plan

__all__ = ["dacp_only", "gds_only", "gds_paper", "round_robin", "skrull", "skrull_binary", "skrull_paper"]

Dacp = Callable[[PlanningProblem, Sequence[int]], MicroBatch | None]
Search = Callable[[PlanningProblem, Sequence[Sequence[int]]], list[Candidate | None]]
EXTRA_MICRO_BATCH_COUNTS = 1  # counts tried beyond the first feasible one


def _greedy_in_order(indices: Sequence[int], weights: Sequence[float], num_parts: int) -> list[list[int]]:
    """Each item, in batch order, onto the least-loaded part: our reading of the paper's ``Binpack``."""
    parts: list[list[int]] = [[] for _ in range(num_parts)]
    loads = [0.0] * num_parts
    for index in indices:
        part = min(range(num_parts), key=loads.__getitem__)
        parts[part].append(index)
        loads[part] += weights[index]
    return parts


def _strided(problem: PlanningProblem, subset: Sequence[int], count: int) -> list[list[int]]:
    """Alg. 2 line 7: sort ascending, take every ``count``-th sequence."""
    ascending = sorted(subset, key=lambda k: (problem.lengths[k], k))
    return [ascending[j::count] for j in range(count)]


def _longest_first(problem: PlanningProblem, subset: Sequence[int]) -> list[int]:
    indices = np.asarray(subset, dtype=np.int64)
    return indices[np.lexsort((indices, -problem.lengths[indices]))].tolist()


def _spread_longest_first(problem: PlanningProblem, longest_first: Sequence[int], count: int,
                          ) -> list[list[int]] | None:
    """Longest first onto the micro-batch with the fewest tokens; ``None`` if one would exceed C·N."""
    capacity, lengths = problem.micro_batch_capacity, problem.sequence_lengths
    groups: list[list[int]] = [[] for _ in range(count)]
    heap = [(0, j) for j in range(count)]
    for index in longest_first:
        tokens, j = heap[0]
        tokens += lengths[index]
        if tokens > capacity:
            return None
        groups[j].append(index)
        heapq.heapreplace(heap, (tokens, j))
    return groups


def _schedule_groups(problem: PlanningProblem, groups: list[list[int]], dacp: Dacp) -> list[MicroBatch] | None:
    micro_batches = []
    for group in groups:
        if not group:
            continue
        if sum(int(problem.lengths[k]) for k in group) > problem.micro_batch_capacity:
            return None  # Alg. 2 line 8: overloaded
        micro_batch = dacp(problem, group)
        if micro_batch is None:
            return None  # Alg. 2 line 8: DACP failed
        micro_batches.append(micro_batch)
    return micro_batches


def _no_plan(problem: PlanningProblem, subset: Sequence[int]) -> InfeasiblePlanError:
    return InfeasiblePlanError(
        f"no micro-batching of {len(subset)} sequences fits bucket_size {problem.bucket_size} × cp_size "
        f"{problem.cp_size}", field="bucket_size")


def gds_paper(problem: PlanningProblem, subset: Sequence[int], dacp: Dacp) -> list[MicroBatch]:
    """Alg. 2 lines 2–12 for one DP rank's share."""
    for count in range(min_micro_batches(problem, subset), len(subset) + 1):
        micro_batches = _schedule_groups(problem, _strided(problem, subset, count), dacp)
        if micro_batches is not None:
            return micro_batches
    raise _no_plan(problem, subset)


def _paper_style(problem: PlanningProblem, dacp: Dacp) -> Plan:
    indices = range(problem.num_sequences)
    shares = _greedy_in_order(indices, problem.flops_list, problem.dp_size)  # Alg. 2 line 1
    return Plan(dp_ranks=tuple(
        DPRankPlan(micro_batches=tuple(gds_paper(problem, share, dacp)) if share else ()) for share in shares
    ))


def skrull_paper(problem: PlanningProblem) -> Plan:
    """Algorithms 1–3 as published (roll-back fixed)."""
    return _paper_style(problem, dacp_paper)


def round_robin(problem: PlanningProblem) -> Plan:
    """The RR case-study scheduler of appendix B.2 under the paper's GDS."""
    return _paper_style(problem, dacp_round_robin)


def _cuts(problem: PlanningProblem, subset: Sequence[int]) -> list[list[list[int]]]:
    """The micro-batchings of one DP share worth comparing: the fewest micro-batches whose token spread fits,
    and ``EXTRA_MICRO_BATCH_COUNTS`` more (each where its spread fits)."""
    longest_first = _longest_first(problem, subset)

    def spread(count: int) -> list[list[int]] | None:
        return _spread_longest_first(problem, longest_first, count)

    count = min_micro_batches(problem, subset)
    failed, fitting = count - 1, spread(count)
    while fitting is None:  # grow geometrically until one fits: O(log n) spreads even for adversarial lengths ...
        if count == len(subset):
            raise _no_plan(problem, subset)
        failed, count = count, min(len(subset), count + max(1, count // 8))
        fitting = spread(count)
    while count - failed > 1:  # ... then bisect back down to the fewest that fits
        middle = (failed + count) // 2
        groups = spread(middle)
        if groups is None:
            failed = middle
        else:
            count, fitting = middle, groups
    cuts = [fitting, *(spread(extra) for extra in range(count + 1, min(count + EXTRA_MICRO_BATCH_COUNTS,
                                                                       len(subset)) + 1))]
    return [[group for group in groups if group] for groups in cuts if groups is not None]


@dataclass(frozen=True, slots=True)
class _Split:
    """One global batch split for GDS: LPT shares over DP ranks, and each share's micro-batchings worth comparing."""

    shares: list[list[int]]
    cuts: list[list[list[list[int]]]]

    @property
    def groups(self) -> list[list[int]]:
        """Every micro-batch of every share and cut, in order: what one batched search decides."""
        return [group for share_cuts in self.cuts for cut in share_cuts for group in cut]


def _split(problem: PlanningProblem, weights: Sequence[float]) -> _Split:
    shares = lpt_partition(range(problem.num_sequences), weights, problem.dp_size)
    return _Split(shares=shares, cuts=[_cuts(problem, share) if share else [] for share in shares])


def _assemble(problem: PlanningProblem, split: _Split, found: list[Candidate | None]) -> tuple[Plan, float]:
    """Per share, the cheapest micro-batching under the cost model, built; the plan and its iteration time."""
    candidates = iter(found)
    dp_ranks, times_s = [], []
    for share, share_cuts in zip(split.shares, split.cuts, strict=True):
        best: tuple[float, list[Candidate]] | None = None
        for cut in share_cuts:
            kept = [candidate for candidate in (next(candidates) for _ in cut) if candidate is not None]
            time_s = sum(candidate.time_s for candidate in kept)
            if len(kept) == len(cut) and (best is None or time_s < best[0]):
                best = (time_s, kept)
        if share and best is None:
            raise _no_plan(problem, share)
        decided = [candidate.decide() for candidate in best[1]] if best else []
        dp_ranks.append(DPRankPlan(micro_batches=tuple(decision.micro_batch for decision in decided)))
        times_s.append(sum(decision.time_s for decision in decided))
    return Plan(dp_ranks=tuple(dp_ranks)), max(times_s)


def _lpt_gds(problem: PlanningProblem, weights: Sequence[float], search: Search) -> tuple[Plan, float]:
    """LPT over DP ranks; per share, the cheapest of its micro-batchings, every micro-batch of every share and cut
    searched in one batched call."""
    split = _split(problem, weights)
    return _assemble(problem, split, search(problem, split.groups))


def skrull(problem: PlanningProblem) -> Plan:
    """Skrull's default scheduler: LPT over DP ranks, best of several micro-batchings, hybrid DACP, refined across
    micro-batches and DP ranks (``refine_plan``); binary Skrull's plan where that is cheaper under the cost model
    (its DP split and cuts can differ), so never slower than it. Both are searched in one batched pass."""
    hybrid_split, binary_split = _split(problem, problem.area), _split(problem, problem.flops_list)
    hybrid_found, binary_found = hybrid_and_balanced_candidates(problem, hybrid_split.groups, binary_split.groups)
    hybrid = _assemble(problem, hybrid_split, hybrid_found)[0]
    refined, hybrid_time_s = refine_plan(problem, [dp_rank.micro_batches for dp_rank in hybrid.dp_ranks])
    hybrid = Plan(dp_ranks=tuple(DPRankPlan(micro_batches=tuple(micro_batches)) for micro_batches in refined))
    binary, binary_time_s = _assemble(problem, binary_split, binary_found)
    return hybrid if hybrid_time_s <= binary_time_s else binary


def skrull_binary(problem: PlanningProblem) -> Plan:
    """Binary Skrull: the same GDS, each sequence whole or sharded over the whole CP group."""
    return _lpt_gds(problem, problem.flops_list, balanced_candidates)[0]


def dacp_only(problem: PlanningProblem) -> Plan:
    """Ablation (paper Fig. 3, step by step): the baseline's data order and DP slices, packed into
    micro-batches in order, with DACP inside each."""
    dp_ranks = []
    for share in contiguous_slices(range(problem.num_sequences), problem.dp_size):
        micro_batches = _schedule_groups(problem, pack_in_order(problem, share), dacp_balanced)
        assert micro_batches is not None, "balanced DACP succeeds whenever a micro-batch's tokens fit"
        dp_ranks.append(DPRankPlan(micro_batches=tuple(micro_batches)))
    return Plan(dp_ranks=tuple(dp_ranks))


def gds_only(problem: PlanningProblem) -> Plan:
    """Ablation: Skrull's GDS with static context parallelism (every sequence sharded)."""
    return _lpt_gds(problem, problem.flops_list, static_candidates)[0]
