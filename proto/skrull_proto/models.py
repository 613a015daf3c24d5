"""Pydantic v2 models of the wire contract (docs/design.md, "Wire contract").

This package depends on pydantic alone, so the trainer can speak the contract
without importing FastAPI or the planner. Types and lower bounds (positive
sizes, a non-empty batch) are checked here and appear in the exported JSON
Schema; upper bounds are limits the service configures, so the planning core
checks them and names the offending field and the limit in its error. A batch's
lengths are the exception: typed here, their bounds documented in the schema,
and checked by the core alone, which every caller's batch passes through and
which names the first bad index (pydantic would describe every bad item of a
body of millions).

The JSON Schemas of ``PlanRequest``, ``PlanResponse`` and ``Problem`` and the
service's OpenAPI document are exported beside this module
(``python -m scheduler_service.export_schema``); a test fails when they drift.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, ClassVar, Final, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    StrictInt,
    WithJsonSchema,
    model_serializer,
    model_validator,
)

from skrull_proto.profile_document import ProfileDocument

__all__ = [
    "MAX_FEEDBACK_MICRO_BATCHES",
    "MAX_MEMORY_BYTES",
    "MAX_MICRO_BATCH_TIME_MS",
    "MIN_MEMORY_BYTES",
    "MIN_MICRO_BATCH_TIME_MS",
    "SCHEMA_VERSION",
    "SCHEMES_SCHEMA_VERSION",
    "SPANNING_SCHEMA_VERSION",
    "CPRankEstimateModel",
    "CollectiveScheme",
    "ComputeCoefficients",
    "DPRankPlanModel",
    "FeedbackRequest",
    "FeedbackResponse",
    "FieldError",
    "HealthStatus",
    "JobId",
    "JobProfileRequest",
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
    "SampledBatch",
    "SamplerSpec",
    "SamplersResponse",
    "SchedulerName",
    "ServiceLimits",
    "ShardedGroupLengths",
    "ShardedGroupModel",
    "SolverReport",
    "SpanningGroupModel",
    "SpanningMicroBatchModel",
]

SCHEMA_VERSION: Final = 1
# Plans that may hold spanning micro-batches (blocks over several DP replicas): a request of this version accepts
# them (the default), a response has it exactly when it holds one.
SPANNING_SCHEMA_VERSION: Final = 2
# Plans whose collectives may name a scheme other than all-gather-KV (``scheme``, ``ulysses_degree``): a request of
# this version accepts them (the default), a response has it exactly when it holds one.
SCHEMES_SCHEMA_VERSION: Final = 3

PositiveInt = Annotated[StrictInt, Field(ge=1)]
# A length of a batch: the planning core checks that it is positive (module docstring); the schema says so.
SequenceLength = Annotated[StrictInt, WithJsonSchema({"minimum": 1, "type": "integer"})]
SequenceIndex = Annotated[StrictInt, Field(ge=0)]
CPRank = Annotated[StrictInt, Field(ge=0)]
JobId = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]*$")]

# Bounds on what a trainer can have measured; anything outside is a broken measurement, not a slow machine
# (and values far apart, each positive, drove the refit's arithmetic to overflow).
MIN_MICRO_BATCH_TIME_MS: Final = 1e-3  # one microsecond: less than one kernel launch
MAX_MICRO_BATCH_TIME_MS: Final = 3_600_000.0  # one hour for one micro-batch
MIN_MEMORY_BYTES: Final = float(1 << 20)  # 1 MiB: less than any device holds while it trains
MAX_MEMORY_BYTES: Final = float(1 << 50)  # 1 PiB on one device
MAX_FEEDBACK_MICRO_BATCHES: Final = 4096


class SchedulerName(StrEnum):
    SKRULL = "skrull"
    SKRULL_BINARY = "skrull_binary"
    SKRULL_PAPER = "skrull_paper"
    DEEPSPEED = "deepspeed"
    SORTED = "sorted"
    ROUND_ROBIN = "round_robin"
    BALANCED = "balanced"
    CPSAT = "cpsat"
    DYNAMIC_CP = "dynamic_cp"
    GROUP_BY_LENGTH = "group_by_length"
    BATCH_REBALANCE = "batch_rebalance"
    ULYSSES = "ulysses"
    USP = "usp"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSpec(_Strict):
    """A model described inline, for architectures outside the built-in catalogue."""

    name: str = Field(min_length=1, max_length=128, description="A label for logs and metrics.")
    # Upper bounds well above any real model: absurd shapes are a 422, not an overflow deep in the planner.
    hidden_size: PositiveInt = Field(le=2**18, description="h of eq. 13.")
    num_layers: PositiveInt = Field(le=2**12)
    num_attention_heads: PositiveInt = Field(le=2**12)
    num_key_value_heads: PositiveInt = Field(le=2**12,
                                             description="Must divide num_attention_heads; h_kv = this × head_dim.")
    head_dim: PositiveInt = Field(le=2**12)
    intermediate_size: PositiveInt = Field(le=2**20)
    vocab_size: PositiveInt = Field(le=2**23)
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

    schema_version: Literal[1, 2, 3] = Field(
        default=SCHEMES_SCHEMA_VERSION,
        description="Contract version. 3 (the default): a collective may be Ulysses or 2D (`scheme`), as well as "
        "all that 2 allows. 2: the plan may hold spanning micro-batches (`spanning`), and a sequence may be as long "
        "as the world holds, bucket_size x cp_size x dp_size; every collective all-gathers K/V. 1: a client that "
        "cannot run spanning micro-batches either; every sequence must fit one CP group (bucket_size x cp_size).")
    spanning: bool | None = Field(
        default=None, description="Whether the plan may hold spanning micro-batches; absent: as schema_version "
        "says (from 2). False: every sequence must fit one CP group, whatever the version; True needs version 2 or "
        "later.")
    sequence_lengths: list[SequenceLength] = Field(
        json_schema_extra={"minItems": 1},  # the core checks it (module docstring)
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
    gpus_per_node: PositiveInt | None = Field(
        default=None,
        description="GPUs per node (a power of two): a sharded block larger than a node is priced with the "
        "profile's inter-node collectives. Absent: every CP group lies on one node.",
    )
    token_buckets: Annotated[StrictInt, Field(ge=0, le=8)] = Field(
        default=0,
        description="The client pads each CP rank's row of a micro-batch to the smallest of this many token buckets "
        "(bucket_size and its halves, each rounded up to 64 tokens), as a trainer that replays CUDA graphs captured "
        "per bucket does; the padding is priced, so the plan fills buckets. 0: rows run as packed.",
    )
    scheduler: SchedulerName = Field(default=SchedulerName.SKRULL, description="Which scheduler plans the batch.")
    profile: str | None = Field(default=None, description="Hardware profile name; the service default when absent.")
    time_limit_s: Annotated[float, Field(strict=True, gt=0, allow_inf_nan=False)] | None = Field(
        default=None, description="cpsat only: solver time limit in seconds (capped by the service)."
    )
    search_budget: Annotated[StrictInt, Field(ge=0)] | None = Field(
        default=None,
        description="skrull (and cpsat's warm start) only: units of plan-level search work, each the costing of "
        "one sequence against every swap and move, or one perturbation of the iterated local search that runs "
        "once the local search stops improving. A larger budget never gives a worse plan; the same budget always "
        "gives the same plan. Absent: the service's default, else 192 units on a few hundred sequences, fewer on "
        "larger batches (whose costings are dearer); capped by the service.",
    )
    job_id: JobId | None = Field(
        default=None,
        description="Opt-in feedback: names the training job. Its POST /feedback reports refit the profile its "
        "later plans use, and may lower their bucket_size when measured peak memory nears the budget.",
    )
    breakdown: bool = Field(
        default=False,
        description="Add each CP rank's estimated time and tokens to every micro-batch of the response "
        "(`cp_ranks`), as the plan viewer draws them. Off by default: responses stay as they were.",
    )

    @model_validator(mode="after")
    def _spanning_needs_version_2(self) -> PlanRequest:
        if self.spanning and self.schema_version < SPANNING_SCHEMA_VERSION:
            raise ValueError(f"spanning needs schema_version {SPANNING_SCHEMA_VERSION} or later; got "
                             f"{self.schema_version}")
        return self

    @property
    def allows_spanning(self) -> bool:
        """Whether the plan may hold spanning micro-batches (``spanning``, else the version)."""
        return self.schema_version >= SPANNING_SCHEMA_VERSION if self.spanning is None else self.spanning


_BLOCK_RULE = ("size s with 2 <= s < cp_size and s dividing cp_size, the ranks consecutive and ascending from a "
               "multiple of s (e.g. [0, 1], [2, 3], [4, 5, 6, 7] for cp_size 8)")


class _OmitsEmpty(_Strict):
    """Leaves empty optional lists and unset optional fields out of the JSON, so a plan (or report) without hybrid
    groups, a per-CP-rank breakdown or a job-state warning reads exactly as before those fields existed: a client
    that predates them still parses it, and one that gets them refuses the unknown field (``extra="forbid"``)
    instead of silently running the plan without them."""

    _omitted_when_empty: ClassVar[tuple[str, ...]]  # the fields left out when empty (or null)
    _omitted_when_default: ClassVar[dict[str, str]] = {}  # the fields left out when they hold this value

    # No return annotation: pydantic would take it as the serialisation schema instead of the model's own.
    @model_serializer(mode="wrap")
    def _omit_empty(self, handler: SerializerFunctionWrapHandler):
        data = handler(self)
        if isinstance(data, dict):
            for name in self._omitted_when_empty:
                if not data.get(name, True):
                    del data[name]
            for name, default in self._omitted_when_default.items():
                if name in data and data[name] == default:
                    del data[name]
        return data


class CollectiveScheme(StrEnum):
    """How a collective (sequences sharded over one block of s ranks) moves its attention's data."""

    ALL_GATHER_KV = "all_gather_kv"
    ULYSSES = "ulysses"
    TWO_D = "2d"


