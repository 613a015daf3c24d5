"""Conversion between the wire contract (``skrull_proto``) and the planning core.

The one place where pydantic models meet core dataclasses; importable without
FastAPI, so the CLI and the trainer use it too.
"""

from __future__ import annotations

from skrull_proto import (
    CPRankEstimateModel,
    DPRankPlanModel,
    MicroBatchModel,
    ModelSpec,
    PlanRequest,
    PlanResponse,
    ShardedGroupModel,
    SolverReport,
)
from skrull_proto import SchedulerName as WireSchedulerName

from scheduler_service.core.models import ModelShape, resolve_model
from scheduler_service.core.plan import (
    DEFAULT_LIMITS,
    DPRankPlan,
    MicroBatch,
    Plan,
    PlanLimits,
    PlanningProblem,
    ShardedGroup,
    make_problem,
)
from scheduler_service.core.planner import PlanResult
from scheduler_service.core.profile import Profile, resolve_profile
from scheduler_service.core.simulate import CPRankEstimate

__all__ = ["request_model_and_profile", "request_to_problem", "response_to_plan", "result_to_response"]


def _model_shape(model: str | ModelSpec) -> str | ModelShape:
    return model if isinstance(model, str) else ModelShape(**model.model_dump())


def request_to_problem(
    request: PlanRequest, *, limits: PlanLimits = DEFAULT_LIMITS, extra_profiles: dict[str, Profile] | None = None
) -> PlanningProblem:
    """Validate a request's values with the core (which names the offending field)."""
    return make_problem(
        sequence_lengths=request.sequence_lengths,
        dp_size=request.dp_size,
        cp_size=request.cp_size,
        model=_model_shape(request.model),
        bucket_size=request.bucket_size,
        profile=request.profile,
        limits=limits,
        extra_profiles=extra_profiles,
    )


def request_model_and_profile(
    request: PlanRequest, *, extra_profiles: dict[str, Profile] | None = None
) -> tuple[ModelShape, Profile]:
    """The request's model and profile (unknown names raise), without validating its batch: cheap whatever its
    size, and what a feedback job is keyed by."""
    return resolve_model(_model_shape(request.model)), resolve_profile(request.profile, extra_profiles)


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 6)


def _cp_rank_model(rank: CPRankEstimate) -> CPRankEstimateModel:
    return CPRankEstimateModel(
        tokens=round(rank.tokens, 6), local_tokens=rank.local_tokens, local_ms=_ms(rank.local_compute_s),
        distributed_ms=_ms(rank.distributed_compute_s), sharded_ms=_ms(rank.sharded_compute_s),
        fixed_ms=_ms(rank.fixed_s), comm_ms=_ms(rank.comm_s), exposed_comm_ms=_ms(rank.exposed_comm_s),
        time_ms=_ms(rank.time_s),
    )


def result_to_response(result: PlanResult, *, breakdown: bool = False) -> PlanResponse:
    """The response to a plan; ``breakdown`` (the request's) adds every CP rank's estimate per micro-batch."""
    problem, estimate = result.problem, result.estimate
    dp_ranks = [
        DPRankPlanModel(
            micro_batches=[
                MicroBatchModel(
                    local=[list(rank_local) for rank_local in micro_batch.local],
                    distributed=list(micro_batch.distributed),
                    sharded=[ShardedGroupModel(cp_ranks=list(group.cp_ranks), sequences=list(group.sequences))
                             for group in micro_batch.sharded],
                    estimated_time_ms=_ms(mb_estimate.time_s),
                    cp_ranks=[_cp_rank_model(rank) for rank in mb_estimate.cp_ranks] if breakdown else [],
                )
                for micro_batch, mb_estimate in zip(dp_plan.micro_batches, dp_estimate.micro_batches, strict=True)
            ],
            estimated_time_ms=_ms(dp_estimate.time_s),
        )
        for dp_plan, dp_estimate in zip(result.plan.dp_ranks, estimate.dp_ranks, strict=True)
    ]
    solver = None
    if result.solver is not None:
        report = result.solver
        solver = SolverReport.model_validate({  # validates the core's status string against the contract
            "status": report.status,
            "objective_ms": None if report.objective_s is None else _ms(report.objective_s),
            "bound_ms": None if report.bound_s is None else _ms(report.bound_s),
            "wall_time_ms": _ms(report.wall_time_s),
        })
    return PlanResponse(
        scheduler=WireSchedulerName(result.scheduler.value),
        model=problem.perf.model.name,
        profile=problem.perf.profile.name,
        bucket_size=problem.bucket_size,
        dp_ranks=dp_ranks,
        estimated_iteration_time_ms=_ms(estimate.iteration_time_s),
        solve_time_ms=_ms(result.solve_time_s),
        deepspeed_estimated_iteration_time_ms=_ms(result.baseline_time_s),
        speedup_vs_deepspeed=round(result.speedup_vs_deepspeed, 6),
        solver=solver,
    )


def _micro_batch(model: MicroBatchModel) -> MicroBatch:
    return MicroBatch(
        local=tuple(tuple(rank_local) for rank_local in model.local),
        distributed=tuple(model.distributed),
        sharded=tuple(ShardedGroup(cp_ranks=tuple(group.cp_ranks), sequences=tuple(group.sequences))
                      for group in model.sharded),
    )


def response_to_plan(response: PlanResponse) -> Plan:
    """The core plan a response describes, hybrid groups included (check it with ``check_plan`` before use)."""
    return Plan(
        dp_ranks=tuple(
            DPRankPlan(micro_batches=tuple(_micro_batch(mb) for mb in dp_rank.micro_batches))
            for dp_rank in response.dp_ranks
        )
    )
