"""Advice against measurement on this machine: the layouts ``skrull-advise`` ranks for 4 CPU processes, each trained.

    python -m benchmarks.advise_cpu                      # profile this machine (4 processes), advise, train each layout
    python -m benchmarks.advise_cpu --profile prof.json  # a profile measured so before (saves 4-7 minutes)
    python -m benchmarks.advise_cpu --rounds 2           # train every layout twice, interleaved
    python -m benchmarks.advise_cpu --processes 2        # the control: one process per core, CP 1 and 2

1. The profile: ``--profile FILE``, or measured here first as ``make demo`` measures its own
   (``trainer_client.demo.profile_command``: ``torchrun --nproc-per-node 4 -m trainer_client.profile``, 4 ranks
   sharing the cores as they will in training, collectives up to one layer's K/V of the largest global batch).
   The shipped ``cpu-tiny`` is not that profile: it was measured with 2 ranks, so it has no 4-rank collectives and
   its compute does not share the cores 4 ways (in one run it predicted dp 1 × cp 4's steps about 9x short).
2. The data: ``--steps × --global-batch`` records of random token ids (a JSONL file in a temporary folder), their
   lengths drawn from the ``lmsys`` sampler cut at ``--max-length`` (the demo's ``synthetic:lmsys``, shorter): most
   records a few hundred tokens, a tail at the cut. Every layout trains the same records in the same order.
3. The advice (``scheduler_service.core.advise.advise``, the CLI's core): the tiny model on 4 "GPUs" of one node,
   ``zero2``, ``float32``, 16 sequences per step, CP 1, 2 and 4, the sample read from the file as the CLI reads
   it. Each layout gets the memory model's BucketSize, which on a CPU's host memory is about a million tokens:
   every record fits, so every step is one micro-batch per DP rank.
4. Every priced layout trains with the command the advice prints for it: ``torchrun`` becomes ``python -m
   torch.distributed.run --standalone``, and ``--steps``, ``--no-progress`` and ``--metrics-out`` are added (its
   ``--profile`` names the profile file, as the CLI's does).
5. From each run's metrics, after ``--warmup`` steps: the step time (``step_time_s``), the slowest rank's time in
   its micro-batches (``micro_batch_time_s``: what the performance model predicts) and the planner's estimate of
   each trained step's plan (``estimated_time_ms``); tokens per second per GPU over those steps.

Prints the advice, then per layout its predicted rank, step time and throughput, the same model's estimate of the
steps it trained, what was measured and the measured rank; whether the predicted ranking holds and Spearman's rank
correlation. Ranks are by tokens per second per GPU, as the advice ranks. Ratios are measured in the same run; the
machine's load average is printed before and after, since other jobs on the 2 shared cores move every time (the
history in ``docs/benchmark-history.md`` has the demo's runs moving by up to 2x). About 6 minutes on the 2-core
development machine at load average 2-4 (the profile 4 of them; each training run 30-40 s, 25 s of it start-up),
10 at load 8; ``--profile FILE`` saves the profile's share.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from scheduler_service.contract.advice import TrainerSources, advice_document, global_batch_size, trainer_argv
from scheduler_service.contract.profiles import load_profile
from scheduler_service.core.advise import Advice, LayoutProblem, PricedLayout, advise
from scheduler_service.core.memory import Sharding
from scheduler_service.core.models import resolve_model
from scheduler_service.core.samplers import sample_lengths
from trainer_client.advise.command import format_advice
from trainer_client.advise.inputs import read_lengths
from trainer_client.demo import demo_comm_sizes, profile_command, read_metrics, run_trainer

__all__ = ["LayoutRun", "local_argv", "main", "measured_ranks", "spearman", "write_records"]

MODEL = "tiny"
VOCAB_SIZE = 1024  # the tiny model's
TRAINER_TIMEOUT_S = 600.0
# Of each step's metrics line (trainer_client.components.step_metrics.StepMetrics): all numbers.
_KEPT_METRICS = ("step", "tokens", "step_time_s", "micro_batch_time_s", "estimated_time_ms")


def write_records(path: Path, lengths: Sequence[int], *, seed: int) -> None:
    """One ``{"input_ids": [...]}`` record per length, token ids uniform over the tiny model's vocabulary."""
    rng = np.random.default_rng(seed)
    with path.open("w") as records:
        for length in lengths:
            records.write(json.dumps({"input_ids": rng.integers(1, VOCAB_SIZE, size=length).tolist()}) + "\n")


