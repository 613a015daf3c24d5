"""``GET /healthz`` and ``GET /readyz``: the probes a kubelet (or compose) asks."""

from __future__ import annotations

from fastapi import APIRouter
from skrull_proto import HealthStatus

from scheduler_service.runtime.errors import ServiceUnavailableError
from scheduler_service.web.deps import PlannerDep
from scheduler_service.web.problems import PROBLEM_RESPONSES

__all__ = ["router"]

router = APIRouter()


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
    description="Ready once the planner is warmed up. `checks` names each component's state; `job_store` is "
    "`ok`, or `unavailable: <reason>` while the job store fails (as of its last use): plans go on without "
    "feedback then, so the service stays ready.",
)
async def readyz(planner: PlannerDep) -> HealthStatus:
    if not planner.ready:
        raise ServiceUnavailableError("the planner is warming up")
    return HealthStatus(status="ready", checks={"planner": "ready", "cpsat": planner.cpsat_state,
                                                "job_store": planner.jobs.state})
