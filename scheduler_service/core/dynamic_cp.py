"""Megatron-Core's dynamic context parallelism as a baseline: Megatron's own schedule, priced as Megatron runs it.

**The plan** is the schedule of Megatron-LM's ``DefaultDynamicCPScheduler`` (``megatron_dcp``, a line-for-line port
held to the original's outputs): micro-batches over the whole DP × CP pool of ``P = dp_size × cp_size`` ranks,
each sequence on a group of a power of two of ranks (a group of one keeps it whole), every rank in exactly one
group per micro-batch, ``bucket_size`` as Megatron's ``max_seqlen_per_dp_cp_rank``. As a ``Plan`` each
micro-batch is a spanning micro-batch over every DP replica (``plan.SpanningMicroBatch``; with one replica, a
micro-batch of its CP group), each sequence placed on its group: what ``/plan`` answers and the trainer can run.

It refuses, by name (``BaselineCannotPlanError``), what Megatron does not run: a pool that is not a power of two of
at least two ranks (Megatron asserts an even pool, builds its dynamic groups as the aligned power-of-two blocks of
the pool, and its scheduler's fill step fails on other pools: the original raises ``IndexError`` on two sequences
of 150 and 225 tokens over 18 ranks of 31), and a group that is not an aligned block of its size (Megatron's runtime
would run it on the aligned process group of that size, other ranks than planned; none of 3,000 random schedules
the original made had one).

**The price** (``megatron_estimate``) is how Megatron runs such a micro-batch, which is not how this project's
trainer runs the same plan (``simulate``). Term by term:

* *Lockstep over the pool.* Every rank of the pool runs each micro-batch together; a micro-batch takes its slowest
  rank, the iteration the sum of its micro-batches. The same as ``simulate`` for spanning micro-batches over the
  whole world.
* *Compute.* Each rank runs one packed (THD) row of its group's sequences at the group's degree: the same FLOPs,
  query-chunk efficiency, ``β`` once and the launch-bound floor as ``costing.rank_time_s``.
* *Communication.* Transformer Engine's context parallelism (``cp_comm_type="p2p"``, Megatron's default) passes K/V
  around the group's ring in ``s − 1`` steps: per rank the all-gather's volume forward. Its backward passes K/V
  again with dK/dV, the all-gather's and the reduce-scatter's volumes. Skrull's DACP gathers K/V once, keeps it for
  the backward (memory the BucketSize reserves) and reduce-scatters dK/dV. Fixed costs as the profile's
  collectives, once per group and micro-batch.
* *Overlap.* Each ring step's transfer hides behind the previous step's attention of the same sequences, so
  ``(s − 1)/s`` of the rank's own (sharded) attention hides its forward and its backward communication. Skrull's
  DACP gathers before a sharded sequence's attention, so only whole sequences' attention on the rank hides it.

So with ``A`` the rank's attention time (forward share ``φ``), ``AG`` and ``RS`` its collectives at its group's
degree ``s``: ``T_r = max(F, α·W_r + β + max(0, AG − (s−1)/s·φA) + max(0, AG + RS − (s−1)/s·(1−φ)A))``.
Left out: the padding of each sequence to a multiple of ``2s`` tokens that Transformer Engine's THD layout needs (at
most ``2s − 1`` tokens a sequence), and the memory Megatron saves by not keeping gathered K/V.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from scheduler_service.core.errors import BaselineCannotPlanError
from scheduler_service.core.megatron_dcp import get_groups_and_subsamples
from scheduler_service.core.plan import DPRankPlan, MicroBatch, Place, Plan, PlanningProblem, SpanningMicroBatch

__all__ = ["MegatronEstimate", "dynamic_cp", "megatron_estimate", "micro_batch_places"]


def micro_batch_places(sample_ids_per_rank: list[list[int]]) -> list[Place]:
    """One of Megatron's micro-batches (per DP × CP rank, its sample ids) as places ``(index, degree, first
    rank)``, each sequence on the aligned block of ranks that packs it."""
    ranks_of: dict[int, list[int]] = {}
    for rank, sample_ids in enumerate(sample_ids_per_rank):
        for sample_id in sample_ids:
            ranks_of.setdefault(sample_id, []).append(rank)
    places: list[Place] = []
    for sample_id, ranks in ranks_of.items():
        first, degree = ranks[0], len(ranks)
        if ranks != list(range(first, first + degree)) or first % degree:
            raise BaselineCannotPlanError(
                "dynamic_cp", f"Megatron's schedule puts sequence {sample_id} on ranks {ranks}, not an aligned block "
                f"of {degree}: its runtime runs a group of {degree} on the aligned process group of that size")
        places.append((sample_id, degree, first))
    return places


def dynamic_cp(problem: PlanningProblem) -> Plan:
    """Megatron dynamic CP's plan of ``problem`` (module docstring)."""
    pool = problem.dp_size * problem.cp_size
    if pool < 2 or pool & (pool - 1):
        raise BaselineCannotPlanError(
            "dynamic_cp", f"Megatron's dynamic CP runs on pools of a power of two of at least 2 ranks; dp_size "
            f"{problem.dp_size} × cp_size {problem.cp_size} = {pool}")
    rounds = get_groups_and_subsamples(list(enumerate(problem.sequence_lengths)), pool, problem.bucket_size)
    micro_batches = [MicroBatch.from_places(micro_batch_places(round_), pool) for round_ in rounds]
    if problem.dp_size == 1:
        return Plan(dp_ranks=(DPRankPlan(micro_batches=tuple(micro_batches)),))
    return Plan(dp_ranks=tuple(DPRankPlan(micro_batches=()) for _ in range(problem.dp_size)),
                spanning=tuple(SpanningMicroBatch(first_dp_rank=0, num_dp_ranks=problem.dp_size, micro_batch=mb)
                               for mb in micro_batches))


