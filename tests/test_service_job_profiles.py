"""PUT /jobs/{job_id}/profile: a trainer registers the profile it measured as its job's base. The job's plans then
plan with it (as the embedded planner does with the same profile), its reports refit from it, it outlives a restart
of the service, it stays the job's own, and a bad registration is a 4xx naming the field that changes nothing."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from skrull_proto import FeedbackResponse, PlanResponse

from scheduler_service.contract.profiles import MAX_PROFILE_FILE_BYTES
from scheduler_service.core.plan import make_problem
from scheduler_service.core.planner import make_plan
from scheduler_service.core.profile import DEFAULT_PROFILE, builtin_profiles, parse_profile
from scheduler_service.web.app import create_app
from tests.answers import assert_problem
from tests.service_inputs import LENGTHS, measured_document, report, settings

# Three times the compute cost of the test's other measured profile, on a device with a quarter of the H100's
# memory: its plans, and the BucketSize it derives, differ from the default profile's.
DOCUMENT = measured_document(name="trainer-tiny", scale=3.0)
DOCUMENT["hardware"]["device_memory_bytes"] /= 4


@pytest.fixture
def client() -> Iterator[TestClient]:
    with TestClient(create_app(settings())) as test_client:
        yield test_client


def register(client: TestClient, job_id: str = "job-1", document: dict[str, Any] = DOCUMENT,
             **overrides: Any) -> FeedbackResponse:
    response = client.put(f"/jobs/{job_id}/profile",
                          json={"profile": document, "model": "tiny", "dp_size": 1, "cp_size": 2, **overrides})
    assert response.status_code == 200, response.text
    return FeedbackResponse.model_validate_json(response.content)


def plan(client: TestClient, job_id: str | None = "job-1", **overrides: Any) -> PlanResponse:
    body = {"sequence_lengths": LENGTHS, "dp_size": 1, "cp_size": 2, "model": "tiny",
            **({"job_id": job_id} if job_id else {}), **overrides}
    response = client.post("/plan", json=body)
    assert response.status_code == 200, response.text
    return PlanResponse.model_validate_json(response.content)


def test_the_jobs_plans_use_the_registered_profile_as_the_embedded_planner_does(client: TestClient) -> None:
    state = register(client)
    assert (state.base_profile, state.profile, state.base_registered, state.num_observations) == (
        "trainer-tiny", "trainer-tiny", True, 0)
    embedded = make_plan(make_problem(sequence_lengths=LENGTHS, dp_size=1, cp_size=2, model="tiny",
                                      profile=parse_profile(DOCUMENT)), "skrull")
    default = plan(client, job_id=None)
    for planned in (plan(client), plan(client, profile="trainer-tiny")):  # naming no profile, or this one
        assert planned.profile == "trainer-tiny"
        assert planned.bucket_size == embedded.problem.bucket_size < default.bucket_size  # derived from its memory
        assert planned.estimated_iteration_time_ms == pytest.approx(embedded.estimate.iteration_time_s * 1e3)
        assert planned.estimated_iteration_time_ms != pytest.approx(default.estimated_iteration_time_ms)


def test_the_jobs_reports_refit_from_the_registered_profile(client: TestClient) -> None:
    register(client)
    plan(client)
    answer = client.post("/feedback", json=report(scale=1000.0))
    assert answer.status_code == 200, answer.text
    state = FeedbackResponse.model_validate_json(answer.content)
    assert (state.base_profile, state.profile, state.base_registered) == (
        "trainer-tiny", "trainer-tiny+feedback", True)
    # the refit scales the registered coefficients, not the default profile's
    assert state.compute.alpha_s_per_flop == pytest.approx(
        DOCUMENT["compute"]["alpha_s_per_flop"] * state.compute_scale)
    assert plan(client).profile == "trainer-tiny+feedback"
    assert client.get("/feedback/job-1").json() == answer.json()


def test_the_same_registration_changes_nothing_and_another_restarts_the_refit(client: TestClient) -> None:
    register(client)
    plan(client)
    refit = client.post("/feedback", json=report()).json()
    again = register(client, document=copy.deepcopy(DOCUMENT))
    assert again.model_dump(mode="json") == refit == client.get("/feedback/job-1").json()
    assert plan(client).profile == "trainer-tiny+feedback"
    slower = copy.deepcopy(DOCUMENT)
    slower["compute"]["alpha_s_per_flop"] *= 10
    restarted = register(client, document=slower)
    assert (restarted.num_observations, restarted.profile) == (0, "trainer-tiny")
    assert restarted.compute.alpha_s_per_flop == slower["compute"]["alpha_s_per_flop"]
    expected = make_plan(make_problem(sequence_lengths=LENGTHS, dp_size=1, cp_size=2, model="tiny",
                                      profile=parse_profile(slower)), "skrull")
    assert plan(client).estimated_iteration_time_ms == pytest.approx(expected.estimate.iteration_time_s * 1e3)


def test_the_registered_profile_stays_the_base_when_the_jobs_sizes_change(client: TestClient) -> None:
    register(client)
    assert plan(client, dp_size=2).profile == "trainer-tiny"  # a new shape of job, restarted from its own profile
    assert client.get("/feedback/job-1").json()["base_registered"] is True


def test_a_plan_naming_another_profile_starts_the_job_afresh(client: TestClient) -> None:
    register(client)
    assert plan(client, profile="h100-paper").profile == "h100-paper"
    state = client.get("/feedback/job-1").json()
    assert state["base_profile"] == "h100-paper" and "base_registered" not in state  # omitted: a shared profile
    assert plan(client).profile == DEFAULT_PROFILE  # the registration is gone with the job it was the base of


def test_a_registered_profile_stays_the_jobs_own() -> None:
    with TestClient(create_app(settings(feedback_max_jobs=1))) as client:
        shared = client.get("/models").json()["profiles"]
        register(client)
        assert client.get("/models").json()["profiles"] == shared
        for other in ({"job_id": None}, {"job_id": "job-2"}):  # a plan without the job, or of another job
            response = client.post("/plan", json={"sequence_lengths": LENGTHS, "dp_size": 1, "cp_size": 2,
                                                  "model": "tiny", "profile": "trainer-tiny", **other})
            assert_problem(response, 422, "profile")
        plan(client, job_id="job-2")  # the one job kept is job-2 now: job-1 is forgotten, its profile with it
        assert client.get("/feedback/job-1").status_code == 404
        assert_problem(client.post("/plan", json={"sequence_lengths": LENGTHS, "dp_size": 1, "cp_size": 2,
                                                  "model": "tiny", "profile": "trainer-tiny", "job_id": "job-1"}),
                       422, "profile")


def test_a_registered_profile_survives_a_restart_of_the_service(tmp_path: Path) -> None:
    state_url = f"sqlite://{tmp_path}/jobs.sqlite3"
    with TestClient(create_app(settings(state_url=state_url))) as first:
        register(first)
        before = plan(first)
    with TestClient(create_app(settings(state_url=state_url))) as second:
        assert second.get("/feedback/job-1").json()["base_registered"] is True
        after = plan(second)
    assert (after.profile, after.bucket_size, after.dp_ranks, after.estimated_iteration_time_ms) == (
        "trainer-tiny", before.bucket_size, before.dp_ranks, before.estimated_iteration_time_ms)


def _bad(mutate: Any) -> dict[str, Any]:
    body = {"profile": copy.deepcopy(DOCUMENT), "model": "tiny", "dp_size": 1, "cp_size": 2}
    mutate(body)
    return body


@pytest.mark.parametrize(
    ("body", "field"),
    [
        pytest.param(_bad(lambda b: b["profile"]["compute"].update(alpha_s_per_flop=-1.0)),
                     "profile.compute.alpha_s_per_flop", id="negative-alpha"),
        pytest.param(_bad(lambda b: b["profile"]["compute"].update(alpha_s_per_flop="fast")),
                     "profile.compute.alpha_s_per_flop", id="alpha-not-a-number"),
        # numbers no device has: planning with them would overflow
        pytest.param(_bad(lambda b: b["profile"]["compute"].update(alpha_s_per_flop=5e-324)),
                     "profile.compute.alpha_s_per_flop", id="denormal-alpha"),
        pytest.param(_bad(lambda b: b["profile"]["compute"].update(beta_s_per_layer=1e308)),
                     "profile.compute.beta_s_per_layer", id="absurd-beta"),
        pytest.param(_bad(lambda b: b["profile"]["memory"]["static_bytes_per_parameter"].update(replicated=-1e308)),
                     "profile.memory.static_bytes_per_parameter.replicated", id="absurd-static-memory"),
        pytest.param(_bad(lambda b: b["profile"]["communication"]["tables"].update(
            all_gather=[[5e-324, 1e308], [1e-300, 0.0]])), "profile.communication.tables.all_gather[0][0]",
            id="absurd-latency-table"),
        pytest.param(_bad(lambda b: b["profile"].pop("hardware")), "profile.hardware", id="no-hardware"),
        pytest.param(_bad(lambda b: b["profile"].update(memory=[])), "profile.memory", id="memory-not-an-object"),
        pytest.param(_bad(lambda b: b["profile"]["communication"].update(tables={"all_gather": [[1, 1e-5]]})),
                     "profile.communication.tables.all_gather", id="one-point-table"),
        pytest.param(_bad(lambda b: b["profile"].update(schema_version=2)), "profile.schema_version",
                     id="other-profile-version"),
        pytest.param(_bad(lambda b: b.update(profile="trainer-tiny")), "profile", id="a-name-not-a-document"),
        pytest.param(_bad(lambda b: b.update(model="qwen2.5-0.5b")), "profile", id="measured-for-another-model"),
        pytest.param(_bad(lambda b: b.update(model="no-such-model")), "model", id="unknown-model"),
        pytest.param(_bad(lambda b: b["profile"].update(name="h100-paper")), "profile.name",
                     id="a-shared-name-with-other-numbers"),
        pytest.param(_bad(lambda b: b.update(dp_size=0)), "dp_size", id="no-dp"),
        pytest.param(_bad(lambda b: b.pop("cp_size")), "cp_size", id="no-cp"),
        pytest.param(_bad(lambda b: b.update(job_id="job-1")), "job_id", id="unknown-field"),
    ],
)
def test_a_bad_registration_is_a_422_naming_the_field_and_changes_nothing(
    client: TestClient, body: dict[str, Any], field: str
) -> None:
    register(client)
    plan(client)
    before = client.get("/feedback/job-1").json()
    problem = assert_problem(client.put("/jobs/job-1/profile", json=body), 422, field)
    assert problem.detail
    assert client.get("/feedback/job-1").json() == before


def test_a_shared_profile_may_be_registered_with_its_own_numbers(client: TestClient) -> None:
    assert register(client, document=builtin_profiles()["h100-paper"].raw).base_profile == "h100-paper"


def test_a_job_id_the_contract_refuses_is_a_422_naming_it(client: TestClient) -> None:
    response = client.put("/jobs/-job/profile", json={"profile": DOCUMENT, "model": "tiny", "dp_size": 1,
                                                      "cp_size": 2})
    assert_problem(response, 422, "path.job_id")


def test_a_body_that_is_not_json_is_a_400_or_a_415(client: TestClient) -> None:
    assert_problem(client.put("/jobs/job-1/profile", content=b'{"profile": {', headers={
        "content-type": "application/json"}), 400, "body")
    assert_problem(client.put("/jobs/job-1/profile", content=json.dumps({"profile": DOCUMENT}).encode(), headers={
        "content-type": "text/plain"}), 415, "body")


def test_a_body_over_the_services_limit_is_a_413_and_over_a_profiles_a_422() -> None:
    padded = {**DOCUMENT, "provenance": {"notes": "x" * MAX_PROFILE_FILE_BYTES}}
    with TestClient(create_app(settings())) as client:
        problem = assert_problem(client.put("/jobs/job-1/profile", json={
            "profile": padded, "model": "tiny", "dp_size": 1, "cp_size": 2}), 422, "profile")
        assert problem.limit == MAX_PROFILE_FILE_BYTES
    with TestClient(create_app(settings(max_body_bytes=4096))) as client:
        problem = assert_problem(client.put("/jobs/job-1/profile", json={
            "profile": DOCUMENT, "model": "tiny", "dp_size": 1, "cp_size": 2}), 413, "body")
        assert problem.limit == 4096
        assert client.get("/feedback/job-1").status_code == 404  # nothing was registered


def test_registration_needs_feedback_on() -> None:
    with TestClient(create_app(settings(feedback=False))) as client:
        response = client.put("/jobs/job-1/profile", json={"profile": DOCUMENT, "model": "tiny", "dp_size": 1,
                                                           "cp_size": 2})
        assert "disabled" in assert_problem(response, 404).detail
