"""``make gpu-check``: the project on a CUDA machine in one command, within 10 minutes on one H100 or H200.

    make gpu-check                                   # the machine's own python3; artefacts in gpu-check/
    make gpu-check GPU_PYTHON=/opt/py/bin/python GPU_CHECK_ARGS="--wheels /data/wheels"

Each step runs as its own process, under a deadline, and what it printed is kept in ``gpu-check/<step>.log``:

1. ``gpu-tests``: ``pytest tests/test_gpu.py`` (the varlen kernels against SDPA in bf16, an FSDP2 bf16 step);
   without the repository's conftest, whose service fixtures need Redis and FastAPI;
2. ``profile``: ``trainer_client.profile`` measures the model on these GPUs (over 2 of them under torchrun where
   there are 2 or more, so that the profile holds collectives);
3. ``accuracy``: ``benchmarks.accuracy`` on CUDA with that profile: every micro-batch of ``skrull`` and
   ``deepspeed`` plans of three length distributions run as the trainer runs it, its time predicted vs measured;
4. ``train-skrull-…``: the trainer (``trainer_client.train`` under torchrun) with ``skrull`` for a few steps at
   DP 1 × CP 1 with that profile, and where there are 2 GPUs at DP 1 × CP 2;
5. ``train-skrull-dp1-cp1-auto``: the trainer as a user runs it on a GPU, ``--profile auto``: it measures its own
   profile (afresh, into ``gpu-check/cache``) and plans with it; how long that takes, and its fit beside step 2's;
6. the trainer's faster paths at DP 1 × CP 1 with step 2's profile: ``train-skrull-dp1-cp1-compiled``
   (``--compile``: the same plans, the blocks compiled) and ``train-skrull-dp1-cp1-cuda-graphs`` (``--cuda-graphs
   --sharding none``: rows padded to 4 token buckets, which the plans fill, each layer's graphs captured per
   bucket and replayed); the CPU rehearsal runs ``train-skrull-dp1-cp1-buckets`` (``--token-buckets 4``, the
   padding alone) instead, since neither compiles there within its time (tests/test_trainer_paths.py compiles on
   the CPU);
7. ``train-deepspeed-…``: step 4 with ``deepspeed``'s plans: the same losses, another schedule; where there are
   2 GPUs, ``train-ulysses-dp1-cp2`` too: XTuner's static Ulysses, every sequence's attention by all-to-all over heads
   on NCCL (step 4's ``skrull`` chooses each collective's scheme by step 2's profile, which measured the all-to-all);
8. ``profile-compiled`` (GPU only): step 2's sweep with ``--compile``, for the launch-bound floor per layer of
   compiled blocks beside step 2's eager one;
9. ``trl-bench``: ``benchmarks.against_trl`` (``make bench-trl``) with the model: one TRL SFT script run with TRL's
   padding, ``padding_free``, ``bfd`` packing and ``batch_rebalance`` and as ``SkrullSFTTrainer`` at every DP × CP
   split of the GPUs, tokens/s, step times, peak memory and losses against TRL padding's; only where this Python
   has TRL, datasets and accelerate (``--wheels`` brings them where their wheels are there), skipped otherwise.

Then it prints one summary and writes it as ``gpu-check/summary.json``: the machine and software, each step's
outcome and time, the GPU tests' result, the profile's fits and BucketSize, the predicted against the measured
time per micro-batch (median and worst error, by size class) and per step, whether the model orders them as they
were measured (``benchmarks.ranking``: the share of pairs of micro-batches, of steps and of one batch's plans
ordered correctly, and the regret of picking by the model, under the profile and under its two-coefficient fit),
tokens/s, how far the two schedulers' losses are apart, the peak memory per GPU, per faster path its tokens/s
against the eager run's, its losses' distance from them, its peak memory and its fitted floor, and the TRL
comparison's table.
Exit status 0 when every step ran, 1 when one failed, 2 when this machine cannot run the check (no CUDA; a
dependency missing).

It runs on the machine's own Python: no virtual environment is made and nothing is downloaded. The trainer's
dependencies must be importable (torch, transformers, peft, numpy, numba, pydantic, safetensors, httpx, tenacity,
tqdm, pyyaml), and pytest for the GPU tests; the service's (FastAPI, OR-Tools, Redis) are not needed.
``--wheels DIR`` installs the missing ones, with what they need, from wheel files brought along (``pip download``
them on a machine with a network) into ``gpu-check/site``, without touching the machine's Python. A step still
running at ``--deadline`` (10 minutes for all of them) is stopped, torchrun's workers with it. ``--rehearse``
runs the same steps on this machine's CPU with the tiny model, to check the check itself where there is no GPU.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["EXIT_CANNOT_RUN", "main"]

EXIT_CANNOT_RUN = 2
ROOT = Path(__file__).resolve().parents[1]
# Import name → distribution name: what the trainer, the profiler and the accuracy benchmark import.
TRAINER_MODULES = {"torch": "torch", "transformers": "transformers", "peft": "peft", "numpy": "numpy",
                   "numba": "numba", "pydantic": "pydantic", "safetensors": "safetensors", "httpx": "httpx",
                   "tenacity": "tenacity", "tqdm": "tqdm", "yaml": "pyyaml", "pytest": "pytest"}
# What the TRL comparison (step 9) imports beside them; without them that step is skipped.
TRL_MODULES = {"trl": "trl", "datasets": "datasets", "accelerate": "accelerate"}
STOP_GRACE_S = 30.0  # a step past its deadline gets SIGTERM (torchrun then stops its workers), then SIGKILL
SIZE_CLASS_TOKENS = 2048  # micro-batches below it are launch-bound on a GPU (the eager floor), above compute-bound


@dataclass(frozen=True, slots=True)
class FastPath:
    """One of the trainer's faster paths: the name its run is suffixed with, and its flags beside the eager run's."""

    name: str
    flags: tuple[str, ...]


GPU_FAST_PATHS = (FastPath("compiled", ("--compile",)),
                  FastPath("cuda-graphs", ("--cuda-graphs", "--sharding", "none")))
CPU_FAST_PATHS = (FastPath("buckets", ("--token-buckets", "4")),)


@dataclass(frozen=True, kw_only=True, slots=True)
class Settings:
    """What the check runs: the GPU defaults, or the CPU rehearsal's."""

    device: str
    model: str
    data: str
    global_batch: int
    steps: int
    bucket_size: int
    profile_args: tuple[str, ...]
    accuracy_args: tuple[str, ...]
    fast_paths: tuple[FastPath, ...]  # step 6
    profile_compiled: bool  # step 8
    trl_args: tuple[str, ...]  # step 9

    @classmethod
    def for_gpu(cls, model: str, steps: int) -> Settings:
        return cls(device="cuda", model=model, data="synthetic:chatqa2", global_batch=32, steps=steps,
                   bucket_size=16384,
                   profile_args=("--sizes", "512,1024,2048,4096,8192,16384", "--short-length", "512",
                                 "--memory-sizes", "4096,8192,16384", "--shard-sizes", "2048,8192", "--repeats", "3"),
                   accuracy_args=("--global-batch", "32", "--bucket-size", "16384", "--repeats", "2"),
                   fast_paths=GPU_FAST_PATHS, profile_compiled=True,
                   # the example's batch (4 chats a forward × 8 accumulated, on one GPU) and max_length
                   trl_args=("--max-length", "8192", "--global-batch", "32", "--per-device-batch", "4", "--steps",
                             "4", "--warmup", "1", "--rounds", "1"))

    @classmethod
    def for_rehearsal(cls, steps: int) -> Settings:
        # As small as still exercises every step: the tiny model, short sweeps, one repeat.
        return cls(device="cpu", model="tiny", data="synthetic:lmsys", global_batch=8, steps=steps, bucket_size=512,
                   profile_args=("--sizes", "32,128,512", "--short-length", "16", "--memory-sizes", "64,256",
                                 "--repeats", "1", "--warmup", "0", "--threads", "1"),
                   accuracy_args=("--global-batch", "8", "--bucket-size", "512", "--repeats", "1",
                                  "--datasets", "lmsys"), fast_paths=CPU_FAST_PATHS, profile_compiled=False,
                   trl_args=("--max-length", "512", "--global-batch", "8", "--per-device-batch", "2", "--steps", "2",
                             "--warmup", "1", "--rounds", "1", "--memory-steps", "0"))


