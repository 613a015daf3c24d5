"""The service's own failures, beside the core's (``core.errors``): raised by the runtime, mapped to HTTP by
``web.problems`` alone.

Every one but ``RequestLimitError`` (a limit the service configures, so one of the core's
``InvalidRequestError``s) is a ``ServiceError``: what its answer needs (the message, the field, the limit, the
seconds to wait) and nothing of HTTP, which ``web.problems`` maps by class in one handler. The two a pool process
can raise, ``RequestLimitError`` and ``RequestBodyError``, pickle, so they reach the caller as they were raised.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from scheduler_service.core.errors import InvalidRequestError, quoted

__all__ = [
    "MAX_BODY_ERRORS",
    "ClientDisconnectedError",
    "FeedbackDisabledError",
    "JobStoreUnavailableError",
    "RequestBodyError",
    "RequestLimitError",
    "ServiceBusyError",
    "ServiceError",
    "ServiceUnavailableError",
    "UnknownJobError",
    "UnsupportedMediaTypeError",
    "unavailable_job_state",
]

# A batch of bad lengths yields one error per item; the first few hundred say all there is to say (and pickling
# a million from a pool process would not be cheap).
MAX_BODY_ERRORS = 256


class ServiceError(Exception):
    """The root of the service's own failures (module docstring). ``field``: the request field at fault;
    ``limit``: the bound that applies; ``retry_after_s``: when to try again, where waiting helps."""

    def __init__(self, message: str, *, field: str | None = None, limit: int | float | None = None,
                 retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field
        self.limit = limit
        self.retry_after_s = retry_after_s


class RequestLimitError(InvalidRequestError):
    """A request exceeds a limit the service configures (the core's own limits say so in their message)."""

    def __init__(self, message: str, *, field: str, limit: int | float) -> None:
        super().__init__(message, field=field, limit=limit)


class RequestBodyError(ServiceError):
    """A body that is not JSON, or not the wire model: pydantic's error items, located from the body
    (``("body", "sequence_lengths", 3)``), at most ``MAX_BODY_ERRORS`` of them plus their total."""

    def __init__(self, errors: Sequence[Mapping[str, Any]], total: int | None = None) -> None:
        self.errors: list[Mapping[str, Any]] = list(errors[:MAX_BODY_ERRORS])
        self.total: int = len(errors) if total is None else total
        super().__init__(f"the body does not match the wire model ({self.total} errors)", field="body")

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.errors, self.total)

    @classmethod
    def malformed_json(cls, reason: str) -> RequestBodyError:
        return cls([{"type": "json_invalid", "loc": ("body",), "msg": "JSON decode error", "ctx": {"error": reason}}])


class UnsupportedMediaTypeError(ServiceError):
    def __init__(self, content_type: str) -> None:
        super().__init__(f"Content-Type {quoted(content_type)} is not JSON; send application/json", field="body")


class ClientDisconnectedError(ServiceError):
    """The client hung up before its answer was ready: the client's doing, not a server error."""

    def __init__(self, message: str = "the client hung up before its answer was ready") -> None:
        super().__init__(message)


class ServiceBusyError(ServiceError):
    """Admission control refused the request; the client should retry after ``retry_after_s``."""

    def __init__(self, message: str, *, retry_after_s: int, limit: int) -> None:
        super().__init__(message, limit=limit, retry_after_s=retry_after_s)


class ServiceUnavailableError(ServiceError):
    """The service cannot answer now (not ready, or a worker pool broke)."""

    def __init__(self, message: str, *, retry_after_s: int = 1) -> None:
        super().__init__(message, retry_after_s=retry_after_s)


class JobStoreUnavailableError(ServiceUnavailableError):
    """The job store failed a call (a corrupt or full file, a read-only folder, an unreachable server). Plans go on
    without the job's state; reports and reads of a job answer 503 until the store is back."""

    def __init__(self, reason: str, *, operation: str) -> None:
        super().__init__(f"the job store is unavailable: {reason}")
        self.reason = reason
        # the store's method that failed: get, keep, register, replace (or open, at the start)
        self.operation = operation

    @property
    def job_state(self) -> str:
        """What a plan answers as ``job_state`` when this failure kept it from the job's state."""
        return unavailable_job_state(self.reason)


def unavailable_job_state(reason: str) -> str:
    """A store's ``state`` (and a plan's ``job_state``) while its calls fail for ``reason``."""
    return f"unavailable: {reason}"


class UnknownJobError(ServiceError):
    """Feedback for a job the service does not know (never planned with its job_id, or forgotten)."""

    def __init__(self, job_id: str, *, max_jobs: int) -> None:
        super().__init__(f"unknown job {job_id!r}: send POST /plan with \"job_id\": {job_id!r} first (the "
                         f"service keeps the {max_jobs} most recently planned jobs)", field="job_id", limit=max_jobs)


class FeedbackDisabledError(ServiceError):
    def __init__(self) -> None:
        super().__init__("feedback is disabled on this service (SKRULL_FEEDBACK=false)")
