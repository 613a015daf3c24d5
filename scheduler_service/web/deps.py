"""The app's objects as route dependencies: the planning service, the settings, the metrics.

``async def``: FastAPI runs a plain ``def`` dependency in a worker thread, a
hop that costs more than the lookup itself.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from scheduler_service.runtime.service import PlanningService
from scheduler_service.runtime.settings import Settings
from scheduler_service.web.metrics import ServiceMetrics

__all__ = ["MetricsDep", "PlannerDep", "SettingsDep"]


async def get_planner(request: Request) -> PlanningService:
    planner: PlanningService = request.app.state.planner
    return planner


async def get_app_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


async def get_metrics(request: Request) -> ServiceMetrics:
    metrics: ServiceMetrics = request.app.state.metrics
    return metrics


PlannerDep = Annotated[PlanningService, Depends(get_planner)]
SettingsDep = Annotated[Settings, Depends(get_app_settings)]
MetricsDep = Annotated[ServiceMetrics, Depends(get_metrics)]
