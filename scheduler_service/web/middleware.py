"""Pure ASGI middleware: request context (id, access log, metrics, last-resort 500, 499 for a client that
hung up) and the body limits (size: 413; time: 408).

Both are plain ASGI callables rather than ``BaseHTTPMiddleware``: they add no
task or stream per request, which keeps the sidecar's latency near the
planner's own.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from scheduler_service.runtime.logging_setup import request_id_var
from scheduler_service.web.metrics import ServiceMetrics
from scheduler_service.web.problems import CLIENT_CLOSED_REQUEST, internal_error_response, problem_response

__all__ = ["SCHEDULER_SCOPE_KEY", "BodySizeLimitMiddleware", "RequestContextMiddleware"]

REQUEST_ID_HEADER = "x-request-id"
SCHEDULER_SCOPE_KEY = "skrull.scheduler"  # set by POST /plan once the request names its scheduler
_VALID_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")

access_logger = logging.getLogger("scheduler_service.access")
error_logger = logging.getLogger("scheduler_service.error")


class RequestContextMiddleware:
    """Request id (accepted from ``X-Request-ID`` or generated, echoed back), access log, HTTP metrics.

    Also the last resort for unhandled exceptions: it logs the traceback under
    the request id and answers a problem+json 500, so no bug escapes as a bare
    text response.
    """

    def __init__(
        self, app: ASGIApp, *, metrics: ServiceMetrics, known_paths: frozenset[str], access_log: bool = True
    ) -> None:
        self.app = app
        self.metrics = metrics
        self.known_paths = known_paths  # metric labels for requests refused before routing (413)
        self.access_log = access_log

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started_s = time.perf_counter()
        request_id = _request_id(scope)
        token = request_id_var.set(request_id)
        status: int | None = None
        disconnected = False

        async def receive_watching() -> Message:
            nonlocal disconnected
            message = await receive()
            disconnected = disconnected or message["type"] == "http.disconnect"
            return message

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                # An answer started after the client hung up is never read: the request is the client's 499.
                status = CLIENT_CLOSED_REQUEST if disconnected else message["status"]
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id.encode())]
            await send(message)

        try:
            await self.app(scope, receive_watching, send_with_id)
        except Exception:
            error_logger.exception("unhandled error", extra={"method": scope["method"], "path": scope["path"]})
            if status is None and not disconnected:
                await internal_error_response()(scope, receive, send_with_id)
        finally:
            if status is None:  # no answer started: the client left (499), or the app never answered (a bug)
                status = CLIENT_CLOSED_REQUEST if disconnected else 500
            duration_s = time.perf_counter() - started_s
            route = scope.get("route")
            route_path = getattr(route, "path", None) or (
                scope["path"] if scope["path"] in self.known_paths else "unmatched"
            )
            scheduler = scope.get(SCHEDULER_SCOPE_KEY) if route_path == "/plan" else None
            if route_path == "/plan" and scheduler is None:
                scheduler = "unknown"  # rejected before the body named a scheduler
            self.metrics.observe_request(method=scope["method"], route=route_path, status=status,
                                         duration_s=duration_s, scheduler=scheduler)
            if self.access_log:
                access_logger.info(
                    "request",
                    extra={"method": scope["method"], "path": scope["path"], "status": status,
                           "duration_ms": round(duration_s * 1e3, 3), "scheduler": scheduler,
                           "client": _client(scope)},
                )
            request_id_var.reset(token)


def _request_id(scope: Scope) -> str:
    for name, value in scope["headers"]:
        if name == b"x-request-id":
            candidate = value.decode("latin-1")
            if _VALID_REQUEST_ID.fullmatch(candidate):
                return candidate
            break
    return uuid.uuid4().hex


def _client(scope: Scope) -> str | None:
    client = scope.get("client")
    return f"{client[0]}:{client[1]}" if client else None


class BodySizeLimitMiddleware:
    """Answers 413 when a request body exceeds ``max_body_bytes``, 408 when it takes over ``body_timeout_s``.

    A declared ``Content-Length`` over the limit is refused before reading a
    byte; a chunked (or lying) body is counted as it streams and refused as soon
    as it passes the limit. The body is read here in full and replayed to the
    app, so the app never sees a partial body and the 413 decision is made
    before any response starts. A client that trickles its body is cut off at
    the deadline (the server alone would wait for it forever).
    """

    def __init__(self, app: ASGIApp, *, max_body_bytes: int, body_timeout_s: float) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS", "DELETE"):
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_body_bytes:
            await self._refuse(scope, receive, send, f"Content-Length {declared}")
            return
        chunks: list[bytes] = []
        num_bytes = 0
        more_body = True
        try:
            async with asyncio.timeout(self.body_timeout_s):
                while more_body:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return  # the client left; nobody to answer
                    chunk = message.get("body", b"")
                    num_bytes += len(chunk)
                    if num_bytes > self.max_body_bytes:
                        await self._refuse(scope, receive, send,
                                           f"more than {num_bytes - len(chunk)} + {len(chunk)} bytes")
                        return
                    chunks.append(chunk)
                    more_body = message.get("more_body", False)
        except TimeoutError:
            response = problem_response(
                408, f"the request body did not arrive within {self.body_timeout_s:g} s ({num_bytes} bytes came)",
                problem_type="body-timeout", title="Request Timeout", field="body", limit=self.body_timeout_s,
                headers={"Connection": "close"})
            await response(scope, receive, send)
            return
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, seen: str) -> None:
        response = problem_response(
            413,
            f"request body ({seen}) exceeds the limit of {self.max_body_bytes} bytes",
            problem_type="body-too-large",
            field="body",
            limit=self.max_body_bytes,
            headers={"Connection": "close"},
        )
        await response(scope, receive, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
