"""Logs people read: ``--logging-steps`` lines (loss, lr, tokens/s, plan source, epoch) with the bar on or off, no bar
where stderr is no terminal, one numbering of the steps (the logs, the metrics file, the evaluation, the trackers, the
checkpoints and ``--steps`` count them alike, from 1), the layout line's BucketSize on CPU from this host's memory,
and the job's runs named after it."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import warnings
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
    metrics = read_metrics(folder / "metrics.jsonl")
    assert [(m["step"], m["epoch"]) for m in metrics] == [(1, 0.5), (2, 1.0), (3, 1.5), (4, 2.0)]


STEPS = 3


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """3 steps of 4 records from a set of 10 (4, 4 and the 2 left: one epoch) in one process, a line every step,
    a checkpoint after every step, reported to TensorBoard; the BucketSize left to the trainer."""
    folder = tmp_path_factory.mktemp("numbers")
    result = subprocess.run(
        [sys.executable, "-m", "trainer_client.train", "--dp", "1", "--cp", "1", "--data",
         str(_records(folder / "train.jsonl", 10)), "--global-batch", "4", "--steps", str(STEPS), "--no-shuffle",
         "--no-progress", "--checkpoint-dir", str(folder / "ck"), "--checkpoint-every", "1", "--metrics-out",
         str(folder / "metrics.jsonl"), "--report-to", "tensorboard", "--logging-dir", str(folder / "tb")],
        cwd=folder, env=trainer_env(), capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    return folder, result


def _saved_steps(checkpoint: Path) -> dict[str, object]:
    """What a checkpoint says of the steps it holds (``num_steps_done``, ``data_position``), read without a model."""
    import torch.distributed.checkpoint as dcp

    state = {"train": ""}
    with warnings.catch_warnings():  # DCP warns on every load without a process group; one process is meant
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load(state, checkpoint_id=checkpoint, no_dist=True)
    saved: dict[str, object] = json.loads(state["train"])
    return saved


@pytest.mark.slow
def test_the_console_the_metrics_file_tensorboard_the_checkpoints_and_steps_give_a_loss_one_number(
    one_process: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    folder, result = one_process
    logged = [(int(m[1]), int(m[2]), float(m[3])) for m in
              re.finditer(r"INFO trainer_client\.trainer: step (\d+)/(\d+): loss ([0-9.]+)", result.stderr)]
    assert [(step, total) for step, total, _ in logged] == [(1, STEPS), (2, STEPS), (3, STEPS)]  # the last is --steps
    printed = [(int(fields[1]), float(fields[3])) for fields in map(str.split, result.stdout.splitlines())
               if fields and fields[0] == "step"]
    metrics = read_metrics(folder / "metrics.jsonl")
    events = EventAccumulator(str(folder / "tb"))
    events.Reload()
    tensorboard = [(event.step, event.value) for event in events.Scalars("train/loss")]
    for (step, _, loss), (printed_step, printed_loss), line, (event_step, event_loss) in zip(
            logged, printed, metrics, tensorboard, strict=True):
        assert step == printed_step == line["step"] == event_step
        assert loss == printed_loss == pytest.approx(line["loss"], abs=1e-6)  # the logs print 6 decimals
        assert event_loss == pytest.approx(line["loss"], rel=1e-6)  # TensorBoard keeps float32
        saved = _saved_steps(folder / "ck" / f"step-{step:08d}")  # saved after step `step`, holding it
        assert saved["num_steps_done"] == step
        position = saved["data_position"]
        assert isinstance(position, dict)
        assert position["epoch"] + position["index"] / 10 == line["epoch"]
    assert sorted(path.name for path in (folder / "ck").glob("step-*")) == [f"step-{n:08d}" for n in (1, 2, 3)]
    assert [line["epoch"] for line in metrics] == [0.4, 0.8, 1.0]  # one epoch: the last step trains the 2 left


@pytest.mark.slow
def test_on_cpu_the_derived_bucket_size_is_this_hosts_memory_not_a_gpus(
    one_process: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    import torch

    from scheduler_service.core.memory import ActivationCheckpointing, Sharding, training_profile
    from scheduler_service.core.models import MODEL_CATALOGUE
    from scheduler_service.core.perf_model import PerformanceModel
    from scheduler_service.core.profile import resolve_profile
    from trainer_client.profiler.measure import device_memory_bytes

    _, result = one_process
    match = re.search(r"layout: BucketSize (\d+) tokens per CP rank \(derived from profile h100-paper for --sharding "
                      r"zero2 in float32, from ([0-9.]+) GiB of host memory per rank\)", result.stderr)
    assert match is not None, result.stderr[-3000:]
    host_bytes = device_memory_bytes(torch.device("cpu"))  # one process: all of it
    assert float(match[2]) == round(host_bytes / 2**30, 1)
    profile = training_profile(resolve_profile("h100-paper"), MODEL_CATALOGUE["tiny"], sharding=Sharding.ZERO2,
                               compute_bytes=4, activation_checkpointing=ActivationCheckpointing.NONE)
    perf = PerformanceModel(model=MODEL_CATALOGUE["tiny"], profile=profile)
    static_bytes = perf.static_bytes(num_state_shards=1)
    expected = int((host_bytes - static_bytes - profile.memory.beta_bytes) // perf.activation_bytes_per_token)
    assert int(match[1]) == expected != perf.bucket_size(num_state_shards=1)  # the latter: the H100's 80 GB


def test_on_cpu_a_nodes_ranks_share_its_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from trainer_client.profiler.measure import device_memory_bytes, memory_per_rank_bytes

    cpu, host_bytes = torch.device("cpu"), device_memory_bytes(torch.device("cpu"))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert memory_per_rank_bytes(cpu, world_size=4) == host_bytes / 4  # one node: the whole world
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # torchrun --nnodes 2 --nproc-per-node 2
    assert memory_per_rank_bytes(cpu, world_size=4) == host_bytes / 2


def test_a_job_without_a_job_id_is_named_after_its_run_and_start() -> None:
    started = time.strftime("%Y%m%d-%H%M")
    with_checkpoints = default_job_id(model="tiny", data="synthetic:lmsys",
                                      checkpoint_dir=Path("checkpoints/qwen ultrachat"))
    assert with_checkpoints.startswith(f"qwen-ultrachat-{started}")
    bare = default_job_id(model="org/Qwen2.5-0.5B@main", data="data/chats.jsonl", checkpoint_dir=None)
    assert bare.startswith(f"Qwen2.5-0.5B-chats-{started}")
    TrainConfig(dp=1, cp=1, job_id=bare)  # a job id the contract takes
