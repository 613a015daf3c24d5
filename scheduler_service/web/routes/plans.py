"""``POST /plan``: one global batch planned."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response
from skrull_proto import PlanResponse, SchedulerName

from scheduler_service.runtime.service import PlanningService
from scheduler_service.web.disconnect import DisconnectWatch
from scheduler_service.web.middleware import SCHEDULER_SCOPE_KEY
from scheduler_service.web.openapi import JSON, json_request_body
from scheduler_service.web.problems import PROBLEM_RESPONSES

__all__ = ["router"]

router = APIRouter()


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
    openapi_extra=json_request_body("PlanRequest"),
)
async def plan(request: Request) -> Response:
    # The app's state read directly rather than through Depends: resolving dependencies costs more than the
    # rest of the route's own work, on the one route called once per training step.
    planner: PlanningService = request.app.state.planner

    def named(scheduler: SchedulerName) -> None:
        request.scope[SCHEDULER_SCOPE_KEY] = scheduler.value

    # The raw body: the planner parses, validates and places the work (``PlanningService.plan``).
    body = await planner.plan(await request.body(), request.headers.get("content-type"),
                              watch=DisconnectWatch(request.receive), named=named)
    # Already serialized where it was planned; returning a Response skips FastAPI's second validation pass.
    return Response(body, media_type=JSON)
