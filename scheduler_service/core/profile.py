"""Hardware profiles: the fitted coefficients of the performance model.

A profile is a versioned JSON file (see ``profiles/h100-paper.json``): compute
``T_comp = α·FLOPs + β``, activation memory ``M(S) = α·S + β`` and the
collective latency tables ``T_comm`` is fitted from. Numbers live in data, each
with its source, never in code. The shipped ``h100-paper`` profile holds
per-architecture formulas and fits any model; a profile measured by the
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
* ``provenance``: where, when and with what the numbers were measured
  (hardware, software versions, model, date, command); carried, not checked.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

from scheduler_service.core.errors import InvalidRequestError, UnknownProfileError

__all__ = [
    "DEFAULT_PROFILE",
    "PROFILE_SCHEMA_VERSION",
    "CommunicationProfile",
    "ComputeProfile",
    "MemoryProfile",
    "Profile",
    "builtin_profiles",
    "load_profile",
    "load_profile_dir",
    "parse_profile",
    "resolve_profile",
]

PROFILE_SCHEMA_VERSION = 1
DEFAULT_PROFILE = "h100-paper"
COLLECTIVES = ("all_gather", "reduce_scatter")
_MAX_PROFILE_BYTES = 1 << 20  # a profile is a few KiB; anything larger in a profile folder is not one


@dataclass(frozen=True, kw_only=True, slots=True)
class ComputeProfile:
    """``T_comp = α·FLOPs + α_token·tokens + α_sequence·sequences + β·layers`` of one packed group."""

    alpha_s_per_flop: float
    beta_s_per_layer: float
    alpha_s_per_token: float = 0.0
    alpha_s_per_sequence: float = 0.0
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


@dataclass(frozen=True, kw_only=True, slots=True)
class CommunicationProfile:
    kv_bytes_per_element: int
    # collective name -> ((message bytes, latency seconds), ...), sorted by size; empty when none was measured
    tables: dict[str, tuple[tuple[float, float], ...]]
    relative_fit: bool = False  # fit T_comm to the tables on relative rather than absolute error
    world_size: int | None = None  # ranks the tables were measured over; None: no scaling by group size
    # group size -> the same tables measured over groups of that size
    tables_by_group_size: dict[int, dict[str, tuple[tuple[float, float], ...]]] = field(default_factory=dict)


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
            raise InvalidRequestError("profile hardware.device_memory_bytes must be positive", field="profile")
        compute = self.compute
        if not compute.alpha_s_per_flop > 0:
            raise InvalidRequestError(
                f"profile compute.alpha_s_per_flop must be positive, got {compute.alpha_s_per_flop}", field="profile")
        for name in ("beta_s_per_layer", "alpha_s_per_token", "alpha_s_per_sequence"):
            if not getattr(compute, name) >= 0:
                raise InvalidRequestError(f"profile compute.{name} must not be negative, got {getattr(compute, name)}",
                                          field="profile")
        memory = self.memory
        per_token = (memory.activation_fixed_bytes_per_token, memory.activation_per_layer_hidden,
                     memory.activation_per_vocab)
        if min(per_token) < 0 or max(per_token) <= 0:
            raise InvalidRequestError("profile memory.activation_bytes_per_token must be non-negative and not all 0",
                                      field="profile")
        if self.communication.kv_bytes_per_element < 1:
            raise InvalidRequestError("profile communication.kv_bytes_per_element must be at least 1",
                                      field="profile")
        _check_tables(self.communication.tables, "communication.tables")
        for group_size, group_tables in self.communication.tables_by_group_size.items():
            _check_tables(group_tables, f"communication.tables_by_group_size.{group_size}")
        world_size = self.communication.world_size
        if world_size is not None and world_size < 1:
            raise InvalidRequestError(f"profile communication.world_size must be at least 1, got {world_size}",
                                      field="profile")
        efficiency = compute.attention_efficiency
        if efficiency and (len(efficiency) < 2 or len({tokens for tokens, _ in efficiency}) < len(efficiency)
                           or any(not (tokens >= 1 and 0 < value <= 1) for tokens, value in efficiency)):
            raise InvalidRequestError(
                "profile compute.attention_efficiency.points needs at least 2 [query_tokens, throughput] points at "
                "distinct lengths >= 1 with relative throughputs in (0, 1]", field="profile")

    @property
    def provenance(self) -> dict[str, Any]:
        """Where the numbers come from (the profiler fills it); empty for hand-written profiles."""
        provenance = self.raw.get("provenance")
        return provenance if isinstance(provenance, dict) else {}


def _check_tables(tables: dict[str, tuple[tuple[float, float], ...]], path: str) -> None:
    if not tables:
        return
    for collective in COLLECTIVES:
        # two distinct sizes at least: T_comm is a line fitted to the table
        if len({size for size, _ in tables.get(collective, ())}) < 2:
            raise InvalidRequestError(
                f"profile {path}.{collective} needs (bytes, seconds) points at at least 2 distinct sizes",
                field="profile",
            )


def _number(data: dict[str, Any], key: str, path: str, default: float | None = None) -> float:
    value = data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidRequestError(f"profile field {path}.{key} must be a finite number, got {value!r}",
                                  field="profile")
    return float(value)


def _section(data: Any, key: str, path: str) -> dict[str, Any]:
    value = data.get(key) if isinstance(data, dict) else None
    if not isinstance(value, dict):
        where = f"{path}.{key}" if path else key
        raise InvalidRequestError(f"profile field {where} must be a JSON object, got {value!r}", field="profile")
    return value


def _table(path: str, points: Any, what: str = "[bytes, seconds]") -> tuple[tuple[float, float], ...]:
    if not isinstance(points, list | tuple):
        raise InvalidRequestError(f"profile {path} must be a list of {what} points", field="profile")
    try:
        parsed = tuple(sorted((float(x), float(y)) for x, y in points))
    except (TypeError, ValueError) as error:
        raise InvalidRequestError(f"profile {path} must hold {what} number pairs: {error}",
                                  field="profile") from error
    if any(not (math.isfinite(x) and math.isfinite(y)) or x <= 0 or y < 0 for x, y in parsed):
        raise InvalidRequestError(f"profile {path} needs positive {what} values", field="profile")
    return parsed


def _tables(section: dict[str, Any], path: str) -> dict[str, tuple[tuple[float, float], ...]]:
    return {str(name): _table(f"{path}.{name}", points) for name, points in section.items()}


def _efficiency(compute: dict[str, Any]) -> tuple[tuple[float, float], ...]:
    if "attention_efficiency" not in compute:
        return ()
    section = _section(compute, "attention_efficiency", "compute")
    return _table("compute.attention_efficiency.points", section.get("points"), what="[query_tokens, throughput]")


def _group_tables(communication: dict[str, Any]) -> dict[int, dict[str, tuple[tuple[float, float], ...]]]:
    if "tables_by_group_size" not in communication:
        return {}
    groups = _section(communication, "tables_by_group_size", "communication")
    parsed = {}
    for key, section in groups.items():
        path = f"communication.tables_by_group_size.{key}"
        if not (isinstance(key, str) and key.isdigit() and int(key) >= 2):
            raise InvalidRequestError(f"profile field {path}: group sizes are integers >= 2", field="profile")
        if not isinstance(section, dict):
            raise InvalidRequestError(f"profile field {path} must be a JSON object of tables", field="profile")
        parsed[int(key)] = _tables(section, path)
    return parsed


def _world_size(communication: dict[str, Any]) -> int | None:
    value = communication.get("world_size")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(f"profile field communication.world_size must be an integer, got {value!r}",
                                  field="profile")
    return value


def parse_profile(data: dict[str, Any]) -> Profile:
    """Build a ``Profile`` from its JSON document, naming the first bad field."""
    if data.get("schema_version") != PROFILE_SCHEMA_VERSION:
        raise InvalidRequestError(
            f"profile schema_version must be {PROFILE_SCHEMA_VERSION}, got {data.get('schema_version')!r}",
            field="profile",
        )
    hardware = _section(data, "hardware", "")
    compute = _section(data, "compute", "")
    memory = _section(data, "memory", "")
    communication = _section(data, "communication", "")
    activation = _section(memory, "activation_bytes_per_token", "memory")
    static = _section(memory, "static_bytes_per_parameter", "memory")
    raw_tables = _section(communication, "tables", "communication")
    tables = _tables(raw_tables, "communication.tables")
    comm_fit = communication.get("fit", "absolute")
    if comm_fit not in ("absolute", "relative"):
        raise InvalidRequestError(f"profile field communication.fit must be 'absolute' or 'relative', got "
                                  f"{comm_fit!r}", field="profile")
    model = data.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidRequestError(f"profile field model must be a model name or null, got {model!r}",
                                  field="profile")
    return Profile(
        name=str(data.get("name", "unnamed")),
        description=str(data.get("description", "")),
        model=model,
        device=str(hardware.get("device", "unknown")),
        device_memory_bytes=_number(hardware, "device_memory_bytes", "hardware"),
        compute=ComputeProfile(
            alpha_s_per_flop=_number(compute, "alpha_s_per_flop", "compute"),
            beta_s_per_layer=_number(compute, "beta_s_per_layer", "compute"),
            alpha_s_per_token=_number(compute, "alpha_s_per_token", "compute", default=0.0),
            alpha_s_per_sequence=_number(compute, "alpha_s_per_sequence", "compute", default=0.0),
            attention_efficiency=_efficiency(compute),
        ),
        memory=MemoryProfile(
            activation_fixed_bytes_per_token=_number(activation, "fixed", "memory.activation_bytes_per_token"),
            activation_per_layer_hidden=_number(activation, "per_layer_hidden", "memory.activation_bytes_per_token"),
            activation_per_vocab=_number(activation, "per_vocab", "memory.activation_bytes_per_token"),
            beta_bytes=_number(memory, "beta_bytes", "memory"),
            reserved_bytes=_number(memory, "reserved_bytes", "memory"),
            replicated_bytes_per_parameter=_number(static, "replicated", "memory.static_bytes_per_parameter"),
            sharded_bytes_per_parameter=_number(static, "sharded", "memory.static_bytes_per_parameter"),
        ),
        communication=CommunicationProfile(
            kv_bytes_per_element=int(_number(communication, "kv_bytes_per_element", "communication")),
            tables=tables,
            relative_fit=comm_fit == "relative",
            world_size=_world_size(communication),
            tables_by_group_size=_group_tables(communication),
        ),
        raw=data,
    )


def load_profile(path: str | Path) -> Profile:
    """Read a profile file; errors name the file."""
    path = Path(path)
    try:
        if path.stat().st_size > _MAX_PROFILE_BYTES:
            raise InvalidRequestError(f"profile {path} is larger than {_MAX_PROFILE_BYTES} bytes", field="profile")
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise InvalidRequestError(f"cannot read profile {path}: {error}", field="profile") from error
    if not isinstance(data, dict):
        raise InvalidRequestError(f"profile {path} must hold a JSON object", field="profile")
    try:
        return parse_profile(data)
    except InvalidRequestError as error:
        raise InvalidRequestError(f"profile {path}: {error.message}", field="profile") from error


def load_profile_dir(directory: str | Path) -> dict[str, Profile]:
    """Every ``*.json`` profile in ``directory`` by name; the first bad file (or a duplicate name) is an error
    naming it, so a folder is accepted whole or not at all."""
    directory = Path(directory)
    if not directory.is_dir():
        raise InvalidRequestError(f"profile directory {directory} does not exist or is not a directory",
                                  field="profile_dir")
    profiles: dict[str, Profile] = {}
    origins: dict[str, Path] = {}
    for path in sorted(directory.glob("*.json")):
        profile = load_profile(path)
        if profile.name in profiles:
            raise InvalidRequestError(f"profiles {origins[profile.name]} and {path} are both named {profile.name!r}",
                                      field="profile_dir")
        profiles[profile.name] = profile
        origins[profile.name] = path
    return profiles


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
