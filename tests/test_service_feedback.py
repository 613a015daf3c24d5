"""POST /feedback: opt-in per job, refits the job's later plans, lowers its bucket near the memory budget, and
answers bad reports with a 4xx problem that leaves the job unchanged."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from skrull_proto import FeedbackRequest, FeedbackResponse, PlanResponse

from scheduler_service.core.plan import DPRankPlan, MicroBatch, Plan, make_problem
from scheduler_service.core.planner import make_plan
from scheduler_service.core.profile import DEFAULT_PROFILE, builtin_profiles
from scheduler_service.web.app import create_app
from tests.answers import assert_problem
from tests.service_inputs import LENGTHS, report, settings
from trainer_client.planning.client import PlanClient
from trainer_client.planning.source import MicroBatchTiming, PlanOrigin, PlanSource, measurements_of

PAPER = builtin_profiles()["h100-paper"]


@pytest.fixture
def client() -> Iterator[TestClient]:
    with TestClient(create_app(settings())) as test_client:
        yield test_client


def plan(client: TestClient, job_id: str | None = "job-1", **overrides: Any) -> PlanResponse:
    body = {"sequence_lengths": LENGTHS, "dp_size": 1, "cp_size": 2, "model": "tiny", "bucket_size": 2048,
            **({"job_id": job_id} if job_id else {}), **overrides}
    response = client.post("/plan", json=body)
    assert response.status_code == 200, response.text
    return PlanResponse.model_validate_json(response.content)


def test_feedback_refits_the_profile_of_the_jobs_later_plans(client: TestClient) -> None:
    before = plan(client)
    answer = client.post("/feedback", json=report(scale=1000.0))
    assert answer.status_code == 200, answer.text
    state = FeedbackResponse.model_validate_json(answer.content)
    assert state.profile == f"{DEFAULT_PROFILE}+feedback" and state.num_observations == 4
    assert state.compute_scale == pytest.approx(1000.0, rel=0.05)
    after = plan(client)
    assert after.profile == f"{DEFAULT_PROFILE}+feedback"
    # compute now costs a thousand times more, communication the same: the plan (and its estimate) follow
    assert after.estimated_iteration_time_ms > 100 * before.estimated_iteration_time_ms
    other = plan(client, job_id="job-2")  # other jobs, and plans without a job, keep the base profile
    assert other.profile == plan(client, job_id=None).profile == DEFAULT_PROFILE
    assert client.get("/feedback/job-1").json() == answer.json()


def test_memory_near_the_budget_lowers_the_bucket_size_of_later_plans(client: TestClient) -> None:
    assert plan(client).bucket_size == 2048
    budget = 1e9
    answer = client.post("/feedback", json={**report(peak=0.97 * budget), "memory_budget_bytes": budget})
    state = FeedbackResponse.model_validate_json(answer.content)
    assert state.bucket_size_cap is not None and state.bucket_size_cap < 2048
    lowered = plan(client)
    # never below what the longest sequence (1742 tokens over 2 CP ranks) needs
    assert lowered.bucket_size == max(state.bucket_size_cap, 871)
    assert "skrull_feedback_bucket_lowered_total 1.0" in client.get("/metrics").text


def test_changing_model_or_sizes_restarts_the_job(client: TestClient) -> None:
    plan(client)
    client.post("/feedback", json=report())
    assert plan(client).profile == f"{DEFAULT_PROFILE}+feedback"
    assert plan(client, dp_size=2).profile == DEFAULT_PROFILE  # a new shape of job: a fresh refit
    assert client.get("/feedback/job-1").json()["num_observations"] == 0


def _bad(mutate: Any) -> dict[str, Any]:
    body = copy.deepcopy(report())
    mutate(body)
    return body


@pytest.mark.parametrize(
    ("body", "status", "field"),
    [
        pytest.param(_bad(lambda b: b["micro_batches"][1].update(time_ms=-3.0)), 422, "micro_batches[1].time_ms",
                     id="negative-time"),
        pytest.param(_bad(lambda b: b["micro_batches"][0].update(time_ms=0)), 422, "micro_batches[0].time_ms",
                     id="zero-time"),
        pytest.param(_bad(lambda b: b["micro_batches"][0].update(time_ms=1e12)), 422, "micro_batches[0].time_ms",
                     id="absurd-time"),
        pytest.param(_bad(lambda b: b["micro_batches"][2].update(peak_memory_bytes=1e20)), 422,
                     "micro_batches[2].peak_memory_bytes", id="absurd-memory"),
        pytest.param(_bad(lambda b: b["micro_batches"][2].update(peak_memory_bytes=-1)), 422,
                     "micro_batches[2].peak_memory_bytes", id="negative-memory"),
        pytest.param(_bad(lambda b: b["micro_batches"][2].update(peak_memory_bytes=1e-300)), 422,
                     "micro_batches[2].peak_memory_bytes", id="tiny-memory"),
        pytest.param(_bad(lambda b: b["micro_batches"][1].update(time_ms=1e-300)), 422, "micro_batches[1].time_ms",
                     id="tiny-time"),
        pytest.param(_bad(lambda b: b["micro_batches"][0].update(local_lengths=[[637, 0], [1216]])), 422,
                     "micro_batches[0].local_lengths[0][1]", id="zero-length"),
        pytest.param(_bad(lambda b: b["micro_batches"][1].update(distributed_lengths=[1 << 30])), 422,
                     "micro_batches[1]", id="absurd-length"),
        pytest.param(_bad(lambda b: b["micro_batches"][3].update(local_lengths=[[1742]])), 422,
                     "micro_batches[3].local_lengths", id="wrong-cp-lists"),
        pytest.param(_bad(lambda b: b["micro_batches"][3].update(local_lengths=[[], []])), 422,
                     "micro_batches[3].local_lengths", id="empty-micro-batch"),
        pytest.param(_bad(lambda b: b.update(micro_batches=[])), 422, "micro_batches", id="no-micro-batch"),
        pytest.param(_bad(lambda b: b.update(memory_budget_bytes=0)), 422, "memory_budget_bytes", id="no-budget"),
        pytest.param(_bad(lambda b: b.update(job_id="job 1/../x")), 422, "job_id", id="bad-job-id"),
        pytest.param(_bad(lambda b: b.update(seconds=3)), 422, "seconds", id="unknown-field"),
        pytest.param(_bad(lambda b: b.update(job_id="never-planned")), 404, "job_id", id="unknown-job"),
    ],
)
def test_bad_feedback_is_a_clear_4xx_and_leaves_the_profile_unchanged(
    client: TestClient, body: dict[str, Any], status: int, field: str
) -> None:
    plan(client)
    client.post("/feedback", json=report(scale=50.0))
    before_state = client.get("/feedback/job-1").json()
    before_plan = plan(client)
    problem = assert_problem(client.post("/feedback", json=body), status, field)
    assert problem.detail
    assert client.get("/feedback/job-1").json() == before_state
    after_plan = plan(client)
    assert (after_plan.profile, after_plan.bucket_size, after_plan.estimated_iteration_time_ms) == (
        before_plan.profile, before_plan.bucket_size, before_plan.estimated_iteration_time_ms)


def test_malformed_feedback_json_is_a_400(client: TestClient) -> None:
    response = client.post("/feedback", content=b'{"job_id": "job-1", "micro_batches": [',
                           headers={"content-type": "application/json"})
    assert_problem(response, 400, "body")


def test_unknown_job_names_the_job_and_the_limit(client: TestClient) -> None:
    problem = assert_problem(client.get("/feedback/nobody"), 404, "job_id")
    assert "nobody" in problem.detail and problem.limit == 256 and problem.type.endswith("unknown-job")


def test_feedback_can_be_switched_off() -> None:
    with TestClient(create_app(settings(feedback=False))) as client:
        assert plan(client).profile == DEFAULT_PROFILE  # a job_id is then simply ignored
        problem = assert_problem(client.post("/feedback", json=report()), 404, None)
        assert "disabled" in problem.detail


def test_the_service_keeps_a_bounded_number_of_jobs() -> None:
    with TestClient(create_app(settings(feedback_max_jobs=2))) as client:
        for job_id in ("a", "b", "c"):
            plan(client, job_id=job_id)
        assert client.get("/feedback/a").status_code == 404  # the least recently planned is forgotten
        assert client.get("/feedback/c").status_code == 200
        assert "skrull_feedback_jobs 2.0" in client.get("/metrics").text


def test_plan_source_reports_measured_micro_batches_and_accepts_a_lowered_bucket(client: TestClient) -> None:
    source = PlanSource(scheduler="skrull", dp_size=1, cp_size=2, model="tiny", bucket_size=2048,
                        client=PlanClient("http://testserver", client=client), job_id="trainer-job")
    decision = source.decide(0, LENGTHS)
    assert decision.origin is PlanOrigin.SERVICE
    micro_batches = decision.plan.dp_ranks[0].micro_batches
    timings = [MicroBatchTiming(dp_rank=0, index=i, time_s=0.5 + i, peak_memory_bytes=9_900_000_000)
               for i in range(len(micro_batches))]
    timings.append(MicroBatchTiming(dp_rank=0, index=0, time_s=0.1))  # another CP rank, faster: not the max
    future = source.report(1, decision.plan, LENGTHS, timings, memory_budget_bytes=1e10)
    assert future is not None
    future.result(timeout=10)
    assert source.num_feedback_failures == 0
    assert source.last_feedback is not None and source.last_feedback.num_observations == len(micro_batches)
    assert source.last_feedback.bucket_size_cap is not None
    lowered = source.decide(1, LENGTHS)
    assert lowered.origin is PlanOrigin.SERVICE and lowered.bucket_size < 2048
    source.close()


def test_measurements_take_the_slowest_cp_rank_and_the_largest_peak() -> None:
    problem = make_problem(sequence_lengths=LENGTHS, dp_size=1, cp_size=2, model="tiny", bucket_size=2048)
    plan_ = make_plan(problem, "skrull").plan
    timings = [MicroBatchTiming(dp_rank=0, index=0, time_s=0.2, peak_memory_bytes=5 << 30),
               MicroBatchTiming(dp_rank=0, index=0, time_s=0.3, peak_memory_bytes=4 << 30)]
    (only,) = measurements_of(plan_, LENGTHS, timings)
    micro_batch = plan_.dp_ranks[0].micro_batches[0]
    assert only.time_ms == pytest.approx(300.0) and only.peak_memory_bytes == 5 << 30
    assert only.local_lengths == [[LENGTHS[i] for i in rank] for rank in micro_batch.local]
    FeedbackRequest(job_id="x", micro_batches=[only])  # a valid wire report


def test_a_micro_batch_with_a_ulysses_collective_is_not_reported() -> None:
    """The refit prices a measurement as all-gather-KV: a Ulysses or 2D micro-batch's time would mislead it."""
    local = ((0,), (1,))
    gathered = MicroBatch(local=local, distributed=(2,))
    ulysses = MicroBatch(local=((3,), ()), distributed=(4,), distributed_ulysses_degree=2)
    plan_ = Plan(dp_ranks=(DPRankPlan(micro_batches=(gathered, ulysses)),))
    timings = [MicroBatchTiming(dp_rank=0, index=index, time_s=0.1) for index in (0, 1)]
    (only,) = measurements_of(plan_, [100, 200, 900, 50, 1200], timings)
    assert only.distributed_lengths == [900]


def test_feedback_failures_are_counted_not_raised(client: TestClient) -> None:
    source = PlanSource(scheduler="skrull", dp_size=1, cp_size=2, model="tiny", bucket_size=2048,
                        client=PlanClient("http://testserver", client=client), job_id="never-planned")
    decision = source._plan_embedded(0, LENGTHS)
    future = source.report(1, decision.plan, LENGTHS, [MicroBatchTiming(dp_rank=0, index=0, time_s=0.1)])
    assert future is not None
    future.result(timeout=10)
    assert source.num_feedback_failures == 1
    source.close()
