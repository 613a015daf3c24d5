"""``GET /metrics``: the Prometheus exposition (``web.metrics``)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response

from scheduler_service.web.deps import MetricsDep
from scheduler_service.web.metrics import CONTENT_TYPE_LATEST

__all__ = ["router"]

router = APIRouter()


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
