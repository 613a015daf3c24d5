"""Rank 0's plans: ``PlanSource`` asks the scheduler service (``planning.client``) and falls back on the embedded
planning core.

``PlanSource`` is rank 0's decision maker. For global batch ``s`` it asks the
service (prefetched in a background thread while batch ``s − 1`` trains); when
the service's answer fails, whatever the exception (a ``PlanClientError``, or
any other error of the request or of its answer), it plans the batch with the
embedded core — the same ``make_problem`` + ``make_plan`` the service runs, so
the same plan — logs one warning for the whole run, counts the fallback, and the
batch trains as planned: no batch is skipped or repeated. The service is asked
again for the next batch. A batch no planner can plan (a sequence longer than
``bucket_size × cp_size``, or ``bucket_size × cp_size × dp_size`` where blocks
may span DP replicas) becomes an error decision, which every rank receives.
A service plan keeps its hybrid DACP groups (``sharded``) and is checked with
the core's checker (aligned blocks, memory bound) before any rank sees it.

Documented behaviour when the service is unreachable at start-up: one warning,
training starts at once with embedded plans, and batches go back to the
service as soon as it answers (the sidecar may come up later).

A profile object (read from a file, or measured by the profiler) is one the
service cannot know by its name. ``PlanSource`` registers it as the base
profile of the job its plans name, on the background thread before the job's
first plan (``PUT /jobs/{job_id}/profile``); its plans then name it and the
service plans with it, the same numbers the embedded core plans with. The job
is the trainer's ``job_id``; without one (feedback off) the plans name a job
made up for the run (``run-<hex>``), for which no report is ever sent. Until
the profile is registered, every batch plans with the embedded core: the
service is asked again at the next batch while it is unreachable or failing;
a registration the service refuses (a 4xx: a profile it finds invalid, a name
one of its own profiles has, no token, feedback switched off) is warned once
and ends the asking: the whole run then plans embedded. A plan the service
refuses sends the registration again before the next plan (the service may
have forgotten the job, its profile with it), which changes nothing where it
had not.

Feedback (opt-in, a ``job_id``): plan requests carry the job id, and
``PlanSource.report`` posts a step's measured micro-batches (``POST /feedback``)
on the same background thread as the prefetch, so training never waits for
it. Feedback is best effort: a failure — a report the contract refuses (more
than ``MAX_FEEDBACK_MICRO_BATCHES`` micro-batches, a micro-batch over an hour),
a transport or serialisation error, an answer that is not 200 — is logged once
and counted (``num_feedback_failures``), never raised, so it can neither stop
rank 0 nor leave the other ranks waiting in the next collective. ``close``
waits for the report in flight (bounded by the client's timeout). A service that lowered the job's
BucketSize (memory near its budget) answers plans with the smaller
``bucket_size``; any bucket up to the trainer's own is accepted.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from enum import StrEnum

from pydantic import ValidationError
from skrull_proto import (
    SCHEMES_SCHEMA_VERSION,
    SPANNING_SCHEMA_VERSION,
    FeedbackRequest,
    FeedbackResponse,
    JobProfileRequest,
    MicroBatchMeasurement,
    ModelSpec,
    PlanRequest,
    ProfileDocument,
    SchedulerName,
)

from scheduler_service.contract.wire import micro_batch_to_measurement, response_to_plan, shape_to_model_spec
from scheduler_service.core import jit
from scheduler_service.core.check import check_plan
from scheduler_service.core.errors import PlanCheckError, PlanningError, SequenceTooLongError
from scheduler_service.core.models import ModelShape, resolve_model
from scheduler_service.core.plan import DEFAULT_LIMITS, Plan, make_problem
from scheduler_service.core.planner import make_plan, warm_up
from scheduler_service.core.profile import Profile
from trainer_client.planning.client import PlanClient, PlanClientError, PlanRejected

__all__ = ["MicroBatchTiming", "PlanDecision", "PlanOrigin", "PlanSource", "measurements_of", "plan_capacity"]

logger = logging.getLogger(__name__)


class PlanOrigin(StrEnum):
    SERVICE = "service"
    EMBEDDED = "embedded"


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanDecision:
    """What rank 0 broadcasts for one global batch: a plan, or the error every rank stops with."""

    step: int
    scheduler: str
    origin: PlanOrigin
    plan: Plan | None = None
    bucket_size: int = 0
    estimated_time_ms: float | None = None
    error: str | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class _ServicePlan:
    plan: Plan
    estimated_time_ms: float
    bucket_size: int


@dataclass(frozen=True, kw_only=True, slots=True)
class MicroBatchTiming:
    """What one rank measured for one of its DP rank's micro-batches."""

    dp_rank: int
    index: int  # position in the DP rank's micro-batch list
    time_s: float
    peak_memory_bytes: int | None = None


