"""The HTTP routes: thin wrappers over ``PlanningService``, the catalogue and the metrics.

Routes parse (FastAPI + ``skrull_proto``), call one function and answer;
errors are raised, never formatted here (``problems`` maps them to HTTP).
"""

from __future__ import annotations

import functools
from typing import Annotated

import anyio.to_thread
from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from skrull_proto import (
    HealthStatus,
    ModelSpec,
    ModelsResponse,
    PlanRequest,
    PlanResponse,
    ProfileSummary,
    SchedulerName,
    ServiceLimits,
)

from scheduler_service.core.models import MODEL_CATALOGUE
from scheduler_service.core.profile import DEFAULT_PROFILE, builtin_profiles
from scheduler_service.metrics import CONTENT_TYPE_LATEST, ServiceMetrics
from scheduler_service.middleware import SCHEDULER_SCOPE_KEY
from scheduler_service.parsing import parse_plan_request
from scheduler_service.planning import PlanningService
from scheduler_service.problems import PROBLEM_RESPONSES, ServiceUnavailableError
from scheduler_service.settings import Settings

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


_PLAN_REQUEST_BODY = {
    "required": True,
    "content": {_JSON: {"schema": {"$ref": "#/components/schemas/PlanRequest"}}},
}


@router.post(
    "/plan",
    response_model=PlanResponse,
    responses=PROBLEM_RESPONSES,
    summary="Plan one global batch",
    description="Schedules the batch with the chosen scheduler (GDS + DACP for `skrull`) and returns the plan "
    "with its estimated iteration time beside the deepspeed baseline's. Deterministic: the same request gives "
    "the same plan. `cpsat` runs in a bounded process pool (429 with Retry-After when full).",
    openapi_extra={"requestBody": _PLAN_REQUEST_BODY},
)
async def plan(request: Request, planner: PlannerDep, settings: SettingsDep) -> Response:
    raw = await request.body()
    content_type = request.headers.get("content-type")
    if len(raw) <= _INLINE_MAX_BODY_BYTES:
        body = parse_plan_request(raw, content_type, max_sequences=settings.max_sequences)
    else:  # parsing (or describing the errors of) a huge batch must not stall the event loop
        body = await anyio.to_thread.run_sync(
            functools.partial(parse_plan_request, raw, content_type, max_sequences=settings.max_sequences)
        )
    request.scope[SCHEDULER_SCOPE_KEY] = body.scheduler.value
    batch = await planner.plan(body)
    # Already serialized where it was planned; returning a Response skips FastAPI's second validation pass.
    return Response(batch.body, media_type=_JSON)


@router.get("/models", response_model=ModelsResponse, summary="Known models, profiles, schedulers and limits")
async def models(settings: SettingsDep) -> ModelsResponse:
    return ModelsResponse(
        models=[ModelSpec.model_validate(_shape_fields(shape)) for shape in MODEL_CATALOGUE.values()],
        profiles=[
            ProfileSummary(name=profile.name, description=profile.description, device=profile.device,
                           device_memory_bytes=profile.device_memory_bytes, model=profile.model)
            for profile in builtin_profiles().values()
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
        ),
    )


def _shape_fields(shape: object) -> dict[str, object]:
    return {name: getattr(shape, name) for name in ModelSpec.model_fields}


@router.get("/healthz", response_model=HealthStatus, summary="Liveness: the process answers")
async def healthz() -> HealthStatus:
    return HealthStatus(status="ok")


@router.get(
    "/readyz",
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
    response_class=Response,
    responses={200: {"description": "Prometheus text exposition.",
                     "content": {"text/plain": {"schema": {"type": "string"}}}}},
    summary="Prometheus metrics",
)
async def metrics(metrics: MetricsDep) -> Response:
    return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)