_SCHEME = ("How the collective's attention moves its data: `all_gather_kv` (the default, omitted: zigzag shards, K/V "
           "all-gathered over the block), `ulysses` (contiguous shards, all-to-all over heads), `2d` (Ulysses over "
           "`ulysses_degree` consecutive ranks, K/V all-gathered across the block's sub-blocks of that size).")
_ULYSSES_DEGREE = ("`2d` only: the ranks of one Ulysses group, a divisor of the block's size strictly between 1 and "
                   "it; omitted otherwise (all_gather_kv: 1, ulysses: the block's size).")


class _HasScheme(_OmitsEmpty):
    """A collective's scheme, with the 2D degree it needs and nothing it does not."""

    def _check_scheme(self, scheme: CollectiveScheme, ulysses_degree: int | None, size: int, name: str) -> None:
        if scheme is CollectiveScheme.TWO_D:
            if ulysses_degree is None or not 1 < ulysses_degree < size or size % ulysses_degree:
                raise ValueError(f"{name}scheme 2d needs {name}ulysses_degree, a divisor of the block's {size} ranks "
                                 f"strictly between 1 and {size}; got {ulysses_degree}")
        elif ulysses_degree is not None:
            raise ValueError(f"{name}ulysses_degree is for scheme 2d only; {name}scheme is {scheme.value}")


