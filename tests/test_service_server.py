"""The real server: ``python -m scheduler_service serve`` on a free loopback port (``servers.serve``), spoken to
with httpx."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest
from skrull_proto import PlanResponse, Problem

from tests.servers import Served, serve

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    with serve() as server:
        yield server


def test_real_server_plans_over_http(served: Served) -> None:
    with httpx.Client(base_url=served.base_url, timeout=30) as client:
        assert client.get("/healthz").json()["status"] == "ok"
        assert client.get("/readyz").status_code == 200
        response = client.post("/plan", json={"sequence_lengths": [812, 30311, 97, 4096, 65000, 733],
                                              "dp_size": 2, "cp_size": 4},
                               headers={"x-request-id": "real-server-1"})
        assert response.status_code == 200, response.text
        assert response.headers["x-request-id"] == "real-server-1"
        plan = PlanResponse.model_validate_json(response.content)
        assert len(plan.dp_ranks) == 2 and plan.speedup_vs_deepspeed > 0


def test_real_server_rejects_bad_input_with_problem(served: Served) -> None:
    with httpx.Client(base_url=served.base_url, timeout=30) as client:
        response = client.post("/plan", content=b"{not json", headers={"content-type": "application/json"})
        assert response.status_code == 400
        assert response.headers["content-type"] == "application/problem+json"
        response = client.post("/plan", json={"sequence_lengths": [5, 0], "dp_size": 1, "cp_size": 1})
        assert Problem.model_validate_json(response.content).field == "sequence_lengths[1]"
        too_big = b'{"sequence_lengths": [' + b"1," * (3 << 20) + b"1]}"
        response = client.post("/plan", content=too_big, headers={"content-type": "application/json"})
        assert response.status_code == 413


@pytest.mark.cpsat
def test_real_server_solves_cpsat_in_its_pool(served: Served) -> None:
    with httpx.Client(base_url=served.base_url, timeout=60) as client:
        response = client.post("/plan", json={"sequence_lengths": [4000, 3000, 200, 100], "dp_size": 2,
                                              "cp_size": 2, "bucket_size": 8192, "scheduler": "cpsat"})
    assert response.status_code == 200, response.text
    assert PlanResponse.model_validate_json(response.content).solver is not None


def test_real_server_exports_metrics(served: Served) -> None:
    with httpx.Client(base_url=served.base_url, timeout=30) as client:
        client.post("/plan", json={"sequence_lengths": [100, 200], "dp_size": 1, "cp_size": 1})
        text = client.get("/metrics").text
    assert 'skrull_plan_requests_total{scheduler="skrull",status="200"}' in text
    assert "skrull_plan_solve_seconds_bucket" in text


def test_real_server_logs_json_lines_with_request_id(served: Served) -> None:
    with httpx.Client(base_url=served.base_url, timeout=30) as client:
        client.get("/healthz", headers={"x-request-id": "log-check-9"})
    deadline = time.monotonic() + 10
    entries = served.log_entries()
    while not any(e.get("request_id") == "log-check-9" for e in entries) and time.monotonic() < deadline:
        time.sleep(0.05)
        entries = served.log_entries()
    [access] = [e for e in entries if e.get("request_id") == "log-check-9"]
    assert access["logger"] == "scheduler_service.access"
    assert (access["method"], access["path"], access["status"]) == ("GET", "/healthz", 200)
    assert all({"ts", "level", "logger", "msg"} <= set(e) for e in entries)
