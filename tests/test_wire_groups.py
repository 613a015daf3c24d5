"""Hybrid DACP groups at the edges: the wire contract, its conversions, the service, the CLI and the plan client.

The plans here are built by hand (the heuristic decides for itself whether groups pay off), checked with the core
checker, and simulated, so every edge sees a plan that certainly carries groups.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from skrull_proto import FeedbackRequest, PlanResponse, Problem

from scheduler_service.cli import cp_rank_shares, format_table, plot_gantt
from scheduler_service.contract.wire import response_to_plan, result_to_response
from scheduler_service.core.check import check_plan
from scheduler_service.core.plan import (
    SchedulerName,
)
from scheduler_service.core.simulate import simulate
from scheduler_service.export_schema import CONTRACT_DIR
from scheduler_service.runtime import work
from scheduler_service.web.app import create_app
from tests.grouped_plans import BINARY_PLAN, BUCKET_SIZE, CP, DP, GROUPED_PLAN, LENGTHS, problem, result_of
from tests.service_inputs import settings
from trainer_client.planning.client import PlanClient
from trainer_client.planning.source import MicroBatchTiming, PlanOrigin, PlanSource, measurements_of

# ---- a JSON Schema reader, enough for the exported contract (no jsonschema dependency) ------------------------

def schema_errors(instance: Any, schema: dict[str, Any], root: dict[str, Any], path: str = "") -> list[str]:
    """What a client validating against the exported JSON Schema would refuse (the keywords our schemas use)."""
    if "$ref" in schema:
        return schema_errors(instance, root["$defs"][schema["$ref"].split("/")[-1]], root, path)
    if "anyOf" in schema:
        options = [schema_errors(instance, option, root, path) for option in schema["anyOf"]]
        return [] if any(not errors for errors in options) else min(options, key=len)
    if "const" in schema and instance != schema["const"]:
        return [f"{path}: {instance!r} != {schema['const']!r}"]
    if "enum" in schema and instance not in schema["enum"]:
        return [f"{path}: {instance!r} not in {schema['enum']}"]
    kind = schema.get("type")
    if kind == "object":
        if not isinstance(instance, dict):
            return [f"{path}: not an object"]
        properties = schema.get("properties", {})
        errors = [f"{path}.{name}: missing" for name in schema.get("required", []) if name not in instance]
        for name, value in instance.items():
            if name in properties:
                errors += schema_errors(value, properties[name], root, f"{path}.{name}")
            elif schema.get("additionalProperties") is False:
                errors.append(f"{path}.{name}: unknown property")
        return errors
    if kind == "array":
        if not isinstance(instance, list):
            return [f"{path}: not an array"]
        errors = [f"{path}: fewer than {schema['minItems']} items"] if len(instance) < schema.get("minItems", 0) else []
        for index, item in enumerate(instance):
            errors += schema_errors(item, schema.get("items", {}), root, f"{path}[{index}]")
        return errors
    if kind == "integer" and not (isinstance(instance, int) and instance >= schema.get("minimum", instance)):
        return [f"{path}: {instance!r} is not an integer >= {schema.get('minimum')}"]
    if kind == "number" and not isinstance(instance, int | float):
        return [f"{path}: {instance!r} is not a number"]
    if kind == "string" and not isinstance(instance, str):
        return [f"{path}: {instance!r} is not a string"]
    if kind == "null" and instance is not None:
        return [f"{path}: not null"]
    return []


def plan_response_schema() -> dict[str, Any]:
    schema: dict[str, Any] = json.loads((CONTRACT_DIR / "plan_response.schema.json").read_text())
    return schema


def schema_before_groups() -> dict[str, Any]:
    """The response schema as a client built before hybrid DACP has it: no ``sharded``, unknown fields refused."""
    schema = plan_response_schema()
    micro_batch = schema["$defs"]["MicroBatchModel"]
    del micro_batch["properties"]["sharded"]
    del schema["$defs"]["ShardedGroupModel"]
    return schema


# ---- the wire contract and its conversions --------------------------------------------------------------------

def test_grouped_plan_round_trips_core_to_wire_to_json_and_back() -> None:
    response = result_to_response(result_of(GROUPED_PLAN))
    first = response.dp_ranks[0].micro_batches[1]
    assert [(group.cp_ranks, group.sequences) for group in first.sharded] == [([0, 1], [9]), ([2, 3], [8])]
    parsed = PlanResponse.model_validate_json(response.model_dump_json())
    assert parsed == response
    assert response_to_plan(parsed) == GROUPED_PLAN


def test_binary_plan_round_trips_and_leaves_sharded_out_of_the_json() -> None:
    response = result_to_response(result_of(BINARY_PLAN))
    body = json.loads(response.model_dump_json())
    assert all("sharded" not in mb for dp in body["dp_ranks"] for mb in dp["micro_batches"])
    assert response_to_plan(PlanResponse.model_validate(body)) == BINARY_PLAN


def test_a_client_that_predates_groups_parses_binary_plans_and_refuses_grouped_ones() -> None:
    old_schema = schema_before_groups()
    binary = json.loads(result_to_response(result_of(BINARY_PLAN)).model_dump_json())
    assert schema_errors(binary, old_schema, old_schema) == []
    grouped = json.loads(result_to_response(result_of(GROUPED_PLAN)).model_dump_json())
    errors = schema_errors(grouped, old_schema, old_schema)
    # never read as a binary plan: the unknown field stops it
    assert errors and all(error.endswith(".sharded: unknown property") for error in errors)


def test_grouped_plan_passes_the_exported_schema() -> None:
    schema = plan_response_schema()
    grouped = json.loads(result_to_response(result_of(GROUPED_PLAN)).model_dump_json())
    assert schema_errors(grouped, schema, schema) == []
    grouped["dp_ranks"][0]["micro_batches"][0]["sharded"][0]["cp_ranks"] = [0]  # a group of one is no group
    assert schema_errors(grouped, schema, schema) == [
        ".dp_ranks[0].micro_batches[0].sharded[0].cp_ranks: fewer than 2 items"]


def test_skrull_binary_is_a_wire_scheduler() -> None:
    response = result_to_response(result_of(BINARY_PLAN, scheduler=SchedulerName.SKRULL_BINARY))
    assert PlanResponse.model_validate_json(response.model_dump_json()).scheduler == "skrull_binary"
    assert "skrull_binary" in plan_response_schema()["$defs"]["SchedulerName"]["enum"]


# ---- the service ----------------------------------------------------------------------------------------------


@pytest.fixture
def grouped_service(monkeypatch: pytest.MonkeyPatch) -> Iterator[TestClient]:
    """The app, with the planner answering GROUPED_PLAN for the request's own problem."""
    monkeypatch.setattr(work, "make_plan",
                        lambda planning_problem, scheduler, **_: result_of(GROUPED_PLAN, planning_problem))
    with TestClient(create_app(settings())) as client:
        yield client


