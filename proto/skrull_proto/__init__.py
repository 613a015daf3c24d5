"""The Skrull wire contract: request, response and error models (pydantic v2 only).

The JSON Schemas of the main models and the service's OpenAPI document are
exported beside these modules (``*.schema.json``, ``openapi.json``).
"""

from skrull_proto.models import (
    SCHEMA_VERSION,
    DPRankPlanModel,
    FieldError,
    HealthStatus,
    MicroBatchModel,
    ModelSpec,
    ModelsResponse,
    PlanRequest,
    PlanResponse,
    Problem,
    ProfileSummary,
    SchedulerName,
    ServiceLimits,
    SolverReport,
)

__all__ = [
    "SCHEMA_VERSION",
    "DPRankPlanModel",
    "FieldError",
    "HealthStatus",
    "MicroBatchModel",
    "ModelSpec",
    "ModelsResponse",
    "PlanRequest",
    "PlanResponse",
    "Problem",
    "ProfileSummary",
    "SchedulerName",
    "ServiceLimits",
    "SolverReport",
]
