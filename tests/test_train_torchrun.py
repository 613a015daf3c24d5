"""End to end under torchrun: 4 CPU processes, plans from the real service, Skrull vs DeepSpeed losses.

The runs are the issue's command (dp 2 × cp 2, tiny model, synthetic:lmsys, global batch 16, bucket 4096)
with fewer steps. The skrull run loses its service mid-run and must go on with embedded plans, same losses.
A run in which one rank fails must end at once, every rank naming it.
"""

from __future__ import annotations

import re
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
COLLECTIVE_TIMEOUT_S = 120


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
    assert [m["step"] for m in scheduled] == [m["step"] for m in baseline] == list(range(1, STEPS + 1))
    for a, b in zip(scheduled, baseline, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), f"step {a['step']}"
        assert a["tokens"] == b["tokens"]
    assert {m["plan_source"] for m in baseline} == {"service"}
    assert scheduled[0]["plan_source"] == "service" and scheduled[-1]["plan_source"] == "embedded"
    assert scheduled[-1]["plan_fallbacks"] >= 1
    assert stderr.count("planning with the embedded core instead") == 1
    assert sum(a["num_micro_batches"] for a in scheduled) < sum(b["num_micro_batches"] for b in baseline)
    # rank 0 prints every step's loss as well, numbered as checkpoints count steps
    assert [line.split()[1] for line in stdout.splitlines() if line.startswith("step ")] == [
        str(step) for step in range(1, STEPS + 1)
    ]


@pytest.mark.slow
def test_a_failing_rank_stops_the_job_at_once_and_every_rank_names_it(tmp_path: Path) -> None:
    metrics_out = tmp_path / "metrics.jsonl"
    job = subprocess.run(
        trainer_command(scheduler="skrull", metrics_out=metrics_out, scheduler_url=None, steps=4, global_batch=8,
                        bucket_size=1024, extra=["--collective-timeout", str(COLLECTIVE_TIMEOUT_S),
                                                 "--fail-rank", "2", "--fail-at-step", "3"]),
        env=trainer_env(), capture_output=True, text=True, timeout=300, check=False,
    )
    ended, stderr = time.time(), job.stderr
    assert job.returncode != 0, stderr[-3000:]
    # Rank 0 logged steps 1 and 2, then waited for global rank 2 in step 3: it and the job ended long before a
    # collective could time out (seconds, here; the bound leaves room for a loaded machine).
    assert [m["step"] for m in read_metrics(metrics_out)] == [1, 2]
    assert ended - metrics_out.stat().st_mtime < COLLECTIVE_TIMEOUT_S / 4
    reason = "InjectedFault: injected fault at step 3 (--fail-rank 2 --fail-at-step 3)"
    final_errors = _final_errors(stderr)
    assert final_errors.pop(2) == f"trainer_client.trainer.{reason}"
    # Each other rank that got to print before torchrun stopped it (all, so far) stops with rank 2's reason, not
    # its broken collective's.
    assert final_errors
    assert set(final_errors.values()) == {f"trainer_client.distributed.PeerFailed: global rank 2 failed: {reason}"}
    # torchrun's summary: its first observed failure is whichever rank its agent saw exit first (rank 2, or on a
    # loaded machine a peer that stopped on rank 2's failure), and either names rank 2's reason.
    root_cause = stderr.split("Root Cause (first observed failure):")[1]
    assert reason in root_cause


def _final_errors(stderr: str) -> dict[int, str]:
    """Global rank → the last line of the traceback it printed (torchrun prefixes a rank's lines "[rankN]: ")."""
    final: dict[int, str] = {}
    for match in re.finditer(r"^\[rank(\d+)\]: (\S.*)$", stderr, flags=re.MULTILINE):
        final[int(match[1])] = match[2]
    return final
