"""Measuring on the training device: timings, peak memory, collective latency, and what the machine is.

Timings are repeated after warm-up and summarised by their median (robust to a
run slowed by another process); on CUDA they use CUDA events, so they time the
device, not the launch. Collectives are the exception: their mean, because their
slow runs are their own. On gloo a small collective's mean is 2-3 times its median
(``make bench-cpu-costs``: 4 KiB, 2 ranks, all-gather 247 µs median and 561 µs
mean, reduce-scatter 417 µs and 1.4 ms), and a step pays every slow one: the median
priced micro-batches that shard a sequence 5-7 ms low each, and ``make demo``'s
``deepspeed`` runs 13-27 % low. Peak memory is the allocator's peak on CUDA; on CPU,
where no allocator keeps one, PyTorch's ``MemTracker`` (a dispatch mode that
follows every tensor storage's life) counts the bytes live at the peak —
exact for tensors, blind to the allocator's own slack, and blind to tensors
made before it starts, which are counted apart. Either counts every tensor
alive, the model's shards and optimizer states included: what of it is static
memory is the memory model's to say (``sweeps``). Collectives time the
exact calls DACP attention makes (``torch_compat``'s ``all_gather_single`` and ``reduce_scatter_single``;
``all_to_all_single`` for the Ulysses comparison), launched and waited as it
does, after a lead of compute where the caller gives one (the collectives of
a micro-batch follow its compute), and take, per repetition, the ranks' mean.
"""

from __future__ import annotations

import datetime
import gc
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from scheduler_service.core.plan import MicroBatch
from scheduler_service.core.profile import Profile
from trainer_client.dacp.packing import PackedMicroBatch, pack_micro_batch
from trainer_client.data import Sample
from trainer_client.distributed.torch_compat import memory_tracker, torch_apis, torch_release

__all__ = [
    "COLLECTIVES",
    "check_profile_machine",
    "collective_latency_s",
    "device_memory_bytes",
    "hardware_info",
    "local_pack",
    "memory_per_rank_bytes",
    "peak_bytes",
    "random_samples",
    "software_versions",
    "state_bytes",
    "timed_runs",
    "utc_now",
]

COLLECTIVES = ("all_gather", "reduce_scatter", "all_to_all")


def timed_runs(fn: Callable[[], object], *, device: torch.device, warmup: int, repeats: int) -> list[float]:
    """Seconds per call of ``fn`` over ``repeats`` runs after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    times_s = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            times_s.append(start.elapsed_time(end) / 1e3)
        else:
            started = time.perf_counter()
            fn()
            times_s.append(time.perf_counter() - started)
    return times_s


def peak_bytes(fn: Callable[[], object], *, device: torch.device, model: torch.nn.Module,
               optimizer: torch.optim.Optimizer) -> int:
    """The most bytes of tensors alive at once on ``device`` while ``fn`` runs, those made before it included
    (``model``'s weights, gradients and buffers, ``optimizer``'s states, what FSDP keeps gathered)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device))
    alive_before = _live_tensor_bytes(device, model, optimizer)
    tracker = memory_tracker()  # the tensors made while fn runs; it cannot see those made before it
    with tracker:
        fn()
    made = tracker.get_tracker_snapshot("peak").get(device, {})  # nothing there when fn made no tensor
    return alive_before + int(made.get("Total", 0))