def measurements_of(
    plan: Plan, sequence_lengths: Sequence[int], timings: Sequence[MicroBatchTiming]
) -> list[MicroBatchMeasurement]:
    """Every rank's timings → one measurement per micro-batch: the slowest CP rank's time, the largest peak, and
    the lengths as planned (local, distributed and each hybrid group's). A micro-batch with a Ulysses or 2D
    collective is left out: the refit prices what it measures as all-gather-KV (docs/known-limits.md)."""
    slowest: dict[tuple[int, int], MicroBatchTiming] = {}
    peaks: dict[tuple[int, int], int] = {}
    for timing in timings:
        key = (timing.dp_rank, timing.index)
        if key not in slowest or timing.time_s > slowest[key].time_s:
            slowest[key] = timing
        if timing.peak_memory_bytes is not None:
            peaks[key] = max(peaks.get(key, 0), timing.peak_memory_bytes)
    if plan.spanning:  # a measurement is of one CP group's micro-batch (docs/known-limits.md)
        return []
    measured = [(plan.dp_ranks[dp_rank].micro_batches[index], timing, peaks.get((dp_rank, index)))
                for (dp_rank, index), timing in sorted(slowest.items())]
    return [micro_batch_to_measurement(micro_batch, sequence_lengths, time_s=timing.time_s, peak_memory_bytes=peak)
            for micro_batch, timing, peak in measured
            if all(collective.ulysses_degree == 1 for collective in micro_batch.collectives())]


def plan_capacity(*, dp_size: int, cp_size: int, model: str | ModelShape, bucket_size: int,
                  profile: str | Profile | None, spanning: bool) -> int | None:
    """The most tokens a sequence may have for the planner to plan it in this layout, as ``make_problem`` decides
    (one CP group's buckets, or the world's where plans span DP replicas); None where this process cannot tell (a
    profile only the service knows)."""
    longest = min(bucket_size * cp_size * dp_size + 1, DEFAULT_LIMITS.max_sequence_length)
    try:
        make_problem(sequence_lengths=[longest], dp_size=dp_size, cp_size=cp_size, model=model,
                     bucket_size=bucket_size, profile=profile, spanning=spanning)
    except SequenceTooLongError as error:
        return error.limit
    except PlanningError:
        return None
    return longest


