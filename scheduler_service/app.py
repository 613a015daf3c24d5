"""The FastAPI app: ``create_app(settings)`` wires routes, error mapping, middleware and the planner.

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
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from skrull_proto import SCHEMA_VERSION, FeedbackRequest, PlanRequest, Problem

from scheduler_service.api import router
from scheduler_service.logging_setup import configure_logging
from scheduler_service.metrics import ServiceMetrics
from scheduler_service.middleware import BodySizeLimitMiddleware, RequestContextMiddleware
from scheduler_service.planning import PlanningService
from scheduler_service.problems import install_problem_handlers
from scheduler_service.settings import Settings, get_settings
from scheduler_service.viewer import install_viewer

__all__ = ["app_factory", "create_app"]

try:
    __version__ = version("skrull")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0"

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
    app.include_router(router)
    install_viewer(app)  # GET / (the plan viewer), /static, /samplers
    install_problem_handlers(app)
    app.add_middleware(BodySizeLimitMiddleware, max_body_bytes=settings.max_body_bytes,
                       body_timeout_s=settings.body_timeout_s)
    known_paths = frozenset(getattr(route, "path", "") for route in [*router.routes, *app.routes]) - {""}
    app.add_middleware(RequestContextMiddleware, metrics=metrics, known_paths=known_paths,
                       access_log=settings.access_log)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    return app


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's document plus the schemas the routes refer to by hand: PlanRequest and FeedbackRequest (POST
    /plan and /feedback parse their own bodies, see ``parsing``) and Problem (the problem+json responses); the
    bearer token marked optional where it is asked for (``auth``)."""
    if app.openapi_schema is None:
        document = get_openapi(title=app.title, version=app.version, description=app.description,
                               routes=app.routes)
        schemas = document.setdefault("components", {}).setdefault("schemas", {})
        for model in (PlanRequest, FeedbackRequest, Problem):
            schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update(schema.pop("$defs", {}))
            schemas[model.__name__] = schema
        document["components"]["schemas"] = dict(sorted(schemas.items()))
        for item in document["paths"].values():  # the bearer token is optional: off unless SKRULL_API_TOKEN is set
            for operation in item.values():
                if "security" in operation:
                    operation["security"].append({})
        app.openapi_schema = document
    return app.openapi_schema


def app_factory() -> FastAPI:
    """What ``serve`` hands uvicorn (``factory=True``): JSON logs, then the app from the environment."""
    settings = get_settings()
    configure_logging(settings.log_level)
    return create_app(settings)
