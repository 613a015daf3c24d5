"""``--profile auto``: the trainer measures the profile it plans with, before its first step, once per machine and
layout (the default on CUDA).

A shipped profile describes someone else's machine and engine: on the first real GPU the shipped ``h100-paper``
under-predicted the trainer's micro-batches by 94 %, while a profile the project measured there predicted its
steps within 3 % (docs/known-limits.md). So on CUDA the trainer measures a short profile with every rank
(``profiler.sweeps.run_sweeps`` over the trainer's own process group, the model laid out as the run lays it out:
dtype, sharding, checkpointing, ``--compile``) and plans with it.

The profile is cached under ``$XDG_CACHE_HOME/skrull/profiles`` (``~/.cache/skrull/profiles``), one file per
``AutoProfileKey``: the GPU (or CPU) model, the model's shape, the compute dtype, the attention backend, the torch
and transformers releases, the checkpointing mode, whether blocks are compiled, the sharding, the world size and
ranks per node, the sweep itself and the profiler's own code (a digest of its sources: a profile fitted by other
code is measured again). LoRA and the loss's chunking are not in it: the sweep measures full fine-tuning, and the
planner derives a LoRA run's memory from the profile (``core.memory.training_profile``).

The key is stored in the file's provenance and compared when read: a file that does not parse, does not load as a
profile, or was made for another key is measured again and replaced, never trusted; a cache that cannot be written
is warned of, and the run goes on with what it measured. Rank 0 decides and every rank hears the
outcome over the gloo group, so all measure or none does.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from skrull_proto import PROFILE_SCHEMA_VERSION

from scheduler_service.contract.profiles import profile_from_document
from scheduler_service.core import perf_model
from scheduler_service.core import profile as core_profile
from scheduler_service.core.profile import Profile
from trainer_client.distributed import ParallelContext
from trainer_client.models.loading import ModelLayout
from trainer_client.models.model import model_shape
from trainer_client.profiler import document as profiler_document
from trainer_client.profiler import measure as profiler_measure
from trainer_client.profiler import sweeps as profiler_sweeps
from trainer_client.profiler.command import measure_profile
from trainer_client.profiler.measure import hardware_info
from trainer_client.profiler.sweeps import ProfileOptions

__all__ = ["AUTO_PROFILE", "CPU_PROFILE", "AutoProfileKey", "auto_profile", "auto_profile_options", "cache_path",
           "default_profile", "profile_key"]

AUTO_PROFILE = "auto"
CPU_PROFILE = "h100-paper"  # default_profile says why
logger = logging.getLogger(__name__)

# A short sweep: the sizes below 1k tokens show a GPU's launch-bound floor, the larger ones its FLOP rate; two
# timed runs per case. 49 s for a 0.5B model on one H200, compiled (docs/benchmarks.md, "On GPUs").
_CUDA_SIZES = (512, 1024, 2048, 4096, 8192, 16384)
_CPU_SIZES = (64, 256, 1024, 2048)


@dataclass(frozen=True, kw_only=True, slots=True)
class AutoProfileKey:
    """What a measured profile holds for: another value of any field is another machine or another run."""

    device: str  # the GPU's name, or the CPU's model
    model: dict[str, Any]  # the model's shape (its name, layers, widths): two checkpoints of one shape time alike
    dtype: str
    attention_backend: str
    torch: str
    transformers: str
    activation_checkpointing: str
    compiled: bool
    sharding: str
    world_size: int
    ranks_per_node: int
    sweep: dict[str, Any]  # the profiler's options less the ones above: another sweep is another profile
    profiler: str  # a digest of the code that measures and fits (``_profiler_digest``)
    schema_version: int = PROFILE_SCHEMA_VERSION

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]


def default_profile(device: torch.device) -> str:
    """The profile a run plans with when ``--profile`` is not given: measured (``auto``) on a GPU; on CPU the shipped
    ``h100-paper``, as before the planner's default became ``h100-eager``: its costs add, the form a CPU's take (one
    process both dispatches and computes; the launch-bound floor is a GPU's), and the shipped CPU figures, tests and
    demos compare against it."""
    return AUTO_PROFILE if device.type == "cuda" else CPU_PROFILE


def auto_profile_options(model: str, device: torch.device, layout: ModelLayout, *, attention_backend: str,
                         progress: bool) -> ProfileOptions:
    """The short sweep ``auto`` measures, the model laid out as the run lays it out, its attention the run's."""
    cuda = device.type == "cuda"
    return ProfileOptions(
        model=model, device=device.type, sizes=_CUDA_SIZES if cuda else _CPU_SIZES, short_length=512 if cuda else 64,
        memory_sizes=(4096, 8192) if cuda else (256, 1024), comm_sizes=(1 << 16, 1 << 20, 1 << 23),
        shard_sizes=(2048, 8192) if cuda else (256, 1024), warmup=1, repeats=2,
        dtype="bfloat16" if layout.param_dtype == torch.bfloat16 else "float32",
        activation_checkpointing=layout.activation_checkpointing.value, sharding=layout.sharding.value,
        compile=layout.compiled, attention_backend=attention_backend, progress=progress,
    )


def profile_key(options: ProfileOptions, device: torch.device, world_size: int) -> AutoProfileKey:
    hardware = hardware_info(device)
    sweep = {name: value for name, value in asdict(options).items()
             if name not in {"model", "dtype", "attention_backend", "activation_checkpointing", "sharding", "compile",
                             "progress", "name"}}
    return AutoProfileKey(
        device=hardware["gpu"] if device.type == "cuda" else hardware["cpu"], model=asdict(model_shape(options.model)),
        dtype=options.dtype or "", attention_backend=options.attention_backend, torch=torch.__version__,
        transformers=importlib.metadata.version("transformers"),
        activation_checkpointing=options.activation_checkpointing, compiled=options.compile, sharding=options.sharding,
        world_size=world_size, ranks_per_node=int(os.environ.get("LOCAL_WORLD_SIZE", world_size)), sweep=sweep,
        profiler=_profiler_digest(),
    )


def _profiler_digest() -> str:
    """A digest of the sources that measure and fit a profile: the sweeps, the document, the probes, the core's
    fits and the profile format."""
    digest = hashlib.sha256()
    for module in (profiler_sweeps, profiler_document, profiler_measure, perf_model, core_profile):
        digest.update(Path(module.__file__ or "").read_bytes())
    return digest.hexdigest()[:16]


def cache_path(key: AutoProfileKey) -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "skrull" / "profiles"
    return cache / f"auto-{key.digest()}.json"


def auto_profile(model: str, *, parallel: ParallelContext, layout: ModelLayout, attention_backend: str = "auto",
                 progress: bool = True, options: ProfileOptions | None = None) -> Profile:
    """This run's measured profile: the cached one for its key, or measured now by every rank and cached. Every rank
    calls it and gets the same profile. ``options`` replaces the short sweep (tests measure a shorter one)."""
    options = options or auto_profile_options(model, parallel.device, layout, attention_backend=attention_backend,
                                              progress=progress)
    key = profile_key(options, parallel.device, parallel.dims.world_size)
    path = cache_path(key)
    document: list[dict[str, Any] | None] = [_cached(path, key) if parallel.is_main else None]
    dist.broadcast_object_list(document, src=0, group=parallel.object_group)
    if document[0] is None:
        started = time.perf_counter()
        if parallel.is_main:
            logger.info("--profile auto: measuring this machine for %s (about a minute on a GPU; cached in %s)",
                        model, path)
        measured = measure_profile(options, command=f"trainer_client.train --profile auto (key {key.digest()})")
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the sweep's model and activations: the run's own model comes next
        if parallel.is_main:
            assert measured is not None
            measured["name"] = f"auto-{key.digest()}"
            measured["provenance"]["auto_key"] = asdict(key)
            _write(path, measured)
            logger.info("--profile auto: measured in %.0f s", time.perf_counter() - started)
        document[0] = measured
        dist.broadcast_object_list(document, src=0, group=parallel.object_group)
    assert document[0] is not None
    return profile_from_document(document[0])


def _cached(path: Path, key: AutoProfileKey) -> dict[str, Any] | None:
    """The cached document for ``key``, or None (logged) when there is none or it cannot be trusted."""
    if not path.is_file():
        return None
    try:
        document = json.loads(path.read_text())
        profile_from_document(document)  # the format and every value's range
        stored_key = (document.get("provenance") or {}).get("auto_key")
    except Exception as error:  # whatever the file holds: rank 0 must reach the broadcast the others wait in
        logger.warning("--profile auto: the cached profile %s is unreadable (%s); measuring again", path, error)
        return None
    if stored_key != json.loads(json.dumps(asdict(key))):
        logger.warning("--profile auto: the cached profile %s was measured for another machine or layout; "
                       "measuring again", path)
        return None
    logger.info("--profile auto: using %s, measured %s", path, document["provenance"].get("date", "earlier"))
    return document


def _write(path: Path, document: dict[str, Any]) -> None:
    """Write atomically: a run stopped mid-write leaves the old file or none, never half of one. A cache that cannot
    be written (read-only, full) costs the next run a measurement, not this run its start."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps(document, indent=2) + "\n")
        partial.replace(path)
    except OSError as error:
        logger.warning("--profile auto: cannot cache the profile in %s (%s); the next run measures again", path, error)
