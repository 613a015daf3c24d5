"""The HTTP routes: thin wrappers over ``PlanningService``, the catalogue and the metrics.

Routes parse (FastAPI + ``skrull_proto``), call one function and answer;
errors are raised, never formatted here (``problems`` maps them to HTTP).
"""

from __future__ import annotations

import functools
from typing import Annotated, Any

import anyio.to_thread
from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from skrull_proto import (
    FeedbackResponse,
    HealthStatus,
    ModelsResponse,
    PlanRequest,
    PlanResponse,
    ProfilesReloaded,
    SchedulerName,
    ServiceLimits,
)

from scheduler_service.auth import require_api_token
from scheduler_service.core.models import MODEL_CATALOGUE
from scheduler_service.core.profile import DEFAULT_PROFILE, builtin_profiles
from scheduler_service.disconnect import ClientWatch
from scheduler_service.metrics import CONTENT_TYPE_LATEST, ServiceMetrics
from scheduler_service.middleware import SCHEDULER_SCOPE_KEY
from scheduler_service.parsing import parse_plan_request
from scheduler_service.planning import PlanningService
from scheduler_service.problems import (
    FEEDBACK_PROBLEM_RESPONSES,
    PROBLEM_RESPONSES,
    UNAUTHORIZED_RESPONSE,
    ServiceUnavailableError,
)
from scheduler_service.settings import Settings
from scheduler_service.wire import job_to_feedback_response, profile_to_summary, shape_to_model_spec

__all__ = ["router"]

router = APIRouter()


# Dependencies are ``async def``: FastAPI runs a plain ``def`` dependency in a worker thread, a hop that
# costs more than the lookup itself.
async def get_planner(request: Request) -> PlanningService:
    planner: PlanningService = request.app.state.planner
    return planner


async def get_app_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


async def get_metrics(request: Request) -> ServiceMetrics:
    metrics: ServiceMetrics = request.app.state.metrics
    return metrics


PlannerDep = Annotated[PlanningService, Depends(get_planner)]
SettingsDep = Annotated[Settings, Depends(get_app_settings)]
MetricsDep = Annotated[ServiceMetrics, Depends(get_metrics)]

_JSON = "application/json"
# Bodies up to this size (about 10,000 sequences) are parsed on the event loop; larger ones in a thread.
_INLINE_MAX_BODY_BYTES = 64 << 10


def _request_body(schema: str) -> dict[str, Any]:
    """OpenAPI of a body the route parses itself (``parsing``), so that the service decides where it is parsed."""
    return {"requestBody": {"content": {_JSON: {"schema": {"$ref": f"#/components/schemas/{schema}"}}},
                            "required": True}}


@router.post(
    "/plan",
    operation_id="plan",
    response_model=PlanResponse,
    responses=PROBLEM_RESPONSES,
    summary="Plan one global batch",
    description="Schedules the batch with the chosen scheduler (GDS + hybrid DACP for `skrull`, binary DACP for "
    "`skrull_binary`) and returns the plan "
    "with its estimated iteration time beside the deepspeed baseline's. Deterministic: the same request gives "
    "the same plan. `cpsat` runs in a bounded process pool (429 with Retry-After when full).",
    openapi_extra=_request_body("PlanRequest"),
)
async def plan(request: Request) -> Response:
    # The app's state read directly rather than through Depends: resolving dependencies costs more than the
    # rest of the route's own work, on the one route called once per training step.
    planner: PlanningService = request.app.state.planner
    settings: Settings = request.app.state.settings
    raw = await request.body()
    content_type = request.headers.get("content-type")
    if len(raw) <= _INLINE_MAX_BODY_BYTES:
        body = parse_plan_request(raw, content_type, max_sequences=settings.max_sequences)
    else:  # parsing (or describing the errors of) a huge batch must not stall the event loop
        body = await anyio.to_thread.run_sync(
            functools.partial(parse_plan_request, raw, content_type, max_sequences=settings.max_sequences)
        )
    request.scope[SCHEDULER_SCOPE_KEY] = body.scheduler.value
    batch = await planner.plan(body, watch=ClientWatch(request.receive))
    # Already serialized where it was planned; returning a Response skips FastAPI's second validation pass.
    return Response(batch.body, media_type=_JSON)


@router.get("/models", operation_id="listModels", response_model=ModelsResponse,
            summary="Known models, profiles, schedulers and limits")
