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
* a ``search_budget`` over the limit (``max_search_budget``) is refused before
  any work; one over ``inline_max_search_budget`` (a larger budget searches
  longer: up to about a second on 256 sequences) sends the request to the
  heavy pool whatever its size;
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
  most ``feedback_max_jobs`` are kept, least recently used dropped. A report
  is adopted only onto the state it was refit from: a report that another
  (worker's) report or plan of the same job overtook is a 429, never a lost
  update.
* a job store that fails (a corrupt or full file, a read-only folder, an
  unreachable server) does not stop planning: a plan whose job could not be
  read plans as a request without a ``job_id`` (the base profile), and every
  plan that met the failure says so in its answer (``job_state``). Reports and
  reads of a job answer 503 with Retry-After, and apply nothing. The store
  reports its state to ``/readyz`` and its failures to the metrics, and is used
  again at the next request once it is back (``job_store``).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future

from skrull_proto import FeedbackResponse, JobProfileRequest, PlanRequest, ProfileDocument, SchedulerName
from skrull_proto.advise import AdviseRequest

from scheduler_service.contract.wire import (
    document_to_profile,
    job_to_feedback_response,
    request_model,
    request_to_problem,
)
from scheduler_service.core import feedback as core_feedback
from scheduler_service.core import jit
from scheduler_service.core.errors import InvalidRequestError
from scheduler_service.core.feedback import FeedbackConfig, JobFeedback
from scheduler_service.core.profile import Profile, builtin_profiles, resolve_profile
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
from scheduler_service.runtime.job_store import StoredJob, job_key, open_job_store
from scheduler_service.runtime.parsing import check_json_media_type, parse_feedback_request
from scheduler_service.runtime.pools import (
    WorkerPool,
    feedback_job_id_in_worker,
    plan_in_worker,
    refit_in_worker,
    warm_cpsat_worker,
)
from scheduler_service.runtime.profiles import ProfileFolder
from scheduler_service.runtime.settings import Settings
from scheduler_service.runtime.work import (
    CostLimits,
    PlannedBatch,
    check_search_budget,
    job_problem,
    plan_request,
    refit_job,
    warm_planner,
)

__all__ = ["PlanningService"]

logger = logging.getLogger("scheduler_service.runtime.service")

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
        # Called on the event loop only (the endpoints are async); refits and plans run in pool processes only
        # receive a job, an immutable snapshot.
        self.jobs = open_job_store(settings.state_url, max_jobs=settings.feedback_max_jobs, events=events)
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

    def _job_for(self, request: PlanRequest, profiles: dict[str, Profile]) -> JobFeedback | None:
        """The request's job as its plan will use it: the one kept, or a new one when its model, profile or sizes
        changed (or it is new). A base profile the job's trainer registered stays the base while the request names
        no other profile (none, or that one's name). Kept only once the plan succeeds (``_keep_job``): a refused
        request changes no job. Model and profile are resolved without validating the batch, so this is cheap for
        any batch."""
        if request.job_id is None or not self.settings.feedback:
            return None
        stored = self.jobs.get(request.job_id)
        kept = None if stored is None else stored.job
        model = request_model(request.model)
        if kept is not None and kept.base_registered and request.profile in (None, kept.base.name):
            profile, registered = kept.base, True
        else:
            profile, registered = resolve_profile(request.profile, profiles), False
        if kept is not None and job_key(kept) == (profile.name, model, request.dp_size, request.cp_size):
            return kept
        return core_feedback.start_job(request.job_id, base=profile, model=model, dp_size=request.dp_size,
                                       cp_size=request.cp_size, config=self.feedback_config,
                                       base_registered=registered)

    def register_profile(self, job_id: str, request: JobProfileRequest) -> FeedbackResponse:
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
        stored = self.jobs.get(job_id)
        if stored is not None and stored.job.base_registered and stored.job.base == profile \
                and job_key(stored.job) == job_key(job):
            self.events.jobs_kept(self.jobs.keep(stored.job))  # registered already: used, its refit kept
            return job_to_feedback_response(stored.job)
        self.events.jobs_kept(self.jobs.register(job))
        logger.info("profile registered", extra={"job_id": job_id, "profile": profile.name,
                                                 "model": job.model.name, "dp_size": job.dp_size,
                                                 "cp_size": job.cp_size})
        return job_to_feedback_response(job)

    def _keep_job(self, job: JobFeedback | None) -> str | None:
        """Register or refresh a job after a successful plan; a refit adopted meanwhile (same key) is kept. The
        store's state if it failed: the plan stands (it used the job as read, or a new job's base profile), and
        its answer says so."""
        if job is None:
            return None
        try:
            self.events.jobs_kept(self.jobs.keep(job))
        except JobStoreUnavailableError:
            return self.jobs.state
        return None

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
        job_id = await self.heavy_pool.run(feedback_job_id_in_worker, body, expected_s=expected_s, watch=watch)
        stored = self._admit_refit(job_id)
        job = stored.job
        self._refitting.add(job.job_id)
        try:
            updated = await self.heavy_pool.run(refit_in_worker, body, job, self.settings.max_sequence_length,
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
        self.events.feedback_adopted(num_micro_batches)
        logger.info("feedback", extra={"job_id": job_id, "step": step, "micro_batches": num_micro_batches,
                                       "compute_scale": round(updated.compute_scale, 6),
                                       "bucket_size_cap": updated.bucket_cap})
        return job_to_feedback_response(updated)

    # -- planning

    async def plan(self, request: PlanRequest, *, watch: ClientWatch | None = None) -> PlannedBatch:
        """Where a plan runs is decided from the request's shape, before validating it (~3 µs per sequence):
        small ones inline; anything larger, validation included, in the heavy pool. ``watch``: stop waiting
        for a pool when the client hangs up."""
        if not self.ready:
            raise ServiceUnavailableError("the planner is still warming up")
        profiles = self.profiles  # once: one request sees one version of the folder
        settings = self.settings
        if request.search_budget is None and settings.search_budget is not None:
            request = request.model_copy(update={"search_budget": settings.search_budget})
        cost_limits = CostLimits(max_cells=settings.max_plan_cells, max_answer_bytes=settings.max_answer_bytes)
        # A cp_size over its limit is left to validation, which names that limit.
        at_least = baseline_cells(len(request.sequence_lengths), min(request.cp_size, self.limits.max_cp_size))
        if at_least > settings.max_plan_cells:  # over the limit whatever the micro-batches: refused at once
            raise RequestLimitError(
                f"every plan of {len(request.sequence_lengths)} sequences on cp_size {request.cp_size} holds at "
                f"least {at_least} cells (the deepspeed baseline's sequences × cp_size local lists); the service "
                f"plans at most {settings.max_plan_cells}: use a smaller cp_size or a smaller batch",
                field="sequence_lengths", limit=settings.max_plan_cells)
        check_search_budget(request, self.limits)
        try:
            job, job_state = self._job_for(request, profiles), None
        except JobStoreUnavailableError:
            # Planned as a request without a job_id: the base profile. The state is the failure just raised.
            job, job_state = None, self.jobs.state
        if job is not None and job.base_registered:
            # The job's own base profile, which the shared profiles do not hold: the request names it, so that it
            # is validated and planned (its BucketSize derived) with it, wherever it is planned.
            profiles = {**profiles, job.base.name: job.base}
            request = request.model_copy(update={"profile": job.base.name})
        search_budget = request.search_budget or 0
        if request.scheduler is SchedulerName.CPSAT:
            batch = await self._plan_cpsat(request, profiles, job, cost_limits, watch)
        elif at_least <= settings.inline_max_cells and search_budget <= settings.inline_max_search_budget:
            batch = plan_request(request, self.limits, extra_profiles=profiles, job=job,
                                 cost_limits=cost_limits)
        else:
            # Planning costs about twice the baseline's cells, plus the search asked for; the estimate only feeds
            # Retry-After and the give-up.
            expected_s = 2 * at_least * _SECONDS_PER_CELL + search_seconds(search_budget, at_least)
            batch = await self.heavy_pool.run(plan_in_worker, request.model_dump_json().encode(), self.limits,
                                              None, profiles, job, cost_limits, expected_s=expected_s, watch=watch)
        job_state = self._keep_job(job) or job_state
        if job_state is not None:
            batch = batch.with_job_state(job_state)
        self.events.plan_made(batch.summary, num_sequences=len(request.sequence_lengths))
        return batch

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

    async def _plan_cpsat(self, request: PlanRequest, profiles: dict[str, Profile], job: JobFeedback | None,
                          cost_limits: CostLimits, watch: ClientWatch | None) -> PlannedBatch:
        """Validated here first (a cpsat batch is small): bad input never takes a solver slot. The solver process
        builds its own problem (it cannot share this one)."""
        settings = self.settings
        if len(request.sequence_lengths) > settings.cpsat_max_sequences:
            raise InvalidRequestError(
                f"cpsat plans at most {settings.cpsat_max_sequences} sequences per request, got "
                f"{len(request.sequence_lengths)}; use a heuristic scheduler for larger batches",
                field="sequence_lengths",
            )
        problem = request_to_problem(request, limits=self.limits, extra_profiles=profiles)
        cost_limits.check(job_problem(problem, job), request)
        requested_s = request.time_limit_s or settings.cpsat_default_time_limit_s
        time_limit_s = min(float(requested_s), settings.cpsat_max_time_limit_s)
        return await self.cpsat_pool.run(plan_in_worker, request.model_dump_json().encode(), self.limits,
                                         time_limit_s, profiles, job, cost_limits, expected_s=time_limit_s,
                                         watch=watch)
