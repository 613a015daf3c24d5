"""A run killed at any step, or while it saved, resumes from its newest complete checkpoint and trains the batches
it had not, bit for bit (fp32, CPU); a checkpoint written in the background equals one written in the step; only
the newest checkpoints are kept; every checkpoint records the run that wrote it, and a resume of another run stops
before it trains."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.multiprocessing import ProcessExitedException

from trainer_client.components.checkpoint import (
    COMPLETE,
    LEGACY_LATEST,
    Checkpointer,
    TrainState,
    _retire_legacy_latest,
    is_complete,
    latest_checkpoint,
    load_model_weights,
    prune_checkpoints,
    saved_run_identity,
    step_dir,
)
from trainer_client.components.optim import LRSchedulerName, lr_factors
from trainer_client.components.run_identity import RunIdentity
from trainer_client.config import TrainConfig
from trainer_client.data import DataIdentity
from trainer_client.demo import read_metrics, trainer_env
from trainer_client.distributed import ParallelDims, init_parallel, spawn_gloo
from trainer_client.train import build_parser, config_from_args
from trainer_client.trainer import Trainer

DP, CP, STEPS, GLOBAL_BATCH, BUCKET_SIZE = 2, 2, 3, 8, 512


def _config(**changes: object) -> TrainConfig:
    base: dict[str, object] = dict(dp=DP, cp=CP, model="tiny", data="synthetic:lmsys", global_batch=GLOBAL_BATCH,
                                   steps=STEPS, bucket_size=BUCKET_SIZE, seed=0, progress=False, warmup_steps=1)
    return TrainConfig(**{**base, **changes})  # type: ignore[arg-type]


def _train(config: TrainConfig) -> list[float]:
    trainer = Trainer(config, init_parallel(ParallelDims.of(config)))
    try:
        return [m.loss for m in trainer.train()]
    finally:
        trainer.close()


def _torchrun(checkpoints: Path, metrics_out: Path, *flags: str, max_restarts: int = 0) -> list[str]:
    """The command a user resumes the fixture's run with (``--resume``), ``flags`` added."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(DP * CP),
            "--max-restarts", str(max_restarts), "-m", "trainer_client.train", "--dp", str(DP), "--cp", str(CP),
            "--model", "tiny", "--data", "synthetic:lmsys", "--global-batch", str(GLOBAL_BATCH),
            "--steps", str(STEPS), "--bucket-size", str(BUCKET_SIZE), "--warmup-steps", "1",
            "--checkpoint-dir", str(checkpoints), "--resume", "--metrics-out", str(metrics_out), "--no-progress",
            *flags]


def _killed_while_completing_its_last_checkpoint(out_dir: Path, sharding: str) -> None:
    """The uninterrupted run, an async checkpoint after every step, two kept. Rank 0 is killed (SIGKILL) once DCP
    has written the last checkpoint and before it is marked complete, as a job killed while saving is."""
    complete = Checkpointer._complete

    def killed_at_the_last(checkpointer: Checkpointer, path: Path, identity: RunIdentity) -> None:
        if path.name == step_dir(path.parent, STEPS).name and dist.get_rank() == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        complete(checkpointer, path, identity)

    with mock.patch.object(Checkpointer, "_complete", killed_at_the_last):
        _train(_config(sharding=sharding, checkpoint_dir=out_dir / f"checkpoints-{sharding}", checkpoint_every=1,
                       keep_last=2, async_checkpoint=True, metrics_out=out_dir / f"uninterrupted-{sharding}.jsonl"))


