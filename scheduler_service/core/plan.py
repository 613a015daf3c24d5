"""The planning problem and the plan: the value objects every scheduler shares.

A ``Plan`` mirrors the wire contract (DESIGN.md): per DP rank an ordered list
of micro-batches; per micro-batch ``cp_size`` lists of sequence indices kept
whole on that CP rank ("local"), one list sharded over the whole CP group
("distributed"), and hybrid DACP's ``sharded`` groups: sequences sharded over an
aligned block of CP ranks (``cp_blocks``). Indices point into
``PlanningProblem.sequence_lengths``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum

import numpy as np
import numpy.typing as npt

from scheduler_service.core.errors import InvalidRequestError, SequenceTooLongError
from scheduler_service.core.models import ModelShape, resolve_model
from scheduler_service.core.perf_model import PerformanceModel
from scheduler_service.core.profile import Profile, resolve_profile

__all__ = [
    "DEFAULT_LIMITS",
    "DPRankPlan",
    "MicroBatch",
    "Plan",
    "PlanLimits",
    "PlanningProblem",
    "SchedulerName",
    "ShardedGroup",
    "SolverReport",
    "block_degrees",
    "cp_blocks",
    "make_problem",
]


class SchedulerName(StrEnum):
    SKRULL = "skrull"
    SKRULL_BINARY = "skrull_binary"
    SKRULL_PAPER = "skrull_paper"
    DEEPSPEED = "deepspeed"
    SORTED = "sorted"
    ROUND_ROBIN = "round_robin"
    BALANCED = "balanced"
    CPSAT = "cpsat"


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanLimits:
    """Bounds that keep one request from exhausting the planner; the service makes them configurable."""

    max_sequences: int = 65536
    max_sequence_length: int = 1 << 24
    max_dp_size: int = 4096
    max_cp_size: int = 1024


DEFAULT_LIMITS = PlanLimits()


def block_degrees(cp_size: int) -> tuple[int, ...]:
    """Sizes a hybrid group may have: the divisors ``s`` of ``cp_size`` with ``2 <= s < cp_size``, ascending."""
    return tuple(s for s in range(2, cp_size) if cp_size % s == 0)


def cp_blocks(cp_size: int, degree: int) -> tuple[tuple[int, ...], ...]:
    """The aligned blocks of ``degree`` CP ranks: ``[0..s)``, ``[s..2s)``, … (DESIGN.md, "Hybrid DACP")."""
    return tuple(tuple(range(start, start + degree)) for start in range(0, cp_size, degree))


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardedGroup:
    """Sequences zigzag-sharded over ``cp_ranks``, an aligned block of the CP group (the checker verifies it)."""

    cp_ranks: tuple[int, ...]
    sequences: tuple[int, ...]

    @property
    def degree(self) -> int:
        return len(self.cp_ranks)


@dataclass(frozen=True, kw_only=True, slots=True)
class MicroBatch:
    local: tuple[tuple[int, ...], ...]  # one tuple per CP rank: indices kept whole there
    distributed: tuple[int, ...]  # indices sharded over the whole CP group
    sharded: tuple[ShardedGroup, ...] = ()  # hybrid DACP: indices sharded over part of the CP group

    def indices(self) -> list[int]:
        return ([index for rank_local in self.local for index in rank_local] + list(self.distributed)
                + [index for group in self.sharded for index in group.sequences])


@dataclass(frozen=True, kw_only=True, slots=True)
class DPRankPlan:
    micro_batches: tuple[MicroBatch, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    dp_ranks: tuple[DPRankPlan, ...]

    @property
    def num_micro_batches(self) -> int:
        return sum(len(dp_rank.micro_batches) for dp_rank in self.dp_ranks)


@dataclass(frozen=True, kw_only=True, slots=True)
class SolverReport:
    """What an exact solver proved about its answer."""

    status: str  # OPTIMAL | FEASIBLE | UNKNOWN | INFEASIBLE | MODEL_INVALID
    objective_s: float | None
    bound_s: float | None
    wall_time_s: float


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanningProblem:
    """One global batch to schedule, already validated."""

    sequence_lengths: tuple[int, ...]
    dp_size: int
    cp_size: int
    bucket_size: int  # C: tokens per CP rank per micro-batch
    perf: PerformanceModel
    lengths: npt.NDArray[np.int64] = field(init=False, repr=False)
    flops: npt.NDArray[np.float64] = field(init=False, repr=False)
    flops_list: tuple[float, ...] = field(init=False, repr=False)  # plain floats: fast scalar access in loops
    # Where a sequence can run: 1 (whole on one CP rank), each hybrid block size, cp_size (the whole group).
    degrees: tuple[int, ...] = field(init=False, repr=False)
    # degree -> per sequence, the FLOP-equivalents each rank of a group of that size computes for it
    placement: dict[int, tuple[float, ...]] = field(init=False, repr=False)
    local_attention: tuple[float, ...] = field(init=False, repr=False)  # the attention part of placement[1]
    # per sequence, the least rank-FLOP-equivalents it can cost: min over degrees d it fits (S <= d·C) of d·placement
    area: tuple[float, ...] = field(init=False, repr=False)
    alpha_s_per_flop: float = field(init=False, repr=False)
    beta_s: float = field(init=False, repr=False)  # β·L, paid once per micro-batch by each CP rank with work

    def __post_init__(self) -> None:
        lengths = np.asarray(self.sequence_lengths, dtype=np.int64)
        perf = self.perf
        set_field = functools.partial(object.__setattr__, self)
        set_field("lengths", lengths)
        set_field("flops", perf.flops_array(lengths))
        set_field("flops_list", tuple(self.flops.tolist()))
        degrees = (1, *block_degrees(self.cp_size), self.cp_size) if self.cp_size > 1 else (1,)
        set_field("degrees", degrees)
        per_degree = {degree: perf.placement_flops(lengths, degree) for degree in degrees}
        set_field("placement", {degree: tuple(costs.tolist()) for degree, costs in per_degree.items()})
        set_field("local_attention", tuple(perf.local_attention_flops(lengths).tolist()))
        areas = np.full(len(lengths), np.inf)
        for degree, costs in per_degree.items():
            fits = lengths <= degree * self.bucket_size
            areas = np.where(fits, np.minimum(areas, degree * costs), areas)
        set_field("area", tuple(areas.tolist()))
        set_field("alpha_s_per_flop", perf.profile.compute.alpha_s_per_flop)
        set_field("beta_s", perf.compute_beta_s)

    @property
    def num_sequences(self) -> int:
        return len(self.sequence_lengths)

    @property
    def micro_batch_capacity(self) -> int:
        """Tokens one micro-batch may hold over the whole CP group (eq. 10's C × N)."""
        return self.bucket_size * self.cp_size


def _validate_int(value: object, name: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise InvalidRequestError(f"{name} must be an integer, got {value!r}", field=name)
    if not low <= value <= high:
        raise InvalidRequestError(f"{name} must be between {low} and {high}, got {value}", field=name)
    return int(value)


def _validate_lengths(sequence_lengths: Sequence[int], limits: PlanLimits) -> tuple[int, ...]:
    if len(sequence_lengths) == 0:
        raise InvalidRequestError("sequence_lengths is empty: a global batch needs at least one sequence",
                                  field="sequence_lengths")
    if len(sequence_lengths) > limits.max_sequences:
        raise InvalidRequestError(
            f"sequence_lengths has {len(sequence_lengths)} sequences; at most {limits.max_sequences} are accepted",
            field="sequence_lengths",
        )
    for index, length in enumerate(sequence_lengths):
        if isinstance(length, bool) or not isinstance(length, int | np.integer):
            raise InvalidRequestError(f"sequence {index} length must be an integer, got {length!r}",
                                      field=f"sequence_lengths[{index}]")
        if length <= 0:
            raise InvalidRequestError(f"sequence {index} length must be positive, got {length}",
                                      field=f"sequence_lengths[{index}]")
        if length > limits.max_sequence_length:
            raise InvalidRequestError(
                f"sequence {index} has {length} tokens; the service accepts at most {limits.max_sequence_length}",
                field=f"sequence_lengths[{index}]",
            )
    return tuple(int(length) for length in sequence_lengths)


def make_problem(
    *,
    sequence_lengths: Sequence[int],
    dp_size: int,
    cp_size: int,
    model: str | ModelShape,
    bucket_size: int | None = None,
    profile: str | Profile | None = None,
    limits: PlanLimits = DEFAULT_LIMITS,
    extra_profiles: dict[str, Profile] | None = None,
) -> PlanningProblem:
    """Validate a request and derive what it leaves out (BucketSize from the profile)."""
    lengths = _validate_lengths(sequence_lengths, limits)
    dp_size = _validate_int(dp_size, "dp_size", 1, limits.max_dp_size)
    cp_size = _validate_int(cp_size, "cp_size", 1, limits.max_cp_size)
    perf = PerformanceModel(model=resolve_model(model), profile=resolve_profile(profile, extra_profiles))
    if bucket_size is None:
        # ZeRO-2 shards gradients and optimizer states over every rank holding a replica: DP × CP.
        bucket_size = perf.bucket_size(num_state_shards=dp_size * cp_size, cp_size=cp_size)
        if bucket_size <= 0:
            raise InvalidRequestError(
                f"model {perf.model.name} leaves no activation memory on {perf.profile.device} with "
                f"dp_size {dp_size} × cp_size {cp_size}; give bucket_size explicitly or use more ranks",
                field="bucket_size",
            )
    bucket_size = _validate_int(bucket_size, "bucket_size", 1, limits.max_sequence_length)
    for index, length in enumerate(lengths):
        if length > bucket_size * cp_size:
            raise SequenceTooLongError(index=index, num_tokens=length, bucket_size=bucket_size, cp_size=cp_size)
    return PlanningProblem(sequence_lengths=lengths, dp_size=dp_size, cp_size=cp_size, bucket_size=bucket_size,
                           perf=perf)
