"""The wire contract in ``proto/``: the models, the exported JSON Schemas and OpenAPI document, and its isolation."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from pydantic import ValidationError
from skrull_proto import SCHEMES_SCHEMA_VERSION, ModelSpec, PlanRequest, PlanResponse, Problem

from scheduler_service.export_schema import CONTRACT_DIR, contract_documents, main, stale_documents


def test_checked_in_contract_files_match_the_code() -> None:
    stale = stale_documents()
    assert not stale, f"{stale} drifted from the models; run: python -m scheduler_service.export_schema"


def test_export_check_fails_on_drift(tmp_path: object) -> None:
    directory = tmp_path  # type: ignore[assignment]
    assert main(["--dir", str(directory)]) == 0
    assert main(["--check", "--dir", str(directory)]) == 0
    (directory / "openapi.json").write_text("{}\n")  # type: ignore[operator]
    assert main(["--check", "--dir", str(directory)]) == 1


def test_openapi_documents_every_endpoint_and_problem_responses() -> None:
    document = json.loads((CONTRACT_DIR / "openapi.json").read_text())
    assert set(document["paths"]) == {
        "/plan", "/models", "/healthz", "/readyz", "/metrics", "/feedback", "/feedback/{job_id}", "/profiles/reload",
        "/jobs/{job_id}/profile", "/samplers", "/samplers/{name}", "/advise",
    }
    plan = document["paths"]["/plan"]["post"]
    assert plan["requestBody"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/PlanRequest"}
    for status in ("400", "413", "415", "422", "429", "500", "503"):
        assert plan["responses"][status]["content"] == {
            "application/problem+json": {"schema": {"$ref": "#/components/schemas/Problem"}}}
    assert {"PlanRequest", "PlanResponse", "Problem", "ModelSpec", "SolverReport", "ShardedGroupModel",
            "ShardedGroupLengths", "CPRankEstimateModel", "SampledBatch", "AdviseRequest", "AdviceDocument",
            "RankedLayoutModel", "ExcludedLayoutModel"} <= set(document["components"]["schemas"])
    advise = document["paths"]["/advise"]["post"]
    assert advise["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/AdviseRequest"}
    assert advise["responses"]["422"]["content"] == {
        "application/problem+json": {"schema": {"$ref": "#/components/schemas/Problem"}}}


def test_openapi_operation_ids_are_readable() -> None:
    """Generated clients name their methods after these (FastAPI's default would be ``plan_plan_post``)."""
    document = json.loads((CONTRACT_DIR / "openapi.json").read_text())
    operation_ids = {(method.upper(), path): operation["operationId"]
                     for path, item in document["paths"].items() for method, operation in item.items()}
    assert operation_ids == {
        ("POST", "/plan"): "plan", ("GET", "/models"): "listModels", ("POST", "/profiles/reload"): "reloadProfiles",
        ("POST", "/feedback"): "postFeedback", ("GET", "/feedback/{job_id}"): "getJobFeedback",
        ("PUT", "/jobs/{job_id}/profile"): "putJobProfile",
        ("GET", "/healthz"): "healthz", ("GET", "/readyz"): "readyz", ("GET", "/metrics"): "metrics",
        ("GET", "/samplers"): "listSamplers", ("GET", "/samplers/{name}"): "drawSamples", ("POST", "/advise"): "advise",
    }


def test_json_schemas_describe_the_models() -> None:
    documents = contract_documents()
    request_schema = json.loads(documents["plan_request.schema.json"])
    assert request_schema["additionalProperties"] is False
    assert request_schema["required"] == ["sequence_lengths", "dp_size", "cp_size"]
    assert request_schema["properties"]["sequence_lengths"]["minItems"] == 1
    assert set(json.loads(documents["plan_response.schema.json"])["properties"]) >= {
        "dp_ranks", "estimated_iteration_time_ms", "solve_time_ms", "deepspeed_estimated_iteration_time_ms",
        "speedup_vs_deepspeed", "solver", "schema_version"}


def test_request_example_in_the_schema_is_valid() -> None:
    for example in PlanRequest.model_json_schema()["examples"]:
        assert PlanRequest.model_validate(example).schema_version == SCHEMES_SCHEMA_VERSION


def test_request_forbids_unknown_fields_and_other_versions() -> None:
    base = {"sequence_lengths": [10], "dp_size": 1, "cp_size": 1}
    with pytest.raises(ValidationError):
        PlanRequest.model_validate({**base, "dp": 2})
    with pytest.raises(ValidationError):
        PlanRequest.model_validate({**base, "schema_version": 4})


@pytest.mark.parametrize(
    ("name", "bound"),
    [("hidden_size", 2**18), ("intermediate_size", 2**20), ("num_layers", 2**12), ("num_attention_heads", 2**12),
     ("num_key_value_heads", 2**12), ("head_dim", 2**12), ("vocab_size", 2**23)],
)
def test_inline_model_sizes_are_bounded(name: str, bound: int) -> None:
    spec = {"name": "m", "hidden_size": 64, "num_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
            "head_dim": 16, "intermediate_size": 128, "vocab_size": 1000}
    assert ModelSpec.model_validate({**spec, name: bound})  # the bound itself is accepted
    with pytest.raises(ValidationError, match=name):
        ModelSpec.model_validate({**spec, name: bound + 1})
    schema = PlanRequest.model_json_schema()["$defs"]["ModelSpec"]["properties"][name]
    assert schema["maximum"] == bound  # and published in the contract


def test_response_round_trips_through_json() -> None:
    response = PlanResponse.model_validate({
        "scheduler": "skrull", "model": "tiny", "profile": "h100-paper", "bucket_size": 100,
        "dp_ranks": [{"micro_batches": [{"local": [[0], []], "distributed": [1], "estimated_time_ms": 1.5}],
                      "estimated_time_ms": 1.5}],
        "estimated_iteration_time_ms": 1.5, "solve_time_ms": 0.1, "deepspeed_estimated_iteration_time_ms": 3.0,
        "speedup_vs_deepspeed": 2.0, "lower_bound_ms": 1.2,
    })
    assert PlanResponse.model_validate_json(response.model_dump_json()) == response


def test_problem_allows_extension_members() -> None:
    problem = Problem.model_validate({"title": "Busy", "status": 429, "detail": "full", "retry_after_s": 3})
    assert problem.model_dump()["retry_after_s"] == 3


def test_proto_imports_without_fastapi_or_the_planner() -> None:
    code = (
        "import sys, skrull_proto; "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
        "{'fastapi', 'starlette', 'scheduler_service', 'trainer_client', 'numpy', 'torch', 'httpx'}); "
        "print(','.join(bad))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == ""


def test_wire_and_core_name_the_same_schedulers() -> None:
    from skrull_proto import SchedulerName as WireSchedulerName

    from scheduler_service.core.plan import SchedulerName as CoreSchedulerName

    assert [s.value for s in WireSchedulerName] == [s.value for s in CoreSchedulerName]


def test_wire_and_core_name_the_same_sharding_and_checkpointing_modes() -> None:
    # The advisor's wire enums copy the core's (the contract imports nothing of the core): a mode added to one must
    # be added to the other.
    from skrull_proto.advise import CheckpointingMode, ShardingMode

    from scheduler_service.core.memory import ActivationCheckpointing, Sharding

    assert [mode.value for mode in ShardingMode] == [mode.value for mode in Sharding]
    assert [mode.value for mode in CheckpointingMode] == [mode.value for mode in ActivationCheckpointing]