def _resumed(out_dir: Path, sharding: str) -> None:
    _train(_config(sharding=sharding, checkpoint_dir=out_dir / f"checkpoints-{sharding}", resume=True, keep_last=2,
                   metrics_out=out_dir / f"resumed-{sharding}.jsonl"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out_dir = tmp_path_factory.mktemp("checkpoint")
    with pytest.raises(ProcessExitedException, match="process 0 terminated with signal SIGKILL"):
        spawn_gloo(_killed_while_completing_its_last_checkpoint, DP * CP, out_dir, "zero2")
    last = step_dir(out_dir / "checkpoints-zero2", STEPS)
    assert not is_complete(last)
    shutil.copytree(last, out_dir / "async-last")  # written whole by DCP in the background; the resume rewrites it
    spawn_gloo(_resumed, DP * CP, out_dir, "zero2")
    return out_dir


@pytest.mark.slow
def test_a_run_killed_before_its_last_checkpoint_was_complete_resumes_from_the_one_before_bit_for_bit(
    runs: Path,
) -> None:
    uninterrupted = read_metrics(runs / "uninterrupted-zero2.jsonl")
    assert [m["step"] for m in uninterrupted] == list(range(1, STEPS + 1))
    resumed = read_metrics(runs / "resumed-zero2.jsonl")
    assert [m["step"] for m in resumed] == [STEPS]  # from the checkpoint after step STEPS - 1
    assert [m["loss"] for m in resumed] == [m["loss"] for m in uninterrupted[STEPS - 1:]]  # exact float equality


def _dcp_state(checkpoint: Path, into: Path) -> dict[str, Any]:
    dcp_to_torch_save(checkpoint, into)
    state: dict[str, Any] = torch.load(into, weights_only=False)
    return state


@pytest.mark.slow
def test_a_checkpoint_written_in_the_background_equals_the_one_written_in_the_step(runs: Path, tmp_path: Path) -> None:
    written_async = _dcp_state(runs / "async-last", tmp_path / "async.pt")
    written_sync = _dcp_state(step_dir(runs / "checkpoints-zero2", STEPS), tmp_path / "sync.pt")
    assert written_async.keys() == {"model", "optimizer", "train", "rng"}
    _assert_identical(written_async, written_sync)


def _assert_identical(got: object, expected: object, where: str = "") -> None:
    """Equal in every value, tensors bit for bit (``assert_close`` takes no strings, which a state dict holds)."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(got, torch.Tensor) and torch.equal(got, expected), where
    elif isinstance(expected, dict):
        assert isinstance(got, dict) and got.keys() == expected.keys(), where
        for key, value in expected.items():
            _assert_identical(got[key], value, f"{where}/{key}")
    elif isinstance(expected, list | tuple):
        assert isinstance(got, list | tuple) and len(got) == len(expected), where
        for index, (item, value) in enumerate(zip(got, expected, strict=True)):
            _assert_identical(item, value, f"{where}/{index}")
    else:
        assert got == expected, where


@pytest.mark.slow
def test_keep_last_leaves_the_newest_complete_checkpoints_and_resume_reads_the_newest(runs: Path) -> None:
    folder = runs / "checkpoints-zero2"
    assert sorted(p.name for p in folder.iterdir()) == ["step-00000002", "step-00000003"]  # step 1 removed
    assert all(is_complete(step) for step in folder.iterdir())
    assert latest_checkpoint(folder) == folder / "step-00000003"  # the resumed run saved after its last step


@pytest.mark.slow
def test_every_checkpoint_records_the_run_that_wrote_it(runs: Path) -> None:
    config = _config()
    expected = RunIdentity(model="tiny", dp=DP, cp=CP, global_batch=GLOBAL_BATCH,
                           data=DataIdentity(source="synthetic:lmsys", fingerprint=f"max length {BUCKET_SIZE * CP}"),
                           steps=STEPS, warmup_steps=1, lr=config.lr, min_lr_ratio=config.min_lr_ratio, seed=0,
                           weight_decay=config.weight_decay, max_grad_norm=config.max_grad_norm,
                           loss_on=config.loss_on)
    steps = sorted((runs / "checkpoints-zero2").glob("step-*"))
    assert [saved_run_identity(step) for step in steps] == [expected] * len(steps)


@pytest.mark.slow
def test_torchrun_restarts_a_job_whose_rank_was_killed_and_it_ends_with_the_uninterrupted_losses(
    runs: Path, tmp_path: Path
) -> None:
    reference = read_metrics(runs / "uninterrupted-zero2.jsonl")
    metrics_out = tmp_path / "metrics.jsonl"
    checkpoints = tmp_path / "checkpoints"
    command = _torchrun(checkpoints, metrics_out, "--checkpoint-every", "2", "--keep-last", "1", max_restarts=1)
    job = subprocess.Popen(command, env=trainer_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and job.poll() is None:
            if metrics_out.exists() and len(read_metrics(metrics_out)) >= 3:  # step 2 trained, checkpoint at 2
                break
            time.sleep(0.05)
        workers = Path(f"/proc/{job.pid}/task/{job.pid}/children").read_text().split()
        assert len(workers) == DP * CP
        os.kill(int(workers[-1]), signal.SIGKILL)  # the last rank dies mid-run, after the checkpoint of step 2
        _, stderr = job.communicate(timeout=240)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, stderr[-3000:]
    assert "resumed from" in stderr and "step-00000002" in stderr
    metrics = read_metrics(metrics_out)
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))  # each step once: none skipped, none repeated
    assert [m["loss"] for m in metrics] == [m["loss"] for m in reference]
    assert [p.name for p in checkpoints.iterdir()] == ["step-00000003"]  # --keep-last 1: step 2's went once 3's was


@pytest.mark.slow
def test_torchrun_refuses_another_global_batch_and_extends_the_run_on_accepted_other_data(
    runs: Path, tmp_path: Path
) -> None:
    checkpoints = tmp_path / "checkpoints"
    shutil.copytree(runs / "checkpoints-zero2", checkpoints)
    latest = checkpoints / "step-00000003"
    refused_out = tmp_path / "refused.jsonl"
    refused = subprocess.run(_torchrun(checkpoints, refused_out, "--global-batch", str(GLOBAL_BATCH // 2)),
                             env=trainer_env(), capture_output=True, text=True, timeout=300, check=False)
    assert refused.returncode != 0
    assert refused.stderr.count("error: ") == 1, refused.stderr[-3000:]  # every rank stops; one reports
    assert (f"error: checkpoint {latest} was written by another run:\n"
            f"  --global-batch: saved {GLOBAL_BATCH}, this run {GLOBAL_BATCH // 2}\n"
            "resume with the saved values, or give another --checkpoint-dir to start afresh\n") in refused.stderr
    assert not refused_out.exists()  # the metrics file is opened after the check: no step ran

    extended_out = tmp_path / "extended.jsonl"
    extended = subprocess.run(_torchrun(checkpoints, extended_out, "--steps", str(STEPS + 3), "--seed", "1",
                                        "--resume-accept-data-change", "--lr-scheduler", "cosine_with_min_lr"),
                              env=trainer_env(), capture_output=True, text=True, timeout=300, check=False)
    assert extended.returncode == 0, extended.stderr[-3000:]
    assert (f"--resume-accept-data-change: checkpoint {latest} was trained on --seed 0; this run trains on --seed 1 "
            "from the saved data position") in extended.stderr
    assert (f"resuming checkpoint {latest} with other hyperparameters: --steps {STEPS} → {STEPS + 3}"
            in extended.stderr)
    extended_steps = read_metrics(extended_out)
    assert [m["step"] for m in extended_steps] == [STEPS + 1, STEPS + 2, STEPS + 3]
    # the extended run's own schedule (another scheduler too) from the restored step on, not the saved run's
    defaults = TrainConfig(dp=DP, cp=CP)
    factors = lr_factors(LRSchedulerName.COSINE_WITH_MIN_LR, warmup_steps=1, total_steps=STEPS + 3,
                         min_lr_ratio=defaults.min_lr_ratio)
    own_schedule = [defaults.lr * factors(m["step"] - 1) for m in extended_steps]  # the factor of 0-based steps
    assert [m["lr"] for m in extended_steps] == pytest.approx(own_schedule, rel=1e-9)


# ------------------------------------------------------------------------------------------------ complete or not


def _checkpoint(directory: Path, num_steps_done: int, *, complete: bool) -> Path:
    """A step folder as DCP leaves it (metadata and a shard), marked complete or cut short before the marker."""
    path = step_dir(directory, num_steps_done)
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(b"")
    (path / "__0_0.distcp").write_bytes(b"")
    if complete:
        (path / COMPLETE).touch()
    return path


def test_resume_picks_the_newest_complete_checkpoint_and_logs_each_newer_one_cut_short(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    for num_steps_done, complete in ((2, True), (4, True), (6, False)):
        _checkpoint(tmp_path, num_steps_done, complete=complete)
    step_dir(tmp_path, 8).mkdir()  # killed before DCP wrote anything
    with caplog.at_level(logging.INFO, logger="trainer_client.components.checkpoint"):
        assert latest_checkpoint(tmp_path) == step_dir(tmp_path, 4)
    assert caplog.messages == [f"skipping {step_dir(tmp_path, n)}: it has no complete marker, so its save did not "
                               "finish" for n in (8, 6)]


def test_a_directory_without_a_complete_checkpoint_has_none(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path / "missing") is None
    assert latest_checkpoint(tmp_path) is None
    _checkpoint(tmp_path, 2, complete=False)
    (tmp_path / "step-notes").mkdir()  # not a step folder
    assert latest_checkpoint(tmp_path) is None


def test_the_checkpoint_an_older_trainers_latest_file_names_is_complete_and_the_first_save_marks_it(
    tmp_path: Path,
) -> None:
    named = _checkpoint(tmp_path, 2, complete=False)
    cut_short = _checkpoint(tmp_path, 3, complete=False)
    (tmp_path / LEGACY_LATEST).write_text(f"{named.name}\n")  # replaced, by those trainers, once its save finished
    assert latest_checkpoint(tmp_path) == named
    _retire_legacy_latest(tmp_path)  # what a save into the directory does first
    assert not (tmp_path / LEGACY_LATEST).exists()
    assert is_complete(named) and not is_complete(cut_short)
    assert latest_checkpoint(tmp_path) == named


def test_keep_last_removes_older_checkpoints_whole_or_cut_short_and_leaves_later_folders(tmp_path: Path) -> None:
    complete = {1: True, 2: False, 3: True, 4: True, 5: True, 6: False}
    folders = {n: _checkpoint(tmp_path, n, complete=whole) for n, whole in complete.items()}
    removed = prune_checkpoints(tmp_path, keep_last=2, newest=folders[4])  # 5 and 6: another run's, left alone
    assert removed == [folders[1], folders[2]]  # 3 and 4 kept
    assert sorted(p.name for p in tmp_path.iterdir()) == [folders[n].name for n in (3, 4, 5, 6)]


def test_keep_last_never_removes_the_only_complete_checkpoint(tmp_path: Path) -> None:
    cut_short, only = _checkpoint(tmp_path, 1, complete=False), _checkpoint(tmp_path, 2, complete=True)
    assert prune_checkpoints(tmp_path, keep_last=1, newest=only) == [cut_short]
    assert prune_checkpoints(tmp_path, keep_last=1, newest=only) == []
    assert latest_checkpoint(tmp_path) == only


def test_keep_last_keeps_every_complete_checkpoint_while_there_are_fewer(tmp_path: Path) -> None:
    folders = [_checkpoint(tmp_path, n, complete=True) for n in (1, 2)]
    assert prune_checkpoints(tmp_path, keep_last=3, newest=folders[-1]) == []


def test_keep_last_and_async_checkpoint_need_a_checkpoint_dir_and_keep_last_a_positive_count() -> None:
    args = build_parser().parse_args(["--dp", "1", "--cp", "1", "--checkpoint-dir", "ck", "--keep-last", "2",
                                      "--async-checkpoint"])
    config = config_from_args(args)
    assert (config.keep_last, config.async_checkpoint) == (2, True)
    with pytest.raises(ValueError, match=r"^--keep-last must be positive, got 0$"):
        TrainConfig(dp=1, cp=1, checkpoint_dir=Path("ck"), keep_last=0)
    for flag in ({"keep_last": 2}, {"async_checkpoint": True}):
        with pytest.raises(ValueError, match=r"^--keep-last and --async-checkpoint need --checkpoint-dir$"):
            TrainConfig(dp=1, cp=1, **flag)


# ------------------------------------------------------------------------------------------------ async save

IDENTITY = RunIdentity(model="tiny", dp=1, cp=1, global_batch=1, data=DataIdentity(source="s", fingerprint="f"),
                       steps=1, warmup_steps=0, lr=1e-3, min_lr_ratio=0.1)


def _async_save_with_its_write_held(out_dir: Path) -> None:
    """One rank: the write of an async save is held until the parameters have changed, as the next step would."""
    module = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(module.parameters())
    at_save = {name: tensor.clone() for name, tensor in module.state_dict().items()}
    release = threading.Event()
    write = FileSystemWriter.write_data

    def held(writer: FileSystemWriter, *args: Any, **kwargs: Any) -> Any:
        release.wait()
        return write(writer, *args, **kwargs)

    checkpointer = Checkpointer(out_dir / "ck", async_save=True, timeout=timedelta(seconds=60))
    with mock.patch.object(FileSystemWriter, "write_data", held):
        path = checkpointer.save(module=module, optimizer=optimizer, identity=IDENTITY,
                                 state=TrainState(num_steps_done=1, data_position={}))
        complete_on_return = is_complete(path)
        with torch.no_grad():
            module.weight.add_(1.0)
        release.set()
        checkpointer.wait()
    complete_after_wait = is_complete(path)
    checkpointer.close()
    loaded = torch.nn.Linear(4, 4)
    load_model_weights(path, loaded)
    same = all(torch.equal(loaded.state_dict()[name], tensor) for name, tensor in at_save.items())
    (out_dir / "outcome.json").write_text(json.dumps({"complete on return": complete_on_return,
                                                      "complete after wait": complete_after_wait,
                                                      "the state at save": same}))


@pytest.mark.slow  # one process importing torch
def test_an_async_save_returns_before_its_write_and_holds_the_state_of_its_step(tmp_path: Path) -> None:
    spawn_gloo(_async_save_with_its_write_held, 1, tmp_path)
    assert json.loads((tmp_path / "outcome.json").read_text()) == {
        "complete on return": False, "complete after wait": True, "the state at save": True}
