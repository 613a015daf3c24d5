"""Pydantic v2 models of the wire contract (DESIGN.md, "Wire contract").

This package depends on pydantic alone, so the trainer can speak the contract
without importing FastAPI or the planner. Types and lower bounds (positive
sizes, a non-empty batch) are checked here and appear in the exported JSON
Schema; upper bounds are limits the service configures, so the planning core
checks them and names the offending field and the limit in its error.

The JSON Schemas of ``PlanRequest``, ``PlanResponse`` and ``Problem`` and the
service's OpenAPI document are exported beside this module
(``python -m scheduler_service.export_schema``); a test fails when they drift.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt

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

SCHEMA_VERSION: Final = 1

PositiveInt = Annotated[StrictInt, Field(ge=1)]
SequenceIndex = Annotated[StrictInt, Field(ge=0)]


class SchedulerName(StrEnum):
    SKRULL = "skrull"
    SKRULL_PAPER = "skrull_paper"
    DEEPSPEED = "deepspeed"
    SORTED = "sorted"
    ROUND_ROBIN = "round_robin"
    BALANCED = "balanced"
    CPSAT = "cpsat"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSpec(_Strict):
    """A model described inline, for architectures outside the built-in catalogue."""

    name: str = Field(min_length=1, max_length=128, description="A label for logs and metrics.")
    hidden_size: PositiveInt = Field(description="h of eq. 13.")
    num_layers: PositiveInt
    num_attention_heads: PositiveInt
    num_key_value_heads: PositiveInt = Field(description="Must divide num_attention_heads; h_kv = this × head_dim.")
    head_dim: PositiveInt
    intermediate_size: PositiveInt
    vocab_size: PositiveInt
    tie_word_embeddings: bool = False
    attention_bias: bool = False


class PlanRequest(_Strict):
    """POST /plan: one global batch to schedule."""

    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        json_schema_extra={
            "examples": [
                {
                    "sequence_lengths": [812, 30311, 97, 4096, 1500, 256, 65000, 733],
                    "dp_size": 2,
                    "cp_size": 4,
                    "model": "qwen2.5-0.5b",
                    "scheduler": "skrull",
                }
            ]
        },
    )

    schema_version: Literal[1] = Field(default=SCHEMA_VERSION, description="Contract version.")
    sequence_lengths: list[PositiveInt] = Field(
        min_length=1,
        description="Token count of every sequence of the global batch, in dataset order; plans refer to "
        "positions here. The service caps the count and each length (GET /models lists the limits).",
    )
    dp_size: PositiveInt = Field(description="Data-parallel degree (capped by the service).")
    cp_size: PositiveInt = Field(description="Context-parallel degree (capped by the service).")
    model: str | ModelSpec = Field(
        default="qwen2.5-0.5b", description="A built-in model name (GET /models) or an inline ModelSpec."
    )
    bucket_size: PositiveInt | None = Field(
        default=None,
        description="Tokens per CP rank per micro-batch (BucketSize C); derived from the profile when absent.",
    )
    scheduler: SchedulerName = Field(default=SchedulerName.SKRULL, description="Which scheduler plans the batch.")
    profile: str | None = Field(default=None, description="Hardware profile name; the service default when absent.")
    time_limit_s: Annotated[float, Field(strict=True, gt=0, allow_inf_nan=False)] | None = Field(
        default=None, description="cpsat only: solver time limit in seconds (capped by the service)."
    )


class MicroBatchModel(_Strict):
    local: list[list[SequenceIndex]] = Field(description="cp_size lists: indices kept whole on that CP rank.")
    distributed: list[SequenceIndex] = Field(description="Indices sharded (zigzag) over the whole CP group.")
    estimated_time_ms: float = Field(description="max over CP ranks of the estimated micro-batch time.")


class DPRankPlanModel(_Strict):
    micro_batches: list[MicroBatchModel] = Field(description="Run in order with gradient accumulation.")
    estimated_time_ms: float = Field(description="Sum of this DP rank's micro-batch estimates.")


class SolverReport(_Strict):
    """What CP-SAT proved: present for the cpsat scheduler only."""

    status: Literal["OPTIMAL", "FEASIBLE", "UNKNOWN", "INFEASIBLE", "MODEL_INVALID"] = Field(
        description="CP-SAT's status; FEASIBLE means the time limit stopped the search before proving optimality."
    )
    objective_ms: float | None = Field(description="Estimated iteration time of the best plan found.")
    bound_ms: float | None = Field(description="The solver's lower bound on any plan's iteration time.")
    wall_time_ms: float = Field(description="Solver wall time.")


class PlanResponse(_Strict):
    """The plan of one global batch, with its estimate beside the deepspeed baseline's."""

    schema_version: Literal[1] = SCHEMA_VERSION
    scheduler: SchedulerName
    model: str = Field(description="The model the estimate is for.")
    profile: str = Field(description="The hardware profile the estimate is for.")
    bucket_size: StrictInt = Field(description="BucketSize C the plan honours (requested or derived).")
    dp_ranks: list[DPRankPlanModel] = Field(description="dp_size entries, in DP-rank order.")
    estimated_iteration_time_ms: float = Field(description="max over DP ranks of their estimated time.")
    solve_time_ms: float = Field(description="Wall time the scheduler took to plan.")
    deepspeed_estimated_iteration_time_ms: float = Field(
        description="The deepspeed baseline's estimate for the same batch, from the same performance model."
    )
    speedup_vs_deepspeed: float = Field(description="deepspeed estimate / this plan's estimate.")
    solver: SolverReport | None = Field(default=None, description="cpsat only: status, objective and bound.")


