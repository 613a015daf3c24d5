"""The FastAPI app in-process (TestClient, lifespan run by the ``with`` block): every endpoint, every bad input."""

from __future__ import annotations

import json
import logging
import os
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from skrull_proto import PlanRequest, PlanResponse, Problem, SchedulerName

from scheduler_service import cli
from scheduler_service.contract.wire import response_to_plan
from scheduler_service.core.check import check_plan
from scheduler_service.core.errors import InfeasiblePlanError, PlanCheckError
from scheduler_service.core.models import MODEL_CATALOGUE
from scheduler_service.core.profile import DEFAULT_PROFILE
from scheduler_service.runtime.settings import Settings
from scheduler_service.web.app import create_app
from tests.answers import assert_problem

HEURISTICS = [s for s in SchedulerName if s is not SchedulerName.CPSAT]

# A Figure-3-like mix: many short sequences and a few long ones (tokens).
MIXED_LENGTHS = [812, 30311, 97, 4096, 1500, 256, 65000, 733, 12000, 410, 2048, 128, 9000, 350, 20000, 640]


def plan_body(**overrides: object) -> dict[str, object]:
    return {"sequence_lengths": MIXED_LENGTHS, "dp_size": 2, "cp_size": 4, **overrides}


def scheduler_body(scheduler: SchedulerName) -> dict[str, object]:
    """``plan_body`` for ``scheduler``; the static SP ones on a model whose 4 query and 2 K/V heads split over
    Ulysses degrees 2 and 4 (qwen2.5-0.5b's 14 heads do not split over cp_size 4: they refuse it by name)."""
    static_sp = scheduler in (SchedulerName.ULYSSES, SchedulerName.USP)
    return plan_body(scheduler=scheduler.value, **({"model": "tiny"} if static_sp else {}))


def service_settings(**overrides: object) -> Settings:
    return Settings(cpsat_warmup=False, cpsat_max_time_limit_s=2.0, cpsat_default_time_limit_s=0.5,
                    **overrides)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    with TestClient(create_app(service_settings(max_sequences=1000, max_body_bytes=64 << 10))) as test_client:
        yield test_client


# ---- POST /plan: good requests -------------------------------------------------------------------------------

@pytest.mark.parametrize("scheduler", HEURISTICS)
def test_plan_passes_checker_for_every_heuristic_scheduler(client: TestClient, scheduler: SchedulerName) -> None:
    response = client.post("/plan", json=scheduler_body(scheduler))
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/json"
    plan = PlanResponse.model_validate_json(response.content)
    assert plan.scheduler is scheduler
    assert len(plan.dp_ranks) == 2
    check_plan(response_to_plan(plan), sequence_lengths=MIXED_LENGTHS, dp_size=2, cp_size=4,
               bucket_size=plan.bucket_size)
    assert plan.solver is None


@pytest.mark.parametrize("scheduler", HEURISTICS)
def test_every_plan_reports_a_lower_bound_it_does_not_beat(client: TestClient, scheduler: SchedulerName) -> None:
    plan = PlanResponse.model_validate_json(client.post("/plan", json=scheduler_body(scheduler)).content)
    assert 0 < plan.lower_bound_ms <= plan.estimated_iteration_time_ms


def test_a_larger_search_budget_never_plans_worse_and_the_cap_is_named(client: TestClient) -> None:
    times_ms = [PlanResponse.model_validate_json(client.post("/plan", json=plan_body(search_budget=budget)).content)
                .estimated_iteration_time_ms for budget in (0, 16, 512)]
    assert times_ms[0] >= times_ms[1] >= times_ms[2]
    problem = assert_problem(client.post("/plan", json=plan_body(search_budget=1 << 17)), 422, "search_budget")
    assert str(1 << 16) in problem.detail
    assert_problem(client.post("/plan", json=plan_body(search_budget=-1)), 422, "search_budget")


