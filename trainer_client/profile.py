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
  fitted from; the same all-gather / reduce-scatter sizes over every aligned
  block of ``s`` ranks at once (``s`` each hybrid group size: the divisors of
  the world size between 2 and it) → ``communication.tables_by_group_size``.
  Each collective is timed as a micro-batch pays it: every rank first computes
  for as long as a static-CP micro-batch whose K/V the message is computes
  before each of its collectives (``collective_lead_s``, from the compute fit
  just measured), then launches and waits the collective; the ranks' mean time
  in it is the latency. Timed from a barrier instead, with the other ranks
  idle, the collectives of 4 ranks sharing 2 cores measured a quarter of what
  the trainer waits in them (dp 1 × cp 4, deepspeed's micro-batches);
* **the shard-size effect** of the paper's Figure 1(b) (world size > 1): one
  sequence computed whole on every rank vs as zigzag shards over every aligned
  block of ``d`` ranks at once (each block its own copy, so every rank works),
  for ``d`` each hybrid group size and the whole world, beside the model's
  prediction (``compute.shard_effect``). From those rows the attention kernel's
  efficiency per query length follows (``derive_attention_efficiency``): per
  row, the efficiency that makes the model's time equal the measured one,
  normalised to the longest query measured. It is written as
  ``compute.attention_efficiency`` only when well determined (at least 2 query
  lengths where attention is a tenth or more of the measured time, the
  measurements of one length agree, the longest whole sequence runs as the
  compute fit predicts, the efficiency lies in (0, 1], and it does not fall as
  queries lengthen); ``compute.shard_effect_note`` says which, and why.

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
``--repeats`` and friends trade time for precision. Every derived number sits
beside what it was derived from (``compute.fit``, the candidates of
``compute.fit.attention_efficiency``).

A profile holds for the machine *as it was* while measured: on a shared host
another job taking a core makes every micro-batch slower (we saw 2×). The
service's feedback loop (``POST /feedback``) corrects such drift online.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import logging
import os
import statistics
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from skrull_proto import PROFILE_SCHEMA_VERSION
from tqdm import tqdm

from scheduler_service.core.errors import PlanningError
from scheduler_service.core.models import ModelShape
from scheduler_service.core.perf_model import (
    ComputeFit,
    ComputePoint,
    PerformanceModel,
    eq13_flops,
    fit_compute,
    fit_memory,
)
from scheduler_service.core.plan import MicroBatch, ShardedGroup, block_degrees, cp_blocks
from scheduler_service.core.profile import parse_profile
from scheduler_service.profile_files import profile_from_document
from trainer_client.attention import AttentionBackend, resolve_backend
from trainer_client.loss import CausalLMLoss
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
from trainer_client.parallelize import (
    ActivationCheckpointing,
    Sharding,
    apply_activation_checkpointing,
    static_bytes_per_parameter,
)
from trainer_client.trainer import run_micro_batch

__all__ = [
    "EfficiencyCandidate",
    "EfficiencyFit",
    "ProfileOptions",
    "build_parser",
    "collective_lead_s",
    "compute_cases",
    "derive_attention_efficiency",
    "main",
    "measure_profile",
    "shard_degrees",
    "shard_effect_rows",
    "shard_micro_batch",
]

logger = logging.getLogger("trainer_client.profile")

EXIT_USER_ERROR = 2
GROUP_COLLECTIVES = ("all_gather", "reduce_scatter")  # what a hybrid group's attention runs (attention.py)
# An efficiency is solved from the measured time minus the model's other terms; where attention is less than
# this share of the measured time, a few percent of noise in the other terms is a large error in it.
MIN_ATTENTION_SHARE = 0.1
# Candidates at one query length (from different sequence lengths and degrees) measure the same kernel; where they
# disagree by more than this factor, noise or a term the model lacks dominates, not the kernel's efficiency.
MAX_CANDIDATE_SPREAD = 1.5
# The longest query is a whole sequence like the compute sweep's, so against the sweep's fit its efficiency is
# about 1; further off than this, the machine ran differently during the shard runs (load) and nothing is normalised.
MAX_REFERENCE_DEVIATION = 0.25


@dataclass(frozen=True, kw_only=True, slots=True)
class ProfileOptions:
    model: str
    device: str = "cpu"
    name: str | None = None
    sizes: tuple[int, ...] = (64, 128, 256, 512, 1024, 2048)  # packed tokens per micro-batch (compute sweep)
    short_length: int = 128  # tokens of each sequence in the "many short" mixes
    memory_sizes: tuple[int, ...] = (256, 512, 1024, 2048)
    comm_sizes: tuple[int, ...] = (1 << 12, 1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22)  # bytes per collective
    shard_sizes: tuple[int, ...] = (512, 2048)  # tokens of the sequence computed whole vs sharded at each degree
    warmup: int = 1
    repeats: int = 5
    memory_budget_bytes: float | None = None
    dtype: str | None = None  # float32 | bfloat16 autocast; default as the trainer: float32 on CPU, bf16 on CUDA
    attention_backend: str = AttentionBackend.AUTO.value
    activation_checkpointing: str = ActivationCheckpointing.NONE.value  # as the trainer will run; recorded
    seed: int = 0
    progress: bool = True

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"--device must be cpu or cuda, got {self.device!r}")
        ActivationCheckpointing(self.activation_checkpointing)
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
        self.model = CausalLMLoss(build_model(options.model, seed=options.seed, device=device))
        apply_activation_checkpointing(self.model, ActivationCheckpointing(options.activation_checkpointing))
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