def plan_body(**overrides: Any) -> dict[str, Any]:
    return {"sequence_lengths": LENGTHS, "dp_size": DP, "cp_size": CP, "bucket_size": BUCKET_SIZE, **overrides}


def test_plan_endpoint_answers_groups_that_pass_the_schema(grouped_service: TestClient) -> None:
    answer = grouped_service.post("/plan", json=plan_body())
    assert answer.status_code == 200, answer.text
    schema = plan_response_schema()
    assert schema_errors(answer.json(), schema, schema) == []
    plan = response_to_plan(PlanResponse.model_validate_json(answer.content))
    assert plan == GROUPED_PLAN
    check_plan(plan, sequence_lengths=LENGTHS, dp_size=DP, cp_size=CP, bucket_size=BUCKET_SIZE)


def metric(text: str, name: str) -> float:
    (line,) = [line for line in text.splitlines() if line.startswith(name + " ")]
    return float(line.rsplit(" ", 1)[1])


def test_metrics_count_sequences_by_placement_and_group_degrees(grouped_service: TestClient) -> None:
    assert grouped_service.post("/plan", json=plan_body()).status_code == 200
    text = grouped_service.get("/metrics").text
    placed = 'skrull_sequences_placed_total{placement="%s",scheduler="skrull"}'
    assert metric(text, placed % "local") == 4  # sequences 2, 3, 4, 5
    assert metric(text, placed % "distributed") == 1  # 6
    assert metric(text, placed % "sharded") == 5  # 0, 1, 9, 8, 7
    assert metric(text, 'skrull_sharded_group_degree_count{scheduler="skrull"}') == 4  # groups, all of 2 ranks
    assert metric(text, 'skrull_sharded_group_degree_sum{scheduler="skrull"}') == 8
    assert metric(text, 'skrull_sharded_group_degree_bucket{le="2.0",scheduler="skrull"}') == 4


