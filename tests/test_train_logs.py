"""Logs people read: ``--logging-steps`` lines (loss, lr, tokens/s, plan source, epoch) with the bar on or off, no bar
where stderr is no terminal, one numbering of the steps (the logs, the evaluation, the trackers and the checkpoints
count them alike), and the job's runs named after it."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainer_client.components.reporting import default_job_id
from trainer_client.config import TrainConfig
from trainer_client.demo import read_metrics, trainer_env

STEP_LINE = re.compile(r"INFO trainer_client\.trainer: step (\d+)/(\d+): loss [0-9.]+, lr [0-9.e+-]+, \d+ tokens/s, "
                       r"plan embedded, epoch ([0-9.]+)")


def _records(path: Path, count: int) -> Path:
    path.write_text("".join(json.dumps({"input_ids": list(range(1, 12 + k))}) + "\n" for k in range(count)))
    return path


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """4 steps of 4 records from a set of 8 on 2 ranks, the bar on (the default) in a non-terminal, a line every 2
    steps, evaluated and checkpointed every 2, reported to TensorBoard."""
    folder = tmp_path_factory.mktemp("logs")
    result = subprocess.run(
        [sys.executable, "-m", "trainer_client.train", "--dp", "1", "--cp", "2", "--data",
         str(_records(folder / "train.jsonl", 8)), "--eval-data", str(_records(folder / "eval.jsonl", 3)),
         "--global-batch", "4", "--steps", "4", "--bucket-size", "64", "--no-shuffle", "--logging-steps", "2",
         "--eval-every", "2", "--checkpoint-dir", str(folder / "ck"), "--checkpoint-every", "2",
         "--metrics-out", str(folder / "metrics.jsonl"), "--report-to", "tensorboard",
         "--logging-dir", str(folder / "tb")],
        cwd=folder, env=trainer_env(), capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    return folder, result


@pytest.mark.slow
def test_logging_steps_log_a_line_every_n_steps_with_the_epoch(run: tuple[Path, subprocess.CompletedProcess[str]]
                                                              ) -> None:
    _, result = run
    lines = [STEP_LINE.search(line) for line in result.stderr.splitlines()]
    assert [(int(m[1]), int(m[2]), float(m[3])) for m in lines if m] == [(2, 4, 1.0), (4, 4, 2.0)]


@pytest.mark.slow
def test_no_bar_is_drawn_where_stderr_is_no_terminal(run: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    _, result = run
    assert "\r" not in result.stderr and "step/s" not in result.stderr


@pytest.mark.slow
def test_the_logs_the_trackers_and_the_checkpoints_number_the_steps_alike(
    run: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    folder, result = run
    evaluated = [int(step) for step in re.findall(r"step (\d+): eval loss", result.stderr)]
    assert evaluated == [2, 4]
    assert sorted(path.name for path in (folder / "ck").glob("step-*")) == ["step-00000002", "step-00000004"]
    assert [line.split()[1] for line in result.stdout.splitlines() if line.startswith("step ")] == ["1", "2", "3", "4"]
    events = EventAccumulator(str(folder / "tb"))
    events.Reload()
    assert [event.step for event in events.Scalars("eval/loss")] == evaluated
    assert [event.step for event in events.Scalars("train/epoch")] == [1, 2, 3, 4]
    # the metrics file keys each line by its global batch's index, the number less one
    metrics = read_metrics(folder / "metrics.jsonl")
    assert [(m["step"], m["epoch"]) for m in metrics] == [(0, 0.5), (1, 1.0), (2, 1.5), (3, 2.0)]


def test_a_job_without_a_job_id_is_named_after_its_run_and_start() -> None:
    started = time.strftime("%Y%m%d-%H%M")
    with_checkpoints = default_job_id(model="tiny", data="synthetic:lmsys",
                                      checkpoint_dir=Path("checkpoints/qwen ultrachat"))
    assert with_checkpoints.startswith(f"qwen-ultrachat-{started}")
    bare = default_job_id(model="org/Qwen2.5-0.5B@main", data="data/chats.jsonl", checkpoint_dir=None)
    assert bare.startswith(f"Qwen2.5-0.5B-chats-{started}")
    TrainConfig(dp=1, cp=1, job_id=bare)  # a job id the contract takes
