"""A run killed at any step and resumed from its checkpoint trains the batches it had not, bit for bit (fp32, CPU);
every checkpoint records the run that wrote it, and a resume of another run stops before it trains."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from trainer_client.checkpoint import LATEST, latest_checkpoint, saved_run_identity
from trainer_client.config import TrainConfig
from trainer_client.data import DataIdentity
from trainer_client.demo import read_metrics, trainer_env
from trainer_client.distributed import init_parallel, spawn_gloo
from trainer_client.optim import lr_factor
from trainer_client.run_identity import RunIdentity
from trainer_client.trainer import Trainer

DP, CP, STEPS, GLOBAL_BATCH, BUCKET_SIZE = 2, 2, 3, 8, 512


def _config(**changes: object) -> TrainConfig:
    base: dict[str, object] = dict(dp=DP, cp=CP, model="tiny", data="synthetic:lmsys", global_batch=GLOBAL_BATCH,
                                   steps=STEPS, bucket_size=BUCKET_SIZE, seed=0, progress=False, warmup_steps=1)
    return TrainConfig(**{**base, **changes})  # type: ignore[arg-type]


def _train(config: TrainConfig) -> list[float]:
    trainer = Trainer(config, init_parallel(config.dims))
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


def _uninterrupted_then_resumed(out_dir: Path, sharding: str) -> None:
    checkpoints = out_dir / f"checkpoints-{sharding}"
    uninterrupted = _train(_config(sharding=sharding, checkpoint_dir=checkpoints, checkpoint_every=2))
    if dist.get_rank() == 0:
        (checkpoints / LATEST).write_text("step-00000002\n")  # as if killed during step 2 (0-based)
    dist.barrier()
    metrics_out = out_dir / f"resumed-{sharding}.jsonl"
    resumed = _train(_config(sharding=sharding, checkpoint_dir=checkpoints, resume=True, metrics_out=metrics_out))
    if dist.get_rank() == 0:
        (out_dir / f"{sharding}.json").write_text(json.dumps({"uninterrupted": uninterrupted, "resumed": resumed}))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out_dir = tmp_path_factory.mktemp("checkpoint")
    spawn_gloo(_uninterrupted_then_resumed, DP * CP, out_dir, "zero2")
    return out_dir


@pytest.mark.slow
def test_resumed_run_equals_the_uninterrupted_one_bit_for_bit(runs: Path) -> None:
    result = json.loads((runs / "zero2.json").read_text())
    assert len(result["uninterrupted"]) == STEPS
    assert result["resumed"] == result["uninterrupted"][2:]  # exact float equality: step 2 only


@pytest.mark.slow
def test_checkpoints_are_written_every_n_steps_and_latest_names_the_newest(runs: Path) -> None:
    folder = runs / "checkpoints-zero2"
    assert sorted(p.name for p in folder.glob("step-*")) == ["step-00000002", "step-00000003"]  # every 2, and last
    assert latest_checkpoint(folder) == folder / "step-00000003"  # the resumed run saved after its last step


@pytest.mark.slow
def test_every_checkpoint_records_the_run_that_wrote_it(runs: Path) -> None:
    config = _config()
    expected = RunIdentity(model="tiny", dp=DP, cp=CP, global_batch=GLOBAL_BATCH,
                           data=DataIdentity(source="synthetic:lmsys",
                                             fingerprint=f"seed 0, max length {BUCKET_SIZE * CP}"),
                           steps=STEPS, warmup_steps=1, lr=config.lr, min_lr_ratio=config.min_lr_ratio)
    steps = sorted((runs / "checkpoints-zero2").glob("step-*"))
    assert [saved_run_identity(step) for step in steps] == [expected] * len(steps)


@pytest.mark.slow
def test_torchrun_restarts_a_job_whose_rank_was_killed_and_it_ends_with_the_uninterrupted_losses(
    runs: Path, tmp_path: Path
) -> None:
    reference = json.loads((runs / "zero2.json").read_text())["uninterrupted"]
    metrics_out = tmp_path / "metrics.jsonl"
    command = _torchrun(tmp_path / "checkpoints", metrics_out, "--checkpoint-every", "2", max_restarts=1)
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
    assert [m["step"] for m in metrics] == list(range(STEPS))  # each step once: none skipped, none repeated
    assert [m["loss"] for m in metrics] == reference


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
                                        "--resume-accept-data-change"),
                              env=trainer_env(), capture_output=True, text=True, timeout=300, check=False)
    assert extended.returncode == 0, extended.stderr[-3000:]
    assert (f"--resume-accept-data-change: checkpoint {latest} was trained on synthetic:lmsys (seed 0, max length "
            f"{BUCKET_SIZE * CP}); this run trains on synthetic:lmsys (seed 1, max length {BUCKET_SIZE * CP}) from "
            "the saved data position") in extended.stderr
    assert f"resuming checkpoint {latest} with another schedule: --steps {STEPS} → {STEPS + 3}" in extended.stderr
    extended_steps = read_metrics(extended_out)
    assert [m["step"] for m in extended_steps] == [STEPS, STEPS + 1, STEPS + 2]
    # the extended run's own schedule from the restored step on, not the saved run's last learning rate
    defaults = TrainConfig(dp=DP, cp=CP)
    own_schedule = [defaults.lr * lr_factor(step, warmup_steps=1, total_steps=STEPS + 3,
                                            min_lr_ratio=defaults.min_lr_ratio) for step in range(STEPS, STEPS + 3)]
    assert [m["lr"] for m in extended_steps] == pytest.approx(own_schedule, rel=1e-9)
