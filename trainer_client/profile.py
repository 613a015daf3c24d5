"""The offline profiler: measure the performance model's coefficients on this machine, write a profile file.

    python -m trainer_client.profile --model tiny --device cpu --out profiles/cpu-tiny.json
    torchrun --nproc-per-node 2 -m trainer_client.profile --model tiny --device cpu --out cpu-tiny.json

What it measures, each with warm-up and repeated timings summarised by the
median (CUDA events on CUDA), running exactly the trainer's micro-batch code
(``trainer.run_micro_batch``: HF model, DACP attention, loss, backward):

* **compute**: forward + backward of packed micro-batches over a sweep of
  sizes and sequence mixes (one long sequence, many short ones, half and half)
  → ``T_comp = α·FLOPs + β`` (eq. 14) and the extended fit with per-token and
  per-sequence terms, each with its relative error on the sweep;
* **memory**: the peak above weights and optimizer states over a sweep of
  packed token counts → ``M(S) = α·S + β``; weights, gradients and optimizer
  states are counted tensor by tensor (static memory measured, not guessed),
  and the BucketSize for the memory budget follows;
* **communication** (world size > 1): all-gather / reduce-scatter /
  all-to-all latency vs message size over all ranks → the tables ``T_comm`` is
  fitted from; and the shard-size effect of the paper's Figure 1(b): one
  sequence computed whole on one rank vs as 1/N zigzag shards over N ranks,
  measured beside the model's prediction.

Under ``torchrun`` every rank runs the compute sweep at the same time (as in
training, ranks share the machine) and the per-rank medians are averaged;
rank 0 measures memory and writes the file. One process profiles no
collective: its file has no communication tables, so it plans CP > 1 as if
communication were free (run it under torchrun for those).

The file is a schema-1 profile (``scheduler_service.core.profile``) naming the
model it was measured for, with ``provenance`` (hardware, software versions,
model shape, date, command) and the raw points beside every fit. The default
sweeps take about 15 s for the tiny model in one process and 30–40 s under
torchrun with 2 ranks, on the 2-core development machine; ``--sizes``,
``--repeats`` and friends trade time for precision.

A profile holds for the machine *as it was* while measured: on a shared host
another job taking a core makes every micro-batch slower (we saw 2×). The
service's feedback loop (``POST /feedback``) corrects such drift online.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import statistics
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm

from scheduler_service.core.errors import PlanningError
from scheduler_service.core.models import ModelShape
from scheduler_service.core.perf_model import ComputePoint, PerformanceModel, eq13_flops, fit_compute, fit_memory
from scheduler_service.core.plan import MicroBatch
from scheduler_service.core.profile import PROFILE_SCHEMA_VERSION, parse_profile
from trainer_client.attention import AttentionBackend, resolve_backend
from trainer_client.measure import (
    COLLECTIVES,
    activation_peak_bytes,
    collective_latency_s,
    device_memory_bytes,
    hardware_info,
    local_pack,
    random_samples,
    software_versions,
    state_bytes,
    timed_runs,
    utc_now,
)
from trainer_client.model import build_model, model_shape
from trainer_client.packing import PackedMicroBatch, pack_micro_batch
from trainer_client.trainer import run_micro_batch

__all__ = ["ProfileOptions", "build_parser", "compute_cases", "main", "measure_profile"]

logger = logging.getLogger("trainer_client.profile")

EXIT_USER_ERROR = 2


@dataclass(frozen=True, kw_only=True, slots=True)
class ProfileOptions:
    model: str
    device: str = "cpu"
    name: str | None = None
    sizes: tuple[int, ...] = (64, 128, 256, 512, 1024, 2048)  # packed tokens per micro-batch (compute sweep)
    short_length: int = 128  # tokens of each sequence in the "many short" mixes
    memory_sizes: tuple[int, ...] = (256, 512, 1024, 2048)
    comm_sizes: tuple[int, ...] = (1 << 12, 1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22)  # bytes per collective
    shard_sizes: tuple[int, ...] = (512, 2048)  # tokens of the sequence computed whole vs sharded
    warmup: int = 1
    repeats: int = 5
    memory_budget_bytes: float | None = None
    dtype: str | None = None  # float32 | bfloat16 autocast; default as the trainer: float32 on CPU, bf16 on CUDA
    attention_backend: str = AttentionBackend.AUTO.value
    seed: int = 0
    progress: bool = True

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"--device must be cpu or cuda, got {self.device!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA device is visible to torch")
        for name in ("sizes", "memory_sizes", "comm_sizes", "shard_sizes"):
            values = getattr(self, name)
            if any(value < 1 for value in values):
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {list(values)}")
        if len(self.sizes) < 2:
            raise ValueError(f"--sizes needs at least 2 sizes to fit a line, got {list(self.sizes)}")
        if len(set(self.memory_sizes)) < 2:
            raise ValueError(f"--memory-sizes needs at least 2 distinct sizes, got {list(self.memory_sizes)}")
        if self.short_length < 1:
            raise ValueError(f"--short-length must be positive, got {self.short_length}")
        if self.repeats < 1 or self.warmup < 0:
            raise ValueError(f"--repeats must be ≥ 1 and --warmup ≥ 0, got {self.repeats} and {self.warmup}")
        if self.dtype not in (None, "float32", "bfloat16"):
            raise ValueError(f"--dtype must be float32 or bfloat16, got {self.dtype!r}")
        AttentionBackend(self.attention_backend)


def compute_cases(sizes: Sequence[int], short_length: int) -> list[tuple[str, tuple[int, ...]]]:
    """The sweep's sequence mixes per packed size: one long sequence, many short ones (``short_length``, or
    half the size when that is smaller), many tiny ones (a quarter of ``short_length``: per-sequence costs),
    and half long + half short."""
    cases: list[tuple[str, tuple[int, ...]]] = []
    tiny = max(short_length // 4, 1)
    for size in sizes:
        cases.append((f"long-{size}", (size,)))
        short = min(short_length, size // 2)
        if short >= 1:
            cases.append((f"short-{size}", (short,) * (size // short)))
        if size >= 8 * tiny and tiny < short:
            cases.append((f"tiny-{size}", (tiny,) * (size // tiny)))
        if size >= 4 * short_length:
            half = size // 2
            cases.append((f"mixed-{size}", (half, *(short_length,) * ((size - half) // short_length))))
    return cases


class _Bench:
    """The model, its optimizer and the trainer's micro-batch step on one device."""

    def __init__(self, options: ProfileOptions, device: torch.device) -> None:
        self.options = options
        self.device = device
        self.shape: ModelShape = model_shape(options.model)
        self.model = build_model(options.model, seed=options.seed, device=device)
        self.model.train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        dtype = options.dtype or ("bfloat16" if device.type == "cuda" else "float32")
        self.autocast_dtype = torch.bfloat16 if dtype == "bfloat16" else None
        self.dtype_name = dtype
        # Materialise the optimizer states (AdamW creates them lazily at the first step), then drop gradients.
        for parameter in self.model.parameters():
            parameter.grad = torch.zeros_like(parameter)
        self.optimizer.step()
        self.zero_grad()
        # The first micro-batches pay one-off costs (allocator growth, lazy kernel and autograd set-up) that
        # a per-case warm-up of one run does not absorb for the first small cases.
        warm = local_pack((256, 128, 64, 64), vocab_size=self.shape.vocab_size, device=device, seed=options.seed)
        timed_runs(functools.partial(self.step, warm), device=device, warmup=3, repeats=0)
        self.zero_grad()

    def zero_grad(self) -> None:
        for parameter in self.model.parameters():
            parameter.grad = None

    def step(self, pack: PackedMicroBatch) -> None:
        """One micro-batch as the trainer runs it (gradients start from None, as at a step's first micro-batch)."""
        self.zero_grad()
        run_micro_batch(self.model, pack, num_loss_tokens=max(pack.num_loss_tokens, 1),
                        autocast_dtype=self.autocast_dtype, attention_backend=self.options.attention_backend)

    def kv_bytes_per_element(self) -> int:
        return 2 if self.autocast_dtype is not None else torch.empty((), dtype=torch.float32).element_size()


