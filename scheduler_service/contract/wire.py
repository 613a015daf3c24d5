"""Conversion between the wire contract (``skrull_proto``) and the planning core.

The one place where pydantic models meet core dataclasses; importable without
FastAPI, so the CLI and the trainer use it too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from skrull_proto import (
    SCHEMA_VERSION,
    SCHEMES_SCHEMA_VERSION,
    SPANNING_SCHEMA_VERSION,
    ComputeCoefficients,
    FeedbackRequest,
    FeedbackResponse,
    MemoryCoefficients,
    MicroBatchMeasurement,
    MicroBatchModel,
    ModelSpec,
    PlanRequest,
    PlanResponse,
    ProfileDocument,
    ProfileSummary,
    SamplerSpec,
    ShardedGroupLengths,
    SpanningMicroBatchModel,
)

from scheduler_service.core import feedback as core_feedback
from scheduler_service.core.choices import CollectiveScheme
from scheduler_service.core.errors import InvalidRequestError
from scheduler_service.core.models import ModelShape, resolve_model
from scheduler_service.core.plan import (
    DEFAULT_LIMITS,
    DPRankPlan,
    MicroBatch,
    Plan,
    PlanLimits,
    PlanningProblem,
    ShardedGroup,
    SpanningMicroBatch,
    make_problem,
)
from scheduler_service.core.planner import SCHEME_CHOOSERS, PlanResult
from scheduler_service.core.profile import Profile, parse_profile
from scheduler_service.core.samplers import LengthDistribution
from scheduler_service.core.schemes import schemes_note
from scheduler_service.core.simulate import CPRankEstimate, MicroBatchEstimate

__all__ = [
    "document_to_profile",
    "feedback_to_measurements",
    "job_to_feedback_response",
    "micro_batch_to_measurement",
    "profile_to_summary",
    "request_model",
    "request_to_problem",
    "response_to_plan",
    "result_to_response",
    "result_to_response_data",
    "sampler_to_spec",
    "shape_to_model_spec",
]


def _model_shape(model: str | ModelSpec) -> str | ModelShape:
    return model if isinstance(model, str) else ModelShape(**model.model_dump())


def shape_to_model_spec(shape: ModelShape) -> ModelSpec:
    """A core model shape as the contract spells it (a request's custom model, ``GET /models``)."""
    return ModelSpec.model_validate({name: getattr(shape, name) for name in ModelSpec.model_fields})


def profile_to_summary(profile: Profile, origin: Literal["builtin", "directory"]) -> ProfileSummary:
    date = profile.provenance.get("date")
    return ProfileSummary(name=profile.name, description=profile.description, device=profile.device,
                          device_memory_bytes=profile.device_memory_bytes, model=profile.model,
                          origin=origin, measured_at=date if isinstance(date, str) else None)


def sampler_to_spec(name: str, distribution: LengthDistribution) -> SamplerSpec:
    return SamplerSpec(name=name, thresholds=list(distribution.thresholds), cumulative=list(distribution.cumulative),
                       longest=distribution.longest)


def request_to_problem(
    request: PlanRequest, *, limits: PlanLimits = DEFAULT_LIMITS, extra_profiles: dict[str, Profile] | None = None,
    model: ModelShape | None = None, profile: Profile | None = None,
) -> PlanningProblem:
    """Validate a request's values with the core (which names the offending field). ``model`` and ``profile``:
    the request's, resolved already (the service's admission resolves them once); None: resolved here, the profile
    among the shipped ones and ``extra_profiles``."""
    return make_problem(
        sequence_lengths=request.sequence_lengths,
        dp_size=request.dp_size,
        cp_size=request.cp_size,
        model=_model_shape(request.model) if model is None else model,
        bucket_size=request.bucket_size,
        profile=request.profile if profile is None else profile,
        limits=limits,
        extra_profiles=extra_profiles,
        gpus_per_node=request.gpus_per_node,
        spanning=request.allows_spanning,
        token_buckets=request.token_buckets,
        schemes=request.schema_version >= SCHEMES_SCHEMA_VERSION,
    )


def request_model(model: str | ModelSpec) -> ModelShape:
    """The model a request names, a catalogue name or an inline shape (an unknown name raises), without validating
    anything else of the request: cheap whatever its size, and what a feedback job is keyed by."""
    return resolve_model(_model_shape(model))


def document_to_profile(document: ProfileDocument) -> Profile:
    """The core's profile of a document the contract validated (its ranges are checked here, each error naming its
    field). Its ``raw`` is the document as the contract writes it, defaults included, so that two spellings of one
    profile (a member left out, or given its default) are the same profile."""
    return parse_profile(document.model_dump(mode="json"))


def _ms(seconds: float) -> float:
    return round(float(seconds) * 1e3, 6)  # a plain float, whatever numpy type the core computed it in


def _cp_rank_data(rank: CPRankEstimate) -> dict[str, Any]:
    data = {
        "tokens": round(float(rank.tokens), 6), "local_tokens": int(rank.local_tokens),
        "local_ms": _ms(rank.local_compute_s), "distributed_ms": _ms(rank.distributed_compute_s),
        "sharded_ms": _ms(rank.sharded_compute_s), "fixed_ms": _ms(rank.fixed_s), "comm_ms": _ms(rank.comm_s),
        "exposed_comm_ms": _ms(rank.exposed_comm_s),
    }
    if padding_ms := _ms(rank.padding_s):  # left out when 0, as CPRankEstimateModel serialises it
        data["padding_ms"] = padding_ms
    if launch_bound_ms := _ms(rank.launch_bound_s):
        data["launch_bound_ms"] = launch_bound_ms
    data["time_ms"] = _ms(rank.time_s)
    return data


def _scheme_data(degree: int, ulysses_degree: int, prefix: str = "") -> dict[str, Any]:
    """A collective's scheme as the wire spells it: nothing for all-gather-KV (the default, left out), the name,
    and the degree for 2D only."""
    scheme = CollectiveScheme.of(degree, ulysses_degree)
    if scheme is CollectiveScheme.ALL_GATHER_KV:
        return {}
    data: dict[str, Any] = {f"{prefix}scheme": scheme.value}
    if scheme is CollectiveScheme.TWO_D:
        data[f"{prefix}ulysses_degree"] = ulysses_degree
    return data


def _ulysses_degree(scheme: str, ulysses_degree: int | None, degree: int) -> int:
    """The core's Ulysses degree of a wire scheme (the contract checked that 2D names its degree)."""
    if scheme == CollectiveScheme.ULYSSES:
        return degree
    if scheme == CollectiveScheme.TWO_D:
        assert ulysses_degree is not None
        return ulysses_degree
    return 1


def _has_schemes(plan: Plan) -> bool:
    micro_batches = [mb for dp_plan in plan.dp_ranks for mb in dp_plan.micro_batches]
    micro_batches += [spanning.micro_batch for spanning in plan.spanning]
    return any(collective.ulysses_degree != 1 for mb in micro_batches for collective in mb.collectives())


def _micro_batch_data(micro_batch: MicroBatch, estimate: MicroBatchEstimate, breakdown: bool) -> dict[str, Any]:
    data: dict[str, Any] = {"local": [list(rank_local) for rank_local in micro_batch.local],
                            "distributed": list(micro_batch.distributed),
                            **_scheme_data(len(micro_batch.local), micro_batch.distributed_ulysses_degree,
                                           "distributed_")}
    if micro_batch.sharded:  # empty optional lists are left out, as ``MicroBatchModel`` serialises them
        data["sharded"] = [{"cp_ranks": list(group.cp_ranks), "sequences": list(group.sequences),
                            **_scheme_data(group.degree, group.ulysses_degree)}
                           for group in micro_batch.sharded]
    data["estimated_time_ms"] = _ms(estimate.time_s)
    if breakdown:
        data["cp_ranks"] = [_cp_rank_data(rank) for rank in estimate.cp_ranks]
    return data


def _spanning_data(spanning: SpanningMicroBatch, estimate: MicroBatchEstimate, breakdown: bool,
                   cp_size: int) -> dict[str, Any]:
    """A spanning micro-batch on the wire: its sharded groups by world rank (the core counts from the block's
    first)."""
    micro_batch = spanning.micro_batch
    first_rank = spanning.world_ranks(cp_size)[0]
    data: dict[str, Any] = {"dp_ranks": list(spanning.dp_ranks),
                            "local": [list(rank_local) for rank_local in micro_batch.local],
                            "distributed": list(micro_batch.distributed),
                            **_scheme_data(len(micro_batch.local), micro_batch.distributed_ulysses_degree,
                                           "distributed_")}
    if micro_batch.sharded:
        data["sharded"] = [{"ranks": [first_rank + rank for rank in group.cp_ranks],
                            "sequences": list(group.sequences), **_scheme_data(group.degree, group.ulysses_degree)}
                           for group in micro_batch.sharded]
    data["estimated_time_ms"] = _ms(estimate.time_s)
    if breakdown:
        data["ranks"] = [_cp_rank_data(rank) for rank in estimate.cp_ranks]
    return data


def result_to_response_data(result: PlanResult, *, breakdown: bool = False) -> dict[str, Any]:
    """A plan's response as JSON-ready data, spelt as ``PlanResponse`` serialises it (every field, empty optional
    lists left out): the one description of the response. ``result_to_response`` validates it; the service writes
    it as it is (``runtime.work.plan_validated``), which costs a third of building the models (a test checks they
    agree)."""
    problem, estimate = result.problem, result.estimate
    dp_ranks = [
        {"micro_batches": [_micro_batch_data(micro_batch, mb_estimate, breakdown) for micro_batch, mb_estimate
                           in zip(dp_plan.micro_batches, dp_estimate.micro_batches, strict=True)],
         "estimated_time_ms": _ms(dp_estimate.time_s)}
        for dp_plan, dp_estimate in zip(result.plan.dp_ranks, estimate.dp_ranks, strict=True)
    ]
    solver = None
    if (report := result.solver) is not None:
        solver = {"status": report.status,
                  "objective_ms": None if report.objective_s is None else _ms(report.objective_s),
                  "bound_ms": None if report.bound_s is None else _ms(report.bound_s),
                  "wall_time_ms": _ms(report.wall_time_s)}
    spanning = [_spanning_data(micro_batch, mb_estimate, breakdown, problem.cp_size)
                for micro_batch, mb_estimate in zip(result.plan.spanning, estimate.spanning, strict=True)]
    note = schemes_note(problem) if problem.schemes and result.scheduler in SCHEME_CHOOSERS else None
    version = (SCHEMES_SCHEMA_VERSION if _has_schemes(result.plan)
               else SPANNING_SCHEMA_VERSION if spanning else SCHEMA_VERSION)
    return {
        "schema_version": version,
        "scheduler": result.scheduler.value,
        "model": problem.perf.model.name,
        "profile": problem.perf.profile.name,
        "bucket_size": int(problem.bucket_size),
        "dp_ranks": dp_ranks,
        **({"spanning": spanning} if spanning else {}),
        "estimated_iteration_time_ms": _ms(estimate.iteration_time_s),
        "solve_time_ms": _ms(result.solve_time_s),
        "deepspeed_estimated_iteration_time_ms": _ms(result.baseline_time_s),
        "speedup_vs_deepspeed": round(float(result.speedup_vs_deepspeed), 6),
        "lower_bound_ms": _ms(result.lower_bound_s),
        "solver": solver,
        **({"notes": [note]} if note else {}),
    }


def result_to_response(result: PlanResult, *, breakdown: bool = False) -> PlanResponse:
    """The response to a plan, validated; ``breakdown`` (the request's) adds every CP rank's estimate per
    micro-batch."""
    return PlanResponse.model_validate(result_to_response_data(result, breakdown=breakdown))


def _micro_batch(model: MicroBatchModel) -> MicroBatch:
    return MicroBatch(
        local=tuple(tuple(rank_local) for rank_local in model.local),
        distributed=tuple(model.distributed),
        distributed_ulysses_degree=_ulysses_degree(model.distributed_scheme, model.distributed_ulysses_degree,
                                                   len(model.local)),
        sharded=tuple(ShardedGroup(cp_ranks=tuple(group.cp_ranks), sequences=tuple(group.sequences),
                                   ulysses_degree=_ulysses_degree(group.scheme, group.ulysses_degree,
                                                                  len(group.cp_ranks)))
                      for group in model.sharded),
    )


def _spanning_micro_batch(model: SpanningMicroBatchModel) -> SpanningMicroBatch:
    """The core's spanning micro-batch of a wire one: its groups' world ranks counted from the block's first rank,
    ``cp_size`` its local lists per replica (whether the block and the groups are aligned, and the lists as many as
    the block's ranks, is the checker's to say)."""
    first_dp_rank = model.dp_ranks[0]
    first_rank = first_dp_rank * (len(model.local) // len(model.dp_ranks))
    if model.dp_ranks != list(range(first_dp_rank, first_dp_rank + len(model.dp_ranks))):
        raise InvalidRequestError(f"spanning micro-batch DP ranks {model.dp_ranks} are not consecutive",
                                  field="spanning.dp_ranks")
    return SpanningMicroBatch(first_dp_rank=first_dp_rank, num_dp_ranks=len(model.dp_ranks), micro_batch=MicroBatch(
        local=tuple(tuple(rank_local) for rank_local in model.local), distributed=tuple(model.distributed),
        distributed_ulysses_degree=_ulysses_degree(model.distributed_scheme, None, len(model.local)),
        sharded=tuple(ShardedGroup(cp_ranks=tuple(rank - first_rank for rank in group.ranks),
                                   sequences=tuple(group.sequences),
                                   ulysses_degree=_ulysses_degree(group.scheme, None, len(group.ranks)))
                      for group in model.sharded)))


def response_to_plan(response: PlanResponse) -> Plan:
    """The core plan a response describes, hybrid groups and spanning micro-batches included (check it with
    ``check_plan`` before use)."""
    return Plan(
        dp_ranks=tuple(
            DPRankPlan(micro_batches=tuple(_micro_batch(mb) for mb in dp_rank.micro_batches))
            for dp_rank in response.dp_ranks
        ),
        spanning=tuple(map(_spanning_micro_batch, response.spanning)),
    )


def micro_batch_to_measurement(
    micro_batch: MicroBatch, sequence_lengths: Sequence[int], *, time_s: float, peak_memory_bytes: float | None,
) -> MicroBatchMeasurement:
    """What the trainer reports of one planned micro-batch: its lengths as planned, its time and peak memory."""
    return MicroBatchMeasurement(
        local_lengths=[[int(sequence_lengths[i]) for i in rank_local] for rank_local in micro_batch.local],
        distributed_lengths=[int(sequence_lengths[i]) for i in micro_batch.distributed],
        sharded_lengths=[ShardedGroupLengths(cp_ranks=list(group.cp_ranks),
                                             lengths=[int(sequence_lengths[i]) for i in group.sequences])
                         for group in micro_batch.sharded],
        time_ms=time_s * 1e3,
        peak_memory_bytes=None if peak_memory_bytes is None else float(peak_memory_bytes),  # strict float
    )


def feedback_to_measurements(request: FeedbackRequest) -> list[core_feedback.MicroBatchMeasurement]:
    """A report's micro-batches as the core refits them; an error names the micro-batch it is in."""
    measurements = []
    for index, item in enumerate(request.micro_batches):
        try:
            measurements.append(core_feedback.MicroBatchMeasurement(
                local_lengths=tuple(tuple(rank) for rank in item.local_lengths),
                distributed_lengths=tuple(item.distributed_lengths), time_s=item.time_ms / 1e3,
                peak_memory_bytes=item.peak_memory_bytes,
                sharded_lengths=tuple(core_feedback.GroupLengths(cp_ranks=tuple(group.cp_ranks),
                                                                 lengths=tuple(group.lengths))
                                      for group in item.sharded_lengths),
            ))
        except InvalidRequestError as error:
            raise InvalidRequestError(f"micro_batches[{index}]: {error.message}",
                                      field=f"micro_batches[{index}].{error.field}") from None
    return measurements


def job_to_feedback_response(job: core_feedback.JobFeedback) -> FeedbackResponse:
    """A job's refit state: ``POST /feedback``'s answer and ``GET /feedback/{job_id}``."""
    compute = job.profile.compute
    memory = None
    if job.memory_slope is not None and job.memory_intercept is not None:
        memory = MemoryCoefficients(bytes_per_token=job.memory_slope, fixed_bytes=job.memory_intercept)
    return FeedbackResponse(
        job_id=job.job_id, model=job.model.name, base_profile=job.base.name, base_registered=job.base_registered,
        profile=job.profile.name,
        num_observations=job.num_observations, num_in_window=len(job.compute_window),
        num_downweighted=job.num_downweighted, compute_scale=job.compute_scale,
        compute=ComputeCoefficients(alpha_s_per_flop=compute.alpha_s_per_flop,
                                    alpha_s_per_token=compute.alpha_s_per_token,
                                    alpha_s_per_sequence=compute.alpha_s_per_sequence,
                                    beta_s_per_layer=compute.beta_s_per_layer),
        fit_median_relative_error=job.fit_median_relative_error, memory=memory,
        memory_budget_bytes=job.memory_budget_bytes, bucket_size_cap=job.bucket_cap,
    )
