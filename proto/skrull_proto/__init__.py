"""The Skrull wire contract: request, response and error models (pydantic v2 only).

The JSON Schemas of the main models and the service's OpenAPI document are
exported beside these modules (``*.schema.json``, ``openapi.json``).
"""

from skrull_proto.models import (
    MAX_FEEDBACK_MICRO_BATCHES,
    MAX_MEMORY_BYTES,
    MAX_MICRO_BATCH_TIME_MS,
    SCHEMA_VERSION,
    ComputeCoefficients,
    DPRankPlanModel,
    FeedbackRequest,
    FeedbackResponse,
    FieldError,
    HealthStatus,
    MemoryCoefficients,
    MicroBatchMeasurement,
    MicroBatchModel,
    ModelSpec,
    ModelsResponse,
    PlanRequest,
    PlanResponse,
    Problem,
    ProfilesReloaded,
    ProfileSummary,
    SchedulerName,
    ServiceLimits,
    SolverReport,
)

__all__ = [
    "MAX_FEEDBACK_MICRO_BATCHES",
    "MAX_MEMORY_BYTES",
    "MAX_MICRO_BATCH_TIME_MS",
    "SCHEMA_VERSION",
    "ComputeCoefficients",
    "DPRankPlanModel",
    "FeedbackRequest",
    "FeedbackResponse",
    "FieldError",
    "HealthStatus",
    "MemoryCoefficients",
    "MicroBatchMeasurement",
    "MicroBatchModel",
    "ModelSpec",
    "ModelsResponse",
    "PlanRequest",
    "PlanResponse",
    "Problem",
    "ProfileSummary",
    "ProfilesReloaded",
    "SchedulerName",
    "ServiceLimits",
    "SolverReport",
]
