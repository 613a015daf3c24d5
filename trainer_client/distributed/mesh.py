"""The DP × CP mesh of a run and every process group its collectives need (``init_parallel``).

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

Teardown: ``destroy_process_group`` frees a group only when nothing else holds it. ``torch._dynamo`` keeps every
group that exists when it is first imported (torch 2.13; torch.nn.attention.varlen, FSDP2 and ``--compile`` import
it). Such a group outlived its processes' interpreter, with gloo's worker threads still running; one that released a
finished collective as the interpreter shut down aborted the process ("terminate called without an active
exception", about one CP-2 attention test in twenty). This module imports ``torch._dynamo`` first (``launch.py``
too), so every group is created after it and freed when it is destroyed.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch._dynamo  # before any process group exists; see the module docstring, "Teardown"
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from scheduler_service.core.check import spanning_widths
from scheduler_service.core.costing import place_degrees
from scheduler_service.core.plan import block_degrees, cp_blocks
from trainer_client.config_choices import DEFAULT_COLLECTIVE_TIMEOUT_S
from trainer_client.distributed.host_memory import retain_freed_memory
from trainer_client.distributed.torch_compat import flatten_mesh, group_options

if TYPE_CHECKING:
    from trainer_client.config import TrainConfig

__all__ = ["ParallelContext", "ParallelDims", "destroy_groups", "init_parallel", "max_over_ranks"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelDims:
    """The DP × CP layout, row-major: ``global_rank = dp_rank · cp_size + cp_rank``."""

    dp_size: int
    cp_size: int

    @classmethod
    def of(cls, config: TrainConfig) -> ParallelDims:
        """The layout ``--dp`` and ``--cp`` give."""
        return cls(dp_size=config.dp, cp_size=config.cp)

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