def local_argv(advice: Advice, priced: PricedLayout, sources: TrainerSources, *, steps: int,
               metrics_out: Path) -> list[str]:
    """The advice's command for ``priced``, run by this Python (as ``tests/test_advise_cli.py`` runs it)."""
    command = list(trainer_argv(advice, priced.layout, sources))
    assert command[:3] == ["torchrun", "--nproc-per-node", str(priced.num_gpus)], command
    assert command[command.index("--profile") + 1] == sources.profile, command
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", *command[1:], "--steps", str(steps),
            "--no-progress", "--metrics-out", str(metrics_out)]


@dataclass(frozen=True, kw_only=True, slots=True)
class LayoutRun:
    """One layout: what the advice predicted, and the steady steps of its training runs (warm-up dropped)."""

    priced: PricedLayout
    advised_rank: int
    steps: tuple[dict[str, float], ...]
    wall_time_s: float

    def _values(self, key: str) -> list[float]:
        return [step[key] for step in self.steps]

    @property
    def label(self) -> str:
        return f"dp {self.priced.layout.dp_size} × cp {self.priced.layout.cp_size}"

    @property
    def planned_step_s(self) -> float:
        """The performance model's estimate of the trained steps' plans, median."""
        return statistics.median(self._values("estimated_time_ms")) / 1e3

    @property
    def micro_batch_s(self) -> float:
        return statistics.median(self._values("micro_batch_time_s"))

    @property
    def step_s(self) -> float:
        return statistics.median(self._values("step_time_s"))

    @property
    def tokens_per_s_per_gpu(self) -> float:
        """Measured over the whole steps: what a run sees."""
        return sum(self._values("tokens")) / sum(self._values("step_time_s")) / self.priced.num_gpus

    @property
    def planned_tokens_per_s_per_gpu(self) -> float:
        return sum(self._values("tokens")) / (sum(self._values("estimated_time_ms")) / 1e3) / self.priced.num_gpus

    @property
    def planned_over_micro_batches(self) -> float:
        return sum(self._values("estimated_time_ms")) / 1e3 / sum(self._values("micro_batch_time_s"))

    @property
    def planned_over_step(self) -> float:
        return sum(self._values("estimated_time_ms")) / 1e3 / sum(self._values("step_time_s"))


def _ranks(values: Sequence[float]) -> list[float]:
    """1 for the largest value; ties share the mean of their ranks."""
    order = sorted(range(len(values)), key=lambda index: -values[index])
    ranks = [0.0] * len(values)
    position = 0
    while position < len(order):
        end = position
        while end + 1 < len(order) and values[order[end + 1]] == values[order[position]]:
            end += 1
        for index in order[position:end + 1]:
            ranks[index] = (position + end) / 2 + 1
        position = end + 1
    return ranks


def measured_ranks(runs: Sequence[LayoutRun]) -> list[float]:
    return _ranks([run.tokens_per_s_per_gpu for run in runs])


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rank correlation of two rankings (the Pearson correlation of the ranks, ties averaged)."""
    ranks_a, ranks_b = np.asarray(_ranks(a)), np.asarray(_ranks(b))
    if ranks_a.std() == 0 or ranks_b.std() == 0:
        return float("nan")
    return float(np.corrcoef(ranks_a, ranks_b)[0, 1])


def _measure_profile(path: Path, *, num_processes: int, max_batch_tokens: int, repeats: int) -> None:
    """As ``make demo`` measures its profile: as many ranks as will train, sharing the cores; collectives up to one
    layer's K/V of the largest global batch (with a million-token bucket, one micro-batch may hold all of it)."""
    comm_sizes = demo_comm_sizes(bucket_size=max_batch_tokens, cp=1)
    result = run_trainer(profile_command(name="cpu-tiny-advise", out=path, nproc=num_processes, repeats=repeats,
                                         comm_sizes=comm_sizes), timeout_s=TRAINER_TIMEOUT_S)
    if result.returncode != 0:
        raise RuntimeError(f"profiling failed with exit code {result.returncode}: {result.stderr[-3000:]}")


