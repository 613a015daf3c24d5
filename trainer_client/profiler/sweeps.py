"""The profiler's sweeps: what it measures with torch on this machine, each with warm-up and repeated timings
summarised by the median (CUDA events on CUDA), running exactly what the trainer runs: its model laid out as
the trainer lays it out (``loading.build_training_module``: FSDP2 over the profiling ranks in the ``--sharding``
asked for, computing in the trainer's dtype) and its micro-batch step (``loss.run_micro_batch``: HF model,
DACP attention, loss, backward).

* **compute**: forward + backward of packed micro-batches over a sweep of sizes and sequence mixes (one long
  sequence, many short ones, half and half; ``compute_cases``) → ``T_comp = α·FLOPs + β`` (eq. 14) and the
  extended fit with per-token and per-sequence terms; each timed as a micro-batch amid a step's;
* **memory**: over a sweep of packed token counts, the peak of a step's last micro-batch less the static memory
  the memory model counts for the profiled layout (``scheduler_service.core.memory``) → ``M(S) = α·S + β``, so
  that the profile's activations and the memory model's static bytes add up to the measured peak, no byte
  counted in both; this rank's weights, gradients and optimizer states are also counted tensor by tensor;
* **communication** (world size > 1): all-gather / reduce-scatter / all-to-all latency vs message size over all
  ranks → the tables ``T_comm`` is fitted from; the same all-gather / reduce-scatter sizes over every aligned
  block of ``s`` ranks at once (``s`` each hybrid group size: the divisors of the world size between 2 and it).
  Each collective is timed as a micro-batch pays it: every rank first computes for as long as a static-CP
  micro-batch whose K/V the message is computes before each of its collectives (``collective_lead_s``, from the
  compute fit just measured), then launches and waits the collective; the ranks' mean time in it is the latency.
  Timed from a barrier instead, with the other ranks idle, the collectives of 4 ranks sharing 2 cores measure a
  quarter of what the trainer waits in them (dp 1 × cp 4, deepspeed's micro-batches). When the world spans
  nodes (``LOCAL_WORLD_SIZE`` < ``WORLD_SIZE``, as torchrun sets them), the world and the blocks larger than a
  node cross nodes: the profile document files those tables as inter-node ones (``document``);
* **the shard-size effect** of the paper's Figure 1(b) (world size > 1): one sequence computed whole on every
  rank vs as zigzag shards over every aligned block of ``d`` ranks at once (each block its own copy, so every
  rank works), for ``d`` each hybrid group size and the whole world (``shard_degrees``, ``shard_micro_batch``).

Under ``torchrun`` every rank runs every sweep at the same time (as in training, ranks share the machine and
FSDP's collectives join them) and the per-rank medians are averaged, the memory peaks maximised; rank 0 returns
what was measured (``Measurements``). Before any model is built, a layout whose weights, gradients and optimizer
states alone exceed a rank's memory is refused (``check_states_fit``), and the device memory no tensor holds
(``reserved_bytes``) is taken once the model is built and warm, with the allocator's cache emptied.
"""

from __future__ import annotations

import functools
import math
import os
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm

from scheduler_service.core import check
from scheduler_service.core.fitting import ComputeFit, ComputePoint, fit_compute
from scheduler_service.core.memory import static_bytes_per_parameter
from scheduler_service.core.models import ModelShape
from scheduler_service.core.perf_model import eq13_flops
from scheduler_service.core.plan import Collective, MicroBatch, ShardedGroup, block_degrees, cp_blocks
from trainer_client.dacp.kernels import AttentionBackend, resolve_backend
from trainer_client.dacp.packing import PackedMicroBatch, pack_micro_batch
from trainer_client.distributed import ParallelContext, ParallelDims, destroy_groups, init_parallel, max_over_ranks
from trainer_client.models.loading import ModelLayout, build_training_module
from trainer_client.models.loss import run_micro_batch
from trainer_client.models.model import model_shape
from trainer_client.models.parallelize import (
    ActivationCheckpointing,
    Sharding,
    check_compile,
    check_compile_layout,
    prepare_micro_batch,
)
from trainer_client.profiler.measure import (
    COLLECTIVES,
    collective_latency_s,
    device_memory_bytes,
    hardware_info,
    local_pack,
    memory_per_rank_bytes,
    peak_bytes,
    random_samples,
    software_versions,
    state_bytes,
    timed_runs,
    utc_now,
)

