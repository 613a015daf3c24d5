"""The pure planning core: performance model, schedulers, simulator, plan checker.

Plain Python with dataclasses and numpy, and numba-compiled scalar kernels for the searches' inner loops
(``jit``; ``ortools`` only inside ``cpsat``); no FastAPI, pydantic or torch, so the service, the CLI and the
trainer's embedded fallback share it.

The names below are importable from here (``from scheduler_service.core import make_plan``), each loaded from its
module on first use: importing one module of the core (``core.errors``, say) loads that module alone, not numba
and every scheduler. (A name that is also a module's, as ``advise`` and ``simulate``, would be that module once it is
imported: ``core.advise.advise`` and ``core.simulate.simulate`` are the functions.)
"""

from __future__ import annotations

import importlib
from typing import Any

# Each name importable from the package, and the module of the core that defines it.
_EXPORTS = {
    "Advice": "advise",
    "GlobalBatchSize": "advise",
    "LayoutProblem": "advise",
    "advise_cost": "advise",
    "check_plan": "check",
    "find_violations": "check",
    "SchedulerName": "choices",
    "BaselineCannotPlanError": "errors",
    "InfeasiblePlanError": "errors",
    "InvalidRequestError": "errors",
    "PlanCheckError": "errors",
    "PlanningError": "errors",
    "SequenceTooLongError": "errors",
    "UnknownModelError": "errors",
    "UnknownProfileError": "errors",
    "UnknownSchedulerError": "errors",
    "FeedbackConfig": "feedback",
    "GroupLengths": "feedback",
    "JobFeedback": "feedback",
    "MicroBatchMeasurement": "feedback",
    "effective_bucket_size": "feedback",
    "observe": "feedback",
    "start_job": "feedback",
    "MODEL_CATALOGUE": "models",
    "ModelShape": "models",
    "resolve_model": "models",
    "PerformanceModel": "perf_model",
    "DPRankPlan": "plan",
    "MicroBatch": "plan",
    "Plan": "plan",
    "PlanLimits": "plan",
    "PlanningProblem": "plan",
    "ShardedGroup": "plan",
    "SolverReport": "plan",
    "block_degrees": "plan",
    "cp_blocks": "plan",
    "make_problem": "plan",
    "PlanResult": "planner",
    "make_plan": "planner",
    "schedule": "planner",
    "Profile": "profile",
    "builtin_profiles": "profile",
    "resolve_profile": "profile",
    "DATASETS": "samplers",
    "sample_lengths": "samplers",
    "PlanEstimate": "simulate",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # loaded once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
