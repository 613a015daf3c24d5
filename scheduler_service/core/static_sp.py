"""The seed systems' static sequence parallelism, as schedulers: every sequence over the whole CP group, one scheme.

* ``ulysses`` — XTuner's and ModelScope SWIFT's sequence parallelism (DeepSpeed Ulysses): the data packed in order
  into sequences of at most the SP group's capacity (their ``pack_to_max_length``; here C·N tokens), DP ranks taking
  contiguous slices of the batch, every packed sequence split evenly over the SP group (the CP group) and attended
  by all-to-all over heads (Ulysses degree = cp_size).
* ``usp`` — long-context-attention's unified sequence parallelism (USP) at one static 2D layout: the same packing,
  Ulysses over ``u`` consecutive ranks and all-gather-KV (their ring) across the ``cp_size / u`` sub-groups, ``u`` the
  largest proper divisor of cp_size the heads split evenly over (USP keeps Ulysses inside a node and the ring
  across; the largest inner degree moves least).

Both refuse a layout whose heads the degree does not split evenly, naming the heads, the degree and the degrees
that would work (neither system splits heads unevenly), and a profile that cannot price their all-to-all; like the
HF samplers, they hold no sequence longer than one CP group (neither spans DP replicas).
"""

from __future__ import annotations

from scheduler_service.core.baselines import contiguous_slices, pack_in_order
from scheduler_service.core.errors import BaselineCannotPlanError
from scheduler_service.core.plan import DPRankPlan, MicroBatch, Plan, PlanningProblem

__all__ = ["static_layout_problem", "ulysses", "usp", "usp_ulysses_degree"]


def _working_degrees(problem: PlanningProblem, up_to: int) -> list[int]:
    return [u for u in range(2, up_to + 1) if problem.perf.heads_allow(u)]


def static_layout_problem(scheduler: str, heads: tuple[int, int], cp_size: int, *, schemes: bool = True) -> str | None:
    """Why ``scheduler`` (``ulysses`` or ``usp``; None for any other) cannot run a model of these ``heads`` (query,
    K/V) over a CP group of ``cp_size`` ranks, naming the heads and the degrees that would work, or for a client
    that keeps every collective all-gather-KV (``schemes`` False); None when it can. What a trainer checks at
    start, before any batch: such a layout refuses every batch."""
    if not schemes and scheduler in ("ulysses", "usp"):
        return (f"scheduler {scheduler} runs every collective as {'Ulysses' if scheduler == 'ulysses' else '2D'}, and "
                "schemes are off (every collective all-gather-KV): keep them on, or choose another scheduler")
    num_heads, num_kv_heads = heads

    def splits(degree: int) -> bool:
        return num_heads % degree == 0 and (num_kv_heads % degree == 0 or degree % num_kv_heads == 0)

    working = [u for u in range(2, num_heads + 1) if splits(u)]
    if scheduler == "ulysses" and not (cp_size > 1 and splits(cp_size)):
        return (f"scheduler ulysses shards every sequence over the CP group by Ulysses degree cp_size {cp_size}, and "
                f"the model's {num_heads} query and {num_kv_heads} K/V heads do not split evenly over it; cp sizes "
                f"that would: {', '.join(map(str, working)) or 'none'}")
    if scheduler == "usp" and not any(cp_size % u == 0 and splits(u) for u in range(2, cp_size)):
        return (f"scheduler usp needs a Ulysses degree strictly between 1 and cp_size {cp_size} that divides it and "
                f"splits the model's {num_heads} query and {num_kv_heads} K/V heads evenly, and there is none; "
                f"Ulysses degrees the heads allow: {', '.join(map(str, working)) or 'none'} (a cp_size with one of "
                f"them as a proper divisor would work)")
    return None


def _refuse_heads(problem: PlanningProblem, scheduler: str, degree: int, working: list[int]) -> BaselineCannotPlanError:
    num_heads, num_kv_heads = problem.perf.model.heads
    return BaselineCannotPlanError(
        scheduler, f"model {problem.perf.model.name}'s {num_heads} query and {num_kv_heads} K/V heads do not split "
        f"evenly over Ulysses degree {degree} (cp_size {problem.cp_size}); Ulysses degrees that would: "
        f"{', '.join(map(str, working)) or 'none'}")


def _static_plan(problem: PlanningProblem, scheduler: str, ulysses_degree: int) -> Plan:
    if not problem.schemes:
        raise BaselineCannotPlanError(
            scheduler, "its plans name a scheme other than all-gather-KV, which a client of schema_version 1 or 2 "
            "cannot run: ask with schema_version 3")
    if problem.perf.scheme_comm(problem.cp_size, ulysses_degree) is None:
        raise BaselineCannotPlanError(
            scheduler, f"profile {problem.perf.profile.name} has no all_to_all table for a group of {ulysses_degree} "
            "ranks, so its all-to-all cannot be priced; measure one with skrull-profile")
    longest = int(problem.lengths.argmax())
    if problem.lengths[longest] > problem.micro_batch_capacity:
        raise BaselineCannotPlanError(
            scheduler, f"sequence {longest} has {problem.lengths[longest]} tokens and one SP group holds "
            f"{problem.micro_batch_capacity} (bucket_size {problem.bucket_size} × cp_size {problem.cp_size}); "
            "static sequence parallelism shards no sequence wider than its group")
    empty = ((),) * problem.cp_size
    return Plan(dp_ranks=tuple(
        DPRankPlan(micro_batches=tuple(MicroBatch(local=empty, distributed=tuple(group),
                                                  distributed_ulysses_degree=ulysses_degree)
                                       for group in pack_in_order(problem, share)))
        for share in contiguous_slices(range(problem.num_sequences), problem.dp_size)))


def ulysses(problem: PlanningProblem) -> Plan:
    """XTuner / SWIFT's static Ulysses SP over the CP group (module docstring)."""
    if problem.cp_size == 1:
        raise BaselineCannotPlanError("ulysses", "cp_size is 1: Ulysses needs an SP group of at least 2 ranks")
    if not problem.perf.heads_allow(problem.cp_size):
        working = _working_degrees(problem, problem.perf.model.num_attention_heads)
        raise _refuse_heads(problem, "ulysses", problem.cp_size, working)
    return _static_plan(problem, "ulysses", problem.cp_size)


def usp_ulysses_degree(problem: PlanningProblem) -> int:
    """USP's inner (Ulysses) degree for this layout: the largest proper divisor of cp_size above 1 the heads split
    evenly over; ``BaselineCannotPlanError`` where there is none."""
    degrees = [u for u in range(2, problem.cp_size) if problem.cp_size % u == 0 and problem.perf.heads_allow(u)]
    if not degrees:
        raise BaselineCannotPlanError(
            "usp", f"a 2D layout needs a Ulysses degree strictly between 1 and cp_size {problem.cp_size} that divides "
            f"it and splits {problem.perf.model.name}'s {problem.perf.model.num_attention_heads} query and "
            f"{problem.perf.model.num_key_value_heads} K/V heads evenly, and there is none (Ulysses degrees the heads "
            f"allow up to cp_size: {', '.join(map(str, _working_degrees(problem, problem.cp_size))) or 'none'})")
    return degrees[-1]


def usp(problem: PlanningProblem) -> Plan:
    """long-context-attention's static 2D USP over the CP group (module docstring)."""
    return _static_plan(problem, "usp", usp_ulysses_degree(problem))
