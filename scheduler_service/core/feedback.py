"""Closing the loop: refit a job's profile online from the micro-batch times and peak memory its trainer measured.

The offline profile (``core.profile``) is a prior. A trainer that opts in reports,
after each step, every micro-batch it ran: the sequence lengths on each CP rank
(local) and sharded over the group (distributed), the measured time, and, where
the device can say, the peak memory. ``observe`` turns each report into
observations and refits two things, robustly and in bounded memory:

* **compute**: the micro-batch time of the critical CP rank under the base
  profile (``costing.rank_time_s``) splits into a variable part ``W``
  (``α·FLOPs`` at each sequence's placement, with the profile's per-token and
  per-sequence terms) and the fixed part ``β·L`` paid once per micro-batch. The
  refit keeps the base profile's ratios inside ``W`` and fits ``t ≈ u·W + b``:
  one multiplier ``u`` on the variable cost and the fixed cost ``b``.
  Communication stays the base profile's (it is measured offline by the
  collective benchmark; a micro-batch time cannot tell hidden communication
  from compute): the part predicted to be exposed is subtracted from the
  measured time first. So does a profile's launch-bound floor: a micro-batch
  measured within ``LAUNCH_BOUND_MARGIN`` of it was set by the host's
  dispatch, says nothing about ``u`` and ``b``, and is left out.
* **memory**: ``peak ≈ m₀ + m₁·tokens`` over the tokens per CP rank (local +
  distributed / N); ``m₁`` becomes the activation bytes per token, ``m₀`` the
  static and fixed memory. When the fit (or any single measurement) puts the
  peak above ``headroom × budget``, the job's BucketSize is capped so that the
  next plans stay below it — before an out-of-memory error, not after.

Both fits minimise Huber's loss of *relative* residuals by iteratively
reweighted least squares (scale from the median absolute deviation), so a few
outliers (a step slowed by another process, a first-step warm-up) are
down-weighted rather than followed. A weak ridge pulls toward the base profile
scaled by the median ratio measured/predicted, which keeps the two-parameter
fit stable when the micro-batches are all alike; with fewer than
``min_two_parameter_samples`` observations only that scale is fitted. Memory is
bounded: each job keeps its last ``window`` observations of each kind (a
sliding window, which also follows slow drift); a refit costs
O(window) numpy work: about 2 ms per report of 8 micro-batches with full
windows of 256, measured on the 2-core development machine.

Everything here is pure: ``observe`` returns a new ``JobFeedback`` and never
mutates its input, so a rejected report leaves the job exactly as it was.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import numpy.typing as npt

from scheduler_service.core.costing import exposed_comm_s
from scheduler_service.core.errors import InvalidRequestError
from scheduler_service.core.models import ModelShape
from scheduler_service.core.perf_model import PerformanceModel
from scheduler_service.core.plan import MicroBatch, PlanningProblem, ShardedGroup, cp_blocks
from scheduler_service.core.profile import MIN_ALPHA_S_PER_FLOP, MemoryProfile, Profile
from scheduler_service.core.simulate import micro_batch_sums

# A micro-batch measured within this factor of the launch-bound floor was bound by it (the floor itself varies
# by about ±10 % between measurements on a GPU).
LAUNCH_BOUND_MARGIN = 1.15

__all__ = [
    "ComputeObservation",
    "FeedbackConfig",
    "GroupLengths",
    "JobFeedback",
    "MemoryObservation",
    "MicroBatchMeasurement",
    "effective_bucket_size",
    "job_key",
    "observe",
    "start_job",
]

_MAD_TO_SIGMA = 1.4826  # median absolute deviation → standard deviation for normal residuals
_MIN_SIGMA = 1e-3  # relative residuals below 0.1% are noise-free for our purpose; avoids weights blowing up
_RIDGE = 1e-3  # per observation, in normalised units: weak enough that the data win once they disagree
_IRLS_ITERATIONS = 30


@dataclass(frozen=True, kw_only=True, slots=True)
class FeedbackConfig:
    """How a job's refit behaves; the service makes these settings."""

    window: int = 256
    min_two_parameter_samples: int = 8
    huber_k: float = 1.345  # 95% efficiency under normal noise
    memory_headroom: float = 0.9  # fraction of the memory budget the plans may use

    def __post_init__(self) -> None:
        if self.window < 2:
            raise InvalidRequestError(f"feedback window must be at least 2, got {self.window}", field="window")
        if not 0 < self.memory_headroom <= 1:
            raise InvalidRequestError(f"memory headroom must lie in (0, 1], got {self.memory_headroom}",
                                      field="memory_headroom")
        if self.min_two_parameter_samples < 2:
            raise InvalidRequestError("min_two_parameter_samples must be at least 2",
                                      field="min_two_parameter_samples")