class ShardedGroupModel(_HasScheme):
    """Hybrid DACP: sequences sharded over part of the CP group."""

    _omitted_when_empty: ClassVar[tuple[str, ...]] = ("ulysses_degree",)
    _omitted_when_default: ClassVar[dict[str, str]] = {"scheme": "all_gather_kv"}

    cp_ranks: list[CPRank] = Field(min_length=2, description=f"The group's CP ranks, an aligned block: {_BLOCK_RULE}.")
    sequences: list[SequenceIndex] = Field(min_length=1, description="Indices sharded over these CP ranks.")
    scheme: CollectiveScheme = Field(default=CollectiveScheme.ALL_GATHER_KV, description=_SCHEME)
    ulysses_degree: PositiveInt | None = Field(default=None, description=_ULYSSES_DEGREE)

    @model_validator(mode="after")
    def _scheme_fits(self) -> ShardedGroupModel:
        self._check_scheme(self.scheme, self.ulysses_degree, len(self.cp_ranks), "")
        return self


class CPRankEstimateModel(_OmitsEmpty):
    """One CP rank's share of a micro-batch under the performance model (the simulator's breakdown): what the
    CLI's ``--plot`` and the plan viewer draw. The parts add up to ``time_ms``."""

    _omitted_when_empty: ClassVar[tuple[str, ...]] = ("padding_ms", "launch_bound_ms")

    tokens: float = Field(description="local + distributed / cp_size + each hybrid group's tokens / its size: "
                                      "the quantity bucket_size bounds (activation memory).")
    local_tokens: StrictInt = Field(description="Tokens of the sequences kept whole on this rank.")
    local_ms: float = Field(description="Compute of the sequences kept whole on this rank.")
    distributed_ms: float = Field(description="This rank's share of the compute of `distributed`.")
    sharded_ms: float = Field(description="This rank's share of the compute of its hybrid groups.")
    fixed_ms: float = Field(description="Fixed cost per micro-batch with work (β).")
    comm_ms: float = Field(description="Every collective this rank takes part in, forward and backward.")
    exposed_comm_ms: float = Field(description="The part of comm_ms local attention does not hide.")
    padding_ms: float = Field(default=0.0, description="The compute of the padding that fills this rank's row to "
                                                       "its token bucket (token_buckets); 0 without buckets.")
    launch_bound_ms: float = Field(default=0.0, description="What the launch-bound floor of the profile adds beyond "
                                                            "the device's work (eager GPU dispatch); 0 when the rank "
                                                            "is compute-bound or the profile has no floor.")
    time_ms: float = Field(description="local + distributed + sharded + fixed + padding + exposed communication + "
                                       "launch_bound.")


