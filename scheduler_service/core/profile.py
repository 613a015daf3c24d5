"""Hardware profiles: the fitted coefficients of the performance model.

A profile is a versioned JSON file (see ``profiles/h100-paper.json``; its
shape is the model ``skrull_proto.ProfileDocument``, checked where files are
read, ``scheduler_service.contract.profiles``; the ranges are checked here): compute
``T_comp = α·FLOPs + β``, activation memory ``M(S) = α·S + β`` and the
collective latency tables ``T_comm`` is fitted from. Numbers live in data, each
with its source, never in code. Shipped: ``h100-eager``, the default, an
H100-class GPU running this project's eager trainer (compute as measured on an
H200, in the launch-bound form; memory and collectives as ``h100-paper``);
``h100-paper``, the paper's setting, an optimised engine's assumed compute;
``h200-qwen2.5-0.5b``, measured; ``cpu-tiny``, measured. ``h100-*`` hold
per-architecture formulas and fit any model; a profile measured by the
profiler (``python -m trainer_client.profile``) names its model in ``model``,
and only plans for that model (its activation bytes per token are measured,
not derived from the shape).

Schema version 1; every member below ``compute``/``memory``/``communication``
not listed in the shipped file is optional and defaults to what reproduces the
paper's model:

* ``compute.alpha_s_per_token`` and ``compute.alpha_s_per_sequence`` (default
  0): the measured cost eq. 13 leaves out (the LM head, norms and element-wise
  kernels per token; one attention call per sequence per layer where the
  kernel is not varlen, as SDPA on CPU);
* ``compute.alpha_s_per_shard`` (default 0): what a sequence sharded over
  several ranks costs each of them beyond its share of the work, its two
  chunks' calls and its collectives' tables (the profiler measures it on
  sequences too short for their attention to matter,
  ``core/shard_effect.derive_shard_cost``); ``compute.alpha_s_per_ulysses_shard``
  (default 0) the same for a sequence sharded by Ulysses or 2D, measured on
  Ulysses rows of the same short sequences;
* ``compute.floor_s_per_layer`` (default 0): the launch-bound floor of eager
  execution on a GPU, where the host dispatches the kernels while the device
  runs earlier ones: a packed group then takes ``max(floor·L, T_comp)``
  (``PerformanceModel.compute_time_s``). 0 keeps the additive form, host and
  device one after the other, as on a CPU;
* ``communication.tables`` may be empty (a single-process profile measured no
  collective): communication then costs nothing in the model;
* ``communication.fit``: ``"absolute"`` (default, least squares on seconds) or
  ``"relative"`` (on relative error, so that small messages, which dominate
  short distributed sequences, are fitted as well as large ones);
* ``compute.attention_efficiency`` (default: none, efficiency 1):
  ``{"points": [[query_tokens, relative_throughput], ...], "source": ...}``,
  the attention kernel's throughput at each query length relative to long
  sequences (the paper's Figure 1(b) effect; at least 2 points, throughputs in
  (0, 1]);
* ``communication.world_size`` (default: none, no scaling by group size): the
  number of ranks the tables were measured over;
* ``communication.tables_by_group_size`` (default: none):
  ``{"2": {"all_gather": [...], "reduce_scatter": [...]}, ...}``, the same
  tables measured over groups of other sizes;
* ``communication.inter_node`` (default: none): the all-gather and
  reduce-scatter tables of groups whose ranks lie on several nodes, in the
  same format: ``tables``, ``world_size`` and ``num_nodes`` (the ranks and
  nodes they were measured over), ``tables_by_group_size`` and a ``source``.
  The performance model reads them for a group of more than ``gpus_per_node``
  ranks (``PerformanceModel``); a profile without them plans no such group;
* ``provenance``: where, when and with what the numbers were measured
  (hardware, software versions, model, date, command); carried, not checked.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from typing import Any

from scheduler_service.core.errors import InvalidRequestError, UnknownProfileError

__all__ = [
    "DEFAULT_PROFILE",
    "MIN_ALPHA_S_PER_FLOP",
    "CommunicationProfile",
    "ComputeProfile",
    "InterNodeCommunication",
    "MemoryProfile",
    "Profile",
    "Tables",
    "builtin_profiles",
    "parse_profile",
    "resolve_profile",
]

DEFAULT_PROFILE = "h100-eager"
COLLECTIVES = ("all_gather", "reduce_scatter")
# The per-token and per-sequence costs are priced as FLOP-equivalents, divided by α (``perf_model``): a smaller α,
# a device a billion times faster than any there is, would overflow them.
MIN_ALPHA_S_PER_FLOP = 1e-24


@dataclass(frozen=True, kw_only=True, slots=True)
class ComputeProfile:
    """``T_comp = α·FLOPs + α_token·tokens + α_sequence·sequences + β·layers`` of one packed group."""

    alpha_s_per_flop: float
    beta_s_per_layer: float
    alpha_s_per_token: float = 0.0
    alpha_s_per_sequence: float = 0.0
    # What a sequence sharded over d ≥ 2 ranks costs each of them beyond its share of the work, its two chunks' calls
    # and its collectives' tables: the sharded path's own fixed cost (``PerformanceModel.placement_flops``).
    alpha_s_per_shard: float = 0.0
    # The same for a sequence sharded by Ulysses or 2D (``schemes``): its own path's cost beyond its share of the
    # work, its calls and its all-to-alls' tables (heads split and joined, rows reordered)
    alpha_s_per_ulysses_shard: float = 0.0
    # The host's dispatch per layer that the device's work overlaps (eager execution on a GPU): a packed group takes
    # at least floor·layers. 0: the additive form, host and device one after the other (CPU).
    floor_s_per_layer: float = 0.0
    # (query tokens, relative throughput), ascending in tokens; empty: the kernel is equally efficient at every length
    attention_efficiency: tuple[tuple[float, float], ...] = ()


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryProfile:
    """Activation bytes per token = fixed + per_layer_hidden·h·L + per_vocab·V."""

    activation_fixed_bytes_per_token: float
    activation_per_layer_hidden: float
    activation_per_vocab: float
    beta_bytes: float
    reserved_bytes: float
    replicated_bytes_per_parameter: float
    sharded_bytes_per_parameter: float


Tables = dict[str, tuple[tuple[float, float], ...]]  # collective -> ((message bytes, latency seconds), ...) by size


@dataclass(frozen=True, kw_only=True, slots=True)
class InterNodeCommunication:
    """The collective tables of groups that cross nodes: ``tables`` measured over ``world_size`` ranks on
    ``num_nodes`` nodes (empty when the profiler saw one node), others by group size."""

    tables: Tables
    world_size: int | None = None
    num_nodes: int | None = None
    tables_by_group_size: dict[int, Tables] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True, slots=True)
class CommunicationProfile:
    kv_bytes_per_element: int
    tables: Tables  # within a node; sorted by size, empty when none was measured
    relative_fit: bool = False  # fit T_comm to the tables on relative rather than absolute error
    world_size: int | None = None  # ranks the tables were measured over; None: no scaling by group size
    tables_by_group_size: dict[int, Tables] = field(default_factory=dict)  # the same over groups of that size
    inter_node: InterNodeCommunication | None = None  # groups whose ranks lie on several nodes


@dataclass(frozen=True, kw_only=True, slots=True)
class Profile:
    name: str
    description: str
    model: str | None
    device: str
    device_memory_bytes: float
    compute: ComputeProfile
    memory: MemoryProfile
    communication: CommunicationProfile
    raw: dict[str, Any]

    def __post_init__(self) -> None:
        if not self.device_memory_bytes > 0:
            raise InvalidRequestError("profile hardware.device_memory_bytes must be positive",
                                      field="profile.hardware.device_memory_bytes")
        compute = self.compute
        if not compute.alpha_s_per_flop >= MIN_ALPHA_S_PER_FLOP:
            raise InvalidRequestError(f"profile compute.alpha_s_per_flop must be at least {MIN_ALPHA_S_PER_FLOP:g} "
                                      f"(a yottaFLOP/s device), got {compute.alpha_s_per_flop}",
                                      field="profile.compute.alpha_s_per_flop")
        for name in ("beta_s_per_layer", "alpha_s_per_token", "alpha_s_per_sequence", "alpha_s_per_shard",
                     "alpha_s_per_ulysses_shard", "floor_s_per_layer"):
            if not getattr(compute, name) >= 0:
                raise InvalidRequestError(f"profile compute.{name} must not be negative, got {getattr(compute, name)}",
                                          field=f"profile.compute.{name}")
        memory = self.memory
        per_token = (memory.activation_fixed_bytes_per_token, memory.activation_per_layer_hidden,
                     memory.activation_per_vocab)
        if min(per_token) < 0 or max(per_token) <= 0:
            raise InvalidRequestError("profile memory.activation_bytes_per_token must be non-negative and not all 0",
                                      field="profile.memory.activation_bytes_per_token")
        if self.communication.kv_bytes_per_element < 1:
            raise InvalidRequestError("profile communication.kv_bytes_per_element must be at least 1",
                                      field="profile.communication.kv_bytes_per_element")
        communication = self.communication
        _check_link(communication.tables, communication.tables_by_group_size, communication.world_size,
                    "communication")
        inter_node = communication.inter_node
        if inter_node is not None:
            _check_link(inter_node.tables, inter_node.tables_by_group_size, inter_node.world_size,
                        "communication.inter_node")
            if inter_node.num_nodes is not None and inter_node.num_nodes < 2:
                raise InvalidRequestError("profile communication.inter_node.num_nodes must be at least 2, got "
                                          f"{inter_node.num_nodes}", field="profile.communication.inter_node.num_nodes")
        efficiency = compute.attention_efficiency
        if efficiency and (len(efficiency) < 2 or len({tokens for tokens, _ in efficiency}) < len(efficiency)
                           or any(not (tokens >= 1 and 0 < value <= 1) for tokens, value in efficiency)):
            raise InvalidRequestError(
                "profile compute.attention_efficiency.points needs at least 2 [query_tokens, throughput] points at "
                "distinct lengths >= 1 with relative throughputs in (0, 1]",
                field="profile.compute.attention_efficiency.points")

    @property
    def provenance(self) -> dict[str, Any]:
        """Where the numbers come from (the profiler fills it); empty for hand-written profiles."""
        provenance = self.raw.get("provenance")
        return provenance if isinstance(provenance, dict) else {}


def _check_link(tables: Tables, by_group_size: dict[int, Tables], world_size: int | None, path: str) -> None:
    """The tables of one kind of link (within a node, or across nodes) and the ranks they were measured over."""
    _check_tables(tables, f"{path}.tables")
    for group_size, group_tables in by_group_size.items():
        _check_tables(group_tables, f"{path}.tables_by_group_size.{group_size}")
    if world_size is not None and world_size < 1:
        raise InvalidRequestError(f"profile {path}.world_size must be at least 1, got {world_size}",
                                  field=f"profile.{path}.world_size")


def _check_tables(tables: Tables, path: str) -> None:
    if not tables:
        return
    # the all-to-all is optional (without it no collective is Ulysses or 2D), the others are not
    for collective in (*COLLECTIVES, *(("all_to_all",) if "all_to_all" in tables else ())):
        # two distinct sizes at least: T_comm is a line fitted to the table
        if len({size for size, _ in tables.get(collective, ())}) < 2:
            raise InvalidRequestError(
                f"profile {path}.{collective} needs (bytes, seconds) points at at least 2 distinct sizes",
                field=f"profile.{path}.{collective}",
            )


def _points(points: Any) -> tuple[tuple[float, float], ...]:
    return tuple(sorted((float(x), float(y)) for x, y in points))


def _tables(section: dict[str, Any]) -> Tables:
    return {str(name): _points(points) for name, points in section.items()}


def _tables_by_group_size(section: dict[str, Any]) -> dict[int, Tables]:
    return {int(size): _tables(tables) for size, tables in section.get("tables_by_group_size", {}).items()}


def _inter_node(section: dict[str, Any] | None) -> InterNodeCommunication | None:
    if section is None:
        return None
    return InterNodeCommunication(tables=_tables(section.get("tables", {})), world_size=section.get("world_size"),
                                  num_nodes=section.get("num_nodes"),
                                  tables_by_group_size=_tables_by_group_size(section))


def parse_profile(data: dict[str, Any]) -> Profile:
    """Build a ``Profile`` from its JSON document. The document's shape is checked before (``ProfileDocument``
    where a file is read; the shipped files and the documents the core writes itself are trusted), its values'
    ranges by ``Profile`` itself."""
    hardware, compute, memory, communication = (data["hardware"], data["compute"], data["memory"],
                                                data["communication"])
    activation, static = memory["activation_bytes_per_token"], memory["static_bytes_per_parameter"]
    efficiency = compute.get("attention_efficiency") or {}
    return Profile(
        name=str(data.get("name", "unnamed")),
        description=str(data.get("description", "")),
        model=data.get("model"),
        device=str(hardware.get("device", "unknown")),
        device_memory_bytes=float(hardware["device_memory_bytes"]),
        compute=ComputeProfile(
            alpha_s_per_flop=float(compute["alpha_s_per_flop"]),
            beta_s_per_layer=float(compute["beta_s_per_layer"]),
            alpha_s_per_token=float(compute.get("alpha_s_per_token", 0.0)),
            alpha_s_per_sequence=float(compute.get("alpha_s_per_sequence", 0.0)),
            alpha_s_per_shard=float(compute.get("alpha_s_per_shard", 0.0)),
            alpha_s_per_ulysses_shard=float(compute.get("alpha_s_per_ulysses_shard", 0.0)),
            floor_s_per_layer=float(compute.get("floor_s_per_layer", 0.0)),
            attention_efficiency=_points(efficiency.get("points", ())),
        ),
        memory=MemoryProfile(
            activation_fixed_bytes_per_token=float(activation["fixed"]),
            activation_per_layer_hidden=float(activation["per_layer_hidden"]),
            activation_per_vocab=float(activation["per_vocab"]),
            beta_bytes=float(memory["beta_bytes"]),
            reserved_bytes=float(memory["reserved_bytes"]),
            replicated_bytes_per_parameter=float(static["replicated"]),
            sharded_bytes_per_parameter=float(static["sharded"]),
        ),
        communication=CommunicationProfile(
            kv_bytes_per_element=int(communication["kv_bytes_per_element"]),
            tables=_tables(communication["tables"]),
            relative_fit=communication.get("fit", "absolute") == "relative",
            world_size=communication.get("world_size"),
            tables_by_group_size=_tables_by_group_size(communication),
            inter_node=_inter_node(communication.get("inter_node")),
        ),
        raw=data,
    )


@cache
def builtin_profiles() -> dict[str, Profile]:
    """The profiles shipped with the package, by name."""
    folder = resources.files("scheduler_service.core") / "profiles"
    files = sorted((entry for entry in folder.iterdir() if entry.name.endswith(".json")), key=lambda e: e.name)
    loaded = (parse_profile(json.loads(entry.read_text())) for entry in files)
    return {profile.name: profile for profile in loaded}


def resolve_profile(profile: str | Profile | None, extra: dict[str, Profile] | None = None) -> Profile:
    """A profile by name (``extra`` first, then the shipped ones); ``None`` means the default."""
    if isinstance(profile, Profile):
        return profile
    known = {**builtin_profiles(), **(extra or {})}
    name = DEFAULT_PROFILE if profile is None else profile  # "" is a name, unknown like any other
    if name not in known:
        raise UnknownProfileError(name, list(known))
    return known[name]
