"""The performance model of the Skrull paper, appendix C, with the fitting helpers the profiler uses.

* FLOPs of a sequence of ``S`` tokens (eq. 13, b = 1, summed over layers):
  ``L · (20·h²·S + 4·h·h_kv·S + 4·h·S²)``.
* Compute time ``T_comp = α·FLOPs + β`` (eq. 14); ``β`` is per layer, paid once
  per group of tokens that runs as one packed kernel sequence.
* A measured profile may add what eq. 13 leaves out: a cost per token (LM head,
  norms, element-wise kernels) and per sequence (one attention call per
  sequence and layer where the kernel is not varlen, as SDPA on CPU). Both are
  folded into each sequence's FLOPs as FLOP-equivalents (``cost / α``), so
  ``T_comp = α·ΣFLOPs + β`` stays the one formula every scheduler and the
  simulator use; with the shipped profiles they are 0 and FLOPs are eq. 13's.
* Activation memory ``M(S) = α·S + β`` (eq. 12) → BucketSize: the tokens per CP
  rank that fit beside the static memory (weights, gradients and optimizer
  states under ZeRO-2).
* Communication volume ``V = S·h_kv`` per layer (eq. 15), sent for K and V;
  ``T_comm = α·V + T_fixed`` (eq. 16), fitted by least squares to the profile's
  all-gather (forward) and reduce-scatter (backward) latency tables; free when
  the profile measured no collective (a single-process profile).

Fitting (``fit_compute``, ``fit_memory``): least squares on *relative* residuals
(micro-batch times span orders of magnitude, and a planner needs ratios right),
non-negative coefficients by exhaustive active sets (at most four unknowns).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache

import numpy as np
import numpy.typing as npt

from scheduler_service.core.errors import InvalidRequestError
from scheduler_service.core.models import ModelShape
from scheduler_service.core.profile import Profile

__all__ = [
    "ComputeFit",
    "ComputePoint",
    "LinearFit",
    "MemoryFit",
    "PerformanceModel",
    "eq13_flops",
    "fit_compute",
    "fit_line",
    "fit_memory",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class LinearFit:
    """``y = slope·x + intercept``, fitted by least squares."""

    slope: float
    intercept: float

    def __call__(self, x: float) -> float:
        return self.slope * x + self.intercept


_NO_COST = LinearFit(slope=0.0, intercept=0.0)


@cache  # profiles are parsed once but performance models are built per request
def fit_line(points: tuple[tuple[float, float], ...], relative: bool = False) -> LinearFit:
    """Least-squares line through (x, y) points, on absolute or (``relative``) relative error; both coefficients
    clamped at 0 (latencies never fall with size)."""
    xs = np.array([x for x, _ in points], dtype=np.float64)
    ys = np.array([y for _, y in points], dtype=np.float64)
    weights = 1.0 / np.maximum(ys, 1e-12) if relative else None
    slope, intercept = np.polyfit(xs, ys, deg=1, w=weights)
    return LinearFit(slope=max(float(slope), 0.0), intercept=max(float(intercept), 0.0))


def eq13_flops(model: ModelShape, lengths: npt.ArrayLike) -> npt.NDArray[np.float64]:
    """Forward FLOPs of eq. 13 (b = 1) summed over layers, one entry per sequence length."""
    s = np.asarray(lengths, dtype=np.float64)
    h, h_kv = float(model.hidden_size), float(model.kv_hidden_size)
    return model.num_layers * (20 * h * h * s + 4 * h * h_kv * s + 4 * h * s * s)


@dataclass(frozen=True, kw_only=True, slots=True)
class PerformanceModel:
    """Estimates for one model on one profiled machine."""

    model: ModelShape
    profile: Profile
    all_gather: LinearFit = field(init=False)
    reduce_scatter: LinearFit = field(init=False)
    _flops_per_token: float = field(init=False, repr=False)  # measured per-token cost, in FLOP-equivalents
    _flops_per_sequence: float = field(init=False, repr=False)  # measured per-sequence cost, in FLOP-equivalents

    def __post_init__(self) -> None:
        measured_for = self.profile.model
        if measured_for is not None and measured_for.lower() != self.model.name.lower():
            raise InvalidRequestError(
                f"profile {self.profile.name} was measured for model {measured_for}, not {self.model.name}: its "
                f"compute and memory coefficients hold for that model only; measure one for {self.model.name} "
                f"with python -m trainer_client.profile --model {self.model.name}",
                field="profile",
            )
        tables, relative = self.profile.communication.tables, self.profile.communication.relative_fit
        object.__setattr__(self, "all_gather", fit_line(tables["all_gather"], relative) if tables else _NO_COST)
        object.__setattr__(self, "reduce_scatter",
                           fit_line(tables["reduce_scatter"], relative) if tables else _NO_COST)
        compute = self.profile.compute
        object.__setattr__(self, "_flops_per_token", compute.alpha_s_per_token / compute.alpha_s_per_flop)
        object.__setattr__(self, "_flops_per_sequence", compute.alpha_s_per_sequence / compute.alpha_s_per_flop)

    # -- compute --------------------------------------------------------------
    def flops(self, num_tokens: float) -> float:
        """Compute cost of one sequence of ``num_tokens`` tokens: eq. 13 × layers, plus the profile's measured
        per-token and per-sequence costs as FLOP-equivalents (0 in profiles that do not measure them)."""
        return float(self.flops_array([num_tokens])[0])

    def flops_array(self, lengths: npt.ArrayLike) -> npt.NDArray[np.float64]:
        """``flops`` of many sequences at once."""
        s = np.asarray(lengths, dtype=np.float64)
        flops = eq13_flops(self.model, s)
        if self._flops_per_token or self._flops_per_sequence:
            flops = flops + self._flops_per_token * s + np.where(s > 0, self._flops_per_sequence, 0.0)
        return flops

    @property
    def compute_beta_s(self) -> float:
        return self.profile.compute.beta_s_per_layer * self.model.num_layers

    def compute_time_s(self, flops: float) -> float:
        """``T_comp`` (eq. 14) of a packed group of sequences; nothing to run costs nothing."""
        if flops <= 0:
            return 0.0
        return self.profile.compute.alpha_s_per_flop * flops + self.compute_beta_s

    # -- communication ----------------------------------------------------------
    def comm_bytes_per_layer(self, num_tokens: float) -> float:
        """Bytes of K and V of ``num_tokens`` distributed tokens in one layer (eq. 15, for K and V)."""
        return 2.0 * num_tokens * self.model.kv_hidden_size * self.profile.communication.kv_bytes_per_element

    def comm_time_s(self, num_tokens: float) -> float:
        """``T_comm`` (eq. 16) of a micro-batch's distributed tokens: an all-gather of K/V per layer
        forward and a reduce-scatter of dK/dV per layer backward."""
        if num_tokens <= 0:
            return 0.0
        message_bytes = self.comm_bytes_per_layer(num_tokens)
        return self.model.num_layers * (self.all_gather(message_bytes) + self.reduce_scatter(message_bytes))

    # -- memory -------------------------------------------------------------------
    @property
    def activation_bytes_per_token(self) -> float:
        """α of eq. 12 for this model."""
        memory, model = self.profile.memory, self.model
        return (
            memory.activation_fixed_bytes_per_token
            + memory.activation_per_layer_hidden * model.hidden_size * model.num_layers
            + memory.activation_per_vocab * model.vocab_size
        )

    def activation_bytes(self, num_tokens: float) -> float:
        """``M(S) = α·S + β`` (eq. 12)."""
        return self.activation_bytes_per_token * num_tokens + self.profile.memory.beta_bytes

    def static_bytes(self, num_state_shards: int) -> float:
        """Weights replicated; gradients and optimizer states sharded over ``num_state_shards`` ranks (ZeRO-2)."""
        memory, num_parameters = self.profile.memory, self.model.num_parameters
        return num_parameters * (
            memory.replicated_bytes_per_parameter + memory.sharded_bytes_per_parameter / num_state_shards
        )

    def peak_bytes(self, num_tokens: float, num_state_shards: int) -> float:
        """Predicted peak device memory of a micro-batch of ``num_tokens`` tokens per rank."""
        return (self.profile.memory.reserved_bytes + self.static_bytes(num_state_shards)
                + self.activation_bytes(num_tokens))

    def bucket_size(self, num_state_shards: int, device_memory_bytes: float | None = None) -> int:
        """BucketSize C: tokens per CP rank whose activations fit beside the static memory (appendix C.1)."""
        budget = device_memory_bytes if device_memory_bytes is not None else self.profile.device_memory_bytes
        free = budget - self.profile.memory.reserved_bytes - self.static_bytes(num_state_shards)
        free -= self.profile.memory.beta_bytes
        return max(int(free // self.activation_bytes_per_token), 0)


# ---- fitting ------------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class ComputePoint:
    """One measured packed group: its eq. 13 FLOPs, tokens, sequences, and the time it took."""

    flops: float
    num_tokens: int
    num_sequences: int
    time_s: float

    def __post_init__(self) -> None:
        if not (self.time_s > 0 and self.flops > 0 and self.num_tokens > 0 and self.num_sequences > 0):
            raise InvalidRequestError(f"a compute point needs positive flops, tokens, sequences and time: {self}",
                                      field="points")


@dataclass(frozen=True, kw_only=True, slots=True)
class ComputeFit:
    """Fitted compute coefficients and how well they reproduce the points they were fitted to."""

    alpha_s_per_flop: float
    alpha_s_per_token: float
    alpha_s_per_sequence: float
    beta_s_per_layer: float
    median_relative_error: float
    max_relative_error: float
    num_points: int

    def predict_s(self, point: ComputePoint, num_layers: int) -> float:
        return (self.alpha_s_per_flop * point.flops + self.alpha_s_per_token * point.num_tokens
                + self.alpha_s_per_sequence * point.num_sequences + self.beta_s_per_layer * num_layers)


def _nonnegative_relative_lstsq(
    features: npt.NDArray[np.float64], targets: npt.NDArray[np.float64], required: int
) -> npt.NDArray[np.float64]:
    """``argmin Σ ((X·c − y) / y)²`` over ``c ≥ 0`` with ``c[required] > 0``: every active set is tried (the
    non-negative optimum is the unconstrained optimum of one of them), the best feasible one wins."""
    rows = features / targets[:, None]
    ones = np.ones_like(targets)
    num_columns = features.shape[1]
    scale = np.abs(rows).max(axis=0)  # column scaling keeps the tiny α (s/FLOP) and β (s) comparable
    scale[scale == 0] = 1.0
    best: npt.NDArray[np.float64] | None = None
    best_cost = np.inf
    others = [column for column in range(num_columns) if column != required]
    for size in range(len(others) + 1):
        for subset in itertools.combinations(others, size):
            active = [required, *subset]
            solution, *_ = np.linalg.lstsq(rows[:, active] / scale[active], ones, rcond=None)
            coefficients = np.zeros(num_columns)
            coefficients[active] = solution / scale[active]
            if coefficients[required] <= 0 or (coefficients < 0).any():
                continue
            cost = float(np.sum((rows @ coefficients - 1.0) ** 2))
            if cost < best_cost:
                best, best_cost = coefficients, cost
    if best is None:
        raise InvalidRequestError("no non-negative fit exists: measured times do not grow with work", field="points")
    return best


def fit_compute(points: Sequence[ComputePoint], *, num_layers: int, extended: bool = True) -> ComputeFit:
    """Fit ``T = α·FLOPs + β·L`` (eq. 14; ``extended=False``) or with the per-token and per-sequence terms."""
    if len(points) < (4 if extended else 2):
        raise InvalidRequestError(f"fitting compute needs at least {4 if extended else 2} points, got {len(points)}",
                                  field="points")
    columns = [[p.flops for p in points]]
    if extended:
        columns += [[p.num_tokens for p in points], [p.num_sequences for p in points]]
    columns.append([num_layers] * len(points))
    features = np.array(columns, dtype=np.float64).T
    targets = np.array([p.time_s for p in points], dtype=np.float64)
    coefficients = _nonnegative_relative_lstsq(features, targets, required=0)
    errors = np.abs(features @ coefficients - targets) / targets
    alpha_token, alpha_sequence = (coefficients[1], coefficients[2]) if extended else (0.0, 0.0)
    return ComputeFit(
        alpha_s_per_flop=float(coefficients[0]), alpha_s_per_token=float(alpha_token),
        alpha_s_per_sequence=float(alpha_sequence), beta_s_per_layer=float(coefficients[-1]),
        median_relative_error=float(np.median(errors)), max_relative_error=float(errors.max()),
        num_points=len(points),
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryFit:
    """``M(S) = α·S + β`` over packed tokens per rank (eq. 12), with the fit's worst relative error."""

    bytes_per_token: float
    beta_bytes: float
    max_relative_error: float


def fit_memory(points: Sequence[tuple[int, float]]) -> MemoryFit:
    """Least squares through (tokens, activation bytes); β is clamped at 0 (a negative β would only ever
    raise the BucketSize)."""
    if len(points) < 2 or len({tokens for tokens, _ in points}) < 2:
        raise InvalidRequestError("fitting memory needs at least 2 distinct token counts", field="points")
    tokens = np.array([t for t, _ in points], dtype=np.float64)
    measured = np.array([m for _, m in points], dtype=np.float64)
    slope, intercept = np.polyfit(tokens, measured, deg=1)
    if slope <= 0:
        raise InvalidRequestError("activation memory does not grow with tokens; no fit", field="points")
    beta = max(float(intercept), 0.0)
    errors = np.abs(slope * tokens + beta - measured) / np.maximum(measured, 1.0)
    return MemoryFit(bytes_per_token=float(slope), beta_bytes=beta, max_relative_error=float(errors.max()))
