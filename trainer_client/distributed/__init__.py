"""Process-group plumbing: the DP × CP mesh, and a gloo launcher for CPU tests and tools. Beside it in this
package: ``parallelize`` (activation checkpointing, compiled blocks, FSDP, the gradient all-reduce, over this mesh),
``torch_compat`` (the torch calls that differ between the supported releases) and ``host_memory`` (a CPU rank keeps
the memory its micro-batches free, as a GPU's caching allocator does: ``init_parallel`` sets it).

``ParallelDims`` names every rank by its coordinates: ``global_rank = dp_rank ·
cp_size + cp_rank`` (the row-major layout of ``init_device_mesh``), so the CP
group of DP row ``i`` is global ranks ``[i · cp_size, (i + 1) · cp_size)``.

Hybrid DACP shards some sequences over an aligned *block* of a CP group
(docs/design.md, "Wire contract"). ``init_parallel`` creates the process group of every
such block of every DP row up front, ``sum(cp_size / s for s in
block_degrees(cp_size))`` per row (4 + 2 for cp_size 8), because
``dist.new_group`` is collective over the world and cannot be called lazily by
only the ranks of one micro-batch. ``ParallelContext.cp_block_group(first, s)``
looks a block up by its first CP rank and size; the block of all ``cp_size``
ranks is the CP group itself. Spanning micro-batches (blocks of several DP
replicas, docs/design.md, "Blocks that span DP replicas") shard over aligned
blocks of world ranks that no CP group holds; ``init_parallel`` creates those
too (``ParallelDims.span_block_ranks``), and
``ParallelContext.world_block_group(first, s)`` looks up any aligned block of
world ranks holding this rank.

A collective of 2D attention (Ulysses degree ``1 < u < s``, ``dacp/attention.py``)
also all-gathers K/V over a *strided* set of its block: the ``s/u`` ranks at the
same place ``j`` of each of its sub-blocks of ``u``. ``init_parallel`` creates
those for every aligned block of every degree ``s`` of the CP group (the whole
group included) and every such ``u`` (``ParallelDims.cp_stride_ranks``; 10 per
DP row for cp_size 8), and ``ParallelContext.cp_stride_groups`` keys them by
``(first CP rank, size, stride)``. Spanning micro-batches get none: their
collectives run all-gather-KV or Ulysses only.

Every process group (the world, the mesh's, the flattened DP × CP mesh FSDP
shards over, the block groups, the gloo object group) is created with the same
collective timeout: a rank that stops answering fails its peers' next
collective after that long, whichever group it is on (``new_group`` would
otherwise give each new group the 30-minute default).

A rank that raises does not leave the others waiting for that timeout: before it
tears its process groups down it reports its reason in the default group's store
(``report_failure``; under torchrun the agent's store, which outlives every
worker). Its peers' next collective then fails at once (gloo: the connection
closes; torchrun also stops every worker as soon as one exits), and each of them
finds the first report there and stops with ``PeerFailed`` naming that rank and
its reason instead of its own broken collective (``train.py``). The first report
wins, so a peer's consequential error never takes the blame. A rank killed
outright (a signal, the OOM killer) reports nothing: the first peer whose
collective breaks reports that, and torchrun's summary names the killed rank by
its exit signal. A rank's signal handler reads the report too (``reported_failure``):
torchrun's SIGTERM after a failure ends a rank at once, where a SIGTERM without
one stops the run at its next step boundary (``components/stop.py``).

Teardown: ``destroy_process_group`` frees a group only when nothing else holds it. ``torch._dynamo`` keeps every
group that exists when it is first imported (torch 2.13; torch.nn.attention.varlen, FSDP2 and ``--compile`` import
it). Such a group outlived its processes' interpreter, with gloo's worker threads still running; one that released a
finished collective as the interpreter shut down aborted the process ("terminate called without an active
exception", about one CP-2 attention test in twenty). This module imports ``torch._dynamo`` first, so every group
is created after it and freed when it is destroyed.
"""

from __future__ import annotations

import functools
import gc
import json
import os
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch._dynamo  # before any process group exists; see the module docstring, "Teardown"
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from scheduler_service.core.check import spanning_widths
from scheduler_service.core.costing import place_degrees
from scheduler_service.core.plan import block_degrees, cp_blocks
from trainer_client.choices import DEFAULT_COLLECTIVE_TIMEOUT_S
from trainer_client.distributed.host_memory import retain_freed_memory
from trainer_client.distributed.torch_compat import default_store, flatten_mesh, group_options

