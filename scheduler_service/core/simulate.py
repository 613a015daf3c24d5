"""The simulator: a plan's estimated time under the performance model.

Each CP rank ``r`` of a micro-batch computes, as one packed row, its local
sequences whole, its ``1/N`` zigzag share of the distributed ones and its
``1/s`` share of every hybrid group of size ``s`` it belongs to
(``PerformanceModel.placement_flops``), paying the fixed cost ``β`` once. It
takes part in one collective per group it belongs to (the whole CP group when
there are distributed sequences): an all-gather of K/V forward, a
reduce-scatter of dK/dV backward. The model lets local attention alone hide
them: the all-gathers behind the local attention forward, the reduce-scatters
behind its backward (``PerformanceModel.exposed_comm_s``), which is what the
trainer overlaps for a rank in one collective. A rank in several waits for each
gather just before its group's attention, so a later gather also hides behind an
earlier group's attention: for such ranks the model is pessimistic. So, with
``W_r`` the rank's FLOP-equivalents:

    T_r = α·W_r + β + max(0, ΣAG − T_attn,fwd(local_r)) + max(0, ΣRS − T_attn,bwd(local_r))

A micro-batch takes the max over CP ranks (eq. 1); a DP rank the sum over its
micro-batches; an iteration the max over DP ranks (eq. 8).
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler_service.core.perf_model import FloatOrArray
from scheduler_service.core.plan import MicroBatch, Plan, PlanningProblem

__all__ = [
    "CPRankEstimate",
    "DPRankEstimate",
    "MicroBatchEstimate",
    "PlanEstimate",
    "RankLoad",
    "iteration_lower_bound_s",
    "micro_batch_time_s",
    "rank_compute_time_s",
    "rank_loads",
    "rank_time_s",
    "simulate",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class CPRankEstimate:
    local_tokens: int
    tokens: float  # local + distributed / N + each group's tokens / its size: the memory-bound quantity
    local_compute_s: float  # whole sequences kept on this rank
    distributed_compute_s: float  # this rank's share of the sequences sharded over the whole CP group
    sharded_compute_s: float  # this rank's share of its hybrid groups' sequences
    fixed_s: float  # β: once per micro-batch with work
    comm_s: float  # every collective this rank takes part in, forward and backward
    exposed_comm_s: float  # the part local attention does not hide
    time_s: float


@dataclass(frozen=True, kw_only=True, slots=True)
class MicroBatchEstimate:
    """Every CP rank's breakdown; the critical rank sets ``time_s``."""

    time_s: float
    critical_cp_rank: int
    cp_ranks: tuple[CPRankEstimate, ...]

    @property
    def critical(self) -> CPRankEstimate:
        return self.cp_ranks[self.critical_cp_rank]