def test_metrics_count_binary_plans_with_no_sharded_sequence() -> None:
    with TestClient(create_app(settings())) as client:
        assert client.post("/plan", json=plan_body(scheduler="skrull_binary")).status_code == 200
        text = client.get("/metrics").text
    placed = 'skrull_sequences_placed_total{placement="%s",scheduler="skrull_binary"}'
    assert metric(text, placed % "sharded") == 0
    assert metric(text, placed % "local") + metric(text, placed % "distributed") == len(LENGTHS)
    assert 'skrull_sharded_group_degree_count{scheduler="skrull_binary"}' not in text


def grouped_report(cp_ranks: list[int], job_id: str = "job-g") -> dict[str, Any]:
    return {"job_id": job_id, "micro_batches": [
        {"local_lengths": [[], [], [3000], [2000]], "distributed_lengths": [],
         "sharded_lengths": [{"cp_ranks": [0, 1], "lengths": [9000, 9432]}], "time_ms": 95.0,
         "peak_memory_bytes": 4e10},
        {"local_lengths": [[1000], [500], [], []], "distributed_lengths": [],
         "sharded_lengths": [{"cp_ranks": [0, 1], "lengths": [800]}, {"cp_ranks": cp_ranks, "lengths": [700]}],
         "time_ms": 6.0},
    ]}


def test_feedback_with_groups_is_accepted(grouped_service: TestClient) -> None:
    assert grouped_service.post("/plan", json=plan_body(job_id="job-g")).status_code == 200
    answer = grouped_service.post("/feedback", json=grouped_report([2, 3]))
    assert answer.status_code == 200, answer.text
    assert answer.json()["num_observations"] == 2


@pytest.mark.parametrize(
    ("cp_ranks", "reason"),
    [
        pytest.param([1, 2], "not an aligned block", id="misaligned"),
        pytest.param([3, 2], "not an aligned block", id="descending"),
        pytest.param([0, 1, 2], "has 3 CP ranks", id="size-not-dividing"),
        pytest.param([0, 1, 2, 3], "has 4 CP ranks", id="the-whole-group"),
        pytest.param([4, 5], "not an aligned block", id="beyond-cp-size"),
    ],
)
def test_feedback_with_a_group_that_is_not_an_aligned_block_is_a_422_naming_it(
    grouped_service: TestClient, cp_ranks: list[int], reason: str
) -> None:
    assert grouped_service.post("/plan", json=plan_body(job_id="job-g")).status_code == 200
    before = grouped_service.get("/feedback/job-g").json()
    answer = grouped_service.post("/feedback", json=grouped_report(cp_ranks))
    assert answer.status_code == 422, answer.text
    assert answer.headers["content-type"] == "application/problem+json"
    problem = Problem.model_validate_json(answer.content)
    assert problem.field == "micro_batches[1].sharded_lengths[1].cp_ranks"
    assert reason in problem.detail and "micro_batches[1].sharded_lengths[1]" in problem.detail
    assert grouped_service.get("/feedback/job-g").json() == before


