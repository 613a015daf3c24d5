"""GDS: split a global batch over DP ranks and into memory-bounded micro-batches.

* ``skrull_paper`` — Algorithm 2 as published: bin-pack FLOPs over DP ranks
  (greedy, in batch order, onto the least-loaded rank: the paper leaves
  ``Binpack`` unspecified), sort each share ascending, cut it into ``m``
  strided micro-batches ``Subset[j::m]`` starting from
  ``m = ⌈tokens / (C·N)⌉`` and growing ``m`` until every micro-batch fits and
  Algorithm 1 (``dacp_paper``) succeeds on each.
* ``round_robin`` — the same GDS with the RR DACP of appendix B.2.
* ``skrull`` — the default, hybrid: LPT over DP ranks on each sequence's
  cheapest-placement cost, the best of a few micro-batchings per share, hybrid
  DACP in each micro-batch (``gds_search``, ``dacp_search``), then a local search
  across micro-batches and DP ranks (``plan_refine``) within a search budget.
  Binary Skrull's plan is a candidate too (its DP split and cuts differ), so
  ``skrull`` is never slower than ``skrull_binary`` under the cost model.
* ``skrull_binary`` — the same GDS with LPT on FLOPs and binary DACP (whole, or
  sharded over the whole CP group).

The Skrull schedulers run as compiled kernels: the Python here hands them the
batch's cost tables and turns the ``Places`` they return into a ``Plan``.
Measured cost: docs/benchmarks.md, "Planning latency".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from scheduler_service.core.baselines import contiguous_slices, pack_in_order
from scheduler_service.core.dacp import dacp_balanced, dacp_paper, dacp_round_robin
from scheduler_service.core.dacp_search import BINARY, HYBRID, STATIC
from scheduler_service.core.errors import InfeasiblePlanError
from scheduler_service.core.gds_search import min_micro_batches, plan_gds
from scheduler_service.core.plan import DPRankPlan, MicroBatch, Places, Plan, PlanningProblem
from scheduler_service.core.plan_refine import refine_plan

__all__ = ["Searched", "dacp_only", "gds_only", "gds_paper", "gds_places", "round_robin", "search", "skrull",
           "skrull_binary", "skrull_binary_places", "skrull_paper", "skrull_places"]

Dacp = Callable[[PlanningProblem, Sequence[int]], MicroBatch | None]

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
    ascending = sorted(subset, key=lambda k: (problem.sequence_lengths[k], k))
    return [ascending[j::count] for j in range(count)]


def _schedule_groups(problem: PlanningProblem, groups: list[list[int]], dacp: Dacp) -> list[MicroBatch] | None:
    micro_batches = []
    for group in groups:
        if not group:
            continue
        if sum(problem.sequence_lengths[k] for k in group) > problem.micro_batch_capacity:
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
    fewest = min_micro_batches(problem.lengths[np.asarray(subset, dtype=np.int64)], problem.micro_batch_capacity)
    for count in range(fewest, len(subset) + 1):
        micro_batches = _schedule_groups(problem, _strided(problem, subset, count), dacp)
        if micro_batches is not None:
            return micro_batches
    raise _no_plan(problem, subset)


def _paper_style(problem: PlanningProblem, dacp: Dacp) -> Plan:
    indices = range(problem.num_sequences)
    shares = _greedy_in_order(indices, problem.flops.tolist(), problem.dp_size)  # Alg. 2 line 1
    return Plan(dp_ranks=tuple(
        DPRankPlan(micro_batches=tuple(gds_paper(problem, share, dacp)) if share else ()) for share in shares
    ))


def skrull_paper(problem: PlanningProblem) -> Plan:
    """Algorithms 1–3 as published (roll-back fixed)."""
    return _paper_style(problem, dacp_paper)


def round_robin(problem: PlanningProblem) -> Plan:
    """The RR case-study scheduler of appendix B.2 under the paper's GDS."""
    return _paper_style(problem, dacp_round_robin)


def gds_places(problem: PlanningProblem, weights: npt.NDArray[np.float64], space: int) -> tuple[Places, float]:
    """GDS in a DACP search space (``gds_search.plan_gds``): the plan, and its iteration time under the cost
    model."""
    micro_batch, degree, first_rank, dp_rank, time_s, failed_dp_rank = plan_gds(
        problem.tables, np.ascontiguousarray(weights, dtype=np.float64), problem.dp_size, space)
    if failed_dp_rank >= 0:
        raise InfeasiblePlanError(
            f"no micro-batching of DP rank {failed_dp_rank}'s sequences fits bucket_size {problem.bucket_size} × "
            f"cp_size {problem.cp_size}", field="bucket_size")
    return Places(micro_batch, degree, first_rank, dp_rank), time_s


def _plan(problem: PlanningProblem, places: Places) -> Plan:
    return Plan.from_places(places, dp_size=problem.dp_size, cp_size=problem.cp_size)


class Searched(NamedTuple):
    """GDS's hybrid plan before its refinement and binary Skrull's plan, each with its iteration time."""

    hybrid: Places
    hybrid_s: float
    binary: Places
    binary_s: float

    def faster(self) -> Places:
        """The faster of the two (hybrid on ties)."""
        return self.hybrid if self.hybrid_s <= self.binary_s else self.binary


def search(problem: PlanningProblem) -> Searched:
    """The two GDS searches ``skrull_places`` refines and compares."""
    return Searched(*gds_places(problem, problem.area, HYBRID), *gds_places(problem, problem.flops, BINARY))


def skrull_places(problem: PlanningProblem, *, budget: int | None = None, searched: Searched | None = None) -> Places:
    """Skrull's default scheduler: GDS with hybrid DACP, refined across micro-batches and DP ranks
    (``plan_refine.refine_plan``: the local search, and with a ``budget`` the iterated local search until it is
    spent); binary Skrull's plan where that is cheaper under the cost model, so never slower than it.
    ``searched``: the two searches, where the caller has made them (``search``)."""
    searched = search(problem) if searched is None else searched
    hybrid, hybrid_s = refine_plan(problem, searched.hybrid, budget=budget)
    return hybrid if hybrid_s <= searched.binary_s else searched.binary


def skrull(problem: PlanningProblem, *, budget: int | None = None) -> Plan:
    """``skrull_places`` as a plan."""
    return _plan(problem, skrull_places(problem, budget=budget))


def skrull_binary_places(problem: PlanningProblem) -> Places:
    """Binary Skrull: the same GDS, each sequence whole or sharded over the whole CP group."""
    return gds_places(problem, problem.flops, BINARY)[0]


def skrull_binary(problem: PlanningProblem) -> Plan:
    """``skrull_binary_places`` as a plan."""
    return _plan(problem, skrull_binary_places(problem))


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
    return _plan(problem, gds_places(problem, problem.flops, STATIC)[0])