@dataclass(kw_only=True, slots=True)
class Step:
    name: str
    command: list[str]
    # benchmarks.accuracy exits 3 when a median error misses its target: a finding, not a failure to run
    succeeded: tuple[int, ...] = (0,)
    returncode: int | None = None  # None: killed at its deadline
    wall_s: float = 0.0
    log: str = ""

    @property
    def ok(self) -> bool:
        return self.returncode in self.succeeded


@dataclass(kw_only=True, slots=True)
class Check:
    """Everything the check did and found: ``summary.json``."""

    machine: dict[str, Any]
    steps: list[Step] = field(default_factory=list)
    gpu_tests: dict[str, Any] = field(default_factory=dict)
    profile: dict[str, Any] = field(default_factory=dict)
    accuracy: list[dict[str, Any]] = field(default_factory=list)
    training: list[dict[str, Any]] = field(default_factory=list)
    loss_agreement: list[dict[str, Any]] = field(default_factory=list)
    auto: dict[str, Any] = field(default_factory=dict)
    paths: list[dict[str, Any]] = field(default_factory=list)
    ranking: list[dict[str, Any]] = field(default_factory=list)
    trl: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "steps": [{**asdict(step), "ok": step.ok} for step in self.steps]}


# ---------------------------------------------------------------------------------------------------- the machine


