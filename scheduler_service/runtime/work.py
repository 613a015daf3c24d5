"""One request's work, synchronously, wherever it runs: admitting a ``/plan`` request, planning it, refitting a job.

``admit_plan`` is the one admission of a ``/plan`` request: every check it
passes, cheapest first, each made here only (its shape, its search budget, a
CP-SAT request's size and time limit, its model and profile, resolved once, its
job, its values through the core, its estimated cost). ``plan_validated`` plans,
checks and simulates what was admitted; ``refit_job`` refits a job from one
``/feedback`` report. They are pure functions of their arguments, so the service
(``service.PlanningService``) only decides where each runs: inline on the event
loop for small requests, in a worker thread, or in ``pools``' processes for
large ones, with the same results.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

import orjson
from skrull_proto import FeedbackRequest, PlanRequest, SchedulerName

from scheduler_service.contract.wire import (
    feedback_to_measurements,
    request_model,
    request_to_problem,
    result_to_response_data,
)
from scheduler_service.core import feedback as core_feedback
from scheduler_service.core.check import block_violation
from scheduler_service.core.errors import InvalidRequestError
from scheduler_service.core.feedback import FeedbackConfig, JobFeedback, job_key
from scheduler_service.core.models import ModelShape
from scheduler_service.core.perf_model import PerformanceModel
from scheduler_service.core.plan import Plan, PlanningProblem
from scheduler_service.core.plan import SchedulerName as CoreSchedulerName
from scheduler_service.core.planner import HEURISTIC_SCHEDULERS, make_plan, warm_up
from scheduler_service.core.profile import Profile, resolve_profile
from scheduler_service.runtime.cost import baseline_cells, plan_cost
from scheduler_service.runtime.errors import RequestLimitError
from scheduler_service.runtime.settings import Settings

__all__ = [
    "AdmittedPlan",
    "Placement",
    "PlanSummary",
    "PlannedBatch",
    "ValidatedPlan",
    "admit_plan",
    "job_problem",
    "plan_request",
    "plan_validated",
    "refit_job",
    "requested_search_budget",
    "warm_planner",
]

# A small mixed batch that touches every heuristic code path (local, distributed, roll-back); over 4 CP ranks,
# so hybrid groups (blocks of 2) are candidates too.
_WARMUP_LENGTHS = [128, 512, 2048, 8192, 30000, 300, 1000, 4000, 96, 16000, 700, 64] * 4
_WARMUP_BUCKET_SIZE = 16384
_WARMUP_CP_SIZE = 4


class Placement(StrEnum):
    """Where a plan puts a sequence (docs/design.md, "Wire contract")."""

    LOCAL = "local"
    DISTRIBUTED = "distributed"
    SHARDED = "sharded"


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
    """A plan made, wherever it was made. ``response`` holds the answer's fields as ``result_to_response_data``
    spells them, but for ``dp_ranks``, which holds that field's JSON already: the bulk of the answer crosses
    processes as bytes and is never built again on the event loop. ``job_state`` is known only once the job store
    was used, after planning: ``answer`` adds it."""

    response: dict[str, Any]
    summary: PlanSummary

    def answer(self, job_state: str | None) -> bytes:
        """The answer's JSON; ``job_state`` is left out when there is none, as ``PlanResponse`` leaves it out."""
        data = {**self.response, "dp_ranks": orjson.Fragment(self.response["dp_ranks"])}  # in its place
        if job_state is not None:
            data["job_state"] = job_state
        return orjson.dumps(data)


@dataclass(frozen=True, kw_only=True, slots=True)
class ValidatedPlan:
    """A ``/plan`` request once validated and costed (``admit_plan``): what ``plan_validated`` plans, inline
    or in a pool process, without validating anything again. Picklable: a pool receives it as it is."""

    problem: PlanningProblem  # as the job plans it (``job_problem``)
    scheduler: CoreSchedulerName
    search_budget: int | None
    time_limit_s: float | None  # cpsat's, capped by the service; None: the core's default
    breakdown: bool
    bucket_lowered: bool  # the job's memory feedback lowered the bucket_size (requested or derived)


def job_problem(problem: PlanningProblem, job: JobFeedback | None) -> PlanningProblem:
    """The request's problem (validated with its base profile) as the job's feedback plans it: the refit profile
    replaces the base one, and the memory cap lowers the BucketSize (the request's, or the one the base profile
    derives), never below what the longest sequence needs over the whole CP group."""
    if job is None:
        return problem
    if job.num_observations:
        problem = replace(problem, perf=PerformanceModel(model=problem.perf.model, profile=job.profile,
                                                         gpus_per_node=problem.perf.gpus_per_node))
    bucket_size = core_feedback.effective_bucket_size(job, problem.bucket_size, max(problem.sequence_lengths))
    if bucket_size < problem.bucket_size:
        problem = replace(problem, bucket_size=bucket_size)
    return problem


