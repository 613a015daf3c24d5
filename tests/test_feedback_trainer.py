"""End to end: ``trainer_client.train --feedback`` under torchrun reports to the real service, which refits."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch.distributed as dist

from trainer_client.config import TrainConfig
from trainer_client.data import GlobalBatch
from trainer_client.demo import read_metrics, run_trainer, start_service, stop_service, trainer_command
from trainer_client.distributed import ParallelDims, free_port, init_parallel, spawn_gloo
from trainer_client.loop import RankBatch
from trainer_client.trainer import Trainer

pytestmark = pytest.mark.slow

STEPS = 4


def test_trainer_feedback_reaches_the_service_and_refits_the_jobs_plans(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SKRULL_CPSAT_WARMUP", "false")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    service = start_service(port)
    try:
        metrics_out = tmp_path / "metrics.jsonl"
        command = trainer_command(scheduler="skrull", metrics_out=metrics_out, scheduler_url=url, nproc=2, dp=1,
                                  cp=2, steps=STEPS, global_batch=8, bucket_size=1024,
                                  extra=["--feedback", "--job-id", "e2e-job"])
        result = run_trainer(command, timeout_s=300)
        assert result.returncode == 0, result.stderr[-3000:]
        state = httpx.get(f"{url}/feedback/e2e-job", timeout=5).json()
    finally:
        stop_service(service)
    metrics = read_metrics(metrics_out)
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert {m["plan_source"] for m in metrics} == {"service"}
    # every step but the first (warm-up) was reported; the last report may still be in flight when training ends
    assert state["num_observations"] > 0 and state["profile"] == "h100-paper+feedback"
    assert state["compute_scale"] > 10  # a CPU is far slower than the H100 profile the job started from


class _CountingSource:
    """The trainer's data source, counting which global batches are built."""

    def __init__(self, source: Any, built: list[int]) -> None:
        self._source, self._built = source, built

    def batch(self, step: int) -> GlobalBatch:
        self._built.append(step)
        return self._source.batch(step)


class _HourLongMicroBatches(Trainer):
    """Every micro-batch reports two hours: a report the contract refuses (time_ms ≤ one hour)."""

    def forward_backward(self, share: RankBatch) -> tuple[float, int]:
        result = super().forward_backward(share)
        self.micro_batch_timings = [dataclasses.replace(t, time_s=7200.0) for t in self.micro_batch_timings]
        return result


def _train_with_refused_feedback(out_dir: Path, url: str) -> None:
    config = TrainConfig(dp=2, cp=1, model="tiny", global_batch=4, steps=STEPS, bucket_size=1024, progress=False,
                         scheduler_url=url, plan_attempts=1, plan_timeout_s=1.0, feedback=True, job_id="refused")
    trainer = _HourLongMicroBatches(config, init_parallel(ParallelDims.of(config)))
    built: list[int] = []
    trainer.source = _CountingSource(trainer.source, built)  # type: ignore[assignment]
    history = trainer.train()
    plans = trainer.batches.plans
    failures = plans.num_feedback_failures if plans is not None else None
    trainer.close()
    (out_dir / f"rank{dist.get_rank()}.json").write_text(json.dumps(
        {"steps": [m.step for m in history], "built": built, "feedback_failures": failures}))


def test_refused_feedback_never_stops_training_and_each_batch_is_built_once(tmp_path: Path) -> None:
    # Before the fix rank 0 raised ValidationError building the report and rank 1 waited in the next broadcast.
    spawn_gloo(_train_with_refused_feedback, 2, tmp_path, f"http://127.0.0.1:{free_port()}")
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert rank0["steps"] == rank1["steps"] == list(range(1, STEPS + 1))
    assert rank0["feedback_failures"] == STEPS - 1  # every step but the first is reported, each refused, none raised
    # rank 0 builds batch s + 1 for the prefetch and trains on that same object: every batch is built once
    assert rank0["built"] == rank1["built"] == list(range(STEPS))