def _mean_over_ranks(value: float, world_size: int) -> float:
    if world_size == 1:
        return value
    gathered: list[float | None] = [None] * world_size
    dist.all_gather_object(gathered, value)
    return statistics.fmean(v for v in gathered if v is not None)


def _measure_compute(bench: _Bench, bar: tqdm, world_size: int) -> list[dict[str, Any]]:
    options, shape = bench.options, bench.shape
    points = []
    for index, (label, lengths) in enumerate(compute_cases(options.sizes, options.short_length)):
        pack = local_pack(lengths, vocab_size=shape.vocab_size, device=bench.device, seed=options.seed + index)
        if world_size > 1:
            dist.barrier()  # every rank runs the same case at the same time, as ranks do in training
        times_s = timed_runs(functools.partial(bench.step, pack), device=bench.device, warmup=options.warmup,
                             repeats=options.repeats)
        time_s = _mean_over_ranks(statistics.median(times_s), world_size)
        flops = float(eq13_flops(shape, lengths).sum())
        points.append({"case": label, "num_tokens": sum(lengths), "num_sequences": len(lengths), "flops": flops,
                       "time_s": time_s, "spread": (max(times_s) - min(times_s)) / statistics.median(times_s)})
        bar.update()
    bench.zero_grad()
    return points


