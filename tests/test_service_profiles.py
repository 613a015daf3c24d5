"""Profiles from a folder (SKRULL_PROFILE_DIR): loaded at start-up and on request, listed, planned with."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from skrull_proto import ModelsResponse, PlanResponse

from scheduler_service.core.errors import InvalidRequestError
from scheduler_service.runtime import profiles
from scheduler_service.runtime.settings import Settings
from scheduler_service.web.app import create_app
from tests.service_inputs import measured_document
from tests.service_inputs import settings as service_settings


def settings(profile_dir: Path | None, **overrides: Any) -> Settings:
    return service_settings(profile_dir=profile_dir, **overrides)


def plan_body(**overrides: Any) -> dict[str, Any]:
    return {"sequence_lengths": [300, 1200, 80, 40], "dp_size": 1, "cp_size": 2, "model": "tiny",
            "bucket_size": 1024, **overrides}


def test_profiles_in_the_folder_are_listed_and_plan(tmp_path: Path) -> None:
    (tmp_path / "lab.json").write_text(json.dumps(measured_document()))
    with TestClient(create_app(settings(tmp_path))) as client:
        models = ModelsResponse.model_validate_json(client.get("/models").content)
        listed = {profile.name: profile for profile in models.profiles}
        assert listed["lab-tiny"].origin == "directory" and listed["lab-tiny"].model == "tiny"
        assert listed["lab-tiny"].measured_at == "2025-03-04T05:06:07+00:00"
        assert listed["h100-paper"].origin == "builtin"
        response = client.post("/plan", json=plan_body(profile="lab-tiny"))
        assert response.status_code == 200, response.text
        assert PlanResponse.model_validate_json(response.content).profile == "lab-tiny"


def test_a_profile_measured_for_another_model_is_a_422_naming_the_profile(tmp_path: Path) -> None:
    (tmp_path / "lab.json").write_text(json.dumps(measured_document()))
    with TestClient(create_app(settings(tmp_path))) as client:
        response = client.post("/plan", json=plan_body(profile="lab-tiny", model="qwen2.5-0.5b"))
    assert response.status_code == 422
    assert response.json()["field"] == "profile" and "measured for model tiny" in response.json()["detail"]


def test_a_bad_profile_folder_stops_the_start_naming_the_file(tmp_path: Path) -> None:
    (tmp_path / "broken.json").write_text('{"schema_version": 1, "name": "x"}')
    with pytest.raises(InvalidRequestError, match=r"broken\.json"), TestClient(create_app(settings(tmp_path))):
        pass
    with pytest.raises(InvalidRequestError, match="does not exist"), \
            TestClient(create_app(settings(tmp_path / "missing"))):
        pass


def test_a_folder_profile_may_not_shadow_a_shipped_one(tmp_path: Path) -> None:
    (tmp_path / "fake.json").write_text(json.dumps(measured_document(name="h100-paper", model=None)))
    with pytest.raises(InvalidRequestError, match="reuse shipped names: h100-paper"), \
            TestClient(create_app(settings(tmp_path))):
        pass


def test_profiles_added_later_are_found_on_request_and_on_reload(tmp_path: Path) -> None:
    with TestClient(create_app(settings(tmp_path))) as client:
        assert client.post("/plan", json=plan_body(profile="late")).status_code == 422
        (tmp_path / "late.json").write_text(json.dumps(measured_document(name="late")))
        response = client.post("/plan", json=plan_body(profile="late"))  # an unknown name triggers a re-read
        assert response.status_code == 200, response.text
        (tmp_path / "later.json").write_text(json.dumps(measured_document(name="later")))
        reloaded = client.post("/profiles/reload")
        assert reloaded.status_code == 200
        assert reloaded.json() == {"directory": tmp_path.name, "profiles": ["late", "later"]}


def test_a_bad_file_on_reload_is_a_422_and_the_loaded_profiles_stay(tmp_path: Path) -> None:
    (tmp_path / "good.json").write_text(json.dumps(measured_document(name="good")))
    with TestClient(create_app(settings(tmp_path))) as client:
        (tmp_path / "zz-bad.json").write_text("[]")
        response = client.post("/profiles/reload")
        assert response.status_code == 422 and "zz-bad.json" in response.json()["detail"]
        assert client.post("/plan", json=plan_body(profile="good")).status_code == 200


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        pytest.param(lambda d: d.update(hardware=[]), "hardware", id="hardware-list"),
        pytest.param(lambda d: d.update(compute=[]), "compute", id="compute-list"),
        pytest.param(lambda d: d["communication"].update(tables=[]), "communication.tables", id="tables-list"),
        pytest.param(lambda d: d["memory"].update(static_bytes_per_parameter=[]),
                     "memory.static_bytes_per_parameter", id="static-list"),
        pytest.param(lambda d: d["communication"]["tables"].update(all_gather=[[4096, 1e-5], [4096, 2e-5]]),
                     "communication.tables.all_gather", id="duplicate-sizes"),
    ],
)
def test_a_section_of_the_wrong_type_is_a_4xx_naming_the_file_not_a_500(
    tmp_path: Path, mutate: Any, field: str
) -> None:
    (tmp_path / "good.json").write_text(json.dumps(measured_document(name="good")))
    with TestClient(create_app(settings(tmp_path))) as client:
        document = measured_document(name="bad")
        mutate(document)
        (tmp_path / "zz-bad.json").write_text(json.dumps(document))
        response = client.post("/profiles/reload")
        assert response.status_code == 422, response.text
        assert response.headers["content-type"] == "application/problem+json"
        assert "zz-bad.json" in response.json()["detail"] and field in response.json()["detail"]
        assert str(tmp_path) not in response.text  # the file within the folder, never the server's path
        # while the bad file stays, plans naming a loaded profile or a not-yet-loaded one are not 500s
        assert client.post("/plan", json=plan_body(profile="good")).status_code == 200
        unknown = client.post("/plan", json=plan_body(profile="not-there-yet"))
        assert unknown.status_code == 422 and unknown.json()["field"] == "profile"


def test_an_unknown_profile_rereads_the_folder_only_when_it_changed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads: list[Path] = []
    load = profiles.load_profile_dir

    def counting_load(directory: Path) -> dict[str, Any]:
        reads.append(directory)
        return load(directory)

    monkeypatch.setattr(profiles, "load_profile_dir", counting_load)
    with TestClient(create_app(settings(tmp_path))) as client:
        assert len(reads) == 1  # the start-up
        for _ in range(3):  # unchanged folder: no re-read per request
            assert client.post("/plan", json=plan_body(profile="late")).status_code == 422
        assert len(reads) == 1
        (tmp_path / "late.json").write_text(json.dumps(measured_document(name="late")))
        assert client.post("/plan", json=plan_body(profile="late")).status_code == 200
        assert len(reads) == 2
        (tmp_path / "zz-bad.json").write_text('{"schema_version": 1, "hardware": []}')
        for _ in range(3):  # a bad file is read once, not on every request naming an unknown profile
            assert client.post("/plan", json=plan_body(profile="later")).status_code == 422
        assert len(reads) == 3
        assert client.post("/profiles/reload").status_code == 422  # an explicit reload always reads
        assert len(reads) == 4


def test_reload_without_a_folder_lists_nothing() -> None:
    with TestClient(create_app(settings(None))) as client:
        assert client.post("/profiles/reload").json() == {"directory": None, "profiles": []}


def test_jobs_can_start_from_a_folder_profile(tmp_path: Path) -> None:
    (tmp_path / "lab.json").write_text(json.dumps(measured_document()))
    with TestClient(create_app(settings(tmp_path))) as client:
        assert client.post("/plan", json=plan_body(profile="lab-tiny", job_id="j")).status_code == 200
        feedback = {"job_id": "j", "micro_batches": [
            {"local_lengths": [[300, 80], [40]], "distributed_lengths": [1200], "time_ms": 90.0}]}
        state = client.post("/feedback", json=feedback).json()
        assert state["base_profile"] == "lab-tiny" and state["profile"] == "lab-tiny+feedback"
        assert client.post("/plan", json=plan_body(profile="lab-tiny", job_id="j")).json()["profile"] == \
            "lab-tiny+feedback"
