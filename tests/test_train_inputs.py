"""Bad inputs to the trainer CLI: each a clear message and the documented behaviour (torchrun, CPU)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from scheduler_service.core.memory import ActivationCheckpointing, Sharding
from scheduler_service.core.plan import SchedulerName
from trainer_client.config import TrainConfig
from trainer_client.dacp.kernels import AttentionBackend
from trainer_client.demo import read_metrics, trainer_env
from trainer_client.distributed import free_port
from trainer_client.train import main


def _torchrun(nproc: int, *args: str, timeout_s: float = 180) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               "-m", "trainer_client.train", "--model", "tiny", "--no-progress", *args]
    return subprocess.run(command, env=trainer_env(), capture_output=True, text=True, timeout=timeout_s, check=False)


@pytest.mark.slow
def test_rejects_world_size_different_from_dp_times_cp() -> None:
    result = _torchrun(2, "--dp", "2", "--cp", "2", "--steps", "1")
    assert result.returncode != 0
    assert "error: world size 2 != dp 2 × cp 2 = 4; launch with torchrun --nproc-per-node 4" in result.stderr
    assert result.stderr.count("error: world size") == 1  # rank 0 reports, the others exit quietly


@pytest.mark.slow
def test_rejects_record_longer_than_max_length_naming_the_record(tmp_path: Path) -> None:
    data = tmp_path / "records.jsonl"
    data.write_text(json.dumps({"input_ids": [1, 2, 3]}) + "\n" + json.dumps({"input_ids": list(range(40))}) + "\n")
    result = _torchrun(1, "--dp", "1", "--cp", "1", "--data", str(data), "--global-batch", "2",
                       "--bucket-size", "32", "--steps", "1")
    assert result.returncode != 0
    assert f"error: --data {data}: 1 of 2 records cannot train:\n" in result.stderr
    assert f"  longer than --max-length 32, 1 record: {data}:2 (40 tokens)\n" in result.stderr
    assert "hint: --truncate cuts records to --max-length; --skip-bad-records trains the other 1" in result.stderr


@pytest.mark.slow
def test_unreachable_service_at_start_up_trains_with_embedded_plans(tmp_path: Path) -> None:
    metrics_out = tmp_path / "metrics.jsonl"
    result = _torchrun(1, "--dp", "1", "--cp", "1", "--steps", "2", "--global-batch", "4", "--bucket-size", "2048",
                       "--scheduler-url", f"http://127.0.0.1:{free_port()}", "--plan-attempts", "1",
                       "--metrics-out", str(metrics_out))
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr.count("is unreachable or not ready at start-up; planning with the embedded core") == 1
    metrics = read_metrics(metrics_out)
    assert [m["plan_source"] for m in metrics] == ["embedded", "embedded"]
    assert metrics[-1]["plan_fallbacks"] == 2


@pytest.mark.slow
def test_a_max_length_no_plan_holds_stops_every_rank_before_step_0() -> None:
    # max-length above bucket_size × cp × dp (the world): some batch would draw a sequence no plan holds.
    result = _torchrun(2, "--dp", "2", "--cp", "1", "--steps", "3", "--data", "synthetic:chatqa2",
                       "--bucket-size", "64", "--max-length", "100000")
    assert result.returncode != 0
    assert ("error: --max-length 100000: synthetic:chatqa2 draws sequences up to that long, and a plan of this layout "
            "holds at most 128 tokens (bucket size 64 × cp 1 × dp 2); give --max-length 128 or less, or a larger "
            "--bucket-size") in result.stderr


@pytest.mark.parametrize("job_id", ["has a space", "", "-leading-dash", "x" * 129, "ünïcode"])
def test_rejects_job_id_the_contract_refuses_before_any_work(
    job_id: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ValueError, match=r"--job-id .* is not a valid job id"):
        TrainConfig(dp=1, cp=1, scheduler_url="http://127.0.0.1:1", feedback=True, job_id=job_id)
    # the CLI: exit status 2 and one message, before any process group or model is set up
    assert main(["--dp", "1", "--cp", "1", "--scheduler-url", "http://127.0.0.1:1", "--feedback",
                 f"--job-id={job_id}"]) == 2
    assert "error: --job-id" in capsys.readouterr().err
    assert not dist.is_initialized()


def test_accepts_job_ids_of_the_contract() -> None:
    for job_id in ("e2e-job", "A1.b_c:d-e", "x" * 128):
        assert TrainConfig(dp=1, cp=1, job_id=job_id).job_id == job_id


def test_epochs_need_records_and_exclude_steps(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match=r"--epochs needs records \(a data file, a dataset folder or a Hub data "
                                         r"set\); --data synthetic:lmsys has no end"):
        TrainConfig(dp=1, cp=1, data="synthetic:lmsys", epochs=2)
    with pytest.raises(ValueError, match=r"--epochs must be positive, got 0"):
        TrainConfig(dp=1, cp=1, data="records.jsonl", epochs=0)
    with pytest.raises(SystemExit):
        main(["--dp", "1", "--cp", "1", "--data", "records.jsonl", "--epochs", "2", "--steps", "3"])
    assert "argument --steps: not allowed with argument --epochs" in capsys.readouterr().err


@pytest.mark.slow
def test_two_epochs_of_a_jsonl_file_train_every_record_twice(tmp_path: Path) -> None:
    data = tmp_path / "records.jsonl"
    data.write_text("".join(json.dumps({"input_ids": list(range(1, 20 + k))}) + "\n" for k in range(7)))
    metrics_out = tmp_path / "metrics.jsonl"
    result = _torchrun(2, "--dp", "1", "--cp", "2", "--data", str(data), "--epochs", "2", "--global-batch", "4",
                       "--bucket-size", "64", "--metrics-out", str(metrics_out))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "2 epochs of 7 records in global batches of 4: 4 steps, each epoch's last of 3 records" in result.stderr
    steps = read_metrics(metrics_out)
    assert [(m["step"], m["epoch"]) for m in steps] == [(1, 4 / 7), (2, 1.0), (3, 1 + 4 / 7), (4, 2.0)]


def test_closed_set_flags_hold_their_enums_and_an_unknown_value_names_the_flag_and_the_choices() -> None:
    config = TrainConfig(dp=1, cp=1, scheduler="deepspeed", sharding="zero3", activation_checkpointing="full",
                         attention_backend="sdpa")
    assert (config.scheduler, config.sharding, config.activation_checkpointing, config.attention_backend) == (
        SchedulerName.DEEPSPEED, Sharding.ZERO3, ActivationCheckpointing.FULL, AttentionBackend.SDPA)
    assert isinstance(config.sharding, Sharding)
    with pytest.raises(ValueError, match=r"--sharding 'zero4' is unknown; known: zero2, zero3, none"):
        TrainConfig(dp=1, cp=1, sharding="zero4")
    with pytest.raises(ValueError, match=r"--export-lora 'both' is unknown; known: merged, adapter"):
        TrainConfig(dp=1, cp=1, export_lora="both")


@pytest.mark.slow
def test_bfloat16_on_the_cpu_trains_with_a_warning_saying_what_it_means() -> None:
    result = _torchrun(1, "--dp", "1", "--cp", "1", "--steps", "1", "--global-batch", "2", "--bucket-size", "256",
                       "--dtype", "bfloat16")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr.count("--dtype bfloat16 on the CPU: the model computes in bfloat16 there, which most CPUs run "
                               "slower than float32 and no CPU test checks; float32 is the CPU's default") == 1