class MicroBatchModel(_HasScheme):
    _omitted_when_empty: ClassVar[tuple[str, ...]] = ("sharded", "cp_ranks", "distributed_ulysses_degree")
    _omitted_when_default: ClassVar[dict[str, str]] = {"distributed_scheme": "all_gather_kv"}

    local: list[list[SequenceIndex]] = Field(description="cp_size lists: indices kept whole on that CP rank.")
    distributed: list[SequenceIndex] = Field(description="Indices sharded over the whole CP group.")
    distributed_scheme: CollectiveScheme = Field(default=CollectiveScheme.ALL_GATHER_KV,
                                                 description=f"The scheme of `distributed`. {_SCHEME}")
    distributed_ulysses_degree: PositiveInt | None = Field(default=None, description=_ULYSSES_DEGREE)
    sharded: list[ShardedGroupModel] = Field(
        default_factory=list,
        description="Hybrid DACP groups: indices sharded over an aligned block of CP ranks; a CP rank may belong "
        "to several groups. Omitted when empty (a plain Skrull plan).",
    )
    estimated_time_ms: float = Field(description="max over CP ranks of the estimated micro-batch time.")
    cp_ranks: list[CPRankEstimateModel] = Field(
        default_factory=list,
        description="cp_size entries: each CP rank's estimated time and tokens. Only when the request set "
        "`breakdown`; omitted otherwise.",
    )

    @model_validator(mode="after")
    def _scheme_fits(self) -> MicroBatchModel:
        self._check_scheme(self.distributed_scheme, self.distributed_ulysses_degree, len(self.local),
                           "distributed_")
        return self


class DPRankPlanModel(_Strict):
    micro_batches: list[MicroBatchModel] = Field(description="Run in order with gradient accumulation, after the "
                                                             "spanning micro-batches this DP rank is part of.")
    estimated_time_ms: float = Field(description="When this DP rank's last micro-batch ends: its spanning "
                                                 "micro-batches (waits for the other replicas included), then the sum "
                                                 "of its own micro-batch estimates.")


class SpanningGroupModel(_HasScheme):
    """Sequences sharded over an aligned block of a spanning micro-batch's world ranks."""

    _omitted_when_empty: ClassVar[tuple[str, ...]] = ()
    _omitted_when_default: ClassVar[dict[str, str]] = {"scheme": "all_gather_kv"}

    ranks: list[CPRank] = Field(min_length=2, description="World ranks (dp_rank x cp_size + cp_rank), an aligned "
                                                          "block of the spanning micro-batch's ranks: size s dividing "
                                                          "their number, starting s x k ranks after the first.")
    sequences: list[SequenceIndex] = Field(min_length=1, description="Indices sharded over these ranks.")
    scheme: Literal[CollectiveScheme.ALL_GATHER_KV, CollectiveScheme.ULYSSES] = Field(
        default=CollectiveScheme.ALL_GATHER_KV, description="`all_gather_kv` (the default, omitted) or `ulysses`: "
        "across DP replicas no collective is 2D.")


