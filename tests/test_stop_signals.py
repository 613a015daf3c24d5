"""A signal stops a run where it can resume. SIGINT (a terminal's Ctrl-C) or SIGTERM (a cluster's preemption), to the
launcher or to one rank, stops every rank at the end of the step in flight with a checkpoint there, exit status 128 +
the signal, and one line from rank 0 naming the checkpoint and the command that resumes it; a save in progress
completes first; a second Ctrl-C abandons the step and its save, and the line names the checkpoint before it. Each
resume trains the uninterrupted run's losses, bit for bit (fp32, CPU). ``SkrullTrainer`` saves and stops the same way.
torchrun's SIGTERM to the ranks a failure left is no stop: they exit at once.

Real processes where a launcher is under test: ``python -m trainer_client.train`` (torchrun's agent in-process) and
torchrun, 2 gloo ranks. Where the signal must land in a save, torchrun's ranks run a script (``_HELD_SAVE``) that holds
the save of step 2 for 3 s, and the test signals once it has begun. A signal to one rank alone, the resumes
and the Hugging Face Trainer run in gloo ranks forked from the test process (``spawn_gloo``).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from tests.hf_runs import PaddingCollator, batches, dataset, fresh_accelerate_state, records, training_arguments
from trainer_client.components.checkpoint import is_complete, latest_checkpoint, step_dir
from trainer_client.components.stop import (
    TrainingStopped,
    abandoned,
    graceful_stops,
    received_signal,
    stop_signals,
)
from trainer_client.demo import read_metrics, trainer_env
from trainer_client.distributed import ParallelDims, init_parallel, spawn_gloo
from trainer_client.train import build_parser, config_from_args
from trainer_client.trainer import Trainer

STEPS = 6
FLAGS = ["--dp", "2", "--cp", "1", "--model", "tiny", "--data", "synthetic:lmsys", "--global-batch", "16",
         "--steps", str(STEPS), "--bucket-size", "1024", "--warmup-steps", "1", "--no-progress"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
MAX_RANK_LINES = 5  # of stderr from the ranks, beside rank 0's log records
LOG_RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (INFO|WARNING) trainer_client\.")
AGENT_RECORD = re.compile(r"^[IWE]\d{4} \d\d:\d\d:\d\d\.\d+ \d+ torch/distributed/")  # torchrun's own log
# The ranks' script: trainer_client.train, with the write of step 2's checkpoint held (each rank marks its start).
_HELD_SAVE = """
import os, sys, time
from pathlib import Path
from torch.distributed.checkpoint import FileSystemWriter
from trainer_client import train

write_data = FileSystemWriter.write_data

def held(writer, plan, planner):
    if Path(writer.path).name == "step-00000002":
        Path(f"saving-{os.environ['RANK']}").touch()
        time.sleep(3)
    return write_data(writer, plan, planner)