def _live_tensor_bytes(device: torch.device, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every tensor storage alive on ``device``, each counted once: the model's and the optimizer's, named
    (a gradient autograd made has no Python object until it is read), and every other tensor Python reaches
    (what FSDP keeps gathered). On CPU no allocator keeps a total. Wrapper tensors (DTensor) own no storage and
    are counted through their local tensors."""
    named = [*model.parameters(), *(p.grad for p in model.parameters() if p.grad is not None), *model.buffers(),
             *(value for state in optimizer.state.values() for value in state.values()
               if isinstance(value, torch.Tensor))]
    storages: dict[int, int] = {}
    for candidate in (*named, *gc.get_objects()):
        # type(), not isinstance(): that would also ask proxies and deprecated aliases for their __class__.
        if not issubclass(type(candidate), torch.Tensor):
            continue
        if isinstance(candidate, DTensor):
            candidate = candidate.to_local()
        if candidate.device != device:
            continue
        try:
            storage = candidate.untyped_storage()
            if storage.nbytes():  # FSDP frees a resharded parameter's storage by resizing it to nothing
                storages[storage.data_ptr()] = storage.nbytes()
        except (RuntimeError, NotImplementedError):  # a wrapper subclass: its inner tensors are found themselves
            continue
    return sum(storages.values())


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of this rank's weights, gradients (as many as it trains, in the weights' dtype) and optimizer states,
    counted tensor by tensor: its shards where the model is sharded."""
    def size(tensor: torch.Tensor) -> int:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        return local.numel() * local.element_size()

    parameters = list(model.parameters())
    return {
        "weights": sum(size(p) for p in parameters) + sum(size(b) for b in model.buffers()),
        "gradients": sum(size(p) for p in parameters if p.requires_grad),
        "optimizer": sum(size(value) for state in optimizer.state.values() for value in state.values()
                         if isinstance(value, torch.Tensor)),
    }


def collective_latency_s(
    collective: str, num_bytes: int, *, group: dist.ProcessGroup | None, device: torch.device,
    dtype: torch.dtype, warmup: int, repeats: int, lead: Callable[[], object] | None = None,
) -> float:
    """Mean over repetitions (module docstring: why not the median) of the ranks' mean time in one collective
    moving ``num_bytes`` in all (the gathered output of an all-gather, the input of a reduce-scatter or an
    all-to-all), from its launch to the end of its ``wait``, as DACP attention launches and waits it.

    With ``lead`` (the compute a rank runs before the collective in a micro-batch), every rank runs ``lead`` and
    then the collective, so ranks reach it from compute, apart, as in training: on a machine whose cores the
    ranks share, a collective then waits for the last rank to arrive, and a collective that starts from a
    barrier misses that. Every rank of a micro-batch finishes it together, so its time is its ranks' mean
    compute (what the compute fit measures) plus their mean time in the collectives (this)."""
    world_size = dist.get_world_size(group)
    element_size = torch.empty((), dtype=dtype).element_size()
    numel = max(num_bytes // element_size // world_size, 1) * world_size
    full = torch.ones(numel, dtype=dtype, device=device)
    shard = torch.ones(numel // world_size, dtype=dtype, device=device)

    def run() -> None:
        if collective == "all_gather":
            work = torch_apis().all_gather_single(full, shard, group=group, async_op=True)
        elif collective == "reduce_scatter":
            work = torch_apis().reduce_scatter_single(shard, full, group=group, async_op=True)
        elif collective == "all_to_all":
            work = dist.all_to_all_single(full, full.clone(), group=group, async_op=True)
        else:
            raise ValueError(f"unknown collective {collective!r}; known: {', '.join(COLLECTIVES)}")
        assert work is not None
        work.wait()

    for _ in range(warmup):
        run()
    mean_s = []
    for _ in range(repeats):
        dist.barrier(group=group)
        if lead is not None:
            lead()
        elapsed = timed_runs(run, device=device, warmup=0, repeats=1)[0]
        measured = torch.tensor([elapsed / world_size], dtype=torch.float64, device=device)
        dist.all_reduce(measured, group=group)
        mean_s.append(float(measured.item()))
    return statistics.fmean(mean_s)


def random_samples(lengths: Sequence[int], *, vocab_size: int, seed: int) -> list[Sample]:
    rng = np.random.default_rng(seed)
    samples = []
    for length in lengths:
        input_ids = rng.integers(0, vocab_size, size=int(length), dtype=np.int64)
        samples.append(Sample(input_ids=input_ids, labels=input_ids.copy()))
    return samples


def local_pack(lengths: Sequence[int], *, vocab_size: int, device: torch.device, seed: int) -> PackedMicroBatch:
    """One CP rank's packed micro-batch holding ``lengths`` whole (cp_size 1)."""
    samples = random_samples(lengths, vocab_size=vocab_size, seed=seed)
    micro_batch = MicroBatch(local=(tuple(range(len(samples))),), distributed=())
    return pack_micro_batch(samples, micro_batch, cp_size=1, cp_rank=0).to(device)


def device_memory_bytes(device: torch.device) -> int:
    """The device's memory: the GPU's, or the host's physical memory for CPU."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def memory_per_rank_bytes(device: torch.device, *, world_size: int) -> float:
    """The memory one rank of a world of ``world_size`` may fill: its GPU's; on CPU the host's physical memory,
    which the node's ranks (torchrun's ``LOCAL_WORLD_SIZE``, else the whole world) share. Physical, not available,
    memory: every rank of a node reads the same figure, so every rank derives the same BucketSize from it."""
    if device.type == "cuda":
        return device_memory_bytes(device)
    return device_memory_bytes(device) / int(os.environ.get("LOCAL_WORLD_SIZE", world_size))


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def hardware_info(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "host_memory_bytes": device_memory_bytes(torch.device("cpu")),
        "platform": platform.platform(),
    }
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        info.update(gpu=properties.name, gpu_memory_bytes=int(properties.total_memory),
                    gpu_capability=f"{properties.major}.{properties.minor}", gpu_count=torch.cuda.device_count())
    return info


def check_profile_machine(profile: Profile, device: torch.device) -> None:
    """Refuse, training on a GPU, a measured profile whose provenance says it was measured on another kind of
    device, another GPU or another torch release: its coefficients describe that machine, not this one. Profiles
    that were not measured (no provenance) and training on CPU pass."""
    provenance = profile.provenance
    if device.type != "cuda" or not provenance:
        return
    hardware, software = provenance.get("hardware", {}), provenance.get("software", {})
    here = torch.cuda.get_device_properties(device).name
    mismatches = []
    if "gpu" not in hardware:
        mismatches.append(f"it was measured on the CPU ({hardware.get('cpu', 'unknown')}), this run trains on "
                          f"{here}")
    elif hardware["gpu"] != here:
        mismatches.append(f"it was measured on {hardware['gpu']}, this run trains on {here}")
    measured_torch = software.get("torch")
    if measured_torch is not None and torch_release(measured_torch) != torch_release(torch.__version__):
        mismatches.append(f"it was measured with torch {measured_torch}, this run has torch {torch.__version__}")
    if mismatches:
        raise ValueError(f"profile {profile.name} does not describe this machine: {'; '.join(mismatches)}. Measure "
                         f"one here (python -m trainer_client.profile --device cuda --model ...), or name a shipped "
                         f"profile that was not measured (h100-eager)")


def software_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {"python": sys.version.split()[0], "torch": torch.__version__,
                                       "cuda": torch.version.cuda}
    for package in ("skrull", "transformers", "numpy", "flash-attn"):
        try:
            versions[package] = version(package)
        except PackageNotFoundError:
            versions[package] = None
    return versions


def utc_now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