def test_the_service_default_search_budget_applies_to_requests_without_one() -> None:
    with TestClient(create_app(service_settings(search_budget=0))) as zero, TestClient(create_app(
            service_settings())) as default:
        budgetless = [PlanResponse.model_validate_json(app.post("/plan", json=plan_body()).content)
                      for app in (zero, default)]
        explicit = PlanResponse.model_validate_json(zero.post("/plan", json=plan_body(search_budget=0)).content)
    assert budgetless[0].dp_ranks == explicit.dp_ranks
    assert budgetless[1].estimated_iteration_time_ms <= budgetless[0].estimated_iteration_time_ms


def test_plan_carries_deepspeed_baseline_and_speedup(client: TestClient) -> None:
    plan = PlanResponse.model_validate_json(client.post("/plan", json=plan_body()).content)
    assert plan.deepspeed_estimated_iteration_time_ms > 0
    assert plan.speedup_vs_deepspeed == pytest.approx(
        plan.deepspeed_estimated_iteration_time_ms / plan.estimated_iteration_time_ms, rel=1e-4)
    assert plan.estimated_iteration_time_ms == pytest.approx(max(r.estimated_time_ms for r in plan.dp_ranks))
    deepspeed = PlanResponse.model_validate_json(
        client.post("/plan", json=plan_body(scheduler="deepspeed")).content)
    assert deepspeed.speedup_vs_deepspeed == pytest.approx(1.0)


@pytest.mark.parametrize("scheduler", HEURISTICS)
def test_same_request_gives_same_plan(client: TestClient, scheduler: SchedulerName) -> None:
    first, second = (client.post("/plan", json=scheduler_body(scheduler)).json() for _ in range(2))
    for varying in ("solve_time_ms",):
        first.pop(varying), second.pop(varying)
    assert first == second


def test_service_answers_like_the_cli_twin(client: TestClient, tmp_path: object, capsys: pytest.CaptureFixture[str]
                                           ) -> None:
    request = plan_body(scheduler="skrull_paper", model="qwen2.5-1.5b", bucket_size=20000)
    path = tmp_path / "request.json"  # type: ignore[operator]
    path.write_text(json.dumps(request))
    assert cli.main(["plan", str(path)]) == 0
    from_cli = json.loads(capsys.readouterr().out)
    from_service = client.post("/plan", json=request).json()
    for response in (from_cli, from_service):
        response.pop("solve_time_ms")
    assert from_service == from_cli


def test_inline_model_spec_and_explicit_bucket_size_are_honoured(client: TestClient) -> None:
    shape = MODEL_CATALOGUE["small"]
    spec = {name: getattr(shape, name) for name in ("hidden_size", "num_layers", "num_attention_heads",
                                                    "num_key_value_heads", "head_dim", "intermediate_size",
                                                    "vocab_size", "tie_word_embeddings", "attention_bias")}
    response = client.post("/plan", json=plan_body(model={"name": "my-small", **spec}, bucket_size=70000))
    assert response.status_code == 200, response.text
    plan = PlanResponse.model_validate_json(response.content)
    assert (plan.model, plan.bucket_size, plan.profile) == ("my-small", 70000, DEFAULT_PROFILE)


def test_a_request_planned_in_the_heavy_pool_gets_the_plan_planned_inline() -> None:
    with TestClient(create_app(service_settings(access_log=False))) as client:
        inline = client.post("/plan", json=plan_body())
    with TestClient(create_app(service_settings(access_log=False, inline_max_cells=0))) as client:
        pooled = client.post("/plan", json=plan_body())
        in_pool = client.get("/metrics").text
    assert inline.status_code == pooled.status_code == 200, pooled.text
    assert inline.json()["dp_ranks"] == pooled.json()["dp_ranks"]
    assert "skrull_heavy_in_flight 0.0" in in_pool  # it went through the pool, and left it


