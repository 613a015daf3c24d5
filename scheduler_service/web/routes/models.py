"""``GET /models``: what a request may name (models, profiles, schedulers) and the service's limits."""

from __future__ import annotations

from fastapi import APIRouter
from skrull_proto import ModelsResponse, PlanRequest, SchedulerName, ServiceLimits

from scheduler_service.contract.wire import profile_to_summary, shape_to_model_spec
from scheduler_service.core.models import MODEL_CATALOGUE
from scheduler_service.core.profile import DEFAULT_PROFILE, builtin_profiles
from scheduler_service.web.deps import PlannerDep, SettingsDep

__all__ = ["router"]

router = APIRouter()


@router.get("/models", operation_id="listModels", response_model=ModelsResponse,
            summary="Known models, profiles, schedulers and limits")
async def models(settings: SettingsDep, planner: PlannerDep) -> ModelsResponse:
    return ModelsResponse(
        models=[shape_to_model_spec(shape) for shape in MODEL_CATALOGUE.values()],
        profiles=[
            *(profile_to_summary(profile, "builtin") for profile in builtin_profiles().values()),
            *(profile_to_summary(profile, "directory") for profile in planner.profiles.values()),
        ],
        schedulers=list(SchedulerName),
        default_model=PlanRequest.model_fields["model"].default,
        default_profile=DEFAULT_PROFILE,
        limits=ServiceLimits(
            max_body_bytes=settings.max_body_bytes,
            max_sequences=settings.max_sequences,
            max_sequence_length=settings.max_sequence_length,
            max_dp_size=settings.max_dp_size,
            max_cp_size=settings.max_cp_size,
            cpsat_max_sequences=settings.cpsat_max_sequences,
            cpsat_default_time_limit_s=settings.cpsat_default_time_limit_s,
            cpsat_max_time_limit_s=settings.cpsat_max_time_limit_s,
            max_plan_cells=settings.max_plan_cells,
            max_answer_bytes=settings.max_answer_bytes,
            max_feedback_cells=settings.max_feedback_cells,
        ),
    )