FileSystemWriter.write_data = held
sys.exit(train.main(recorded=True))
"""


def _config(flags: list[str]) -> Any:
    return config_from_args(build_parser().parse_args(flags))


def _train(out: Path, flags: list[str]) -> None:
    """One rank: train as ``flags`` say, in ``out`` (relative paths are the command's)."""
    os.chdir(out)
    config = _config(flags)
    trainer = Trainer(config, init_parallel(ParallelDims.of(config)))
    try:
        trainer.train()
    finally:
        trainer.close()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    out = tmp_path_factory.mktemp("uninterrupted")
    spawn_gloo(_train, 2, out, [*FLAGS, "--metrics-out", "metrics.jsonl"])
    return [float(m["loss"]) for m in read_metrics(out / "metrics.jsonl")]  # type: ignore[arg-type]


def _started(command: list[str], cwd: Path) -> subprocess.Popen[str]:
    # A session of its own, as a shell gives a foreground job: the test signals its process group as a terminal does.
    return subprocess.Popen(command, cwd=cwd, env=trainer_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def _wait_for(job: subprocess.Popen[str], ready: Any, timeout_s: float = 240.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        assert job.poll() is None and time.monotonic() < deadline, job.communicate()[1][-3000:]
        time.sleep(0.02)


def _ended(job: subprocess.Popen[str]) -> tuple[str, str]:
    try:
        return job.communicate(timeout=240)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)


def _ranks_lines(stderr: str) -> list[str]:
    """What the ranks printed on stderr beside rank 0's log records: before torchrun's agent's traceback of the
    signal (the last thing it prints), without its log records."""
    ranks = stderr.split("Traceback (most recent call last):\n")[0] if "SignalException" in stderr else stderr
    return [line for line in ranks.splitlines() if not LOG_RECORD.match(line) and not AGENT_RECORD.match(line)]


def _resumed_losses(out: Path, line: str) -> list[float]:
    """Resume in ``out`` with the flags of the command ``line`` names; every step's loss in its metrics file."""
    command = shlex.split(line.split("resume with: ")[1])
    flags = command[command.index("trainer_client.train") + 1:]
    spawn_gloo(_train, 2, out, flags)
    return [float(m["loss"]) for m in read_metrics(out / "metrics.jsonl")]  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------------ the handler


def test_a_second_sigterm_waits_for_the_step_boundary_and_a_ctrl_c_after_it_abandons_the_step() -> None:
    with stop_signals(), graceful_stops():
        signal.raise_signal(signal.SIGTERM)
        signal.raise_signal(signal.SIGTERM)  # SLURM signals every process, and torchrun forwards its own copy
        assert (received_signal(), abandoned()) == (signal.SIGTERM, None)
        with pytest.raises(TrainingStopped) as stopped:
            signal.raise_signal(signal.SIGINT)
    assert (stopped.value.exit_status, stopped.value.abandoned, stopped.value.how()) == (
        128 + signal.SIGTERM, True, "SIGTERM, then SIGINT")


def test_outside_the_training_loop_a_signal_exits_at_once() -> None:
    previous = signal.getsignal(signal.SIGINT)
    with stop_signals(), pytest.raises(SystemExit) as stopped:
        signal.raise_signal(signal.SIGINT)
    assert stopped.value.code == 128 + signal.SIGINT and not isinstance(stopped.value, TrainingStopped)
    assert signal.getsignal(signal.SIGINT) is previous


def _sigterm_after_a_reported_failure(out: Path) -> None:
    from trainer_client.distributed import report_failure

    report_failure(RuntimeError("rank 1 crashed"))  # as a failing rank does before torchrun stops the others
    outcome = "trained on"
    try:
        with stop_signals(), graceful_stops():
            signal.raise_signal(signal.SIGTERM)
    except SystemExit as exited:
        outcome = f"{type(exited).__name__} {exited.code}, received {received_signal()}"
    (out / "outcome.txt").write_text(outcome)


@pytest.mark.slow  # one forked rank
def test_torchruns_sigterm_after_a_peer_failed_exits_at_once_even_in_the_training_loop(tmp_path: Path) -> None:
    spawn_gloo(_sigterm_after_a_reported_failure, 1, tmp_path)
    assert (tmp_path / "outcome.txt").read_text() == f"SystemExit {128 + signal.SIGTERM}, received None"


# ------------------------------------------------------------------------------------------------ launchers


@pytest.mark.slow
def test_ctrl_c_stops_skrull_train_after_the_step_with_its_checkpoint_and_one_line(
    tmp_path: Path, uninterrupted: list[float]
) -> None:
    flags = [*FLAGS, "--checkpoint-dir", "ck", "--checkpoint-every", "4", "--metrics-out", "metrics.jsonl"]
    job = _started([sys.executable, "-m", "trainer_client.train", *flags], tmp_path)
    metrics = tmp_path / "metrics.jsonl"
    _wait_for(job, lambda: metrics.exists() and len(read_metrics(metrics)) >= 2)
    os.killpg(job.pid, signal.SIGINT)  # Ctrl-C: the launcher alone, as torchrun starts each rank in its own session
    _, stderr = _ended(job)
    assert job.returncode == 128 + signal.SIGINT, stderr[-3000:]
    (line,) = [line for line in stderr.splitlines() if line.startswith("stopped by")]
    stop = re.fullmatch(r"stopped by SIGINT after step (\d) of 6: saved (\S+); resume with: (.*)", line)
    assert stop is not None, line
    step = int(stop[1])  # the step in flight: 2 or 3 (a loaded machine can be a step slower to deliver the signal)
    assert 2 <= step < STEPS and stop[2] == str(step_dir(Path("ck"), step))
    assert is_complete(tmp_path / stop[2])
    assert stop[3] == shlex.join(["python", "-m", "trainer_client.train", *flags, "--resume"])
    assert _ranks_lines(stderr) == [line]  # no traceback, of a rank or of the launcher
    assert len(read_metrics(metrics)) == step
    assert _resumed_losses(tmp_path, line) == uninterrupted


def _torchrun_with_held_saves(tmp_path: Path) -> tuple[subprocess.Popen[str], list[str]]:
    """torchrun training with a checkpoint every step, each save held (``_HELD_SAVE``); the job and its flags."""
    (tmp_path / "held_save.py").write_text(_HELD_SAVE)
    flags = [*FLAGS, "--checkpoint-dir", "ck", "--checkpoint-every", "1", "--metrics-out", "metrics.jsonl"]
    return _started([*TORCHRUN, "held_save.py", *flags], tmp_path), flags


@pytest.mark.slow
def test_sigterm_to_torchrun_during_a_save_lets_it_complete_and_stops_after_that_step(
    tmp_path: Path, uninterrupted: list[float]
) -> None:
    job, flags = _torchrun_with_held_saves(tmp_path)
    _wait_for(job, lambda: (tmp_path / "saving-0").exists())
    job.send_signal(signal.SIGTERM)  # Kubernetes: the container's first process alone
    _, stderr = _ended(job)
    # torchrun's agent sends the ranks SIGTERM, waits for them, then raises the signal as an exception: status 1
    assert job.returncode == 1, stderr[-3000:]
    assert stderr.endswith("torch.distributed.elastic.multiprocessing.api.SignalException: Process "
                           f"{job.pid} got signal: 15\n")
    resume = shlex.join(["torchrun", "--standalone", "--nproc-per-node", "2", "-m", "trainer_client.train", *flags,
                         "--resume"])
    line = f"stopped by SIGTERM after step 2 of 6: saved ck/step-00000002; resume with: {resume}"
    assert _ranks_lines(stderr) == [line]
    assert latest_checkpoint(tmp_path / "ck") == tmp_path / "ck" / "step-00000002"
    assert _resumed_losses(tmp_path, line) == uninterrupted


@pytest.mark.slow
def test_ctrl_c_twice_during_a_save_abandons_it_and_the_resume_takes_the_checkpoint_before(
    tmp_path: Path, uninterrupted: list[float]
) -> None:
    job, _ = _torchrun_with_held_saves(tmp_path)
    _wait_for(job, lambda: (tmp_path / "saving-0").exists() and (tmp_path / "saving-1").exists())
    os.killpg(job.pid, signal.SIGINT)
    time.sleep(1)  # a person's second press; the agent, waiting for the ranks, sends them SIGTERM on it
    os.killpg(job.pid, signal.SIGINT)
    _, stderr = _ended(job)
    assert job.returncode == 1, stderr[-3000:]  # torchrun's own, as above
    (line,) = [line for line in _ranks_lines(stderr)]
    assert line.startswith("stopped by SIGINT, then SIGTERM during step 2 of 6: the step was abandoned; the save of "
                           "ck/step-00000002 was cut short (it has no complete marker); --resume takes "
                           "ck/step-00000001; resume with: torchrun "), line
    assert not is_complete(tmp_path / "ck" / "step-00000002")
    assert _resumed_losses(tmp_path, line) == uninterrupted


# ------------------------------------------------------------------------------------------------ one rank


def _signalled_alone(out: Path) -> None:
    """Rank 1 alone gets SIGTERM in step 2; rank 0 too must stop after it."""
    os.chdir(out)
    config = _config([*FLAGS, "--checkpoint-dir", "ck", "--checkpoint-every", "4"])
    trainer = Trainer(config, init_parallel(ParallelDims.of(config)))
    train_step = trainer.train_step

    def signalled(step: int, batch: Any) -> Any:
        if (step, dist.get_rank()) == (1, 1):
            os.kill(os.getpid(), signal.SIGTERM)
        return train_step(step, batch)

    trainer.train_step = signalled  # type: ignore[method-assign]
    outcome: dict[str, Any] = {}
    try:
        trainer.train()
    except TrainingStopped as stopped:
        outcome = {"status": stopped.exit_status, "checkpoint": str(stopped.checkpoint),
                   "steps done": trainer.num_steps_done}
    finally:
        trainer.close()
    (out / f"outcome-{dist.get_rank()}.json").write_text(json.dumps(outcome))


@pytest.mark.slow
def test_a_signal_to_one_rank_stops_every_rank_after_the_same_step(tmp_path: Path) -> None:
    spawn_gloo(_signalled_alone, 2, tmp_path)
    expected = {"status": 128 + signal.SIGTERM, "checkpoint": "ck/step-00000002", "steps done": 2}
    assert [json.loads((tmp_path / f"outcome-{rank}.json").read_text()) for rank in (0, 1)] == [expected] * 2
    assert is_complete(tmp_path / "ck" / "step-00000002")


# ------------------------------------------------------------------------------------------------ SkrullTrainer


def _hf_stopped_and_resumed(out: Path) -> None:
    """SkrullTrainer, DP 2: four steps whole; rank 1 alone gets SIGTERM in step 2 of the same run; that run resumed."""
    from transformers import TrainerCallback

    from trainer_client.hf import SkrullArguments, SkrullTrainer
    from trainer_client.models.model import build_model

    class SignalInStep2(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if (state.global_step, dist.get_rank()) == (1, 1):
                os.kill(os.getpid(), signal.SIGTERM)

    rows = records(batches(num_steps=4, global_batch=8, max_length=256, seed=0))
    outcome: dict[str, Any] = {"logged": []}
    logged = logging.getLogger("trainer_client.hf")
    logged.addHandler(logging.Handler())
    logged.handlers[-1].emit = lambda record: outcome["logged"].append(record.getMessage())  # type: ignore[method-assign]
    for name, callbacks, resume in (("whole", [], None), ("stopped", [SignalInStep2()], None),
                                    ("resumed", [], True)):
        fresh_accelerate_state()
        folder = out / ("whole" if name == "whole" else "stopped")
        args = training_arguments(folder, per_device_train_batch_size=8, max_steps=4, save_strategy="steps",
                                  save_steps=100)
        trainer = SkrullTrainer(model=build_model("tiny", attn_implementation="sdpa", seed=0), args=args,
                                train_dataset=dataset(rows), data_collator=PaddingCollator(), callbacks=callbacks,
                                skrull=SkrullArguments(bucket_size=128, profile="h100-paper"))
        try:
            trainer.train(resume_from_checkpoint=resume)
        except TrainingStopped as stopped:
            outcome[f"{name} stop"] = [stopped.exit_status, str(stopped.checkpoint.relative_to(out))
                                       if stopped.checkpoint is not None else None, trainer.state.global_step]
        outcome[name] = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    (out / f"outcome-{dist.get_rank()}.json").write_text(json.dumps(outcome))


@pytest.mark.slow
def test_skrull_trainer_saves_at_the_step_a_signal_came_in_stops_and_resumes_from_it(tmp_path: Path) -> None:
    spawn_gloo(_hf_stopped_and_resumed, 2, tmp_path)
    outcomes = [json.loads((tmp_path / f"outcome-{rank}.json").read_text()) for rank in (0, 1)]
    checkpoint = tmp_path / "stopped" / "checkpoint-2"
    for rank, outcome in enumerate(outcomes):
        assert outcome["stopped stop"] == [128 + signal.SIGTERM, "stopped/checkpoint-2", 2]
        assert outcome["stopped"] == outcome["whole"][:2]
        assert outcome["resumed"] == outcome["whole"]  # steps 1 and 2 come with the checkpoint's log
        assert [message for message in outcome["logged"] if message.startswith("stopped by")] == (
            [f"stopped by SIGTERM after step 2 of 4: saved {checkpoint}; resume with "
             f"trainer.train(resume_from_checkpoint=True), which takes {checkpoint}"] if rank == 0 else [])
    # the stop's, and the resumed run's after its last step (the Trainer saves the last step)
    assert sorted(path.name for path in checkpoint.parent.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]

