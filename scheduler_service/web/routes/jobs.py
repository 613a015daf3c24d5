"""``PUT /jobs/{job_id}/profile``: the profile a trainer measured, registered as its job's base profile."""

from __future__ import annotations

import functools
from typing import Annotated

import anyio.to_thread
from fastapi import APIRouter, Depends, Path, Request
from skrull_proto import FeedbackResponse, JobId

from scheduler_service.contract.profiles import MAX_PROFILE_FILE_BYTES
from scheduler_service.runtime.parsing import parse_job_profile_request
from scheduler_service.web.auth import require_api_token
from scheduler_service.web.deps import PlannerDep
from scheduler_service.web.openapi import json_request_body
from scheduler_service.web.problems import JOB_PROFILE_PROBLEM_RESPONSES

__all__ = ["router"]

router = APIRouter()


@router.put(
    "/jobs/{job_id}/profile",
    operation_id="putJobProfile",
    dependencies=[Depends(require_api_token)],
    response_model=FeedbackResponse,
    responses=JOB_PROFILE_PROBLEM_RESPONSES,
    summary="Register the profile a trainer measured as its job's base profile",
    description="A trainer that plans with a profile of its own (a file the profiler wrote) registers it for its "
    "job before the job's first plan: the body is the profile document and the job's model, dp_size and cp_size, "
    "as its POST /plan requests give them. Then the job's plans that name this profile (or none) plan with it, "
    "and POST /feedback refits start from it. The profile is the job's alone: GET /models never lists it, and it "
    "is forgotten with the job. The same document for the same job again changes nothing; another restarts the "
    "job's refit from it. A document the format refuses, a profile measured for another model, a name a shared "
    f"profile already has (with other numbers), or a body over {MAX_PROFILE_FILE_BYTES} bytes is a 4xx naming the "
    "field, and changes nothing. Answers the job's state.",
    openapi_extra=json_request_body("JobProfileRequest"),
)
async def put_job_profile(
    job_id: Annotated[JobId, Path(description="The job_id its POST /plan requests carry.")],
    request: Request,
    planner: PlannerDep,
) -> FeedbackResponse:
    raw = await request.body()
    # A profile is a few KiB, but a body up to the service's limit would stall the event loop while it is parsed.
    body = await anyio.to_thread.run_sync(
        functools.partial(parse_job_profile_request, raw, request.headers.get("content-type")))
    return await planner.register_profile(job_id, body)
