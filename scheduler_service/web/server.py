"""Run the service under uvicorn (``python -m scheduler_service serve``).

uvicorn imports ``scheduler_service.web.app:app_factory`` in every worker process,
and the factory reads the ``SKRULL_*`` environment, so ``serve`` passes its
flags on as environment variables: one configuration for every worker. By
default there is one worker per available core (``settings.default_workers``);
the Kubernetes manifests and compose file set one per container and scale with
replicas. Several workers share job state through the job store and follow each
other's profile reloads (``runtime.profiles``); their metrics are summed through
``PROMETHEUS_MULTIPROC_DIR``, a fresh folder for the server's lifetime unless
the environment names one.

Connections: uvicorn closes a keep-alive connection idle for
``timeout_keep_alive_s``, but never one that sent part of a request's headers
and stopped (a slow or hostile client holds a connection, and its memory,
forever). ``HeaderDeadlineProtocol`` closes such a connection
``header_timeout_s`` after the request's first byte; the body has its own
deadline (``body_timeout_s``, ``BodySizeLimitMiddleware``: 408).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
from collections.abc import Iterator, Mapping
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from scheduler_service.runtime.logging_setup import configure_logging
from scheduler_service.runtime.settings import ENV_PREFIX, Settings, get_settings

__all__ = ["HeaderDeadlineProtocol", "apply_overrides", "serve"]

APP_FACTORY = "scheduler_service.web.app:app_factory"
MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"


class HeaderDeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol, plus a deadline for a request's headers: from the connection's start, or the
    next request's first byte, to the end of its headers. Imported by name in every uvicorn worker, so it
    reads the deadline from the settings (the ``SKRULL_*`` environment)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_deadline: asyncio.TimerHandle | None = None
        self._header_timeout_s = get_settings().header_timeout_s

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # type: ignore[arg-type]
        self._arm_header_deadline()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE:  # still waiting for (the rest of) a request's headers
            self._arm_header_deadline()
        else:
            self._disarm_header_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_deadline()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        # Between requests the connection is idle: uvicorn's keep-alive timeout applies until the next byte.
        self._disarm_header_deadline()
        super().on_response_complete()

    def _arm_header_deadline(self) -> None:
        if self._header_deadline is None:
            self._header_deadline = self.loop.call_later(self._header_timeout_s, self._on_header_deadline)

    def _disarm_header_deadline(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _on_header_deadline(self) -> None:
        self._header_deadline = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


def apply_overrides(overrides: Mapping[str, object]) -> Settings:
    """Export ``overrides`` (setting name → value; ``None`` skipped) as ``SKRULL_*`` and reload the settings."""
    for name, value in overrides.items():
        if value is not None:
            os.environ[ENV_PREFIX + name.upper()] = str(value).lower() if isinstance(value, bool) else str(value)
    get_settings.cache_clear()
    return get_settings()  # validates: a bad flag or variable fails here, before uvicorn starts


@contextlib.contextmanager
def _shared_metrics_folder(workers: int) -> Iterator[None]:
    """With several workers, each one's samples go to a fresh folder that ``/metrics`` sums (prometheus_client's
    multiprocess mode), removed when the server stops; one worker, or a folder the environment names, is left as
    it is. Set before uvicorn spawns the workers, which read it when they import prometheus_client."""
    if workers == 1 or os.environ.get(MULTIPROC_DIR_ENV):
        yield
        return
    with tempfile.TemporaryDirectory(prefix="skrull-metrics-") as folder:
        os.environ[MULTIPROC_DIR_ENV] = folder
        try:
            yield
        finally:
            del os.environ[MULTIPROC_DIR_ENV]


def serve(settings: Settings) -> None:
    configure_logging(settings.log_level)
    with _shared_metrics_folder(settings.workers):
        uvicorn.run(
            APP_FACTORY,
            factory=True,
            host=settings.host,
            port=settings.port,
            workers=settings.workers,
            log_config=None,  # keep our JSON handler; uvicorn's loggers propagate to it
            log_level=settings.log_level,
            access_log=False,  # RequestContextMiddleware writes the access line, with the request id
            proxy_headers=False,
            server_header=False,
            http=f"{__name__}:HeaderDeadlineProtocol",
            timeout_keep_alive=settings.timeout_keep_alive_s,
            timeout_graceful_shutdown=15,
        )