@dataclass(frozen=True, kw_only=True, slots=True)
class AdmittedPlan:
    """A ``/plan`` request admitted (``admit_plan``): what to plan, and the job to keep once it is planned (a refused
    or failed request changes no job)."""

    validated: ValidatedPlan
    job: JobFeedback | None


def requested_search_budget(request: PlanRequest, settings: Settings) -> int | None:
    """The search budget a request plans with: its own, or the service's default."""
    return settings.search_budget if request.search_budget is None else request.search_budget


def admit_plan(request: PlanRequest, settings: Settings, *, profiles: dict[str, Profile],
               stored_job: JobFeedback | None, feedback: FeedbackConfig | None) -> AdmittedPlan:
    """Admit one ``/plan`` request (module docstring), or refuse it naming the field and the limit. ``profiles``:
    the profiles the service shares beside the shipped ones; ``stored_job``: the request's job as the job store
    keeps it (None: none, or none could be read); ``feedback``: None where the service keeps no jobs.

    The checks, in order: the cells every plan of this shape holds at least (sequences × ``cp_size``, known before
    validating the batch, which costs ~3 µs per sequence); the search budget; for ``cpsat``, the batch's size and
    the time limit, capped; the model and the profile (the job's own base where its trainer registered one and the
    request names no other), each resolved once; the job; the values, by the core (``make_problem``); and, as the
    job plans it, the plan's estimated cells and answer bytes."""
    limits = settings.plan_limits
    num_sequences = len(request.sequence_lengths)
    # A cp_size over its limit is left to the core, which names that limit.
    at_least = baseline_cells(num_sequences, min(request.cp_size, limits.max_cp_size))
    if at_least > settings.max_plan_cells:
        raise RequestLimitError(
            f"every plan of {num_sequences} sequences on cp_size {request.cp_size} holds at least {at_least} cells "
            f"(the deepspeed baseline's sequences × cp_size local lists); the service plans at most "
            f"{settings.max_plan_cells}: use a smaller cp_size or a smaller batch", field="sequence_lengths",
            limit=settings.max_plan_cells)
    search_budget = requested_search_budget(request, settings)
    if search_budget is not None and search_budget > limits.max_search_budget:
        raise RequestLimitError(f"search_budget {search_budget} is over the service's limit "
                                f"{limits.max_search_budget}", field="search_budget", limit=limits.max_search_budget)
    time_limit_s = _cpsat_time_limit_s(request, settings) if request.scheduler is SchedulerName.CPSAT else None
    model = request_model(request.model)
    if stored_job is not None and stored_job.base_registered and request.profile in (None, stored_job.base.name):
        profile, registered = stored_job.base, True  # the trainer's own, which the shared profiles do not hold
    else:
        profile, registered = resolve_profile(request.profile, profiles), False
    job = None if feedback is None or request.job_id is None else _plan_job(
        request, request.job_id, stored_job, model=model, profile=profile, registered=registered, config=feedback)
    base = request_to_problem(request, limits=limits, model=model, profile=profile)
    problem = job_problem(base, job)
    scheduler = CoreSchedulerName(request.scheduler)
    _check_cost(problem, scheduler, settings, breakdown=request.breakdown)
    return AdmittedPlan(validated=ValidatedPlan(problem=problem, scheduler=scheduler, search_budget=search_budget,
                                                time_limit_s=time_limit_s, breakdown=request.breakdown,
                                                bucket_lowered=problem.bucket_size < base.bucket_size),
                        job=job)


def _cpsat_time_limit_s(request: PlanRequest, settings: Settings) -> float:
    """The solver's time limit: the request's, capped by the settings. A batch over ``cpsat_max_sequences`` is
    refused."""
    if len(request.sequence_lengths) > settings.cpsat_max_sequences:
        raise InvalidRequestError(
            f"cpsat plans at most {settings.cpsat_max_sequences} sequences per request, got "
            f"{len(request.sequence_lengths)}; use a heuristic scheduler for larger batches",
            field="sequence_lengths", limit=settings.cpsat_max_sequences)
    requested_s = request.time_limit_s or settings.cpsat_default_time_limit_s
    return min(float(requested_s), settings.cpsat_max_time_limit_s)


def _plan_job(request: PlanRequest, job_id: str, stored: JobFeedback | None, *, model: ModelShape, profile: Profile,
              registered: bool, config: FeedbackConfig) -> JobFeedback:
    """The request's job as its plan uses it: the one kept, or a new one when its model, profile or sizes changed
    (or it is new)."""
    if stored is not None and job_key(stored) == (profile.name, model, request.dp_size, request.cp_size):
        return stored
    return core_feedback.start_job(job_id, base=profile, model=model, dp_size=request.dp_size,
                                   cp_size=request.cp_size, config=config, base_registered=registered)