__all__ = [
    "GROUP_COLLECTIVES",
    "Measurements",
    "ProfileOptions",
    "check_states_fit",
    "collective_lead_s",
    "compute_cases",
    "compute_points",
    "run_sweeps",
    "shard_degrees",
    "shard_micro_batch",
    "shard_runs",
]

GROUP_COLLECTIVES = ("all_gather", "reduce_scatter")  # what a hybrid group's attention runs (dacp/attention.py)


CPU_SIZES = (64, 128, 256, 512, 1024, 2048)
# On a GPU the small sizes show the launch-bound floor (the host's dispatch, flat up to ~4k tokens for a 0.5B model
# on an H200), the large ones the device's work.
CUDA_SIZES = (256, 512, 1024, 2048, 4096, 8192, 16384)


# Timed runs of each collective at least (its mean: measure.collective_latency_s).
COLLECTIVE_REPEATS = 30


@dataclass(frozen=True, kw_only=True, slots=True)
class ProfileOptions:
    model: str
    device: str = "cpu"
    name: str | None = None
    # Packed tokens per micro-batch of the compute sweep; empty: the device's (``CPU_SIZES``, ``CUDA_SIZES``).
    sizes: tuple[int, ...] = ()
    short_length: int = 128  # tokens of each sequence in the "many short" mixes
    memory_sizes: tuple[int, ...] = (256, 512, 1024, 2048)
    comm_sizes: tuple[int, ...] = (1 << 12, 1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22)  # bytes per collective
    # tokens of the sequence computed whole vs sharded at each degree; the two shortest price a shard's own cost
    shard_sizes: tuple[int, ...] = (64, 128, 512, 2048)
    warmup: int = 1
    repeats: int = 5
    memory_budget_bytes: float | None = None
    dtype: str | None = None  # float32 | bfloat16 autocast; default as the trainer: float32 on CPU, bf16 on CUDA
    attention_backend: str = AttentionBackend.AUTO.value
    activation_checkpointing: str = ActivationCheckpointing.NONE.value  # as the trainer will run; recorded
    sharding: str = Sharding.ZERO2.value  # as the trainer will run (FSDP2 over the profiling ranks); recorded
    compile: bool = False  # each decoder layer under torch.compile, as the trainer's --compile; recorded
    seed: int = 0
    progress: bool = True

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"--device must be cpu or cuda, got {self.device!r}")
        checkpointing = ActivationCheckpointing(self.activation_checkpointing)
        Sharding(self.sharding)
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA device is visible to torch")
        if self.compile:
            check_compile_layout(checkpointing)
            check_compile(torch.device(self.device))
        if not self.sizes:
            object.__setattr__(self, "sizes", CUDA_SIZES if self.device == "cuda" else CPU_SIZES)
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


@dataclass(frozen=True, kw_only=True, slots=True)
class Measurements:
    """What rank 0 measured, and the machine and settings it measured on: what the profile document holds."""

    shape: ModelShape
    world_size: int
    local_world_size: int  # ranks per node (torchrun's LOCAL_WORLD_SIZE); the world size on one node
    process_group_backend: str | None  # gloo or nccl; None in one process
    device_type: str  # cpu | cuda
    device_name: str  # the GPU's name on CUDA, the CPU model's on CPU
    device_memory_bytes: int  # the whole device's (the host's physical memory on CPU)
    reserved_bytes: int  # CUDA context and allocator slack (mem_get_info minus allocated); 0 on CPU
    threads_per_rank: int
    dtype_name: str  # float32 | bfloat16
    param_dtype: torch.dtype  # what the model computes in (bfloat16 on CUDA by default); master weights float32
    sharding: Sharding  # how the weights and states lay over the profiling ranks, as the trainer's --sharding
    attention_backend: str  # the backend ``--attention-backend`` resolved to on this device
    kv_bytes_per_element: int
    hardware: dict[str, Any]
    software: dict[str, str | None]
    measured_at: str  # UTC, ISO 8601
    static_bytes: dict[str, int]  # rank 0's weights, gradients and optimizer states (its shards), tensor by tensor
    compute_points: list[dict[str, Any]]  # per compute case: tokens, sequences, FLOPs, median time, spread
    memory_points: list[tuple[int, int]]  # (packed tokens, activation bytes): the peak less the static bytes
    memory_peaks: list[tuple[int, int]]  # (packed tokens, every byte alive at the peak), the largest over ranks
    static_bytes_counted: float  # what the memory model counts per rank for the profiled layout
    tables: dict[str, list[list[float]]]  # collective -> [[bytes, seconds], ...] over all ranks
    group_tables: dict[str, dict[str, list[list[float]]]]  # group size -> collective -> table
    shards: list[dict[str, Any]]  # per sequence length and degree: num_tokens, degree, whole_s, shard_s


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


