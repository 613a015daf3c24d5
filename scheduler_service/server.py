"""Run the service under uvicorn (``python -m scheduler_service serve``).

uvicorn imports ``scheduler_service.app:app_factory`` in every worker process,
and the factory reads the ``SKRULL_*`` environment, so ``serve`` passes its
flags on as environment variables: one configuration for every worker. One
worker per container is the deployment pattern (scale with replicas); more
workers suit a shared scheduler on a larger host.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import uvicorn

from scheduler_service.logging_setup import configure_logging
from scheduler_service.settings import ENV_PREFIX, Settings, get_settings

__all__ = ["apply_overrides", "serve"]

APP_FACTORY = "scheduler_service.app:app_factory"


def apply_overrides(overrides: Mapping[str, object]) -> Settings:
    """Export ``overrides`` (setting name → value; ``None`` skipped) as ``SKRULL_*`` and reload the settings."""
    for name, value in overrides.items():
        if value is not None:
            os.environ[ENV_PREFIX + name.upper()] = str(value).lower() if isinstance(value, bool) else str(value)
    get_settings.cache_clear()
    return get_settings()  # validates: a bad flag or variable fails here, before uvicorn starts


def serve(settings: Settings) -> None:
    configure_logging(settings.log_level)
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
        timeout_graceful_shutdown=15,
    )
