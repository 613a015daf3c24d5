"""``POST /advise``: a sample of sequence lengths, a model and a GPU count in; the layouts ranked by predicted
throughput out (``scheduler_service.core.advise``). The answer is the document ``skrull-advise --json`` writes."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeFloat, NonNegativeInt, PositiveInt, model_validator

from skrull_proto.models import ModelSpec

__all__ = ["ADVICE_SCHEMA_VERSION", "AdviceDocument", "AdviseRequest", "ExcludedLayoutModel", "LengthCount",
           "RankedLayoutModel"]

ADVICE_SCHEMA_VERSION: Literal[1] = 1


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ShardingMode(StrEnum):
    """The trainer's ``--sharding`` (the core's ``memory.Sharding``, which the contract does not import;
    tests/test_proto_contract.py ties the two)."""

    ZERO2 = "zero2"
    ZERO3 = "zero3"
    NONE = "none"


class CheckpointingMode(StrEnum):
    """The trainer's ``--activation-checkpointing`` (the core's ``memory.ActivationCheckpointing``, tied likewise)."""

    NONE = "none"
    SELECTIVE = "selective"
    FULL = "full"


class LengthCount(_Strict):
    """One bar of a length histogram: ``count`` sequences of ``length`` tokens."""

    length: PositiveInt
    count: PositiveInt


class AdviseRequest(_Strict):
    """POST /advise: which layout of ``gpus`` GPUs trains sequences like these fastest? Sequences longer than a layout
    trains are left out, or cut with ``truncate``, and each layout says what it loses."""

    model_config = ConfigDict(
        extra="forbid", frozen=True,
        json_schema_extra={"examples": [{"sequence_lengths": [812, 30311, 97, 4096, 1500, 256, 65000, 733] * 16,
                                         "model": "qwen2.5-7b", "gpus": 16, "global_batch": 32}]},
    )

    schema_version: Literal[1] = Field(default=ADVICE_SCHEMA_VERSION, description="Contract version.")
    sequence_lengths: list[PositiveInt] | None = Field(
        default=None, min_length=1,
        description="The sample: token counts of sequences like the data set's (give this or `histogram`).")
    histogram: list[LengthCount] | None = Field(
        default=None, min_length=1, description="The sample as (length, count) bars (give this or `sequence_lengths`).")
    model: str | ModelSpec = Field(description="A built-in model name (GET /models) or an inline ModelSpec.")
    profile: str | None = Field(default=None, description="Hardware profile name; the service default when absent.")
    gpus: PositiveInt = Field(description="GPUs to lay out as dp_size × cp_size.")
    gpus_per_node: PositiveInt = Field(
        default=8, description="GPUs per node (a power of two): CP blocks larger than a node pay the profile's "
                               "inter-node collectives.")
    global_batch: PositiveInt | None = Field(
        default=None, description="Sequences per optimizer step (give this or `tokens_per_step`; default 64).")
    tokens_per_step: PositiveInt | None = Field(
        default=None, description="A token budget per optimizer step instead of a number of sequences.")
    shardings: list[ShardingMode] | None = Field(
        default=None, min_length=1, description="Sharding modes to consider (default: all).")
    activation_checkpointing: list[CheckpointingMode] | None = Field(
        default=None, min_length=1,
        description="Checkpointing modes to consider (default: the one the profile measured its activations with).")
    cp_sizes: list[PositiveInt] | None = Field(
        default=None, min_length=1, description="CP degrees to consider (default: every power of two dividing gpus).")
    num_batches: PositiveInt = Field(default=8, description="Global batches drawn from the sample to price each "
                                                            "layout on (capped by the service).")
    seed: NonNegativeInt = Field(default=0, description="Seeds the batches drawn: the same request, the same answer.")
    dtype: Literal["bfloat16", "float32"] = Field(
        default="bfloat16", description="The dtype weights compute in (bytes of the gathered weights).")
    max_length: PositiveInt | None = Field(
        default=None,
        description="The trainer's --max-length: the longest sequence trained whole (default: each layout's "
                    "longest_trainable_sequence; a larger value is capped by it). A longer one is left out, or cut "
                    "to it with `truncate`.")
    truncate: bool = Field(
        default=False, description="The trainer's --truncate: cut sequences longer than a layout trains to its limit "
                                   "instead of leaving them out.")

    @model_validator(mode="after")
    def _one_sample_and_one_batch_size(self) -> AdviseRequest:
        if (self.sequence_lengths is None) == (self.histogram is None):
            raise ValueError("give exactly one of sequence_lengths and histogram")
        if self.global_batch is not None and self.tokens_per_step is not None:
            raise ValueError("give at most one of global_batch and tokens_per_step")
        return self


class SpreadModel(_Strict):
    step_time_ms_min: NonNegativeFloat
    step_time_ms_p10: NonNegativeFloat
    step_time_ms_p90: NonNegativeFloat
    step_time_ms_max: NonNegativeFloat
    relative_spread: NonNegativeFloat = Field(description="(p90 − p10) / median of the sampled batches' times.")


class DegreeShare(_Strict):
    degree: Annotated[int, Field(ge=2)]
    share: NonNegativeFloat = Field(description="Of the sampled sequences, sharded over this many CP ranks.")


class _LayoutFields(_Strict):
    dp_size: PositiveInt
    cp_size: PositiveInt
    bucket_size: NonNegativeInt = Field(description="Tokens per CP rank per micro-batch the memory model allows.")
    sharding: ShardingMode
    activation_checkpointing: CheckpointingMode
    longest_trainable_sequence: NonNegativeInt = Field(
        description="bucket_size × cp_size × dp_size where `spanning` (one micro-batch over every DP replica), else "
                    "bucket_size × cp_size.")
    spans_nodes: bool = Field(description="Whether a CP block can cross nodes (cp_size > gpus_per_node).")
    spanning: bool = Field(
        description="Whether its plans may hold micro-batches spanning several DP replicas: dp_size > 1 and a "
                    "profile that prices a block of every GPU.")
    num_sequences_too_long: NonNegativeInt = Field(
        description="Of the sample: longer than this layout trains whole (longest_trainable_sequence, or "
                    "max_length when smaller), so left out, or cut with `truncate`.")
    too_long_token_share: NonNegativeFloat = Field(
        description="Of the sample's tokens: those this layout does not train (the sequences left out, or the part "
                    "cut).")


class RankedLayoutModel(_LayoutFields):
    rank: PositiveInt = Field(description="1 for the fastest.")
    predicted_step_time_ms: NonNegativeFloat = Field(description="Skrull's, median over the sampled batches.")
    tokens_per_s_per_gpu: NonNegativeFloat = Field(description="All sampled tokens over all step times, per GPU.")
    speedup_vs_static_cp: NonNegativeFloat = Field(description="Static CP's (deepspeed) time over Skrull's, on the "
                                                               "same layout and batches.")
    static_cp_step_time_ms: NonNegativeFloat
    memory_headroom_bytes: float = Field(description="Device memory left at the fullest CP rank of any micro-batch.")
    memory_headroom_fraction: float
    sharded_share: NonNegativeFloat = Field(description="Of the sampled sequences, sharded over several CP ranks.")
    sharded_by_degree: list[DegreeShare]
    micro_batches_per_step: NonNegativeFloat
    num_batches_spanning: NonNegativeInt = Field(
        description="Sampled batches whose plan holds micro-batches spanning DP replicas.")
    num_sequences_spanned: NonNegativeInt = Field(
        description="Sampled sequences in micro-batches spanning DP replicas, over all batches.")
    num_sequences_needing_span: NonNegativeInt = Field(
        description="Sampled sequences longer than one CP group holds (bucket_size × cp_size), over all batches: "
                    "spanning is what trains them.")
    confidence: SpreadModel
    trainer_command: str = Field(description="The torchrun command that trains with this layout.")


class ExcludedLayoutModel(_LayoutFields):
    exclusion: Literal["no_memory", "too_long", "no_inter_node_table"] = Field(
        description="too_long: it leaves out (or cuts) more of the sample's sequences than the ranked layouts.")
    reason: str
    cp_size_needed: PositiveInt | None = Field(
        description="The smallest CP degree, with the same sharding and checkpointing, of a ranked layout: one that "
                    "holds as much of the sample as any layout; null when none does.")


class SampleSummary(_Strict):
    num_sequences: PositiveInt
    longest: PositiveInt
    mean_length: NonNegativeFloat


class AdviceDocument(_Strict):
    """The answer of POST /advise and the file ``skrull-advise --json`` writes."""

    schema_version: Literal[1] = ADVICE_SCHEMA_VERSION
    model: str
    profile: str
    gpus: PositiveInt
    gpus_per_node: PositiveInt
    global_batch: dict[Literal["sequences", "tokens"], PositiveInt]
    num_batches: PositiveInt
    seed: NonNegativeInt
    data: str | None = Field(description="The sample's source, as the trainer's --data names it (CLI only).")
    max_length: PositiveInt | None = Field(description="As requested.")
    truncate: bool = Field(description="As requested.")
    sample: SampleSummary
    mean_sequences_per_batch: NonNegativeFloat
    mean_tokens_per_batch: NonNegativeFloat
    why: str = Field(description="Why the first layout wins, against the runner-up; and when it spans DP replicas "
                                 "or leaves sequences out, how.")
    layouts: list[RankedLayoutModel] = Field(
        description="The priced layouts, fastest first: those that leave out (or cut) the fewest of the sample's "
                    "sequences, so all hold the same ones.")
    excluded: list[ExcludedLayoutModel] = Field(description="Layouts not priced, each with its reason.")
