"""``POST /advise``: the layouts of a GPU count ranked for a sample of sequence lengths."""

from __future__ import annotations

import functools

import anyio.to_thread
from fastapi import APIRouter, Request
from fastapi.responses import Response
from skrull_proto.advise import AdviceDocument

from scheduler_service.runtime.parsing import parse_advise_request
from scheduler_service.runtime.service import PlanningService
from scheduler_service.web.disconnect import DisconnectWatch
from scheduler_service.web.openapi import JSON, json_request_body
from scheduler_service.web.problems import PROBLEM_RESPONSES

__all__ = ["router"]

router = APIRouter()


@router.post(
    "/advise",
    operation_id="advise",
    response_model=AdviceDocument,
    responses=PROBLEM_RESPONSES,
    summary="Rank the parallel layouts of a GPU count for a sample of sequence lengths",
    description="Enumerates dp_size × cp_size = gpus for every CP degree, sharding mode and activation "
    "checkpointing mode allowed, derives each one's BucketSize from the memory model, lists apart those that "
    "cannot hold the sample (with the reason), and prices the rest by planning seeded global batches drawn from "
    "the sample with skrull and static CP (deepspeed) on the same layout. The answer ranks them by predicted "
    "tokens/s per GPU and is the document `skrull-advise --json` writes. Its work is estimated from the "
    "request's shape first (422 over the service's limit) and done in the heavy pool (429 with Retry-After "
    "when full).",
    openapi_extra=json_request_body("AdviseRequest"),
)
async def advise(request: Request) -> Response:
    planner: PlanningService = request.app.state.planner
    raw = await request.body()
    body = await anyio.to_thread.run_sync(
        functools.partial(parse_advise_request, raw, request.headers.get("content-type")))
    document = await planner.advise(body, watch=DisconnectWatch(request.receive))
    return Response(document, media_type=JSON)
