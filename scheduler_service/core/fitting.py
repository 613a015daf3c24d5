"""Fitting the performance model's coefficients to measured points, as the profiler does from its sweeps.

``fit_compute`` fits eq. 14 (``T = α·FLOPs + β·L``, with the measured per-token and per-sequence terms and the
launch-bound floor where asked: ``perf_model``'s module docstring) and ``fit_memory`` eq. 12 (``M(S) = α·S + β``).
Both fit least squares on *relative* residuals: micro-batch times span orders of magnitude, and a planner needs
ratios right. Compute coefficients are non-negative, found by exhaustive active sets (at most four unknowns).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from scheduler_service.core.errors import InvalidRequestError

__all__ = ["ComputeFit", "ComputePoint", "MemoryFit", "fit_compute", "fit_memory"]


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
    floor_s_per_layer: float = 0.0  # the launch-bound floor; 0: the additive form

    def predict_s(self, point: ComputePoint, num_layers: int) -> float:
        device_s = (self.alpha_s_per_flop * point.flops + self.alpha_s_per_token * point.num_tokens
                    + self.alpha_s_per_sequence * point.num_sequences + self.beta_s_per_layer * num_layers)
        return max(self.floor_s_per_layer * num_layers, device_s)


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


def _floor_s(times: npt.NDArray[np.float64]) -> float:
    """The floor that fits floor-bound times ``t`` best: ``2·min·max / (min + max)``, equally far, relatively, from
    the fastest and the slowest, the smallest worst relative error any one floor has over them.

    Floor-bound micro-batches of different work take the host's dispatch time, which jitters (98–125 ms on one
    H200 sweep, no pattern in sizes or mixes), so the floor is a constant met by noise rather than a line met by
    work. Least squares on relative error (``Σ(1/t) / Σ(1/t²)``) weights each time by ``1/t²`` and so leans to the
    fastest: on that sweep it gave 105.5 ms and a worst error of 15.5 %, this 110.1 ms and 11.8 %, and real
    floor-bound micro-batches (median 121 ms) were nearer it too."""
    fastest, slowest = float(times.min()), float(times.max())
    return 2 * fastest * slowest / (fastest + slowest)


def fit_compute(points: Sequence[ComputePoint], *, num_layers: int, extended: bool = True,
                floor: bool = False) -> ComputeFit:
    """Fit ``T = α·FLOPs + β·L`` (eq. 14; ``extended=False``) or with the per-token and per-sequence terms; with
    ``floor``, ``T = max(F, that)``, the launch-bound form (module docstring).

    The floor form is fitted exactly over its one non-linear choice, which points are floor-bound: for each
    ``k``, the ``k`` fastest points are held at ``F = floor_s(their times)`` and the linear part is fitted to the
    others; the ``k`` (0 included: no floor) whose ``max(F, linear)`` fits all points best wins."""
    num_unknowns = 4 if extended else 2
    if len(points) < num_unknowns:
        raise InvalidRequestError(f"fitting compute needs at least {num_unknowns} points, got {len(points)}",
                                  field="points")
    columns = [[p.flops for p in points]]
    if extended:
        columns += [[p.num_tokens for p in points], [p.num_sequences for p in points]]
    columns.append([num_layers] * len(points))
    features = np.array(columns, dtype=np.float64).T
    targets = np.array([p.time_s for p in points], dtype=np.float64)
    order = np.argsort(targets)
    best: tuple[float, float, npt.NDArray[np.float64]] | None = None  # (cost, floor, coefficients)
    for num_floor_bound in range(len(points) - num_unknowns + 1 if floor else 1):
        held = targets[order[:num_floor_bound]]
        floor_s = _floor_s(held) if num_floor_bound else 0.0
        rest = order[num_floor_bound:]
        try:
            coefficients = _nonnegative_relative_lstsq(features[rest], targets[rest], required=0)
        except InvalidRequestError:
            continue  # what is left does not grow with work: more of it is floor-bound, or none of it is
        cost = float(np.sum((np.maximum(floor_s, features @ coefficients) / targets - 1.0) ** 2))
        if best is None or cost < best[0]:
            best = (cost, floor_s, coefficients)
    if best is None:
        raise InvalidRequestError("no non-negative fit exists: measured times do not grow with work", field="points")
    _, floor_s, coefficients = best
    errors = np.abs(np.maximum(floor_s, features @ coefficients) - targets) / targets
    alpha_token, alpha_sequence = (coefficients[1], coefficients[2]) if extended else (0.0, 0.0)
    return ComputeFit(
        alpha_s_per_flop=float(coefficients[0]), alpha_s_per_token=float(alpha_token),
        alpha_s_per_sequence=float(alpha_sequence), beta_s_per_layer=float(coefficients[-1]),
        median_relative_error=float(np.median(errors)), max_relative_error=float(errors.max()),
        num_points=len(points), floor_s_per_layer=floor_s / num_layers,
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