@dataclass(frozen=True, kw_only=True, slots=True)
class DPRankEstimate:
    time_s: float
    micro_batches: tuple[MicroBatchEstimate, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanEstimate:
    iteration_time_s: float
    dp_ranks: tuple[DPRankEstimate, ...]


def rank_time_s(problem: PlanningProblem, work_flops: FloatOrArray, local_attention_flops: FloatOrArray,
                all_gather_s: FloatOrArray, reduce_scatter_s: FloatOrArray) -> FloatOrArray:
    """``T_r`` above: the one cost function every scheduler and the simulator use; a rank without work costs
    nothing. Floats, or arrays of many ranks and candidates at once (the vectorised DACP search)."""
    busy = work_flops > 0
    return busy * (problem.alpha_s_per_flop * work_flops + problem.beta_s
                   + problem.perf.exposed_comm_s(all_gather_s, reduce_scatter_s, local_attention_flops))


def rank_compute_time_s(problem: PlanningProblem, work_flops: FloatOrArray) -> FloatOrArray:
    """``rank_time_s`` without its exposed communication: never above it (what is exposed is never negative, and
    floating-point addition is monotone), and monotone in the work, so a search can bound a block of ranks by its
    heaviest one and skip the candidates whose bound already loses."""
    return (work_flops > 0) * (problem.alpha_s_per_flop * work_flops + problem.beta_s)


@dataclass(slots=True)
class RankLoad:
    """What one CP rank runs in a micro-batch, summed: the inputs of ``rank_time_s``."""

    work_flops: float = 0.0
    local_flops: float = 0.0
    distributed_flops: float = 0.0
    sharded_flops: float = 0.0
    local_attention_flops: float = 0.0
    all_gather_s: float = 0.0
    reduce_scatter_s: float = 0.0
    local_tokens: int = 0
    units: int = 0  # tokens × cp_size (exact)


def rank_loads(problem: PlanningProblem, micro_batch: MicroBatch) -> list[RankLoad]:
    """Every CP rank's sums; ``problem`` only needs the micro-batch's sequences."""
    cp_size, lengths = problem.cp_size, problem.sequence_lengths
    local_costs, attention = problem.placement[1], problem.local_attention
    ranks = [RankLoad() for _ in range(cp_size)]
    for rank, rank_local in zip(ranks, micro_batch.local, strict=True):
        rank.local_flops = sum(local_costs[k] for k in rank_local)
        rank.local_attention_flops = sum(attention[k] for k in rank_local)
        rank.local_tokens = sum(lengths[k] for k in rank_local)
        rank.units = rank.local_tokens * cp_size
    shared = [(tuple(range(cp_size)), micro_batch.distributed)] if micro_batch.distributed else []
    for cp_ranks, sequences in shared + [(g.cp_ranks, g.sequences) for g in micro_batch.sharded]:
        degree = len(cp_ranks)
        costs = problem.placement[degree]
        flops = sum(costs[k] for k in sequences)
        tokens = sum(lengths[k] for k in sequences)
        collective = problem.perf.collective_cost(degree)
        all_gather_s, reduce_scatter_s = collective.all_gather_s(tokens), collective.reduce_scatter_s(tokens)
        for cp_rank in cp_ranks:
            rank = ranks[cp_rank]
            if degree == cp_size:
                rank.distributed_flops += flops
            else:
                rank.sharded_flops += flops
            rank.all_gather_s += all_gather_s
            rank.reduce_scatter_s += reduce_scatter_s
            rank.units += tokens * (cp_size // degree)
    for rank in ranks:
        rank.work_flops = rank.local_flops + rank.distributed_flops + rank.sharded_flops
    return ranks


def micro_batch_time_s(problem: PlanningProblem, micro_batch: MicroBatch) -> float:
    """The slowest CP rank's ``T_r``."""
    return max(rank_time_s(problem, rank.work_flops, rank.local_attention_flops, rank.all_gather_s,
                           rank.reduce_scatter_s) for rank in rank_loads(problem, micro_batch))


def _estimate_micro_batch(problem: PlanningProblem, micro_batch: MicroBatch) -> MicroBatchEstimate:
    alpha, cp_size = problem.alpha_s_per_flop, problem.cp_size
    cp_ranks = []
    for rank in rank_loads(problem, micro_batch):
        time_s = rank_time_s(problem, rank.work_flops, rank.local_attention_flops, rank.all_gather_s,
                             rank.reduce_scatter_s)
        comm_s = rank.all_gather_s + rank.reduce_scatter_s
        cp_ranks.append(CPRankEstimate(
            local_tokens=rank.local_tokens,
            tokens=rank.units / cp_size,
            local_compute_s=alpha * rank.local_flops,
            distributed_compute_s=alpha * rank.distributed_flops,
            sharded_compute_s=alpha * rank.sharded_flops,
            fixed_s=problem.beta_s if rank.work_flops > 0 else 0.0,
            comm_s=comm_s,
            exposed_comm_s=problem.perf.exposed_comm_s(rank.all_gather_s, rank.reduce_scatter_s,
                                                       rank.local_attention_flops) if comm_s else 0.0,
            time_s=time_s,
        ))
    critical = max(range(cp_size), key=lambda r: cp_ranks[r].time_s)
    return MicroBatchEstimate(time_s=cp_ranks[critical].time_s, critical_cp_rank=critical, cp_ranks=tuple(cp_ranks))


def iteration_lower_bound_s(problem: PlanningProblem) -> float:
    """No plan is faster: every sequence at its cheapest placement (``area``) and the work spread evenly over all
    DP × CP ranks (the max replaced by the mean), no communication exposed, one β per micro-batch of the fewest
    micro-batches the tokens need; and no faster than the costliest sequence at its cheapest placement."""
    num_ranks = problem.dp_size * problem.cp_size
    min_micro_batches = -(-sum(problem.sequence_lengths) // problem.micro_batch_capacity)
    spread_s = (problem.alpha_s_per_flop * sum(problem.area) / num_ranks
                + problem.beta_s * min_micro_batches / problem.dp_size)
    longest_s = max(
        min(problem.alpha_s_per_flop * problem.placement[degree][k] + problem.beta_s for degree in problem.degrees
            if problem.sequence_lengths[k] <= degree * problem.bucket_size)
        for k in range(problem.num_sequences)
    )
    return max(spread_s, longest_s)


def simulate(problem: PlanningProblem, plan: Plan) -> PlanEstimate:
    """Estimated times of every micro-batch, DP rank and the iteration."""
    dp_ranks = []
    for dp_plan in plan.dp_ranks:
        micro_batches = tuple(_estimate_micro_batch(problem, mb) for mb in dp_plan.micro_batches)
        dp_ranks.append(DPRankEstimate(time_s=sum(mb.time_s for mb in micro_batches), micro_batches=micro_batches))
    return PlanEstimate(iteration_time_s=max(rank.time_s for rank in dp_ranks), dp_ranks=tuple(dp_ranks))