def _train(
    advice: Advice, priced: PricedLayout, sources: TrainerSources, *, steps: int, metrics_out: Path,
) -> tuple[list[dict[str, float]], float]:
    """Train ``priced`` with its command; each step's kept metrics, and the run's wall time (start-up included)."""
    started = time.perf_counter()
    result = run_trainer(local_argv(advice, priced, sources, steps=steps, metrics_out=metrics_out),
                         timeout_s=TRAINER_TIMEOUT_S)
    wall_time_s = time.perf_counter() - started
    if result.returncode != 0:
        raise RuntimeError(f"training {priced.layout.label} failed with exit code {result.returncode}: "
                           f"{result.stderr[-3000:]}")
    return [{key: float(value) for key, value in step.items() if key in _KEPT_METRICS}  # type: ignore[arg-type]
            for step in read_metrics(metrics_out)], wall_time_s


def _print_table(advice: Advice, runs: Sequence[LayoutRun]) -> None:
    print("| layout | bucket | advised rank | advised step ms | advised tok/s/GPU | planned step ms | "
          "measured micro-batches ms | measured step ms | measured tok/s/GPU | measured rank | "
          "planned / micro-batches | planned / step |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for run, measured_rank in zip(runs, measured_ranks(runs), strict=True):
        priced = run.priced
        print(f"| {run.label} | {priced.layout.bucket_size} | {run.advised_rank} | "
              f"{priced.predicted_step_time_s * 1e3:.0f} | {priced.tokens_per_s_per_gpu:,.0f} | "
              f"{run.planned_step_s * 1e3:.0f} | {run.micro_batch_s * 1e3:.0f} | {run.step_s * 1e3:.0f} | "
              f"{run.tokens_per_s_per_gpu:,.0f} | {measured_rank:g} | {run.planned_over_micro_batches:.2f} | "
              f"{run.planned_over_step:.2f} |")


def _verdict(runs: Sequence[LayoutRun]) -> list[str]:
    """Whether the advice's ranking holds, and whether the model's estimates of the trained steps rank alike."""
    measured = [run.tokens_per_s_per_gpu for run in runs]
    advised = [-float(run.advised_rank) for run in runs]  # larger is better, as the throughputs
    planned = [run.planned_tokens_per_s_per_gpu for run in runs]

    def order(values: Sequence[float]) -> str:
        return " > ".join(runs[index].label for index in sorted(range(len(runs)), key=lambda index: -values[index]))

    holds = _ranks(advised) == _ranks(measured)
    winner = max(runs, key=lambda run: run.tokens_per_s_per_gpu)
    lead = sorted(measured)[-1] / sorted(measured)[-2] - 1 if len(runs) > 1 else 0.0
    return [
        f"advised ranking:  {order(advised)}",
        f"measured ranking: {order(measured)} (whole steps; the fastest leads by {lead:.1%})",
        f"the advised ranking {'holds' if holds else 'does NOT hold'}: Spearman rank correlation "
        f"{spearman(advised, measured):+.2f}; the advised winner {runs[0].label} "
        f"{'is' if winner is runs[0] else 'is not'} the measured one",
        f"the model's estimates of the trained steps rank them {order(planned)} (Spearman "
        f"{spearman(planned, measured):+.2f} against the measurement)",
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.advise_cpu", description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=4,
                        help="trainer processes (the advice's GPUs, one node): 4 as make demo; 2 gives each its core")
    parser.add_argument("--profile", type=Path, help="a profile file from trainer_client.profile under torchrun "
                                                     "with --processes ranks (default: measure one here first)")
    parser.add_argument("--steps", type=int, default=12, help="training steps per run, warm-up included")
    parser.add_argument("--warmup", type=int, default=2, help="first steps of each run left out of the medians")
    parser.add_argument("--rounds", type=int, default=1, help="training runs per layout, interleaved")
    parser.add_argument("--global-batch", type=int, default=16, help="sequences per step")
    parser.add_argument("--max-length", type=int, default=3072, help="the records' longest length (lmsys cut here)")
    parser.add_argument("--profile-repeats", type=int, default=3, help="the profiler's timed runs per case")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="write the advice, the measured steps and the verdict as JSON")
    args = parser.parse_args(argv)
    if not 0 <= args.warmup < args.steps:
        parser.error(f"--warmup must be between 0 and --steps - 1, got {args.warmup}")

    started = time.perf_counter()
    load_before = os.getloadavg()
    print(f"{os.cpu_count()} CPUs, load average {load_before[0]:.1f} (1 min), {load_before[1]:.1f} (5 min) at the "
          "start", flush=True)
    with tempfile.TemporaryDirectory(prefix="skrull-advise-cpu-") as folder:
        work = Path(folder)
        lengths = sample_lengths("lmsys", args.steps * args.global_batch, np.random.default_rng(args.seed),
                                 max_length=args.max_length)
        records = work / "records.jsonl"
        write_records(records, lengths.tolist(), seed=args.seed)
        # The trainer's steps are consecutive slices of a permutation: none holds more than the longest records do.
        max_batch_tokens = int(np.sort(lengths)[-args.global_batch:].sum())
        profile_path = args.profile
        if profile_path is None:
            profile_path = work / "cpu-tiny-advise.json"
            print(f"measuring a CPU profile of this machine ({args.processes} processes) …", flush=True)
            _measure_profile(profile_path, num_processes=args.processes, max_batch_tokens=max_batch_tokens,
                             repeats=args.profile_repeats)
        profile = load_profile(profile_path)

        problem = LayoutProblem(
            sequence_lengths=read_lengths(str(records), sample_size=len(lengths), seed=args.seed),
            model=resolve_model(MODEL), profile=profile, num_gpus=args.processes,
            gpus_per_node=args.processes,
            global_batch=global_batch_size(sequences=args.global_batch, tokens=None), shardings=(Sharding.ZERO2,),
            compute_bytes=4, seed=args.seed)
        sources = TrainerSources(data=str(records), profile=str(profile_path))
        advice = advise(problem)
        print()
        print(format_advice(advice, sources))
        print()
        for priced in advice.layouts:
            # Every record must fit: the trainer refuses a record longer than bucket_size × cp_size.
            assert priced.layout.longest_trainable_sequence >= int(lengths.max()), priced.layout

        steps: dict[int, list[dict[str, float]]] = {rank: [] for rank in range(1, len(advice.layouts) + 1)}
        wall_times_s: dict[int, float] = dict.fromkeys(steps, 0.0)
        for round_index in range(args.rounds):
            # Each round starts with another layout, so that a change in the machine's load spreads over all.
            order = list(range(1, len(advice.layouts) + 1))
            order = order[round_index % len(order):] + order[:round_index % len(order)]
            for rank in order:
                priced = advice.layouts[rank - 1]
                print(f"training {args.steps} steps with {priced.layout.label} (round {round_index + 1} of "
                      f"{args.rounds}) …", flush=True)
                metrics, wall_time_s = _train(advice, priced, sources, steps=args.steps,
                                              metrics_out=work / f"metrics-{rank}-{round_index}.jsonl")
                steps[rank] += metrics[args.warmup:]
                wall_times_s[rank] += wall_time_s
        runs = [LayoutRun(priced=priced, advised_rank=rank, steps=tuple(steps[rank]),
                          wall_time_s=wall_times_s[rank]) for rank, priced in enumerate(advice.layouts, start=1)]

    load_after = os.getloadavg()
    print()
    print(f"## Advice against measurement: {MODEL} on {args.processes} CPU processes, profile {profile.name}, "
          f"{args.global_batch} sequences per step (longest {int(lengths.max())} tokens), medians of "
          f"{args.rounds} × {args.steps - args.warmup} steps per layout\n")
    _print_table(advice, runs)
    print()
    for line in _verdict(runs):
        print(line)
    print("training runs (start-up included): " + ", ".join(f"{run.label} {run.wall_time_s:.0f} s" for run in runs))
    print(f"load average {load_after[0]:.1f} (1 min) at the end; {time.perf_counter() - started:.0f} s in all")
    if args.out is not None:
        document = advice_document(advice, sources)
        placeholders = TrainerSources(data=sources.data, profile="PROFILE")
        args.out.write_text(json.dumps({
            "advice": document, "profile": str(args.profile) if args.profile else "measured",
            "load_average": {"start": load_before, "end": load_after},
            "runs": [{"layout": document["layouts"][run.advised_rank - 1], "advised_rank": run.advised_rank,
                      "steps": list(run.steps), "trainer_command": shlex.join(local_argv(
                          advice, run.priced, placeholders, steps=args.steps, metrics_out=Path("METRICS")))}
                     for run in runs],
            "verdict": _verdict(runs),
        }, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
