"""The end-to-end demo (``make demo``): the service plans, a 4-process CPU trainer trains, Skrull vs DeepSpeed.

1. measure a profile of this machine as the demo will use it (``torchrun
   --nproc-per-node 4 -m trainer_client.profile``: 4 ranks sharing its cores),
   unless ``--profile NAME`` names a shipped one (``cpu-tiny``);
2. start the scheduler service on a free loopback port with that profile and
   wait for ``/readyz``;
3. run ``torchrun --nproc-per-node 4 -m trainer_client.train --dp 2 --cp 2
   --sharding zero2`` (tiny Qwen2 model, ``synthetic:lmsys``) with
   ``--scheduler skrull``, then with ``--scheduler deepspeed`` on the same data
   and the same profile: only the schedule differs;
4. print, per scheduler and side by side, the step time the performance model
   predicts for the plans (the service's estimate) and the measured time of the
   micro-batches (the slowest rank's, what the estimate models) and of the
   whole step (plus planning, the loss and gradient-norm collectives, the
   optimizer), the speedups both ways, and whether the losses are equal at
   every step;
5. stop the service.

Nothing is tuned per scheduler. CPU step times of a tiny model reflect
per-micro-batch overheads and 4 ranks sharing the machine's cores, not GPU
kernels; that is why the profile is measured here, with 4 ranks, its
collectives up to the largest message the demo sends (a whole CP group's
bucket of K/V in one layer).

The runs keep every micro-batch within a DP replica's CP group
(``--no-spanning``). On 2 cores shared by 4 ranks, a replica that waits lends
its cores to the busy one, which the performance model (one device per rank)
does not see: it predicted spanning micro-batches to save about twice what they
measured here (docs/benchmarks.md, "End-to-end demo"), and the demo's goal is
that its predictions hold.
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
from trainer_client.model import model_shape
from trainer_client.profile import ProfileOptions

__all__ = ["RunSummary", "build_parser", "demo_comm_sizes", "main", "run_trainer", "start_service", "stop_service",
           "summarize"]


def start_service(port: int, *, ready_timeout_s: float = 120.0,
                  profile_dir: Path | None = None) -> subprocess.Popen[bytes]:
    """``python -m scheduler_service serve`` on loopback (with a folder of measured profiles); returns once
    ``/readyz`` answers 200."""
    extra = ["--profile-dir", str(profile_dir)] if profile_dir is not None else []
    process = subprocess.Popen(
        [sys.executable, "-m", "scheduler_service", "serve", "--host", "127.0.0.1", "--port", str(port),
         "--log-level", "warning", "--no-access-log", *extra],
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
               "--no-progress", "--no-spanning", *extra]  # module docstring: why within CP groups
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


def profile_command(*, name: str, out: Path, nproc: int = 4, repeats: int = 3,
                    comm_sizes: Sequence[int] | None = None) -> list[str]:
    """The profiler under torchrun with as many ranks as the demo trains with: they share the cores as they will."""
    extra = ["--comm-sizes", ",".join(map(str, comm_sizes))] if comm_sizes else []
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            "-m", "trainer_client.profile", "--model", "tiny", "--device", "cpu", "--name", name, "--out", str(out),
            "--repeats", str(repeats), "--no-progress", *extra]


def demo_comm_sizes(*, bucket_size: int, cp: int) -> list[int]:
    """Collective sizes to profile, from the profiler's smallest by factors of 4 up to the largest the demo sends:
    one layer's fp32 K and V of a sequence filling the CP group's buckets. Each collective is timed after the
    compute that precedes it in such a micro-batch, so sizes larger than the run sends only lengthen the profile."""
    largest_bytes = 2 * bucket_size * cp * model_shape("tiny").kv_hidden_size * 4
    sizes = [ProfileOptions(model="tiny").comm_sizes[0]]
    while sizes[-1] * 4 < largest_bytes:
        sizes.append(sizes[-1] * 4)
    return [*sizes, largest_bytes]


@dataclass(frozen=True, kw_only=True, slots=True)
class RunSummary:
    scheduler: str
    steps: int
    losses: list[float]
    predicted_step_time_s: float  # the performance model's estimate of the plans
    micro_batch_time_s: float  # measured: the slowest rank's micro-batches, what the estimate models
    step_time_s: float  # measured: the whole step
    tokens_per_s: float
    plan_sources: dict[str, int]
    wall_time_s: float


def summarize(scheduler: str, metrics: list[dict[str, object]], wall_time_s: float) -> RunSummary:
    # Step 0 pays one-off costs (first plan, allocator warm-up); measure the steady state after it.
    steady = metrics[1:] or metrics

    def values(key: str) -> list[float]:
        return [float(m[key]) for m in steady]  # type: ignore[arg-type]

    def mean(key: str) -> float:
        return statistics.fmean(values(key))

    sources: dict[str, int] = {}
    for m in metrics:
        sources[str(m["plan_source"])] = sources.get(str(m["plan_source"]), 0) + 1
    return RunSummary(
        scheduler=scheduler, steps=len(metrics), losses=[float(m["loss"]) for m in metrics],  # type: ignore[arg-type]
        predicted_step_time_s=mean("estimated_time_ms") / 1e3, micro_batch_time_s=mean("micro_batch_time_s"),
        step_time_s=mean("step_time_s"), tokens_per_s=sum(values("tokens")) / sum(values("step_time_s")),
        plan_sources=sources, wall_time_s=wall_time_s,
    )


def max_relative_difference(a: Sequence[float], b: Sequence[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=True))


SPEEDUP_GOAL = 2.0
PREDICTION_TOLERANCE = 0.15


def format_table(skrull: RunSummary, deepspeed: RunSummary, *, profile: str) -> str:
    rel = max_relative_difference(skrull.losses, deepspeed.losses)
    rows = [
        f"plans and predictions: profile {profile}",
        f"{'scheduler':<10} {'steps':>5} {'final loss':>11} {'predicted s':>11} {'micro-batches s':>15} "
        f"{'error':>7} {'whole step s':>12} {'tokens/s':>9} {'plans from':<16}",
    ]
    for run in (skrull, deepspeed):
        sources = ", ".join(f"{k} {v}" for k, v in sorted(run.plan_sources.items()))
        error = run.predicted_step_time_s / run.micro_batch_time_s - 1
        rows.append(f"{run.scheduler:<10} {run.steps:>5} {run.losses[-1]:>11.6f} {run.predicted_step_time_s:>11.3f} "
                    f"{run.micro_batch_time_s:>15.3f} {error:>+7.1%} {run.step_time_s:>12.3f} "
                    f"{run.tokens_per_s:>9.0f} {sources:<16}")
    predicted = deepspeed.predicted_step_time_s / skrull.predicted_step_time_s
    measured = deepspeed.micro_batch_time_s / skrull.micro_batch_time_s
    whole = deepspeed.step_time_s / skrull.step_time_s
    speedup_error = predicted / measured - 1
    errors = [abs(run.predicted_step_time_s / run.micro_batch_time_s - 1) for run in (skrull, deepspeed)]
    rows += [
        f"losses equal at every step: {'yes' if rel <= 1e-5 else 'NO'} (max relative difference {rel:.2e}, "
        f"tolerance 1e-05)",
        f"speedup skrull vs deepspeed: predicted {predicted:.2f}x | measured {measured:.2f}x (micro-batches), "
        f"{whole:.2f}x (whole step)",
        f"goal measured whole-step speedup >= {SPEEDUP_GOAL:.1f}x: {'met' if whole >= SPEEDUP_GOAL else 'MISSED'}",
        f"goal predictions within {PREDICTION_TOLERANCE:.0%} of the measured micro-batch times: "
        f"{'met' if max(errors) <= PREDICTION_TOLERANCE else 'MISSED'} (worst {max(errors):.1%}; "
        f"the predicted speedup is {speedup_error:+.1%} off the measured)",
    ]
    return "\n".join(rows)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m trainer_client.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="training steps of each run")
    parser.add_argument("--global-batch", type=int, default=16, help="sequences per global batch")
    parser.add_argument("--bucket-size", type=int, default=4096, help="tokens one CP rank holds (BucketSize)")
    parser.add_argument("--dp", type=int, default=2, help="data-parallel size")
    parser.add_argument("--cp", type=int, default=2, help="context-parallel size")
    parser.add_argument("--data", default="synthetic:lmsys", help="the trainer's --data")
    parser.add_argument("--profile", default="measure",
                        help="'measure': profile this machine first, with the demo's 4 processes (about 80-150 s); "
                             "or a shipped profile name (cpu-tiny)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    nproc = args.dp * args.cp

    with tempfile.TemporaryDirectory(prefix="skrull-demo-") as work:
        profile_dir = None
        profile = args.profile
        if profile == "measure":
            profile, profile_dir = "cpu-tiny-demo", Path(work) / "profiles"
            print(f"measuring a CPU profile of this machine ({nproc} processes) …", flush=True)
            comm_sizes = demo_comm_sizes(bucket_size=args.bucket_size, cp=args.cp)
            result = run_trainer(profile_command(name=profile, out=profile_dir / f"{profile}.json", nproc=nproc,
                                                 comm_sizes=comm_sizes))
            if result.returncode != 0:
                print(result.stderr[-4000:], file=sys.stderr)
                print(f"error: profiling failed with exit code {result.returncode}", file=sys.stderr)
                return 1
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        print(f"starting the scheduler service on {url} …", flush=True)
        service = start_service(port, profile_dir=profile_dir)
        summaries: dict[str, RunSummary] = {}
        try:
            for scheduler in ("skrull", "deepspeed"):
                metrics_out = Path(work) / f"{scheduler}.jsonl"
                command = trainer_command(scheduler=scheduler, metrics_out=metrics_out, scheduler_url=url,
                                          nproc=nproc, dp=args.dp, cp=args.cp, steps=args.steps,
                                          global_batch=args.global_batch, bucket_size=args.bucket_size,
                                          data=args.data, extra=["--profile", profile, "--sharding", "zero2"])
                print(f"training {args.steps} steps with --scheduler {scheduler} ({nproc} CPU processes: "
                      f"dp {args.dp} × cp {args.cp}, --sharding zero2) …", flush=True)
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
    print(format_table(summaries["skrull"], summaries["deepspeed"], profile=profile))
    rel = max_relative_difference(summaries["skrull"].losses, summaries["deepspeed"].losses)
    return 0 if rel <= 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
