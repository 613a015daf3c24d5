"""Hardware profiles: the fitted coefficients of the performance model.

A profile is a versioned JSON file (see ``profiles/h100-paper.json``): compute
``T_comp = α·FLOPs + β``, activation memory ``M(S) = α·S + β`` and the
collective latency tables ``T_comm`` is fitted from. Numbers live in data, each
with its source, never in code. Profiles measured for one model name it in
``model``; the shipped ones hold per-architecture formulas and fit any model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
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
    "parse_profile",
    "resolve_profile",
]

PROFILE_SCHEMA_VERSION = 1
DEFAULT_PROFILE = "h100-paper"
COLLECTIVES = ("all_gather", "reduce_scatter")


@dataclass(frozen=True, kw_only=True, slots=True)
class ComputeProfile:
    alpha_s_per_flop: float
    beta_s_per_layer: float


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
    # collective name -> ((message bytes, latency seconds), ...), sorted by size
    tables: dict[str, tuple[tuple[float, float], ...]]


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
        if self.device_memory_bytes <= 0:
            raise InvalidRequestError("profile hardware.device_memory_bytes must be positive", field="profile")
        if self.compute.alpha_s_per_flop <= 0 or self.compute.beta_s_per_layer < 0:
            raise InvalidRequestError("profile compute coefficients must be positive", field="profile")
        for collective in COLLECTIVES:
            table = self.communication.tables.get(collective, ())
            if len(table) < 2:
                raise InvalidRequestError(
                    f"profile communication.tables.{collective} needs at least 2 (bytes, seconds) points",
                    field="profile",
                )


def _number(data: dict[str, Any], key: str, path: str) -> float:
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidRequestError(f"profile field {path}.{key} must be a number, got {value!r}", field="profile")
    return float(value)


def parse_profile(data: dict[str, Any]) -> Profile:
    """Build a ``Profile`` from its JSON document, naming the first bad field."""
    if data.get("schema_version") != PROFILE_SCHEMA_VERSION:
        raise InvalidRequestError(
            f"profile schema_version must be {PROFILE_SCHEMA_VERSION}, got {data.get('schema_version')!r}",
            field="profile",
        )
    try:
        hardware, compute, memory, communication = (
            data["hardware"],
            data["compute"],
            data["memory"],
            data["communication"],
        )
        activation = memory["activation_bytes_per_token"]
        static = memory["static_bytes_per_parameter"]
        tables = {
            name: tuple(sorted((float(size), float(latency)) for size, latency in points))
            for name, points in communication["tables"].items()
        }
    except (KeyError, TypeError, ValueError) as error:
        raise InvalidRequestError(f"profile is missing or has a malformed field: {error}", field="profile") from error
    return Profile(
        name=str(data.get("name", "unnamed")),
        description=str(data.get("description", "")),
        model=data.get("model"),
        device=str(hardware.get("device", "unknown")),
        device_memory_bytes=_number(hardware, "device_memory_bytes", "hardware"),
        compute=ComputeProfile(
            alpha_s_per_flop=_number(compute, "alpha_s_per_flop", "compute"),
            beta_s_per_layer=_number(compute, "beta_s_per_layer", "compute"),
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
        ),
        raw=data,
    )


def load_profile(path: str | Path) -> Profile:
    """Read a profile file; errors name the file."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise InvalidRequestError(f"cannot read profile {path}: {error}", field="profile") from error
    if not isinstance(data, dict):
        raise InvalidRequestError(f"profile {path} must hold a JSON object", field="profile")
    return parse_profile(data)


@cache
def builtin_profiles() -> dict[str, Profile]:
    """The profiles shipped with the package, by name."""
    folder = resources.files("scheduler_service.core") / "profiles"
    files = (entry for entry in folder.iterdir() if entry.name.endswith(".json"))
    loaded = (parse_profile(json.loads(entry.read_text())) for entry in files)
    return {profile.name: profile for profile in loaded}


def resolve_profile(profile: str | Profile | None, extra: dict[str, Profile] | None = None) -> Profile:
    """A profile by name (``extra`` first, then the shipped ones); ``None`` means the default."""
    if isinstance(profile, Profile):
        return profile
    known = {**builtin_profiles(), **(extra or {})}
    name = profile or DEFAULT_PROFILE
    if name not in known:
        raise UnknownProfileError(name, list(known))
    return known[name]