def test_a_plan_over_the_cost_limit_is_refused_before_planning_naming_limit_and_estimate() -> None:
    """Its shape alone (64 × 1024 baseline cells) is under the limit; with its own 64 micro-batches it is not."""
    with TestClient(create_app(service_settings(access_log=False, max_plan_cells=100_000))) as client:
        response = client.post("/plan", json=plan_body(sequence_lengths=[1000] * 64, dp_size=1, cp_size=1024,
                                                        bucket_size=1))
        # Half the batch (65 600 cells) is under the limit and planned.
        assert client.post("/plan", json=plan_body(sequence_lengths=[1000] * 32, dp_size=1, cp_size=1024,
                                                    bucket_size=1)).status_code == 200
    problem = Problem.model_validate_json(response.content)
    assert (response.status_code, problem.field, problem.limit) == (422, "sequence_lengths", 100_000)
    assert "64 micro-batches × cp_size 1024" in problem.detail and "131136 cells" in problem.detail


def test_an_answer_over_the_size_limit_is_refused_before_planning() -> None:
    with TestClient(create_app(service_settings(access_log=False, max_answer_bytes=100_000))) as client:
        plain = client.post("/plan", json=plan_body(sequence_lengths=[1000] * 64, dp_size=1, cp_size=64,
                                                     bucket_size=16))
        detailed = client.post("/plan", json=plan_body(sequence_lengths=[1000] * 64, dp_size=1, cp_size=64,
                                                        bucket_size=16, breakdown=True))
    assert plain.status_code == 200, plain.text
    problem = Problem.model_validate_json(detailed.content)
    assert (detailed.status_code, problem.limit) == (422, 100_000)
    assert "MB answer" in problem.detail


# ---- POST /plan: bad input is a 4xx problem naming the field and the limit ------------------------------------

@pytest.mark.parametrize(
    ("body", "status", "field"),
    [
        pytest.param(b'{"sequence_lengths": [1, 2', 400, "body", id="malformed-json"),
        pytest.param(b'{"sequence_lengths": [1], "dp_size": NaN, "cp_size": 1}', 400, "body", id="nan-literal"),
        pytest.param(b"", 400, "body", id="empty-body"),
        pytest.param(b"[1, 2, 3]", 422, "body", id="not-an-object"),
        pytest.param(json.dumps(plan_body(dp_size="4")).encode(), 422, "dp_size", id="string-for-int"),
        pytest.param(json.dumps(plan_body(dp_size=2.0)).encode(), 422, "dp_size", id="float-for-int"),
        pytest.param(json.dumps(plan_body(cp_size=True)).encode(), 422, "cp_size", id="bool-for-int"),
        pytest.param(json.dumps(plan_body(sequence_lengths=[5, "x", 7])).encode(), 422, "sequence_lengths[1]",
                     id="string-length"),
        pytest.param(json.dumps(plan_body(sequence_lengths=[5, 7.5])).encode(), 422, "sequence_lengths[1]",
                     id="fractional-length"),
        pytest.param(json.dumps(plan_body(sequence_lengths="1,2")).encode(), 422, "sequence_lengths",
                     id="lengths-not-a-list"),
        pytest.param(json.dumps({"dp_size": 1, "cp_size": 1}).encode(), 422, "sequence_lengths", id="missing-field"),
        pytest.param(json.dumps(plan_body(sequence_lengths=[])).encode(), 422, "sequence_lengths", id="empty-batch"),
        pytest.param(json.dumps(plan_body(sequence_lengths=[100, 0, 5])).encode(), 422, "sequence_lengths[1]",
                     id="zero-length"),
        pytest.param(json.dumps(plan_body(sequence_lengths=[100, 5, -3])).encode(), 422, "sequence_lengths[2]",
                     id="negative-length"),
        pytest.param(json.dumps(plan_body(sequence_lengths=[100, 10**40])).encode(), 422, "sequence_lengths[1]",
                     id="absurd-length"),
        pytest.param(json.dumps(plan_body(model="gpt-17")).encode(), 422, "model", id="unknown-model"),
        pytest.param(json.dumps(plan_body(model={"name": "x", "hidden_size": 64})).encode(), 422,
                     "model.num_layers", id="incomplete-model-spec"),
        pytest.param(json.dumps(plan_body(scheduler="magic")).encode(), 422, "scheduler", id="unknown-scheduler"),
        pytest.param(json.dumps(plan_body(profile="tpu-v9")).encode(), 422, "profile", id="unknown-profile"),
        pytest.param(json.dumps(plan_body(dp_size=0)).encode(), 422, "dp_size", id="dp-zero"),
        pytest.param(json.dumps(plan_body(cp_size=-1)).encode(), 422, "cp_size", id="cp-negative"),
        pytest.param(json.dumps(plan_body(dp_size=10**6)).encode(), 422, "dp_size", id="dp-too-large"),
        pytest.param(json.dumps(plan_body(cp_size=5000)).encode(), 422, "cp_size", id="cp-too-large"),
        pytest.param(json.dumps(plan_body(bucket_size=0)).encode(), 422, "bucket_size", id="bucket-zero"),
        pytest.param(json.dumps(plan_body(time_limit_s=-1.0)).encode(), 422, "time_limit_s", id="negative-time"),
        pytest.param(json.dumps(plan_body(schema_version=4)).encode(), 422, "schema_version", id="future-version"),
        pytest.param(json.dumps(plan_body(priority="high")).encode(), 422, "priority", id="unknown-field"),
    ],
)
def test_rejects_bad_input_with_problem_naming_the_field(
    client: TestClient, body: bytes, status: int, field: str
) -> None:
    response = client.post("/plan", content=body, headers={"content-type": "application/json"})
    problem = assert_problem(response, status, field)
    assert problem.detail
    if status == 422:
        assert any(error.field == field for error in problem.errors)