def shard_degrees(world_size: int) -> tuple[int, ...]:
    """The degrees the shard effect is measured at: every hybrid group size (``block_degrees``) and the whole
    world; none in one process."""
    return (*block_degrees(world_size), world_size) if world_size > 1 else ()


def shard_micro_batch(world_size: int, degree: int) -> MicroBatch:
    """Sequence ``b`` zigzag-sharded over the ``b``-th aligned block of ``degree`` ranks, every block at once (so
    every rank works, as in training); over the whole world it is the plan's ``distributed`` part."""
    local: tuple[tuple[int, ...], ...] = ((),) * world_size
    if degree == world_size:
        return MicroBatch(local=local, distributed=(0,))
    return MicroBatch(local=local, distributed=(), sharded=tuple(
        ShardedGroup(cp_ranks=block, sequences=(index,)) for index, block in enumerate(cp_blocks(world_size, degree))))


def _new_block_groups(world_size: int) -> dict[tuple[int, int], dist.ProcessGroup]:
    """The process group of every aligned block holding this rank, by (first rank, size) as
    ``ParallelContext.cp_block_groups`` keys them: the profiler's world is one CP group. ``new_group`` is
    collective over the world, so every rank creates every block, in the same order."""
    rank = dist.get_rank()
    groups: dict[tuple[int, int], dist.ProcessGroup] = {}
    for degree in block_degrees(world_size):
        for block in cp_blocks(world_size, degree):
            group = dist.new_group(list(block))
            if rank in block:
                assert group is not None
                groups[(block[0], degree)] = group
    return groups


def _slowest_over_ranks(value: float, device: torch.device) -> float:
    slowest = torch.tensor([value], dtype=torch.float64, device=device)  # NCCL reduces device tensors only
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return float(slowest.item())


class _Lead:
    """CPU-bound torch work of a given duration, timed with every rank busy at once: it stands for the compute a
    micro-batch runs before each collective. Its unit is a matmul; its size only sets the lead's granularity."""

    UNIT_ROWS = 256
    CALIBRATION_UNITS = 32

    def __init__(self, bench: _Bench, world_size: int) -> None:
        self.matrix = torch.randn(self.UNIT_ROWS, self.UNIT_ROWS, device=bench.device)
        dist.barrier()
        times_s = timed_runs(self.of_units(self.CALIBRATION_UNITS), device=bench.device, warmup=1,
                             repeats=max(bench.options.repeats, 3))
        self.unit_s = _mean_over_ranks(statistics.median(times_s) / self.CALIBRATION_UNITS, world_size)

    def of_units(self, num_units: int) -> functools.partial[None]:
        return functools.partial(self._run, num_units)

    def of_seconds(self, seconds: float) -> functools.partial[None]:
        return self.of_units(max(round(seconds / self.unit_s), 1))

    def _run(self, num_units: int) -> None:
        for _ in range(num_units):
            torch.mm(self.matrix, self.matrix)


