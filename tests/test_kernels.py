"""The compiled kernels of the planning core: their plain-Python source is their specification, and the search
budget trades time for quality without ever giving a worse plan."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings

from scheduler_service.core import gds
from scheduler_service.core.jit import JIT_DISABLED
from scheduler_service.core.plan import PlanningProblem
from scheduler_service.core.plan_refine import DEFAULT_BUDGET
from scheduler_service.core.simulate import simulate
from tests import planning_cases
from tests.problem_builders import hybrid_problems

REPOSITORY = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_compiled_kernels_plan_exactly_as_their_python_source() -> None:
    # NUMBA_DISABLE_JIT is read when numba is imported: the Python run needs a process of its own
    assert not JIT_DISABLED
    python = subprocess.run([sys.executable, "-m", "tests.planning_cases"], cwd=REPOSITORY, check=True,
                            capture_output=True, text=True, env={**os.environ, "NUMBA_DISABLE_JIT": "1"})
    ran = json.loads(python.stdout)
    assert ran["jit_disabled"]
    assert ran["plans"] == json.loads(json.dumps(planning_cases.plans()))


@pytest.mark.slow
def test_warm_up_compiles_every_kernel_the_planners_call() -> None:
    # a process of its own: in this one, earlier tests have compiled whatever they planned
    script = "from tests.planning_cases import kernels_compiled_after_warm_up as late; print(late())"
    ran = subprocess.run([sys.executable, "-c", script], cwd=REPOSITORY, check=True, capture_output=True, text=True)
    assert ran.stdout.strip() == "[]"


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problem=hybrid_problems(max_sequences=32))
def test_a_larger_search_budget_never_gives_a_worse_plan(problem: PlanningProblem) -> None:
    times_s = [simulate(problem, gds.skrull(problem, budget=budget)).iteration_time_s for budget in (0, 4, 16, 64)]
    assert all(later <= earlier * (1 + 1e-12) for earlier, later in itertools.pairwise(times_s))


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problem=hybrid_problems(max_sequences=32))
def test_the_default_budget_of_a_small_batch_is_the_default_number_of_units(problem: PlanningProblem) -> None:
    assert gds.skrull(problem) == gds.skrull(problem, budget=DEFAULT_BUDGET)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problem=hybrid_problems(max_sequences=32))
def test_the_same_request_gives_the_same_plan_whatever_the_budget(problem: PlanningProblem) -> None:
    for budget in (None, 64):
        assert gds.skrull(problem, budget=budget) == gds.skrull(problem, budget=budget)