def _small_spec(**overrides: object) -> dict[str, object]:
    shape = MODEL_CATALOGUE["small"]
    spec = {name: getattr(shape, name) for name in ("hidden_size", "num_layers", "num_attention_heads",
                                                    "num_key_value_heads", "head_dim", "intermediate_size",
                                                    "vocab_size")}
    return {"name": "absurd", **spec, **overrides}


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        pytest.param({"hidden_size": 10**200}, "model.hidden_size", id="hidden-10e200"),
        pytest.param({"hidden_size": 2**18 + 1}, "model.hidden_size", id="hidden-over-bound"),
        pytest.param({"intermediate_size": 2**20 + 1}, "model.intermediate_size", id="intermediate"),
        pytest.param({"num_layers": 2**12 + 1}, "model.num_layers", id="layers"),
        pytest.param({"num_attention_heads": 2**12 + 1}, "model.num_attention_heads", id="heads"),
        pytest.param({"num_key_value_heads": 2**12 + 1}, "model.num_key_value_heads", id="kv-heads"),
        pytest.param({"head_dim": 2**12 + 1}, "model.head_dim", id="head-dim"),
        pytest.param({"vocab_size": 2**23 + 1}, "model.vocab_size", id="vocab"),
    ],
)
def test_absurd_inline_model_is_a_422_not_an_overflow(
    client: TestClient, overrides: dict[str, object], field: str
) -> None:
    response = client.post("/plan", json=plan_body(model=_small_spec(**overrides), bucket_size=70000))
    assert any(error.field == field for error in assert_problem(response, 422).errors), response.text


def test_rejects_sequence_longer_than_the_world_holds(client: TestClient) -> None:
    response = client.post("/plan", json=plan_body(sequence_lengths=[100, 200, 170000], bucket_size=20000))
    problem = assert_problem(response, 422, "sequence_lengths[2]")
    assert problem.limit == 20000 * 4 * 2
    assert "170000" in problem.detail and "160000" in problem.detail and "world" in problem.detail


def test_a_client_of_schema_version_1_is_held_to_one_cp_group(client: TestClient) -> None:
    response = client.post("/plan", json=plan_body(sequence_lengths=[100, 200, 90000], bucket_size=20000,
                                                   schema_version=1))
    problem = assert_problem(response, 422, "sequence_lengths[2]")
    assert problem.limit == 20000 * 4
    assert "90000" in problem.detail and "80000" in problem.detail