def collective_lead_s(fit: ComputeFit, shape: ModelShape, num_bytes: float, group_size: int,
                      kv_bytes_per_element: int) -> float:
    """The compute a rank runs before each collective of a static-CP micro-batch (one sequence sharded over
    ``group_size`` ranks) whose K/V per layer is ``num_bytes``: its share of the forward and backward (as
    ``PerformanceModel.placement_flops``: 1/group_size of the work, two zigzag chunks, β) spread over its
    2 · num_layers collectives (an all-gather per layer forward, a reduce-scatter per layer backward)."""
    num_tokens = num_bytes / (2 * shape.kv_hidden_size * kv_bytes_per_element)
    shared_s = fit.alpha_s_per_flop * float(eq13_flops(shape, [num_tokens])[0]) + fit.alpha_s_per_token * num_tokens
    rank_s = shared_s / group_size + 2 * fit.alpha_s_per_sequence + fit.beta_s_per_layer * shape.num_layers
    return rank_s / (2 * shape.num_layers)


def _collective_table(bench: _Bench, collective: str, group: dist.ProcessGroup | None, fit: ComputeFit,
                      lead: _Lead) -> list[list[float]]:
    dtype = torch.bfloat16 if bench.autocast_dtype is not None else torch.float32
    group_size = dist.get_world_size(group)
    table = []
    for num_bytes in bench.options.comm_sizes:
        lead_s = collective_lead_s(fit, bench.shape, num_bytes, group_size, bench.kv_bytes_per_element())
        latency_s = collective_latency_s(collective, num_bytes, group=group, device=bench.device, dtype=dtype,
                                         warmup=max(bench.options.warmup, 1), repeats=max(bench.options.repeats, 3),
                                         lead=lead.of_seconds(lead_s))
        if group is not None:  # every block measured at once; a micro-batch waits for the slowest
            latency_s = _slowest_over_ranks(latency_s, bench.device)
        table.append([float(num_bytes), latency_s])
    return table


def _measure_collectives(bench: _Bench, bar: tqdm, fit: ComputeFit, lead: _Lead) -> dict[str, list[list[float]]]:
    tables = {}
    for collective in COLLECTIVES:
        tables[collective] = _collective_table(bench, collective, None, fit, lead)
        bar.update(len(bench.options.comm_sizes))
    return tables


