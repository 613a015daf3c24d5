"""Where plans are made: inline, in a thread, or in the CP-SAT process pool.

* Heuristic schedulers (everything but ``cpsat``) take about a millisecond for
  a few hundred sequences, so they run inline on the event loop: a thread hop
  costs more than it saves under the GIL and worsens tail latency. Batches
  above ``inline_max_sequences`` go to a worker thread so one huge batch does
  not stall every other request (and ``/healthz``) behind it.
* ``cpsat`` runs in a bounded ``ProcessPoolExecutor`` (spawned, niced worker
  processes) with the request's time limit capped by the settings. At most
  ``cpsat_workers + cpsat_queue`` cpsat requests are admitted; the next gets
  ``ServiceBusyError`` (429) with the seconds until the soonest solve ends.
  Heuristic requests never wait for CP-SAT: they do not share the pool, and
  the solver processes run at a lower CPU priority.

The request is validated by the core in this process first, so bad input is
answered at once and never costs a solver slot.

Profiles and feedback (state this service keeps, per process):

* profiles measured by the profiler are read from ``profile_dir`` at start-up
  (a bad file stops the start, naming it), again on ``POST /profiles/reload``,
  and when a request names a profile not loaded yet and the folder changed
  since it was last read; a folder is taken whole or not at all.
* a ``/plan`` request with a ``job_id`` registers the job (its base profile,
  model, DP and CP sizes). ``POST /feedback`` refits that job's profile
  (``core.feedback``, bounded per job) and its later plans use the refit and
  any lowered BucketSize. At most ``feedback_max_jobs`` jobs are kept, least
  recently used dropped. With several uvicorn workers each keeps its own jobs:
  run one worker (the sidecar pattern) when trainers send feedback.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import multiprocessing
import os
import time
from collections import OrderedDict
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, replace
from pathlib import Path

import anyio.to_thread
from skrull_proto import (
    ComputeCoefficients,
    FeedbackRequest,
    FeedbackResponse,
    MemoryCoefficients,
    PlanRequest,
    PlanResponse,
    SchedulerName,
)

from scheduler_service.core import feedback as core_feedback
from scheduler_service.core.errors import (
    InfeasiblePlanError,
    InvalidRequestError,
    PlanCheckError,
    PlanningError,
)
from scheduler_service.core.feedback import FeedbackConfig, GroupLengths, JobFeedback, MicroBatchMeasurement
from scheduler_service.core.perf_model import PerformanceModel
from scheduler_service.core.plan import PlanLimits, PlanningProblem, block_degrees, cp_blocks
from scheduler_service.core.planner import HEURISTIC_SCHEDULERS, make_plan
from scheduler_service.core.profile import Profile, builtin_profiles, load_profile_dir
from scheduler_service.metrics import Placement, ServiceMetrics
from scheduler_service.problems import (
    FeedbackDisabledError,
    RequestLimitError,
    ServiceBusyError,
    ServiceUnavailableError,
    UnknownJobError,
)
from scheduler_service.settings import Settings
from scheduler_service.wire import request_to_problem, result_to_response

__all__ = ["PlannedBatch", "PlanningService", "feedback_response", "plan_request"]

logger = logging.getLogger("scheduler_service.planning")

# A small mixed batch that touches every heuristic code path (local, distributed, roll-back); over 4 CP ranks,
# so hybrid groups (blocks of 2) are candidates too.
_WARMUP_LENGTHS = [128, 512, 2048, 8192, 30000, 300, 1000, 4000, 96, 16000, 700, 64] * 4
_WARMUP_BUCKET_SIZE = 16384
_WARMUP_CP_SIZE = 4
# Solver processes yield the CPU to the event loop's heuristic planning.
_CPSAT_NICE = 10
# Extra wall time allowed beyond a solve's time limit (spawn, model building, presolve) before giving up.
_CPSAT_GRACE_S = 30.0


@dataclass(frozen=True, kw_only=True, slots=True)
class PlannedBatch:
    response: PlanResponse
    body: bytes  # the response's JSON, serialized where it was planned


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


def plan_request(
    request: PlanRequest, limits: PlanLimits, time_limit_s: float | None = None,
    extra_profiles: dict[str, Profile] | None = None, job: JobFeedback | None = None,
    problem: PlanningProblem | None = None,
) -> PlannedBatch:
    """Validate, plan, check and simulate one request (any scheduler), synchronously.

    ``job``: the request's feedback state; its refit profile replaces the named one and its memory cap lowers
    the BucketSize. ``problem``: the request already validated (with its base profile), if it was.
    """
    if problem is None:
        problem = request_to_problem(request, limits=limits, extra_profiles=extra_profiles)
    problem = job_problem(problem, job)
    if time_limit_s is None:
        result = make_plan(problem, request.scheduler)
    else:
        result = make_plan(problem, request.scheduler, time_limit_s=time_limit_s)
    response = result_to_response(result, breakdown=request.breakdown)
    return PlannedBatch(response=response, body=response.model_dump_json().encode())


# ---- the CP-SAT worker process side ---------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True, slots=True)
class _WorkerOutcome:
    """What a solver process sends back; errors travel as data (core errors do not all pickle)."""

    body: bytes | None = None
    error_kind: str | None = None
    message: str = ""
    field: str | None = None
    violations: tuple[str, ...] = ()


def _init_worker() -> None:
    os.nice(_CPSAT_NICE)


def _solve_in_worker(
    request_json: bytes, limits: PlanLimits, time_limit_s: float, extra_profiles: dict[str, Profile] | None = None,
    job: JobFeedback | None = None,
) -> _WorkerOutcome:
    request = PlanRequest.model_validate_json(request_json)
    try:
        batch = plan_request(request, limits, time_limit_s, extra_profiles=extra_profiles, job=job)
    except PlanCheckError as error:
        return _WorkerOutcome(error_kind="check", message=error.message, violations=tuple(error.violations))
    except InfeasiblePlanError as error:
        return _WorkerOutcome(error_kind="infeasible", message=error.message, field=error.field)
    except PlanningError as error:
        return _WorkerOutcome(error_kind="invalid", message=error.message, field=error.field)
    return _WorkerOutcome(body=batch.body)


def _warm_worker() -> str:
    """Import CP-SAT and solve a tiny batch, so the first real request pays no start-up."""
    request = PlanRequest(sequence_lengths=[4000, 3000, 2000, 1000, 500, 200], dp_size=2, cp_size=2,
                          bucket_size=4096, scheduler=SchedulerName.CPSAT)
    batch = plan_request(request, PlanLimits(), time_limit_s=0.5)
    assert batch.response.solver is not None
    return batch.response.solver.status


def _raise_worker_error(outcome: _WorkerOutcome) -> None:
    if outcome.error_kind == "check":
        raise PlanCheckError(list(outcome.violations))
    if outcome.error_kind == "infeasible":
        raise InfeasiblePlanError(outcome.message, field=outcome.field)
    raise InvalidRequestError(outcome.message, field=outcome.field)


def _placements(response: PlanResponse) -> tuple[dict[Placement, int], list[int]]:
    """Sequences per placement, and the size of every hybrid group, of one plan (for the metrics)."""
    counts = dict.fromkeys(Placement, 0)
    group_degrees = []
    for dp_rank in response.dp_ranks:
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


# ---- the service side ----------------------------------------------------------------------------------------

class PlanningService:
    """Owns the CP-SAT pool and the readiness state; one per app."""

    def __init__(self, settings: Settings, metrics: ServiceMetrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self.limits = settings.plan_limits
        self.ready = False
        self.cpsat_state = "not started"
        self._pool: ProcessPoolExecutor | None = None
        self._cpsat_deadlines: dict[int, float] = {}  # admitted cpsat request -> when its solve should end
        self._next_ticket = 0
        self.profiles: dict[str, Profile] = {}  # read from settings.profile_dir
        self.feedback_config = FeedbackConfig(window=settings.feedback_window,
                                              memory_headroom=settings.feedback_memory_headroom)
        # No lock: every read and write of _jobs happens on the event loop (the endpoints are async); plans run
        # in worker threads or processes only receive a job, an immutable snapshot.
        self._jobs: OrderedDict[str, JobFeedback] = OrderedDict()
        self._profile_dir_seen: object = None  # the folder's state at the last (re)load, successful or not

    @property
    def cpsat_in_flight(self) -> int:
        """cpsat requests admitted and not yet solved (solving or waiting for a worker)."""
        return len(self._cpsat_deadlines)

    # -- lifecycle

    def start(self) -> None:
        """Read the profile folder, warm the planner (the first plan pays imports and caches), report ready."""
        self.reload_profiles()
        self._pool = self._new_pool()
        if self.settings.cpsat_warmup:
            self.cpsat_state = "warming"
            self._pool.submit(_warm_worker).add_done_callback(self._on_cpsat_warm)
        else:
            self.cpsat_state = "cold"
        if self.settings.warmup:
            started = time.perf_counter()
            for scheduler in HEURISTIC_SCHEDULERS:
                plan_request(PlanRequest(sequence_lengths=_WARMUP_LENGTHS, dp_size=2, cp_size=_WARMUP_CP_SIZE,
                                         bucket_size=_WARMUP_BUCKET_SIZE, scheduler=SchedulerName(scheduler.value)),
                             PlanLimits())
            logger.info("planner warmed up", extra={"warmup_ms": round((time.perf_counter() - started) * 1e3, 1)})
        self.ready = True

    def close(self) -> None:
        self.ready = False
        if self._pool is not None:
            # Queued solves are dropped; running ones end by their own time limit (at most
            # cpsat_max_time_limit_s), and waiting for them lets the processes exit cleanly.
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def _new_pool(self) -> ProcessPoolExecutor:
        # spawn, not fork: the server process has threads (event loop, anyio workers) that fork would copy mid-state.
        return ProcessPoolExecutor(max_workers=self.settings.cpsat_workers,
                                   mp_context=multiprocessing.get_context("spawn"), initializer=_init_worker)

    def _on_cpsat_warm(self, future: Future[str]) -> None:
        if future.cancelled():
            self.cpsat_state = "cancelled"
        elif (error := future.exception()) is not None:
            self.cpsat_state = f"failed: {type(error).__name__}: {error}"
            logger.error("cpsat warm-up failed", extra={"error": repr(error)})
        else:
            self.cpsat_state = "ready"

    # -- profiles

    def reload_profiles(self) -> list[str]:
        """Read ``profile_dir`` again (whole or not at all); the names it holds."""
        if self.settings.profile_dir is None:
            return []
        self._profile_dir_seen = self._profile_dir_state()
        profiles = load_profile_dir(self.settings.profile_dir)
        clashes = sorted(set(profiles) & set(builtin_profiles()))
        if clashes:
            raise InvalidRequestError(f"profiles in {self.settings.profile_dir} reuse shipped names: "
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

    def _job_for(self, request: PlanRequest, problem: PlanningProblem) -> JobFeedback | None:
        """The request's job, registered (or restarted, when its model, profile or sizes changed) by this plan."""
        if request.job_id is None or not self.settings.feedback:
            return None
        perf = problem.perf
        job = self._jobs.get(request.job_id)
        if job is None or (job.base.name, job.model, job.dp_size, job.cp_size) != (
            perf.profile.name, perf.model, problem.dp_size, problem.cp_size
        ):
            job = core_feedback.start_job(request.job_id, base=perf.profile, model=perf.model,
                                          dp_size=problem.dp_size, cp_size=problem.cp_size,
                                          config=self.feedback_config)
            self._jobs[request.job_id] = job
        self._jobs.move_to_end(request.job_id)
        while len(self._jobs) > self.settings.feedback_max_jobs:
            self._jobs.popitem(last=False)
        self.metrics.feedback_jobs.set(len(self._jobs))
        return job

    def job(self, job_id: str) -> JobFeedback:
        if not self.settings.feedback:
            raise FeedbackDisabledError()
        job = self._jobs.get(job_id)
        if job is None:
            raise UnknownJobError(job_id, max_jobs=self.settings.feedback_max_jobs)
        return job

    def feedback(self, request: FeedbackRequest) -> FeedbackResponse:
        """Refit a job from one report; a bad report raises and leaves the job as it was."""
        job = self.job(request.job_id)
        limit = self.settings.max_sequence_length
        for index, item in enumerate(request.micro_batches):
            longest = max([*item.distributed_lengths, *(n for rank in item.local_lengths for n in rank),
                           *(n for group in item.sharded_lengths for n in group.lengths)], default=0)
            if longest > limit:
                raise RequestLimitError(f"micro_batches[{index}] holds a sequence of {longest} tokens; the service "
                                        f"accepts at most {limit}", field=f"micro_batches[{index}]", limit=limit)
        _check_group_blocks(request, job.cp_size)
        updated = core_feedback.observe(job, _measurements(request), memory_budget_bytes=request.memory_budget_bytes)
        if self._jobs.get(request.job_id) is job:  # not restarted by a plan meanwhile
            self._jobs[request.job_id] = updated
            self._jobs.move_to_end(request.job_id)
        self.metrics.feedback_micro_batches.inc(len(request.micro_batches))
        logger.info("feedback", extra={"job_id": request.job_id, "step": request.step,
                                       "micro_batches": len(request.micro_batches),
                                       "compute_scale": round(updated.compute_scale, 6),
                                       "bucket_size_cap": updated.bucket_cap})
        return feedback_response(updated)

    # -- planning

    async def plan(self, request: PlanRequest) -> PlannedBatch:
        if not self.ready:
            raise ServiceUnavailableError("the planner is still warming up")
        self._refresh_profiles_for(request)
        extra = self.profiles
        # Validated once, with the base profile; the job's refit and bucket cap are applied to this problem.
        problem = request_to_problem(request, limits=self.limits, extra_profiles=extra)
        job = self._job_for(request, problem)
        if request.scheduler is SchedulerName.CPSAT:
            batch = await self._plan_cpsat(request, job)
        elif len(request.sequence_lengths) <= self.settings.inline_max_sequences:
            batch = plan_request(request, self.limits, extra_profiles=extra, job=job, problem=problem)
        else:
            batch = await anyio.to_thread.run_sync(plan_request, request, self.limits, None, extra, job, problem)
        if batch.response.bucket_size < problem.bucket_size:  # explicit or derived, feedback lowered it
            self.metrics.feedback_bucket_lowered.inc()
        response = batch.response
        placements, group_degrees = _placements(response)
        self.metrics.observe_plan(
            scheduler=response.scheduler.value, solve_time_s=response.solve_time_ms / 1e3,
            speedup=response.speedup_vs_deepspeed, num_sequences=len(request.sequence_lengths),
            solver_status=response.solver.status if response.solver else None,
            placements=placements, group_degrees=group_degrees,
        )
        return batch

    async def _plan_cpsat(self, request: PlanRequest, job: JobFeedback | None) -> PlannedBatch:
        """The request was validated by ``plan`` already: bad input never takes a solver slot. The solver process
        builds its own problem (it cannot share this one)."""
        settings = self.settings
        if len(request.sequence_lengths) > settings.cpsat_max_sequences:
            raise InvalidRequestError(
                f"cpsat plans at most {settings.cpsat_max_sequences} sequences per request, got "
                f"{len(request.sequence_lengths)}; use a heuristic scheduler for larger batches",
                field="sequence_lengths",
            )
        requested_s = request.time_limit_s or settings.cpsat_default_time_limit_s
        time_limit_s = min(float(requested_s), settings.cpsat_max_time_limit_s)
        now = time.monotonic()
        if self.cpsat_in_flight >= settings.cpsat_capacity:
            self.metrics.cpsat_rejected.inc()
            soonest_s = min(self._cpsat_deadlines.values()) - now
            raise ServiceBusyError(
                f"the cpsat pool is full ({settings.cpsat_workers} solving + {settings.cpsat_queue} waiting); "
                f"retry later or use a heuristic scheduler",
                retry_after_s=max(1, math.ceil(soonest_s)), limit=settings.cpsat_capacity,
            )
        pool = self._pool
        if pool is None:
            raise ServiceUnavailableError("the cpsat pool is not running")
        ticket = self._next_ticket
        self._next_ticket += 1
        # A waiting request's solve ends one time limit after the running ones; the estimate only feeds Retry-After.
        queued_behind = max(0, len(self._cpsat_deadlines) - settings.cpsat_workers + 1)
        self._cpsat_deadlines[ticket] = now + time_limit_s * (1 + queued_behind)
        self.metrics.cpsat_in_flight.inc()
        try:
            future = pool.submit(_solve_in_worker, request.model_dump_json().encode(), self.limits, time_limit_s,
                                 self.profiles, job)
        except (BrokenProcessPool, RuntimeError) as error:
            self._release(ticket)
            self._replace_broken_pool(pool)
            raise ServiceUnavailableError(f"the cpsat pool is unavailable ({error}); retry") from error
        # The slot is held until the solve really ends, even if this request gives up waiting for it. The
        # callback runs on the pool's manager thread; the bookkeeping stays on the event loop.
        loop = asyncio.get_running_loop()

        def release_on_loop(_: Future[_WorkerOutcome]) -> None:
            # A closed loop means the app is gone, and its bookkeeping with it.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._release, ticket)

        future.add_done_callback(release_on_loop)
        try:
            outcome = await asyncio.wait_for(asyncio.wrap_future(future),
                                             timeout=time_limit_s * (1 + queued_behind) + _CPSAT_GRACE_S)
        except BrokenProcessPool as error:
            self._replace_broken_pool(pool)
            raise ServiceUnavailableError("a cpsat worker process died; retry") from error
        except TimeoutError as error:
            raise ServiceUnavailableError(f"cpsat did not finish within {time_limit_s:g} s plus grace") from error
        if outcome.body is None:
            _raise_worker_error(outcome)
        assert outcome.body is not None
        return PlannedBatch(response=PlanResponse.model_validate_json(outcome.body), body=outcome.body)

    def _release(self, ticket: int) -> None:
        if self._cpsat_deadlines.pop(ticket, None) is not None:
            self.metrics.cpsat_in_flight.dec()

    def _replace_broken_pool(self, broken: ProcessPoolExecutor) -> None:
        if self._pool is broken:
            broken.shutdown(wait=False, cancel_futures=True)
            self._pool = self._new_pool()
            logger.error("cpsat pool broke; started a new one")