@dataclass(frozen=True, kw_only=True, slots=True)
class GroupLengths:
    """The lengths of a hybrid group's sequences, sharded over the aligned block ``cp_ranks``."""

    cp_ranks: tuple[int, ...]
    lengths: tuple[int, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class MicroBatchMeasurement:
    """One micro-batch as the trainer ran it: lengths per CP rank, sharded lengths, time, peak memory."""

    local_lengths: tuple[tuple[int, ...], ...]  # one tuple per CP rank: sequences kept whole there
    distributed_lengths: tuple[int, ...]  # sequences sharded over the CP group
    time_s: float  # the slowest CP rank's forward + backward
    peak_memory_bytes: float | None = None  # the largest over CP ranks; None where the device cannot tell
    sharded_lengths: tuple[GroupLengths, ...] = ()  # hybrid groups: sequences sharded over part of the CP group

    def __post_init__(self) -> None:
        if not (math.isfinite(self.time_s) and self.time_s > 0):
            raise InvalidRequestError(f"time must be positive and finite, got {self.time_s}", field="time_ms")
        if self.peak_memory_bytes is not None and not (
            math.isfinite(self.peak_memory_bytes) and self.peak_memory_bytes > 0
        ):
            raise InvalidRequestError(f"peak memory must be positive, got {self.peak_memory_bytes}",
                                      field="peak_memory_bytes")
        lengths = [*self.distributed_lengths, *(n for rank in self.local_lengths for n in rank),
                   *(n for group in self.sharded_lengths for n in group.lengths)]
        if not lengths:
            raise InvalidRequestError("a measured micro-batch holds no sequence", field="local_lengths")
        if any(n <= 0 for n in lengths):
            raise InvalidRequestError("sequence lengths must be positive", field="local_lengths")

    @property
    def cp_size(self) -> int:
        return len(self.local_lengths)

    @property
    def tokens_per_rank(self) -> float:
        """The memory-bound quantity: the largest local + distributed / N + groups' tokens / size over CP ranks."""
        tokens = [sum(rank) + sum(self.distributed_lengths) / self.cp_size for rank in self.local_lengths]
        for group in self.sharded_lengths:
            for cp_rank in group.cp_ranks:
                tokens[cp_rank] += sum(group.lengths) / len(group.cp_ranks)
        return max(tokens)


@dataclass(frozen=True, kw_only=True, slots=True)
class ComputeObservation:
    """One micro-batch's time split into what the compute refit's two coefficients multiply."""

    work_s: float  # the variable compute time under the base profile (u multiplies it)
    num_fixed: int  # fixed costs on the critical path, each β·L (b multiplies it): 1 per micro-batch
    time_s: float  # measured time minus the communication predicted to be exposed


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryObservation:
    """One micro-batch's peak memory against its tokens per CP rank."""

    tokens: float
    peak_bytes: float


@dataclass(frozen=True, kw_only=True, slots=True)
class _Fit:
    slope: float
    intercept: float
    median_relative_error: float
    num_downweighted: int


@dataclass(frozen=True, kw_only=True, slots=True)
class JobFeedback:
    """One job's refit state: the base profile, the recent observations and the refit they give."""

    job_id: str
    base: Profile
    # The base is the job's own, registered by its trainer rather than named from the profiles the service shares:
    # it stays the job's base for every plan that names no other profile.
    base_registered: bool = False
    model: ModelShape
    dp_size: int
    cp_size: int
    memory_budget_bytes: float
    config: FeedbackConfig
    profile: Profile  # the refit; the base until the first report
    compute_scale: float = 1.0  # u: refit variable compute cost / base
    fixed_s: float  # b: refit fixed cost per packed group (β·L)
    memory_slope: float | None = None  # m₁, bytes per token per rank, once memory was reported
    memory_intercept: float | None = None  # m₀
    bucket_cap: int | None = None  # the largest BucketSize that keeps the peak under headroom × budget
    fit_median_relative_error: float | None = None  # of the compute refit on its window
    num_observations: int = 0
    num_downweighted: int = 0  # observations of the window the robust fit treated as outliers
    compute_window: tuple[ComputeObservation, ...] = field(default=(), repr=False)
    memory_window: tuple[MemoryObservation, ...] = field(default=(), repr=False)


def job_key(job: JobFeedback) -> tuple[str, ModelShape, int, int]:
    """What a job's plans share: a plan that changes any of these restarts the job."""
    return job.base.name, job.model, job.dp_size, job.cp_size


def start_job(
    job_id: str, *, base: Profile, model: ModelShape, dp_size: int, cp_size: int,
    memory_budget_bytes: float | None = None, config: FeedbackConfig | None = None, base_registered: bool = False,
) -> JobFeedback:
    """A job with no report yet: plans use ``base`` unchanged."""
    PerformanceModel(model=model, profile=base)  # the base must fit the model (a measured profile names it)
    budget = memory_budget_bytes if memory_budget_bytes is not None else base.device_memory_bytes
    return JobFeedback(job_id=job_id, base=base, base_registered=base_registered, model=model, dp_size=dp_size,
                       cp_size=cp_size, memory_budget_bytes=budget, config=config or FeedbackConfig(), profile=base,
                       fixed_s=base.compute.beta_s_per_layer * model.num_layers)


# ---- observations ---------------------------------------------------------------------------------------------


def _as_micro_batch(perf: PerformanceModel, measurement: MicroBatchMeasurement) -> tuple[PlanningProblem, MicroBatch]:
    """The measured micro-batch as a one-micro-batch problem, so the simulator's per-rank sums apply to it."""
    lengths: list[int] = []

    def indices(group_lengths: Sequence[int]) -> tuple[int, ...]:
        lengths.extend(group_lengths)
        return tuple(range(len(lengths) - len(group_lengths), len(lengths)))

    local = tuple(indices(rank) for rank in measurement.local_lengths)
    distributed = indices(measurement.distributed_lengths)
    sharded = tuple(ShardedGroup(cp_ranks=group.cp_ranks, sequences=indices(group.lengths))
                    for group in measurement.sharded_lengths)
    problem = PlanningProblem(sequence_lengths=tuple(lengths), dp_size=1, cp_size=measurement.cp_size,
                              bucket_size=sum(lengths), perf=perf)
    return problem, MicroBatch(local=local, distributed=distributed, sharded=sharded)


def _compute_observation(job: JobFeedback, perf: PerformanceModel,
                         measurement: MicroBatchMeasurement) -> ComputeObservation | None:
    """The critical CP rank's time under the current refit, split into what ``u`` and ``b`` multiply."""
    problem, micro_batch = _as_micro_batch(perf, measurement)
    alpha, u, b = problem.alpha_s_per_flop, job.compute_scale, job.fixed_s
    sums = micro_batch_sums(problem, micro_batch)

    def exposed_s(cp_rank: int) -> float:
        return exposed_comm_s(problem.tables, u * float(sums.attention_flops[0, cp_rank]),
                              float(sums.all_gather_s[0, cp_rank]), float(sums.reduce_scatter_s[0, cp_rank]))

    work_flops = sums.work_flops[0].tolist()
    working = [r for r in range(problem.cp_size) if work_flops[r] > 0]
    critical = max(working, key=lambda r: u * alpha * work_flops[r] + b + exposed_s(r))
    if measurement.time_s <= LAUNCH_BOUND_MARGIN * problem.floor_s:
        return None  # at the launch-bound floor: the host's dispatch set the time, not the device's work
    remaining_s = measurement.time_s - exposed_s(critical)
    if remaining_s <= 0:
        return None  # all communication: the time says nothing about compute
    return ComputeObservation(work_s=alpha * work_flops[critical], num_fixed=1, time_s=remaining_s)


# ---- robust fitting -------------------------------------------------------------------------------------------


def _huber_fit(
    x1: npt.NDArray[np.float64], x2: npt.NDArray[np.float64], y: npt.NDArray[np.float64],
    prior: tuple[float, float], *, two_parameters: bool, huber_k: float,
) -> _Fit:
    """``y ≈ slope·x1 + intercept·x2`` with slope > 0, intercept ≥ 0, minimising Huber's loss of relative residuals.

    ``prior`` (slope, intercept) is first scaled by the median ratio y / prediction; with ``two_parameters``
    False that scaled prior is the answer, otherwise IRLS with a weak ridge toward it. Measurements far apart
    may overflow the arithmetic; the caller refuses a fit that is not finite (``_usable``), so numpy need not warn.
    """
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        return _huber_irls(x1, x2, y, prior, two_parameters=two_parameters, huber_k=huber_k)


def _huber_irls(
    x1: npt.NDArray[np.float64], x2: npt.NDArray[np.float64], y: npt.NDArray[np.float64],
    prior: tuple[float, float], *, two_parameters: bool, huber_k: float,
) -> _Fit:
    prior_prediction = prior[0] * x1 + prior[1] * x2
    scale = float(np.median(y / np.maximum(prior_prediction, 1e-300)))
    slope0, intercept0 = prior[0] * scale, prior[1] * scale
    if not two_parameters:
        return _summarise(x1, x2, y, slope0, intercept0, np.ones_like(y))
    design = np.stack([x1 / y, x2 / y], axis=1)  # relative residual of row i: 1 − design[i]·c
    column_scale = np.sqrt(np.mean(design**2, axis=0))
    usable = column_scale > 0
    column_scale[~usable] = 1.0
    normalised = design / column_scale
    q_prior = np.array([slope0, intercept0]) * column_scale
    ridge = _RIDGE * len(y)
    weights = np.ones_like(y)
    active = np.array([True, bool(usable[1])])
    q = q_prior.copy()
    for _ in range(_IRLS_ITERATIONS):
        q = _weighted_ridge(normalised, weights, q_prior, ridge, active)
        if active[1] and q[1] < 0:  # the intercept must not go negative: fit the slope alone
            active[1] = False
            q = _weighted_ridge(normalised, weights, q_prior, ridge, active)
        residuals = 1.0 - normalised @ q
        sigma = max(_MAD_TO_SIGMA * float(np.median(np.abs(residuals - np.median(residuals)))), _MIN_SIGMA)
        new_weights = np.minimum(1.0, huber_k * sigma / np.maximum(np.abs(residuals), 1e-300))
        if np.allclose(new_weights, weights, rtol=0, atol=1e-6):
            break
        weights = new_weights
    slope, intercept = float(q[0] / column_scale[0]), float(q[1] / column_scale[1]) if active[1] else 0.0
    if slope <= 0:
        slope, intercept = slope0, intercept0
    return _summarise(x1, x2, y, slope, intercept, weights)


def _weighted_ridge(
    design: npt.NDArray[np.float64], weights: npt.NDArray[np.float64], q_prior: npt.NDArray[np.float64],
    ridge: float, active: npt.NDArray[np.bool_],
) -> npt.NDArray[np.float64]:
    """argmin Σ wᵢ(1 − Aᵢ·q)² + ridge·‖q − q_prior‖² over the active columns (the others are 0)."""
    columns = np.flatnonzero(active)
    a = design[:, columns]
    lhs = a.T @ (weights[:, None] * a) + ridge * np.eye(len(columns))
    rhs = a.T @ weights + ridge * q_prior[columns]
    q = np.zeros(design.shape[1])
    q[columns] = np.linalg.solve(lhs, rhs)
    return q


def _summarise(x1: npt.NDArray[np.float64], x2: npt.NDArray[np.float64], y: npt.NDArray[np.float64],
               slope: float, intercept: float, weights: npt.NDArray[np.float64]) -> _Fit:
    errors = np.abs(slope * x1 + intercept * x2 - y) / y
    return _Fit(slope=slope, intercept=intercept, median_relative_error=float(np.median(errors)),
                num_downweighted=int(np.count_nonzero(weights < 0.5)))


def _spread(values: npt.NDArray[np.float64]) -> float:
    """Coefficient of variation; 0 for fewer than two values."""
    if len(values) < 2 or not np.mean(values) > 0:
        return 0.0
    return float(np.std(values) / np.mean(values))


# ---- the refit ------------------------------------------------------------------------------------------------


def observe(
    job: JobFeedback, measurements: Sequence[MicroBatchMeasurement], *, memory_budget_bytes: float | None = None,
) -> JobFeedback:
    """The job after one report: new observations in the windows, compute and memory refit, BucketSize cap."""
    for index, measurement in enumerate(measurements):
        if measurement.cp_size != job.cp_size:
            raise InvalidRequestError(
                f"micro-batch {index} has {measurement.cp_size} local lists; job {job.job_id} runs cp_size "
                f"{job.cp_size}", field=f"micro_batches[{index}].local_lengths")
        for group_index, group in enumerate(measurement.sharded_lengths):
            if len(group.cp_ranks) < 2 or group.cp_ranks not in cp_blocks(job.cp_size, len(group.cp_ranks)) \
                    or len(group.cp_ranks) >= job.cp_size:
                raise InvalidRequestError(
                    f"micro-batch {index} group {group_index} has CP ranks {list(group.cp_ranks)}: not an aligned "
                    f"block of a cp_size {job.cp_size} group", field=f"micro_batches[{index}].sharded_lengths"
                    f"[{group_index}].cp_ranks")
    if memory_budget_bytes is not None and not (math.isfinite(memory_budget_bytes) and memory_budget_bytes > 0):
        raise InvalidRequestError(f"memory budget must be positive, got {memory_budget_bytes}",
                                  field="memory_budget_bytes")
    config = job.config
    base_perf = PerformanceModel(model=job.model, profile=job.base)
    new_compute = [obs for m in measurements if (obs := _compute_observation(job, base_perf, m)) is not None]
    new_memory = [MemoryObservation(tokens=m.tokens_per_rank, peak_bytes=float(m.peak_memory_bytes))
                  for m in measurements if m.peak_memory_bytes is not None]
    compute_window = (*job.compute_window, *new_compute)[-config.window:]
    memory_window = (*job.memory_window, *new_memory)[-config.window:]
    job = replace(job, compute_window=compute_window, memory_window=memory_window,
                  num_observations=job.num_observations + len(measurements),
                  memory_budget_bytes=memory_budget_bytes or job.memory_budget_bytes)
    if compute_window:
        job = _refit_compute(job)
    if memory_window:
        job = _refit_memory(job)
    return replace(job, profile=_refit_profile(job))


def _refit_compute(job: JobFeedback) -> JobFeedback:
    window = job.compute_window
    x1 = np.array([obs.work_s for obs in window])
    x2 = np.array([float(obs.num_fixed) for obs in window])
    y = np.array([obs.time_s for obs in window])
    base_fixed_s = job.base.compute.beta_s_per_layer * job.model.num_layers
    # β is identifiable only if the ratio fixed : variable varies between observations.
    two = len(window) >= job.config.min_two_parameter_samples and _spread(x1 / np.maximum(x2, 1.0)) > 0.05
    fit = _huber_fit(x1, x2, y, (1.0, base_fixed_s), two_parameters=two, huber_k=job.config.huber_k)
    # Extreme (if valid) measurements: keep the coefficients the job had, also where the refit α would be smaller
    # than a profile's may be (its per-token costs would overflow as FLOP-equivalents).
    if not _usable(fit) or job.base.compute.alpha_s_per_flop * fit.slope < MIN_ALPHA_S_PER_FLOP:
        return job
    return replace(job, compute_scale=fit.slope, fixed_s=fit.intercept,
                   fit_median_relative_error=fit.median_relative_error, num_downweighted=fit.num_downweighted)


def _refit_memory(job: JobFeedback) -> JobFeedback:
    window = job.memory_window
    tokens = np.array([obs.tokens for obs in window])
    peaks = np.array([obs.peak_bytes for obs in window])
    base_perf = PerformanceModel(model=job.model, profile=job.base)
    num_shards = job.dp_size * job.cp_size
    prior_intercept = base_perf.peak_bytes(0, num_shards)
    two = len(window) >= job.config.min_two_parameter_samples and _spread(tokens) > 0.05
    fit = _huber_fit(tokens, np.ones_like(tokens), peaks, (base_perf.activation_bytes_per_token, prior_intercept),
                     two_parameters=two, huber_k=job.config.huber_k)
    if not _usable(fit):
        return job  # extreme (if valid) measurements: keep the coefficients and the cap the job had
    target = job.config.memory_headroom * job.memory_budget_bytes
    caps = [(target - fit.intercept) / fit.slope]
    for obs in window:  # a measured peak over the target shrinks the bucket even if the fit disagrees
        if obs.peak_bytes > target:
            fixed = min(fit.intercept, 0.5 * obs.peak_bytes)
            caps.append(obs.tokens * (target - fixed) / (obs.peak_bytes - fixed))
    # A cap beyond any real bucket (a slope of almost nothing) caps nothing; floor() of it would overflow.
    finite_caps = [math.floor(cap) for cap in caps if math.isfinite(cap)]
    cap = max(min(finite_caps), 1) if finite_caps else None
    return replace(job, memory_slope=fit.slope, memory_intercept=fit.intercept, bucket_cap=cap)


def _usable(fit: _Fit) -> bool:
    """A refit a job may adopt: a finite positive slope and a finite non-negative intercept. Measurements that
    are each valid but wildly apart can drive the arithmetic to inf or NaN; then the job keeps its model, so a
    report can only improve a job's model or leave it as it was."""
    return math.isfinite(fit.slope) and fit.slope > 0 and math.isfinite(fit.intercept) and fit.intercept >= 0


def _refit_profile(job: JobFeedback) -> Profile:
    """The base profile with the refit coefficients, as a valid profile document too (``raw``)."""
    base, u = job.base, job.compute_scale
    compute = replace(  # the attention-efficiency curve is a shape, not a scale: it stays the base profile's
        base.compute,
        alpha_s_per_flop=base.compute.alpha_s_per_flop * u,
        alpha_s_per_token=base.compute.alpha_s_per_token * u,
        alpha_s_per_sequence=base.compute.alpha_s_per_sequence * u,
        alpha_s_per_shard=base.compute.alpha_s_per_shard * u,
        alpha_s_per_ulysses_shard=base.compute.alpha_s_per_ulysses_shard * u,
        beta_s_per_layer=job.fixed_s / job.model.num_layers,
    )
    memory = base.memory
    if job.memory_slope is not None and job.memory_intercept is not None:
        static = PerformanceModel(model=job.model, profile=base).static_bytes(job.dp_size * job.cp_size)
        memory = replace(memory, activation_fixed_bytes_per_token=job.memory_slope, activation_per_layer_hidden=0.0,
                         activation_per_vocab=0.0,
                         beta_bytes=job.memory_intercept - memory.reserved_bytes - static)
    raw: dict[str, Any] = {
        **base.raw,
        "name": f"{base.name}+feedback",
        "description": f"{base.name} refit online from {job.num_observations} micro-batches measured by job "
                       f"{job.job_id}",
        "model": job.model.name,
        "compute": {**base.raw.get("compute", {}), "alpha_s_per_flop": compute.alpha_s_per_flop,
                    "alpha_s_per_token": compute.alpha_s_per_token,
                    "alpha_s_per_sequence": compute.alpha_s_per_sequence,
                    "alpha_s_per_shard": compute.alpha_s_per_shard,
                    "alpha_s_per_ulysses_shard": compute.alpha_s_per_ulysses_shard,
                    "beta_s_per_layer": compute.beta_s_per_layer},
        "memory": _memory_document(base.raw.get("memory", {}), memory),
    }
    return replace(base, name=raw["name"], description=raw["description"], model=job.model.name, compute=compute,
                   memory=memory, raw=raw)


def _memory_document(document: dict[str, Any], memory: MemoryProfile) -> dict[str, Any]:
    return {
        **document,
        "activation_bytes_per_token": {"fixed": memory.activation_fixed_bytes_per_token,
                                       "per_layer_hidden": memory.activation_per_layer_hidden,
                                       "per_vocab": memory.activation_per_vocab},
        "beta_bytes": memory.beta_bytes,
    }


def effective_bucket_size(job: JobFeedback, bucket_size: int, longest_sequence: int) -> int:
    """The BucketSize a plan of this job uses: ``bucket_size`` lowered to the memory cap, but never below what
    the longest sequence needs when sharded over the whole CP group (that plan would not exist at all)."""
    if job.bucket_cap is None or job.bucket_cap >= bucket_size:
        return bucket_size
    return max(job.bucket_cap, math.ceil(longest_sequence / job.cp_size))