class SpanningMicroBatchModel(_OmitsEmpty):
    """One micro-batch over an aligned block of DP replicas, run by each of them as one synchronised step."""

    _omitted_when_empty: ClassVar[tuple[str, ...]] = ("sharded", "ranks")
    _omitted_when_default: ClassVar[dict[str, str]] = {"distributed_scheme": "all_gather_kv"}

    dp_ranks: list[CPRank] = Field(min_length=2, description="The DP replicas of the block: at least two, "
                                                             "consecutive, starting at a multiple of their number.")
    local: list[list[SequenceIndex]] = Field(description="One list per world rank of the block, in rank order: "
                                                         "indices kept whole on that rank.")
    distributed: list[SequenceIndex] = Field(description="Indices sharded over every rank of the block.")
    distributed_scheme: Literal[CollectiveScheme.ALL_GATHER_KV, CollectiveScheme.ULYSSES] = Field(
        default=CollectiveScheme.ALL_GATHER_KV, description="The scheme of `distributed`: `all_gather_kv` (the "
        "default, omitted) or `ulysses`.")
    sharded: list[SpanningGroupModel] = Field(default_factory=list, description="Indices sharded over an aligned "
                                                                                "block of the block's ranks.")
    estimated_time_ms: float = Field(description="max over the block's ranks of the estimated micro-batch time.")
    ranks: list[CPRankEstimateModel] = Field(default_factory=list, description="Each world rank's estimate, in "
                                                                               "rank order; only with `breakdown`.")


class SolverReport(_Strict):
    """What CP-SAT proved: present for the cpsat scheduler only."""

    status: Literal["OPTIMAL", "FEASIBLE", "UNKNOWN", "INFEASIBLE", "MODEL_INVALID"] = Field(
        description="CP-SAT's status; FEASIBLE means the time limit stopped the search before proving optimality."
    )
    objective_ms: float | None = Field(description="Estimated iteration time of the best plan found.")
    bound_ms: float | None = Field(description="The solver's lower bound on any plan's iteration time.")
    wall_time_ms: float = Field(description="Solver wall time.")


class PlanResponse(_OmitsEmpty):
    """The plan of one global batch, with its estimate beside the deepspeed baseline's."""

    _omitted_when_empty: ClassVar[tuple[str, ...]] = ("spanning", "job_state", "notes")

    schema_version: Literal[1, 2, 3] = Field(default=SCHEMA_VERSION, description="1: a plan within CP groups, as "
                                                                                 "before; 2: it holds `spanning`; 3: "
                                                                                 "a collective names a `scheme` "
                                                                                 "other than all_gather_kv.")
    scheduler: SchedulerName
    model: str = Field(description="The model the estimate is for.")
    profile: str = Field(description="The hardware profile the estimate is for.")
    bucket_size: StrictInt = Field(description="BucketSize C the plan honours (requested or derived).")
    dp_ranks: list[DPRankPlanModel] = Field(description="dp_size entries, in DP-rank order.")
    spanning: list[SpanningMicroBatchModel] = Field(
        default_factory=list,
        description="Micro-batches over blocks of several DP replicas. Every DP replica runs those it is part of "
        "first, in this order, then its own; each is one synchronised step of its replicas. Omitted when empty "
        "(schema_version 1).")
    estimated_iteration_time_ms: float = Field(description="max over DP ranks of their estimated time.")
    solve_time_ms: float = Field(description="Wall time the planner took: the scheduler's plan, its check, the choice "
                                             "of its collectives' schemes and its estimate.")
    deepspeed_estimated_iteration_time_ms: float = Field(
        description="The deepspeed baseline's estimate for the same batch, from the same performance model."
    )
    speedup_vs_deepspeed: float = Field(description="deepspeed estimate / this plan's estimate.")
    lower_bound_ms: float = Field(
        description="No plan of this batch is faster under the same performance model: every sequence at its "
        "cheapest placement, the work spread evenly over all DP x CP ranks, no communication exposed. "
        "estimated_iteration_time_ms / lower_bound_ms - 1 is at most what a better plan could gain."
    )
    solver: SolverReport | None = Field(default=None, description="cpsat only: status, objective and bound.")
    notes: list[str] = Field(
        default_factory=list,
        description="What the plan could not use and why, e.g. every collective kept to all_gather_kv because the "
        "profile has no all_to_all table. Omitted when empty.")
    job_state: str | None = Field(
        default=None,
        description="Only when the request named a `job_id` and the service's job store failed during it: "
        "`unavailable: <reason>`. A job that could not be read is planned with the base profile (`profile` "
        "then names it, without `+feedback`); one that could not be kept after planning was planned with its "
        "state as read. Reports for the job are refused until the store is back. Omitted otherwise.",
    )


