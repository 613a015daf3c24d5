"""The plan client against the real service app, and rank 0's fallback to the embedded planner."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from skrull_proto.models import MAX_FEEDBACK_MICRO_BATCHES

from scheduler_service.core.plan import make_problem
from scheduler_service.core.planner import make_plan
from scheduler_service.core.profile import parse_profile
from scheduler_service.runtime.settings import Settings
from scheduler_service.web.app import create_app
from tests.service_inputs import measured_document
from tests.test_schemes_training import mixed_schemes_profile
from trainer_client.data import SyntheticSource
from trainer_client.distributed import free_port
from trainer_client.planning import source as plan_source
from trainer_client.planning.client import PlanClient, PlanRejected, PlanTimeout, PlanUnavailable
from trainer_client.planning.source import MicroBatchTiming, PlanOrigin, PlanSource

LENGTHS = (637, 208, 90, 138, 35, 1216, 326, 301, 270, 1742, 1014, 958, 344, 304, 347, 123)
DP, CP, BUCKET_SIZE = 2, 2, 1024
LOGGER = "trainer_client.planning.source"


@pytest.fixture(scope="module")
def service() -> Iterator[TestClient]:
    with TestClient(create_app(Settings(cpsat_warmup=False, access_log=False))) as client:
        yield client


def _source(client: PlanClient | None, scheduler: str = "skrull") -> PlanSource:
    return PlanSource(scheduler=scheduler, dp_size=DP, cp_size=CP, model="tiny", bucket_size=BUCKET_SIZE,
                      client=client)


def _dead_url() -> str:
    return f"http://127.0.0.1:{free_port()}"  # nothing listens there


@pytest.mark.parametrize("scheduler", ["skrull", "deepspeed"])
def test_service_plan_equals_embedded_plan(service: TestClient, scheduler: str) -> None:
    source = _source(PlanClient("http://testserver", client=service), scheduler)
    decision = source.decide(0, LENGTHS)
    expected = make_plan(make_problem(sequence_lengths=LENGTHS, dp_size=DP, cp_size=CP, model="tiny",
                                      bucket_size=BUCKET_SIZE), scheduler)
    assert decision.origin is PlanOrigin.SERVICE and decision.error is None
    assert decision.plan == expected.plan
    assert decision.estimated_time_ms == pytest.approx(expected.estimate.iteration_time_s * 1e3, rel=1e-6)
    assert source.num_fallbacks == 0


def test_prefetched_plan_is_used_for_its_batch(service: TestClient) -> None:
    source = _source(PlanClient("http://testserver", client=service))
    source.prefetch(1, LENGTHS[:8])
    decision = source.decide(1, LENGTHS[:8])
    assert decision.origin is PlanOrigin.SERVICE
    plan = decision.plan
    assert sorted([i for d in plan.dp_ranks for mb in d.micro_batches for i in mb.indices()]
                  + [i for spanning in plan.spanning for i in spanning.micro_batch.indices()]) == list(range(8))
    source.close()


def test_unreachable_service_falls_back_to_embedded_with_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    source = _source(PlanClient(_dead_url(), timeout_s=1.0, max_attempts=2, backoff_s=0.01))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert source.check_service() is False
        first, second = source.decide(0, LENGTHS), source.decide(1, LENGTHS)
    warnings = [r for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "unreachable" in warnings[0].getMessage()
    assert first.origin is second.origin is PlanOrigin.EMBEDDED
    assert source.num_fallbacks == 2
    expected = make_plan(make_problem(sequence_lengths=LENGTHS, dp_size=DP, cp_size=CP, model="tiny",
                                      bucket_size=BUCKET_SIZE), "skrull")
    assert first.plan == expected.plan
    source.close()


def test_connection_refused_raises_plan_unavailable_after_retries() -> None:
    client = PlanClient(_dead_url(), timeout_s=1.0, max_attempts=3, backoff_s=0.01)
    with pytest.raises(PlanUnavailable, match="after 3 attempts"):
        client.plan(_source(None)._request(LENGTHS))


def test_silent_service_raises_plan_timeout() -> None:
    with socket.socket() as listener:  # accepts connections (kernel backlog) and never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        client = PlanClient(f"http://127.0.0.1:{listener.getsockname()[1]}", timeout_s=0.2, max_attempts=2,
                            backoff_s=0.01)
        with pytest.raises(PlanTimeout, match="timed out"):
            client.plan(_source(None)._request(LENGTHS))
        client.close()


@pytest.mark.parametrize("status", [503, 408])  # 408: the service gave up waiting for a slow body
def test_service_errors_are_retried_then_succeed(service: TestClient, status: int) -> None:
    calls = []

    def flaky(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        if len(calls) == 1:
            return httpx.Response(status, json={"title": "Transient", "detail": "warming up"})
        real = service.post("/plan", content=request.content, headers={"content-type": "application/json"})
        return httpx.Response(real.status_code, content=real.content)

    http = httpx.Client(base_url="http://planner", transport=httpx.MockTransport(flaky))
    client = PlanClient("http://planner", client=http, max_attempts=3, backoff_s=0.01)
    decision = _source(client).decide(0, LENGTHS)
    assert decision.origin is PlanOrigin.SERVICE and calls == ["/plan", "/plan"]


def _busy_then(service: TestClient, retry_after: str, calls: list[str]) -> httpx.Client:
    """A service whose first answer is a 429 with ``retry_after``; the real service's answers after that."""
    def busy_once(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        if len(calls) == 1:
            return httpx.Response(429, json={"title": "Too Many Requests", "detail": "the pool is full"},
                                  headers={"Retry-After": retry_after})
        real = service.post("/plan", content=request.content, headers={"content-type": "application/json"})
        return httpx.Response(real.status_code, content=real.content)

    return httpx.Client(base_url="http://planner", transport=httpx.MockTransport(busy_once))


def test_a_retry_waits_the_answers_retry_after_with_jitter(service: TestClient) -> None:
    calls: list[str] = []
    waits_s: list[float] = []
    client = PlanClient("http://planner", client=_busy_then(service, "1", calls), max_attempts=3, backoff_s=0.01,
                        deadline_s=10.0, sleep=waits_s.append)
    assert client.plan(_source(None)._request(LENGTHS)).scheduler == "skrull"
    assert len(calls) == 2 and len(waits_s) == 1
    assert 1.0 <= waits_s[0] <= 1.25  # Retry-After, up to a quarter more at random


def test_a_retry_after_beyond_the_deadline_gives_up_at_once(service: TestClient) -> None:
    calls: list[str] = []
    waits_s: list[float] = []
    client = PlanClient("http://planner", client=_busy_then(service, "60", calls), max_attempts=3, backoff_s=0.01,
                        deadline_s=5.0, sleep=waits_s.append)
    with pytest.raises(PlanUnavailable, match=r"429.*the pool is full.*after 1 attempts"):
        client.plan(_source(None)._request(LENGTHS))
    assert len(calls) == 1 and waits_s == []  # the step plans embedded now, not in 5 s


def test_rejected_request_is_not_retried(service: TestClient) -> None:
    calls = []

    def counting(request: httpx.Request) -> httpx.Response:
        calls.append(1)
        real = service.post("/plan", content=request.content, headers={"content-type": "application/json"})
        return httpx.Response(real.status_code, content=real.content, headers=real.headers)

    http = httpx.Client(base_url="http://planner", transport=httpx.MockTransport(counting))
    client = PlanClient("http://planner", client=http, max_attempts=3, backoff_s=0.01)
    too_long = _source(None)._request([BUCKET_SIZE * CP * DP + 1, 10])
    with pytest.raises(PlanRejected, match=r"422.*sequence 0 has 4097 tokens"):
        client.plan(too_long)
    assert len(calls) == 1


def test_batch_no_planner_can_plan_becomes_an_error_decision(service: TestClient) -> None:
    source = _source(PlanClient("http://testserver", client=service))
    decision = source.decide(3, [BUCKET_SIZE * CP * DP + 1, 10])
    assert decision.plan is None and decision.origin is PlanOrigin.EMBEDDED
    assert decision.error is not None and "global batch 3" in decision.error and "sequence 0 has 4097" in decision.error


def _tampered_source(service: TestClient, tamper: Callable[[dict[str, Any]], object]) -> PlanSource:
    """A plan source whose service answers the real plan with ``tamper`` applied to its body: a buggy service."""
    def tampering(request: httpx.Request) -> httpx.Response:
        body = service.post("/plan", content=request.content, headers={"content-type": "application/json"}).json()
        tamper(body)
        return httpx.Response(200, content=json.dumps(body).encode())

    http = httpx.Client(base_url="http://planner", transport=httpx.MockTransport(tampering))
    return _source(PlanClient("http://planner", client=http))


def test_plan_failing_the_checker_falls_back(service: TestClient, caplog: pytest.LogCaptureFixture) -> None:
    # some sequences are never scheduled
    source = _tampered_source(service, lambda body: body["dp_ranks"][0]["micro_batches"].pop())
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        decision = source.decide(0, LENGTHS)
    assert decision.origin is PlanOrigin.EMBEDDED and source.num_fallbacks == 1
    assert "fails the checker" in caplog.text and "not scheduled" in caplog.text


def test_response_that_is_not_a_plan_is_rejected() -> None:
    http = httpx.Client(base_url="http://planner",
                        transport=httpx.MockTransport(lambda request: httpx.Response(200, json={"hello": 1})))
    with pytest.raises(PlanRejected, match="not a PlanResponse"):
        PlanClient("http://planner", client=http).plan(_source(None)._request(LENGTHS))


def test_ready_reports_the_service_state(service: TestClient) -> None:
    assert PlanClient("http://testserver", client=service).ready()
    assert not PlanClient(_dead_url(), timeout_s=0.5).ready()


def _feedback_source(handler: Callable[[httpx.Request], httpx.Response], job_id: str = "job-1") -> PlanSource:
    http = httpx.Client(base_url="http://planner", transport=httpx.MockTransport(handler))
    return PlanSource(scheduler="skrull", dp_size=DP, cp_size=CP, model="tiny", bucket_size=BUCKET_SIZE,
                      client=PlanClient("http://planner", client=http), job_id=job_id)


def _unexpected(request: httpx.Request) -> httpx.Response:
    raise AssertionError(f"nothing should be sent, got {request.method} {request.url.path}")


def test_report_the_contract_refuses_is_counted_and_warned_once_not_raised(
    caplog: pytest.LogCaptureFixture,
) -> None:
    source = _feedback_source(_unexpected)
    plan = source._plan_embedded(0, LENGTHS).plan
    assert plan is not None
    hour_long = [MicroBatchTiming(dp_rank=0, index=0, time_s=3601.0)]  # > MAX_MICRO_BATCH_TIME_MS
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert source.report(1, plan, LENGTHS, hour_long) is None
        # > MAX_FEEDBACK_MICRO_BATCHES micro-batches in one step (measurements repeated to get there cheaply)
        with pytest.MonkeyPatch.context() as patch:
            real = plan_source.measurements_of
            patch.setattr(plan_source, "measurements_of",
                          lambda *args: real(*args) * (MAX_FEEDBACK_MICRO_BATCHES + 1))
            assert source.report(2, plan, LENGTHS, [MicroBatchTiming(dp_rank=0, index=0, time_s=0.1)]) is None
    assert source.num_feedback_failures == 2
    warnings = [r for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "breaks the contract" in warnings[0].getMessage()
    source.close()


def test_feedback_send_error_of_any_kind_is_counted() -> None:
    def broken(request: httpx.Request) -> httpx.Response:
        raise RuntimeError("not an httpx error")

    source = _feedback_source(broken)
    plan = source._plan_embedded(0, LENGTHS).plan
    assert plan is not None
    future = source.report(1, plan, LENGTHS, [MicroBatchTiming(dp_rank=0, index=0, time_s=0.1)])
    assert future is not None
    future.result(timeout=10)  # does not raise
    assert source.num_feedback_failures == 1
    source.close()
    # a report after close (the executor is shut down) is counted too, not raised
    assert source.report(2, plan, LENGTHS, [MicroBatchTiming(dp_rank=0, index=0, time_s=0.1)]) is None
    assert source.num_feedback_failures == 2


def test_close_waits_for_the_report_in_flight() -> None:
    answered: list[str] = []

    def slow(request: httpx.Request) -> httpx.Response:
        time.sleep(0.3)
        answered.append(request.url.path)
        return httpx.Response(503, json={"title": "Service Unavailable", "detail": "busy"})

    source = _feedback_source(slow)
    plan = source._plan_embedded(0, LENGTHS).plan
    assert plan is not None
    assert source.report(1, plan, LENGTHS, [MicroBatchTiming(dp_rank=0, index=0, time_s=0.1)]) is not None
    source.close()  # before the fix: returned at once and closed the client under the POST
    assert answered == ["/feedback"] and source.num_feedback_failures == 1


def test_job_id_the_contract_refuses_falls_back_to_embedded(service: TestClient) -> None:
    source = PlanSource(scheduler="skrull", dp_size=DP, cp_size=CP, model="tiny", bucket_size=BUCKET_SIZE,
                        client=PlanClient("http://testserver", client=service), job_id="has a space")
    source.prefetch(1, LENGTHS)
    decision = source.decide(1, LENGTHS)
    assert decision.origin is PlanOrigin.EMBEDDED and decision.error is None and decision.plan is not None
    assert source.num_fallbacks == 1
    source.close()


def test_any_service_path_failure_falls_back_to_embedded() -> None:
    def broken(request: httpx.Request) -> httpx.Response:
        raise RuntimeError("not an httpx error")

    source = _feedback_source(broken)
    decision = source.decide(0, LENGTHS)
    assert decision.origin is PlanOrigin.EMBEDDED and decision.plan is not None and source.num_fallbacks == 1
    source.close()


# A profile the trainer measured, which the service cannot know by its name: three times the compute cost of the
# test's other measured profile.
MEASURED = parse_profile(measured_document(name="trainer-tiny", scale=3.0))


def _measured_source(client: PlanClient, job_id: str | None = None) -> PlanSource:
    return PlanSource(scheduler="skrull", dp_size=DP, cp_size=CP, model="tiny", bucket_size=BUCKET_SIZE,
                      profile=MEASURED, client=client, job_id=job_id)


def _recorded(service: TestClient, calls: list[tuple[str, str]],
              answer: Callable[[httpx.Request], httpx.Response | None] = lambda request: None) -> PlanClient:
    """A client of the real service that records each request as (method, path); ``answer`` may answer one in the
    service's place."""
    def forward(request: httpx.Request) -> httpx.Response:
        calls.append((request.method, request.url.path))
        if (answered := answer(request)) is not None:
            return answered
        real = service.request(request.method, request.url.path, content=request.content,
                               headers={"content-type": "application/json"})
        return httpx.Response(real.status_code, content=real.content)

    http = httpx.Client(base_url="http://planner", transport=httpx.MockTransport(forward))
    return PlanClient("http://planner", client=http, max_attempts=1)


@pytest.mark.parametrize("job_id", [None, "trainer-job"])
def test_a_profile_object_is_registered_once_and_the_service_plans_with_it(
    service: TestClient, job_id: str | None
) -> None:
    calls: list[tuple[str, str]] = []
    source = _measured_source(_recorded(service, calls), job_id)
    decisions = [source.decide(step, LENGTHS) for step in range(3)]
    assert [decision.origin for decision in decisions] == [PlanOrigin.SERVICE] * 3 and source.num_fallbacks == 0
    # without a job id of the trainer's (feedback off), one made up for the run's plans
    method, path = calls[0]
    assert method == "PUT" and (path == f"/jobs/{job_id}/profile" if job_id else path.startswith("/jobs/run-"))
    assert calls[1:] == [("POST", "/plan")] * 3
    embedded = source._plan_embedded(0, LENGTHS)
    default = make_plan(make_problem(sequence_lengths=LENGTHS, dp_size=DP, cp_size=CP, model="tiny",
                                     bucket_size=BUCKET_SIZE), "skrull")
    assert decisions[0].plan == embedded.plan
    assert decisions[0].estimated_time_ms == pytest.approx(embedded.estimated_time_ms)
    assert decisions[0].estimated_time_ms != pytest.approx(default.estimate.iteration_time_s * 1e3)
    if job_id is None:  # the made-up job is never reported
        timings = [MicroBatchTiming(dp_rank=0, index=0, time_s=0.1)]
        assert source.report(3, decisions[0].plan, LENGTHS, timings) is None
    source.close()


def test_a_registration_the_service_refuses_is_warned_once_and_the_run_plans_embedded(
    service: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    calls: list[tuple[str, str]] = []
    shadowing = parse_profile(measured_document(name="h100-paper", model=None))  # a shared name, other numbers
    source = PlanSource(scheduler="skrull", dp_size=DP, cp_size=CP, model="tiny", bucket_size=BUCKET_SIZE,
                        profile=shadowing, client=_recorded(service, calls))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        decisions = [source.decide(step, LENGTHS) for step in range(3)]
    assert [decision.origin for decision in decisions] == [PlanOrigin.EMBEDDED] * 3 and source.num_fallbacks == 3
    assert decisions[0].plan == source._plan_embedded(0, LENGTHS).plan  # planned with the trainer's profile
    assert [method for method, _ in calls] == ["PUT"]  # refused once: never asked again, no plan asked for
    (warning,) = [record.getMessage() for record in caplog.records
                  if record.name == LOGGER and record.levelno == logging.WARNING]
    assert "cannot plan with profile h100-paper" in warning and "422" in warning and "profile.name" in warning
    source.close()


def test_a_registration_the_service_could_not_answer_is_sent_again_at_the_next_batch(service: TestClient) -> None:
    calls: list[tuple[str, str]] = []

    def unavailable_once(request: httpx.Request) -> httpx.Response | None:
        if calls != [("PUT", request.url.path)]:
            return None
        return httpx.Response(503, json={"title": "Service Unavailable", "detail": "the job store is unavailable"})

    source = _measured_source(_recorded(service, calls, unavailable_once), "flaky-job")
    assert source.decide(0, LENGTHS).origin is PlanOrigin.EMBEDDED
    assert source.decide(1, LENGTHS).origin is PlanOrigin.SERVICE
    assert calls == [("PUT", "/jobs/flaky-job/profile"), ("PUT", "/jobs/flaky-job/profile"), ("POST", "/plan")]
    source.close()


def test_a_job_the_service_forgot_is_registered_again_before_the_next_plan() -> None:
    calls: list[tuple[str, str]] = []
    with TestClient(create_app(Settings(cpsat_warmup=False, access_log=False, feedback_max_jobs=1))) as service:
        source = _measured_source(_recorded(service, calls), "forgotten-job")
        assert source.decide(0, LENGTHS).origin is PlanOrigin.SERVICE
        other = {"sequence_lengths": list(LENGTHS), "dp_size": DP, "cp_size": CP, "model": "tiny", "job_id": "other"}
        assert service.post("/plan", json=other).status_code == 200  # the one job the service keeps now
        assert source.decide(1, LENGTHS).origin is PlanOrigin.EMBEDDED  # 422: the profile is unknown without the job
        assert source.decide(2, LENGTHS).origin is PlanOrigin.SERVICE
        source.close()
    put, plan = ("PUT", "/jobs/forgotten-job/profile"), ("POST", "/plan")
    assert calls == [put, plan, plan, put, plan]


class _TricklingServer:
    """A real HTTP server that answers every request with a valid head and then one byte of body every 50 ms,
    for a body long enough to take minutes: each read returns in time, the whole answer never does."""

    def __init__(self) -> None:
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen()
        self.bytes_sent = 0
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.listener.getsockname()[1]}"

    def _serve(self) -> None:
        self.listener.settimeout(0.1)
        while not self.stopped.is_set():
            try:
                connection, _ = self.listener.accept()
            except TimeoutError:
                continue
            with connection:
                connection.recv(65536)
                connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 4000\r\n\r\n")
                try:
                    while not self.stopped.wait(0.05):
                        connection.sendall(b" ")
                        self.bytes_sent += 1
                except OSError:  # the client shut the connection down: the next request may come
                    continue

    def close(self) -> None:
        self.stopped.set()
        self.thread.join(timeout=10)
        self.listener.close()


def test_a_trickling_answer_is_cut_at_the_fetch_deadline_and_the_step_plans_embedded() -> None:
    server = _TricklingServer()
    try:
        client = PlanClient(server.url, timeout_s=1.0, max_attempts=3, backoff_s=0.01, deadline_s=0.5)
        source = _source(client)
        decision = source.decide(0, LENGTHS)
        source.close()
    finally:
        server.close()
    assert decision.origin is PlanOrigin.EMBEDDED and decision.plan is not None
    assert source.num_fallbacks == 1
    assert 0 < server.bytes_sent < 4000  # the answer had started and was cut, not finished


def test_a_source_without_spanning_plans_within_cp_groups_embedded_and_from_the_service(service: TestClient) -> None:
    too_long_for_a_group = [BUCKET_SIZE * CP + 1, 10]
    for spanning in (True, False):
        embedded = PlanSource(scheduler="skrull", dp_size=DP, cp_size=CP, model="tiny", bucket_size=BUCKET_SIZE,
                              spanning=spanning)
        remote = PlanSource(scheduler="skrull", dp_size=DP, cp_size=CP, model="tiny", bucket_size=BUCKET_SIZE,
                            client=PlanClient("http://testserver", client=service), spanning=spanning)
        request = remote._request(too_long_for_a_group)
        assert (request.schema_version, request.spanning) == (3, spanning)
        for source in (embedded, remote):
            decision = source.decide(0, too_long_for_a_group)
            if spanning:
                assert decision.plan is not None and decision.plan.spanning
            else:
                assert decision.plan is None and "at most bucket_size 1024 × cp_size 2 = 2048 fit" in decision.error
        remote.close()


def test_a_source_with_schemes_off_plans_all_gather_kv_embedded_and_asks_the_service_for_version_2(
        service: TestClient, tmp_path: Path) -> None:
    """Under a profile whose tables make the planner choose Ulysses and 2D for some collectives, a source with
    schemes off plans every collective all-gather-KV, and asks the service with the contract that has no other
    scheme."""
    profile = parse_profile(json.loads(mixed_schemes_profile(tmp_path / "profile.json").read_text()))
    lengths = list(SyntheticSource(dataset="lmsys", global_batch_size=8, vocab_size=1024, max_length=2048,
                                   seed=0).batch(0).sequence_lengths)
    for schemes in (True, False):
        embedded = PlanSource(scheduler="skrull", dp_size=1, cp_size=4, model="tiny", bucket_size=512,
                              profile=profile, schemes=schemes)
        decision = embedded.decide(0, lengths)
        assert decision.plan is not None
        degrees = {c.ulysses_degree for dp_plan in decision.plan.dp_ranks for mb in dp_plan.micro_batches
                   for c in mb.collectives()}
        assert (degrees != {1}) is schemes, degrees
        remote = PlanSource(scheduler="skrull", dp_size=DP, cp_size=CP, model="tiny", bucket_size=BUCKET_SIZE,
                            client=PlanClient("http://testserver", client=service), schemes=schemes)
        assert remote._request(LENGTHS).schema_version == (3 if schemes else 2)
        remote.close()


def test_a_step_whose_plan_spans_replicas_is_not_reported_and_is_no_failure() -> None:
    source = _feedback_source(_unexpected)
    plan = source._plan_embedded(0, [BUCKET_SIZE * CP + 1, 10]).plan
    assert plan is not None and plan.spanning
    assert source.report(1, plan, [BUCKET_SIZE * CP + 1, 10], [MicroBatchTiming(dp_rank=0, index=0, time_s=0.1)]) \
        is None
    assert source.num_feedback_failures == 0
    source.close()


def _misaligned(spanning: dict[str, Any]) -> None:
    spanning["dp_ranks"] = [1, 2]


def _one_replicas_lists(spanning: dict[str, Any]) -> None:
    spanning["local"] = spanning["local"][:CP]


def _sharded_kept_whole(spanning: dict[str, Any]) -> None:
    """The long sequence whole on world rank 1: far over its bucket."""
    spanning["local"][1] += spanning["distributed"]
    spanning["distributed"] = []


@pytest.mark.parametrize(("tamper", "sentence"), [
    (_misaligned, "spanning[0] DP replicas 1..2 are not an aligned block of dp_size 2"),
    (_one_replicas_lists, "its block has 4 ranks"),
    (_sharded_kept_whole, "world rank 1 (block rank 1) holds"),
])
def test_a_broken_spanning_micro_batch_from_the_service_falls_back_before_any_collective(
    service: TestClient, caplog: pytest.LogCaptureFixture, tamper: Callable[[dict[str, Any]], None],
    sentence: str,
) -> None:
    lengths = [BUCKET_SIZE * CP * 3 // 2, 300, 200]  # 1.5 x one CP group: a spanning micro-batch over both replicas

    source = _tampered_source(service, lambda body: tamper(body["spanning"][0]))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        decision = source.decide(0, lengths)
    assert decision.origin is PlanOrigin.EMBEDDED and source.num_fallbacks == 1
    assert decision.plan == _source(None).decide(0, lengths).plan  # the embedded planner's, checked
    assert "fails the checker" in caplog.text and sentence in caplog.text


def test_the_service_and_the_embedded_planner_give_the_same_spanning_plan(service: TestClient) -> None:
    lengths = [BUCKET_SIZE * CP * 3 // 2, *LENGTHS]
    remote = _source(PlanClient("http://testserver", client=service)).decide(0, lengths)
    embedded = _source(None).decide(0, lengths)
    assert remote.origin is PlanOrigin.SERVICE and remote.plan is not None and remote.plan.spanning
    assert remote.plan == embedded.plan
