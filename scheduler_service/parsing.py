"""Parsing POST /plan's body into the wire model, cheaply and with bounded error reports."""

from __future__ import annotations

import pydantic_core
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from skrull_proto import PlanRequest

from scheduler_service.problems import RequestLimitError, UnsupportedMediaTypeError

__all__ = ["parse_plan_request"]


def parse_plan_request(body: bytes, content_type: str | None, *, max_sequences: int) -> PlanRequest:
    """Parse POST /plan's body, refusing an over-long batch *before* validating its items.

    Done here rather than by FastAPI's body parameter because pydantic reports
    every bad item: a 4 MB body of negative lengths would cost seconds of
    event-loop time to describe. Counting first bounds that by ``max_sequences``.
    """
    if content_type is not None:
        media_type = content_type.split(";", 1)[0].strip().lower()
        if media_type != "application/json" and not media_type.endswith("+json"):
            raise UnsupportedMediaTypeError(content_type)
    if not body.strip():
        raise _json_error("the request body is empty; send a JSON object")
    try:
        data = pydantic_core.from_json(body, allow_inf_nan=False)
    except ValueError as error:
        raise _json_error(str(error)) from None
    lengths = data.get("sequence_lengths") if isinstance(data, dict) else None
    if isinstance(lengths, list) and len(lengths) > max_sequences:
        raise RequestLimitError(
            f"sequence_lengths has {len(lengths)} sequences; at most {max_sequences} are accepted",
            field="sequence_lengths", limit=max_sequences,
        )
    try:
        return PlanRequest.model_validate(data)
    except ValidationError as error:
        raise RequestValidationError(
            [{**item, "loc": ("body", *item["loc"])} for item in error.errors(include_url=False, include_input=False)]
        ) from None


def _json_error(reason: str) -> RequestValidationError:
    return RequestValidationError(
        [{"type": "json_invalid", "loc": ("body",), "msg": "JSON decode error", "ctx": {"error": reason}}]
    )
