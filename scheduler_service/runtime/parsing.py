"""Parsing request bodies into the wire models, cheaply and with bounded error reports.

Done here rather than by the web framework so that the service decides where
the work runs: a large ``/plan`` body is parsed in a worker thread and a large
``/feedback`` report in a pool process, never on the event loop (a 4 MB report
takes seconds to validate). Errors are
``RequestBodyError``s (pydantic's items, bounded) or ``RequestLimitError``s.
"""

from __future__ import annotations

from typing import Any, TypeVar

import pydantic_core
from pydantic import BaseModel, ValidationError
from skrull_proto import FeedbackRequest, JobProfileRequest, PlanRequest
from skrull_proto.advise import AdviseRequest

from scheduler_service.contract.profiles import MAX_PROFILE_FILE_BYTES
from scheduler_service.core.plan import PlanLimits, check_sequence_count, find_bad_length
from scheduler_service.runtime.errors import RequestBodyError, RequestLimitError, UnsupportedMediaTypeError

__all__ = [
    "check_json_media_type",
    "parse_advise_request",
    "parse_feedback_request",
    "parse_job_profile_request",
    "parse_plan_request",
]

ModelT = TypeVar("ModelT", bound=BaseModel)


def parse_plan_request(body: bytes, content_type: str | None, *, limits: PlanLimits) -> PlanRequest:
    """Parse POST /plan's body, refusing an over-long batch *before* validating its items (the core's
    ``check_sequence_count``): pydantic reports every bad item, and a 4 MB body of strings would cost seconds to
    describe. The lengths' values are the core's to check (``make_problem``, which names the first bad one); when
    other fields are bad too, the core's finding joins pydantic's, so that one answer names every bad field."""
    data = _json(body, content_type)
    lengths = data.get("sequence_lengths") if isinstance(data, dict) else None
    if isinstance(lengths, list):
        check_sequence_count(len(lengths), limits)
    try:
        return _validate(PlanRequest, data)
    except RequestBodyError as error:
        bad_length = find_bad_length(lengths, limits) if isinstance(lengths, list) and lengths else None
        if bad_length is None:
            raise
        item = {"type": "value_error", "loc": ("body", "sequence_lengths", bad_length.index),
                "msg": bad_length.message, "ctx": {"limit": bad_length.limit}}
        raise RequestBodyError([item, *error.errors], error.total + 1) from None


def parse_advise_request(body: bytes, content_type: str | None) -> AdviseRequest:
    """Parse POST /advise's body (the sample's size is bounded afterwards, from the parsed request)."""
    return _validate(AdviseRequest, _json(body, content_type))


def parse_feedback_request(body: bytes, content_type: str | None) -> FeedbackRequest:
    """Parse POST /feedback's body (its size was bounded by the caller's cost estimate)."""
    return _validate(FeedbackRequest, _json(body, content_type))


def parse_job_profile_request(body: bytes, content_type: str | None) -> JobProfileRequest:
    """Parse PUT /jobs/{job_id}/profile's body, refusing one larger than a profile file may be before reading it:
    the job store keeps the document with the job, and writes it again at every refit."""
    if len(body) > MAX_PROFILE_FILE_BYTES:
        raise RequestLimitError(f"the body holds {len(body)} bytes; a profile (as a profile file) holds at most "
                                f"{MAX_PROFILE_FILE_BYTES}", field="profile", limit=MAX_PROFILE_FILE_BYTES)
    return _validate(JobProfileRequest, _json(body, content_type))


def check_json_media_type(content_type: str | None) -> None:
    """A body sent as anything but JSON is a 415 (no Content-Type is taken as JSON)."""
    if content_type is not None:
        media_type = content_type.split(";", 1)[0].strip().lower()
        if media_type != "application/json" and not media_type.endswith("+json"):
            raise UnsupportedMediaTypeError(content_type)


def _json(body: bytes, content_type: str | None) -> Any:
    check_json_media_type(content_type)
    if not body.strip():
        raise RequestBodyError.malformed_json("the request body is empty; send a JSON object")
    try:
        return pydantic_core.from_json(body, allow_inf_nan=False)
    except ValueError as error:
        raise RequestBodyError.malformed_json(str(error)) from None


def _validate(model: type[ModelT], data: Any) -> ModelT:
    try:
        return model.model_validate(data)
    except ValidationError as error:
        items = error.errors(include_url=False, include_input=False)
        raise RequestBodyError([{**item, "loc": ("body", *item["loc"])} for item in items]) from None
