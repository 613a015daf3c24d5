"""The scheduler service over HTTP, as the trainer speaks to it: ``PlanClient``.

``PlanClient`` speaks the wire contract (``skrull_proto``) with httpx: a timeout
per read, bounded retries (tenacity) on transport errors, timeouts, 408, 429
and 5xx, waiting the answer's Retry-After where it has one and exponential
backoff otherwise, both with jitter; any other 4xx is final; and a total deadline per fetch (all
attempts together), which httpx's timeouts alone do not give: they bound each
read, so a server that trickles its answer a few bytes at a time would hold
rank 0 forever. At the deadline the connection's socket is shut down and the
fetch fails with ``PlanTimeout`` (so the step plans with the embedded core). Its errors, the contract of the
plan source's fallback (``planning.source``: what it plans around, and what it reports):

    PlanClientError (Exception)
    ├── PlanUnavailable   no usable answer: connection refused/reset, 5xx, 429, 408 (after every retry)
    │   └── PlanTimeout   no answer within the timeout (after every retry)
    └── PlanRejected      the service answered, but not with a usable plan: a 4xx (problem+json detail
                          quoted), a body that is not a PlanResponse, or a plan that fails the checker

``PlanClient`` also registers a job's profile (``PUT /jobs/{job_id}/profile``), retried as a plan is (a PUT
changes nothing when repeated), and sends a step's report once (``POST /feedback``).
"""


from __future__ import annotations

import contextlib
import math
import os
import random
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import httpx
from pydantic import ValidationError
from skrull_proto import (
    FeedbackRequest,
    FeedbackResponse,
    JobProfileRequest,
    PlanRequest,
    PlanResponse,
)
from tenacity import (
    RetryCallState,
    RetryError,
    Retrying,
    retry_if_exception_type,
    stop_after_attempt,
    stop_before_delay,
)

from trainer_client.config_choices import DEFAULT_PLAN_ATTEMPTS, DEFAULT_PLAN_TIMEOUT_S

__all__ = ["PlanClient", "PlanClientError", "PlanRejected", "PlanTimeout", "PlanUnavailable"]


# Transient answers worth another attempt: a body the service stopped waiting for (408), busy (429), failing (5xx).
_RETRIED_STATUS = frozenset({408, 429, 500, 502, 503, 504})
_JITTER = 0.25  # a retry waits up to this fraction longer than its delay, at random


def _retry_after_s(response: httpx.Response) -> float | None:
    """The Retry-After header in seconds (the service sends seconds; an HTTP date is ignored: backoff applies)."""
    try:
        seconds = float(response.headers.get("retry-after", ""))
    except ValueError:
        return None
    return seconds if math.isfinite(seconds) and seconds >= 0 else None


class PlanClientError(Exception):
    """Base class: the service gave no plan the trainer can use."""


