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
    "checkpointing mode allowed, and derives each one's BucketSize from the memory model and its longest trainable "
    "sequence: the world's capacity, bucket_size × cp_size × dp_size, where its plans may span DP replicas. A "
    "sequence longer than a layout trains (or than `max_length`) is left out or, with `truncate`, cut, as the "
    "trainer's --max-length and --truncate do. The layouts that lose the fewest sequences are priced, by planning "
    "seeded global batches drawn from the sample with skrull and static CP (deepspeed) on the same layout, each "
    "saying how many sequences and what share of the tokens it loses; the others are listed apart with the "
    "reason, so outliers no layout holds do not stop the advice. The answer ranks the priced layouts by predicted "
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
