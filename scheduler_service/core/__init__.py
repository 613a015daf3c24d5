"""The pure planning core: performance model, schedulers, simulator, plan checker.

Plain Python with dataclasses and numpy (``ortools`` only inside ``cpsat``);
no FastAPI, pydantic or torch, so the service, the CLI and the trainer's
embedded fallback share it.
"""

from scheduler_service.core.advise import Advice, GlobalBatchSize, LayoutProblem, advise, advise_cost
from scheduler_service.core.check import check_plan, find_violations
from scheduler_service.core.errors import (
    BaselineCannotPlanError,
    InfeasiblePlanError,
    InvalidRequestError,
    PlanCheckError,
    PlanningError,
    SequenceTooLongError,
    UnknownModelError,
    UnknownProfileError,
    UnknownSchedulerError,
)
from scheduler_service.core.feedback import (
    FeedbackConfig,
    GroupLengths,
    JobFeedback,
    MicroBatchMeasurement,
    effective_bucket_size,
    observe,
    start_job,
)
from scheduler_service.core.models import MODEL_CATALOGUE, ModelShape, resolve_model
from scheduler_service.core.perf_model import PerformanceModel
from scheduler_service.core.plan import (
    DPRankPlan,
    MicroBatch,
    Plan,
    PlanLimits,
    PlanningProblem,
    SchedulerName,
    ShardedGroup,
    SolverReport,
    block_degrees,
    cp_blocks,
    make_problem,
)
from scheduler_service.core.planner import PlanResult, make_plan, schedule
from scheduler_service.core.profile import Profile, builtin_profiles, resolve_profile
from scheduler_service.core.samplers import DATASETS, sample_lengths
from scheduler_service.core.simulate import PlanEstimate, simulate

__all__ = [
    "DATASETS",
    "MODEL_CATALOGUE",
    "Advice",
    "BaselineCannotPlanError",
    "DPRankPlan",
    "FeedbackConfig",
    "GlobalBatchSize",
    "GroupLengths",
    "InfeasiblePlanError",
    "InvalidRequestError",
    "JobFeedback",
    "LayoutProblem",
    "MicroBatch",
    "MicroBatchMeasurement",
    "ModelShape",
    "PerformanceModel",
    "Plan",
    "PlanCheckError",
    "PlanEstimate",
    "PlanLimits",
    "PlanResult",
    "PlanningError",
    "PlanningProblem",
    "Profile",
    "SchedulerName",
    "SequenceTooLongError",
    "ShardedGroup",
    "SolverReport",
    "UnknownModelError",
    "UnknownProfileError",
    "UnknownSchedulerError",
    "advise",
    "advise_cost",
    "block_degrees",
    "builtin_profiles",
    "check_plan",
    "cp_blocks",
    "effective_bucket_size",
    "find_violations",
    "make_plan",
    "make_problem",
    "observe",
    "resolve_model",
    "resolve_profile",
    "sample_lengths",
    "schedule",
    "simulate",
    "start_job",
]