def _missing_modules() -> list[str]:
    return [name for name in TRAINER_MODULES if importlib.util.find_spec(name) is None]


def _install_wheels(wheels: Path, missing: Sequence[str], site: Path) -> None:
    """The missing distributions from ``wheels`` (no index) into ``site``, which this process and its steps read."""
    site.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--find-links", str(wheels),
                    "--target", str(site), *({**TRAINER_MODULES, **TRL_MODULES}[name] for name in missing)],
                   check=True)
    sys.path.insert(0, str(site))
    importlib.invalidate_caches()


def _missing_trl_modules() -> list[str]:
    return [name for name in TRL_MODULES if importlib.util.find_spec(name) is None]


def _machine(device: str) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
                            "host": platform.node(), "cpu_count": os.cpu_count()}
    for name in ("transformers", "peft", "numba", "numpy", "flash_attn"):
        module = importlib.util.find_spec(name)
        info[name] = _version(name) if module is not None else None
    if device == "cuda":
        info["gpus"] = [torch.cuda.get_device_name(index) for index in range(torch.cuda.device_count())]
        info["gpu_memory_bytes"] = torch.cuda.get_device_properties(0).total_memory
    return info


def _version(module: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(module.replace("_", "-"))
    except PackageNotFoundError:
        return None


# ---------------------------------------------------------------------------------------------------- the steps


def _run(step: Step, *, out_dir: Path, env: dict[str, str], deadline_s: float) -> Step:
    started = time.perf_counter()
    print(f"== {step.name}: {' '.join(step.command)}", flush=True)
    log_path = out_dir / f"{step.name}.log"
    with log_path.open("w") as log:
        # Its own session: at its deadline the whole step is stopped, not only its first process.
        process = subprocess.Popen(step.command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        try:
            step.returncode = process.wait(timeout=deadline_s)
        except subprocess.TimeoutExpired:
            _stop(process)
            log.write(f"\n[gpu-check] stopped at its deadline of {deadline_s:.0f} s\n")
    step.wall_s = time.perf_counter() - started
    step.log = str(log_path)
    outcome = "ok" if step.ok else f"FAILED (exit {step.returncode}; see {step.log})"
    print(f"   {outcome} in {step.wall_s:.0f} s", flush=True)
    return step


def _stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the step's processes, so that torchrun stops its workers (they run in sessions of their own) and
    frees the GPUs for the next step; SIGKILL to whatever is left after ``STOP_GRACE_S``."""
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def _torchrun(num_processes: int, module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(num_processes),
            "-m", module, *args]


def _gpu_test_counts(log: Path) -> dict[str, int]:
    """pytest's closing counts: ``2 passed, 1 skipped in 20.13s`` → {"passed": 2, "skipped": 1}."""
    return {kind: int(number) for number, kind in re.findall(r"(\d+) (passed|failed|skipped|errors?)", log.read_text())}


def _profile_summary(path: Path) -> dict[str, Any]:
    document = json.loads(path.read_text())
    compute, memory = document["compute"], document["memory"]
    return {"file": str(path), "fit": compute["fit"],
            "activation_bytes_per_token": memory["activation_bytes_per_token"]["fixed"],
            "beta_bytes": memory["beta_bytes"], "reserved_bytes": memory["reserved_bytes"],
            "device_memory_bytes": document["hardware"]["device_memory_bytes"],
            "attention_backend": document["provenance"]["attention_backend"]}


def _accuracy_summary(path: Path) -> list[dict[str, Any]]:
    """Per CP size: the benchmark's summary, the signed median, and the errors of small and large micro-batches."""
    cases = []
    for case in json.loads(path.read_text())["cases"]:
        rows = case["rows"]
        by_size = {}
        for label, small in ((f"< {SIZE_CLASS_TOKENS} tokens per rank", True),
                             (f">= {SIZE_CLASS_TOKENS} tokens per rank", False)):
            errors = [_error(row["predicted_s"], row["measured_s"]) for row in rows
                      if (row["tokens_per_rank"] < SIZE_CLASS_TOKENS) == small]
            if errors:
                by_size[label] = {"micro_batches": len(errors), "median_error": statistics.median(errors),
                                  "worst_error": max(errors)}
        signed = [(row["predicted_s"] - row["measured_s"]) / row["measured_s"] for row in rows]
        cases.append({"cp_size": case["cp_size"], **case["summary"], "by_size": by_size,
                      "signed_median_error": statistics.median(signed)})
    return cases


def _error(predicted: float, measured: float) -> float:
    return abs(predicted - measured) / measured


def _training_summary(name: str, metrics_path: Path) -> dict[str, Any]:
    steps = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    warm = steps[1:] or steps  # the first step pays one-off warm-up (allocator growth, first collectives)
    errors = [(s["estimated_time_ms"] / 1e3 - s["micro_batch_time_s"]) / s["micro_batch_time_s"] for s in warm
              if s["estimated_time_ms"] is not None and s["micro_batch_time_s"] > 0]
    peaks = [s["peak_memory_bytes"] for s in steps if s["peak_memory_bytes"] is not None]
    return {"run": name, "steps": len(steps), "losses": [s["loss"] for s in steps],
            "tokens_per_s": statistics.median(s["tokens_per_s"] for s in warm),
            "step_time_s": [s["step_time_s"] for s in steps],
            "predicted_vs_measured_step": {"signed_errors_after_step_0": errors,
                                           "median_abs_error": statistics.median(abs(e) for e in errors)
                                           if errors else None},
            "peak_memory_bytes": max(peaks) if peaks else None, "memory_kind": steps[-1]["memory_kind"]}


def _auto_summary(log: Path, cache: Path, sweep_profile: dict[str, Any]) -> dict[str, Any]:
    """The ``--profile auto`` run: how long measuring took, and its profile's fit beside the sweep's (step 2)."""
    measured = re.search(r"--profile auto: measured in (\d+) s", log.read_text())
    profiles = sorted(cache.glob("skrull/profiles/auto-*.json"))
    summary: dict[str, Any] = {"auto_profile_s": int(measured.group(1)) if measured else None,
                               "auto_profile": str(profiles[-1]) if profiles else None}
    if profiles:
        fit = json.loads(profiles[-1].read_text())["compute"]["fit"]
        summary["fit"] = fit[fit.get("form", "extended")]
        summary["sweep_fit"] = sweep_profile["fit"][sweep_profile["fit"].get("form", "extended")]
    return summary


def _floor_ms_per_layer(profile: dict[str, Any]) -> float | None:
    """A profile summary's launch-bound floor per layer, in ms (None: its kept fit has none)."""
    floor = profile["fit"][profile["fit"].get("form", "extended")].get("floor_s_per_layer") if profile else None
    return floor * 1e3 if floor else None


def _paths_summary(training: Sequence[dict[str, Any]], paths: Sequence[FastPath], *, eager_profile: dict[str, Any],
                   compiled_profile: dict[str, Any]) -> list[dict[str, Any]]:
    """Per faster path that trained, against the eager run of the same profile (``train-skrull-dp1-cp1``): tokens/s,
    how far its losses are from eager's, peak memory, and the fitted floor per layer where a profile measured one
    (eager: step 2's; compiled: step 8's)."""
    by_run = {run["run"]: run for run in training}
    eager = by_run.get("train-skrull-dp1-cp1")
    if eager is None:
        return []
    floors = {"eager": _floor_ms_per_layer(eager_profile), "compiled": _floor_ms_per_layer(compiled_profile)}
    rows = [{"path": "eager", "flags": [], "tokens_per_s": eager["tokens_per_s"], "speedup_tokens_per_s": 1.0,
             "max_relative_loss_difference": 0.0, "peak_memory_bytes": eager["peak_memory_bytes"],
             "floor_ms_per_layer": floors["eager"]}]
    for path in paths:
        run = by_run.get(f"train-skrull-dp1-cp1-{path.name}")
        if run is None:
            continue
        rows.append({"path": path.name, "flags": list(path.flags), "tokens_per_s": run["tokens_per_s"],
                     "speedup_tokens_per_s": run["tokens_per_s"] / eager["tokens_per_s"],
                     "max_relative_loss_difference": max(
                         abs(a - b) / abs(b) for a, b in zip(run["losses"], eager["losses"], strict=False)),
                     "peak_memory_bytes": run["peak_memory_bytes"], "floor_ms_per_layer": floors.get(path.name)})
    return rows if len(rows) > 1 else []


def _ranking_summary(accuracy_path: Path | None, metrics: Sequence[Path]) -> list[dict[str, Any]]:
    """``benchmarks.ranking`` over what this check recorded, as it priced it: the accuracy run's micro-batches
    (under the profile of step 2 and under its two-coefficient fit) and the steps of the trainer runs planned with
    that profile (``metrics``: their ``train-*.jsonl``), every pair ordered or not, the regret of picking by the
    model. Standard library and numpy: the machine's own Python runs it."""
    from benchmarks.ranking import rank_set, recorded_sets

    accuracy = json.loads(accuracy_path.read_text()) if accuracy_path is not None else None
    runs = {path.stem: [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            for path in metrics if path.is_file()}
    return [rank_set(ranked) for ranked in recorded_sets(accuracy, runs)]


def _loss_agreement(training: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per layout, how far ``skrull``'s (and static ``ulysses``') losses are from ``deepspeed``'s: the same batches,
    another schedule (another attention scheme)."""
    by_run = {run["run"]: run for run in training}
    agreement = []
    for name, run in by_run.items():
        scheduler = next((s for s in ("skrull", "ulysses") if name.startswith(f"train-{s}-")), None)
        if scheduler is None:
            continue
        other = by_run.get(name.replace(f"train-{scheduler}-", "train-deepspeed-"))
        if other is None:
            continue
        differences = [abs(a - b) / abs(b) for a, b in zip(run["losses"], other["losses"], strict=False)]
        agreement.append({"scheduler": scheduler, "layout": name.removeprefix(f"train-{scheduler}-"),
                          "max_relative_difference": max(differences),
                          "speedup_tokens_per_s": run["tokens_per_s"] / other["tokens_per_s"]})
    return agreement


# ---------------------------------------------------------------------------------------------------- the check


def run_check(settings: Settings, *, out_dir: Path, env: dict[str, str], num_gpus: int,
              deadline_s: float) -> Check:
    """Every step in order; a step that fails leaves the ones that need its output out."""
    from benchmarks.accuracy import EXIT_TARGET_MISSED  # imports torch: only once the machine was checked
    from scheduler_service.core.jit import CACHE_DIR_VARIABLE
    from scheduler_service.core.jit import cache_dir as jit_cache_dir

    check = Check(machine=_machine(settings.device))
    started = time.perf_counter()

    def remaining() -> float:
        return max(deadline_s - (time.perf_counter() - started), 1.0)

    def run(name: str, command: list[str], succeeded: tuple[int, ...] = (0,),
            env: dict[str, str] = env) -> Step:
        step = _run(Step(name=name, command=command, succeeded=succeeded), out_dir=out_dir, env=env,
                    deadline_s=remaining())
        check.steps.append(step)
        return step

    # pytest-timeout, which pyproject's `timeout` option is for, is a development tool the machine may lack.
    tests = run("gpu-tests", [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--noconftest",
                              "-W", "ignore::pytest.PytestConfigWarning", "tests/test_gpu.py"])
    check.gpu_tests = {"returncode": tests.returncode, **_gpu_test_counts(out_dir / "gpu-tests.log")}

    profile_path = out_dir / "profile.json"
    ranks = 2 if num_gpus >= 2 else 1

    def profile_args(out: Path) -> list[str]:
        return ["--model", settings.model, "--device", settings.device, "--out", str(out), "--no-progress",
                *settings.profile_args]

    profile = run("profile", _torchrun(ranks, "trainer_client.profile", *profile_args(profile_path)) if ranks > 1
                  else [sys.executable, "-m", "trainer_client.profile", *profile_args(profile_path)])
    if not profile.ok:
        return check
    check.profile = _profile_summary(profile_path)

    accuracy_path = out_dir / "accuracy.json"
    cp_sizes = ["1", "2"] if num_gpus >= 2 else ["1"]
    accuracy_path.unlink(missing_ok=True)
    accuracy = run("accuracy", [sys.executable, "-m", "benchmarks.accuracy", "--device", settings.device, "--model",
                                settings.model, "--profile", str(profile_path), "--cp", *cp_sizes, "--out",
                                str(accuracy_path), *settings.accuracy_args], succeeded=(0, EXIT_TARGET_MISSED))
    if accuracy.ok and accuracy_path.is_file():
        check.accuracy = _accuracy_summary(accuracy_path)

    layouts = [(1, 1), (1, 2)] if num_gpus >= 2 else [(1, 1)]

    def train(dp: int, cp: int, scheduler: str, *flags: str, suffix: str = "",
              step_env: dict[str, str] = env) -> str:
        name = f"train-{scheduler}-dp{dp}-cp{cp}{suffix}"
        metrics = out_dir / f"{name}.jsonl"
        metrics.unlink(missing_ok=True)
        step = run(name, _torchrun(dp * cp, "trainer_client.train", "--dp", str(dp), "--cp", str(cp), "--model",
                                   settings.model, "--data", settings.data, "--global-batch",
                                   str(settings.global_batch), "--steps", str(settings.steps), "--scheduler",
                                   scheduler, "--bucket-size", str(settings.bucket_size), "--metrics-out",
                                   str(metrics), "--no-progress", *flags),
                   env=step_env)
        if step.ok and metrics.is_file() and metrics.read_text().strip():
            check.training.append(_training_summary(name, metrics))
        return name

    for dp, cp in layouts:
        train(dp, cp, "skrull", "--profile", str(profile_path))
    for path in settings.fast_paths:  # step 2's profile, as the eager run: the path alone differs (and the plans
        # where its token buckets' padding is priced)
        train(1, 1, "skrull", "--profile", str(profile_path), *path.flags, suffix=f"-{path.name}")
    # As a user runs it on a GPU: the profile measured by the run itself (afresh, into the check's cache: its time
    # is reported); before the deepspeed runs, whose figures an earlier check has too. The planner's compiled
    # kernels stay where the other steps cached them: only the profile is measured afresh.
    cache = out_dir / "cache"
    shutil.rmtree(cache, ignore_errors=True)
    kernels = {CACHE_DIR_VARIABLE: str(jit_cache_dir().parent)}
    auto = train(1, 1, "skrull", "--profile", "auto", suffix="-auto",
                 step_env={**env, "XDG_CACHE_HOME": str(cache), **kernels})
    if any(run["run"] == auto for run in check.training):
        check.auto = _auto_summary(out_dir / f"{auto}.log", cache, check.profile)
    for dp, cp in layouts:
        train(dp, cp, "deepspeed", "--profile", str(profile_path))
    if num_gpus >= 2:  # Ulysses over NCCL (all-to-all of Q, K, V over heads): one GPU has no degree above 1
        train(1, 2, "ulysses", "--profile", str(profile_path))
    check.loss_agreement = _loss_agreement(check.training)
    compiled_profile: dict[str, Any] = {}
    if settings.profile_compiled:
        compiled_path = out_dir / "profile-compiled.json"
        step = run("profile-compiled", [sys.executable, "-m", "trainer_client.profile",
                                        *profile_args(compiled_path), "--compile"])
        if step.ok:
            compiled_profile = _profile_summary(compiled_path)
    check.paths = _paths_summary(check.training, settings.fast_paths, eager_profile=check.profile,
                                 compiled_profile=compiled_profile)
    trained = {run["run"] for run in check.training}
    planned_with_profile = [out_dir / f"train-{scheduler}-dp{dp}-cp{cp}.jsonl" for dp, cp in layouts
                            for scheduler in ("skrull", "deepspeed") if f"train-{scheduler}-dp{dp}-cp{cp}" in trained]
    try:
        check.ranking = _ranking_summary(accuracy_path if check.accuracy else None, planned_with_profile)
    except Exception as error:  # the summary then lacks these figures; it is still written
        print(f"ranking: not computed ({error!r})", flush=True)
    check.trl = _trl_comparison(settings, run=run, out_dir=out_dir, num_gpus=num_gpus)
    return check


def _trl_comparison(settings: Settings, *, run: Any, out_dir: Path, num_gpus: int) -> dict[str, Any]:
    """Step 9: TRL's batching against Skrull's plans on one SFT script (``benchmarks.against_trl``); skipped where
    this Python lacks TRL, datasets or accelerate."""
    from benchmarks.against_trl import EXIT_LOSSES_DIFFER

    missing = _missing_trl_modules()
    if missing:
        reason = (f"skipped: {sys.executable} cannot import {', '.join(missing)}; bring "
                  f"{' '.join(TRL_MODULES[name] for name in missing)} with --wheels")
        print(f"== trl-bench: {reason}", flush=True)
        return {"skipped": reason}
    out = out_dir / "trl-bench.json"
    out.unlink(missing_ok=True)
    processes = ("--processes", str(num_gpus)) if settings.device == "cuda" else ()
    step = run("trl-bench", [sys.executable, "-m", "benchmarks.against_trl", "--device", settings.device, "--model",
                             settings.model, *processes, *settings.trl_args, "--out", str(out)],
               succeeded=(0, EXIT_LOSSES_DIFFER))
    if not (step.ok and out.is_file()):
        return {}
    document = json.loads(out.read_text())
    return {"rows": document["rows"], "losses_agree": document["losses_agree"],
            "table": re.findall(r"^\|.*\|$", Path(step.log).read_text(), re.MULTILINE)}


def _print_summary(check: Check) -> None:
    machine = check.machine
    print(f"\n# gpu-check: {', '.join(machine.get('gpus', [])) or 'CPU rehearsal'}; torch {machine['torch']}, "
          f"transformers {machine['transformers']}, flash-attn {machine['flash_attn'] or 'absent'}")
    for step in check.steps:
        print(f"- {step.name}: {'ok' if step.ok else 'FAILED'} ({step.wall_s:.0f} s)")
    if check.gpu_tests:
        print(f"GPU tests: {check.gpu_tests}")
    if check.profile:
        kept = check.profile["fit"][check.profile["fit"].get("form", "extended")]
        floor = (f", launch-bound floor {kept['floor_s_per_layer'] * 1e3:.2f} ms/layer"
                 if kept.get("floor_s_per_layer") else "")
        print(f"profile: fit median {kept['median_relative_error']:.1%}, max {kept['max_relative_error']:.1%}"
              f"{floor}; {check.profile['activation_bytes_per_token']:.0f} B/token + "
              f"{check.profile['beta_bytes']:.3g} B; reserved {check.profile['reserved_bytes'] / 2**30:.2f} GiB; "
              f"{check.profile['attention_backend']}")
    for case in check.accuracy:
        classes = "; ".join(f"{label}: median {c['median_error']:.1%} of {c['micro_batches']}"
                            for label, c in case["by_size"].items())
        print(f"micro-batches at CP {case['cp_size']}: {case['micro_batches']}, |error| median "
              f"{case['median_error']:.1%}, worst {case['worst_error']:.1%}, signed median "
              f"{case['signed_median_error']:+.1%} ({classes})")
    for ranking in check.ranking:
        if not ranking["pairs"]:
            continue
        apart = f"> {ranking['min_gap']:.0%} apart"
        separated = (f"{ranking['separated_ordered']:.1%} of {ranking['separated_pairs']} {apart}"
                     if ranking["separated_pairs"] else f"none {apart}")
        wrong = ranking["wrong_regret"]
        wrong_regret = (f" (their regret p50 {wrong['p50']:.1%}, p95 {wrong['p95']:.1%})" if ranking["wrong_pairs"]
                        else "")
        print(f"ranking {ranking['ranked']} by {ranking['fit']}: {ranking['pairs']} pairs ordered "
              f"{ranking['ordered']:.1%} ({ranking['priced_equal']} priced equal), {separated}; regret p50 "
              f"{ranking['regret']['p50']:.1%}, p95 {ranking['regret']['p95']:.1%}; {ranking['wrong_pairs']} "
              f"ordered wrong{wrong_regret}")
    for run in check.training:
        error = run["predicted_vs_measured_step"]["median_abs_error"]
        estimate = f"step estimate |error| median {error:.1%}" if error is not None else "no step estimate"
        peak = f"{run['peak_memory_bytes'] / 2**30:.1f} GiB" if run["peak_memory_bytes"] is not None else "n/a"
        print(f"{run['run']}: {run['tokens_per_s']:,.0f} tokens/s, {estimate}, peak memory {peak} per GPU")
    for agreement in check.loss_agreement:
        scheduler = agreement["scheduler"]
        print(f"losses {scheduler} vs deepspeed at {agreement['layout']}: max relative difference "
              f"{agreement['max_relative_difference']:.1e}; {scheduler} ×{agreement['speedup_tokens_per_s']:.2f} "
              "tokens/s")
    auto = check.auto
    if auto:
        print(f"--profile auto measured in {auto['auto_profile_s']} s", end="")
        if "fit" in auto:
            floors = [fit.get("floor_s_per_layer") or fit["beta_s_per_layer"]
                      for fit in (auto["sweep_fit"], auto["fit"])]
            print(f": floor (or beta) {floors[1] * 1e3:.2f} ms/layer (the sweep's {floors[0] * 1e3:.2f}), fit median "
                  f"{auto['fit']['median_relative_error']:.1%}", end="")
        print()
    for path in check.paths:
        floor = f", floor {path['floor_ms_per_layer']:.2f} ms/layer" if path["floor_ms_per_layer"] else ""
        peak = f"{path['peak_memory_bytes'] / 2**30:.1f} GiB" if path["peak_memory_bytes"] is not None else "n/a"
        print(f"path {path['path']} {' '.join(path['flags'])}".rstrip() + f": {path['tokens_per_s']:,.0f} tokens/s "
              f"(x{path['speedup_tokens_per_s']:.2f} of eager){floor}, peak memory {peak}, losses within "
              f"{path['max_relative_loss_difference']:.1e} of eager")
    if check.trl.get("table"):
        print("against TRL (one SFT script; Skrull's losses "
              f"{'within' if check.trl['losses_agree'] else 'NOT within'} the tolerance of TRL padding's):")
        print("\n".join(check.trl["table"]))
    elif check.trl.get("skipped"):
        print(f"against TRL: {check.trl['skipped']}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-0.5b", help="a catalogue model or a local checkpoint folder")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps of each trainer run")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "gpu-check", help="logs, profile and summary.json")
    parser.add_argument("--wheels", type=Path, help="install missing dependencies from the wheel files here")
    parser.add_argument("--deadline", type=float, default=600.0,
                        help="seconds for all the steps together; a step still running then is stopped")
    parser.add_argument("--rehearse", action="store_true",
                        help="run the steps on this machine's CPU with the tiny model (checks the check, no GPU)")
    args = parser.parse_args(argv)

    out_dir = args.out_dir.resolve()  # the steps run from the repository's root
    out_dir.mkdir(parents=True, exist_ok=True)
    site = out_dir / "site"
    missing = _missing_modules()
    if missing and args.wheels is not None:
        try:
            _install_wheels(args.wheels, missing, site)
        except subprocess.CalledProcessError:
            print(f"gpu-check: pip could not install {' '.join(TRAINER_MODULES[name] for name in missing)} from "
                  f"{args.wheels} (its output is above)", file=sys.stderr)
            return EXIT_CANNOT_RUN
        missing = _missing_modules()
    if _missing_trl_modules() and args.wheels is not None and not missing:
        try:  # step 9 only: without them it is skipped, and says so
            _install_wheels(args.wheels, _missing_trl_modules(), site)
        except subprocess.CalledProcessError:
            print(f"gpu-check: pip could not install {' '.join(TRL_MODULES[n] for n in _missing_trl_modules())} "
                  f"from {args.wheels}; the TRL comparison will be skipped", file=sys.stderr)
    if missing:
        names = " ".join(TRAINER_MODULES[name] for name in missing)
        print(f"gpu-check: the trainer needs {names}, which {sys.executable} cannot import. On a machine with a "
              f"network: pip download --only-binary=:all: {names} -d wheels; then here: make gpu-check "
              f"GPU_CHECK_ARGS='--wheels wheels'", file=sys.stderr)
        return EXIT_CANNOT_RUN
    import torch

    num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if num_gpus == 0 and not args.rehearse:
        print(f"gpu-check: no CUDA device here (torch {torch.__version__}, CUDA {torch.version.cuda or 'none'}): "
              "run it on a GPU machine, or --rehearse to run its steps on this CPU", file=sys.stderr)
        return EXIT_CANNOT_RUN
    settings = (Settings.for_rehearsal(args.steps) if args.rehearse
                else Settings.for_gpu(args.model, args.steps))
    paths = [*([str(site)] if site.is_dir() else []), str(ROOT), str(ROOT / "proto"), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path for path in paths if path)}
    if shutil.which("nvidia-smi") and not args.rehearse:
        (out_dir / "nvidia-smi.log").write_text(subprocess.run(["nvidia-smi"], capture_output=True, text=True,
                                                                    check=False).stdout)
    check = run_check(settings, out_dir=out_dir, env=env, num_gpus=0 if args.rehearse else num_gpus,
                      deadline_s=args.deadline)
    _print_summary(check)
    summary_path = out_dir / "summary.json"
    summary_path.write_text(json.dumps(check.to_json(), indent=2) + "\n")
    print(f"wrote {summary_path}")
    return 0 if all(step.ok for step in check.steps) else 1


if __name__ == "__main__":
    sys.exit(main())