def test_a_sequence_longer_than_one_cp_group_plans_in_a_spanning_micro_batch(client: TestClient) -> None:
    lengths = [100, 200, 120000, 3000, 700]  # 120000 = 1.5 x one CP group's 4 x 20000
    response = client.post("/plan", json=plan_body(sequence_lengths=lengths, bucket_size=20000))
    assert response.status_code == 200, response.text
    body = PlanResponse.model_validate_json(response.content)
    assert body.schema_version == 2
    assert [spanning.dp_ranks for spanning in body.spanning] == [[0, 1]]
    assert 2 in body.spanning[0].distributed + [i for group in body.spanning[0].sharded for i in group.sequences]
    check_plan(response_to_plan(body), sequence_lengths=lengths, dp_size=2, cp_size=4, bucket_size=20000)


def test_rejects_too_many_sequences_with_the_limit(client: TestClient) -> None:
    problem = assert_problem(client.post("/plan", json=plan_body(sequence_lengths=[10] * 1001)), 422,
                             "sequence_lengths")
    assert problem.limit == 1000
    assert "1000" in problem.detail


def test_reports_the_bound_of_a_range_error(client: TestClient) -> None:
    problem = assert_problem(client.post("/plan", json=plan_body(sequence_lengths=[5, -1])), 422,
                             "sequence_lengths[1]")
    assert problem.limit == 1


def test_one_answer_names_a_bad_length_beside_the_other_bad_fields(client: TestClient) -> None:
    problem = assert_problem(client.post("/plan", json=plan_body(sequence_lengths=[812, -5, 97, 0], dp_size=0)),
                             422, "sequence_lengths[1]")
    assert {error.field for error in problem.errors} == {"sequence_lengths[1]", "dp_size"}
    assert "(and 1 more bad lengths)" in problem.detail
    assert problem.limit == 1


def test_many_bad_items_give_a_short_bounded_report(client: TestClient) -> None:
    problem = assert_problem(client.post("/plan", json=plan_body(sequence_lengths=[-1] * 1000)), 422,
                             "sequence_lengths[0]")
    assert len(problem.errors) <= 50
    assert "more" in problem.detail


def test_rejects_non_json_content_type(client: TestClient) -> None:
    response = client.post("/plan", content=json.dumps(plan_body()), headers={"content-type": "text/plain"})
    assert_problem(response, 415, "body")


def test_rejects_body_over_limit_by_content_length(client: TestClient) -> None:
    body = json.dumps(plan_body(sequence_lengths=[7] * 40000)).encode()
    problem = assert_problem(client.post("/plan", content=body, headers={"content-type": "application/json"}),
                             413, "body")
    assert problem.limit == 64 << 10
    assert str(64 << 10) in problem.detail


