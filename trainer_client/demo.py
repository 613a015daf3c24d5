"""The end-to-end demo (``make demo``): the service plans, a 4-process CPU trainer trains, Skrull vs DeepSpeed.

1. start the scheduler service on a free loopback port and wait for ``/readyz``;
2. run ``torchrun --nproc-per-node 4 -m trainer_client.train --dp 2 --cp 2``
   (tiny Qwen2 model, ``synthetic:lmsys``) with ``--scheduler skrull``, then
   with ``--scheduler deepspeed`` on the same data;
3. print a comparison: loss equal at every step, measured step time and
   tokens/s, where the plans came from, the planner's estimate;
4. stop the service.

Measured on this project's 2-core CPU machine: about 36 s per scheduler
(30 steps), 75 s in all. CPU step times of a tiny model reflect per-micro-batch
overheads and 4 ranks sharing 2 cores, not GPU kernels; the estimate column is
the H100 performance model's view of the same plans.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from trainer_client.distributed import free_port

__all__ = ["RunSummary", "main", "run_trainer", "start_service", "stop_service", "summarize"]


def start_service(port: int, *, ready_timeout_s: float = 120.0) -> subprocess.Popen[bytes]:
    """``python -m scheduler_service serve`` on loopback; returns once ``/readyz`` answers 200."""
    process = subprocess.Popen(
        [sys.executable, "-m", "scheduler_service", "serve", "--host", "127.0.0.1", "--port", str(port),
         "--log-level", "warning", "--no-access-log"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}/readyz"
    deadline = time.monotonic() + ready_timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            stderr = process.stderr.read().decode() if process.stderr else ""
            raise RuntimeError(f"the scheduler service exited with {process.returncode}: {stderr[-2000:]}")
        try:
            if httpx.get(url, timeout=1.0).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    stop_service(process)
    raise RuntimeError(f"the scheduler service did not become ready within {ready_timeout_s:.0f} s")


def stop_service(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    if process.stderr is not None:
        process.stderr.close()


def trainer_command(
    *, scheduler: str, metrics_out: Path, scheduler_url: str | None, nproc: int = 4, dp: int = 2, cp: int = 2,
    steps: int = 30, global_batch: int = 16, bucket_size: int = 4096, data: str = "synthetic:lmsys",
    seed: int = 0, extra: Sequence[str] = (),
) -> list[str]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               "-m", "trainer_client.train", "--dp", str(dp), "--cp", str(cp), "--model", "tiny", "--data", data,
               "--global-batch", str(global_batch), "--steps", str(steps), "--scheduler", scheduler,
               "--bucket-size", str(bucket_size), "--seed", str(seed), "--metrics-out", str(metrics_out),
               "--no-progress", *extra]
    if scheduler_url is not None:
        command += ["--scheduler-url", scheduler_url]
    return command


def trainer_env() -> dict[str, str]:
    # One thread per rank: 4 ranks share this machine's cores; torchrun would warn and set the same.
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def run_trainer(command: Sequence[str], *, timeout_s: float = 600.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, env=trainer_env(), capture_output=True, text=True, timeout=timeout_s,
                          check=False)


def read_metrics(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@dataclass(frozen=True, kw_only=True, slots=True)
class RunSummary:
    scheduler: str
    steps: int
    losses: list[float]
    mean_step_time_s: float
    tokens_per_s: float
    plan_sources: dict[str, int]
    estimated_time_ms: float
    wall_time_s: float


def summarize(scheduler: str, metrics: list[dict[str, object]], wall_time_s: float) -> RunSummary:
    # Step 0 pays one-off costs (first plan, allocator warm-up); measure the steady state after it.
    steady = metrics[1:] or metrics
    step_times = [float(m["step_time_s"]) for m in steady]  # type: ignore[arg-type]
    tokens = sum(int(m["tokens"]) for m in steady)  # type: ignore[call-overload]
    sources: dict[str, int] = {}
    for m in metrics:
        sources[str(m["plan_source"])] = sources.get(str(m["plan_source"]), 0) + 1
    return RunSummary(
        scheduler=scheduler, steps=len(metrics), losses=[float(m["loss"]) for m in metrics],  # type: ignore[arg-type]
        mean_step_time_s=statistics.fmean(step_times), tokens_per_s=tokens / sum(step_times),
        plan_sources=sources,
        estimated_time_ms=statistics.fmean(float(m["estimated_time_ms"]) for m in metrics),  # type: ignore[arg-type]
        wall_time_s=wall_time_s,
    )


def max_relative_difference(a: Sequence[float], b: Sequence[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=True))


def format_table(skrull: RunSummary, deepspeed: RunSummary) -> str:
    rel = max_relative_difference(skrull.losses, deepspeed.losses)
    equal = "yes" if rel <= 1e-5 else "NO"
    rows = [
        f"{'scheduler':<10} {'steps':>5} {'final loss':>11} {'step time s':>11} {'tokens/s':>9} "
        f"{'plans from':<18} {'est. ms (H100 model)':>20} {'run wall s':>10}",
    ]
    for run in (skrull, deepspeed):
        sources = ", ".join(f"{k} {v}" for k, v in sorted(run.plan_sources.items()))
        rows.append(f"{run.scheduler:<10} {run.steps:>5} {run.losses[-1]:>11.6f} {run.mean_step_time_s:>11.3f} "
                    f"{run.tokens_per_s:>9.0f} {sources:<18} {run.estimated_time_ms:>20.3f} {run.wall_time_s:>10.1f}")
    rows.append(f"losses equal at every step: {equal} (max relative difference {rel:.2e}, tolerance 1e-05)")
    rows.append(f"measured speedup skrull vs deepspeed (CPU, tiny model): "
                f"{deepspeed.mean_step_time_s / skrull.mean_step_time_s:.2f}x; "
                f"estimated (H100 performance model): {deepspeed.estimated_time_ms / skrull.estimated_time_ms:.2f}x")
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer_client.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--bucket-size", type=int, default=4096)
    parser.add_argument("--data", default="synthetic:lmsys")
    args = parser.parse_args(argv)

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    print(f"starting the scheduler service on {url} …", flush=True)
    service = start_service(port)
    summaries: dict[str, RunSummary] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="skrull-demo-") as work:
            for scheduler in ("skrull", "deepspeed"):
                metrics_out = Path(work) / f"{scheduler}.jsonl"
                command = trainer_command(scheduler=scheduler, metrics_out=metrics_out, scheduler_url=url,
                                          steps=args.steps, global_batch=args.global_batch,
                                          bucket_size=args.bucket_size, data=args.data)
                print(f"training {args.steps} steps with --scheduler {scheduler} (4 CPU processes: dp 2 × cp 2) …",
                      flush=True)
                started = time.perf_counter()
                result = run_trainer(command)
                wall_time_s = time.perf_counter() - started
                if result.returncode != 0:
                    print(result.stderr[-4000:], file=sys.stderr)
                    print(f"error: the {scheduler} run failed with exit code {result.returncode}", file=sys.stderr)
                    return 1
                summaries[scheduler] = summarize(scheduler, read_metrics(metrics_out), wall_time_s)
    finally:
        stop_service(service)
        print("scheduler service stopped", flush=True)
    print()
    print(format_table(summaries["skrull"], summaries["deepspeed"]))
    rel = max_relative_difference(summaries["skrull"].losses, summaries["deepspeed"].losses)
    return 0 if rel <= 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
