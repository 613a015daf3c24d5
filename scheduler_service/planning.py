"""Where plans are made: inline on the event loop, in the heavy pool, or in the CP-SAT pool.

Every plan's cost is estimated from its shape before any work (``cost``:
cells = micro-batches × ``cp_size`` local lists, plus sequences; and the
answer's bytes):

* its shape alone (sequences × ``cp_size``, the deepspeed baseline's cells)
  is a lower bound known before validating the batch, which itself costs ~3 µs
  per sequence: over ``max_plan_cells`` the request is refused at once (422
  naming the limit and the estimate); up to ``inline_max_cells`` it is
  validated and planned inline on the event loop (a few milliseconds, where a
  process hop would cost more than it saves);
* anything larger is validated and planned in the *heavy pool*, a bounded
  ``ProcessPoolExecutor`` (spawned, niced processes), so the event loop keeps
  answering ``/healthz``, ``/readyz`` and ``/metrics`` whatever the load, and
  the server's own memory does not grow with the plans (the answer comes back
  as bytes, with a small summary for the metrics). At most ``heavy_workers +
  heavy_queue`` requests are admitted; the next gets ``ServiceBusyError`` (429)
  with the seconds until the soonest admitted one should end (Retry-After).
* wherever it is validated, the full estimate (micro-batches from the bucket
  size, answer bytes with or without a breakdown) is checked against
  ``max_plan_cells`` and ``max_answer_bytes`` before planning.
* ``cpsat`` runs in its own pool of the same kind (``cpsat_workers`` +
  ``cpsat_queue``), with the request's time limit capped by the settings, so
  exact solves never delay heuristic plans; its batches are small, so they are
  validated here first and bad input never costs a solver slot.
* ``/feedback`` reports are estimated from their raw body (``cost``), refused
  over ``max_feedback_cells``, and parsed and refit in the heavy pool above
  ``inline_max_cells``.

Pool processes exit when the server process is gone, even after a SIGKILL
(``_exit_with_parent``).

Profiles and feedback (state this service keeps):

* profiles measured by the profiler are read from ``profile_dir`` at start-up
  (a bad file stops the start, naming it), again on ``POST /profiles/reload``,
  and when a request names a profile not loaded yet and the folder changed
  since it was last read; a folder is taken whole or not at all.
* a ``/plan`` request with a ``job_id`` registers the job (its base profile,
  model, DP and CP sizes). ``POST /feedback`` refits that job's profile
  (``core.feedback``, bounded per job) and its later plans use the refit and
  any lowered BucketSize. Jobs live in the job store (``job_store``: a SQLite
  file by default, Redis when ``state_url`` names one), so a restarted process
  resumes every job's refit and workers sharing the store share the jobs; at
  most ``feedback_max_jobs`` are kept, least recently used dropped. A report
  is adopted only onto the state it was refit from: a report that another
  (worker's) report or plan of the same job overtook is a 429, never a lost
  update.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import multiprocessing
import multiprocessing.connection
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TypeVar

from fastapi.exceptions import RequestValidationError
from prometheus_client import Counter, Gauge
from skrull_proto import (
    ComputeCoefficients,
    FeedbackRequest,
    FeedbackResponse,
    MemoryCoefficients,
    PlanRequest,
    SchedulerName,
)

from scheduler_service.core import feedback as core_feedback
from scheduler_service.core.errors import (
    InvalidRequestError,
)
from scheduler_service.core.feedback import FeedbackConfig, GroupLengths, JobFeedback, MicroBatchMeasurement
from scheduler_service.core.perf_model import PerformanceModel
from scheduler_service.core.plan import Plan, PlanLimits, PlanningProblem, block_degrees, cp_blocks
from scheduler_service.core.plan import SchedulerName as CoreSchedulerName
from scheduler_service.core.planner import HEURISTIC_SCHEDULERS, make_plan
from scheduler_service.core.profile import Profile, builtin_profiles, load_profile_dir
from scheduler_service.cost import baseline_cells, feedback_cells, plan_cost
from scheduler_service.disconnect import ClientWatch
from scheduler_service.job_store import StoredJob, job_key, open_job_store
from scheduler_service.metrics import Placement, ServiceMetrics
from scheduler_service.parsing import check_json_media_type, parse_feedback_request
from scheduler_service.problems import (
    FeedbackDisabledError,
    RequestLimitError,
    ServiceBusyError,
    ServiceUnavailableError,
    UnknownJobError,
)
from scheduler_service.settings import Settings
from scheduler_service.wire import request_model_and_profile, request_to_problem, result_to_response

__all__ = ["PlanSummary", "PlannedBatch", "PlanningService", "feedback_response", "plan_request", "refit_job"]

logger = logging.getLogger("scheduler_service.planning")

# A small mixed batch that touches every heuristic code path (local, distributed, roll-back); over 4 CP ranks,
# so hybrid groups (blocks of 2) are candidates too.
_WARMUP_LENGTHS = [128, 512, 2048, 8192, 30000, 300, 1000, 4000, 96, 16000, 700, 64] * 4
_WARMUP_BUCKET_SIZE = 16384
_WARMUP_CP_SIZE = 4
# Pool processes yield the CPU to the event loop (probes, small plans).
_POOL_NICE = 10
# A task is given up (503) only long after it should have ended: its expected time several times over (niced
# pool processes on a busy machine run slower than the calibration) plus a grace (spawn, imports, model building).
_POOL_PATIENCE = 4.0
_POOL_GRACE_S = 60.0
# Seconds per cell of the slowest measured plans (2 cores): only feeds Retry-After and the give-up time.
_SECONDS_PER_CELL = 15e-6
T = TypeVar("T")


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanSummary:
    """What the service records of a plan (metrics, feedback): small, so it crosses processes cheaply."""

    scheduler: str
    bucket_size: int
    bucket_lowered: bool  # the job's memory feedback lowered the bucket_size (requested or derived)
    solve_time_s: float
    speedup: float
    solver_status: str | None
    placements: dict[Placement, int]
    group_degrees: tuple[int, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class PlannedBatch:
    body: bytes  # the response's JSON, serialized where it was planned: never parsed again on the event loop
    summary: PlanSummary


def job_problem(problem: PlanningProblem, job: JobFeedback | None) -> PlanningProblem:
    """The request's problem (validated with its base profile) as the job's feedback plans it: the refit profile
    replaces the base one, and the memory cap lowers the BucketSize (the request's, or the one the base profile
    derives), never below what the longest sequence needs over the whole CP group."""
    if job is None:
        return problem
    if job.num_observations:
        problem = replace(problem, perf=PerformanceModel(model=problem.perf.model, profile=job.profile))
    bucket_size = core_feedback.effective_bucket_size(job, problem.bucket_size, max(problem.sequence_lengths))
    if bucket_size < problem.bucket_size:
        problem = replace(problem, bucket_size=bucket_size)
    return problem


@dataclass(frozen=True, kw_only=True, slots=True)
class CostLimits:
    """The most a plan may cost (``Settings.max_plan_cells``, ``max_answer_bytes``), checked where it is planned."""

    max_cells: int
    max_answer_bytes: int

    def check(self, problem: PlanningProblem, request: PlanRequest) -> None:
        """Refuse ``problem`` (as the job plans it) when its estimate is over a limit, naming limit and estimate."""
        cost = plan_cost(problem, CoreSchedulerName(request.scheduler.value), breakdown=request.breakdown)
        shape = (f"this plan would hold about {cost.num_micro_batches} micro-batches × cp_size {problem.cp_size} "
                 f"local lists for {problem.num_sequences} sequences, beside the deepspeed baseline's "
                 f"{problem.num_sequences} × {problem.cp_size}: an estimated {cost.cells} cells and a "
                 f"{cost.answer_bytes / 1e6:.1f} MB answer")
        advice = "use a larger bucket_size, a smaller cp_size or a smaller batch"
        if cost.cells > self.max_cells:
            raise RequestLimitError(f"{shape}; the service plans at most {self.max_cells} cells: {advice}",
                                    field="sequence_lengths", limit=self.max_cells)
        if cost.answer_bytes > self.max_answer_bytes:
            raise RequestLimitError(f"{shape}; the service answers at most {self.max_answer_bytes} bytes: "
                                    f"{advice}, or leave out the breakdown", field="sequence_lengths",
                                    limit=self.max_answer_bytes)


def plan_request(
    request: PlanRequest, limits: PlanLimits, time_limit_s: float | None = None,
    extra_profiles: dict[str, Profile] | None = None, job: JobFeedback | None = None,
    cost_limits: CostLimits | None = None,
) -> PlannedBatch:
    """Validate, estimate, plan, check and simulate one request (any scheduler), synchronously.

    ``job``: the request's feedback state; its refit profile replaces the named one and its memory cap lowers
    the BucketSize. ``cost_limits``: refuse the request before planning when its estimate is over them.
    """
    base = request_to_problem(request, limits=limits, extra_profiles=extra_profiles)
    problem = job_problem(base, job)
    if cost_limits is not None:
        cost_limits.check(problem, request)
    if time_limit_s is None:
        result = make_plan(problem, request.scheduler)
    else:
        result = make_plan(problem, request.scheduler, time_limit_s=time_limit_s)
    response = result_to_response(result, breakdown=request.breakdown)
    placements, group_degrees = _placements(result.plan)
    summary = PlanSummary(scheduler=response.scheduler.value, bucket_size=response.bucket_size,
                          bucket_lowered=problem.bucket_size < base.bucket_size,
                          solve_time_s=result.solve_time_s, speedup=response.speedup_vs_deepspeed,
                          solver_status=response.solver.status if response.solver else None,
                          placements=placements, group_degrees=tuple(group_degrees))
    return PlannedBatch(body=response.model_dump_json().encode(), summary=summary)


# ---- the pool process side -----------------------------------------------------------------------------------

def _init_worker() -> None:
    os.nice(_POOL_NICE)
    parent = multiprocessing.parent_process()
    if parent is not None:
        threading.Thread(target=_exit_with_parent, args=(parent.sentinel,), name="exit-with-parent",
                         daemon=True).start()


def _exit_with_parent(parent_sentinel: int) -> None:
    """Exit as soon as the server process is gone. A pool process otherwise outlives a server killed with
    SIGKILL: it holds both ends of its task queue, so it never reads an end of file. The parent's sentinel
    becomes readable when the parent dies, however it dies."""
    multiprocessing.connection.wait([parent_sentinel])
    os._exit(1)


def _plan_in_worker(
    request_json: bytes, limits: PlanLimits, time_limit_s: float | None, extra_profiles: dict[str, Profile],
    job: JobFeedback | None, cost_limits: CostLimits,
) -> PlannedBatch:
    """``plan_request`` in a pool process; a planning error is raised to the caller as it is (errors pickle)."""
    request = PlanRequest.model_validate_json(request_json)
    return plan_request(request, limits, time_limit_s, extra_profiles=extra_profiles, job=job,
                        cost_limits=cost_limits)


def _parse_feedback_in_worker(body: bytes) -> FeedbackRequest:
    # The first few hundred errors say all there is to say (and pickling a million would not be cheap).
    try:
        return parse_feedback_request(body, None)
    except RequestValidationError as error:
        raise RequestValidationError(error.errors()[:256]) from None


def _feedback_job_id_in_worker(body: bytes) -> str:
    """First phase of a heavy report: parse it (seconds for a few MB), so the event loop learns its job."""
    return _parse_feedback_in_worker(body).job_id


def _refit_in_worker(body: bytes, job: JobFeedback, max_sequence_length: int) -> JobFeedback:
    """Second phase: parse again (cheaper than sending a million parsed lists back and forth) and refit."""
    return refit_job(job, _parse_feedback_in_worker(body), max_sequence_length)


def _warm_planner() -> None:
    """Plan a small mixed batch with every heuristic: the first plans pay imports and caches."""
    for scheduler in HEURISTIC_SCHEDULERS:
        plan_request(PlanRequest(sequence_lengths=_WARMUP_LENGTHS, dp_size=2, cp_size=_WARMUP_CP_SIZE,
                                 bucket_size=_WARMUP_BUCKET_SIZE, scheduler=SchedulerName(scheduler.value)),
                     PlanLimits())


def _warm_worker() -> str:
    """Import the planner and CP-SAT and solve a tiny batch, so the first real request pays no start-up."""
    request = PlanRequest(sequence_lengths=[4000, 3000, 2000, 1000, 500, 200], dp_size=2, cp_size=2,
                          bucket_size=4096, scheduler=SchedulerName.CPSAT)
    batch = plan_request(request, PlanLimits(), time_limit_s=0.5)
    assert batch.summary.solver_status is not None
    return batch.summary.solver_status


def _placements(plan: Plan) -> tuple[dict[Placement, int], list[int]]:
    """Sequences per placement, and the size of every hybrid group, of one plan (for the metrics)."""
    counts = dict.fromkeys(Placement, 0)
    group_degrees = []
    for dp_rank in plan.dp_ranks:
        for micro_batch in dp_rank.micro_batches:
            counts[Placement.LOCAL] += sum(len(rank_local) for rank_local in micro_batch.local)
            counts[Placement.DISTRIBUTED] += len(micro_batch.distributed)
            for group in micro_batch.sharded:
                counts[Placement.SHARDED] += len(group.sequences)
                group_degrees.append(len(group.cp_ranks))
    return counts, group_degrees


# ---- feedback on the wire -------------------------------------------------------------------------------------

def _check_group_blocks(request: FeedbackRequest, cp_size: int) -> None:
    """Every reported hybrid group is an aligned block of the job's CP group (the plan checker's rule). A
    micro-batch with the wrong number of local lists is left to ``observe``, which names that first."""
    degrees = block_degrees(cp_size)
    for index, item in enumerate(request.micro_batches):
        if len(item.local_lengths) != cp_size:
            continue
        for group_index, group in enumerate(item.sharded_lengths):
            cp_ranks, degree = tuple(group.cp_ranks), len(group.cp_ranks)
            if not degrees:
                reason = f"is a hybrid group, but cp_size {cp_size} has none (no size 2 <= s < cp_size divides it)"
            elif degree not in degrees:
                reason = f"has {degree} CP ranks; a group of cp_size {cp_size} has a size in {list(degrees)}"
            elif cp_ranks not in cp_blocks(cp_size, degree):
                reason = (f"CP ranks {list(cp_ranks)} are not an aligned block (consecutive, ascending, starting "
                          f"at a multiple of {degree})")
            else:
                continue
            where = f"micro_batches[{index}].sharded_lengths[{group_index}]"
            raise InvalidRequestError(f"{where} {reason}", field=f"{where}.cp_ranks")


def _measurements(request: FeedbackRequest) -> list[MicroBatchMeasurement]:
    measurements = []
    for index, item in enumerate(request.micro_batches):
        try:
            measurements.append(MicroBatchMeasurement(
                local_lengths=tuple(tuple(rank) for rank in item.local_lengths),
                distributed_lengths=tuple(item.distributed_lengths), time_s=item.time_ms / 1e3,
                peak_memory_bytes=item.peak_memory_bytes,
                sharded_lengths=tuple(GroupLengths(cp_ranks=tuple(group.cp_ranks), lengths=tuple(group.lengths))
                                      for group in item.sharded_lengths),
            ))
        except InvalidRequestError as error:
            raise InvalidRequestError(f"micro_batches[{index}]: {error.message}",
                                      field=f"micro_batches[{index}].{error.field}") from None
    return measurements


def refit_job(job: JobFeedback, request: FeedbackRequest, max_sequence_length: int) -> JobFeedback:
    """The job refit from one report (pure: inline or in a pool process); a bad report raises."""
    for index, item in enumerate(request.micro_batches):
        longest = max([*item.distributed_lengths, *(n for rank in item.local_lengths for n in rank),
                       *(n for group in item.sharded_lengths for n in group.lengths)], default=0)
        if longest > max_sequence_length:
            raise RequestLimitError(f"micro_batches[{index}] holds a sequence of {longest} tokens; the service "
                                    f"accepts at most {max_sequence_length}", field=f"micro_batches[{index}]",
                                    limit=max_sequence_length)
    _check_group_blocks(request, job.cp_size)
    return core_feedback.observe(job, _measurements(request), memory_budget_bytes=request.memory_budget_bytes)


def feedback_response(job: JobFeedback) -> FeedbackResponse:
    compute = job.profile.compute
    memory = None
    if job.memory_slope is not None and job.memory_intercept is not None:
        memory = MemoryCoefficients(bytes_per_token=job.memory_slope, fixed_bytes=job.memory_intercept)
    return FeedbackResponse(
        job_id=job.job_id, model=job.model.name, base_profile=job.base.name, profile=job.profile.name,
        num_observations=job.num_observations, num_in_window=len(job.compute_window),
        num_downweighted=job.num_downweighted, compute_scale=job.compute_scale,
        compute=ComputeCoefficients(alpha_s_per_flop=compute.alpha_s_per_flop,
                                    alpha_s_per_token=compute.alpha_s_per_token,
                                    alpha_s_per_sequence=compute.alpha_s_per_sequence,
                                    beta_s_per_layer=compute.beta_s_per_layer),
        fit_median_relative_error=job.fit_median_relative_error, memory=memory,
        memory_budget_bytes=job.memory_budget_bytes, bucket_size_cap=job.bucket_cap,
    )


def _without_folder(message: str, directory: Path) -> str:
    """``message`` with the folder's path left out: answers never carry a server's file-system paths."""
    folder = str(directory).rstrip("/")
    return message.replace(folder + "/", "").replace(folder, "the profile folder")


# ---- the pools ------------------------------------------------------------------------------------------------

class _Pool:
    """A process pool with admission control: at most ``workers + queue`` tasks admitted at once; the next is
    refused with ``ServiceBusyError`` (429) and the seconds until the soonest admitted task should end."""

    def __init__(self, name: str, *, workers: int, queue: int, in_flight: Gauge, rejected: Counter,
                 alternative: str) -> None:
        self.name = name
        self.workers = workers
        self.capacity = workers + queue
        self._in_flight_gauge = in_flight
        self._rejected = rejected
        self._alternative = alternative  # what the 429 suggests instead of waiting
        self._executor: ProcessPoolExecutor | None = None
        self._deadlines: dict[int, float] = {}  # admitted task -> when it should end
        self._next_ticket = 0

    @property
    def in_flight(self) -> int:
        """Tasks admitted and not yet finished (running or waiting for a process)."""
        return len(self._deadlines)

    def start(self) -> None:
        self._executor = self._new_executor()

    def close(self) -> None:
        if self._executor is not None:
            # Queued tasks are dropped; running ones end by their own bounds (the time limit, the cost limit),
            # and waiting for them lets the processes exit cleanly.
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None

    def submit_unadmitted(self, fn: Callable[[], T]) -> Future[T]:
        """Start-up work (a warm-up) that bypasses admission."""
        assert self._executor is not None
        return self._executor.submit(fn)

    def _new_executor(self) -> ProcessPoolExecutor:
        # spawn, not fork: the server process has threads (event loop, anyio workers) that fork would copy mid-state.
        return ProcessPoolExecutor(max_workers=self.workers, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=_init_worker)

    async def run(self, fn: Callable[..., T], *args: object, expected_s: float, watch: ClientWatch | None) -> T:
        """``fn(*args)`` in a pool process, admitted or refused at once. The slot is held until the task really
        ends, even if its request stops waiting (``watch``: the client hung up): the process is busy until then.
        A task still queued when its request stops waiting is dropped."""
        now = time.monotonic()
        if self.in_flight >= self.capacity:
            self._rejected.inc()
            soonest_s = min(self._deadlines.values()) - now
            raise ServiceBusyError(
                f"the {self.name} pool is full ({self.workers} working + {self.capacity - self.workers} waiting); "
                f"retry later{self._alternative}", retry_after_s=max(1, math.ceil(soonest_s)), limit=self.capacity)
        executor = self._executor
        if executor is None:
            raise ServiceUnavailableError(f"the {self.name} pool is not running")
        ticket = self._next_ticket
        self._next_ticket += 1
        # A waiting task ends one expected time after the running ones; the estimate only feeds Retry-After.
        queued_behind = max(0, self.in_flight - self.workers + 1)
        self._deadlines[ticket] = now + expected_s * (1 + queued_behind)
        self._in_flight_gauge.inc()
        try:
            future = executor.submit(fn, *args)
        except (BrokenProcessPool, RuntimeError) as error:
            self._release(ticket)
            self._replace_broken(executor)
            raise ServiceUnavailableError(f"the {self.name} pool is unavailable; retry") from error
        loop = asyncio.get_running_loop()

        def release_on_loop(_: Future[T]) -> None:
            # Runs on the pool's manager thread; the bookkeeping stays on the event loop. A closed loop means the
            # app is gone, and its bookkeeping with it.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._release, ticket)

        future.add_done_callback(release_on_loop)
        try:
            result = asyncio.wrap_future(future)
            return await asyncio.wait_for(result if watch is None else watch.until_gone(result),
                                          timeout=_POOL_PATIENCE * expected_s * (1 + queued_behind) + _POOL_GRACE_S)
        except BrokenProcessPool as error:
            self._replace_broken(executor)
            raise ServiceUnavailableError(f"a {self.name} pool process died; retry") from error
        except TimeoutError as error:
            raise ServiceUnavailableError(f"the {self.name} pool did not finish within {_POOL_PATIENCE:g} × "
                                          f"{expected_s:g} s plus grace") from error

    def _release(self, ticket: int) -> None:
        if self._deadlines.pop(ticket, None) is not None:
            self._in_flight_gauge.dec()

    def _replace_broken(self, broken: ProcessPoolExecutor) -> None:
        if self._executor is broken:
            broken.shutdown(wait=False, cancel_futures=True)
            self._executor = self._new_executor()
            logger.error("a pool broke; started a new one", extra={"pool": self.name})


# ---- the service side ----------------------------------------------------------------------------------------

class PlanningService:
    """Owns the CP-SAT pool and the readiness state; one per app."""

    def __init__(self, settings: Settings, metrics: ServiceMetrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self.limits = settings.plan_limits
        self.ready = False
        self.cpsat_state = "not started"
        self.cpsat_pool = _Pool("cpsat", workers=settings.cpsat_workers, queue=settings.cpsat_queue,
                                in_flight=metrics.cpsat_in_flight, rejected=metrics.cpsat_rejected,
                                alternative=" or use a heuristic scheduler")
        self.heavy_pool = _Pool("heavy", workers=settings.heavy_workers, queue=settings.heavy_queue,
                                in_flight=metrics.heavy_in_flight, rejected=metrics.heavy_rejected,
                                alternative=" or send smaller requests")
        self.profiles: dict[str, Profile] = {}  # read from settings.profile_dir
        self.feedback_config = FeedbackConfig(window=settings.feedback_window,
                                              memory_headroom=settings.feedback_memory_headroom)
        # Called on the event loop only (the endpoints are async); refits and plans run in pool processes only
        # receive a job, an immutable snapshot.
        self.jobs = open_job_store(settings.state_url, max_jobs=settings.feedback_max_jobs)
        self._refitting: set[str] = set()  # jobs whose report is being refit in the heavy pool
        self._profile_dir_seen: object = None  # the folder's state at the last (re)load, successful or not

    @property
    def cpsat_in_flight(self) -> int:
        """cpsat requests admitted and not yet solved (solving or waiting for a worker)."""
        return self.cpsat_pool.in_flight

    # -- lifecycle

    def start(self) -> None:
        """Read the profile folder, start the pools, warm the planner (the first plan pays imports and caches),
        report ready."""
        self.reload_profiles()
        self.cpsat_pool.start()
        self.heavy_pool.start()
        if self.settings.cpsat_warmup:
            self.cpsat_state = "warming"
            self.cpsat_pool.submit_unadmitted(_warm_worker).add_done_callback(self._on_cpsat_warm)
            self.heavy_pool.submit_unadmitted(_warm_planner)  # spawned and warm before the first heavy request
        else:
            self.cpsat_state = "cold"
        if self.settings.warmup:
            started = time.perf_counter()
            _warm_planner()
            logger.info("planner warmed up", extra={"warmup_ms": round((time.perf_counter() - started) * 1e3, 1)})
        self.ready = True

    def close(self) -> None:
        self.ready = False
        self.cpsat_pool.close()
        self.heavy_pool.close()
        self.jobs.close()

    def _on_cpsat_warm(self, future: Future[str]) -> None:
        if future.cancelled():
            self.cpsat_state = "cancelled"
        elif (error := future.exception()) is not None:
            self.cpsat_state = f"failed: {type(error).__name__}"  # the log has the rest; answers carry no detail
            logger.error("cpsat warm-up failed", extra={"error": repr(error)})
        else:
            self.cpsat_state = "ready"

    # -- profiles

    def reload_profiles(self) -> list[str]:
        """Read ``profile_dir`` again (whole or not at all); the names it holds."""
        directory = self.settings.profile_dir
        if directory is None:
            return []
        self._profile_dir_seen = self._profile_dir_state()
        try:
            profiles = load_profile_dir(directory)
        except InvalidRequestError as error:
            # The log keeps the paths; the answer names files within the folder only.
            logger.warning("profile folder refused", extra={"profile_dir": str(directory), "error": error.message})
            raise InvalidRequestError(_without_folder(error.message, directory), field=error.field) from None
        clashes = sorted(set(profiles) & set(builtin_profiles()))
        if clashes:
            raise InvalidRequestError(f"profiles in the profile folder reuse shipped names: "
                                      f"{', '.join(clashes)}; rename them", field="profile_dir")
        self.profiles = profiles
        logger.info("profiles loaded", extra={"profile_dir": str(self.settings.profile_dir),
                                              "profiles": sorted(profiles)})
        return sorted(profiles)

    def _profile_dir_state(self) -> object:
        """What changes when a profile file is added, removed, renamed or rewritten (cheap: no file is read)."""
        directory = self.settings.profile_dir
        if directory is None:
            return None
        try:
            files = sorted((path.name, stat.st_mtime_ns, stat.st_size)
                           for path in Path(directory).glob("*.json") for stat in (path.stat(),))
            return Path(directory).stat().st_mtime_ns, tuple(files)
        except OSError as error:
            return repr(error)

    def _refresh_profiles_for(self, request: PlanRequest) -> None:
        """A request names a profile not loaded yet: it may have been added to the folder since. The folder is read
        again only if it changed since the last (re)load, so unknown names cost no reading (nor a bad file's
        re-parse) per request."""
        name = request.profile
        if name is None or name in self.profiles or name in builtin_profiles() or self.settings.profile_dir is None:
            return
        if self._profile_dir_state() == self._profile_dir_seen:
            return
        with contextlib.suppress(InvalidRequestError):  # the request then fails as an unknown profile
            self.reload_profiles()

    # -- feedback

    def _job_for(self, request: PlanRequest) -> JobFeedback | None:
        """The request's job as its plan will use it: the one kept, or a new one when its model, profile or sizes
        changed (or it is new). Kept only once the plan succeeds (``_keep_job``): a refused request changes no
        job. Model and profile are resolved without validating the batch, so this is cheap for any batch."""
        if request.job_id is None or not self.settings.feedback:
            return None
        model, profile = request_model_and_profile(request, extra_profiles=self.profiles)
        stored = self.jobs.get(request.job_id)
        if stored is not None and job_key(stored.job) == (profile.name, model, request.dp_size, request.cp_size):
            return stored.job
        return core_feedback.start_job(request.job_id, base=profile, model=model, dp_size=request.dp_size,
                                       cp_size=request.cp_size, config=self.feedback_config)

    def _keep_job(self, job: JobFeedback | None) -> None:
        """Register or refresh a job after a successful plan; a refit adopted meanwhile (same key) is kept."""
        if job is not None:
            self.metrics.feedback_jobs.set(self.jobs.keep(job))

    def job(self, job_id: str) -> JobFeedback:
        return self._stored_job(job_id).job

    def _stored_job(self, job_id: str) -> StoredJob:
        if not self.settings.feedback:
            raise FeedbackDisabledError()
        stored = self.jobs.get(job_id)
        if stored is None:
            raise UnknownJobError(job_id, max_jobs=self.settings.feedback_max_jobs)
        return stored

    async def feedback(self, body: bytes, content_type: str | None, *,
                       watch: ClientWatch | None = None) -> FeedbackResponse:
        """Refit a job from one report (raw JSON: a large report is parsed in the heavy pool, not here); a bad
        report raises and leaves the job as it was. One report per job at a time (the trainer sends them one
        after another); another meanwhile is a 429."""
        if not self.settings.feedback:
            raise FeedbackDisabledError()
        cells = feedback_cells(body)
        if cells > self.settings.max_feedback_cells:
            raise RequestLimitError(
                f"the report holds up to {cells} lists and lengths (estimated from its body); the service refits "
                f"at most {self.settings.max_feedback_cells} per report: report fewer micro-batches at a time",
                field="micro_batches", limit=self.settings.max_feedback_cells)
        if cells <= self.settings.inline_max_cells:
            request = parse_feedback_request(body, content_type)
            stored = self._admit_refit(request.job_id)
            updated = refit_job(stored.job, request, self.settings.max_sequence_length)
            return self._adopt_refit(stored, updated, len(request.micro_batches), request.step)
        check_json_media_type(content_type)  # here: the pool processes parse the JSON only
        expected_s = cells * _SECONDS_PER_CELL
        job_id = await self.heavy_pool.run(_feedback_job_id_in_worker, body, expected_s=expected_s, watch=watch)
        stored = self._admit_refit(job_id)
        job = stored.job
        self._refitting.add(job.job_id)
        try:
            updated = await self.heavy_pool.run(_refit_in_worker, body, job, self.settings.max_sequence_length,
                                                expected_s=expected_s, watch=watch)
        finally:
            self._refitting.discard(job.job_id)
        return self._adopt_refit(stored, updated, updated.num_observations - job.num_observations, None)

    def _admit_refit(self, job_id: str) -> StoredJob:
        stored = self._stored_job(job_id)
        if job_id in self._refitting:
            raise ServiceBusyError(f"job {job_id!r} has a report being refit; send the next one after it",
                                   retry_after_s=1, limit=1)
        return stored

    def _adopt_refit(self, stored: StoredJob, updated: JobFeedback, num_micro_batches: int,
                     step: int | None) -> FeedbackResponse:
        job_id = updated.job_id
        if not self.jobs.replace(stored, updated):
            raise ServiceBusyError(f"job {job_id!r} was refit (or restarted by a plan) by another request while "
                                   "this report was refit; send it again", retry_after_s=1, limit=1)
        self.metrics.feedback_micro_batches.inc(num_micro_batches)
        logger.info("feedback", extra={"job_id": job_id, "step": step, "micro_batches": num_micro_batches,
                                       "compute_scale": round(updated.compute_scale, 6),
                                       "bucket_size_cap": updated.bucket_cap})
        return feedback_response(updated)

    # -- planning

    async def plan(self, request: PlanRequest, *, watch: ClientWatch | None = None) -> PlannedBatch:
        """Where a plan runs is decided from the request's shape, before validating it (~3 µs per sequence):
        small ones inline; anything larger, validation included, in the heavy pool. ``watch``: stop waiting
        for a pool when the client hangs up."""
        if not self.ready:
            raise ServiceUnavailableError("the planner is still warming up")
        self._refresh_profiles_for(request)
        settings = self.settings
        cost_limits = CostLimits(max_cells=settings.max_plan_cells, max_answer_bytes=settings.max_answer_bytes)
        # A cp_size over its limit is left to validation, which names that limit.
        at_least = baseline_cells(len(request.sequence_lengths), min(request.cp_size, self.limits.max_cp_size))
        if at_least > settings.max_plan_cells:  # over the limit whatever the micro-batches: refused at once
            raise RequestLimitError(
                f"every plan of {len(request.sequence_lengths)} sequences on cp_size {request.cp_size} holds at "
                f"least {at_least} cells (the deepspeed baseline's sequences × cp_size local lists); the service "
                f"plans at most {settings.max_plan_cells}: use a smaller cp_size or a smaller batch",
                field="sequence_lengths", limit=settings.max_plan_cells)
        job = self._job_for(request)
        if request.scheduler is SchedulerName.CPSAT:
            batch = await self._plan_cpsat(request, job, cost_limits, watch)
        elif at_least <= settings.inline_max_cells:
            batch = plan_request(request, self.limits, extra_profiles=self.profiles, job=job,
                                 cost_limits=cost_limits)
        else:
            # Planning costs about twice the baseline's cells; the estimate only feeds Retry-After and the give-up.
            batch = await self.heavy_pool.run(_plan_in_worker, request.model_dump_json().encode(), self.limits,
                                              None, self.profiles, job, cost_limits,
                                              expected_s=2 * at_least * _SECONDS_PER_CELL, watch=watch)
        self._keep_job(job)
        summary = batch.summary
        if summary.bucket_lowered:
            self.metrics.feedback_bucket_lowered.inc()
        self.metrics.observe_plan(
            scheduler=summary.scheduler, solve_time_s=summary.solve_time_s, speedup=summary.speedup,
            num_sequences=len(request.sequence_lengths), solver_status=summary.solver_status,
            placements=summary.placements, group_degrees=summary.group_degrees,
        )
        return batch

    async def _plan_cpsat(self, request: PlanRequest, job: JobFeedback | None, cost_limits: CostLimits,
                          watch: ClientWatch | None) -> PlannedBatch:
        """Validated here first (a cpsat batch is small): bad input never takes a solver slot. The solver process
        builds its own problem (it cannot share this one)."""
        settings = self.settings
        if len(request.sequence_lengths) > settings.cpsat_max_sequences:
            raise InvalidRequestError(
                f"cpsat plans at most {settings.cpsat_max_sequences} sequences per request, got "
                f"{len(request.sequence_lengths)}; use a heuristic scheduler for larger batches",
                field="sequence_lengths",
            )
        problem = request_to_problem(request, limits=self.limits, extra_profiles=self.profiles)
        cost_limits.check(job_problem(problem, job), request)
        requested_s = request.time_limit_s or settings.cpsat_default_time_limit_s
        time_limit_s = min(float(requested_s), settings.cpsat_max_time_limit_s)
        return await self.cpsat_pool.run(_plan_in_worker, request.model_dump_json().encode(), self.limits,
                                         time_limit_s, self.profiles, job, cost_limits, expected_s=time_limit_s,
                                         watch=watch)
