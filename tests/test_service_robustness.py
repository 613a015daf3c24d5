"""A real uvicorn process under heavy but valid requests, extreme numbers, slow and vanishing clients, and a kill.

One class per test: cost is bounded by what a request really costs; probes answer while heavy work runs; the
server's memory stays bounded; numbers cannot poison a job; one request gives one plan; a client's hang-up is a
499, not a server error; no answer carries a path or a long echo; incomplete connections are closed; every
process of a killed server ends with it. Ordering, not timing: nothing here asserts how long anything took.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from skrull_proto import FeedbackResponse, PlanResponse, Problem

from scheduler_service.core.samplers import sample_lengths
from tests.servers import Served, descendants, is_running, serve

pytestmark = pytest.mark.slow

# Valid and heavy: 64 sequences that each fill a micro-batch of 1024 CP ranks, so the plan (and the deepspeed
# baseline) hold 64 × 1024 local lists: about 0.13 M cells, seconds of planning in the heavy pool.
HEAVY = {"sequence_lengths": [1000] * 64, "dp_size": 1, "cp_size": 1024, "bucket_size": 1}
SMALL = {"sequence_lengths": [812, 30311, 97, 4096, 65000, 733], "dp_size": 2, "cp_size": 4}
# Small (inline by its cells) but with the largest search budget a request may ask for: about a second of search.
SEARCHING = {"sequence_lengths": sample_lengths("chatqa2", 256, np.random.default_rng(0), max_length=65536).tolist(),
             "dp_size": 4, "cp_size": 8, "model": "qwen2.5-7b", "search_budget": 1 << 16}
ENV = {
    "SKRULL_HEAVY_WORKERS": "1", "SKRULL_HEAVY_QUEUE": "0",  # one heavy request at a time: the next is a 429
    "SKRULL_HEADER_TIMEOUT_S": "0.5", "SKRULL_BODY_TIMEOUT_S": "0.5",
}


@pytest.fixture(scope="module")
def profile_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("profiles")


@pytest.fixture(scope="module")
def served(profile_dir: Path) -> Iterator[Served]:
    with serve({**ENV, "SKRULL_PROFILE_DIR": str(profile_dir)}) as server:
        yield server


def _metric(client: httpx.Client, prefix: str) -> float:
    """The value of the exposition line starting with ``prefix`` (0 when absent)."""
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(prefix + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _wait_until(condition: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"never happened: {what}")
        time.sleep(0.02)


def _raw_post(base_url: str, body: bytes) -> socket.socket:
    host, port = base_url.removeprefix("http://").split(":")
    connection = socket.create_connection((host, int(port)))
    connection.sendall(b"POST /plan HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    return connection


def _plan_in_background(served: Served, body: dict[str, object]) -> tuple[threading.Thread, list[httpx.Response]]:
    """POST /plan of ``body`` on a thread of its own, so the test can probe the server meanwhile; the answer lands
    in the list once it comes."""
    answers: list[httpx.Response] = []

    def post() -> None:
        with httpx.Client(base_url=served.base_url, timeout=300) as client:
            answers.append(client.post("/plan", json=body))

    thread = threading.Thread(target=post)
    thread.start()
    return thread, answers


def test_probes_answer_while_a_heavy_plan_runs_and_a_second_one_is_a_429(served: Served) -> None:
    with httpx.Client(base_url=served.base_url, timeout=60) as client:
        heavy, heavy_answers = _plan_in_background(served, HEAVY)
        _wait_until(lambda: _metric(client, "skrull_heavy_in_flight") == 1.0, "the heavy plan was admitted")
        assert client.get("/healthz").status_code == 200
        assert client.get("/readyz").status_code == 200
        small = client.post("/plan", json=SMALL)
        busy = client.post("/plan", json=HEAVY)
        assert not heavy_answers  # all of the above were answered while the heavy plan was still running
        heavy.join()
    assert small.status_code == 200
    assert busy.status_code == 429 and int(busy.headers["retry-after"]) >= 1
    assert Problem.model_validate_json(busy.content).limit == 1
    assert heavy_answers[0].status_code == 200, heavy_answers[0].text
    plan = PlanResponse.model_validate_json(heavy_answers[0].content)
    assert sum(len(dp_rank.micro_batches) for dp_rank in plan.dp_ranks) == 64


@pytest.mark.parametrize("budget", [-1, 1.5, "64", True, 1 << 17, 10**30])
def test_a_bad_search_budget_is_a_422_naming_it(served: Served, budget: object) -> None:
    with httpx.Client(base_url=served.base_url, timeout=60) as client:
        response = client.post("/plan", json={**SMALL, "search_budget": budget})
    assert response.status_code == 422, response.text
    problem = Problem.model_validate_json(response.content)
    assert problem.field == "search_budget", problem
    if budget == 1 << 17:
        assert problem.limit == 1 << 16


def test_the_largest_search_budget_searches_in_the_heavy_pool_while_probes_answer(served: Served) -> None:
    """A small batch with the largest budget is a second of search: it must not run on the event loop."""
    with httpx.Client(base_url=served.base_url, timeout=60) as client:
        searching, answers = _plan_in_background(served, SEARCHING)
        _wait_until(lambda: _metric(client, "skrull_heavy_in_flight") == 1.0 or bool(answers),
                    "the search was admitted or answered")
        assert not answers, "planned inline, on the event loop"
        assert client.get("/healthz").status_code == 200
        assert not answers  # answered while the search was still running
        searching.join()
    assert answers[0].status_code == 200, answers[0].text


def test_a_plan_over_the_cost_limit_is_a_422_naming_the_limit_and_the_estimate(served: Served) -> None:
    with httpx.Client(base_url=served.base_url, timeout=60) as client:
        response = client.post("/plan", json={**HEAVY, "sequence_lengths": [1000] * 1024})
        assert _metric(client, "skrull_heavy_in_flight") == 0.0  # refused before any work
    problem = Problem.model_validate_json(response.content)
    assert response.status_code == 422 and problem.limit == 1 << 20
    assert "1024 sequences on cp_size 1024 holds at least 1049600 cells" in problem.detail


def test_server_memory_stays_bounded_under_repeated_heavy_plans(served: Served) -> None:
    def peak_rss_bytes() -> int:  # the server process's high-water mark
        status = Path(f"/proc/{served.process.pid}/status").read_text()
        return int(next(line for line in status.splitlines() if line.startswith("VmHWM:")).split()[1]) * 1024

    with httpx.Client(base_url=served.base_url, timeout=300) as client:
        client.post("/plan", json={**HEAVY, "sequence_lengths": [1000] * 16})  # the pool process is up
        before = peak_rss_bytes()
        for _ in range(2):
            assert client.post("/plan", json=HEAVY).status_code == 200
        after = peak_rss_bytes()
    # Planned in the server process, each of these raised its peak by about 20 MB (and 4096 sequences by 850 MB,
    # now refused by the cost limit); planned in the pool process, they leave it where it was.
    assert after - before < 10 << 20


def test_a_client_that_hangs_up_is_a_499_not_a_server_error(served: Served) -> None:
    with httpx.Client(base_url=served.base_url, timeout=60) as client:
        connection = _raw_post(served.base_url, json.dumps(HEAVY).encode())
        _wait_until(lambda: _metric(client, "skrull_heavy_in_flight") == 1.0, "the heavy plan was admitted")
        connection.close()
        hung_up = 'skrull_http_requests_total{method="POST",route="/plan",status="499"}'
        _wait_until(lambda: _metric(client, hung_up) == 1.0, "the hang-up was counted")
        exposition = client.get("/metrics").text
        _wait_until(lambda: _metric(client, "skrull_heavy_in_flight") == 0.0, "the pool process finished")
    assert not any(line.startswith("skrull_http_requests_total") and 'status="5' in line
                   for line in exposition.splitlines())
    logged = [entry for entry in served.log_entries() if entry.get("logger") == "scheduler_service.access"]
    assert any(entry["status"] == 499 for entry in logged)


def test_extreme_feedback_numbers_are_422s_and_a_heavy_report_is_refit_off_the_loop(served: Served) -> None:
    cp_size = 256
    plan = {"sequence_lengths": [4000, 300, 20], "dp_size": 1, "cp_size": cp_size, "job_id": "robust-1"}

    def report(num_micro_batches: int, **measured: float) -> dict[str, object]:
        micro_batch = {"local_lengths": [[300]] + [[]] * (cp_size - 1), "distributed_lengths": [4000],
                       "time_ms": 5.0, **measured}
        return {"job_id": "robust-1", "micro_batches": [micro_batch] * num_micro_batches}

    with httpx.Client(base_url=served.base_url, timeout=300) as client:
        assert client.post("/plan", json=plan).status_code == 200
        tiny_memory = client.post("/feedback", json=report(1, peak_memory_bytes=1e-300))
        tiny_time = client.post("/feedback", json=report(1, time_ms=1e-300))
        heavy = client.post("/feedback", json=report(200, peak_memory_bytes=2e9))  # 51 k lists: the pool's
        too_heavy = client.post("/feedback", json=report(1100))
    assert tiny_memory.status_code == 422
    assert Problem.model_validate_json(tiny_memory.content).field == "micro_batches[0].peak_memory_bytes"
    assert tiny_time.status_code == 422
    assert Problem.model_validate_json(tiny_time.content).field == "micro_batches[0].time_ms"
    assert heavy.status_code == 200, heavy.text
    assert FeedbackResponse.model_validate_json(heavy.content).num_observations == 200
    assert too_heavy.status_code == 422 and Problem.model_validate_json(too_heavy.content).limit == 1 << 18


@pytest.mark.cpsat
def test_the_same_cpsat_request_gets_the_same_plan(served: Served) -> None:
    # Twelve long-tailed sequences on 2 × 4 ranks: the search stops at FEASIBLE, not OPTIMAL.
    request = {"sequence_lengths": [5920, 312, 2105, 13288, 640, 980, 3300, 150, 7610, 420, 1888, 260],
               "dp_size": 2, "cp_size": 4, "bucket_size": 4096, "scheduler": "cpsat", "time_limit_s": 1.0}
    with httpx.Client(base_url=served.base_url, timeout=120) as client:
        first = PlanResponse.model_validate_json(client.post("/plan", json=request).content)
        second = PlanResponse.model_validate_json(client.post("/plan", json=request).content)
    assert first.dp_ranks == second.dp_ranks
    assert first.estimated_iteration_time_ms == second.estimated_iteration_time_ms


def test_no_answer_carries_a_path_or_a_long_echo(served: Served, profile_dir: Path) -> None:
    (profile_dir / "broken.json").write_text("{not json")
    long_name = "m" * 100_000
    with httpx.Client(base_url=served.base_url, timeout=60) as client:
        reload = client.post("/profiles/reload")
        unknown = client.post("/plan", json={**SMALL, "model": long_name})
        empty_profile = client.post("/plan", json={**SMALL, "profile": ""})
    (profile_dir / "broken.json").unlink()
    assert reload.status_code == 422
    assert str(profile_dir) not in reload.text and "broken.json" in reload.text
    assert "Traceback" not in reload.text
    assert unknown.status_code == 422 and len(unknown.content) < 4000 and long_name not in unknown.text
    assert empty_profile.status_code == 422
    assert Problem.model_validate_json(empty_profile.content).field == "profile"


def test_incomplete_requests_are_cut_off(served: Served) -> None:
    host, port = served.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as silent, \
            socket.create_connection((host, int(port)), timeout=30) as half_headers, \
            socket.create_connection((host, int(port)), timeout=30) as half_body:
        half_headers.sendall(b"POST /plan HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n")
        half_body.sendall(b"POST /plan HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"sequence")
        assert silent.recv(1024) == b""  # closed by the server
        assert half_headers.recv(1024) == b""
        answer = b""
        while chunk := half_body.recv(4096):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 408 ")
    assert b'"limit":0.5' in answer


def test_a_killed_supervisor_takes_every_process_with_it_and_its_port_is_free_at_once() -> None:
    """``kill -9`` of a 2-worker ``serve``: its workers, their pool processes and the resource tracker all end,
    so a restart on the same port starts and plans (without this they go on answering and hold the port)."""
    with serve({"SKRULL_WORKERS": "2", "SKRULL_CPSAT_WARMUP": "true"}) as server:  # every pool starts a process
        server.wait_ready()
        supervisor = server.process.pid
        # 2 workers, 2 pools each, the resource tracker
        _wait_until(lambda: len(descendants(supervisor)) >= 7, "the workers' pool processes started")
        started = descendants(supervisor)
        os.kill(supervisor, signal.SIGKILL)
        server.process.wait()
        try:
            _wait_until(lambda: not any(is_running(pid) for pid in started), "every process of the server ended",
                        timeout_s=10)
        finally:  # survivors would hold the port and the log pipe
            for pid in filter(is_running, started):
                os.kill(pid, signal.SIGKILL)
        port = int(server.base_url.rsplit(":", 1)[1])
    with serve({"SKRULL_WORKERS": "2"}, port=port) as restarted:
        restarted.wait_ready()
        answer = httpx.post(f"{restarted.base_url}/plan", json=SMALL, timeout=30)
        assert answer.status_code == 200, answer.text
