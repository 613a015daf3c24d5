"""End to end under torchrun: 4 CPU processes, plans from the real service, Skrull vs DeepSpeed losses.

The runs are the issue's command (dp 2 × cp 2, tiny model, synthetic:lmsys, global batch 16, bucket 4096)
with fewer steps. The skrull run loses its service mid-run and must go on with embedded plans, same losses.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from trainer_client.demo import (
    read_metrics,
    start_service,
    stop_service,
    trainer_command,
    trainer_env,
)
from trainer_client.distributed import free_port

STEPS = 8


@pytest.mark.slow
def test_skrull_matches_deepspeed_step_for_step_and_survives_the_service_stopping(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    service = start_service(port)
    try:
        deepspeed_out, skrull_out = tmp_path / "deepspeed.jsonl", tmp_path / "skrull.jsonl"
        deepspeed = subprocess.run(
            trainer_command(scheduler="deepspeed", metrics_out=deepspeed_out, scheduler_url=url, steps=STEPS),
            env=trainer_env(), capture_output=True, text=True, timeout=300, check=False,
        )
        assert deepspeed.returncode == 0, deepspeed.stderr[-3000:]

        skrull = subprocess.Popen(
            trainer_command(scheduler="skrull", metrics_out=skrull_out, scheduler_url=url, steps=STEPS),
            env=trainer_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and skrull.poll() is None:
            if skrull_out.exists() and len(read_metrics(skrull_out)) >= 2:
                break
            time.sleep(0.05)
        stop_service(service)  # mid-run: later batches must be planned by the embedded core
        stdout, stderr = skrull.communicate(timeout=300)
        assert skrull.returncode == 0, stderr[-3000:]
    finally:
        stop_service(service)

    baseline, scheduled = read_metrics(deepspeed_out), read_metrics(skrull_out)
    assert [m["step"] for m in scheduled] == [m["step"] for m in baseline] == list(range(STEPS))
    for a, b in zip(scheduled, baseline, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), f"step {a['step']}"
        assert a["tokens"] == b["tokens"]
    assert {m["plan_source"] for m in baseline} == {"service"}
    assert scheduled[0]["plan_source"] == "service" and scheduled[-1]["plan_source"] == "embedded"
    assert scheduled[-1]["plan_fallbacks"] >= 1
    assert stderr.count("planning with the embedded core instead") == 1
    assert sum(a["num_micro_batches"] for a in scheduled) < sum(b["num_micro_batches"] for b in baseline)
    # rank 0 prints every step's loss as well
    assert [line.split()[1] for line in stdout.splitlines() if line.startswith("step ")] == [
        str(step) for step in range(STEPS)
    ]
