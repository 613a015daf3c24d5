"""Every error a user can cause ends the job with one ``error:`` line (and a hint where there is one), printed once,
and exit status 2: no per-rank tracebacks, no usage printed per rank, no launcher summary (``skrull-train`` /
``python -m trainer_client.train`` start the ranks themselves). ``--help`` imports no torch."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from trainer_client.demo import trainer_env
from trainer_client.models.model import model_config

LOG_RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (INFO|WARNING) trainer_client\.")


def _train(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m trainer_client.train ARGS`` as a user runs it: it starts dp × cp ranks itself."""
    return subprocess.run([sys.executable, "-m", "trainer_client.train", "--no-progress", *args], cwd=cwd,
                          env=trainer_env(), capture_output=True, text=True, timeout=300, check=False)


def _error_lines(stderr: str) -> list[str]:
    """stderr without rank 0's log records (its layout and data lines): what the user's error printed."""
    return [line for line in stderr.splitlines() if not LOG_RECORD.match(line)]


def test_help_answers_without_importing_torch() -> None:
    probe = ("import sys, contextlib, io\n"
             "from trainer_client.train import main\n"
             "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
             "    main(['--help'])\n"
             "print(sorted(name for name in ('torch', 'transformers', 'peft') if name in sys.modules))\n")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    assert result.stdout.strip() == "[]"


@pytest.mark.slow
def test_records_that_cannot_train_end_the_job_with_their_list_alone(tmp_path: Path) -> None:
    data = tmp_path / "records.jsonl"
    data.write_text("".join(json.dumps({"input_ids": list(range(1, 20))}) + "\n" for _ in range(6))
                    + json.dumps({"input_ids": list(range(300))}) + "\n")
    result = _train("--dp", "1", "--cp", "2", "--data", str(data), "--global-batch", "2", "--bucket-size", "64",
                    "--steps", "2")
    assert result.returncode == 2
    assert _error_lines(result.stderr) == [
        f"error: --data {data}: 1 of 7 records cannot train:",
        f"  longer than --max-length 128, 1 record: {data}:7 (300 tokens)",
        "hint: --truncate cuts records to --max-length; --skip-bad-records trains the other 6 and leaves these out",
    ]


@pytest.mark.slow
def test_a_model_folder_without_weights_is_named_as_such(tmp_path: Path) -> None:
    model_config("tiny").save_pretrained(tmp_path / "config-only")
    result = _train("--dp", "1", "--cp", "2", "--model", str(tmp_path / "config-only"), "--steps", "1",
                    "--bucket-size", "128")
    assert result.returncode == 2
    (line,) = _error_lines(result.stderr)
    assert line.startswith(f"error: --model {tmp_path / 'config-only'}: the folder {tmp_path / 'config-only'} holds "
                           "no weights, only config.json; a model folder holds one of model.safetensors")


def test_a_usage_error_is_one_line_and_a_hint() -> None:
    result = _train("--dp", "1", "--cp", "2", "--bogus", "3")
    assert result.returncode == 2
    assert result.stderr.splitlines() == ["error: unrecognized arguments: --bogus 3",
                                          "hint: python -m trainer_client.train --help lists the flags"]


def test_a_config_error_is_one_line_before_any_rank_starts(tmp_path: Path) -> None:
    run = tmp_path / "run.yaml"
    run.write_text("dp: 2\ncp: 2\nlora_rank: 0\n")
    result = _train("--config", str(run))
    assert result.returncode == 2
    assert result.stderr.splitlines() == [f"error: {run}: lora_rank: must be positive, got 0"]


@pytest.mark.slow
def test_under_torchrun_the_usage_error_is_printed_by_rank_0_alone() -> None:
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             "-m", "trainer_client.train", "--dp", "1", "--cp", "2", "--bogus", "3"],
                            env=trainer_env(), capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode != 0
    assert result.stderr.count("error: unrecognized arguments: --bogus 3") == 1
    assert "usage:" not in result.stderr


@pytest.mark.slow
def test_with_debug_a_user_error_shows_its_traceback(tmp_path: Path) -> None:
    data = tmp_path / "records.jsonl"
    data.write_text(json.dumps({"input_ids": [1]}) + "\n")
    result = _train("--dp", "1", "--cp", "1", "--data", str(data), "--global-batch", "1", "--bucket-size", "64",
                    "--debug")
    assert result.returncode == 2
    assert "Traceback (most recent call last):" in result.stderr
    assert result.stderr.count(f"error: --data {data}: 1 of 1 records cannot train:") == 1
