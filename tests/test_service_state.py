"""Job state outlives the process: a service killed mid-job and started again on the same SQLite file plans the
job with its refit, and service processes sharing a Redis server share their jobs (real uvicorn processes,
``python -m scheduler_service serve``; the Redis test skips where ``redis-server`` is not installed)."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import pytest
from skrull_proto import FeedbackResponse, PlanResponse

from scheduler_service.core.profile import DEFAULT_PROFILE
from tests.servers import serve
from tests.service_inputs import LENGTHS, report

pytestmark = pytest.mark.slow

BUDGET_BYTES = 1e9


def plan(client: httpx.Client, job_id: str = "job-1") -> PlanResponse:
    response = client.post("/plan", json={"sequence_lengths": LENGTHS, "dp_size": 1, "cp_size": 2, "model": "tiny",
                                          "bucket_size": 2048, "job_id": job_id})
    assert response.status_code == 200, response.text
    return PlanResponse.model_validate_json(response.content)


def refit(client: httpx.Client, job_id: str = "job-1") -> FeedbackResponse:
    """A report 1000 times slower than the profile, its peaks near the memory budget."""
    response = client.post("/feedback", json={**report(job_id, scale=1000.0, peak=0.97 * BUDGET_BYTES),
                                              "memory_budget_bytes": BUDGET_BYTES})
    assert response.status_code == 200, response.text
    return FeedbackResponse.model_validate_json(response.content)


def test_a_service_killed_and_started_again_plans_the_job_with_its_refit(tmp_path: Path) -> None:
    env = {"SKRULL_STATE_URL": f"sqlite://{tmp_path}/jobs.sqlite3"}
    with serve(env) as first, httpx.Client(base_url=first.base_url, timeout=30) as client:
        before = plan(client)
        state = refit(client)
        first.process.kill()  # SIGKILL: no shutdown hook runs; what was committed must be enough
        first.process.wait(timeout=30)
    assert before.profile == DEFAULT_PROFILE and before.bucket_size == 2048
    assert state.bucket_size_cap is not None and state.bucket_size_cap < 2048

    with serve(env) as second, httpx.Client(base_url=second.base_url, timeout=30) as client:
        assert FeedbackResponse.model_validate_json(client.get("/feedback/job-1").content) == state
        after = plan(client)
    assert after.profile == f"{DEFAULT_PROFILE}+feedback"
    # compute costs a thousand times more than the profile said, and the bucket is capped by the memory refit
    assert after.estimated_iteration_time_ms > 100 * before.estimated_iteration_time_ms
    assert after.bucket_size == max(state.bucket_size_cap, 871)  # 871: the longest sequence over 2 CP ranks


def test_services_sharing_redis_share_jobs_and_lose_no_concurrent_report(redis_url: str) -> None:
    env = {"SKRULL_STATE_URL": redis_url}
    with serve(env) as one, serve(env) as other, \
            httpx.Client(base_url=one.base_url, timeout=30) as first, \
            httpx.Client(base_url=other.base_url, timeout=30) as second:
        before = plan(first)
        refit(second)  # the job one registered, refit by the other
        assert plan(first).estimated_iteration_time_ms > 100 * before.estimated_iteration_time_ms

        # The same report to both at once, again and again: each is adopted (200) or refused (429), never lost.
        statuses: list[int] = []

        def send(client: httpx.Client) -> None:
            for _ in range(6):
                statuses.append(client.post("/feedback", json=report(scale=1000.0)).status_code)

        threads = [threading.Thread(target=send, args=(client,)) for client in (first, second)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert set(statuses) <= {200, 429} and len(statuses) == 12
        observations = FeedbackResponse.model_validate_json(second.get("/feedback/job-1").content).num_observations
    assert observations == 4 * (1 + statuses.count(200))