class ShardedGroupLengths(_Strict):
    """A hybrid group as the trainer ran it: the lengths of the sequences sharded over its CP ranks."""

    cp_ranks: list[CPRank] = Field(
        min_length=2, description=f"The group's CP ranks, an aligned block of the job's CP group: {_BLOCK_RULE}.")
    lengths: list[PositiveInt] = Field(min_length=1, description="Lengths of the sequences sharded over them.")


class MicroBatchMeasurement(_OmitsEmpty):
    """One micro-batch as the trainer ran it."""

    _omitted_when_empty: ClassVar[tuple[str, ...]] = ("sharded_lengths",)

    local_lengths: list[list[PositiveInt]] = Field(
        description="cp_size lists: lengths of the sequences kept whole on each CP rank.")
    distributed_lengths: list[PositiveInt] = Field(description="Lengths of the sequences sharded over the CP group.")
    sharded_lengths: list[ShardedGroupLengths] = Field(
        default_factory=list, description="Hybrid DACP groups of the micro-batch; omitted when it had none.")
    time_ms: Annotated[float, Field(strict=True, ge=MIN_MICRO_BATCH_TIME_MS, le=MAX_MICRO_BATCH_TIME_MS,
                                    allow_inf_nan=False)] = Field(
        description="Measured forward + backward time of the slowest CP rank.")
    peak_memory_bytes: Annotated[float, Field(strict=True, ge=MIN_MEMORY_BYTES, le=MAX_MEMORY_BYTES,
                                              allow_inf_nan=False)] | None = (
        Field(default=None, description="Peak device memory during the micro-batch, the largest over CP ranks; "
                                        "absent where the device cannot measure it per micro-batch (CPU)."))


class FeedbackRequest(_Strict):
    """POST /feedback: what one training step measured, for the job's online refit."""

    schema_version: Literal[1] = Field(default=SCHEMA_VERSION, description="Contract version.")
    job_id: JobId = Field(description="The job_id its POST /plan requests carried.")
    step: Annotated[StrictInt, Field(ge=0)] | None = Field(default=None, description="Training step, for logs.")
    micro_batches: list[MicroBatchMeasurement] = Field(min_length=1, max_length=MAX_FEEDBACK_MICRO_BATCHES)
    memory_budget_bytes: Annotated[float, Field(strict=True, ge=MIN_MEMORY_BYTES, le=MAX_MEMORY_BYTES,
                                                allow_inf_nan=False)] | None = (
        Field(default=None, description="Device memory the job may use; the profile's device memory when absent."))


class JobProfileRequest(_Strict):
    """PUT /jobs/{job_id}/profile: the profile a trainer measured, as its job's base profile.

    The job is keyed as its plans key it (model, dp_size, cp_size), so the job exists, planned with this profile,
    before its first POST /plan."""

    schema_version: Literal[1] = Field(default=SCHEMA_VERSION, description="Contract version.")
    profile: ProfileDocument = Field(
        description="The profile document, in the format of a profile file (`python -m trainer_client.profile` "
        "writes one). Its `name` is what the job's POST /plan requests name in `profile` (or they name none).")
    model: str | ModelSpec = Field(
        default="qwen2.5-0.5b", description="The job's model, as its POST /plan requests name it.")
    dp_size: PositiveInt = Field(description="The job's data-parallel degree, as its POST /plan requests give it.")
    cp_size: PositiveInt = Field(description="The job's context-parallel degree, as its POST /plan requests give it.")


class ComputeCoefficients(_Strict):
    alpha_s_per_flop: float
    alpha_s_per_token: float
    alpha_s_per_sequence: float
    beta_s_per_layer: float


