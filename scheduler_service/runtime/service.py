"""Where plans are made: inline on the event loop, in the heavy pool, or in the CP-SAT pool.

A ``/plan`` body is parsed and its job read here; ``work.admit_plan`` admits it
(every check, once, in this process), and the service only decides where that
and the planning run: the pools receive what was admitted
(``work.ValidatedPlan``) and only plan it. Bodies over 64 KB are parsed, and
batches larger than an inline plan admitted, in a worker thread, so the event
loop keeps answering.

Every plan's cost is estimated from its shape before any work (``cost``:
cells = micro-batches × ``cp_size`` local lists, plus sequences; and the
answer's bytes):

* its shape alone (sequences × ``cp_size``, the deepspeed baseline's cells)
  is a lower bound known before validating the batch, which itself costs ~3 µs
  per sequence: over ``max_plan_cells`` the request is refused at once (422
  naming the limit and the estimate); up to ``inline_max_cells`` it is
  validated and planned inline on the event loop (a few milliseconds, where a
  process hop would cost more than it saves);
* a ``search_budget`` over the limit (``max_search_budget``) is refused before
  any work; one over ``inline_max_search_budget`` (a larger budget searches
  longer: up to about a second on 256 sequences) sends the request to the
  heavy pool whatever its size;
* anything larger is planned in the *heavy pool*, a bounded
  ``ProcessPoolExecutor`` (spawned, niced processes), so the event loop keeps
  answering ``/healthz``, ``/readyz`` and ``/metrics`` whatever the load, and
  the server's own memory does not grow with the plans (the plan comes back
  as bytes, with a small summary for the metrics). At most ``heavy_workers +
  heavy_queue`` requests are admitted, before they are validated; the next
  gets ``ServiceBusyError`` (429) with the seconds until the soonest admitted
  one should end (Retry-After).
* the full estimate (micro-batches from the bucket size, answer bytes with or
  without a breakdown) is checked against ``max_plan_cells`` and
  ``max_answer_bytes`` as the request is validated, before planning.
* ``cpsat`` runs in its own pool of the same kind (``cpsat_workers`` +
  ``cpsat_queue``), with the request's time limit capped by the settings, so
  exact solves never delay heuristic plans; its batches are small, so they are
  validated before taking a slot and bad input never costs a solver slot.
* ``/feedback`` reports are estimated from their raw body (``cost``), refused
  over ``max_feedback_cells``, and parsed and refit in the heavy pool above
  ``inline_max_cells``.

The work itself is ``work``'s, wherever it runs; the pools are
``pools.WorkerPool``s; the profile folder is a ``profiles.ProfileFolder``;
what happens is reported to ``events.ServiceEvents`` (the web layer's metrics).

Profiles and feedback (state this service keeps):

* profiles measured by the profiler are read from ``profile_dir``
  (``profiles.ProfileFolder``), and read again when the folder changed, so every
  uvicorn worker follows a reload that one of them answered.
* a ``/plan`` request with a ``job_id`` registers the job (its base profile,
  model, DP and CP sizes). A trainer may register the job first with a profile
  of its own (``PUT /jobs/{job_id}/profile``, ``register_profile``): a profile it
  measured, which the service does not share (``GET /models`` never lists it),
  stays the job's base while its plans name no other profile, and is forgotten
  with the job. ``POST /feedback`` refits that job's profile
  (``core.feedback``, bounded per job) and its later plans use the refit and
  any lowered BucketSize. Jobs live in the job store (``job_store``: a SQLite
  file by default, Redis when ``state_url`` names one), so a restarted process
  resumes every job's refit and workers sharing the store share the jobs; at
  most ``feedback_max_jobs`` are kept, least recently used dropped. Every call
  of the store runs in a worker thread (``job_store.AsyncJobStore``): a store
  that hangs holds the requests that need a job until its call times out, and
  nothing else (not ``/healthz``, not a plan without a ``job_id``). A report
  is adopted only onto the state it was refit from: a report that another
  (worker's) report or plan of the same job overtook is a 429, never a lost
  update.
* a job store that fails (a corrupt or full file, a read-only folder, an
  unreachable or hung server) does not stop planning: a plan whose job could
  not be read plans as a request without a ``job_id`` (the base profile), and
  every plan that met the failure says so in its answer (``job_state``).
  Reports and reads of a job answer 503 with Retry-After, and apply nothing.
  The store reports its state to ``/readyz`` and its failures to the metrics,
  and is used again at the next request once it is back (``job_store``).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

import anyio.to_thread
from skrull_proto import FeedbackResponse, JobProfileRequest, PlanRequest, ProfileDocument, SchedulerName
from skrull_proto.advise import AdviseRequest

from scheduler_service.contract.wire import document_to_profile, job_to_feedback_response, request_model
from scheduler_service.core import feedback as core_feedback
from scheduler_service.core import jit
from scheduler_service.core.errors import InvalidRequestError
from scheduler_service.core.feedback import FeedbackConfig, JobFeedback, job_key
from scheduler_service.core.profile import Profile, builtin_profiles
from scheduler_service.runtime.advising import advise_in_worker, check_sample_size
from scheduler_service.runtime.cost import baseline_cells, feedback_cells, search_seconds
from scheduler_service.runtime.errors import (
    FeedbackDisabledError,
    JobStoreUnavailableError,
    RequestLimitError,
    ServiceBusyError,
    ServiceUnavailableError,
    UnknownJobError,
)
from scheduler_service.runtime.events import ClientWatch, ServiceEvents
from scheduler_service.runtime.job_store import AsyncJobStore, StoredJob, open_job_store
from scheduler_service.runtime.parsing import check_json_media_type, parse_feedback_request, parse_plan_request
from scheduler_service.runtime.pools import WorkerPool, feedback_job_id_in_worker, refit_in_worker, warm_cpsat_worker
from scheduler_service.runtime.profiles import ProfileFolder
from scheduler_service.runtime.settings import Settings
from scheduler_service.runtime.work import (
    admit_plan,
    plan_validated,
    refit_job,
    requested_search_budget,
    warm_planner,
)

__all__ = ["PlanningService"]

T = TypeVar("T")

logger = logging.getLogger("scheduler_service.runtime.service")

# Bodies up to this size (about 10,000 sequences) are parsed on the event loop; larger ones in a thread.
_INLINE_MAX_BODY_BYTES = 64 << 10
# Seconds per cell of the slowest measured plans (2 cores): only feeds Retry-After and the give-up time.
_SECONDS_PER_CELL = 15e-6


class PlanningService:
    """Owns the CP-SAT pool and the readiness state; one per app."""

    def __init__(self, settings: Settings, events: ServiceEvents) -> None:
        self.settings = settings
        self.events = events
        self.limits = settings.plan_limits
        self.ready = False
        self.cpsat_state = "not started"
        self.cpsat_pool = WorkerPool("cpsat", workers=settings.cpsat_workers, queue=settings.cpsat_queue,
                                     events=events, alternative=" or use a heuristic scheduler")
        self.heavy_pool = WorkerPool("heavy", workers=settings.heavy_workers, queue=settings.heavy_queue,
                                     events=events, alternative=" or send smaller requests")
        self.profile_folder = ProfileFolder(settings.profile_dir)
        self.feedback_config = FeedbackConfig(window=settings.feedback_window,
                                              memory_headroom=settings.feedback_memory_headroom)
        # Each call in a worker thread (a hung store holds only the requests that wait for it); refits and plans
        # run in pool processes only receive a job, an immutable snapshot.
        self.jobs = AsyncJobStore(open_job_store(settings.state_url, max_jobs=settings.feedback_max_jobs,
                                                 events=events))
        self._refitting: set[str] = set()  # jobs whose report is being refit in the heavy pool

    @property
    def cpsat_in_flight(self) -> int:
        """cpsat requests admitted and not yet solved (solving or waiting for a worker)."""
        return self.cpsat_pool.in_flight

    @property
    def profiles(self) -> dict[str, Profile]:
        """The profiles read from ``settings.profile_dir``, read again first if the folder changed (another
        worker's reload, or files changed): every worker serves the folder as last read whole."""
        self.profile_folder.refresh()
        return self.profile_folder.profiles

    # -- lifecycle

    def start(self) -> None:
        """Read the profile folder, start the pools, warm the planner (the first plan pays imports and caches),
        report ready."""
        self.profile_folder.reload()
        self.cpsat_pool.start()
        self.heavy_pool.start()
        if self.settings.cpsat_warmup:
            self.cpsat_state = "warming"
            self.cpsat_pool.submit_unadmitted(warm_cpsat_worker).add_done_callback(self._on_cpsat_warm)
            self.heavy_pool.submit_unadmitted(warm_planner)  # spawned and warm before the first heavy request
        else:
            self.cpsat_state = "cold"
        if self.settings.warmup:
            started = time.perf_counter()
            warm_planner()
            logger.info("planner warmed up", extra={"warmup_ms": round((time.perf_counter() - started) * 1e3, 1),
                                                    "jit_cache_dir": str(jit.cache_dir())})
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
        return self.profile_folder.reload()

    # -- feedback

    async def _stored_job_for(self, request: PlanRequest) -> tuple[JobFeedback | None, str | None]:
        """The request's job as the store keeps it (None: no ``job_id``, feedback off, or none kept), and the
        store's state where it could not be read: the request then plans as one without a ``job_id`` (the base
        profile), and its answer says so."""
        if request.job_id is None or not self.settings.feedback:
            return None, None
        try:
            stored = await self.jobs.get(request.job_id)
        except JobStoreUnavailableError as failure:
            return None, failure.job_state  # this call's failure: the store's own may have changed since
        return (None if stored is None else stored.job), None

    async def register_profile(self, job_id: str, request: JobProfileRequest) -> FeedbackResponse:
        """Make a profile its trainer measured the job's base (``PUT /jobs/{job_id}/profile``), the job keyed by the
        request's model and sizes as its plans key it. The same profile and key again change nothing (the refit
        goes on); any other restarts the job from the profile. A name the service's shared profiles already use
        is refused unless the numbers are the same: a plan that names it must mean one profile, also when the
        job was forgotten."""
        if not self.settings.feedback:
            raise FeedbackDisabledError()
        profile = document_to_profile(request.profile)
        shared = {**builtin_profiles(), **self.profiles}.get(profile.name)
        if shared is not None and document_to_profile(ProfileDocument.model_validate(shared.raw)) != profile:
            raise InvalidRequestError(
                f"profile {profile.name!r} is the name of a profile the service shares (shipped, or in its profile "
                "folder), with other numbers: give the measured profile a name of its own", field="profile.name")
        job = core_feedback.start_job(job_id, base=profile, model=request_model(request.model),
                                      dp_size=request.dp_size, cp_size=request.cp_size, config=self.feedback_config,
                                      base_registered=True)
        stored = await self.jobs.get(job_id)
        if stored is not None and stored.job.base_registered and stored.job.base == profile \
                and job_key(stored.job) == job_key(job):
            self.events.jobs_kept(await self.jobs.keep(stored.job))  # registered already: used, its refit kept
            return job_to_feedback_response(stored.job)
        self.events.jobs_kept(await self.jobs.register(job))
        logger.info("profile registered", extra={"job_id": job_id, "profile": profile.name,
                                                 "model": job.model.name, "dp_size": job.dp_size,
                                                 "cp_size": job.cp_size})
        return job_to_feedback_response(job)

    async def _keep_job(self, job: JobFeedback | None) -> str | None:
        """Register or refresh a job after a successful plan; a refit adopted meanwhile (same key) is kept. The
        store's state if it failed: the plan stands (it used the job as read, or a new job's base profile), and
        its answer says so."""
        if job is None:
            return None
        try:
            self.events.jobs_kept(await self.jobs.keep(job))
        except JobStoreUnavailableError as failure:
            return failure.job_state  # this call's failure: the store's state may have changed since, in a thread
        return None

    async def job(self, job_id: str) -> JobFeedback:
        return (await self._stored_job(job_id)).job

    async def _stored_job(self, job_id: str) -> StoredJob:
        if not self.settings.feedback:
            raise FeedbackDisabledError()
        stored = await self.jobs.get(job_id)
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
            stored = await self._admit_refit(request.job_id)
            updated = refit_job(stored.job, request, self.settings.max_sequence_length)
            return await self._adopt_refit(stored, updated, len(request.micro_batches), request.step)
        check_json_media_type(content_type)  # here: the pool processes parse the JSON only
        expected_s = cells * _SECONDS_PER_CELL
        job_id = await self.heavy_pool.run(feedback_job_id_in_worker, body, expected_s=expected_s, watch=watch)
        stored = await self._admit_refit(job_id)
        job = stored.job
        self._refitting.add(job.job_id)
        try:
            updated = await self.heavy_pool.run(refit_in_worker, body, job, self.settings.max_sequence_length,
                                                expected_s=expected_s, watch=watch)
        finally:
            self._refitting.discard(job.job_id)
        return await self._adopt_refit(stored, updated, updated.num_observations - job.num_observations, None)

    async def _admit_refit(self, job_id: str) -> StoredJob:
        stored = await self._stored_job(job_id)
        if job_id in self._refitting:
            raise ServiceBusyError(f"job {job_id!r} has a report being refit; send the next one after it",
                                   retry_after_s=1, limit=1)
        return stored

    async def _adopt_refit(self, stored: StoredJob, updated: JobFeedback, num_micro_batches: int,
                           step: int | None) -> FeedbackResponse:
        job_id = updated.job_id
        if not await self.jobs.replace(stored, updated):
            raise ServiceBusyError(f"job {job_id!r} was refit (or restarted by a plan) by another request while "
                                   "this report was refit; send it again", retry_after_s=1, limit=1)
        self.events.feedback_adopted(num_micro_batches)
        logger.info("feedback", extra={"job_id": job_id, "step": step, "micro_batches": num_micro_batches,
                                       "compute_scale": round(updated.compute_scale, 6),
                                       "bucket_size_cap": updated.bucket_cap})
        return job_to_feedback_response(updated)

    # -- planning

    async def plan(self, body: bytes, content_type: str | None, *, watch: ClientWatch | None = None,
                   named: Callable[[SchedulerName], None] | None = None) -> bytes:
        """The answer to one ``POST /plan`` body. The body is parsed and its job read here; ``work.admit_plan``
        admits it, and the service decides where that and the planning run: inline, in a worker thread, in the
        heavy pool or in the CP-SAT pool. A heavy request takes its pool slot before it is admitted (a full pool
        refuses it before that work); a cpsat request after (bad input never takes a solver slot). A request that
        its shape alone puts over a limit (``max_plan_cells``, ``max_search_budget``) is admitted inline, which
        refuses it at once. ``named``: told
        the request's scheduler as soon as it is parsed (the metrics label every answer with it). ``watch``: stop
        waiting for a pool when the client hangs up."""
        # Parsing (or describing the errors of) a huge body must not stall the event loop.
        request = await _maybe_in_thread(
            functools.partial(parse_plan_request, body, content_type, limits=self.limits),
            inline=len(body) <= _INLINE_MAX_BODY_BYTES)
        if named is not None:
            named(request.scheduler)
        if not self.ready:
            raise ServiceUnavailableError("the planner is still warming up")
        settings = self.settings
        stored_job, job_state = await self._stored_job_for(request)
        admit = functools.partial(admit_plan, request, settings, profiles=self.profiles, stored_job=stored_job,
                                  feedback=self.feedback_config if settings.feedback else None)
        at_least = baseline_cells(len(request.sequence_lengths), min(request.cp_size, self.limits.max_cp_size))
        search_budget = requested_search_budget(request, settings) or 0
        # Refused at once by the admission, whose first checks these are: no thread, no pool slot.
        over_a_limit = at_least > settings.max_plan_cells or search_budget > self.limits.max_search_budget
        # Admission costs ~3 µs per sequence: off the event loop for anything larger than an inline plan.
        admit_inline = at_least <= settings.inline_max_cells or over_a_limit
        if request.scheduler is SchedulerName.CPSAT:  # admitted before taking a slot: bad input never takes one
            admitted = await _maybe_in_thread(admit, inline=admit_inline)
            validated = admitted.validated
            assert validated.time_limit_s is not None
            batch = await self.cpsat_pool.run(plan_validated, validated, expected_s=validated.time_limit_s,
                                              watch=watch)
        elif admit_inline and (search_budget <= settings.inline_max_search_budget or over_a_limit):
            admitted = admit()
            batch = plan_validated(admitted.validated)
        else:
            # Planning costs about twice the baseline's cells, plus the search asked for; the estimate only feeds
            # Retry-After and the give-up.
            expected_s = 2 * at_least * _SECONDS_PER_CELL + search_seconds(search_budget, at_least)
            with self.heavy_pool.admit(expected_s=expected_s) as slot:  # a full pool refuses before admission
                admitted = await _maybe_in_thread(admit, inline=admit_inline)
                batch = await slot.run(plan_validated, admitted.validated, watch=watch)
        job_state = await self._keep_job(admitted.job) or job_state
        self.events.plan_made(batch.summary, num_sequences=len(request.sequence_lengths))
        return batch.answer(job_state)

    async def advise(self, request: AdviseRequest, *, watch: ClientWatch | None = None) -> bytes:
        """The advice document for ``request`` (``advising``): the sample's size is checked here, the request's
        values, its estimated work and the pricing itself in the heavy pool, whatever its size (tens of plans
        at least)."""
        if not self.ready:
            raise ServiceUnavailableError("the planner is still warming up")
        settings, limits = self.settings, self.settings.advise_limits
        check_sample_size(request, limits)
        expected_s = settings.max_advise_cells * _SECONDS_PER_CELL  # only feeds Retry-After and the give-up
        document: bytes = await self.heavy_pool.run(
            advise_in_worker, request.model_dump_json().encode(), limits, settings.max_advise_cells, self.profiles,
            expected_s=expected_s, watch=watch)
        return document

async def _maybe_in_thread(fn: Callable[[], T], *, inline: bool) -> T:
    """``fn()`` on the event loop when it is cheap (``inline``), else in a worker thread, which keeps the loop
    answering probes and small plans meanwhile."""
    return fn() if inline else await anyio.to_thread.run_sync(fn)