def compute_points(points: Sequence[Mapping[str, Any]]) -> list[ComputePoint]:
    """The compute sweep's points as the fit takes them."""
    return [ComputePoint(flops=p["flops"], num_tokens=p["num_tokens"], num_sequences=p["num_sequences"],
                         time_s=p["time_s"]) for p in points]


class _Bench:
    """The model as the trainer lays it out over the profiling ranks, its optimizer, and the trainer's micro-batch
    step."""

    def __init__(self, options: ProfileOptions, parallel: ParallelContext, layout: ModelLayout) -> None:
        self.options = options
        self.parallel = parallel
        self.device = parallel.device
        self.shape: ModelShape = model_shape(options.model)
        self.layout = layout
        self.dtype_name = "bfloat16" if self.layout.param_dtype == torch.bfloat16 else "float32"
        self.model = build_training_module(options.model, parallel=parallel, layout=self.layout, seed=options.seed)
        self.parameters = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.parameters, lr=1e-3)
        # Materialise the optimizer states (AdamW creates them lazily at the first step), then drop gradients.
        for parameter in self.parameters:
            parameter.grad = torch.zeros_like(parameter)
        self.optimizer.step()
        self.zero_grad()
        # The first micro-batches pay one-off costs (allocator growth, lazy kernel and autograd set-up, the first
        # collectives) that a per-case warm-up of one run does not absorb for the first small cases.
        warm = local_pack((256, 128, 64, 64), vocab_size=self.shape.vocab_size, device=self.device, seed=options.seed)
        timed_runs(functools.partial(self.step, warm, is_last=True), device=self.device, warmup=3, repeats=0)
        self.zero_grad()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def step(self, pack: PackedMicroBatch, *, is_last: bool = False) -> None:
        """One micro-batch as the trainer runs it, from no gradient (``run``)."""
        self.zero_grad()
        self.run(pack, is_last=is_last)

    def run(self, pack: PackedMicroBatch, *, is_last: bool = False) -> None:
        """One micro-batch as the trainer runs it: one amid a step's micro-batches (``zero2``: the gathered weights
        kept, gradients accumulated unsharded), or with ``is_last`` the step's last, whose backward reduces the
        gradients (where a step's memory peaks)."""
        prepare_micro_batch(self.model, sharding=self.layout.sharding, is_last=is_last)
        run_micro_batch(self.model, pack, num_loss_tokens=max(pack.num_loss_tokens, 1),
                        autocast_dtype=self.layout.autocast_dtype, attention_backend=self.options.attention_backend)

    def static_bytes(self) -> float:
        """What the memory model counts as this rank's static memory in the profiled layout: the weights,
        gradients and optimizer states of ``scheduler_service.core.memory``, nothing the activations hold."""
        static = static_bytes_per_parameter(self.layout.sharding, compute_bytes=self.layout.param_dtype.itemsize)
        return static.per_rank(self.shape.num_parameters, self.parallel.dims.world_size)

    def kv_bytes_per_element(self) -> int:
        return self.layout.param_dtype.itemsize


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
    """Per packed size, (tokens, every byte alive at the peak of a step's last micro-batch after one before it),
    where a step's memory peaks; the largest over the ranks. What of it is activations is the peak less the static
    bytes the memory model counts for the profiled layout (``run_sweeps``)."""
    peaks = []
    for index, size in enumerate(bench.options.memory_sizes):
        lengths = (size,) if size <= 2 * bench.options.short_length else (
            size // 2, *(bench.options.short_length,) * ((size - size // 2) // bench.options.short_length))
        pack = local_pack(lengths, vocab_size=bench.shape.vocab_size, device=bench.device, seed=1000 + index)
        bench.step(pack)  # a micro-batch before the last: what it accumulates is alive at the step's peak
        peak = peak_bytes(functools.partial(bench.run, pack, is_last=True), device=bench.device, model=bench.model,
                          optimizer=bench.optimizer)
        peaks.append((pack.num_tokens, int(max_over_ranks(peak, bench.device))))
        bench.zero_grad()
        bar.update()
    return peaks


def shard_degrees(world_size: int) -> tuple[int, ...]:
    """The degrees the shard effect is measured at: every hybrid group size (``block_degrees``) and the whole
    world; none in one process."""
    return (*block_degrees(world_size), world_size) if world_size > 1 else ()


def shard_micro_batch(world_size: int, degree: int, ulysses_degree: int = 1) -> MicroBatch:
    """Sequence ``b`` sharded over the ``b``-th aligned block of ``degree`` ranks by the scheme of
    ``ulysses_degree`` (1: zigzag, all-gather-KV), every block at once (so every rank works, as in training); over
    the whole world it is the plan's ``distributed`` part."""
    local: tuple[tuple[int, ...], ...] = ((),) * world_size
    if degree == world_size:
        return MicroBatch(local=local, distributed=(0,), distributed_ulysses_degree=ulysses_degree)
    return MicroBatch(local=local, distributed=(), sharded=tuple(
        ShardedGroup(cp_ranks=block, sequences=(index,), ulysses_degree=ulysses_degree)
        for index, block in enumerate(cp_blocks(world_size, degree))))


def heads_split(shape: ModelShape, ulysses_degree: int) -> bool:
    """Whether the model's heads split evenly over ``ulysses_degree`` ranks (``check.scheme_violation``)."""
    return check.scheme_violation(Collective(first_rank=0, degree=ulysses_degree, sequences=(0,),
                                             ulysses_degree=ulysses_degree), shape.heads) is None


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
    group_size = dist.get_world_size(group)
    table = []
    for num_bytes in bench.options.comm_sizes:
        lead_s = collective_lead_s(fit, bench.shape, num_bytes, group_size, bench.kv_bytes_per_element())
        # A mean (collective_latency_s) of a long-tailed latency needs more runs than a median to settle.
        latency_s = collective_latency_s(collective, num_bytes, group=group, device=bench.device,
                                         dtype=bench.layout.param_dtype, warmup=max(bench.options.warmup, 1),
                                         repeats=max(bench.options.repeats, COLLECTIVE_REPEATS),
                                         lead=lead.of_seconds(lead_s))
        if group is not None:  # every block measured at once; a micro-batch waits for the slowest
            latency_s = max_over_ranks(latency_s, bench.device)
        table.append([float(num_bytes), latency_s])
    return table


def _measure_collectives(bench: _Bench, bar: tqdm, fit: ComputeFit, lead: _Lead) -> dict[str, list[list[float]]]:
    tables = {}
    for collective in COLLECTIVES:
        tables[collective] = _collective_table(bench, collective, None, fit, lead)
        bar.update(len(bench.options.comm_sizes))
    return tables


def _measure_group_collectives(
    bench: _Bench, bar: tqdm, world_size: int, fit: ComputeFit, lead: _Lead,
) -> dict[str, dict[str, list[list[float]]]]:
    """All-gather and reduce-scatter over every aligned block of each hybrid group size, all blocks at once."""
    rank = bench.parallel.global_rank
    by_size: dict[str, dict[str, list[list[float]]]] = {}
    for degree in block_degrees(world_size):
        group = bench.parallel.cp_block_group(rank // degree * degree, degree)
        by_size[str(degree)] = {}
        for collective in GROUP_COLLECTIVES:
            by_size[str(degree)][collective] = _collective_table(bench, collective, group, fit, lead)
            bar.update(len(bench.options.comm_sizes))
    return by_size


def shard_runs(options: ProfileOptions) -> int:
    """Timed runs of a sharded row: its collectives' latency is long-tailed, so its mean, what a step pays, needs as
    many runs as a collective's (``COLLECTIVE_REPEATS``)."""
    return max(options.repeats, COLLECTIVE_REPEATS)


def _measure_shards(bench: _Bench, bar: tqdm, world_size: int) -> list[dict[str, Any]]:
    """Figure 1(b) per degree: one sequence whole on every rank (concurrently) vs as 1/d zigzag shards over
    every aligned block of d ranks (concurrently)."""
    rank, options, parallel = bench.parallel.global_rank, bench.options, bench.parallel
    results = []
    for size in options.shard_sizes:
        (sample,) = random_samples([size], vocab_size=bench.shape.vocab_size, seed=2000 + size)
        whole = local_pack([size], vocab_size=bench.shape.vocab_size, device=bench.device, seed=2000 + size)
        dist.barrier()
        whole_s = statistics.median(timed_runs(functools.partial(bench.step, whole), device=bench.device,
                                               warmup=options.warmup, repeats=options.repeats))
        whole_s = _mean_over_ranks(whole_s, world_size)
        for degree in shard_degrees(world_size):
            # zigzag (all-gather-KV), and on the two shortest Ulysses where the heads split: its own cost alone
            schemes = [1] + ([degree] if size in sorted(options.shard_sizes)[:2] and heads_split(bench.shape, degree)
                             else [])
            for ulysses_degree in schemes:
                micro_batch = shard_micro_batch(world_size, degree, ulysses_degree)
                samples = [sample] * (1 if micro_batch.distributed else len(micro_batch.sharded))
                sharded = pack_micro_batch(samples, micro_batch, cp_size=world_size, cp_rank=rank,
                                           cp_group=parallel.cp_group,
                                           cp_block_groups=parallel.cp_block_groups,
                                           cp_stride_groups=parallel.cp_stride_groups).to(bench.device)
                dist.barrier()
                shard_times = timed_runs(functools.partial(bench.step, sharded), device=bench.device,
                                         warmup=options.warmup, repeats=shard_runs(options))
                results.append({"num_tokens": size, "degree": degree, "whole_s": whole_s,
                                "shard_s": max_over_ranks(statistics.fmean(shard_times), bench.device),
                                **({"ulysses_degree": ulysses_degree} if ulysses_degree > 1 else {})})
            bar.update()
    bench.zero_grad()
    return results


def _reserved_bytes(device: torch.device) -> int:
    """Device memory in use that no tensor holds: the CUDA context, communicator buffers, the allocator's slack
    in the blocks tensors use (0 on CPU). Taken with the allocator's cache emptied, before the sweeps: after them
    it would count every block the sweeps cached as if it could never be used."""
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return max(int(total - free - torch.cuda.memory_allocated(device)), 0)


def check_states_fit(shape: ModelShape, layout: ModelLayout, *, world_size: int, memory_budget_bytes: float) -> None:
    """Refuse, before any model is built, a profile whose weights, gradients and optimizer states alone cannot fit
    one rank's memory in ``layout`` over ``world_size`` ranks, saying what would."""
    def states_per_rank(sharding: Sharding) -> float:
        static = static_bytes_per_parameter(sharding, compute_bytes=layout.param_dtype.itemsize)
        return static.per_rank(shape.num_parameters, world_size)

    needed = states_per_rank(layout.sharding)
    if needed < memory_budget_bytes:
        return
    def gib(num_bytes: float) -> str:
        return f"{num_bytes / (1 << 30):.3g} GiB"

    zero3 = states_per_rank(Sharding.ZERO3)
    if zero3 < memory_budget_bytes:
        advice = f"--sharding zero3 keeps {gib(zero3)} per rank"
    else:
        sharded = static_bytes_per_parameter(Sharding.ZERO3, compute_bytes=layout.param_dtype.itemsize).sharded
        min_ranks = math.floor(shape.num_parameters * sharded / memory_budget_bytes) + 1
        advice = f"even --sharding zero3 keeps {gib(zero3)} per rank: profile under torchrun over {min_ranks} ranks"
    raise ValueError(f"{shape.name} ({shape.num_parameters / 1e9:.3g}B parameters) under --sharding {layout.sharding} "
                     f"keeps {gib(needed)} per rank of weights, gradients and optimizer states over {world_size} "
                     f"rank(s), more than the {gib(memory_budget_bytes)} of memory each has: {advice}")


def run_sweeps(options: ProfileOptions) -> Measurements | None:
    """Run every sweep; rank 0 returns what was measured (``None`` on the others).

    Every rank of torchrun's world calls it; a process group it had to make (none existed) ends when it returns.
    Run alone, it measures in a world of one process. The model is laid out as the trainer lays it out over the
    profiling ranks.
    """
    world_size = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    shape = model_shape(options.model)
    device = (torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if options.device == "cuda"
              else torch.device("cpu"))
    layout = ModelLayout.on(device, dtype=options.dtype, sharding=Sharding(options.sharding),
                            activation_checkpointing=ActivationCheckpointing(options.activation_checkpointing),
                            compiled=options.compile)
    check_states_fit(shape, layout, world_size=world_size, memory_budget_bytes=options.memory_budget_bytes
                     or memory_per_rank_bytes(device, world_size=world_size))
    joined = dist.is_initialized()
    parallel = init_parallel(ParallelDims(dp_size=1, cp_size=world_size), device_type=options.device)
    try:
        return _sweep(options, parallel, layout)
    finally:
        if joined:  # the caller's world goes on (a trainer measuring its own profile): this call's groups end
            destroy_groups(parallel)
        else:  # the world this call made for itself ends with it
            dist.destroy_process_group()


def _sweep(options: ProfileOptions, parallel: ParallelContext, layout: ModelLayout) -> Measurements | None:
    world_size, device, is_main = parallel.dims.world_size, parallel.device, parallel.is_main
    bench = _Bench(options, parallel, layout)
    shape = bench.shape
    reserved_bytes = _reserved_bytes(device)
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
        points = _measure_compute(bench, bar, world_size)
        if world_size > 1:
            # The collectives follow compute as in a micro-batch, sized by the compute just measured.
            fit = fit_compute(compute_points(points), num_layers=shape.num_layers)
            lead = _Lead(bench, world_size)
            tables = _measure_collectives(bench, bar, fit, lead)
            group_tables = _measure_group_collectives(bench, bar, world_size, fit, lead)
            shards = _measure_shards(bench, bar, world_size)
        memory_peaks = _measure_memory(bench, bar)
    if not is_main:
        return None
    # Which bytes live where: the memory model counts the layout's weights, gradients and optimizer states; the
    # profile's activations are the rest of each peak, so the two add up to it and neither counts a byte twice.
    static_bytes = bench.static_bytes()
    hardware = hardware_info(device)
    return Measurements(
        shape=shape, world_size=world_size,
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", world_size)) if world_size > 1 else 1,
        process_group_backend=dist.get_backend() if world_size > 1 else None,
        device_type=device.type, device_name=hardware["gpu" if device.type == "cuda" else "cpu"],
        device_memory_bytes=device_memory_bytes(device), reserved_bytes=reserved_bytes,
        threads_per_rank=torch.get_num_threads(), dtype_name=bench.dtype_name, param_dtype=bench.layout.param_dtype,
        sharding=bench.layout.sharding,
        attention_backend=resolve_backend(options.attention_backend, device=device,
                                          dtype=bench.layout.param_dtype).value,
        kv_bytes_per_element=bench.kv_bytes_per_element(), hardware=hardware, software=software_versions(),
        measured_at=utc_now(), static_bytes=state_bytes(bench.model, bench.optimizer), compute_points=points,
        memory_points=[(tokens, int(peak - static_bytes)) for tokens, peak in memory_peaks], memory_peaks=memory_peaks,
        static_bytes_counted=static_bytes, tables=tables, group_tables=group_tables, shards=shards,
    )