def test_rejects_streamed_body_over_limit_without_content_length(client: TestClient) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"sequence_lengths": ['
        for _ in range(2000):
            yield b"1000, " * 10
        yield b"1], \"dp_size\": 1, \"cp_size\": 1}"

    response = client.post("/plan", content=chunks(), headers={"content-type": "application/json"})
    assert "content-length" not in response.request.headers
    problem = assert_problem(response, 413, "body")
    assert problem.limit == 64 << 10


def test_streamed_body_under_limit_is_accepted(client: TestClient) -> None:
    payload = json.dumps(plan_body()).encode()

    def chunks() -> Iterator[bytes]:
        yield from (payload[i:i + 7] for i in range(0, len(payload), 7))

    assert client.post("/plan", content=chunks(), headers={"content-type": "application/json"}).status_code == 200


def test_infeasible_plan_is_a_422(client: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    def infeasible(*args: object, **kwargs: object) -> None:
        raise InfeasiblePlanError("no plan fits bucket_size 10", field="bucket_size")

    monkeypatch.setattr("scheduler_service.runtime.work.make_plan", infeasible)
    assert_problem(client.post("/plan", json=plan_body()), 422, "bucket_size")


def test_plan_check_failure_is_an_internal_500(client: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise PlanCheckError(["index 3 scheduled twice"])

    monkeypatch.setattr("scheduler_service.runtime.work.make_plan", broken)
    problem = assert_problem(client.post("/plan", json=plan_body()), 500)
    assert "index 3 scheduled twice" in problem.detail


def test_unexpected_error_is_a_logged_problem_500(
    client: TestClient, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def bug(*args: object, **kwargs: object) -> None:
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr("scheduler_service.runtime.work.make_plan", bug)
    with caplog.at_level(logging.ERROR, logger="scheduler_service.error"):
        response = client.post("/plan", json=plan_body(), headers={"x-request-id": "bug-1"})
    problem = assert_problem(response, 500)
    assert problem.request_id == "bug-1"
    [record] = [r for r in caplog.records if r.name == "scheduler_service.error"]
    assert record.exc_info is not None and record.exc_info[0] is ZeroDivisionError


def test_unknown_route_and_wrong_method_are_problems(client: TestClient) -> None:
    assert_problem(client.get("/nowhere"), 404)
    response = client.get("/plan")
    assert_problem(response, 405)
    assert response.headers["allow"] == "POST"


# ---- request id and logs --------------------------------------------------------------------------------------

def test_request_id_is_echoed_or_generated(client: TestClient) -> None:
    assert client.get("/healthz", headers={"x-request-id": "trainer-7:step-42"}).headers["x-request-id"] == (
        "trainer-7:step-42")
    generated = client.get("/healthz").headers["x-request-id"]
    assert len(generated) == 32 and generated != client.get("/healthz").headers["x-request-id"]
    # A header that could forge log lines is replaced, not echoed.
    assert client.get("/healthz", headers={"x-request-id": "a b\tc"}).headers["x-request-id"] != "a b\tc"


def test_access_log_names_request_id_status_and_scheduler(
    client: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="scheduler_service.access"):
        client.post("/plan", json=plan_body(scheduler="sorted"), headers={"x-request-id": "log-1"})
    [record] = [r for r in caplog.records if r.name == "scheduler_service.access"]
    assert (record.method, record.path, record.status, record.scheduler) == ("POST", "/plan", 200, "sorted")
    assert record.duration_ms > 0


# ---- GET endpoints --------------------------------------------------------------------------------------------

def test_healthz(client: TestClient) -> None:
    response = client.get("/healthz")
    assert response.status_code == 200 and response.json() == {"status": "ok", "checks": {}}


def test_readyz_after_warmup(client: TestClient) -> None:
    response = client.get("/readyz")
    assert response.status_code == 200
    assert response.json()["status"] == "ready" and response.json()["checks"]["planner"] == "ready"


def test_readyz_is_503_before_startup() -> None:
    client = TestClient(create_app(service_settings()))  # no ``with``: the lifespan has not run
    assert_problem(client.get("/readyz"), 503)
    assert_problem(client.post("/plan", json=plan_body()), 503)


def test_models_lists_catalogue_profiles_schedulers_and_limits(client: TestClient) -> None:
    body = client.get("/models").json()
    assert [m["name"] for m in body["models"]] == list(MODEL_CATALOGUE)
    assert body["default_profile"] == DEFAULT_PROFILE
    assert DEFAULT_PROFILE in [p["name"] for p in body["profiles"]]
    assert body["default_model"] == PlanRequest.model_fields["model"].default
    assert body["schedulers"] == [s.value for s in SchedulerName]
    assert body["limits"]["max_sequences"] == 1000
    assert body["limits"]["max_body_bytes"] == 64 << 10
    assert body["limits"]["max_plan_cells"] == Settings().max_plan_cells
    assert body["limits"]["max_feedback_cells"] == Settings().max_feedback_cells


def test_metrics_count_requests_by_scheduler_and_status() -> None:
    with TestClient(create_app(service_settings())) as client:
        client.post("/plan", json=plan_body(scheduler="balanced"))
        client.post("/plan", json=plan_body(scheduler="balanced"))
        client.post("/plan", json=plan_body(model="nope"))
        response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    text = response.text
    assert 'skrull_plan_requests_total{scheduler="balanced",status="200"} 2.0' in text
    assert 'skrull_plan_requests_total{scheduler="skrull",status="422"} 1.0' in text
    assert 'skrull_plan_request_duration_seconds_count{scheduler="balanced",status="200"} 2.0' in text
    assert 'skrull_plan_solve_seconds_count{scheduler="balanced"} 2.0' in text
    assert 'skrull_plan_speedup_vs_deepspeed_count{scheduler="balanced"} 2.0' in text
    assert f'skrull_sequences_planned_total{{scheduler="balanced"}} {2.0 * len(MIXED_LENGTHS)}' in text
    assert 'skrull_http_requests_total{method="POST",route="/plan",status="200"} 2.0' in text


def test_metrics_label_requests_refused_before_routing() -> None:
    with TestClient(create_app(service_settings(max_body_bytes=1024))) as client:
        client.post("/plan", content=b"[" + b"1," * 2000 + b"1]", headers={"content-type": "application/json"})
        text = client.get("/metrics").text
    assert 'skrull_http_requests_total{method="POST",route="/plan",status="413"} 1.0' in text
    assert 'skrull_plan_requests_total{scheduler="unknown",status="413"} 1.0' in text


# ---- /plan with a job's feedback --------------------------------------------------------------------------------

FEEDBACK_LENGTHS = [637, 208, 90, 138, 35, 1216, 326, 301, 270, 1742, 1014, 958, 344, 304, 347, 123]


def _memory_report(job_id: str) -> dict[str, Any]:
    """Peaks whose two-parameter fit puts the fixed memory above the device's: the refit profile leaves no
    activation memory at all, and the memory cap is tiny."""
    micro_batches = [{"local_lengths": [[100 + 150 * i], [50 + 75 * i]], "distributed_lengths": [], "time_ms": 5.0,
                      "peak_memory_bytes": 1e11 + 1e4 * (100 + 150 * i)} for i in range(10)]
    return {"job_id": job_id, "micro_batches": micro_batches, "memory_budget_bytes": 1e11}


def test_a_capped_job_plans_with_or_without_bucket_size_alike() -> None:
    body: dict[str, Any] = {"sequence_lengths": FEEDBACK_LENGTHS, "dp_size": 1, "cp_size": 2, "model": "tiny",
                            "job_id": "j"}
    with TestClient(create_app(service_settings(warmup=False, access_log=False))) as client:
        base_bucket = client.post("/plan", json=body).json()["bucket_size"]
        state = client.post("/feedback", json=_memory_report("j")).json()
        assert state["bucket_size_cap"] is not None and state["bucket_size_cap"] < 871
        derived = client.post("/plan", json=body)
        explicit = client.post("/plan", json={**body, "bucket_size": base_bucket})
        assert derived.status_code == explicit.status_code == 200, (derived.text, explicit.text)
        # the documented floor: the longest sequence (1742 tokens) over the 2 CP ranks
        assert derived.json()["bucket_size"] == explicit.json()["bucket_size"] == 871
        assert derived.json()["profile"] == f"{DEFAULT_PROFILE}+feedback"
        assert "skrull_feedback_bucket_lowered_total 2.0" in client.get("/metrics").text


# What admitting a /plan request does, each exactly once wherever it runs (``_count_admission``).
_ADMISSION_STEPS = ("parse", "admit", "model", "profile", "validate", "cost")
_ADMISSION_LOG_ENV = "SKRULL_TEST_ADMISSION_LOG"


def _count_admission(log: Path, patch: Callable[[object, str, Any], None]) -> None:
    """Make this process append a line ``<pid> <step>`` to ``log`` at every step of a /plan request's admission:
    its parse (any validation of a ``PlanRequest``), the admission (``work.admit_plan``), its model's and its
    profile's resolution, its validation by the core (``make_problem``) and its cost estimate."""
    from scheduler_service.contract import wire
    from scheduler_service.runtime import service, work

    def write(step: str) -> None:
        with log.open("a") as file:
            file.write(f"{os.getpid()} {step}\n")

    def counted(step: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def counting(*args: Any, **kwargs: Any) -> Any:
            write(step)
            return fn(*args, **kwargs)
        return counting

    class CountingValidator:
        def __init__(self, validator: Any) -> None:
            self._validator = validator

        def __getattr__(self, name: str) -> Any:
            attribute = getattr(self._validator, name)
            return counted("parse", attribute) if name.startswith("validate_") else attribute

    patch(PlanRequest, "__pydantic_validator__", CountingValidator(PlanRequest.__pydantic_validator__))
    patch(service, "admit_plan", counted("admit", service.admit_plan))
    patch(work, "request_model", counted("model", work.request_model))
    patch(work, "resolve_profile", counted("profile", work.resolve_profile))
    patch(wire, "make_problem", counted("validate", wire.make_problem))
    patch(work, "plan_cost", counted("cost", work.plan_cost))
    write("started")


def _init_counting_worker() -> None:
    """A pool process's own initializer, then the counters (the pools spawn: nothing patched here reaches them)."""
    from scheduler_service.runtime import pools

    pools._init_worker()  # this process's own module, not the test's patched one
    _count_admission(Path(os.environ[_ADMISSION_LOG_ENV]), setattr)


def test_a_plan_is_parsed_admitted_resolved_validated_and_costed_once_in_every_process(monkeypatch: pytest.MonkeyPatch,
                                                                      tmp_path: Path) -> None:
    from scheduler_service.runtime import pools

    log = tmp_path / "admission.log"
    monkeypatch.setenv(_ADMISSION_LOG_ENV, str(log))
    monkeypatch.setattr(pools, "_init_worker", _init_counting_worker)
    _count_admission(log, monkeypatch.setattr)

    def steps() -> dict[str, Counter[str]]:
        """Steps of the requests since the last call, by step: how many in this process and in pool processes."""
        lines = [line.split() for line in log.read_text().splitlines()]
        log.write_text("")
        counts: dict[str, Counter[str]] = {step: Counter() for step in (*_ADMISSION_STEPS, "started")}
        for pid, step in lines:
            counts[step]["here" if int(pid) == os.getpid() else "pool"] += 1
        return counts

    body: dict[str, Any] = {"sequence_lengths": FEEDBACK_LENGTHS, "dp_size": 1, "cp_size": 2, "model": "tiny",
                            "job_id": "once", "bucket_size": 4096}
    # A search budget over inline_max_search_budget sends a plan to the heavy pool.
    settings = service_settings(warmup=False, access_log=False, inline_max_search_budget=8)
    with TestClient(create_app(settings)) as client:
        assert client.post("/plan", json=body).status_code == 200
        client.post("/feedback", json=_memory_report("once"))
        steps()
        for where, request in (("inline", body), ("heavy pool", {**body, "search_budget": 16}),
                               ("cpsat pool", {**body, "scheduler": "cpsat", "time_limit_s": 0.5})):
            response = client.post("/plan", json=request)  # a job with a refit profile and a lowered bucket
            assert response.status_code == 200, response.text
            assert response.json()["bucket_size"] == 871
            counts = steps()
            if where != "inline":  # the pool's process counts too: it was started with the counters
                assert counts.pop("started") == Counter(pool=1), where
            once_here = {step: {"here": 1} for step in _ADMISSION_STEPS}
            assert {step: dict(counts[step]) for step in _ADMISSION_STEPS} == once_here, where


def test_a_heavy_request_refused_while_validated_frees_its_pool_slot() -> None:
    # The heavy pool's only slot is taken before validation; a refused request must give it back.
    settings = service_settings(warmup=False, access_log=False, inline_max_cells=0, heavy_workers=1, heavy_queue=0)
    with TestClient(create_app(settings)) as client:
        for _ in range(2):
            bad = client.post("/plan", json=plan_body(sequence_lengths=[*MIXED_LENGTHS, 10**9]))
            assert_problem(bad, 422, field="sequence_lengths[16]")
        assert client.app.state.planner.heavy_pool.in_flight == 0
        assert client.post("/plan", json=plan_body()).status_code == 200
