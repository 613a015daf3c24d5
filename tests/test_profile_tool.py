"""The profiler (``python -m trainer_client.profile``): a short sweep on this machine gives a profile file with
provenance that the service and the CLI accept; under two gloo ranks it adds collectives and the shard effect."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from fastapi.testclient import TestClient
from skrull_proto import PlanResponse

from scheduler_service import cli
from scheduler_service.app import create_app
from scheduler_service.core.models import MODEL_CATALOGUE
from scheduler_service.core.perf_model import PerformanceModel
from scheduler_service.core.plan import make_problem
from scheduler_service.core.planner import make_plan
from scheduler_service.core.profile import load_profile, parse_profile
from scheduler_service.settings import Settings
from trainer_client import profile as profiler
from trainer_client.distributed import spawn_gloo
from trainer_client.plan_client import PlanSource

# Small and quick: a few seconds on 2 cores. The numbers are whatever this machine measures; tests check shape.
QUICK = ["--model", "tiny", "--sizes", "32,64,128", "--short-length", "16", "--memory-sizes", "32,96",
         "--repeats", "1", "--warmup", "0", "--threads", "1", "--no-progress"]


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("profile") / "cpu-tiny-test.json"
    assert profiler.main([*QUICK, "--out", str(out), "--name", "cpu-tiny-test"]) == 0
    return out


def test_profiler_writes_a_profile_with_fits_and_provenance(measured: Path) -> None:
    document = json.loads(measured.read_text())
    profile = load_profile(measured)
    assert (profile.name, profile.model) == ("cpu-tiny-test", "tiny")
    assert profile.compute.alpha_s_per_flop > 0 and profile.memory.activation_fixed_bytes_per_token > 0
    fits = document["compute"]["fit"]
    assert set(fits) == {"extended", "paper_eq14"}
    assert fits["extended"]["median_relative_error"] >= 0
    assert len(document["compute"]["points"]) == len(profiler.compute_cases((32, 64, 128), 16))
    provenance = document["provenance"]
    assert provenance["model"]["hidden_size"] == MODEL_CATALOGUE["tiny"].hidden_size
    assert provenance["software"]["torch"] and provenance["hardware"]["cpu_count"] >= 1
    assert provenance["date"].startswith("20") and provenance["world_size"] == 1
    assert document["communication"]["tables"] == {}  # one process measures no collective
    # static memory is measured tensor by tensor: fp32 weights + gradients + two AdamW states = 16 B/parameter
    assert document["memory"]["static_bytes_per_parameter"]["replicated"] == pytest.approx(16, rel=0.01)
    perf = PerformanceModel(model=MODEL_CATALOGUE["tiny"], profile=profile)
    assert perf.bucket_size(1) > 0


def test_measured_profile_is_accepted_by_the_service_and_the_cli(
    measured: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "profiles"
    folder.mkdir()
    shutil.copy(measured, folder / measured.name)
    request = {"sequence_lengths": [300, 1200, 80, 40, 700], "dp_size": 1, "cp_size": 1, "model": "tiny",
               "profile": "cpu-tiny-test"}
    settings = Settings(cpsat_warmup=False, warmup=False, access_log=False, profile_dir=folder)
    with TestClient(create_app(settings)) as client:
        assert "cpu-tiny-test" in [p["name"] for p in client.get("/models").json()["profiles"]]
        response = client.post("/plan", json=request)
    assert response.status_code == 200, response.text
    served = PlanResponse.model_validate_json(response.content)
    assert served.profile == "cpu-tiny-test" and served.bucket_size > 1200  # derived from the measured memory

    request_file = tmp_path / "request.json"
    request_file.write_text(json.dumps({key: value for key, value in request.items() if key != "profile"}))
    assert cli.main(["plan", str(request_file), "--profile-file", str(measured)]) == 0
    planned = PlanResponse.model_validate_json(capsys.readouterr().out)
    assert planned.profile == "cpu-tiny-test"
    assert planned.estimated_iteration_time_ms == pytest.approx(served.estimated_iteration_time_ms)


def test_compute_sweep_mixes_long_short_tiny_and_mixed_sequences() -> None:
    cases = dict(profiler.compute_cases((64, 512), 128))
    assert cases["long-512"] == (512,)
    assert cases["short-512"] == (128,) * 4
    assert cases["tiny-512"] == (32,) * 16
    assert cases["mixed-512"] == (256, 128, 128)
    assert cases["short-64"] == (32, 32)
    assert all(sum(lengths) <= int(name.split("-")[1]) for name, lengths in cases.items())


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        pytest.param(["--sizes", "64"], "at least 2 sizes", id="one-size"),
        pytest.param(["--sizes", "0,64"], "must be positive", id="zero-size"),
        pytest.param(["--repeats", "0"], "--repeats", id="no-repeats"),
        pytest.param(["--threads", "0"], "--threads", id="no-threads"),
        pytest.param(["--model", "gpt-17"], "gpt-17", id="unknown-model"),
    ],
)
def test_profiler_rejects_bad_options_with_exit_2(
    arguments: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert profiler.main([*QUICK, "--out", str(tmp_path / "p.json"), *arguments]) == profiler.EXIT_USER_ERROR
    assert message in capsys.readouterr().err
    assert not (tmp_path / "p.json").exists()


def _profile_two_ranks(out_path: Path) -> None:
    options = profiler.ProfileOptions(model="tiny", sizes=(32, 64), short_length=16, memory_sizes=(32, 64),
                                      comm_sizes=(1024, 8192), shard_sizes=(64,), repeats=1, warmup=0,
                                      progress=False)
    document = profiler.measure_profile(options)
    if dist.get_rank() == 0:
        assert document is not None
        out_path.write_text(json.dumps(document))
    else:
        assert document is None


@pytest.mark.slow
def test_two_ranks_measure_collectives_and_the_shard_effect(tmp_path: Path) -> None:
    out_path = tmp_path / "two-ranks.json"
    spawn_gloo(_profile_two_ranks, 2, out_path)
    document: dict[str, Any] = json.loads(out_path.read_text())
    tables = document["communication"]["tables"]
    assert set(tables) == {"all_gather", "reduce_scatter", "all_to_all"}
    assert all(len(table) == 2 and all(latency > 0 for _, latency in table) for table in tables.values())
    assert document["communication"]["world_size"] == 2 and document["communication"]["fit"] == "relative"
    (shard,) = document["compute"]["shard_effect"]
    assert shard["num_tokens"] == 64 and shard["cp_size"] == 2
    assert shard["whole_s"] > 0 and shard["shard_s"] > 0 and shard["predicted_shard_s"] > 0
    perf = PerformanceModel(model=MODEL_CATALOGUE["tiny"], profile=parse_profile(document))
    assert perf.comm_time_s(64) > 0  # distributed sequences now pay for their collectives


def test_trainer_plans_with_a_profile_file_and_asks_the_service_for_it_by_name(measured: Path) -> None:
    profile = load_profile(measured)
    source = PlanSource(scheduler="skrull", dp_size=1, cp_size=1, model="tiny", bucket_size=1024, profile=profile)
    lengths = [300, 1000, 80, 40, 700]
    decision = source.decide(0, lengths)
    expected = make_plan(make_problem(sequence_lengths=lengths, dp_size=1, cp_size=1, model="tiny",
                                      bucket_size=1024, profile=profile), "skrull")
    assert decision.plan == expected.plan
    assert decision.estimated_time_ms == pytest.approx(expected.estimate.iteration_time_s * 1e3)
    assert source._request(lengths).profile == "cpu-tiny-test"
    source.close()
