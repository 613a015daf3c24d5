"""The simulator: a plan's estimated time under the performance model.

Micro-batch time on CP rank j (eq. 2): ``max(T_comm(V), T_comp(Local_j)) + T_comp(Dist)``
with ``Dist`` the distributed FLOPs divided by N (each rank computes its 1/N
zigzag share). A micro-batch takes the max over CP ranks (eq. 1); a DP rank the
sum over its micro-batches; an iteration the max over DP ranks (eq. 8).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from scheduler_service.core.perf_model import PerformanceModel
from scheduler_service.core.plan import MicroBatch, Plan, PlanningProblem

__all__ = [
    "CPRankEstimate",
    "DPRankEstimate",
    "MicroBatchEstimate",
    "PlanEstimate",
    "iteration_time_s",
    "micro_batch_time_s",
    "micro_batches_time_s",
    "simulate",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class CPRankEstimate:
    local_tokens: int
    tokens: float  # local + distributed / N: the memory-bound quantity
    local_compute_s: float
    time_s: float


@dataclass(frozen=True, kw_only=True, slots=True)
class MicroBatchEstimate:
    """Breakdown on the critical CP rank (the one that sets ``time_s``)."""

    time_s: float
    local_compute_s: float
    distributed_compute_s: float
    comm_s: float
    overlap_s: float  # communication hidden behind local compute
    cp_ranks: tuple[CPRankEstimate, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class DPRankEstimate:
    time_s: float
    micro_batches: tuple[MicroBatchEstimate, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanEstimate:
    iteration_time_s: float
    dp_ranks: tuple[DPRankEstimate, ...]


def micro_batch_time_s(
    perf: PerformanceModel, cp_size: int, local_flops: Sequence[float], distributed_tokens: float,
    distributed_flops: float,
) -> float:
    """Eqs. 1–5 for one micro-batch given the local FLOPs of (at least the busiest) CP ranks: the schedulers'
    inner cost function."""
    comm_s = perf.comm_time_s(distributed_tokens)
    distributed_s = perf.compute_time_s(distributed_flops / cp_size)
    return max(comm_s, perf.compute_time_s(max(local_flops, default=0.0))) + distributed_s


def _estimate_micro_batch(problem: PlanningProblem, micro_batch: MicroBatch) -> MicroBatchEstimate:
    perf, cp_size = problem.perf, problem.cp_size
    lengths, flops = problem.sequence_lengths, problem.flops_list
    distributed_tokens = sum(lengths[i] for i in micro_batch.distributed)
    comm_s = perf.comm_time_s(distributed_tokens)
    distributed_s = perf.compute_time_s(sum(flops[i] for i in micro_batch.distributed) / cp_size)
    cp_ranks = []
    for rank_local in micro_batch.local:
        local_tokens = sum(lengths[i] for i in rank_local)
        local_s = perf.compute_time_s(sum(flops[i] for i in rank_local))
        cp_ranks.append(
            CPRankEstimate(
                local_tokens=local_tokens,
                tokens=local_tokens + distributed_tokens / cp_size,
                local_compute_s=local_s,
                time_s=max(comm_s, local_s) + distributed_s,
            )
        )
    critical = max(cp_ranks, key=lambda rank: rank.time_s)
    return MicroBatchEstimate(
        time_s=critical.time_s,
        local_compute_s=critical.local_compute_s,
        distributed_compute_s=distributed_s,
        comm_s=comm_s,
        overlap_s=min(comm_s, critical.local_compute_s),
        cp_ranks=tuple(cp_ranks),
    )


def micro_batches_time_s(problem: PlanningProblem, micro_batches: Iterable[MicroBatch]) -> float:
    """Estimated time of micro-batches run one after another (a DP rank's gradient accumulation)."""
    lengths, flops = problem.sequence_lengths, problem.flops_list
    return sum(
        micro_batch_time_s(
            problem.perf, problem.cp_size, [sum(flops[i] for i in rank_local) for rank_local in mb.local if rank_local],
            sum(lengths[i] for i in mb.distributed), sum(flops[i] for i in mb.distributed),
        )
        for mb in micro_batches
    )


def iteration_time_s(problem: PlanningProblem, plan: Plan) -> float:
    """``simulate(...).iteration_time_s`` without the breakdown: the cheap path for baselines and searches."""
    return max(micro_batches_time_s(problem, dp_plan.micro_batches) for dp_plan in plan.dp_ranks)


def simulate(problem: PlanningProblem, plan: Plan) -> PlanEstimate:
    """Estimated times of every micro-batch, DP rank and the iteration."""
    dp_ranks = []
    for dp_plan in plan.dp_ranks:
        micro_batches = tuple(_estimate_micro_batch(problem, mb) for mb in dp_plan.micro_batches)
        dp_ranks.append(DPRankEstimate(time_s=sum(mb.time_s for mb in micro_batches), micro_batches=micro_batches))
    return PlanEstimate(iteration_time_s=max(rank.time_s for rank in dp_ranks), dp_ranks=tuple(dp_ranks))
