"""The end-to-end demo (``make demo``): the service plans, a CPU trainer trains, Skrull vs DeepSpeed.

1. choose the layout: as many processes as this machine has cores, at most 4 (dp 2 × cp 2 on 4 cores, dp 1 × cp 2
   on 2; ``default_layout``); ``--dp``/``--cp`` ask for another, a larger one too;
2. start the scheduler service on a free loopback port and wait for ``/readyz``;
3. in each of ``--rounds`` rounds (3 by default): measure a profile of this machine with the run's processes
   (``torchrun -m trainer_client.profile``, the compute sweep up to the most tokens a rank holds in a micro-batch:
   the BucketSize), then train ``--steps`` steps with ``--scheduler skrull`` and the same steps with ``--scheduler
   deepspeed`` (``--sharding zero2``, tiny Qwen2, ``synthetic:lmsys`` drawn with the round's seed), both planned by
   the service with that profile: only the schedule differs;
4. print, per scheduler, the step time the performance model predicts for its plans (the service's estimate) and
   the measured time of the micro-batches (the slowest rank's, what the estimate models) and of the whole step
   (plus planning, the loss and gradient-norm collectives, the optimizer), each round's and all rounds', the
   speedups both ways, and whether the losses are equal at every step; the first step of every run pays one-off
   costs (the first plan, the allocator's growth) and is left out of the times. Each verdict on a goal comes with
   the load it was reached under: the cores other processes took while the runs trained (``OtherWork``), and a
   miss where they took over ``BUSY_SHARE`` of the machine says it was busy;
5. stop the service.

Nothing is tuned per scheduler. A profile describes the machine as it was while measured: each round's is measured
seconds before the runs it predicts, by as many processes as they use, so that both share its load; one profile
minutes before a run on a shared machine predicted it 30-50 % off. No more processes than cores: 4 processes on 2
cores share them unevenly in training (a rank that waits in a collective lends its core to another), which a
profile measured with every rank busy does not describe, and the performance model (one device per rank) neither.

The runs keep every micro-batch within a DP replica's CP group (``--no-spanning``): a replica that waits lends its
cores to the busy one when processes outnumber cores, which the model does not see (docs/benchmarks.md,
"End-to-end demo").
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from scheduler_service.processes import stop_process
from trainer_client.distributed import free_port
from trainer_client.models.model import model_shape
from trainer_client.profiler.command import ProfileOptions

__all__ = ["RunSummary", "build_parser", "default_layout", "demo_comm_sizes", "main", "run_trainer", "start_service",
           "stop_service", "summarize"]


def start_service(port: int, *, ready_timeout_s: float = 120.0, profile_dir: Path | None = None,
                  settings: Mapping[str, str] | None = None) -> subprocess.Popen[bytes]:
    """``python -m scheduler_service serve`` on loopback (with a folder of measured profiles, and ``SKRULL_*``
    ``settings`` over the environment's); returns once ``/readyz`` answers 200."""
    extra = ["--profile-dir", str(profile_dir)] if profile_dir is not None else []
    process = subprocess.Popen(
        [sys.executable, "-m", "scheduler_service", "serve", "--host", "127.0.0.1", "--port", str(port),
         "--log-level", "warning", "--no-access-log", *extra],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env={**os.environ, **(settings or {})},
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
    """Stop the service ``start_service`` started (``processes.stop_process``: SIGTERM, then SIGKILL after 20 s)."""
    stop_process(process)


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


def profile_command(*, name: str, out: Path, nproc: int = 4, repeats: int = 5,
                    comm_sizes: Sequence[int] | None = None, sizes: Sequence[int] | None = None) -> list[str]:
    """The profiler under torchrun with as many ranks as the demo trains with: they share the cores as they will.
    ``sizes``: the compute sweep's packed tokens (the profiler's own by default)."""
    extra = ["--comm-sizes", ",".join(map(str, comm_sizes))] if comm_sizes else []
    if sizes:
        extra += ["--sizes", ",".join(map(str, sizes))]
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


def demo_compute_sizes(*, bucket_size: int) -> list[int]:
    """The compute sweep's sizes: from 64 tokens by factors of 2 up to the BucketSize, the most a rank holds in a
    micro-batch, so that every micro-batch the runs train is priced within the sweep, none extrapolated beyond it."""
    sizes = [64]
    while sizes[-1] * 2 < bucket_size:
        sizes.append(sizes[-1] * 2)
    return [*sizes, bucket_size]


def machine_busy_s() -> float | None:
    """CPU seconds every process of this machine has run since boot (Linux's ``/proc/stat``), None elsewhere."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(value) for value in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def children_cpu_s() -> float:
    """CPU seconds of this process's finished children and theirs (torchrun's workers)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


@dataclass(slots=True)
class OtherWork:
    """How much of the machine processes other than the demo's used while its runs ran: the performance model
    gives every rank a device of its own, so a core another job takes makes every micro-batch slower than
    predicted, and the slower the more the ranks wait for each other."""

    cpu_s: float = 0.0
    wall_s: float = 0.0

    @contextmanager
    def measured(self) -> Iterator[None]:
        """Count the other processes' CPU time while the block runs (which starts and waits for children)."""
        machine, children, started = machine_busy_s(), children_cpu_s(), time.perf_counter()
        yield
        if machine is not None:
            after = machine_busy_s()
            assert after is not None
            self.cpu_s += max(0.0, (after - machine) - (children_cpu_s() - children))
            self.wall_s += time.perf_counter() - started

    @property
    def cores(self) -> float | None:
        """The cores the other processes kept busy, on average; None where this machine cannot tell."""
        return self.cpu_s / self.wall_s if self.wall_s else None

    def is_busy(self, machine_cores: int) -> bool:
        """Whether the other processes took enough of ``machine_cores`` to make the predictions low: more than
        ``BUSY_SHARE`` of them (quiet runs measured 0.02-0.03 of 2 cores; 0.03-0.17 met the goal once in five)."""
        return self.cores is not None and self.cores > BUSY_SHARE * machine_cores

    def context(self, machine_cores: int) -> str:
        """What a verdict was reached under, for a reader to tell a busy machine from a wrong model."""
        if self.cores is None:
            return f"this machine cannot tell how much of its {machine_cores} cores other processes used"
        used = f"other processes used {self.cores:.2f} of its {machine_cores} cores"
        if not self.is_busy(machine_cores):
            return f"the machine was quiet: {used}"
        return (f"the machine was busy: {used} while the demo trained, and the model gives every rank a core of its "
                "own; rerun on a quiet machine to judge the predictions")


def usable_cores() -> int:
    """The cores this process may run on (its affinity, as a container or taskset limits it), else the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def default_layout(cores: int) -> tuple[int, int]:
    """(dp, cp) of as many processes as ``cores``, at most 4: dp 2 × cp 2, else dp 1 × cp 2, else one process."""
    if cores >= 4:
        return 2, 2
    return (1, 2) if cores >= 2 else (1, 1)


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


def summarize(scheduler: str, runs: Sequence[list[dict[str, object]]], wall_time_s: float) -> RunSummary:
    """A scheduler's runs (one a round) as one: the times of every step but each run's first, which pays one-off
    costs (its first plan, the allocator's growth), and every step's loss."""
    metrics = [m for run in runs for m in run]
    steady = [m for run in runs for m in (run[1:] or run)]

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


# The service as the demo needs it: one worker, its pools started on first use (no demo request needs them), so that
# it loads no core while profiles are measured and runs train (by default a worker per core, and each warms its
# pools in the background after it reports ready).
QUIET_SERVICE = {"SKRULL_WORKERS": "1", "SKRULL_CPSAT_WARMUP": "false"}
SERVICE_READY_TIMEOUT_S = 900.0  # its kernels compiled with a cold cache while other work loads the machine
SPEEDUP_GOAL = 2.0
PREDICTION_TOLERANCE = 0.15
BUSY_SHARE = 0.05  # of the machine's cores, taken by other processes: the verdicts say the machine was busy


def round_lines(rounds: Sequence[Mapping[str, RunSummary]]) -> list[str]:
    """Each round's predicted and measured micro-batch times, per scheduler."""
    lines = []
    for number, round_ in enumerate(rounds, start=1):
        parts = [f"{run.scheduler} predicted {run.predicted_step_time_s:.3f} s, measured "
                 f"{run.micro_batch_time_s:.3f} s ({run.predicted_step_time_s / run.micro_batch_time_s - 1:+.1%})"
                 for run in round_.values()]
        lines.append(f"round {number}: " + "; ".join(parts))
    return lines


def format_table(skrull: RunSummary, deepspeed: RunSummary, *, profile: str, other_work: OtherWork,
                 machine_cores: int) -> str:
    """The two schedulers side by side, and the verdicts on the goals, each with the load it was reached under
    (``other_work`` on ``machine_cores``): a miss on a busy machine reads as such, not as a broken model. The goals
    are the same either way."""
    rel = max_relative_difference(skrull.losses, deepspeed.losses)
    rows = [
        f"plans and predictions: {profile}",
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
    predictions_met = max(errors) <= PREDICTION_TOLERANCE
    busy = " on a busy machine" if other_work.is_busy(machine_cores) else ""
    rows += [
        f"losses equal at every step: {'yes' if rel <= 1e-5 else 'NO'} (max relative difference {rel:.2e}, "
        f"tolerance 1e-05)",
        f"speedup skrull vs deepspeed: predicted {predicted:.2f}x | measured {measured:.2f}x (micro-batches), "
        f"{whole:.2f}x (whole step)",
        f"goal measured whole-step speedup >= {SPEEDUP_GOAL:.1f}x: "
        f"{'met' if whole >= SPEEDUP_GOAL else 'MISSED' + busy}",
        f"goal predictions within {PREDICTION_TOLERANCE:.0%} of the measured micro-batch times: "
        f"{'met' if predictions_met else 'MISSED' + busy} (worst {max(errors):.1%}; "
        f"the predicted speedup is {speedup_error:+.1%} off the measured)",
        other_work.context(machine_cores),
    ]
    return "\n".join(rows)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m trainer_client.demo",
                                     description="The end-to-end demo (make demo): the service plans, a CPU trainer "
                                                 "trains, Skrull vs DeepSpeed.")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of a profile and one run of each scheduler")
    parser.add_argument("--steps", type=int, default=7, help="training steps of each run (the first is not timed)")
    parser.add_argument("--global-batch", type=int, default=16, help="sequences per global batch")
    parser.add_argument("--bucket-size", type=int, default=4096, help="tokens one CP rank holds (BucketSize)")
    parser.add_argument("--dp", type=int, help="data-parallel size (default: from the cores, default_layout)")
    parser.add_argument("--cp", type=int, help="context-parallel size (default: from the cores)")
    parser.add_argument("--data", default="synthetic:lmsys", help="the trainer's --data")
    parser.add_argument("--profile", default="measure",
                        help="'measure': profile this machine at the start of each round, with the run's processes "
                             "(about a minute); or a shipped profile name (cpu-tiny) for every round")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cores = usable_cores()
    default_dp, default_cp = default_layout(cores)
    dp, cp = args.dp or default_dp, args.cp or default_cp
    nproc = dp * cp
    if nproc > cores:
        print(f"note: {nproc} processes on {cores} cores share them, which no profile describes well: predictions "
              "hold best with no more processes than cores", flush=True)
    print(f"{cores} cores: dp {dp} × cp {cp} ({nproc} CPU processes, --sharding zero2), {args.rounds} rounds; load "
          f"average {os.getloadavg()[0]:.1f}", flush=True)
    rounds: list[dict[str, RunSummary]] = []
    other_work = [OtherWork() for _ in range(args.rounds)]
    runs: dict[str, list[list[dict[str, object]]]] = {"skrull": [], "deepspeed": []}
    wall_time_s = dict.fromkeys(runs, 0.0)
    with tempfile.TemporaryDirectory(prefix="skrull-demo-") as work:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        print(f"starting the scheduler service on {url} …", flush=True)
        # Before the first profile: it compiles its planner, which with a cold JIT cache takes minutes on a loaded
        # 2-core machine and would load the profile's measurement.
        service = start_service(port, ready_timeout_s=SERVICE_READY_TIMEOUT_S, settings=QUIET_SERVICE)
        try:
            for number in range(args.rounds):
                profile = args.profile
                if profile == "measure":
                    profile = str(Path(work) / f"profile-{number}.json")
                    print(f"round {number + 1}: measuring a CPU profile of this machine ({nproc} processes) …",
                          flush=True)
                    result = run_trainer(profile_command(
                        name=f"cpu-tiny-demo-{number + 1}", out=Path(profile), nproc=nproc,
                        comm_sizes=demo_comm_sizes(bucket_size=args.bucket_size, cp=cp),
                        sizes=demo_compute_sizes(bucket_size=args.bucket_size)))
                    if result.returncode != 0:
                        print(result.stderr[-4000:], file=sys.stderr)
                        print(f"error: profiling failed with exit code {result.returncode}", file=sys.stderr)
                        return 1
                round_: dict[str, RunSummary] = {}
                for scheduler in runs:
                    metrics_out = Path(work) / f"{scheduler}-{number}.jsonl"
                    # Each round draws other batches (its seed); both schedulers train the same ones.
                    command = trainer_command(scheduler=scheduler, metrics_out=metrics_out, scheduler_url=url,
                                              nproc=nproc, dp=dp, cp=cp, steps=args.steps, seed=number,
                                              global_batch=args.global_batch, bucket_size=args.bucket_size,
                                              data=args.data, extra=["--profile", profile, "--sharding", "zero2",
                                                                     "--job-id", f"demo-{scheduler}-{number + 1}"])
                    print(f"round {number + 1}: training {args.steps} steps with --scheduler {scheduler} …",
                          flush=True)
                    started = time.perf_counter()
                    with other_work[number].measured():
                        result = run_trainer(command)
                    if result.returncode != 0:
                        print(result.stderr[-4000:], file=sys.stderr)
                        print(f"error: the {scheduler} run failed with exit code {result.returncode}", file=sys.stderr)
                        return 1
                    wall_time_s[scheduler] += time.perf_counter() - started
                    runs[scheduler].append(read_metrics(metrics_out))
                    round_[scheduler] = summarize(scheduler, runs[scheduler][-1:], time.perf_counter() - started)
                rounds.append(round_)
        finally:
            stop_service(service)
            print("scheduler service stopped", flush=True)
    summaries = {scheduler: summarize(scheduler, scheduler_runs, wall_time_s[scheduler])
                 for scheduler, scheduler_runs in runs.items()}
    source = ("a profile measured at the start of each round" if args.profile == "measure"
              else f"profile {args.profile}")
    print()
    whole = OtherWork(cpu_s=sum(work.cpu_s for work in other_work), wall_s=sum(work.wall_s for work in other_work))
    print(format_table(summaries["skrull"], summaries["deepspeed"], profile=source, other_work=whole,
                       machine_cores=cores))
    print("\n".join(f"{line}; other processes used {_cores_text(work)}" for line, work in
                    zip(round_lines(rounds), other_work, strict=True)))
    print(f"load average at the end {os.getloadavg()[0]:.1f}")
    rel = max_relative_difference(summaries["skrull"].losses, summaries["deepspeed"].losses)
    return 0 if rel <= 1e-5 else 1


def _cores_text(work: OtherWork) -> str:
    return "an unknown share" if work.cores is None else f"{work.cores:.2f} cores"


if __name__ == "__main__":
    sys.exit(main())
