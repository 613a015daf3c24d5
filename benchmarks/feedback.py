"""Feedback benchmark: a deliberately wrong starting profile converges to the measured one while a job trains.

    python -m benchmarks.feedback                      # profile this machine, then 40 training steps
    python -m benchmarks.feedback --profile cpu-tiny.json --steps 30

1. The measured profile: ``--profile FILE``, or the profiler run here first
   (one process, one thread, as the trainer's ranks).
2. A wrong start: the measured profile with its compute cost ×``--compute-factor``
   and its fixed cost per packed group ×``--fixed-factor`` (default 4× and
   0.1×), written into a profile folder the service loads (``SKRULL_PROFILE_DIR``).
3. The real service (``python -m scheduler_service serve``) and the real trainer
   (tiny model, ``synthetic:lmsys``, DP 1 × CP 1, ``--feedback``, the wrong
   profile) train ``--steps`` steps; the trainer reports each step's measured
   micro-batch times (``POST /feedback``) and plans with the job's refit.
4. After every step: the refit's prediction error against the measured profile
   over a fixed probe set of micro-batches, and against the times the trainer
   measured in the *next* step (out of sample). Converged = the probe error
   stays ≤ 10% from that step on.

A second, simulated part shows the memory side, which a CPU trainer cannot
measure per micro-batch (it has no allocator peak): peaks drawn from the
measured memory fit, a start that believes activations take half their real
size, and a budget the requested bucket would overrun; the BucketSize cap
converges to the largest safe bucket and no planned micro-batch overruns.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch

from scheduler_service.core.feedback import MicroBatchMeasurement, effective_bucket_size, observe, start_job
from scheduler_service.core.models import MODEL_CATALOGUE
from scheduler_service.core.perf_model import PerformanceModel
from scheduler_service.core.plan import SchedulerName
from scheduler_service.core.profile import Profile, parse_profile
from scheduler_service.core.samplers import sample_lengths
from trainer_client.config import TrainConfig
from trainer_client.data import GlobalBatch
from trainer_client.demo import start_service, stop_service
from trainer_client.distributed import ParallelDims, free_port, init_parallel, spawn_gloo
from trainer_client.planning.source import PlanDecision
from trainer_client.profiler.command import ProfileOptions, measure_profile
from trainer_client.trainer import Trainer

__all__ = ["main"]

CONVERGED_ERROR = 0.10
MODEL = "tiny"
BUCKET_SIZE = 2048


def _wrong_document(measured: dict[str, Any], compute_factor: float, fixed_factor: float) -> dict[str, Any]:
    compute = dict(measured["compute"])
    for key in ("alpha_s_per_flop", "alpha_s_per_token", "alpha_s_per_sequence"):
        compute[key] = compute[key] * compute_factor
    compute["beta_s_per_layer"] = compute["beta_s_per_layer"] * fixed_factor
    return {**measured, "name": "wrong-start", "compute": compute,
            "description": f"{measured['name']} with compute ×{compute_factor:g} and β ×{fixed_factor:g}: "
                           "deliberately wrong, for benchmarks.feedback"}


def _probe_lengths(seed: int) -> list[list[int]]:
    """Micro-batches like the trainer's: sampled sequences packed up to the bucket."""
    rng = np.random.default_rng(seed)
    probes = []
    for dataset in ("lmsys", "wikipedia", "chatqa2"):
        for _ in range(30):
            lengths = sample_lengths(dataset, 8, rng, max_length=BUCKET_SIZE).tolist()
            packed, total = [], 0
            for length in lengths:
                if total + length <= BUCKET_SIZE:
                    packed.append(length)
                    total += length
            probes.append(packed)
    return probes


def _predict_s(profile: Profile, lengths: Sequence[int]) -> float:
    perf = PerformanceModel(model=MODEL_CATALOGUE[MODEL], profile=profile)
    return perf.compute_time_s(float(perf.placement_flops(lengths, 1).sum()))


def _refit_profile(measured: Profile, state: dict[str, Any]) -> Profile:
    compute = replace(measured.compute, **state["compute"])
    return replace(measured, compute=compute)


