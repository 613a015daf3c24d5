"""The FastAPI app: ``create_app(settings)`` wires the routes, the error mapping, the middleware and the
runtime's planning service.

``create_app()`` with no argument reads ``get_settings()`` (the ``SKRULL_*``
environment); tests pass their own ``Settings``. ``app_factory`` is what
uvicorn imports (``serve``): it also installs the JSON log handler.

Middleware, outermost first: request context (request id, access log,
metrics, last-resort 500, 499) → body limits (413, 408) → FastAPI.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from importlib.metadata import PackageNotFoundError, version

from fastapi import FastAPI
from skrull_proto import SCHEMA_VERSION

from scheduler_service.runtime.lifeline import end_with_parent, stop_gracefully
from scheduler_service.runtime.logging_setup import configure_logging
from scheduler_service.runtime.service import PlanningService
from scheduler_service.runtime.settings import Settings, get_settings
from scheduler_service.web.metrics import ServiceMetrics
from scheduler_service.web.middleware import BodySizeLimitMiddleware, RequestContextMiddleware
from scheduler_service.web.openapi import openapi_document
from scheduler_service.web.problems import install_problem_handlers
from scheduler_service.web.routes import ROUTERS
from scheduler_service.web.routes.viewer import static_files

__all__ = ["app_factory", "create_app"]

try:
    __version__ = version("skrull")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0"

# A worker whose supervisor died stops as on SIGTERM; one still busy after this long (a long plan in flight) is
# ended regardless, so that a restarted server gets its port within a second or two.
WORKER_STOP_GRACE_S = 1.5
TITLE = "Skrull scheduler"
DESCRIPTION = (
    "Plans long-context fine-tuning batches (Skrull GDS + DACP, baselines, CP-SAT) for a trainer. "
    f"Wire contract version {SCHEMA_VERSION}; errors are RFC 9457 application/problem+json."
)


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()
    metrics = ServiceMetrics()
    planner = PlanningService(settings, metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        planner.start()
        try:
            yield
        finally:
            planner.close()

    app = FastAPI(title=TITLE, version=__version__, description=DESCRIPTION, lifespan=lifespan,
                  docs_url="/docs", redoc_url=None)
    app.state.settings = settings
    app.state.metrics = metrics
    app.state.planner = planner
    for router in ROUTERS:
        app.include_router(router)
    app.mount("/static", static_files(), name="static")  # the plan viewer's script and style
    install_problem_handlers(app)
    app.add_middleware(BodySizeLimitMiddleware, max_body_bytes=settings.max_body_bytes,
                       body_timeout_s=settings.body_timeout_s)
    # FastAPI keeps an included router as one entry of app.routes (without a path): its routes are in the router.
    known_paths = frozenset(path for router in (*ROUTERS, app.router) for route in router.routes
                            if (path := getattr(route, "path", None)))
    app.add_middleware(RequestContextMiddleware, metrics=metrics, known_paths=known_paths,
                       access_log=settings.access_log)
    app.openapi = lambda: openapi_document(app)  # type: ignore[method-assign]
    return app


def app_factory() -> FastAPI:
    """What ``serve`` hands uvicorn (``factory=True``): JSON logs, then the app from the environment. A worker
    process of a multi-worker server stops when its supervisor is gone, however it died (``lifeline``)."""
    settings = get_settings()
    configure_logging(settings.log_level)
    end_with_parent(stop_gracefully(WORKER_STOP_GRACE_S))
    return create_app(settings)