class MemoryCoefficients(_Strict):
    bytes_per_token: float = Field(description="Refit activation bytes per token per CP rank.")
    fixed_bytes: float = Field(description="Refit peak at zero tokens: static, reserved and fixed memory.")


class FeedbackResponse(_OmitsEmpty):
    """A job's refit state (POST /feedback, GET /feedback/{job_id} and PUT /jobs/{job_id}/profile)."""

    _omitted_when_empty: ClassVar[tuple[str, ...]] = ("base_registered",)

    schema_version: Literal[1] = SCHEMA_VERSION
    job_id: str
    model: str
    base_profile: str = Field(description="The profile the job's plans started from.")
    base_registered: bool = Field(
        default=False, description="The base profile is the job's own, registered by its trainer (PUT "
        "/jobs/{job_id}/profile), not one the service shares; omitted otherwise.")
    profile: str = Field(description="The profile name its plans now report (the base's, + feedback).")
    num_observations: int = Field(description="Micro-batches reported so far.")
    num_in_window: int = Field(description="Observations the current fit uses (a bounded sliding window).")
    num_downweighted: int = Field(description="Observations of the window the robust fit treats as outliers.")
    compute_scale: float = Field(description="Refit variable compute cost / the base profile's.")
    compute: ComputeCoefficients
    fit_median_relative_error: float | None = Field(description="Of the compute refit over its window.")
    memory: MemoryCoefficients | None = Field(description="Null until a report carried peak memory.")
    memory_budget_bytes: float
    bucket_size_cap: int | None = Field(
        description="The largest bucket_size that keeps the predicted peak under the budget's headroom; later "
        "plans of the job use at most this (never less than the longest sequence needs over the CP group).")


class ProfilesReloaded(_Strict):
    """POST /profiles/reload: the profile folder read again."""

    directory: str | None = Field(description="The folder (SKRULL_PROFILE_DIR); null when none is configured.")
    profiles: list[str] = Field(description="Names loaded from it.")


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
    origin: Literal["builtin", "directory"] = Field(
        default="builtin", description="Shipped with the service, or read from its profile folder.")
    measured_at: str | None = Field(default=None, description="When the profiler measured it (provenance.date).")


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
    # Optional, so that clients of an older service parse its answers too.
    max_plan_cells: int | None = Field(default=None, description="Largest estimated plan: micro-batches × cp_size "
                                       "local lists, plus sequences (the deepspeed baseline's included).")
    max_answer_bytes: int | None = Field(default=None, description="Largest estimated /plan answer.")
    max_feedback_cells: int | None = Field(default=None, description="Most lists and lengths in one report.")


class ModelsResponse(_Strict):
    """GET /models: what a request may name, and the limits it must respect."""

    schema_version: Literal[1] = SCHEMA_VERSION
    models: list[ModelSpec] = Field(description="The built-in model catalogue.")
    profiles: list[ProfileSummary]
    schedulers: list[SchedulerName]
    default_model: str
    default_profile: str
    limits: ServiceLimits


class SamplerSpec(_Strict):
    """A named sequence-length distribution a batch can be drawn from (GET /samplers)."""

    name: str
    thresholds: list[StrictInt] = Field(description="Token counts, ascending.")
    cumulative: list[float] = Field(description="Share of sequences shorter than each threshold.")
    longest: StrictInt = Field(description="The longest sequence the distribution yields.")


class SamplersResponse(_Strict):
    """GET /samplers: the named length distributions (shaped like the Skrull paper's Table 1, and two of ours)."""

    samplers: list[SamplerSpec]


class SampledBatch(_Strict):
    """GET /samplers/{name}: lengths drawn from one sampler; the same name, count, seed and cap give the same
    batch."""

    sampler: str
    seed: StrictInt
    max_length: StrictInt = Field(description="Longer draws were cut to this, as a trainer truncates records.")
    sequence_lengths: list[PositiveInt] = Field(description="Ready to POST to /plan as `sequence_lengths`.")


class HealthStatus(_Strict):
    """GET /healthz and /readyz."""

    status: Literal["ok", "ready"]
    checks: dict[str, str] = Field(default_factory=dict, description="State of each component.")