def test_feedback_group_on_a_cp_group_too_small_for_groups_is_a_422() -> None:
    with TestClient(create_app(settings())) as client:
        assert client.post("/plan", json=plan_body(cp_size=2, job_id="job-2")).status_code == 200
        report = {"job_id": "job-2", "micro_batches": [
            {"local_lengths": [[], []], "distributed_lengths": [],
             "sharded_lengths": [{"cp_ranks": [0, 1], "lengths": [900]}], "time_ms": 5.0}]}
        answer = client.post("/feedback", json=report)
    assert answer.status_code == 422, answer.text
    assert answer.json()["field"] == "micro_batches[0].sharded_lengths[0].cp_ranks"


@pytest.mark.parametrize(
    ("group", "field"),
    [
        pytest.param({"cp_ranks": [0], "lengths": [5]}, "micro_batches[0].sharded_lengths[0].cp_ranks", id="one-rank"),
        pytest.param({"cp_ranks": [0, 1], "lengths": []}, "micro_batches[0].sharded_lengths[0].lengths",
                     id="no-length"),
        pytest.param({"cp_ranks": [0, 1], "lengths": [0]}, "micro_batches[0].sharded_lengths[0].lengths[0]",
                     id="zero-length"),
        pytest.param({"cp_ranks": [-2, -1], "lengths": [5]}, "micro_batches[0].sharded_lengths[0].cp_ranks[0]",
                     id="negative-rank"),
    ],
)
def test_malformed_group_reports_are_refused_by_the_contract(
    grouped_service: TestClient, group: dict[str, Any], field: str
) -> None:
    grouped_service.post("/plan", json=plan_body(job_id="job-g"))
    report = {"job_id": "job-g", "micro_batches": [
        {"local_lengths": [[5], [], [], []], "distributed_lengths": [], "sharded_lengths": [group], "time_ms": 5.0}]}
    answer = grouped_service.post("/feedback", json=report)
    assert answer.status_code == 422, answer.text
    assert answer.json()["field"] == field


def test_feedback_sequence_in_a_group_counts_toward_the_length_limit() -> None:
    with TestClient(create_app(settings(max_sequence_length=100_000))) as client:
        client.post("/plan", json=plan_body(job_id="job-g"))
        report = grouped_report([2, 3])
        report["micro_batches"][0]["sharded_lengths"][0]["lengths"] = [100_001]
        answer = client.post("/feedback", json=report)
    assert answer.status_code == 422
    assert answer.json()["field"] == "micro_batches[0]" and answer.json()["limit"] == 100_000


# ---- the trainer's plan client --------------------------------------------------------------------------------

def source_for(client: httpx.Client, job_id: str | None = None) -> PlanSource:
    return PlanSource(scheduler="skrull", dp_size=DP, cp_size=CP, model="qwen2.5-0.5b", bucket_size=BUCKET_SIZE,
                      client=PlanClient("http://testserver", client=client), job_id=job_id)


def test_plan_client_keeps_the_groups_of_a_service_plan(grouped_service: TestClient) -> None:
    source = source_for(grouped_service)
    decision = source.decide(0, LENGTHS)
    assert decision.origin is PlanOrigin.SERVICE and decision.plan == GROUPED_PLAN
    source.close()


