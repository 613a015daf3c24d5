"""The profile file format: a hardware profile as the profiler writes it and the service reads it.

A profile is a versioned JSON document (the shipped ``h100-paper.json`` is
the reference; ``python -m trainer_client.profile`` writes measured ones). This
model checks its shape: sections are objects, coefficients finite numbers
within physical bounds (no time over an hour, no size over a PiB: beyond them
a number is a broken measurement, and planning with it would overflow), latency
tables ``[bytes, seconds]`` pairs, ``fit`` one of two names. The
ranges that make a profile usable (an ``alpha_s_per_flop`` of at least 1e-24,
two distinct sizes per table, …) are the planning core's, checked when it builds
its ``Profile`` from the document. Members not declared here (each section's
``source``, the profiler's raw points and fit reports, ``provenance``) are
carried, not checked.
"""

from __future__ import annotations

from typing import Annotated, Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "MAX_PROFILE_BYTES",
    "MAX_PROFILE_SECONDS",
    "PROFILE_SCHEMA_VERSION",
    "ActivationBytesPerToken",
    "AttentionEfficiency",
    "CommunicationSection",
    "ComputeSection",
    "HardwareSection",
    "InterNodeSection",
    "MemorySection",
    "ProfileDocument",
    "StaticBytesPerParameter",
]

PROFILE_SCHEMA_VERSION: Final = 1

MAX_PROFILE_SECONDS: Final = 3600.0  # any time a profile holds, per FLOP, token, sequence or layer, or a latency
MAX_PROFILE_BYTES: Final = float(1 << 50)  # any size a profile holds: memory, bytes per token or parameter, a message

# A coefficient's sign is the planning core's to check (it names the field); its size is bounded here.
Seconds = Annotated[float, Field(strict=True, le=MAX_PROFILE_SECONDS, allow_inf_nan=False)]
Bytes = Annotated[float, Field(strict=True, ge=-MAX_PROFILE_BYTES, le=MAX_PROFILE_BYTES, allow_inf_nan=False)]
# [x, y] with x >= 1 and y >= 0: [message bytes, seconds] or [query tokens, relative throughput]
Point = tuple[Annotated[float, Field(strict=True, ge=1, le=MAX_PROFILE_BYTES, allow_inf_nan=False)],
              Annotated[float, Field(strict=True, ge=0, le=MAX_PROFILE_SECONDS, allow_inf_nan=False)]]
# collective name ("all_gather", "reduce_scatter", …) -> its latency table
Tables = dict[str, list[Point]]


class _Section(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)


class HardwareSection(_Section):
    device: str = "unknown"
    device_memory_bytes: Bytes = Field(description="Memory of one device, the plans' per-rank budget.")


class AttentionEfficiency(_Section):
    points: list[Point] = Field(description="[query_tokens, relative_throughput] of the attention kernel.")


class ComputeSection(_Section):
    """``T_comp = α·FLOPs + α_token·tokens + α_sequence·sequences + β·layers`` of one packed group, at least
    ``floor·layers`` where the host's dispatch overlaps the device's work."""

    alpha_s_per_flop: Seconds
    beta_s_per_layer: Seconds
    alpha_s_per_token: Seconds = 0.0
    alpha_s_per_sequence: Seconds = 0.0
    alpha_s_per_shard: Seconds = Field(
        default=0.0, description="What a sequence sharded over several ranks costs each of them beyond its share of "
                                 "the work, its two chunks' calls and its collectives' tables (measured on sequences "
                                 "too short for their attention to matter); 0: nothing beyond those.")
    alpha_s_per_ulysses_shard: Seconds = Field(
        default=0.0, description="The same for a sequence sharded by Ulysses (all-to-all over heads): beyond its "
                                 "share of the work, its one call and its all-to-alls' tables; 0: nothing beyond "
                                 "those.")
    floor_s_per_layer: Seconds = Field(
        default=0.0, description="The launch-bound floor per layer: a packed group takes max(floor·layers, T_comp) "
                                 "(eager execution on a GPU); 0: T_comp alone, host and device one after the other.")
    attention_efficiency: AttentionEfficiency | None = None


class ActivationBytesPerToken(_Section):
    fixed: Bytes
    per_layer_hidden: Bytes
    per_vocab: Bytes


class StaticBytesPerParameter(_Section):
    replicated: Bytes
    sharded: Bytes


class MemorySection(_Section):
    activation_bytes_per_token: ActivationBytesPerToken
    beta_bytes: Bytes
    reserved_bytes: Bytes
    static_bytes_per_parameter: StaticBytesPerParameter


class InterNodeSection(_Section):
    """The collective tables of groups whose ranks lie on several nodes (CP blocks larger than a node)."""

    tables: Tables = Field(description="All-gather and reduce-scatter latency tables over ranks of several nodes; "
                                       "empty when none was measured (one node).")
    world_size: Annotated[int, Field(strict=True, ge=2)] | None = Field(
        default=None, description="Ranks the tables were measured over; null: no scaling by group size.")
    num_nodes: Annotated[int, Field(strict=True, ge=2)] | None = Field(
        default=None, description="Nodes those ranks lay on.")
    tables_by_group_size: dict[Annotated[int, Field(ge=2)], Tables] = Field(
        default_factory=dict, description="The same tables measured over groups of other sizes, by size.")


class CommunicationSection(_Section):
    kv_bytes_per_element: Annotated[int, Field(strict=True)]
    tables: Tables = Field(description="Collective latency tables; empty when none was measured (one process).")
    fit: Literal["absolute", "relative"] = Field(
        default="absolute", description="Fit T_comm on absolute seconds or on relative error.")
    world_size: Annotated[int, Field(strict=True)] | None = Field(
        default=None, description="Ranks the tables were measured over; null: no scaling by group size.")
    tables_by_group_size: dict[Annotated[int, Field(ge=2)], Tables] = Field(
        default_factory=dict, description="The same tables measured over groups of other sizes, by size.")
    inter_node: InterNodeSection | None = Field(
        default=None, description="Tables of groups that cross nodes; null: the profile plans no such group.")


class ProfileDocument(_Section):
    """A profile file, schema version 1."""

    schema_version: Literal[1]
    name: str = "unnamed"
    description: str = ""
    model: str | None = Field(default=None, description="The model it was measured for; null fits any model.")
    hardware: HardwareSection
    compute: ComputeSection
    memory: MemorySection
    communication: CommunicationSection
    provenance: dict[str, Any] | None = Field(
        default=None, description="Where, when and with what the numbers were measured.")