class PlanSource:
    """Rank 0's plans: the service when one is configured and answers validly, else the embedded core."""

    def __init__(
        self,
        *,
        scheduler: str,
        dp_size: int,
        cp_size: int,
        model: str | ModelShape,
        bucket_size: int,
        profile: str | Profile | None = None,
        client: PlanClient | None = None,
        job_id: str | None = None,
        spanning: bool = True,
        schemes: bool = True,
        token_buckets: int = 0,
    ) -> None:
        self.scheduler = scheduler
        self.spanning = spanning  # plans may hold micro-batches over several DP replicas
        self.schemes = schemes  # a collective may be Ulysses or 2D where the planner chooses it; False: all-gather-KV
        self.token_buckets = token_buckets  # rows padded to this many token buckets, priced by the planner
        self.dp_size = dp_size
        self.cp_size = cp_size
        self.model = model
        self.bucket_size = bucket_size
        self.profile = profile
        self.client = client
        self.job_id = job_id  # the trainer's: plans and reports name it (feedback)
        # A profile object is one the service cannot know by its name: registered for the job the plans name, the
        # trainer's or one made up for the run (which no report names).
        self._registers_profile = client is not None and isinstance(profile, Profile)
        self._plan_job_id = job_id if job_id is not None or not self._registers_profile else f"run-{uuid.uuid4().hex}"
        self._profile_registered = False
        self._registration_refused: str | None = None  # why the service cannot plan with the profile, once it said
        self.num_fallbacks = 0
        self.num_feedback_failures = 0
        self.last_feedback: FeedbackResponse | None = None
        self._warned = False
        self._feedback_warned = False
        self._feedback_lock = threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="plan-prefetch") if client else None
        self._pending: dict[int, Future[_ServicePlan]] = {}

    def close(self) -> None:
        if self._executor is not None:
            # Drop prefetches not yet started, but let a report (or plan) in flight finish — bounded by the client's
            # timeout — before its client is closed under it.
            self._executor.shutdown(wait=True, cancel_futures=True)
        if self.client is not None:
            self.client.close()

    def warm_up(self) -> None:
        """Compile the embedded core's kernels now (or load them from the JIT cache), at start-up: a late plan must
        not wait for a compiler. With a cold cache this takes tens of seconds, once per machine."""
        logger.info("embedded planner ready in %.2f s (JIT cache %s)", warm_up(), jit.cache_dir())

    def check_service(self) -> bool:
        """Probe the service at start-up; warn (once for the run) when it does not answer."""
        if self.client is None:
            return False
        if self.client.ready():
            logger.info("scheduler service at %s is ready", self.client.base_url)
            return True
        self._warn(f"scheduler service at {self.client.base_url} is unreachable or not ready at start-up")
        return False

    def prefetch(self, step: int, sequence_lengths: Sequence[int]) -> None:
        """Start asking the service for batch ``step`` in the background (no-op without a service)."""
        if self._executor is not None and step not in self._pending:
            self._pending[step] = self._executor.submit(self._ask_service, tuple(sequence_lengths))

    def decide(self, step: int, sequence_lengths: Sequence[int]) -> PlanDecision:
        """The plan of batch ``step``; never raises for a planning failure (it becomes an error decision)."""
        if self._executor is not None:
            self.prefetch(step, sequence_lengths)
            try:
                answer = self._pending.pop(step).result()
                return PlanDecision(step=step, scheduler=self.scheduler, origin=PlanOrigin.SERVICE,
                                    plan=answer.plan, bucket_size=answer.bucket_size,
                                    estimated_time_ms=answer.estimated_time_ms)
            except Exception as error:  # PlanClientError, or any other failure: the embedded core still plans
                self.num_fallbacks += 1
                reason = str(error) if isinstance(error, PlanClientError) else repr(error)
                self._warn(f"plan of step {step} from the scheduler service failed: {reason}")
        return self._plan_embedded(step, sequence_lengths)

    def _warn(self, reason: str) -> None:
        if not self._warned:
            self._warned = True
            logger.warning("%s; planning with the embedded core instead (same planner, same plans) and retrying "
                           "the service for every later batch; fallbacks are counted in the metrics "
                           "(plan_fallbacks), this warning is shown once", reason)

    def _wire_model(self) -> str | ModelSpec:
        return self.model if isinstance(self.model, str) else shape_to_model_spec(self.model)

    def _request(self, sequence_lengths: Sequence[int]) -> PlanRequest:
        # 3: the trainer runs every scheme (``dacp/attention.py``), 2 where it keeps all-gather-KV; spanning
        # micro-batches where it may
        return PlanRequest(schema_version=SCHEMES_SCHEMA_VERSION if self.schemes else SPANNING_SCHEMA_VERSION,
                           spanning=self.spanning,
                           sequence_lengths=[int(n) for n in sequence_lengths], dp_size=self.dp_size,
                           cp_size=self.cp_size, model=self._wire_model(), bucket_size=self.bucket_size,
                           scheduler=SchedulerName(self.scheduler),
                           profile=self.profile.name if isinstance(self.profile, Profile) else self.profile,
                           job_id=self._plan_job_id, token_buckets=self.token_buckets)

    def _register_profile(self) -> None:
        """Register the profile object as the base of the job the plans name (``PUT /jobs/{job_id}/profile``).
        ``PlanUnavailable`` when the service is unreachable or failing (asked again at the next batch);
        ``PlanRejected`` for good once it refused, warned once: it cannot plan with this profile."""
        assert self.client is not None and isinstance(self.profile, Profile) and self._plan_job_id is not None
        if self._registration_refused is not None:
            raise PlanRejected(self._registration_refused)
        try:
            request = JobProfileRequest(profile=ProfileDocument.model_validate(self.profile.raw),
                                        model=self._wire_model(), dp_size=self.dp_size, cp_size=self.cp_size)
            self.client.register_profile(self._plan_job_id, request)
        except (ValidationError, PlanRejected) as error:
            reason = (f"it breaks the contract ({error.error_count()} errors, first: {error.errors()[0]['msg']})"
                      if isinstance(error, ValidationError) else str(error))
            self._registration_refused = (f"the scheduler service cannot plan with profile {self.profile.name}: "
                                          f"registering it for job {self._plan_job_id} failed: {reason}")
            self._warned = True  # this warning says all the fallback's would: the run's fallbacks start here
            logger.warning("%s; every batch of this run is planned with the embedded core instead (same planner, "
                           "same plans); fallbacks are counted in the metrics (plan_fallbacks)",
                           self._registration_refused)
            raise PlanRejected(self._registration_refused) from None
        self._profile_registered = True
        logger.info("profile %s registered for job %s at %s", self.profile.name, self._plan_job_id,
                    self.client.base_url)

    def _ask_service(self, sequence_lengths: tuple[int, ...]) -> _ServicePlan:
        assert self.client is not None
        if self._registers_profile and not self._profile_registered:
            self._register_profile()
        try:
            request = self._request(sequence_lengths)
        except ValidationError as error:  # e.g. a job id the contract refuses: no service plan, the core plans
            raise PlanRejected(f"cannot build the plan request: {error.error_count()} errors, first: "
                               f"{error.errors()[0]['msg']}") from None
        try:
            response = self.client.plan(request)
        except PlanRejected:
            # The service may have forgotten the job, and its profile with it (the least recently used of many, or
            # a new store): registered again before the next plan, which changes nothing where it had not.
            self._profile_registered = False
            raise
        # A smaller bucket is the service lowering this job's memory use (feedback); a larger one could OOM.
        if response.scheduler != self.scheduler or response.bucket_size > self.bucket_size:
            raise PlanRejected(f"the service planned with scheduler {response.scheduler} and bucket_size "
                               f"{response.bucket_size}; asked for {self.scheduler} and at most {self.bucket_size}")
        plan = response_to_plan(response)
        try:
            check_plan(plan, sequence_lengths=sequence_lengths, dp_size=self.dp_size, cp_size=self.cp_size,
                       bucket_size=response.bucket_size, heads=resolve_model(self.model).heads)
        except PlanCheckError as error:
            raise PlanRejected(f"the service's plan fails the checker: {error.message}") from None
        return _ServicePlan(plan=plan, estimated_time_ms=response.estimated_iteration_time_ms,
                            bucket_size=response.bucket_size)

    def report(
        self, step: int, plan: Plan, sequence_lengths: Sequence[int], timings: Sequence[MicroBatchTiming], *,
        memory_budget_bytes: float | None = None,
    ) -> Future[None] | None:
        """Post a step's measured micro-batches in the background (no-op without a service or a job id).

        Never raises: a report that cannot be built or sent is counted in ``num_feedback_failures`` (warned once).
        """
        if self._executor is None or self.job_id is None or not timings:
            return None
        try:
            measurements = measurements_of(plan, sequence_lengths, timings)
            if not measurements:  # a plan that spans replicas: nothing a refit can read (measurements_of)
                return None
            request = FeedbackRequest(job_id=self.job_id, step=step, micro_batches=measurements,
                                      memory_budget_bytes=memory_budget_bytes)
            return self._executor.submit(self._send_feedback, request)
        except ValidationError as error:
            self._feedback_failed(step, f"the report breaks the contract ({error.error_count()} errors, first: "
                                        f"{error.errors()[0]['msg']})")
        except Exception as error:  # best effort: nothing here may stop rank 0 between collectives
            self._feedback_failed(step, repr(error))
        return None

    def _send_feedback(self, request: FeedbackRequest) -> None:
        assert self.client is not None
        try:
            self.last_feedback = self.client.feedback(request)
        except PlanClientError as error:
            self._feedback_failed(request.step, str(error))
        except Exception as error:  # serialisation, a closed client, …: counted, never lost in an unread future
            self._feedback_failed(request.step, repr(error))

    def _feedback_failed(self, step: int | None, reason: str) -> None:
        with self._feedback_lock:
            self.num_feedback_failures += 1
            warn, self._feedback_warned = not self._feedback_warned, True
        if warn:
            logger.warning("feedback of step %s was not accepted: %s; training goes on, later steps are "
                           "reported too (this warning is shown once)", step, reason)

    def _plan_embedded(self, step: int, sequence_lengths: Sequence[int]) -> PlanDecision:
        try:
            problem = make_problem(sequence_lengths=sequence_lengths, dp_size=self.dp_size, cp_size=self.cp_size,
                                   model=self.model, bucket_size=self.bucket_size, profile=self.profile,
                                   spanning=self.spanning, token_buckets=self.token_buckets,
                                   schemes=self.schemes)
            result = make_plan(problem, self.scheduler)
        except PlanningError as error:
            return PlanDecision(step=step, scheduler=self.scheduler, origin=PlanOrigin.EMBEDDED,
                                error=f"cannot plan global batch {step}: {error.message}")
        return PlanDecision(step=step, scheduler=self.scheduler, origin=PlanOrigin.EMBEDDED, plan=result.plan,
                            bucket_size=problem.bucket_size,
                            estimated_time_ms=result.estimate.iteration_time_s * 1e3)
