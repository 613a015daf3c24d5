"""One request's work, synchronously, wherever it runs: planning a batch, refitting a job.

``validate_request`` validates and costs one ``/plan`` request, once, where
``service.PlanningService`` admits it; ``plan_validated`` plans, checks and
simulates what it validated; ``refit_job`` refits a job from one ``/feedback``
report. They are pure functions of their arguments, so the service calls them
inline on the event loop for small requests and ``pools`` runs the planning and
the refits in pool processes for large ones, with the same results.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

import orjson
from skrull_proto import FeedbackRequest, PlanRequest, SchedulerName

from scheduler_service.contract.wire import feedback_to_measurements, request_to_problem, result_to_response_data
from scheduler_service.core import feedback as core_feedback
from scheduler_service.core.check import block_violation
from scheduler_service.core.errors import InvalidRequestError
from scheduler_service.core.feedback import JobFeedback
from scheduler_service.core.perf_model import PerformanceModel
from scheduler_service.core.plan import Plan, PlanLimits, PlanningProblem
from scheduler_service.core.plan import SchedulerName as CoreSchedulerName
from scheduler_service.core.planner import HEURISTIC_SCHEDULERS, make_plan, warm_up
from scheduler_service.core.profile import Profile
from scheduler_service.runtime.cost import plan_cost
from scheduler_service.runtime.errors import RequestLimitError

__all__ = [
    "CostLimits",
    "Placement",
    "PlanSummary",
    "PlannedBatch",
    "ValidatedPlan",
    "check_search_budget",
    "job_problem",
    "plan_request",
    "plan_validated",
    "refit_job",
    "validate_request",
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
    """A ``/plan`` request once validated and costed (``validate_request``): what ``plan_validated`` plans, inline
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
class CostLimits:
    """The most a plan may cost (``Settings.max_plan_cells``, ``max_answer_bytes``), checked where it is planned."""

    max_cells: int
    max_answer_bytes: int

    def check(self, problem: PlanningProblem, scheduler: CoreSchedulerName, *, breakdown: bool) -> None:
        """Refuse ``problem`` (as the job plans it) when its estimate is over a limit, naming limit and estimate."""
        cost = plan_cost(problem, scheduler, breakdown=breakdown)
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


def check_search_budget(search_budget: int | None, limits: PlanLimits) -> None:
    """A search budget (the request's, or the service's default) over the limit is refused before any work."""
    if search_budget is not None and search_budget > limits.max_search_budget:
        raise RequestLimitError(f"search_budget {search_budget} is over the service's limit "
                                f"{limits.max_search_budget}", field="search_budget", limit=limits.max_search_budget)


def validate_request(
    request: PlanRequest, limits: PlanLimits, *, search_budget: int | None, time_limit_s: float | None = None,
    extra_profiles: dict[str, Profile] | None = None, job: JobFeedback | None = None,
    cost_limits: CostLimits | None = None,
) -> ValidatedPlan:
    """Validate a request's values with the core, as ``job`` plans it (its refit profile, its memory cap on the
    BucketSize), and refuse it when its estimate is over ``cost_limits``: the one place a ``/plan`` request's
    values are validated and costed, once per request, before it is planned anywhere."""
    base = request_to_problem(request, limits=limits, extra_profiles=extra_profiles)
    problem = job_problem(base, job)
    scheduler = CoreSchedulerName(request.scheduler)
    if cost_limits is not None:
        cost_limits.check(problem, scheduler, breakdown=request.breakdown)
    return ValidatedPlan(problem=problem, scheduler=scheduler, search_budget=search_budget,
                         time_limit_s=time_limit_s, breakdown=request.breakdown,
                         bucket_lowered=problem.bucket_size < base.bucket_size)


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


def plan_request(request: PlanRequest, limits: PlanLimits) -> PlannedBatch:
    """One request planned in this process as it is, without a service's settings, jobs or cost limits (warm-ups,
    benchmarks)."""
    check_search_budget(request.search_budget, limits)
    return plan_validated(validate_request(request, limits, search_budget=request.search_budget))


def warm_planner() -> None:
    """Compile the planning core's kernels (or load them from the JIT cache) and plan a small mixed batch with every
    heuristic through the service's own path: the first plans pay imports and caches."""
    warm_up()
    for scheduler in HEURISTIC_SCHEDULERS:
        plan_request(PlanRequest(sequence_lengths=_WARMUP_LENGTHS, dp_size=2, cp_size=_WARMUP_CP_SIZE,
                                 bucket_size=_WARMUP_BUCKET_SIZE, scheduler=SchedulerName(scheduler.value)),
                     PlanLimits())


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