def _train(url: str, job_id: str, steps: int, out_path: Path) -> None:
    """One gloo rank: train with feedback; after every step record the measured micro-batches and the job."""
    config = TrainConfig(dp=1, cp=1, model=MODEL, data="synthetic:lmsys", global_batch=16, steps=steps,
                         scheduler=SchedulerName.SKRULL, scheduler_url=url, bucket_size=BUCKET_SIZE,
                         profile="wrong-start", feedback=True, job_id=job_id, progress=False)
    trainer = Trainer(config, init_parallel(ParallelDims.of(config)))
    decisions: dict[int, Any] = {}
    decide = trainer.batches.decide

    def recording_decide(batch: GlobalBatch) -> PlanDecision:
        decisions[batch.step] = decision = decide(batch)
        return decision

    trainer.batches.decide = recording_decide  # type: ignore[method-assign]
    records = []
    with httpx.Client(base_url=url, timeout=10.0) as client:
        seen = 0
        for step in range(steps):
            batch = trainer.source.batch(step)
            metrics = trainer.train_step(step, batch)
            micro_batches = decisions.pop(step).plan.dp_ranks[0].micro_batches
            measured = [{"lengths": [batch.sequence_lengths[i] for i in micro_batches[t.index].indices()],
                         "time_s": t.time_s} for t in trainer.micro_batch_timings]
            if step > 0:  # step 0 is not reported (warm-up); wait for this step's report to land
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline:
                    state = client.get(f"/feedback/{job_id}").json()
                    if state["num_observations"] > seen:
                        seen = state["num_observations"]
                        break
                    time.sleep(0.01)
            else:
                state = client.get(f"/feedback/{job_id}").json()
            records.append({"step": metrics.step, "step_time_s": metrics.step_time_s, "state": state,
                            "measured": measured, "plan_source": metrics.plan_source})
    trainer.close()
    out_path.write_text(json.dumps(records))


def _measured_profile(path: str | None, seed: int) -> dict[str, Any]:
    if path is not None:
        document: dict[str, Any] = json.loads(Path(path).read_text())
        return document
    torch.set_num_threads(1)  # as one trainer rank
    measured = measure_profile(ProfileOptions(model=MODEL, progress=False, seed=seed))
    assert measured is not None
    return measured


def compute_part(args: argparse.Namespace, measured_document: dict[str, Any]) -> int:
    measured = parse_profile(measured_document)
    probes = _probe_lengths(args.seed)
    truth = [_predict_s(measured, lengths) for lengths in probes]
    with tempfile.TemporaryDirectory(prefix="skrull-feedback-") as work:
        profile_dir = Path(work) / "profiles"
        profile_dir.mkdir()
        wrong = _wrong_document(measured_document, args.compute_factor, args.fixed_factor)
        (profile_dir / "wrong-start.json").write_text(json.dumps(wrong))
        os.environ["SKRULL_PROFILE_DIR"] = str(profile_dir)
        port = free_port()
        service = start_service(port)
        try:
            out_path = Path(work) / "records.json"
            spawn_gloo(_train, 1, f"http://127.0.0.1:{port}", "feedback-benchmark", args.steps, out_path)
            records = json.loads(out_path.read_text())
        finally:
            stop_service(service)
    print(f"## Compute: start = measured profile with compute ×{args.compute_factor:g}, β ×{args.fixed_factor:g}; "
          f"{args.steps} training steps (tiny, lmsys, DP 1 × CP 1, bucket {BUCKET_SIZE})\n")
    print("| after step | reported micro-batches | compute scale | probe error median | probe error worst | "
          "next step's measured times: median error |")
    print("|---|---|---|---|---|---|")
    converged_at = None
    probe_medians = []
    for index, record in enumerate(records):
        state = record["state"]
        refit = _refit_profile(measured, state) if state["num_observations"] else parse_profile(
            _wrong_document(measured_document, args.compute_factor, args.fixed_factor))
        errors = [abs(_predict_s(refit, lengths) - t) / t for lengths, t in zip(probes, truth, strict=True)]
        probe_medians.append(statistics.median(errors))
        next_error = "–"
        if index + 1 < len(records):
            # The refit after step s plans step s + 1: compare its predictions with what step s + 1 measured.
            next_errors = [abs(_predict_s(refit, m["lengths"]) - m["time_s"]) / m["time_s"]
                           for m in records[index + 1]["measured"]]
            next_error = f"{statistics.median(next_errors):.1%}"
        if index < 6 or index % 5 == 4 or index == len(records) - 1:
            print(f"| {record['step']} | {state['num_observations']} | {state['compute_scale']:.3f} | "
                  f"{statistics.median(errors):.1%} | {max(errors):.1%} | {next_error} |")
    for index in range(len(probe_medians)):
        if all(error <= CONVERGED_ERROR for error in probe_medians[index:]):
            converged_at = records[index]["step"]
            break
    start_error = probe_medians[0]
    print(f"\nprobe error (median): {start_error:.0%} at the start → {probe_medians[-1]:.1%} after {args.steps} steps; "
          f"within {CONVERGED_ERROR:.0%} from step {converged_at} on" if converged_at is not None else
          f"\nprobe error never settled within {CONVERGED_ERROR:.0%} (last {probe_medians[-1]:.1%})")
    return 0 if converged_at is not None else 1