def _measure_group_collectives(
    bench: _Bench, bar: tqdm, world_size: int, block_groups: Mapping[tuple[int, int], dist.ProcessGroup],
    fit: ComputeFit, lead: _Lead,
) -> dict[str, dict[str, list[list[float]]]]:
    """All-gather and reduce-scatter over every aligned block of each hybrid group size, all blocks at once."""
    rank = dist.get_rank()
    by_size: dict[str, dict[str, list[list[float]]]] = {}
    for degree in block_degrees(world_size):
        group = block_groups[(rank // degree * degree, degree)]
        by_size[str(degree)] = {}
        for collective in GROUP_COLLECTIVES:
            by_size[str(degree)][collective] = _collective_table(bench, collective, group, fit, lead)
            bar.update(len(bench.options.comm_sizes))
    return by_size


def _measure_shards(
    bench: _Bench, bar: tqdm, world_size: int, block_groups: Mapping[tuple[int, int], dist.ProcessGroup]
) -> list[dict[str, Any]]:
    """Figure 1(b) per degree: one sequence whole on every rank (concurrently) vs as 1/d zigzag shards over
    every aligned block of d ranks (concurrently)."""
    rank, options = dist.get_rank(), bench.options
    results = []
    for size in options.shard_sizes:
        (sample,) = random_samples([size], vocab_size=bench.shape.vocab_size, seed=2000 + size)
        whole = local_pack([size], vocab_size=bench.shape.vocab_size, device=bench.device, seed=2000 + size)
        dist.barrier()
        whole_s = statistics.median(timed_runs(functools.partial(bench.step, whole), device=bench.device,
                                               warmup=options.warmup, repeats=options.repeats))
        whole_s = _mean_over_ranks(whole_s, world_size)
        for degree in shard_degrees(world_size):
            micro_batch = shard_micro_batch(world_size, degree)
            samples = [sample] * (1 if micro_batch.distributed else len(micro_batch.sharded))
            sharded = pack_micro_batch(samples, micro_batch, cp_size=world_size, cp_rank=rank,
                                       cp_group=dist.group.WORLD, cp_block_groups=block_groups).to(bench.device)
            dist.barrier()
            shard_times = timed_runs(functools.partial(bench.step, sharded), device=bench.device,
                                     warmup=options.warmup, repeats=options.repeats)
            results.append({"num_tokens": size, "degree": degree, "whole_s": whole_s,
                            "shard_s": _slowest_over_ranks(statistics.median(shard_times), bench.device)})
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
    num_group_sizes = len(block_degrees(world_size))
    if world_size > 1:
        num_cases += ((len(COLLECTIVES) + len(GROUP_COLLECTIVES) * num_group_sizes) * len(options.comm_sizes)
                      + len(options.shard_sizes) * len(shard_degrees(world_size)))
    bar = tqdm(total=num_cases, desc=f"profile {shape.name}", unit="case", disable=not (is_main and options.progress))
    tables: dict[str, list[list[float]]] = {}
    group_tables: dict[str, dict[str, list[list[float]]]] = {}
    shards: list[dict[str, Any]] = []
    with bar:
        compute_points = _measure_compute(bench, bar, world_size)
        if world_size > 1:
            block_groups = _new_block_groups(world_size)
            # The collectives follow compute as in a micro-batch, sized by the compute just measured.
            fit = fit_compute(_compute_points(compute_points), num_layers=shape.num_layers)
            lead = _Lead(bench, world_size)
            tables = _measure_collectives(bench, bar, fit, lead)
            group_tables = _measure_group_collectives(bench, bar, world_size, block_groups, fit, lead)
            shards = _measure_shards(bench, bar, world_size, block_groups)
        memory_points = _measure_memory(bench, bar) if is_main else []
    if not is_main:
        return None
    command = command or f"trainer_client.profile.measure_profile() from {Path(sys.argv[0]).name}"
    return _document(options, bench, world_size, compute_points, memory_points, tables, group_tables, shards,
                     command)


def _document(
    options: ProfileOptions, bench: _Bench, world_size: int, compute_points: list[dict[str, Any]],
    memory_points: list[tuple[int, int]], tables: dict[str, list[list[float]]],
    group_tables: dict[str, dict[str, list[list[float]]]], shards: list[dict[str, Any]], command: str,
) -> dict[str, Any]:
    shape, device = bench.shape, bench.device
    points = _compute_points(compute_points)
    extended = fit_compute(points, num_layers=shape.num_layers, extended=True)
    paper = fit_compute(points, num_layers=shape.num_layers, extended=False)
    memory = fit_memory(memory_points)
    states = state_bytes(bench.model, bench.optimizer)
    default_static = static_bytes_per_parameter(Sharding.ZERO2, param_dtype=bench.autocast_dtype or torch.float32)
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
            "static_bytes_per_parameter": {"replicated": default_static.replicated,
                                           "sharded": default_static.sharded},
            "activation_checkpointing": options.activation_checkpointing,
            "fit": {"max_relative_error": memory.max_relative_error},
            "points": [[tokens, peak] for tokens, peak in memory_points],
            "static_bytes": states,
            "source": ("activation peak above weights and optimizer states per micro-batch "
                       + ("(torch.cuda.max_memory_allocated)" if device.type == "cuda" else
                          "(torch.distributed._tools.mem_tracker.MemTracker: live tensor bytes)")
                       + f" with activation checkpointing {options.activation_checkpointing}; static per parameter: "
                         "the trainer's default --sharding zero2 (parallelize.static_bytes_per_parameter; the "
                         "trainer derives its BucketSize with its own mode's), static_bytes: weights, gradients "
                         "and AdamW states of one unsharded replica counted per tensor. reserved: CUDA context and "
                         "allocator slack (mem_get_info minus allocated), 0 on CPU."),
        },
        "communication": {
            "kv_bytes_per_element": bench.kv_bytes_per_element(),
            "tables": tables,
            "tables_by_group_size": group_tables,
            "fit": "relative",
            "world_size": world_size,
            "source": f"collective latency vs bytes moved in all (median over repetitions of the ranks' mean "
                      f"time from launch to the end of wait, each rank first computing for collective_lead_s: "
                      f"what a static-CP micro-batch computes before each collective): {comm_note}."
                      + (f" tables_by_group_size: all_gather and reduce_scatter of the same sizes over every aligned "
                         f"block of s ranks at once (dist.new_group per block), slowest block, for s in "
                         f"{', '.join(group_tables)}." if group_tables else ""),
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
        _add_shard_effect(document["compute"], PerformanceModel(model=shape, profile=parse_profile(document)), shards,
                          options)
    profile_from_document(document)  # the file must load where it is used: the format's model, then the core's
    return document


def _compute_points(compute_points: list[dict[str, Any]]) -> list[ComputePoint]:
    return [ComputePoint(flops=p["flops"], num_tokens=p["num_tokens"], num_sequences=p["num_sequences"],
                         time_s=p["time_s"]) for p in compute_points]


def _fit_summary(fit: Any) -> dict[str, float]:
    return {"alpha_s_per_flop": fit.alpha_s_per_flop, "alpha_s_per_token": fit.alpha_s_per_token,
            "alpha_s_per_sequence": fit.alpha_s_per_sequence, "beta_s_per_layer": fit.beta_s_per_layer,
            "median_relative_error": fit.median_relative_error, "max_relative_error": fit.max_relative_error}


def _predicted_shard_s(perf: PerformanceModel, num_tokens: int, degree: int) -> float:
    """The model's time of a rank holding only its shard of one sequence sharded over ``degree`` ranks: no local
    attention hides the collectives, so all of them are exposed (``costing.rank_time_s``)."""
    cost = perf.collective_cost(degree)
    return (perf.compute_time_s(float(perf.placement_flops([num_tokens], degree)[0]))
            + cost.all_gather_s(num_tokens) + cost.reduce_scatter_s(num_tokens))


def shard_effect_rows(perf: PerformanceModel, shards: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Measured whole vs shard times beside the model's prediction of both (eq. 2 with no local work)."""
    rows = []
    for shard in shards:
        size, degree = shard["num_tokens"], shard["degree"]
        predicted_s = _predicted_shard_s(perf, size, degree)
        rows.append({**shard, "query_tokens": size / (2 * degree),
                     "speedup": shard["whole_s"] / shard["shard_s"],
                     "parallel_efficiency": shard["whole_s"] / (degree * shard["shard_s"]),
                     "predicted_whole_s": perf.compute_time_s(float(perf.placement_flops([size], 1)[0])),
                     "predicted_shard_s": predicted_s,
                     "shard_relative_error": abs(predicted_s - shard["shard_s"]) / shard["shard_s"]})
    return rows


@dataclass(frozen=True, kw_only=True, slots=True)
class EfficiencyCandidate:
    """One measured attention call length: the attention time the model leaves unexplained vs its ideal."""

    query_tokens: float  # the sequence when whole; each zigzag chunk, S / 2d, when sharded over d ranks
    measured_as: str
    time_s: float  # measured
    other_s: float  # the model's non-attention terms: linear and per-token work, per-call costs, β, collectives
    ideal_attention_s: float  # α · attention FLOPs per rank: the attention term at efficiency 1

    @property
    def attention_s(self) -> float:
        return self.time_s - self.other_s

    @property
    def is_determined(self) -> bool:
        return self.attention_s >= MIN_ATTENTION_SHARE * self.time_s

    @property
    def efficiency(self) -> float | None:
        """The efficiency that makes the model's time equal the measured one (None where ill-determined)."""
        return self.ideal_attention_s / self.attention_s if self.is_determined else None


@dataclass(frozen=True, kw_only=True, slots=True)
class EfficiencyFit:
    """``compute.attention_efficiency`` derived from the shard-effect rows, or why it is not."""

    points: tuple[tuple[float, float], ...]  # (query tokens, relative throughput); empty: not determined
    reference_query_tokens: float  # the longest query measured: relative throughput 1 there
    candidates: tuple[EfficiencyCandidate, ...]
    verdicts: dict[float, str]  # per query length: usable, or why not
    result: str

    def __post_init__(self) -> None:
        assert set(self.verdicts) == {c.query_tokens for c in self.candidates}, "every query length has a verdict"

    def to_json(self) -> dict[str, Any]:
        return {
            "reference_query_tokens": self.reference_query_tokens,
            "min_attention_share": MIN_ATTENTION_SHARE,
            "max_candidate_spread": MAX_CANDIDATE_SPREAD,
            "max_reference_deviation": MAX_REFERENCE_DEVIATION,
            "candidates": [{**asdict(c), "attention_s": c.attention_s, "efficiency": c.efficiency,
                            "verdict": self.verdicts[c.query_tokens]} for c in self.candidates],
            "result": self.result,
        }


def _candidate(perf: PerformanceModel, num_tokens: int, degree: int, time_s: float) -> EfficiencyCandidate:
    alpha = perf.profile.compute.alpha_s_per_flop
    ideal_flops = float(perf.local_attention_flops([num_tokens])[0]) / degree
    # placement_flops minus its attention at efficiency 1: what the model says besides attention (β included)
    other_s = perf.compute_time_s(float(perf.placement_flops([num_tokens], degree)[0])) - alpha * ideal_flops
    if degree > 1:
        other_s += perf.comm_time_s(num_tokens, group_size=degree)  # no local attention hides it
    return EfficiencyCandidate(
        query_tokens=float(num_tokens) if degree == 1 else num_tokens / (2 * degree),
        measured_as=f"{num_tokens} tokens whole" if degree == 1 else f"{num_tokens} tokens over {degree} ranks",
        time_s=time_s, other_s=other_s, ideal_attention_s=alpha * ideal_flops)


def derive_attention_efficiency(perf: PerformanceModel, rows: Sequence[Mapping[str, Any]]) -> EfficiencyFit:
    """Attention throughput per query length from shard-effect rows (``num_tokens``, ``degree``, ``whole_s``,
    ``shard_s``), against ``perf`` with efficiency 1 everywhere.

    Per whole sequence (query ``S``) and per shard (query ``S / 2d``): the efficiency ``e`` with
    ``α·A/(d·e) + other = measured`` (``A`` the attention FLOPs, ``other`` the model's remaining terms), where
    attention is at least ``MIN_ATTENTION_SHARE`` of the measured time; per query length the median, where its
    candidates agree within ``MAX_CANDIDATE_SPREAD``, divided by the value at the longest query measured (a whole
    sequence, about 1 against the compute fit: within ``MAX_REFERENCE_DEVIATION`` of it). Points in (0, 1] are
    kept; fewer than 2, or a curve that falls by more than ``MAX_CANDIDATE_SPREAD`` towards longer queries, is no
    curve.
    """
    if perf.profile.compute.attention_efficiency:
        raise ValueError(f"profile {perf.profile.name} already has an attention efficiency curve; the efficiency is "
                         f"solved against the model with efficiency 1 everywhere")
    whole_s = {row["num_tokens"]: row["whole_s"] for row in rows}
    candidates = tuple(
        [_candidate(perf, size, 1, time_s) for size, time_s in sorted(whole_s.items())]
        + [_candidate(perf, row["num_tokens"], row["degree"], row["shard_s"]) for row in rows])
    by_query: dict[float, list[float]] = {}
    for candidate in candidates:
        by_query.setdefault(candidate.query_tokens, []).extend(
            [candidate.efficiency] if candidate.efficiency is not None else [])
    verdicts: dict[float, str] = {}
    determined: dict[float, float] = {}  # query tokens -> efficiency, ascending
    for query, values in sorted(by_query.items()):
        if not values:
            verdicts[query] = (f"ill-determined: attention is under {MIN_ATTENTION_SHARE:.0%} of the measured time "
                               f"or the model's other terms exceed it")
        elif max(values) > MAX_CANDIDATE_SPREAD * min(values):
            verdicts[query] = (f"ill-determined: its candidates disagree ({min(values):.3f} .. {max(values):.3f}, "
                               f"more than {MAX_CANDIDATE_SPREAD}x apart)")
        else:
            determined[query] = statistics.median(values)
            verdicts[query] = f"not used: efficiency {determined[query]:.3f}, but no curve is written"
    reference = max(by_query)

    def fit(points: Sequence[tuple[float, float]], result: str) -> EfficiencyFit:
        return EfficiencyFit(points=tuple(points), reference_query_tokens=reference, candidates=candidates,
                             verdicts=verdicts, result=result)

    if reference not in determined:
        return fit((), f"omitted: the longest query measured ({reference:g} tokens), the reference, is "
                       f"{verdicts[reference]}")
    if abs(determined[reference] - 1) > MAX_REFERENCE_DEVIATION:
        return fit((), f"omitted: not sensible, the longest query ({reference:g} tokens whole) has efficiency "
                       f"{determined[reference]:.3f} against the compute fit, more than {MAX_REFERENCE_DEVIATION:.0%} "
                       f"from 1: the machine ran differently than during the compute sweep")
    points = []
    for query, efficiency in determined.items():
        relative = efficiency / determined[reference]
        if 0 < relative <= 1:
            points.append((query, relative))
            verdicts[query] = f"usable: relative throughput {relative:.3f}"
        else:
            verdicts[query] = f"dropped: relative throughput {relative:.3f} is outside (0, 1]"
    if len(points) < 2:
        return fit((), f"omitted: {len(points)} usable query length(s), a curve needs 2")
    # Figure 1(b): throughput does not fall as queries lengthen; a curve that falls by more than the noise the
    # candidates are allowed measures the machine's load, not the kernel.
    for (short, short_relative), (long, long_relative) in itertools.combinations(points, 2):
        if short_relative > MAX_CANDIDATE_SPREAD * long_relative:
            return fit((), f"omitted: not sensible, the relative throughput falls from {short_relative:.3f} at "
                           f"{short:g} to {long_relative:.3f} at {long:g} query tokens")
    return fit(points, f"written: {len(points)} points")


def _add_shard_effect(compute: dict[str, Any], perf: PerformanceModel, shards: list[dict[str, Any]],
                      options: ProfileOptions) -> None:
    """``compute.shard_effect`` rows, their note, and ``attention_efficiency`` where the rows determine it."""
    rows = shard_effect_rows(perf, shards)
    fit = derive_attention_efficiency(perf, rows)
    compute["shard_effect"] = rows
    compute["fit"]["attention_efficiency"] = fit.to_json()
    degrees = sorted({row["degree"] for row in rows})
    note = (f"one sequence of each of {list(options.shard_sizes)} tokens run whole on every rank at once (whole_s: "
            f"mean over ranks) vs as zigzag shards over every aligned block of d ranks at once, d in {degrees} "
            f"(shard_s: slowest rank); each the median of {options.repeats} timed runs after {options.warmup} "
            f"warm-up. predicted_*: this profile's model with attention efficiency 1 (a rank holding only its "
            f"shard: nothing hides the collectives, whose cost is the table measured for d). ")
    if fit.points:
        compute["attention_efficiency"] = {
            "points": [[query, relative] for query, relative in fit.points],
            "source": f"derived from compute.shard_effect: per query length, the efficiency that makes the model's "
                      f"time equal the measured time, median per length, relative to the longest query measured "
                      f"({fit.reference_query_tokens:g} tokens); candidates in compute.fit.attention_efficiency.",
        }
    compute["shard_effect_note"] = note + (f"attention_efficiency: {fit.result}; candidates and verdicts in "
                                           f"compute.fit.attention_efficiency.")


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
                        help="sequence lengths computed whole vs sharded over blocks of every hybrid group size "
                             "and the whole world (world size > 1)")
    parser.add_argument("--warmup", type=int, default=defaults.warmup, help="untimed runs before each timing")
    parser.add_argument("--repeats", type=int, default=defaults.repeats, help="timed runs per case (median)")
    parser.add_argument("--threads", type=int, help="torch threads per process (default: torch's choice)")
    parser.add_argument("--memory-budget-bytes", type=float,
                        help="device memory the BucketSize is derived for (default: the device's)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], help="default: as the trainer")
    parser.add_argument("--attention-backend", default="auto", choices=[b.value for b in AttentionBackend])
    parser.add_argument("--activation-checkpointing", default=defaults.activation_checkpointing,
                        choices=[a.value for a in ActivationCheckpointing],
                        help="measure activations as the trainer will run with this --activation-checkpointing")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def summary(document: dict[str, Any]) -> str:
    """A few lines for the terminal: the fits, their errors, the BucketSize, the collective tables per group size
    and the shard effect per degree."""
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
    communication = document["communication"]
    groups = {communication["world_size"]: communication["tables"],
              **{int(size): tables for size, tables in communication.get("tables_by_group_size", {}).items()}}
    for group_size, tables in sorted(groups.items()):
        if tables:
            lines.append(f"communication over {group_size} ranks: " + "; ".join(
                f"{name} {table[0][1] * 1e6:.0f} us @ {table[0][0]:.0f} B .. {table[-1][1] * 1e6:.0f} us @ "
                f"{table[-1][0]:.0f} B" for name, table in tables.items()))
    if "shard_effect" in compute:
        lines.extend(_shard_table(compute, perf))
    return "\n".join(lines)


def _shard_table(compute: dict[str, Any], perf: PerformanceModel) -> list[str]:
    """The per-degree shard effect: measured whole and shard times, the model's shard time with efficiency 1 and
    (where the profile carries one) with its attention efficiency curve."""
    with_curve = bool(compute.get("attention_efficiency"))
    lines = ["shard effect (one sequence whole on each rank vs zigzag shards over every aligned block of d ranks; "
             "ms per micro-batch):",
             f"  {'tokens':>6} {'d':>3} {'query':>6} {'whole':>8} {'shard':>8} {'speedup':>7} {'par.eff':>7} "
             f"{'model':>8} {'error':>6}" + (f" {'+curve':>8} {'error':>6}" if with_curve else "")]
    for row in compute["shard_effect"]:
        line = (f"  {row['num_tokens']:>6} {row['degree']:>3} {row['query_tokens']:>6.0f} {row['whole_s'] * 1e3:>8.2f} "
                f"{row['shard_s'] * 1e3:>8.2f} {row['speedup']:>6.2f}x {row['parallel_efficiency']:>7.0%} "
                f"{row['predicted_shard_s'] * 1e3:>8.2f} {row['shard_relative_error']:>6.0%}")
        if with_curve:
            predicted_s = _predicted_shard_s(perf, row["num_tokens"], row["degree"])
            line += f" {predicted_s * 1e3:>8.2f} {abs(predicted_s - row['shard_s']) / row['shard_s']:>6.0%}"
        lines.append(line)
    if with_curve:
        lines.append("attention efficiency (relative throughput by query tokens): " + ", ".join(
            f"{query:g}: {relative:.2f}" for query, relative in compute["attention_efficiency"]["points"]))
    else:
        lines.append(f"attention efficiency: {compute['fit']['attention_efficiency']['result']}")
    return lines


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
            attention_backend=args.attention_backend, activation_checkpointing=args.activation_checkpointing,
            seed=args.seed, progress=not args.no_progress,
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
