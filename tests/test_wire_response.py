"""The service writes a plan's answer from plain data with orjson (``wire.result_to_response_data``), not through
the pydantic models: it must be byte for byte what ``PlanResponse`` would serialise, for every scheduler, with
hybrid groups, a per-CP-rank breakdown, a CP-SAT report and a job store's state."""

from __future__ import annotations

import dataclasses

import numpy as np
import orjson
import pytest
from skrull_proto import PlanRequest, PlanResponse

from scheduler_service.contract.wire import result_to_response, result_to_response_data
from scheduler_service.core.plan import SolverReport, make_problem
from scheduler_service.core.planner import HEURISTIC_SCHEDULERS, PlanResult, make_plan
from scheduler_service.core.profile import DEFAULT_PROFILE
from scheduler_service.core.samplers import sample_lengths
from scheduler_service.runtime.work import plan_request
from tests.grouped_plans import GROUPED_PLAN, result_of
from tests.problem_builders import ADDITIVE_PROFILE, with_floor


def assert_written_as_the_model(result: PlanResult, breakdown: bool) -> None:
    written = orjson.dumps(result_to_response_data(result, breakdown=breakdown))
    assert written == result_to_response(result, breakdown=breakdown).model_dump_json().encode()
    assert PlanResponse.model_validate_json(written) == result_to_response(result, breakdown=breakdown)


@pytest.mark.parametrize("breakdown", [False, True])
@pytest.mark.parametrize("scheduler", list(HEURISTIC_SCHEDULERS))
def test_every_scheduler_answer_is_written_as_the_model_would(scheduler: str, breakdown: bool) -> None:
    lengths = sample_lengths("lmsys", 256, np.random.default_rng(7), max_length=60000)
    # the static SP schedulers on a model whose heads split over cp_size 8 (qwen2.5-0.5b's 14 do not: refused)
    static_sp = scheduler in ("ulysses", "usp")
    problem = make_problem(sequence_lengths=[int(n) for n in lengths], dp_size=4, cp_size=8,
                           model="llama-2-7b" if static_sp else "qwen2.5-0.5b", bucket_size=8192 if static_sp else None)
    assert_written_as_the_model(make_plan(problem, scheduler), breakdown)


@pytest.mark.parametrize("breakdown", [False, True])
def test_hybrid_groups_and_a_solver_report_are_written_as_the_model_would(breakdown: bool) -> None:
    grouped = result_of(GROUPED_PLAN)
    assert_written_as_the_model(grouped, breakdown)
    report = SolverReport(status="FEASIBLE", objective_s=0.0123, bound_s=None, wall_time_s=0.5)
    assert_written_as_the_model(dataclasses.replace(grouped, solver=report), breakdown)


def test_a_launch_bound_breakdown_adds_up_and_names_the_floor_only_where_there_is_one() -> None:
    lengths = [int(n) for n in sample_lengths("lmsys", 64, np.random.default_rng(3), max_length=60000)]
    # A floor of 0.1 s per micro-batch: above some CP ranks' work under the additive profile, not all; the default
    # profile has its measured one.
    for profile, has_floor in ((ADDITIVE_PROFILE, False), (with_floor(0.1 / 24), True), (DEFAULT_PROFILE, True)):
        problem = make_problem(sequence_lengths=lengths, dp_size=2, cp_size=4, model="qwen2.5-0.5b", profile=profile)
        result = make_plan(problem, "skrull")
        assert_written_as_the_model(result, breakdown=True)
        ranks = [rank for dp_rank in result_to_response_data(result, breakdown=True)["dp_ranks"]
                 for micro_batch in dp_rank["micro_batches"] for rank in micro_batch["cp_ranks"]]
        assert any("launch_bound_ms" in rank for rank in ranks) == has_floor  # absent, as before, without one
        for rank in ranks:
            parts = ("local_ms", "distributed_ms", "sharded_ms", "fixed_ms", "exposed_comm_ms", "launch_bound_ms")
            assert sum(rank.get(part, 0.0) for part in parts) == pytest.approx(rank["time_ms"], abs=1e-5)


@pytest.mark.parametrize("job_state", [None, "unavailable: file is not a database"])
def test_the_services_answer_carries_job_state_where_the_model_writes_it(job_state: str | None) -> None:
    request = PlanRequest(sequence_lengths=[812, 30311, 97, 4096, 1500, 256], dp_size=2, cp_size=4, breakdown=True)
    batch = plan_request(request)
    plan = PlanResponse.model_validate_json(batch.answer(None))
    assert plan.job_state is None
    expected = plan.model_copy(update={"job_state": job_state}).model_dump_json().encode()
    assert batch.answer(job_state) == expected