def _check_cost(problem: PlanningProblem, scheduler: CoreSchedulerName, settings: Settings, *,
                breakdown: bool) -> None:
    """Refuse ``problem`` (as the job plans it) when its estimate is over ``max_plan_cells`` or
    ``max_answer_bytes``, naming limit and estimate."""
    cost = plan_cost(problem, scheduler, breakdown=breakdown)
    shape = (f"this plan would hold about {cost.num_micro_batches} micro-batches × cp_size {problem.cp_size} local "
             f"lists for {problem.num_sequences} sequences, beside the deepspeed baseline's {problem.num_sequences} "
             f"× {problem.cp_size}: an estimated {cost.cells} cells and a {cost.answer_bytes / 1e6:.1f} MB answer")
    advice = "use a larger bucket_size, a smaller cp_size or a smaller batch"
    if cost.cells > settings.max_plan_cells:
        raise RequestLimitError(f"{shape}; the service plans at most {settings.max_plan_cells} cells: {advice}",
                                field="sequence_lengths", limit=settings.max_plan_cells)
    if cost.answer_bytes > settings.max_answer_bytes:
        raise RequestLimitError(f"{shape}; the service answers at most {settings.max_answer_bytes} bytes: {advice}, "
                                "or leave out the breakdown", field="sequence_lengths",
                                limit=settings.max_answer_bytes)


def plan_validated(validated: ValidatedPlan) -> PlannedBatch:
    """Plan, check and simulate a validated request (any scheduler), synchronously: inline or in a pool process."""
    problem = validated.problem
    if validated.time_limit_s is None:
        result = make_plan(problem, validated.scheduler, search_budget=validated.search_budget)
    else:
        result = make_plan(problem, validated.scheduler, time_limit_s=validated.time_limit_s,
                           search_budget=validated.search_budget)
    # Written by orjson from plain data, not through the pydantic models (a test checks it is the same JSON).
    response = result_to_response_data(result, breakdown=validated.breakdown)
    placements, group_degrees = _placements(result.plan)
    summary = PlanSummary(scheduler=response["scheduler"], bucket_size=response["bucket_size"],
                          bucket_lowered=validated.bucket_lowered, solve_time_s=result.solve_time_s,
                          speedup=response["speedup_vs_deepspeed"],
                          solver_status=response["solver"]["status"] if response["solver"] else None,
                          placements=placements, group_degrees=tuple(group_degrees))
    return PlannedBatch(response={**response, "dp_ranks": orjson.dumps(response["dp_ranks"])}, summary=summary)


def plan_request(request: PlanRequest, settings: Settings | None = None) -> PlannedBatch:
    """One request admitted and planned in this process, without a job store (warm-ups, benchmarks): under
    ``settings``' limits, the defaults' when None."""
    admitted = admit_plan(request, settings or Settings(), profiles={}, stored_job=None, feedback=None)
    return plan_validated(admitted.validated)


def warm_planner() -> None:
    """Compile the planning core's kernels (or load them from the JIT cache) and plan a small mixed batch with every
    heuristic through the service's own path: the first plans pay imports and caches."""
    warm_up()
    for scheduler in HEURISTIC_SCHEDULERS:
        # the default model's 14 heads split over no Ulysses degree of this CP group: tiny's 4 and 2 do
        static_sp = scheduler in (SchedulerName.ULYSSES, SchedulerName.USP)
        plan_request(PlanRequest(sequence_lengths=_WARMUP_LENGTHS, dp_size=2, cp_size=_WARMUP_CP_SIZE,
                                 bucket_size=_WARMUP_BUCKET_SIZE, scheduler=SchedulerName(scheduler.value),
                                 model="tiny" if static_sp else "qwen2.5-0.5b"))


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


def _check_group_blocks(request: FeedbackRequest, cp_size: int) -> None:
    """Every reported hybrid group is an aligned block of the job's CP group (the plan checker's rule). A
    micro-batch with the wrong number of local lists is left to ``observe``, which names that first."""
    for index, item in enumerate(request.micro_batches):
        if len(item.local_lengths) != cp_size:
            continue
        for group_index, group in enumerate(item.sharded_lengths):
            reason = block_violation(tuple(group.cp_ranks), cp_size)
            if reason is not None:
                where = f"micro_batches[{index}].sharded_lengths[{group_index}]"
                raise InvalidRequestError(f"{where} {reason}", field=f"{where}.cp_ranks")


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
    return core_feedback.observe(job, feedback_to_measurements(request),
                                 memory_budget_bytes=request.memory_budget_bytes)