def test_plan_client_refuses_a_service_plan_with_a_misaligned_group(
    grouped_service: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    def misaligning(request: httpx.Request) -> httpx.Response:
        body = grouped_service.post("/plan", content=request.content,
                                    headers={"content-type": "application/json"}).json()
        body["dp_ranks"][0]["micro_batches"][0]["sharded"][0]["cp_ranks"] = [1, 2]
        return httpx.Response(200, content=json.dumps(body).encode())

    http = httpx.Client(base_url="http://testserver", transport=httpx.MockTransport(misaligning))
    source = source_for(http)
    decision = source.decide(0, LENGTHS)
    assert decision.origin is PlanOrigin.EMBEDDED and source.num_fallbacks == 1
    assert "fails the checker" in caplog.text and "not an aligned block" in caplog.text
    source.close()


def test_measurements_carry_the_lengths_of_each_group() -> None:
    timings = [MicroBatchTiming(dp_rank=0, index=1, time_s=0.006), MicroBatchTiming(dp_rank=1, index=0, time_s=0.1)]
    first, second = measurements_of(GROUPED_PLAN, LENGTHS, timings)
    assert [(group.cp_ranks, group.lengths) for group in first.sharded_lengths] == [([0, 1], [800]), ([2, 3], [700])]
    assert first.local_lengths == [[1000], [500], [], []]
    assert second.distributed_lengths == [20000]
    assert [(group.cp_ranks, group.lengths) for group in second.sharded_lengths] == [([2, 3], [8000])]
    report = FeedbackRequest(job_id="x", micro_batches=[first, second])
    assert json.loads(report.model_dump_json())["micro_batches"][0]["sharded_lengths"][1] == {
        "cp_ranks": [2, 3], "lengths": [700]}
    binary = measurements_of(BINARY_PLAN, LENGTHS, [MicroBatchTiming(dp_rank=0, index=0, time_s=0.1)])
    assert "sharded_lengths" not in binary[0].model_dump_json()  # an older service still reads binary reports


def test_plan_source_reports_group_lengths_the_service_accepts(grouped_service: TestClient) -> None:
    source = source_for(grouped_service, job_id="trainer-g")
    decision = source.decide(0, LENGTHS)
    assert decision.plan == GROUPED_PLAN
    timings = [MicroBatchTiming(dp_rank=dp, index=i, time_s=0.05 + 0.01 * i)
               for dp, dp_plan in enumerate(GROUPED_PLAN.dp_ranks) for i in range(len(dp_plan.micro_batches))]
    future = source.report(1, GROUPED_PLAN, LENGTHS, timings)
    assert future is not None
    future.result(timeout=10)
    assert source.num_feedback_failures == 0
    assert source.last_feedback is not None and source.last_feedback.num_observations == 3
    source.close()


# ---- the CLI --------------------------------------------------------------------------------------------------

def test_table_shows_each_micro_batchs_groups() -> None:
    table = format_table(result_of(GROUPED_PLAN))
    rows = table.splitlines()
    assert "#grp" in rows[1] and "groups [cp ranks]:sequences/tokens" in rows[1]
    assert rows[2].split()[5] == "1" and rows[2].endswith("[0,1]:2/18432")
    assert rows[3].split()[5] == "2" and rows[3].endswith("[0,1]:1/800 [2,3]:1/700")
    assert rows[5].endswith("[2,3]:1/8000")
    # the group's tokens count on its ranks: 18432 / 2 on CP ranks 0 and 1
    assert rows[2].split()[6:10] == ["9216", "9216", "3000", "2000"]


def test_table_of_a_binary_plan_shows_no_group() -> None:
    table = format_table(result_of(BINARY_PLAN))
    micro_batch_rows = [row for row in table.splitlines()[2:] if row.split()[1].isdigit()]
    assert len(micro_batch_rows) == 2
    assert all(row.split()[5] == "0" and row.endswith("  -") for row in micro_batch_rows)


def test_cp_rank_shares_put_group_work_on_the_groups_ranks_only_and_add_up_to_the_estimate() -> None:
    planning_problem = problem()
    micro_batch = simulate(planning_problem, GROUPED_PLAN).dp_ranks[1].micro_batches[0]
    shares = [cp_rank_shares(rank) for rank in micro_batch.cp_ranks]
    assert [share["sharded (hybrid group)"] > 0 for share in shares] == [False, False, True, True]
    assert all(share["distributed"] > 0 and share["local"] == 0.0 for share in shares)
    for share, rank in zip(shares, micro_batch.cp_ranks, strict=True):
        assert sum(share.values()) == pytest.approx(rank.time_s, rel=1e-12)


def test_plot_draws_a_grouped_plan(tmp_path: Path) -> None:
    chart = tmp_path / "gantt.png"
    plot_gantt(result_of(GROUPED_PLAN), chart)
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
