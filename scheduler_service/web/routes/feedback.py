"""``POST /feedback`` and ``GET /feedback/{job_id}``: a job's measured micro-batches, and its refit state."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from skrull_proto import FeedbackResponse

from scheduler_service.contract.wire import job_to_feedback_response
from scheduler_service.web.auth import require_api_token
from scheduler_service.web.deps import PlannerDep
from scheduler_service.web.disconnect import DisconnectWatch
from scheduler_service.web.openapi import json_request_body
from scheduler_service.web.problems import FEEDBACK_PROBLEM_RESPONSES

__all__ = ["router"]

router = APIRouter()


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
    openapi_extra=json_request_body("FeedbackRequest"),
)
async def feedback(request: Request, planner: PlannerDep) -> FeedbackResponse:
    body = await request.body()
    return await planner.feedback(body, request.headers.get("content-type"),
                                  watch=DisconnectWatch(request.receive))


@router.get(
    "/feedback/{job_id}",
    operation_id="getJobFeedback",
    response_model=FeedbackResponse,
    responses={404: FEEDBACK_PROBLEM_RESPONSES[404], 503: FEEDBACK_PROBLEM_RESPONSES[503]},
    summary="A job's refit state",
)
async def job_feedback(job_id: str, planner: PlannerDep) -> FeedbackResponse:
    return job_to_feedback_response(await planner.job(job_id))