class FieldError(_Strict):
    field: str = Field(description="Path of the offending field, e.g. sequence_lengths[17].")
    message: str


class Problem(BaseModel):
    """RFC 9457 problem details, as every 4xx/5xx body (application/problem+json)."""

    model_config = ConfigDict(extra="allow")

    type: str = Field(default="about:blank", description="A URI naming the kind of problem.")
    title: str = Field(description="Short summary of the kind of problem.")
    status: Annotated[int, Field(ge=400, le=599)] = Field(description="The HTTP status code.")
    detail: str = Field(description="What went wrong with this request, with the numbers involved.")
    field: str | None = Field(default=None, description="The offending request field, e.g. sequence_lengths[17].")
    limit: int | float | None = Field(default=None, description="The limit that was exceeded, where one applies.")
    errors: list[FieldError] = Field(default_factory=list, description="Every invalid field, for validation errors.")
    request_id: str | None = Field(default=None, description="The X-Request-ID of the request.")


class ProfileSummary(_Strict):
    """A hardware profile the service can plan for (GET /models)."""

    name: str
    description: str
    device: str
    device_memory_bytes: float
    model: str | None = Field(description="The model the profile was measured for; null when it fits any model.")


class ServiceLimits(_Strict):
    """The limits this service enforces; a request over one gets a 4xx naming it."""

    max_body_bytes: int
    max_sequences: int
    max_sequence_length: int
    max_dp_size: int
    max_cp_size: int
    cpsat_max_sequences: int
    cpsat_default_time_limit_s: float
    cpsat_max_time_limit_s: float


class ModelsResponse(_Strict):
    """GET /models: what a request may name, and the limits it must respect."""

    schema_version: Literal[1] = SCHEMA_VERSION
    models: list[ModelSpec] = Field(description="The built-in model catalogue.")
    profiles: list[ProfileSummary]
    schedulers: list[SchedulerName]
    default_model: str
    default_profile: str
    limits: ServiceLimits


class HealthStatus(_Strict):
    """GET /healthz and /readyz."""

    status: Literal["ok", "ready"]
    checks: dict[str, str] = Field(default_factory=dict, description="State of each component.")
