"""The real server: ``python -m scheduler_service serve`` on a free loopback port, spoken to with httpx.

``serve`` starts one; the robustness tests (``test_service_robustness``) use it too.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import httpx
import pytest
from skrull_proto import PlanResponse, Problem

pytestmark = pytest.mark.slow

_RUNNING = re.compile(r"Uvicorn running on http://127\.0\.0\.1:(\d+)")


@dataclass
class Served:
    base_url: str
    process: subprocess.Popen[str]
    pending: queue.Queue[str]  # stderr lines, read by a thread
    log_lines: list[str] = field(default_factory=list)

    def log_entries(self) -> list[dict[str, object]]:
        while not self.pending.empty():
            self.log_lines.append(self.pending.get())
        return [json.loads(line) for line in self.log_lines if line.startswith("{")]


def _read_lines(stream: object, lines: queue.Queue[str]) -> None:
    for line in stream:  # type: ignore[attr-defined]
        lines.put(line)


@contextlib.contextmanager
def serve(env: Mapping[str, str] | None = None) -> Iterator[Served]:
    """``python -m scheduler_service serve`` on port 0 (uvicorn binds a free port and logs it, so there is no race
    for a port number), stopped with SIGTERM (graceful: the lifespan's exit runs). One worker unless ``env`` asks
    for more: the tests count the server's child processes and kill it."""
    env = {**os.environ, "SKRULL_WORKERS": "1", "SKRULL_CPSAT_WARMUP": "false",
           "SKRULL_CPSAT_DEFAULT_TIME_LIMIT_S": "0.3", **(env or {})}
    process = subprocess.Popen(
        [sys.executable, "-m", "scheduler_service", "serve", "--host", "127.0.0.1", "--port", "0"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=_read_lines, args=(process.stderr, lines), daemon=True)
    reader.start()
    log_lines: list[str] = []
    port = None
    deadline = time.monotonic() + 60
    while port is None and time.monotonic() < deadline and process.poll() is None:
        try:
            line = lines.get(timeout=0.5)
        except queue.Empty:
            continue
        log_lines.append(line)
        if match := _RUNNING.search(line):
            port = int(match.group(1))
    try:
        if port is None:
            process.kill()
            pytest.fail("server did not start:\n" + "".join(log_lines))
        yield Served(base_url=f"http://127.0.0.1:{port}", process=process, pending=lines, log_lines=log_lines)
    finally:
        if process.poll() is None:
            process.terminate()
        process.wait(timeout=30)
        reader.join(timeout=10)  # it ends at the pipe's end of file
        assert process.stderr is not None
        process.stderr.close()


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
