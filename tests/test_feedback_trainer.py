"""End to end: ``trainer_client.train --feedback`` under torchrun reports to the real service, which refits."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from trainer_client.demo import read_metrics, run_trainer, start_service, stop_service, trainer_command
from trainer_client.distributed import free_port

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
    assert [m["step"] for m in metrics] == list(range(STEPS))
    assert {m["plan_source"] for m in metrics} == {"service"}
    # steps 1.. were reported (step 0 is warm-up); the last report may still be in flight when training ends
    assert state["num_observations"] > 0 and state["profile"] == "h100-paper+feedback"
    assert state["compute_scale"] > 10  # a CPU is far slower than the H100 profile the job started from