def memory_part(measured_document: dict[str, Any], seed: int, steps: int) -> int:
    """Simulated peaks from the measured memory fit (a CPU trainer reports none), a start that halves them."""
    model = MODEL_CATALOGUE[MODEL]
    measured = parse_profile(measured_document)
    perf = PerformanceModel(model=model, profile=measured)
    requested_bucket = 16384
    # A budget the requested bucket would overrun by a third: the safe bucket is about 3/4 of it.
    budget = perf.peak_bytes(requested_bucket, 1) / 0.9 * 0.75
    safe_bucket = perf.bucket_size(1, device_memory_bytes=budget * 0.9)
    memory = measured.memory
    halved = replace(memory, activation_fixed_bytes_per_token=memory.activation_fixed_bytes_per_token / 2)
    wrong = replace(measured, memory=halved)
    job = start_job("memory", base=wrong, model=model, dp_size=1, cp_size=1, memory_budget_bytes=budget)
    rng = np.random.default_rng(seed)
    print(f"\n## Memory (simulated peaks): requested bucket {requested_bucket}, budget {budget / 2**20:.0f} MiB, "
          f"largest bucket under 90% of it {safe_bucket}\n")
    print("| after step | bucket used | worst peak / budget | bucket cap |")
    print("|---|---|---|---|")
    overruns = []
    for step in range(steps):
        bucket = effective_bucket_size(job, requested_bucket, 1)
        measurements, worst = [], 0.0
        for _ in range(4):
            tokens = int(bucket * rng.uniform(0.6, 1.0))
            peak = perf.peak_bytes(tokens, 1) * rng.lognormal(0, 0.01)
            worst = max(worst, peak / budget)
            if peak > budget:
                overruns.append(step)
            measurements.append(MicroBatchMeasurement(local_lengths=((tokens,),), distributed_lengths=(),
                                                      time_s=0.1, peak_memory_bytes=peak))
        job = observe(job, measurements)
        if step < 5 or step % 5 == 4:
            print(f"| {step} | {bucket} | {worst:.2f} | {job.bucket_cap} |")
    final = effective_bucket_size(job, requested_bucket, 1)
    print(f"\nbucket cap {job.bucket_cap} vs the largest safe bucket {safe_bucket} "
          f"({(final - safe_bucket) / safe_bucket:+.1%}); micro-batches over the budget: {len(overruns)}, in steps "
          f"{sorted(set(overruns))} (step 0 is planned with the wrong start, before any report)")
    return 0 if math.isclose(final, safe_bucket, rel_tol=0.05) and set(overruns) <= {0} else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.feedback", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--profile", help="the measured profile (default: profile this machine first)")
    parser.add_argument("--compute-factor", type=float, default=4.0)
    parser.add_argument("--fixed-factor", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    measured_document = _measured_profile(args.profile, args.seed)
    status = compute_part(args, measured_document)
    status |= memory_part(measured_document, args.seed, steps=20)
    return status


if __name__ == "__main__":
    sys.exit(main())
