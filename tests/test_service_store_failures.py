"""The job store fails soft: while its SQLite file is corrupt, its disk full or its folder read-only, or its Redis
server down, POST /plan answers with the base profile and says why, reports are refused (503, Retry-After) and
change nothing, /readyz stays ready and names the store's state, and /metrics counts the failures; once the store
is back the same service uses it again. While the store hangs, only the requests that need it wait. Real stores: a
SQLite file, a small tmpfs (root only; skipped elsewhere), a ``redis-server`` stopped and started again on its port,
or paused (skipped where none is installed)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from skrull_proto import FeedbackResponse, PlanResponse, Problem

from scheduler_service.core.profile import DEFAULT_PROFILE
from scheduler_service.runtime.settings import Settings
from scheduler_service.web.app import create_app
from tests.job_store_backends import RedisServer, corrupted, filled, read_only, small_tmpfs
from tests.servers import uvicorn_in_thread
from tests.service_inputs import LENGTHS, report

# The app in process (Starlette's test client), or a real server over a socket (an httpx client).
HttpClient = TestClient | httpx.Client

BASE_PROFILE = DEFAULT_PROFILE
REFIT_PROFILE = f"{DEFAULT_PROFILE}+feedback"


def settings_on(state_url: str) -> Settings:
    return Settings(state_url=state_url, cpsat_warmup=False, warmup=False, access_log=False)


def app_on(state_url: str) -> TestClient:
    return TestClient(create_app(settings_on(state_url)))


def plan_body(job_id: str | None) -> dict[str, Any]:
    return {"sequence_lengths": LENGTHS, "dp_size": 1, "cp_size": 2, "model": "tiny", "bucket_size": 2048,
            **({"job_id": job_id} if job_id else {})}


def plan(client: HttpClient, job_id: str | None = "job-1") -> PlanResponse:
    response = client.post("/plan", json=plan_body(job_id))
    assert response.status_code == 200, response.text
    return PlanResponse.model_validate_json(response.content)


def refit(client: HttpClient) -> FeedbackResponse:
    """The job planned and one report adopted: its later plans use the refit profile."""
    plan(client)
    answer = client.post("/feedback", json=report())
    assert answer.status_code == 200, answer.text
    assert plan(client).profile == REFIT_PROFILE
    return FeedbackResponse.model_validate_json(answer.content)


def assert_unavailable(response: httpx.Response, reason: str) -> None:
    assert response.status_code == 503, response.text
    assert response.headers["retry-after"] == "1"
    problem = Problem.model_validate_json(response.content)
    assert problem.type.endswith("unavailable") and problem.detail == f"the job store is unavailable: {reason}"


def job_store_errors(client: HttpClient, operation: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(f'skrull_job_store_errors_total{{operation="{operation}"}}'):
            return float(line.split()[-1])
    return 0.0


def readiness(client: HttpClient) -> dict[str, Any]:
    response = client.get("/readyz")
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


# ---- a corrupt SQLite file ----------------------------------------------------------------------------------

CORRUPT = "file is not a database"


@pytest.fixture
def state_file(tmp_path: Path) -> Path:
    return tmp_path / "jobs.sqlite3"


@pytest.fixture
def client(state_file: Path) -> Iterator[TestClient]:
    with app_on(str(state_file)) as test_client:
        yield test_client


def test_plans_use_the_base_profile_and_say_why_while_the_store_is_corrupt(client: TestClient,
                                                                          state_file: Path) -> None:
    refit(client)
    healthy = client.post("/plan", json=plan_body("job-1")).json()
    assert "job_state" not in healthy  # a healthy answer is as it always was
    with corrupted(state_file):
        degraded = plan(client)
        assert degraded.profile == BASE_PROFILE and degraded.job_state == f"unavailable: {CORRUPT}"
        without_job = plan(client, job_id=None)  # a plan without a job_id does not touch the store
        assert without_job.job_state is None
        assert (degraded.dp_ranks, degraded.estimated_iteration_time_ms) == (
            without_job.dp_ranks, without_job.estimated_iteration_time_ms)


def test_reports_are_refused_with_retry_after_and_change_nothing_while_the_store_is_corrupt(
    client: TestClient, state_file: Path
) -> None:
    acknowledged = refit(client)
    with corrupted(state_file):
        assert_unavailable(client.post("/feedback", json=report()), CORRUPT)
        assert_unavailable(client.get("/feedback/job-1"), CORRUPT)
    # The refused report left no trace, and the acknowledged one is in the file: another process reads it.
    with app_on(str(state_file)) as other_worker:
        assert FeedbackResponse.model_validate_json(other_worker.get("/feedback/job-1").content) == acknowledged
    sent_again = client.post("/feedback", json=report())
    assert sent_again.status_code == 200, sent_again.text
    assert sent_again.json()["num_observations"] == acknowledged.num_observations + 4


def test_readiness_stays_ready_and_names_the_stores_state(client: TestClient, state_file: Path) -> None:
    refit(client)
    assert readiness(client)["checks"]["job_store"] == "ok"
    with corrupted(state_file):
        plan(client)
        assert readiness(client) == {"status": "ready", "checks": {"planner": "ready", "cpsat": "cold",
                                                                   "job_store": f"unavailable: {CORRUPT}"}}
    plan(client)
    assert readiness(client)["checks"]["job_store"] == "ok"


def test_metrics_count_the_stores_failures_by_operation(client: TestClient, state_file: Path) -> None:
    refit(client)
    assert job_store_errors(client, "get") == 0
    with corrupted(state_file):
        plan(client)
        plan(client)
        client.post("/feedback", json=report())
    assert job_store_errors(client, "get") == 3


def test_the_restored_file_is_used_again_without_a_restart(client: TestClient, state_file: Path) -> None:
    refit(client)
    with corrupted(state_file):
        assert plan(client).profile == BASE_PROFILE
    restored = plan(client)
    assert restored.profile == REFIT_PROFILE and restored.job_state is None
    assert client.post("/feedback", json=report()).status_code == 200


# ---- a full disk, a read-only folder (a small tmpfs) --------------------------------------------------------

FULL = "database or disk is full"


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Path]:
    with small_tmpfs(tmp_path / "disk") as mount_point:
        yield mount_point


def test_a_full_disk_keeps_plans_on_the_refit_and_refuses_reports_until_there_is_room(disk: Path) -> None:
    with app_on(str(disk / "jobs.sqlite3")) as client:
        acknowledged = refit(client)
        with filled(disk):
            # The job still reads: its plans keep the refit, but the plan could not be recorded, and says so.
            degraded = plan(client)
            assert degraded.profile == REFIT_PROFILE and degraded.job_state == f"unavailable: {FULL}"
            assert_unavailable(client.post("/feedback", json=report()), FULL)
            assert FeedbackResponse.model_validate_json(client.get("/feedback/job-1").content) == acknowledged
            assert job_store_errors(client, "keep") == 1 and job_store_errors(client, "replace") == 1
        assert plan(client).job_state is None
        answer = client.post("/feedback", json=report())
        assert answer.json()["num_observations"] == acknowledged.num_observations + 4


def test_a_folder_turned_read_only_keeps_plans_on_the_refit_and_is_written_again_once_writable(disk: Path) -> None:
    read_only_reason = "attempt to write a readonly database"
    with app_on(str(disk / "jobs.sqlite3")) as client:
        acknowledged = refit(client)
        with filled(disk):  # a failure makes the store let go of its file, so the kernel lets it turn read-only
            assert client.post("/feedback", json=report()).status_code == 503
        with read_only(disk):
            degraded = plan(client)  # the store opens the file again: it reads, and cannot write
            assert degraded.profile == REFIT_PROFILE and degraded.job_state == f"unavailable: {read_only_reason}"
            assert_unavailable(client.post("/feedback", json=report()), read_only_reason)
            assert readiness(client)["checks"]["job_store"] == f"unavailable: {read_only_reason}"
        assert plan(client).job_state is None
        answer = client.post("/feedback", json=report())
        assert answer.json()["num_observations"] == acknowledged.num_observations + 4


# ---- Redis down ---------------------------------------------------------------------------------------------

def test_plans_go_on_while_redis_is_down_and_it_is_used_again_once_back(restartable_redis: RedisServer) -> None:
    with app_on(restartable_redis.url) as client:
        acknowledged = refit(client)
        restartable_redis.stop()
        degraded = plan(client)
        assert degraded.profile == BASE_PROFILE and degraded.job_state == "unavailable: ConnectionError"
        assert_unavailable(client.post("/feedback", json=report()), "ConnectionError")
        assert readiness(client)["checks"]["job_store"] == "unavailable: ConnectionError"
        assert job_store_errors(client, "get") == 2
        restartable_redis.start()
        # The same client connects again; the server kept what it acknowledged (and lost its scripts).
        assert FeedbackResponse.model_validate_json(client.get("/feedback/job-1").content) == acknowledged
        restored = plan(client)
        assert restored.profile == REFIT_PROFILE and restored.job_state is None
        answer = client.post("/feedback", json=report())
        assert answer.json()["num_observations"] == acknowledged.num_observations + 4
        assert readiness(client)["checks"]["job_store"] == "ok"


# ---- Redis hung ---------------------------------------------------------------------------------------------

def test_a_hung_redis_holds_only_the_requests_that_need_it_until_their_timeout(restartable_redis: RedisServer) -> None:
    """Redis paused (SIGSTOP: it keeps its connections and answers nothing) while a report reads its job: the probes
    and a plan without a job_id answer while the report still waits for Redis, which then gets its 503 when the
    store's call times out (1 s here, from the URL; 2 s by default). Redis continued, nothing was lost. A real
    server on a port, so that every request has its own connection."""
    state_url = f"{restartable_redis.url}?socket_timeout=1"
    with uvicorn_in_thread(create_app(settings_on(state_url))) as port, \
            httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client, \
            ThreadPoolExecutor(max_workers=1) as background:
        acknowledged = refit(client)
        with restartable_redis.paused():
            report_sent = background.submit(client.post, "/feedback", json=report())
            deadline = time.monotonic() + 30
            while restartable_redis.num_waiting_connections() == 0:  # until the report's read reached Redis
                assert time.monotonic() < deadline and not report_sent.done(), "the report never reached Redis"
                time.sleep(0.01)
            assert client.get("/healthz").status_code == 200
            assert readiness(client)["status"] == "ready"
            assert plan(client, job_id=None).job_state is None
            assert restartable_redis.num_waiting_connections() == 1, "answered only once the report's read gave up"
            assert_unavailable(report_sent.result(timeout=30), "TimeoutError")
            assert readiness(client)["checks"]["job_store"] == "unavailable: TimeoutError"
        assert FeedbackResponse.model_validate_json(client.get("/feedback/job-1").content) == acknowledged
        answer = client.post("/feedback", json=report())
        assert answer.json()["num_observations"] == acknowledged.num_observations + 4
        assert job_store_errors(client, "get") == 1