__all__ = ["DEFAULT_COLLECTIVE_TIMEOUT_S", "FirstFailure", "ParallelContext", "ParallelDims", "PeerFailed",
           "destroy_groups", "free_port", "init_parallel", "max_over_ranks", "report_failure", "reported_failure",
           "spawn_gloo", "spawn_ranks"]

_FIRST_FAILURE_KEY = "skrull/first_failure"  # in the default group's store: per job, and per torchrun restart


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelDims:
    """The DP × CP layout, row-major: ``global_rank = dp_rank · cp_size + cp_rank``."""

    dp_size: int
    cp_size: int

    def __post_init__(self) -> None:
        for name in ("dp_size", "cp_size"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")

    @property
    def world_size(self) -> int:
        return self.dp_size * self.cp_size

    def coordinates(self, global_rank: int) -> tuple[int, int]:
        """(dp_rank, cp_rank) of a global rank."""
        return divmod(global_rank, self.cp_size)

    def global_rank(self, dp_rank: int, cp_rank: int) -> int:
        return dp_rank * self.cp_size + cp_rank

    def cp_block_ranks(self) -> tuple[tuple[int, tuple[int, ...]], ...]:
        """(dp_rank, block of CP ranks) of every aligned block of every DP row, in the order groups are created.

        Per degree ``s`` of ``block_degrees(cp_size)``, ascending, then per DP row, the blocks ``cp_blocks``.
        """
        return tuple((dp_rank, block) for degree in block_degrees(self.cp_size) for dp_rank in range(self.dp_size)
                     for block in cp_blocks(self.cp_size, degree))

    def cp_stride_ranks(self) -> tuple[tuple[int, tuple[int, ...]], ...]:
        """(dp_rank, strided CP ranks) of every 2D all-gather group of every DP row, in the order groups are created.

        Per degree ``s`` of ``block_degrees(cp_size)`` and ``cp_size``, ascending, per Ulysses degree ``u`` with
        ``1 < u < s`` dividing ``s``, ascending, per DP row, per aligned block of ``s``, per place ``j < u``: the
        ranks ``first + j, first + j + u, …`` (``s/u`` of them).
        """
        degrees = (*block_degrees(self.cp_size), self.cp_size) if self.cp_size > 1 else ()
        return tuple((dp_rank, block[place::ulysses_degree])
                     for degree in degrees for ulysses_degree in range(2, degree) if degree % ulysses_degree == 0
                     for dp_rank in range(self.dp_size) for block in cp_blocks(self.cp_size, degree)
                     for place in range(ulysses_degree))

    def is_cp_block(self, ranks: tuple[int, ...]) -> bool:
        """Whether consecutive world ``ranks`` are an aligned block of one DP row's CP group (or the group)."""
        offset = ranks[0] % self.cp_size
        return (ranks[0] // self.cp_size == ranks[-1] // self.cp_size and self.cp_size % len(ranks) == 0
                and offset % len(ranks) == 0)

    def span_block_ranks(self) -> tuple[tuple[int, ...], ...]:
        """Every aligned block of world ranks a spanning micro-batch may shard over that is not a CP group's block,
        in the order groups are created: per spanning block of ``w`` DP replicas (``check.spanning_widths``, then
        its first replica), each aligned block of its ``w × cp_size`` ranks at every degree, each block once."""
        blocks: dict[tuple[int, ...], None] = {}
        for width in spanning_widths(self.dp_size):
            for first_dp_rank in range(0, self.dp_size - width + 1, width):
                first = first_dp_rank * self.cp_size
                for degree in place_degrees(width * self.cp_size)[1:]:
                    for start in range(first, first + width * self.cp_size, degree):
                        ranks = tuple(range(start, start + degree))
                        if not self.is_cp_block(ranks):
                            blocks.setdefault(ranks)
        return tuple(blocks)

    def check_world_size(self, world_size: int) -> None:
        if world_size != self.world_size:
            raise ValueError(
                f"world size {world_size} != dp {self.dp_size} × cp {self.cp_size} = {self.world_size}; "
                f"launch with torchrun --nproc-per-node {self.world_size} or change --dp/--cp"
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelContext:
    """This rank's place in the DP × CP mesh, its device, and every process group it takes part in."""

    dims: ParallelDims
    mesh: DeviceMesh
    shard_mesh: DeviceMesh  # 1-D, the flattened ("dp", "cp") mesh: FSDP shards parameters over every rank
    global_rank: int
    dp_rank: int
    cp_rank: int
    device: torch.device
    cp_group: dist.ProcessGroup
    # (first CP rank, size) → process group, for every aligned block of the CP group that holds this rank.
    cp_block_groups: Mapping[tuple[int, int], dist.ProcessGroup]
    # (first world rank, size) → process group, for every block of ``span_block_ranks`` that holds this rank.
    span_groups: Mapping[tuple[int, int], dist.ProcessGroup]
    # (first CP rank, size, stride) → process group of CP ranks first, first + stride, … (size of them), for every
    # strided group of ``cp_stride_ranks`` that holds this rank (2D attention's K/V all-gathers).
    cp_stride_groups: Mapping[tuple[int, int, int], dist.ProcessGroup]
    object_group: dist.ProcessGroup  # gloo: plans and decisions travel here even when training on NCCL
    collective_timeout: timedelta  # of every group above

    @property
    def is_main(self) -> bool:
        return self.global_rank == 0

    def cp_block_group(self, first_cp_rank: int, degree: int) -> dist.ProcessGroup:
        """The process group of CP ranks ``[first_cp_rank, first_cp_rank + degree)`` of this rank's DP row."""
        if (first_cp_rank, degree) == (0, self.dims.cp_size):
            return self.cp_group
        group = self.cp_block_groups.get((first_cp_rank, degree))
        if group is None:
            raise ValueError(f"CP rank {self.cp_rank} has no group for the block of {degree} CP ranks from "
                             f"{first_cp_rank}: not an aligned block of cp_size {self.dims.cp_size} holding it")
        return group

    def world_block_group(self, first_rank: int, size: int) -> dist.ProcessGroup:
        """The process group of world ranks ``[first_rank, first_rank + size)``, a block of a spanning micro-batch
        (or of this rank's CP group) holding this rank."""
        ranks = tuple(range(first_rank, first_rank + size))
        if self.dims.is_cp_block(ranks) and first_rank // self.dims.cp_size == self.dp_rank:
            return self.cp_block_group(first_rank % self.dims.cp_size, size)
        group = self.span_groups.get((first_rank, size))
        if group is None:
            raise ValueError(f"rank {self.global_rank} has no group for the block of {size} world ranks from "
                             f"{first_rank}: not a spanning block of dp {self.dims.dp_size} x cp "
                             f"{self.dims.cp_size} holding it")
        return group


def _world_store(world_size: int, timeout: timedelta) -> dict[str, Any]:
    """The store the world group meets in (``init_process_group`` arguments).

    Under torchrun, the agent's store with this restart's own key prefix: torchrun keeps one agent store across
    ``--max-restarts`` restarts and ``env://`` adds no per-restart prefix (torch 2.13), so a restarted gloo group
    would read the dead workers' addresses and fail to connect. A lone process started without a launcher (no
    ``MASTER_ADDR``) meets itself in an in-process store. Otherwise no arguments: ``env://`` as usual.
    """
    if "MASTER_ADDR" not in os.environ and world_size == 1:
        return {"store": dist.HashStore(), "rank": 0, "world_size": 1}
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if restart is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False,
                          timeout=timeout)
    return {"store": dist.PrefixStore(f"skrull/restart_{restart}", store), "rank": int(os.environ["RANK"]),
            "world_size": world_size}


def init_parallel(dims: ParallelDims, *, timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S,
                  device_type: str | None = None) -> ParallelContext:
    """Join the process group torchrun (or ``spawn_gloo``) set up and build the ("dp", "cp") mesh.

    NCCL on CUDA, gloo on CPU (``device_type``: by default CUDA where torch sees it); the world size is checked
    against dp × cp before any collective. Every group is created with ``timeout_s`` (a world group made by the
    caller must have been given the same). Run without torchrun, it makes a world of this one process.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    dims.check_world_size(world_size)
    use_cuda = torch.cuda.is_available() if device_type is None else device_type == "cuda"
    if use_cuda:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
        retain_freed_memory()  # the trainer and the profiler alike: the profile measures what the runs will do
    backend = "nccl" if use_cuda else "gloo"
    timeout = timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        # Bound to its GPU, the world communicator is made at once and the mesh's and blocks' groups are split
        # from it (ncclCommSplit) instead of each bootstrapping a communicator of its own.
        dist.init_process_group(backend, timeout=timeout, device_id=device if use_cuda else None,
                                **_world_store(world_size, timeout))
    dims.check_world_size(dist.get_world_size())
    override = (backend, group_options(backend, timeout))
    mesh = init_device_mesh(device.type, (dims.dp_size, dims.cp_size), mesh_dim_names=("dp", "cp"),
                            backend_override={"dp": override, "cp": override})
    shard_mesh = flatten_mesh(mesh["dp", "cp"], "dp_cp", backend_override=override)
    global_rank = dist.get_rank()
    dp_rank, cp_rank = dims.coordinates(global_rank)
    cp_block_groups = _new_cp_block_groups(dims, global_rank, timeout)
    span_groups = _new_span_groups(dims, global_rank, timeout)
    cp_stride_groups = _new_cp_stride_groups(dims, global_rank, timeout)
    object_group = dist.new_group(backend="gloo", timeout=timeout) if use_cuda else dist.group.WORLD
    assert object_group is not None
    cp_group = mesh.get_group("cp")
    return ParallelContext(dims=dims, mesh=mesh, shard_mesh=shard_mesh, global_rank=global_rank, dp_rank=dp_rank,
                           cp_rank=cp_rank, device=device, cp_group=cp_group, cp_block_groups=cp_block_groups,
                           span_groups=span_groups, cp_stride_groups=cp_stride_groups, object_group=object_group,
                           collective_timeout=timeout)


def destroy_groups(parallel: ParallelContext) -> None:
    """End the process groups ``init_parallel`` made for ``parallel``, the world group excepted: a context built for a
    while inside a world that goes on (the profiler inside a trainer, ``--profile auto``) frees its communicators,
    NCCL's buffers on the GPU among them. Every rank calls it, after the context's last collective."""
    world = dist.group.WORLD
    groups = [parallel.mesh.get_group("dp"), parallel.mesh.get_group("cp"), parallel.shard_mesh.get_group(),
              *parallel.cp_block_groups.values(), *parallel.span_groups.values(),
              *parallel.cp_stride_groups.values(), parallel.object_group]
    for group in {id(group): group for group in groups if group is not world}.values():
        dist.destroy_process_group(group)


def _new_cp_block_groups(
    dims: ParallelDims, global_rank: int, timeout: timedelta
) -> dict[tuple[int, int], dist.ProcessGroup]:
    """Create every block group of every DP row; keep this rank's. Every rank runs the same calls in the same order."""
    dp_rank, cp_rank = dims.coordinates(global_rank)
    groups: dict[tuple[int, int], dist.ProcessGroup] = {}
    for row, block in dims.cp_block_ranks():
        # Group rank = position in the block: new_group orders members by global rank, ascending here.
        group = dist.new_group([dims.global_rank(row, member) for member in block], timeout=timeout)
        if row == dp_rank and cp_rank in block:
            assert group is not None and group != dist.GroupMember.NON_GROUP_MEMBER
            groups[(block[0], len(block))] = group
    return groups


def _new_cp_stride_groups(
    dims: ParallelDims, global_rank: int, timeout: timedelta
) -> dict[tuple[int, int, int], dist.ProcessGroup]:
    """Create every strided group of every DP row (``cp_stride_ranks``); keep this rank's. Every rank runs the same
    calls in the same order."""
    dp_rank, cp_rank = dims.coordinates(global_rank)
    groups: dict[tuple[int, int, int], dist.ProcessGroup] = {}
    for row, members in dims.cp_stride_ranks():
        # Group rank = sub-block index: new_group orders members by global rank, ascending here.
        group = dist.new_group([dims.global_rank(row, member) for member in members], timeout=timeout)
        if row == dp_rank and cp_rank in members:
            assert group is not None and group != dist.GroupMember.NON_GROUP_MEMBER
            groups[(members[0], len(members), members[1] - members[0])] = group
    return groups


def _new_span_groups(
    dims: ParallelDims, global_rank: int, timeout: timedelta
) -> dict[tuple[int, int], dist.ProcessGroup]:
    """Create the group of every block of ``span_block_ranks``; keep this rank's. Every rank runs the same calls in
    the same order."""
    groups: dict[tuple[int, int], dist.ProcessGroup] = {}
    for ranks in dims.span_block_ranks():
        group = dist.new_group(list(ranks), timeout=timeout)
        if global_rank in ranks:
            assert group is not None and group != dist.GroupMember.NON_GROUP_MEMBER
            groups[(ranks[0], len(ranks))] = group
    return groups


def max_over_ranks(value: float, device: torch.device) -> float:
    """The largest ``value`` over all ranks of the world (every rank calls): the slowest rank's time is the one
    its peers wait for."""
    largest = torch.tensor([value], dtype=torch.float64, device=device)  # NCCL reduces device tensors only
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    return float(largest.item())


@dataclass(frozen=True, kw_only=True, slots=True)
class FirstFailure:
    """The first rank of the job to fail, and why."""

    global_rank: int
    reason: str  # "ExceptionType: message"
    user_error: bool = False  # the user's to fix (a ValueError), which that rank prints: its peers exit quietly


class PeerFailed(RuntimeError):
    """Another rank failed first; this rank stops with its reason (its own error, a collective cut short by that
    failure, is chained as the cause)."""

    def __init__(self, first: FirstFailure) -> None:
        super().__init__(f"global rank {first.global_rank} failed: {first.reason}")
        self.first = first


def report_failure(error: Exception, *, user_error: bool = False) -> FirstFailure | None:
    """Report ``error`` (``user_error``: the user's to fix) as this rank's failure unless a rank reported first;
    returns the first report.

    Every rank calls this on failure, before it destroys its process groups, so that a peer woken by the torn-down
    connection finds the report. None without a process group, or when the store is gone (outside torchrun it
    lives in global rank 0, which may have exited).
    """
    if not dist.is_initialized():
        return None
    mine = json.dumps({"global_rank": dist.get_rank(), "reason": f"{type(error).__name__}: {error}",
                       "user_error": user_error})
    try:
        # compare_set with expected "" sets the key only if it is absent, atomically; it returns the stored value.
        first = default_store().compare_set(_FIRST_FAILURE_KEY, "", mine)
    except (RuntimeError, dist.DistError):
        return None
    return FirstFailure(**json.loads(first))


def reported_failure() -> FirstFailure | None:
    """The first failure a rank of this job reported (``report_failure``), without reporting one; None when none
    was, without a process group, or when the store is gone."""
    if not dist.is_initialized():
        return None
    try:
        store = default_store()
        if not store.check([_FIRST_FAILURE_KEY]):
            return None
        first = store.get(_FIRST_FAILURE_KEY)
    except (RuntimeError, dist.DistError):
        return None
    return FirstFailure(**json.loads(first))


def free_port() -> int:
    """A free TCP port on loopback (the OS picks; tiny race window, fine for tests)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _spawned(
    local_rank: int, world_size: int, port: int, device_type: str, fn: Callable[..., None], args: tuple[Any, ...]
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world_size),
                      RANK=str(local_rank), LOCAL_RANK=str(local_rank))
    timeout = timedelta(seconds=DEFAULT_COLLECTIVE_TIMEOUT_S)
    if device_type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", rank=local_rank, world_size=world_size, timeout=timeout, device_id=device)
    else:
        torch.set_num_threads(1)  # several ranks share few cores; oversubscription only slows every rank down
        dist.init_process_group("gloo", rank=local_rank, world_size=world_size, timeout=timeout)
    try:
        fn(*args)
    finally:
        dist.destroy_process_group()


def spawn_ranks(fn: Callable[..., None], world_size: int, *args: Any, device_type: str = "cpu") -> None:
    """Run ``fn(*args)`` on ``world_size`` processes of this machine joined in a process group, as torchrun would:
    gloo on CPU (one thread each), NCCL on CUDA (one GPU each). Re-raises a rank's exception.

    CPU ranks are forked, as torch's own multi-process tests do: a forked rank starts with what this process has
    imported (torch, transformers, the compiled kernels), where a fresh interpreter pays 4-5 s of imports per rank,
    most of a small run. This process's objects are frozen out of the garbage collector from the fork until the
    ranks end (``gc.freeze``): a child never finalises what it inherited, such as a pool whose threads did not come
    with the fork (a child's collection of torch.compile's inherited state crashed it). CUDA ranks are spawned, and
    so are CPU ranks of a process that has initialised CUDA: CUDA cannot be used in a child forked after that.
    """
    spawn = functools.partial(mp.start_processes, _spawned, args=(world_size, free_port(), device_type, fn, args),
                              nprocs=world_size, join=True)
    if device_type == "cuda" or torch.cuda.is_initialized():
        spawn(start_method="spawn")
        return
    gc.collect()
    gc.freeze()
    try:
        spawn(start_method="fork")
    finally:
        gc.unfreeze()


def spawn_gloo(fn: Callable[..., None], world_size: int, *args: Any) -> None:
    """Run ``fn(*args)`` on ``world_size`` CPU processes joined in a gloo group; re-raises a rank's exception."""
    spawn_ranks(fn, world_size, *args, device_type="cpu")