async def models(settings: SettingsDep, planner: PlannerDep) -> ModelsResponse:
    return ModelsResponse(
        models=[shape_to_model_spec(shape) for shape in MODEL_CATALOGUE.values()],
        profiles=[
            *(profile_to_summary(profile, "builtin") for profile in builtin_profiles().values()),
            *(profile_to_summary(profile, "directory") for profile in planner.profiles.values()),
        ],
        schedulers=list(SchedulerName),
        default_model=PlanRequest.model_fields["model"].default,
        default_profile=DEFAULT_PROFILE,
        limits=ServiceLimits(
            max_body_bytes=settings.max_body_bytes,
            max_sequences=settings.max_sequences,
            max_sequence_length=settings.max_sequence_length,
            max_dp_size=settings.max_dp_size,
            max_cp_size=settings.max_cp_size,
            cpsat_max_sequences=settings.cpsat_max_sequences,
            cpsat_default_time_limit_s=settings.cpsat_default_time_limit_s,
            cpsat_max_time_limit_s=settings.cpsat_max_time_limit_s,
            max_plan_cells=settings.max_plan_cells,
            max_answer_bytes=settings.max_answer_bytes,
            max_feedback_cells=settings.max_feedback_cells,
        ),
    )


@router.post(
    "/profiles/reload",
    operation_id="reloadProfiles",
    dependencies=[Depends(require_api_token)],
    response_model=ProfilesReloaded,
    responses={401: UNAUTHORIZED_RESPONSE, 422: PROBLEM_RESPONSES[422]},
    summary="Read the profile folder again",
    description="Reads SKRULL_PROFILE_DIR again, whole or not at all: a bad file is a 422 naming it, and the "
    "profiles loaded before stay in use.",
)
async def reload_profiles(planner: PlannerDep, settings: SettingsDep) -> ProfilesReloaded:
    names = planner.reload_profiles()
    # The folder's name: answers never carry a server's file-system path.
    directory = None if settings.profile_dir is None else settings.profile_dir.name
    return ProfilesReloaded(directory=directory, profiles=names)


@router.post(
    "/feedback",
    operation_id="postFeedback",
    dependencies=[Depends(require_api_token)],
    response_model=FeedbackResponse,
    responses=FEEDBACK_PROBLEM_RESPONSES,
    summary="Report measured micro-batches of a job (opt-in)",
    description="A trainer that planned with a `job_id` reports what one step measured: per micro-batch the "
    "lengths per CP rank (and per hybrid group, `sharded_lengths`, each an aligned block of the job's CP ranks), "
    "the time, and the peak memory where known. The service refits the job's compute and "
    "memory coefficients robustly (outliers down-weighted, a bounded window) and uses them for the job's later "
    "plans, lowering their bucket_size when the peak nears the memory budget. A bad report is a 4xx and "
    "changes nothing.",
    openapi_extra=_request_body("FeedbackRequest"),
)
async def feedback(request: Request, planner: PlannerDep) -> FeedbackResponse:
    body = await request.body()
    return await planner.feedback(body, request.headers.get("content-type"), watch=ClientWatch(request.receive))


@router.get(
    "/feedback/{job_id}",
    operation_id="getJobFeedback",
    response_model=FeedbackResponse,
    responses={404: FEEDBACK_PROBLEM_RESPONSES[404]},
    summary="A job's refit state",
)
async def job_feedback(job_id: str, planner: PlannerDep) -> FeedbackResponse:
    return job_to_feedback_response(planner.job(job_id))


@router.get("/healthz", operation_id="healthz", response_model=HealthStatus,
            summary="Liveness: the process answers")
async def healthz() -> HealthStatus:
    return HealthStatus(status="ok")


@router.get(
    "/readyz",
    operation_id="readyz",
    response_model=HealthStatus,
    responses={503: PROBLEM_RESPONSES[503]},
    summary="Readiness: the planner is warmed up",
)
async def readyz(planner: PlannerDep) -> HealthStatus:
    if not planner.ready:
        raise ServiceUnavailableError("the planner is warming up")
    return HealthStatus(status="ready", checks={"planner": "ready", "cpsat": planner.cpsat_state})


@router.get(
    "/metrics",
    operation_id="metrics",
    response_class=Response,
    responses={200: {"description": "Prometheus text exposition.",
                     "content": {"text/plain": {"schema": {"type": "string"}}}}},
    summary="Prometheus metrics",
)
async def metrics(metrics: MetricsDep) -> Response:
    return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)
