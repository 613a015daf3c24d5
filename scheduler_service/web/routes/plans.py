"""``POST /plan``: one global batch planned."""

from __future__ import annotations

import functools

import anyio.to_thread
from fastapi import APIRouter, Request
from fastapi.responses import Response
from skrull_proto import PlanResponse

from scheduler_service.runtime.parsing import parse_plan_request
from scheduler_service.runtime.service import PlanningService
from scheduler_service.runtime.settings import Settings
from scheduler_service.web.disconnect import DisconnectWatch
from scheduler_service.web.middleware import SCHEDULER_SCOPE_KEY
from scheduler_service.web.openapi import JSON, json_request_body
from scheduler_service.web.problems import PROBLEM_RESPONSES

__all__ = ["router"]

router = APIRouter()

# Bodies up to this size (about 10,000 sequences) are parsed on the event loop; larger ones in a thread.
_INLINE_MAX_BODY_BYTES = 64 << 10


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
    batch = await planner.plan(body, watch=DisconnectWatch(request.receive))
    # Already serialized where it was planned; returning a Response skips FastAPI's second validation pass.
    return Response(batch.body, media_type=JSON)