class PlanUnavailable(PlanClientError):
    """The service could not be reached or kept failing (connection errors, 5xx, 429)."""

    def __init__(self, message: str, *, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s  # the answer's Retry-After, where it had one


class PlanTimeout(PlanUnavailable):
    """The service did not answer within the timeout."""


class PlanRejected(PlanClientError):
    """The service answered with an error for this request, or with a plan that is not valid."""


Answer = TypeVar("Answer", PlanResponse, FeedbackResponse)


def _parsed(response: httpx.Response, answer: type[Answer], request: str) -> Answer:
    """The service's answer to ``request`` as its model; ``PlanRejected`` (final) for a body that is not one."""
    try:
        return answer.model_validate_json(response.content)
    except ValidationError as error:
        raise PlanRejected(f"{request} answered a body that is not a {answer.__name__}: "
                           f"{error.error_count()} errors, first: {error.errors()[0]['msg']}") from None


def _problem_detail(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:200]
    if isinstance(body, dict):
        detail = body.get("detail") or body.get("title")
        where = f" ({body['field']})" if body.get("field") else ""
        return f"{detail}{where}"
    return str(body)[:200]


class _Deadline:
    """Shuts down the sockets of one request's connections at its deadline (from a timer thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self.expired = False

    def trace(self, event: str, info: dict[str, Any]) -> None:
        """httpcore's ``trace`` extension: learns each connection's socket as it opens."""
        if event != "connection.connect_tcp.complete" or info.get("return_value") is None:
            return
        sock = info["return_value"].get_extra_info("socket")
        if sock is None:
            return
        with self._lock:
            self._sockets.append(sock)
            if self.expired:  # opened after the deadline passed
                _shut(sock)

    def expire(self) -> None:
        with self._lock:
            self.expired = True
            for sock in self._sockets:
                _shut(sock)


def _shut(sock: socket.socket) -> None:
    """Wake a read blocked on ``sock`` (closing it from another thread would not)."""
    with contextlib.suppress(OSError):  # already closed
        sock.shutdown(socket.SHUT_RDWR)


class PlanClient:
    """POST /plan with a timeout per read, bounded retries and a total deadline per fetch; ``client`` may be
    injected (e.g. Starlette's TestClient, whose in-process transport no deadline can interrupt)."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float = DEFAULT_PLAN_TIMEOUT_S,
        max_attempts: int = DEFAULT_PLAN_ATTEMPTS,
        backoff_s: float = 0.1,
        deadline_s: float | None = None,
        client: httpx.Client | None = None,
        api_token: str | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        """``deadline_s``: the most one fetch (every attempt and backoff) may take; ``timeout_s`` × attempts when
        absent. ``api_token``: sent as ``Authorization: Bearer`` (a shared service asks for it on /feedback);
        ``SKRULL_API_TOKEN`` from the environment when absent, as the service reads it. ``sleep``: how a retry
        waits its delay (injectable, so the wait asked for can be checked without a clock)."""
        if timeout_s <= 0:
            raise ValueError(f"plan timeout must be positive, got {timeout_s}")
        if deadline_s is not None and deadline_s <= 0:
            raise ValueError(f"plan deadline must be positive, got {deadline_s}")
        if max_attempts < 1:
            raise ValueError(f"plan attempts must be at least 1, got {max_attempts}")
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"scheduler URL {base_url!r} must start with http:// or https://")
        self.base_url = base_url
        self.max_attempts = max_attempts
        self.backoff_s = backoff_s
        self._sleep = sleep
        self.deadline_s = deadline_s if deadline_s is not None else timeout_s * max_attempts
        token = api_token if api_token is not None else os.environ.get("SKRULL_API_TOKEN")
        self._headers = {"content-type": "application/json", **({"authorization": f"Bearer {token}"} if token else {})}
        self._owns_client = client is None
        # No idle connection is kept: every request opens its own, so the deadline learns its socket.
        self._client = client or httpx.Client(base_url=base_url, timeout=timeout_s,
                                              limits=httpx.Limits(max_keepalive_connections=0))

    def close(self) -> None:
        if self._owns_client:
            self._client.close()

    def ready(self) -> bool:
        """One quick GET /readyz; False on any transport error or non-200."""
        try:
            return self._client.get("/readyz").status_code == 200
        except httpx.HTTPError:
            return False

    def _send(self, method: str, path: str, body: str, deadline: float) -> httpx.Response:
        """Send ``body`` and read the whole answer before ``deadline`` (``time.monotonic``), else PlanTimeout."""
        remaining_s = deadline - time.monotonic()
        if remaining_s <= 0:
            raise PlanTimeout(f"{method} {self.base_url}{path} timed out: it passed its deadline of "
                              f"{self.deadline_s:g} s")
        watch = _Deadline()
        timer = threading.Timer(remaining_s, watch.expire)
        timer.daemon = True
        timer.start()
        try:
            return self._client.request(method, path, content=body, headers=self._headers,
                                        extensions={"trace": watch.trace})
        except httpx.HTTPError:
            if watch.expired:
                raise PlanTimeout(f"{method} {self.base_url}{path} timed out: it passed its deadline of "
                                  f"{self.deadline_s:g} s (the answer was still arriving)") from None
            raise
        finally:
            timer.cancel()

    def plan(self, request: PlanRequest) -> PlanResponse:
        """POST /plan, retried (``_retried``)."""
        return self._retried("POST", "/plan", request.model_dump_json(exclude_none=True), PlanResponse)

    def register_profile(self, job_id: str, request: JobProfileRequest) -> FeedbackResponse:
        """PUT /jobs/{job_id}/profile, retried (``_retried``): a registration repeated changes nothing."""
        return self._retried("PUT", f"/jobs/{job_id}/profile", request.model_dump_json(exclude_none=True),
                             FeedbackResponse)

    def _retried(self, method: str, path: str, body: str, answer: type[Answer]) -> Answer:
        """The answer, retried (tenacity) on a transport error, a timeout, 408, 429 and 5xx until ``max_attempts`` or
        until the next wait would pass the fetch's deadline; a 4xx is final."""
        deadline = time.monotonic() + self.deadline_s
        retrying = Retrying(
            retry=retry_if_exception_type(PlanUnavailable),
            stop=stop_after_attempt(self.max_attempts) | stop_before_delay(self.deadline_s),
            wait=self._wait_s,
            sleep=self._sleep,
            reraise=False,
        )
        try:
            return retrying(self._once, method, path, body, deadline, answer)
        except RetryError as error:
            failure = error.last_attempt.exception()
            assert isinstance(failure, PlanUnavailable)
            raise type(failure)(f"{failure} (after {error.last_attempt.attempt_number} attempts)") from None

    def _wait_s(self, state: RetryCallState) -> float:
        """The service's Retry-After where it sent one, else exponential backoff; either with up to a quarter more
        at random, so that trainers refused together do not all come back together."""
        assert state.outcome is not None
        failure = state.outcome.exception()
        retry_after_s = failure.retry_after_s if isinstance(failure, PlanUnavailable) else None
        delay_s = retry_after_s if retry_after_s is not None else self.backoff_s * 2 ** (state.attempt_number - 1)
        return delay_s * (1 + _JITTER * random.random())

    def _once(self, method: str, path: str, body: str, deadline: float, answer: type[Answer]) -> Answer:
        """One attempt: the answer, ``PlanUnavailable`` (worth retrying) or ``PlanRejected`` (final)."""
        request = f"{method} {self.base_url}{path}"
        try:
            response = self._send(method, path, body, deadline)
        except httpx.TimeoutException as error:
            raise PlanTimeout(f"{request} timed out ({type(error).__name__})") from None
        except httpx.HTTPError as error:
            raise PlanUnavailable(f"{request} failed: {error!r}") from None
        if response.status_code in _RETRIED_STATUS:
            raise PlanUnavailable(f"{request} answered {response.status_code}: {_problem_detail(response)}",
                                  retry_after_s=_retry_after_s(response))
        if response.status_code != 200:
            raise PlanRejected(f"{request} answered {response.status_code}: {_problem_detail(response)}")
        return _parsed(response, answer, request)

    def feedback(self, request: FeedbackRequest) -> FeedbackResponse:
        """POST /feedback once (a report is not worth retrying: the next step sends a fresh one)."""
        # A deadline here too: reports share the plan prefetch's thread, so a hung report would stall plans.
        return self._once("POST", "/feedback", request.model_dump_json(exclude_none=True),
                          time.monotonic() + self.deadline_s, FeedbackResponse)
