"""The performance model of the Skrull paper, appendix C.

* FLOPs of a sequence of ``S`` tokens (eq. 13, b = 1, summed over layers):
  ``L · (20·h²·S + 4·h·h_kv·S + 4·h·S²)``.
* Compute time ``T_comp = α·FLOPs + β`` (eq. 14); ``β`` is per layer, paid once
  per group of tokens that runs as one packed kernel sequence.
* Activation memory ``M(S) = α·S + β`` (eq. 12) → BucketSize: the tokens per CP
  rank that fit beside the static memory (weights, gradients and optimizer
  states under ZeRO-2).
* Communication volume ``V = S·h_kv`` per layer (eq. 15), sent for K and V;
  ``T_comm = α·V + T_fixed`` (eq. 16), fitted by least squares to the profile's
  all-gather (forward) and reduce-scatter (backward) latency tables.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache

import numpy as np
import numpy.typing as npt

from scheduler_service.core.models import ModelShape
from scheduler_service.core.profile import Profile

__all__ = ["LinearFit", "PerformanceModel", "fit_line"]


@dataclass(frozen=True, kw_only=True, slots=True)
class LinearFit:
    """``y = slope·x + intercept``, fitted by least squares."""

    slope: float
    intercept: float

    def __call__(self, x: float) -> float:
        return self.slope * x + self.intercept


@cache  # profiles are parsed once but performance models are built per request
def fit_line(points: tuple[tuple[float, float], ...]) -> LinearFit:
    """Least-squares line through (x, y) points; both coefficients clamped at 0 (latencies never fall with size)."""
    xs = np.array([x for x, _ in points], dtype=np.float64)
    ys = np.array([y for _, y in points], dtype=np.float64)
    slope, intercept = np.polyfit(xs, ys, deg=1)
    return LinearFit(slope=max(float(slope), 0.0), intercept=max(float(intercept), 0.0))


@dataclass(frozen=True, kw_only=True, slots=True)
class PerformanceModel:
    """Estimates for one model on one profiled machine."""

    model: ModelShape
    profile: Profile
    all_gather: LinearFit = field(init=False)
    reduce_scatter: LinearFit = field(init=False)

    def __post_init__(self) -> None:
        tables = self.profile.communication.tables
        object.__setattr__(self, "all_gather", fit_line(tables["all_gather"]))
        object.__setattr__(self, "reduce_scatter", fit_line(tables["reduce_scatter"]))

    # -- compute --------------------------------------------------------------
    def flops(self, num_tokens: float) -> float:
        """Forward FLOPs of one sequence of ``num_tokens`` tokens (eq. 13 × layers)."""
        h, h_kv = self.model.hidden_size, self.model.kv_hidden_size
        per_layer = 20 * h * h * num_tokens + 4 * h * h_kv * num_tokens + 4 * h * num_tokens * num_tokens
        return float(self.model.num_layers * per_layer)

    def flops_array(self, lengths: npt.ArrayLike) -> npt.NDArray[np.float64]:
        """``flops`` of many sequences at once."""
        s = np.asarray(lengths, dtype=np.float64)
        h, h_kv = float(self.model.hidden_size), float(self.model.kv_hidden_size)
        return self.model.num_layers * (20 * h * h * s + 4 * h * h_kv * s + 4 * h * s * s)

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

    def bucket_size(self, num_state_shards: int, device_memory_bytes: float | None = None) -> int:
        """BucketSize C: tokens per CP rank whose activations fit beside the static memory (appendix C.1)."""
        budget = device_memory_bytes if device_memory_bytes is not None else self.profile.device_memory_bytes
        free = budget - self.profile.memory.reserved_bytes - self.static_bytes(num_state_shards)
        free -= self.profile.memory.beta_bytes
        return max(int(free // self.activation_bytes_per_token), 0)