@dataclass(frozen=True, kw_only=True, slots=True)
class MegatronEstimate:
    """A dynamic-CP plan's time as Megatron runs it (module docstring)."""

    iteration_time_s: float
    micro_batch_times_s: tuple[float, ...]
    exposed_comm_s: float  # what the slowest rank of each micro-batch leaves visible, summed


def megatron_estimate(problem: PlanningProblem, plan: Plan) -> MegatronEstimate:
    """The time of ``plan`` (``dynamic_cp``'s: every micro-batch over the whole pool) as Megatron runs it."""
    pool = problem.span_problem(problem.dp_size)
    tables = pool.tables
    micro_batches = ([spanning.micro_batch for spanning in plan.spanning] if plan.spanning
                     else plan.dp_ranks[0].micro_batches)
    attention_flops = {degree: pool.perf.placement_attention_flops(tables.lengths, degree)
                       for degree in pool.degrees}
    forward_share = tables.attention_forward_share
    times_s: list[float] = []
    exposed_total_s = 0.0
    for micro_batch in micro_batches:
        work, attention, all_gather, reduce_scatter = (np.zeros(tables.cp_size) for _ in range(4))
        degree_of_rank = np.ones(tables.cp_size)
        opened: set[tuple[int, int]] = set()
        for index, degree, first in micro_batch.places():
            d = tables.degree_row[degree]
            ranks = slice(first, first + degree)
            pays_fixed = (first, degree) not in opened
            opened.add((first, degree))
            work[ranks] += tables.rank_flops[d, index]
            attention[ranks] += attention_flops[degree][index]
            all_gather[ranks] += (tables.all_gather_s_per_token[d] * tables.lengths[index]
                                  + pays_fixed * tables.all_gather_fixed_s[d])
            reduce_scatter[ranks] += (tables.reduce_scatter_s_per_token[d] * tables.lengths[index]
                                      + pays_fixed * tables.reduce_scatter_fixed_s[d])
            degree_of_rank[ranks] = degree
        hidden = (degree_of_rank - 1) / degree_of_rank * tables.alpha_s_per_flop * attention
        exposed = (np.maximum(0.0, all_gather - forward_share * hidden)
                   + np.maximum(0.0, all_gather + reduce_scatter - (1 - forward_share) * hidden))
        rank_s = np.where(work > 0, np.maximum(tables.floor_s, tables.alpha_s_per_flop * work + tables.beta_s
                                               + exposed), 0.0)
        slowest = int(rank_s.argmax())
        times_s.append(float(rank_s[slowest]))
        exposed_total_s += float(exposed[slowest])
    return MegatronEstimate(iteration_time_s=sum(times_s), micro_batch_times_s=tuple(times_s),
                            exposed_comm_s=exposed_total_s)
