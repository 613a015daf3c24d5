"""Optional bearer-token auth: off by default; when set, only the state-changing endpoints need the token."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from skrull_proto import FeedbackRequest, Problem

from scheduler_service.core.profile import DEFAULT_PROFILE
from scheduler_service.runtime.settings import Settings
from scheduler_service.web.app import create_app
from tests.service_inputs import measured_document, settings
from trainer_client.planning.client import PlanClient, PlanRejected

TOKEN = "s3cret-token-for-tests"
PLAN: dict[str, Any] = {"sequence_lengths": [637, 208, 90, 1742], "dp_size": 1, "cp_size": 2, "model": "tiny",
                        "job_id": "auth-job"}
REPORT: dict[str, Any] = {"job_id": "auth-job", "micro_batches": [
    {"local_lengths": [[100 + 150 * i], [50 + 75 * i]], "distributed_lengths": [], "time_ms": 5.0 + i}
    for i in range(4)]}
REGISTRATION: dict[str, Any] = {"profile": measured_document(name="auth-tiny"), "model": "tiny", "dp_size": 1,
                                "cp_size": 2}
# The endpoints that change state, each with a body it accepts.
GUARDED = [pytest.param("POST", "/feedback", REPORT, id="feedback"),
           pytest.param("PUT", "/jobs/auth-job/profile", REGISTRATION, id="job-profile"),
           pytest.param("POST", "/profiles/reload", None, id="profiles-reload")]


@pytest.fixture
def guarded() -> Iterator[TestClient]:
    with TestClient(create_app(settings(api_token=TOKEN))) as client:
        assert client.post("/plan", json=PLAN).status_code == 200  # /plan never needs the token
        yield client


def assert_unauthorized(response: Any, challenge: str) -> None:
    assert response.status_code == 401, response.text
    assert response.headers["www-authenticate"] == challenge
    assert response.headers["content-type"] == "application/problem+json"
    problem = Problem.model_validate_json(response.content)
    assert problem.type == "urn:skrull:problem:unauthorized" and problem.status == 401
    assert TOKEN not in response.text


def test_auth_is_off_by_default() -> None:
    assert Settings().api_token is None
    with TestClient(create_app(settings())) as client:
        assert client.post("/plan", json=PLAN).status_code == 200
        for method, path, body in (param.values for param in GUARDED):
            assert client.request(method, path, json=body).status_code == 200, path


@pytest.mark.parametrize(("method", "path", "body"), GUARDED)
def test_state_changing_endpoints_refuse_a_request_without_the_token(
    guarded: TestClient, method: str, path: str, body: dict[str, Any] | None
) -> None:
    assert_unauthorized(guarded.request(method, path, json=body), "Bearer")
    assert_unauthorized(guarded.request(method, path, json=body, headers={"Authorization": f"Basic {TOKEN}"}),
                        "Bearer")


@pytest.mark.parametrize(("method", "path", "body"), GUARDED)
def test_state_changing_endpoints_refuse_a_wrong_token(
    guarded: TestClient, method: str, path: str, body: dict[str, Any] | None
) -> None:
    for wrong in ("nope", TOKEN[:-1], TOKEN + "x"):
        response = guarded.request(method, path, json=body, headers={"Authorization": f"Bearer {wrong}"})
        assert_unauthorized(response, 'Bearer error="invalid_token"')
    state = guarded.get("/feedback/auth-job").json()
    assert state["num_observations"] == 0 and state["base_profile"] == DEFAULT_PROFILE  # nothing refit or registered


def test_the_right_token_is_accepted(guarded: TestClient) -> None:
    headers = {"Authorization": f"Bearer {TOKEN}"}
    response = guarded.post("/feedback", json=REPORT, headers=headers)
    assert response.status_code == 200, response.text
    assert response.json()["num_observations"] == len(REPORT["micro_batches"])
    response = guarded.put("/jobs/auth-job/profile", json=REGISTRATION, headers=headers)
    assert response.status_code == 200, response.text
    assert response.json()["base_profile"] == "auth-tiny"
    assert guarded.post("/profiles/reload", headers=headers).status_code == 200


def test_planning_and_probes_never_need_the_token(guarded: TestClient) -> None:
    assert guarded.post("/plan", json={**PLAN, "scheduler": "deepspeed"}).status_code == 200
    for path in ("/healthz", "/readyz", "/metrics", "/models", "/feedback/auth-job"):
        assert guarded.get(path).status_code == 200, path


def test_the_openapi_document_declares_the_bearer_scheme_on_the_guarded_operations(guarded: TestClient) -> None:
    document = guarded.get("/openapi.json").json()
    assert document["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"
    guarded_operations = {(path, method): operation["security"] for path, item in document["paths"].items()
                          for method, operation in item.items() if operation.get("security")}
    # {}: the token is optional, needed only where the service sets one
    assert guarded_operations == {("/feedback", "post"): [{"HTTPBearer": []}, {}],
                                  ("/jobs/{job_id}/profile", "put"): [{"HTTPBearer": []}, {}],
                                  ("/profiles/reload", "post"): [{"HTTPBearer": []}, {}]}


def test_the_trainers_client_sends_the_token_it_is_given_or_finds_in_the_environment(
    guarded: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    report = FeedbackRequest.model_validate(REPORT)
    monkeypatch.delenv("SKRULL_API_TOKEN", raising=False)
    with pytest.raises(PlanRejected, match="401"):
        PlanClient("http://testserver", client=guarded).feedback(report)
    assert PlanClient("http://testserver", client=guarded, api_token=TOKEN).feedback(report).num_observations == 4
    monkeypatch.setenv("SKRULL_API_TOKEN", TOKEN)
    assert PlanClient("http://testserver", client=guarded).feedback(report).num_observations == 8
