"""Several uvicorn workers behind one port (``SKRULL_WORKERS=2``, real processes): whichever worker answers, it
serves the profiles another worker's reload read, the job state another worker's report refit, and metrics summed
over both. Each request goes on a fresh connection, and the access log's ``pid`` says which worker answered it."""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from skrull_proto import FeedbackResponse, ModelsResponse

from tests.servers import Served, serve
from tests.service_inputs import LENGTHS, measured_document, report

pytestmark = pytest.mark.slow

NUM_WORKERS = 2
MAX_REQUESTS = 400  # fresh connections sent until every worker has answered (the kernel picks the worker)
PLAN_BODY = {"sequence_lengths": LENGTHS, "dp_size": 1, "cp_size": 2, "model": "tiny", "bucket_size": 2048}


@pytest.fixture(scope="module")
def profile_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("profiles")
    (folder / "first.json").write_text(json.dumps(measured_document(name="first")))
    return folder


@pytest.fixture(scope="module")
def served(profile_dir: Path) -> Iterator[Served]:
    env = {"SKRULL_WORKERS": str(NUM_WORKERS), "SKRULL_PROFILE_DIR": str(profile_dir),
           "SKRULL_STATE_URL": f"sqlite://{profile_dir.parent}/jobs.sqlite3"}
    with serve(env) as server:
        server.wait_ready()
        yield server


def _answering_workers(served: Served, request_ids: list[str]) -> set[int]:
    """The process ids that logged the access lines of ``request_ids`` (every one of them)."""
    deadline = time.monotonic() + 10
    while True:
        pids = {entry["request_id"]: entry["pid"] for entry in served.log_entries()
                if entry.get("logger") == "scheduler_service.access" and entry.get("request_id") in request_ids}
        if len(pids) == len(request_ids) or time.monotonic() > deadline:
            assert set(pids) == set(request_ids), "an access line is missing"
            return {int(pid) for pid in pids.values()}  # type: ignore[call-overload]
        time.sleep(0.05)


def on_every_worker(served: Served, method: str, path: str, check: Callable[[httpx.Response], None],
                    **kwargs: object) -> int:
    """Send ``method path`` on fresh connections, 8 at a time, until every worker has answered it; ``check`` every
    answer. The number of requests sent."""
    request_ids: list[str] = []

    def send(_: int) -> str:
        request_id = uuid.uuid4().hex
        response = httpx.request(method, served.base_url + path, headers={"x-request-id": request_id},
                                 timeout=30, **kwargs)  # type: ignore[arg-type]
        check(response)
        return request_id

    with ThreadPoolExecutor(8) as threads:
        while len(request_ids) < MAX_REQUESTS:
            request_ids += threads.map(send, range(8))
            if len(_answering_workers(served, request_ids)) == NUM_WORKERS:
                return len(request_ids)
    pytest.fail(f"{MAX_REQUESTS} requests on fresh connections never reached all {NUM_WORKERS} workers")


def test_a_profile_reload_on_one_worker_reaches_every_worker(served: Served, profile_dir: Path) -> None:
    def folder_profiles(response: httpx.Response) -> set[str]:
        assert response.status_code == 200, response.text
        models = ModelsResponse.model_validate_json(response.content)
        return {profile.name for profile in models.profiles if profile.origin == "directory"}

    def lists_only_first(response: httpx.Response) -> None:
        assert folder_profiles(response) == {"first"}

    def lists_both(response: httpx.Response) -> None:
        assert folder_profiles(response) == {"first", "second"}

    on_every_worker(served, "GET", "/models", lists_only_first)
    (profile_dir / "second.json").write_text(json.dumps(measured_document(name="second")))
    reloaded = httpx.post(served.base_url + "/profiles/reload", timeout=30)  # answered by one worker
    assert reloaded.json()["profiles"] == ["first", "second"]
    on_every_worker(served, "GET", "/models", lists_both)
    on_every_worker(served, "POST", "/plan", _assert_ok, json={**PLAN_BODY, "profile": "second"})


def test_a_report_to_one_worker_is_seen_by_every_worker(served: Served) -> None:
    assert httpx.post(served.base_url + "/plan", json={**PLAN_BODY, "job_id": "shared"}, timeout=30).status_code == 200
    refit = httpx.post(served.base_url + "/feedback", json=report("shared", scale=1000.0), timeout=30)
    assert refit.status_code == 200, refit.text
    state = FeedbackResponse.model_validate_json(refit.content)

    def same_state(response: httpx.Response) -> None:
        assert response.status_code == 200, response.text
        assert FeedbackResponse.model_validate_json(response.content) == state

    on_every_worker(served, "GET", "/feedback/shared", same_state)


def test_metrics_add_up_every_worker(served: Served) -> None:
    def planned(text: str) -> float:
        match = re.search(r'^skrull_plan_requests_total\{scheduler="skrull",status="200"\} (\S+)$', text, re.M)
        return 0.0 if match is None else float(match.group(1))

    before = planned(httpx.get(served.base_url + "/metrics", timeout=30).text)
    sent = on_every_worker(served, "POST", "/plan", _assert_ok, json=PLAN_BODY)
    assert planned(httpx.get(served.base_url + "/metrics", timeout=30).text) == before + sent


def _assert_ok(response: httpx.Response) -> None:
    assert response.status_code == 200, response.text
