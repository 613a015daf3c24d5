"""Errors → HTTP: the one module that maps failures (the core's, the runtime's, the web layer's) to RFC 9457
problem+json.

    400 malformed-json          the body is not JSON (or is empty)
    401 unauthorized            UnauthorizedError: SKRULL_API_TOKEN is set and POST /feedback,
                                PUT /jobs/{job_id}/profile or POST /profiles/reload came without it
                                (WWW-Authenticate: Bearer)
    413 body-too-large          the body exceeds ``max_body_bytes`` (BodySizeLimitMiddleware)
    415 unsupported-media-type  a Content-Type other than JSON
    422 invalid-request         wrong types, missing or extra fields, out-of-range values
                                (pydantic: RequestBodyError, RequestValidationError), RequestLimitError
                                (a configured limit), and the core's InvalidRequestError family
                                (Unknown{Model,Scheduler,Profile}Error)
    422 sequence-too-long       SequenceTooLongError: longer than bucket_size × cp_size
    422 infeasible-plan         InfeasiblePlanError: no plan honours the memory bound
    404 unknown-job             UnknownJobError: POST /feedback for a job no POST /plan named
    404 feedback-disabled       FeedbackDisabledError: the service runs with SKRULL_FEEDBACK=false
    408 body-timeout            the body did not arrive within ``body_timeout_s`` (BodySizeLimitMiddleware)
    429 busy                    ServiceBusyError: the cpsat or heavy pool and its queue are full, or a job's
                                report arrived while its last is being refit (Retry-After)
    499 (no body)               ClientDisconnectedError: the client hung up before its answer (logged and
                                counted as 499, never as a server error; nobody reads the answer)
    503 unavailable             ServiceUnavailableError: not ready, or a pool broke; JobStoreUnavailableError:
                                the job store failed a report, a registration or a read of a job (Retry-After;
                                /plan plans on)
    500 plan-check-failed       PlanCheckError: a scheduler produced an invalid plan (a bug, never bad input)
    500 internal-error          anything else (a bug); logged with its traceback (RequestContextMiddleware)
    4xx from Starlette          404, 405: the same body shape, type about:blank

Every body names the offending ``field`` (a path such as ``sequence_lengths[17]``)
and the ``limit`` where one applies, and carries the request id. No body carries
a file-system path, a stack trace or a setting's value beyond the limits; values
echoed back are cut to a short prefix, and every text to ``MAX_DETAIL_CHARS``.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from skrull_proto import FieldError, Problem
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from scheduler_service.core.errors import (
    InfeasiblePlanError,
    InvalidRequestError,
    PlanCheckError,
    PlanningError,
    SequenceTooLongError,
)
from scheduler_service.runtime.errors import (
    MAX_BODY_ERRORS,
    ClientDisconnectedError,
    FeedbackDisabledError,
    RequestBodyError,
    ServiceBusyError,
    ServiceError,
    ServiceUnavailableError,
    UnknownJobError,
    UnsupportedMediaTypeError,
)
from scheduler_service.runtime.logging_setup import current_request_id
from scheduler_service.web.auth import UnauthorizedError

__all__ = [
    "CLIENT_CLOSED_REQUEST",
    "FEEDBACK_PROBLEM_RESPONSES",
    "JOB_PROFILE_PROBLEM_RESPONSES",
    "MAX_DETAIL_CHARS",
    "PROBLEM_MEDIA_TYPE",
    "PROBLEM_RESPONSES",
    "UNAUTHORIZED_RESPONSE",
    "install_problem_handlers",
    "internal_error_response",
    "problem_response",
    "validation_field_path",
]

PROBLEM_MEDIA_TYPE = "application/problem+json"
_TYPE_PREFIX = "urn:skrull:problem:"
CLIENT_CLOSED_REQUEST = 499  # nginx's code for a client that closed the connection before the answer
MAX_DETAIL_CHARS = 2000  # every message is far shorter; a longer one echoes something it should not

logger = logging.getLogger("scheduler_service.web.problems")


def _problem_schema(description: str) -> dict[str, Any]:
    return {
        "description": description,
        "content": {PROBLEM_MEDIA_TYPE: {"schema": {"$ref": "#/components/schemas/Problem"}}},
    }


# OpenAPI ``responses`` for the routes; the Problem schema itself is added by ``openapi.openapi_document``.
PROBLEM_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: _problem_schema("Malformed JSON."),
    413: _problem_schema("Request body larger than the configured limit."),
    415: _problem_schema("The body is not sent as application/json."),
    422: _problem_schema("Invalid request: the body names the field (or index) and the limit."),
    429: _problem_schema("The heavy or cpsat pool and its queue are full; retry after the Retry-After header's "
                         "seconds."),
    500: _problem_schema("Internal error (a bug; never caused by bad input)."),
    503: _problem_schema("Not ready yet, or a process pool broke (heavy or cpsat)."),
}


UNAUTHORIZED_RESPONSE = _problem_schema("The service sets SKRULL_API_TOKEN and the request did not send it as "
                                        "Authorization: Bearer <token> (WWW-Authenticate: Bearer).")

FEEDBACK_PROBLEM_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: PROBLEM_RESPONSES[400],
    401: UNAUTHORIZED_RESPONSE,
    404: _problem_schema("Unknown job (no POST /plan named it, or it was forgotten), or feedback disabled."),
    413: PROBLEM_RESPONSES[413],
    422: _problem_schema("Invalid report (negative or absurd times or memory, wrong cp lists, a hybrid group that "
                         "is not an aligned block of CP ranks): the body names the field and the limit; the job's "
                         "profile is left unchanged."),
    500: PROBLEM_RESPONSES[500],
    503: _problem_schema("The job store is unavailable: retry after the Retry-After header's seconds. A report "
                         "refused so changed nothing."),
}

JOB_PROFILE_PROBLEM_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: PROBLEM_RESPONSES[400],
    401: UNAUTHORIZED_RESPONSE,
    404: _problem_schema("Feedback disabled: the service keeps no job, so no profile of one."),
    413: PROBLEM_RESPONSES[413],
    415: PROBLEM_RESPONSES[415],
    422: _problem_schema("Invalid registration (a profile document the format refuses, a value out of its range, a "
                         "profile measured for another model than the job's, a name a shared profile has with other "
                         "numbers, a bad job_id or model): the body names the field; the job is left unchanged."),
    500: PROBLEM_RESPONSES[500],
    503: _problem_schema("The job store is unavailable: retry after the Retry-After header's seconds. A "
                         "registration refused so changed nothing."),
}


def problem_response(
    status: int,
    detail: str,
    *,
    problem_type: str | None = None,
    title: str | None = None,
    field: str | None = None,
    limit: int | float | None = None,
    errors: Sequence[FieldError] = (),
    headers: Mapping[str, str] | None = None,
) -> Response:
    problem = Problem(
        type=_TYPE_PREFIX + problem_type if problem_type else "about:blank",
        title=title or HTTPStatus(status).phrase,
        status=status,
        detail=_clip(detail),
        field=field,
        limit=limit,
        errors=[FieldError(field=_clip(e.field), message=_clip(e.message)) for e in errors],
        request_id=current_request_id(),
    )
    body = problem.model_dump_json(exclude_none=True).encode()
    return Response(body, status_code=status, media_type=PROBLEM_MEDIA_TYPE, headers=dict(headers or {}))


def _clip(text: str) -> str:
    return text if len(text) <= MAX_DETAIL_CHARS else text[:MAX_DETAIL_CHARS] + f"… ({len(text)} characters)"


# pydantic puts union members' tags (``str``, ``ModelSpec``, ``constrained-float``) into error locations;
# they are not request fields. Field names are snake_case, so anything else is a tag.
_FIELD_NAME = re.compile(r"[a-z_][a-z0-9_]*")
_UNION_TAGS = frozenset({"str", "int", "float", "bool", "none", "list", "dict"})


def validation_field_path(location: Iterable[int | str]) -> str:
    """``("body", "sequence_lengths", 3)`` → ``sequence_lengths[3]``; the whole body is ``body``."""
    parts = list(location)
    if parts and parts[0] == "body":
        parts = parts[1:]
    path = ""
    for part in parts:
        if isinstance(part, int):
            path += f"[{part}]"
        elif _FIELD_NAME.fullmatch(part) and part not in _UNION_TAGS:
            path += f".{part}" if path else part
    return path or "body"


def _limit_from_context(context: Mapping[str, Any] | None) -> int | float | None:
    for key in ("limit", "ge", "gt", "le", "lt", "min_length", "max_length"):  # limit: the core's (parsing.py)
        value = (context or {}).get(key)
        if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
            return value
    return None


_MAX_ERRORS_LISTED = 50


async def _on_validation_error(request: Request, error: Exception) -> Response:
    """A bad path or query parameter (FastAPI's ``RequestValidationError``)."""
    assert isinstance(error, RequestValidationError)
    return _validation_problem(list(error.errors())[:MAX_BODY_ERRORS], len(error.errors()))


def _validation_problem(details: Sequence[Mapping[str, Any]], total: int) -> Response:
    """pydantic's error items (``total`` of them, ``details`` the first few) as one 422 naming the first fields, or
    the 400 of a body that is not JSON."""
    for item in details:
        if item.get("type") == "json_invalid":
            reason = (item.get("ctx") or {}).get("error", item.get("msg", "JSON decode error"))
            return problem_response(400, f"request body is not valid JSON: {reason}",
                                    problem_type="malformed-json", title="Malformed JSON", field="body")
    field_errors: list[FieldError] = []
    for item in details:
        message = str(item.get("msg", "invalid"))
        if item.get("type") in ("model_attributes_type", "dict_type", "model_type") and tuple(item["loc"]) == ("body",):
            message = "the request body must be a JSON object sent as Content-Type: application/json"
        elif item.get("type") == "missing" and tuple(item["loc"]) == ("body",):
            message = "the request body is empty; send a JSON object as Content-Type: application/json"
        field_errors.append(FieldError(field=validation_field_path(item.get("loc", ())), message=message))
    # One error per field is enough to act on; keep the first of each, in order. An error on a field whose
    # members also failed is a union's other branch (``model`` is a name *or* a ModelSpec): the deeper one
    # says what to fix.
    unique: dict[str, FieldError] = {}
    for field_error in field_errors:
        unique.setdefault(field_error.field, field_error)
    parents = {parent for field in unique for parent in _parents(field)}
    shown = [field_error for field, field_error in unique.items() if field not in parents]
    num_more = total - len(details) + len(shown) - min(len(shown), 5)
    detail = "; ".join(f"{e.field}: {e.message}" for e in shown[:5])
    if num_more:
        detail += f" (and {num_more} more)"
    return problem_response(422, detail, problem_type="invalid-request", title="Invalid request",
                            field=shown[0].field if shown else "body",
                            limit=_limit_from_context(_first_context(details, shown)),
                            errors=shown[:_MAX_ERRORS_LISTED])


def _parents(path: str) -> list[str]:
    """``model.hidden_size`` → ``[model]``; ``a.b[3]`` → ``[a.b, a]``."""
    parents = []
    while (cut := max(path.rfind("."), path.rfind("["))) > 0:
        path = path[:cut]
        parents.append(path)
    return parents


def _first_context(details: Sequence[Mapping[str, Any]], shown: Sequence[FieldError]) -> Mapping[str, Any] | None:
    """The pydantic context (which holds the bound) of the error reported first."""
    for item in details:
        if shown and validation_field_path(item.get("loc", ())) == shown[0].field:
            context: Mapping[str, Any] | None = item.get("ctx")
            return context
    return None


async def _on_planning_error(request: Request, error: Exception) -> Response:
    assert isinstance(error, PlanningError)
    field_errors = [FieldError(field=error.field, message=error.message)] if error.field else []
    if isinstance(error, PlanCheckError):
        # Every scheduler's plan is checked before it leaves the core; a failure is our bug, not the client's.
        logger.error("plan check failed", extra={"violations": error.violations[:20]})
        return problem_response(500, error.message, problem_type="plan-check-failed", title="Plan check failed")
    if isinstance(error, InfeasiblePlanError):
        return problem_response(422, error.message, problem_type="infeasible-plan", title="Infeasible plan",
                                field=error.field, errors=field_errors)
    problem_type = "sequence-too-long" if isinstance(error, SequenceTooLongError) else "invalid-request"
    assert isinstance(error, InvalidRequestError), f"unmapped planning error {type(error).__name__}"
    return problem_response(422, error.message, problem_type=problem_type, title="Invalid request",
                            field=error.field, limit=error.limit, errors=field_errors)


# The runtime's failures (``ServiceError``), each class's status, problem type and title; a subclass not listed
# answers as its nearest listed base (``JobStoreUnavailableError`` as ``ServiceUnavailableError``).
_SERVICE_PROBLEMS: dict[type[ServiceError], tuple[int, str, str | None]] = {
    UnsupportedMediaTypeError: (415, "unsupported-media-type", None),
    UnknownJobError: (404, "unknown-job", "Unknown job"),
    FeedbackDisabledError: (404, "feedback-disabled", "Feedback disabled"),
    ServiceBusyError: (429, "busy", None),
    ServiceUnavailableError: (503, "unavailable", None),
}


async def _on_service_error(request: Request, error: Exception) -> Response:
    """Every ``ServiceError``: a body the wire model refused as pydantic's items are answered; a client that hung
    up gets 499 without a body (nobody reads it: its status is what the log and the metrics record); the others
    by ``_SERVICE_PROBLEMS``, with Retry-After where waiting helps."""
    assert isinstance(error, ServiceError)
    if isinstance(error, RequestBodyError):
        return _validation_problem(error.errors, error.total)
    if isinstance(error, ClientDisconnectedError):
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    status, problem_type, title = next(_SERVICE_PROBLEMS[kind] for kind in type(error).__mro__
                                       if kind in _SERVICE_PROBLEMS)
    headers = {"Retry-After": str(error.retry_after_s)} if error.retry_after_s is not None else None
    return problem_response(status, error.message, problem_type=problem_type, title=title, field=error.field,
                            limit=error.limit, headers=headers)


async def _on_unauthorized(request: Request, error: Exception) -> Response:
    assert isinstance(error, UnauthorizedError)
    # RFC 6750: a request without credentials gets the bare challenge; a wrong token, the error code too.
    challenge = 'Bearer error="invalid_token"' if error.token_given else "Bearer"
    return problem_response(401, error.message, problem_type="unauthorized", title="Unauthorized",
                            headers={"WWW-Authenticate": challenge})


async def _on_http_exception(request: Request, error: Exception) -> Response:
    assert isinstance(error, StarletteHTTPException)
    detail = error.detail if isinstance(error.detail, str) else json.dumps(error.detail)
    if error.status_code == 404:
        detail = f"no route {request.url.path}; see /openapi.json"
    headers = dict(error.headers or {})
    if error.status_code == 405:
        headers.setdefault("Allow", ", ".join(_allowed_methods(request)))
    return problem_response(error.status_code, detail, headers=headers)


def _allowed_methods(request: Request) -> list[str]:
    route = request.scope.get("route")
    methods = getattr(route, "methods", None) or set()
    return sorted(methods)


def internal_error_response() -> Response:
    """The 500 the request middleware sends for an unhandled exception (already logged there)."""
    return problem_response(500, "internal error; the service log has the traceback under this request id",
                            problem_type="internal-error")


def install_problem_handlers(app: FastAPI) -> None:
    """One handler per family of failures: FastAPI's validation, the core's, the runtime's, the web layer's."""
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(PlanningError, _on_planning_error)
    app.add_exception_handler(ServiceError, _on_service_error)
    app.add_exception_handler(UnauthorizedError, _on_unauthorized)
    app.add_exception_handler(StarletteHTTPException, _on_http_exception)