def _measure_memory(bench: _Bench, bar: tqdm) -> list[tuple[int, int]]:
    points = []
    for index, size in enumerate(bench.options.memory_sizes):
        lengths = (size,) if size <= 2 * bench.options.short_length else (
            size // 2, *(bench.options.short_length,) * ((size - size // 2) // bench.options.short_length))
        pack = local_pack(lengths, vocab_size=bench.shape.vocab_size, device=bench.device, seed=1000 + index)
        peak = activation_peak_bytes(functools.partial(bench.step, pack), device=bench.device, model=bench.model,
                                     optimizer=bench.optimizer)
        points.append((pack.num_tokens, peak))
        bench.zero_grad()
        bar.update()
    return points


def _measure_collectives(bench: _Bench, bar: tqdm) -> dict[str, list[list[float]]]:
    dtype = torch.bfloat16 if bench.autocast_dtype is not None else torch.float32
    tables: dict[str, list[list[float]]] = {}
    for collective in COLLECTIVES:
        table = []
        for num_bytes in bench.options.comm_sizes:
            latency_s = collective_latency_s(collective, num_bytes, group=None, device=bench.device, dtype=dtype,
                                             warmup=max(bench.options.warmup, 1), repeats=max(bench.options.repeats, 3))
            table.append([float(num_bytes), latency_s])
            bar.update()
        tables[collective] = table
    return tables


def _measure_shards(bench: _Bench, bar: tqdm, world_size: int) -> list[dict[str, Any]]:
    """Figure 1(b): one sequence whole on every rank (concurrently) vs as 1/N zigzag shards over N ranks."""
    rank = dist.get_rank()
    results = []
    for size in bench.options.shard_sizes:
        samples = random_samples([size], vocab_size=bench.shape.vocab_size, seed=2000 + size)
        whole = local_pack([size], vocab_size=bench.shape.vocab_size, device=bench.device, seed=2000 + size)
        sharded = pack_micro_batch(samples, MicroBatch(local=((),) * world_size, distributed=(0,)),
                                   cp_size=world_size, cp_rank=rank, cp_group=dist.group.WORLD).to(bench.device)
        dist.barrier()
        whole_s = statistics.median(timed_runs(functools.partial(bench.step, whole), device=bench.device,
                                               warmup=bench.options.warmup, repeats=bench.options.repeats))
        dist.barrier()
        shard_times = timed_runs(functools.partial(bench.step, sharded), device=bench.device,
                                 warmup=bench.options.warmup, repeats=bench.options.repeats)
        slowest = torch.tensor([statistics.median(shard_times)], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        results.append({"num_tokens": size, "cp_size": world_size,
                        "whole_s": _mean_over_ranks(whole_s, world_size), "shard_s": float(slowest.item())})
        bar.update()
    bench.zero_grad()
    return results


def measure_profile(options: ProfileOptions, *, command: str | None = None) -> dict[str, Any] | None:
    """Measure and return the profile document on rank 0 (``None`` on the others).

    Every rank of an initialised process group must call it; without one it measures alone. ``command`` is
    recorded in the provenance (the CLI passes its own).
    """
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    is_main = not dist.is_initialized() or dist.get_rank() == 0
    device = torch.device(options.device, int(os.environ.get("LOCAL_RANK", "0"))) if options.device == "cuda" \
        else torch.device("cpu")
    bench = _Bench(options, device)
    shape = bench.shape
    num_cases = len(compute_cases(options.sizes, options.short_length)) + len(options.memory_sizes)
    if world_size > 1:
        num_cases += len(COLLECTIVES) * len(options.comm_sizes) + len(options.shard_sizes)
    bar = tqdm(total=num_cases, desc=f"profile {shape.name}", unit="case", disable=not (is_main and options.progress))
    with bar:
        compute_points = _measure_compute(bench, bar, world_size)
        tables = _measure_collectives(bench, bar) if world_size > 1 else {}
        shards = _measure_shards(bench, bar, world_size) if world_size > 1 else []
        memory_points = _measure_memory(bench, bar) if is_main else []
    if not is_main:
        return None
    command = command or f"trainer_client.profile.measure_profile() from {Path(sys.argv[0]).name}"
    return _document(options, bench, world_size, compute_points, memory_points, tables, shards, command)


def _document(
    options: ProfileOptions, bench: _Bench, world_size: int, compute_points: list[dict[str, Any]],
    memory_points: list[tuple[int, int]], tables: dict[str, list[list[float]]], shards: list[dict[str, Any]],
    command: str,
) -> dict[str, Any]:
    shape, device = bench.shape, bench.device
    points = [ComputePoint(flops=p["flops"], num_tokens=p["num_tokens"], num_sequences=p["num_sequences"],
                           time_s=p["time_s"]) for p in compute_points]
    extended = fit_compute(points, num_layers=shape.num_layers, extended=True)
    paper = fit_compute(points, num_layers=shape.num_layers, extended=False)
    memory = fit_memory(memory_points)
    states = state_bytes(bench.model, bench.optimizer)
    static_bytes = sum(states.values())
    reserved_bytes = 0
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        reserved_bytes = max(int(total - free - torch.cuda.memory_allocated(device)), 0)
    budget = options.memory_budget_bytes or device_memory_bytes(device)
    backend = resolve_backend(options.attention_backend, device=device,
                              dtype=bench.autocast_dtype or torch.float32).value
    device_name = hardware_info(device).get("gpu") if device.type == "cuda" else hardware_info(device)["cpu"]
    threads = torch.get_num_threads()
    name = options.name or f"{device.type}-{shape.name}"
    comm_note = (f"measured over {world_size} ranks ({dist.get_backend()})" if world_size > 1 else
                 "none: measured in one process; plans with cp_size > 1 count communication as free until this is "
                 "re-run under torchrun")
    document: dict[str, Any] = {
        "schema_version": PROFILE_SCHEMA_VERSION,
        "name": name,
        "description": f"{shape.name} measured on {device_name} ({device.type}, {threads} threads per rank, "
                       f"{world_size} rank(s), {bench.dtype_name}, {backend} attention) by "
                       f"python -m trainer_client.profile on {utc_now()[:10]}. Holds for this model only.",
        "model": shape.name,
        "hardware": {
            "device": device_name,
            "device_memory_bytes": budget,
            "source": "--memory-budget-bytes" if options.memory_budget_bytes else
                      ("torch.cuda.get_device_properties().total_memory" if device.type == "cuda"
                       else "physical host memory (sysconf); CPU ranks share it"),
        },
        "compute": {
            "alpha_s_per_flop": extended.alpha_s_per_flop,
            "alpha_s_per_token": extended.alpha_s_per_token,
            "alpha_s_per_sequence": extended.alpha_s_per_sequence,
            "beta_s_per_layer": extended.beta_s_per_layer,
            "fit": {
                "extended": _fit_summary(extended),
                "paper_eq14": _fit_summary(paper),
            },
            "points": compute_points,
            "source": f"least squares on relative error (non-negative) over {len(points)} micro-batches "
                      f"(forward + backward, trainer code path), median of {options.repeats} timed runs after "
                      f"{options.warmup} warm-up each; FLOPs per eq. 13. paper_eq14 is the two-coefficient fit "
                      f"alpha·FLOPs + beta for comparison.",
        },
        "memory": {
            "activation_bytes_per_token": {"fixed": memory.bytes_per_token, "per_layer_hidden": 0.0,
                                           "per_vocab": 0.0},
            "beta_bytes": memory.beta_bytes,
            "reserved_bytes": reserved_bytes,
            "static_bytes_per_parameter": {"replicated": static_bytes / shape.num_parameters, "sharded": 0.0},
            "fit": {"max_relative_error": memory.max_relative_error},
            "points": [[tokens, peak] for tokens, peak in memory_points],
            "static_bytes": states,
            "source": ("activation peak above weights and optimizer states per micro-batch "
                       + ("(torch.cuda.max_memory_allocated)" if device.type == "cuda" else
                          "(torch.distributed._tools.mem_tracker.MemTracker: live tensor bytes)")
                       + "; static = weights + gradients + AdamW states counted per tensor, all replicated: the "
                         "trainer keeps no ZeRO sharding. reserved: CUDA context and allocator slack "
                         "(mem_get_info minus allocated), 0 on CPU."),
        },
        "communication": {
            "kv_bytes_per_element": bench.kv_bytes_per_element(),
            "tables": tables,
            "fit": "relative",
            "world_size": world_size,
            "source": f"collective latency (slowest rank, median) vs bytes moved in all: {comm_note}.",
        },
        "provenance": {
            "tool": "python -m trainer_client.profile",
            "command": command,
            "date": utc_now(),
            "hardware": hardware_info(device),
            "software": software_versions(),
            "model": asdict(shape),
            "world_size": world_size,
            "dtype": bench.dtype_name,
            "attention_backend": backend,
            "options": {key: value for key, value in asdict(options).items() if key != "progress"},
        },
    }
    if shards:
        document["compute"]["shard_effect"] = _shard_effect(document, shape, shards)
    parse_profile(document)  # the file must load where it is used
    return document


def _fit_summary(fit: Any) -> dict[str, float]:
    return {"alpha_s_per_flop": fit.alpha_s_per_flop, "alpha_s_per_token": fit.alpha_s_per_token,
            "alpha_s_per_sequence": fit.alpha_s_per_sequence, "beta_s_per_layer": fit.beta_s_per_layer,
            "median_relative_error": fit.median_relative_error, "max_relative_error": fit.max_relative_error}


def _shard_effect(document: dict[str, Any], shape: ModelShape, shards: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Measured whole vs shard times beside the model's prediction of the shard (eq. 2 with no local work)."""
    perf = PerformanceModel(model=shape, profile=parse_profile(document))
    rows = []
    for shard in shards:
        size, cp_size = shard["num_tokens"], shard["cp_size"]
        predicted = perf.comm_time_s(size) + perf.compute_time_s(perf.flops(size) / cp_size)
        rows.append({**shard, "speedup": shard["whole_s"] / shard["shard_s"],
                     "efficiency": shard["whole_s"] / (cp_size * shard["shard_s"]),
                     "predicted_shard_s": predicted,
                     "shard_relative_error": abs(predicted - shard["shard_s"]) / shard["shard_s"]})
    return rows


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    defaults = ProfileOptions(model="tiny")
    parser = argparse.ArgumentParser(prog="python -m trainer_client.profile", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", required=True, help="a built-in model name or a local HF checkpoint directory")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--out", type=Path, required=True, help="where to write the profile JSON")
    parser.add_argument("--name", help="the profile's name (default: DEVICE-MODEL)")
    parser.add_argument("--sizes", type=_ints, default=defaults.sizes, help="packed tokens of the compute sweep")
    parser.add_argument("--short-length", type=int, default=defaults.short_length,
                        help="tokens per sequence in the many-short mixes")
    parser.add_argument("--memory-sizes", type=_ints, default=defaults.memory_sizes,
                        help="packed tokens of the memory sweep")
    parser.add_argument("--comm-sizes", type=_ints, default=defaults.comm_sizes,
                        help="bytes per collective (world size > 1)")
    parser.add_argument("--shard-sizes", type=_ints, default=defaults.shard_sizes,
                        help="sequence lengths computed whole vs sharded (world size > 1)")
    parser.add_argument("--warmup", type=int, default=defaults.warmup, help="untimed runs before each timing")
    parser.add_argument("--repeats", type=int, default=defaults.repeats, help="timed runs per case (median)")
    parser.add_argument("--threads", type=int, help="torch threads per process (default: torch's choice)")
    parser.add_argument("--memory-budget-bytes", type=float,
                        help="device memory the BucketSize is derived for (default: the device's)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], help="default: as the trainer")
    parser.add_argument("--attention-backend", default="auto", choices=[b.value for b in AttentionBackend])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def summary(document: dict[str, Any]) -> str:
    """A few lines for the terminal: the fits, their errors, the BucketSize."""
    compute, memory = document["compute"], document["memory"]
    extended, paper = compute["fit"]["extended"], compute["fit"]["paper_eq14"]
    profile = parse_profile(document)
    perf = PerformanceModel(model=ModelShape(**document["provenance"]["model"]), profile=profile)
    lines = [
        f"profile {document['name']} for model {document['model']} on {document['hardware']['device']}",
        f"compute: alpha {extended['alpha_s_per_flop']:.3e} s/FLOP, {extended['alpha_s_per_token']:.3e} s/token, "
        f"{extended['alpha_s_per_sequence']:.3e} s/sequence, beta {extended['beta_s_per_layer']:.3e} s/layer; "
        f"fit error median {extended['median_relative_error']:.1%}, max {extended['max_relative_error']:.1%} "
        f"(eq. 14 alone: median {paper['median_relative_error']:.1%}, max {paper['max_relative_error']:.1%})",
        f"memory: {memory['activation_bytes_per_token']['fixed']:.0f} B/token + {memory['beta_bytes']:.0f} B; "
        f"static {sum(memory['static_bytes'].values())} B; fit error max {memory['fit']['max_relative_error']:.1%}; "
        f"BucketSize for {document['hardware']['device_memory_bytes']:.3g} B on one rank: {perf.bucket_size(1)}",
    ]
    tables = document["communication"]["tables"]
    if tables:
        lines.append("communication: " + "; ".join(
            f"{name} {table[0][1] * 1e6:.0f} us @ {table[0][0]:.0f} B .. {table[-1][1] * 1e6:.0f} us @ "
            f"{table[-1][0]:.0f} B" for name, table in tables.items()))
    for row in compute.get("shard_effect", []):
        lines.append(f"shard effect: {row['num_tokens']} tokens whole {row['whole_s'] * 1e3:.1f} ms vs 1/"
                     f"{row['cp_size']} shards {row['shard_s'] * 1e3:.1f} ms (efficiency {row['efficiency']:.0%}; "
                     f"model predicts {row['predicted_shard_s'] * 1e3:.1f} ms)")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    is_main = int(os.environ.get("RANK", "0")) == 0
    logging.basicConfig(level=logging.INFO if is_main else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        options = ProfileOptions(
            model=args.model, device=args.device, name=args.name, sizes=args.sizes,
            short_length=args.short_length, memory_sizes=args.memory_sizes, comm_sizes=args.comm_sizes,
            shard_sizes=args.shard_sizes, warmup=args.warmup, repeats=args.repeats,
            memory_budget_bytes=args.memory_budget_bytes, dtype=args.dtype,
            attention_backend=args.attention_backend, seed=args.seed, progress=not args.no_progress,
        )
        if args.threads is not None:
            if args.threads < 1:
                raise ValueError(f"--threads must be positive, got {args.threads}")
            torch.set_num_threads(args.threads)
        if world_size > 1 and not dist.is_initialized():
            if options.device == "cuda":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group("nccl" if options.device == "cuda" else "gloo", timeout=timedelta(seconds=600))
        launcher = f"torchrun --nproc-per-node {world_size}" if world_size > 1 else "python"
        command = " ".join([launcher, "-m", "trainer_client.profile", *(argv if argv is not None else sys.argv[1:])])
        document = measure_profile(options, command=command)
        if document is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(document, indent=2) + "\n")
            print(summary(document))
            print(f"wrote {args.out}")
    except (ValueError, PlanningError) as error:
        if is_main:
            print(f"error: {error}", file=sys.stderr)
        return EXIT_USER_ERROR
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
