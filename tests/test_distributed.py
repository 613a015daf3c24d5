"""The DP × CP layout and the hybrid DACP block groups every rank creates at start-up."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter

import pytest
import torch
import torch.distributed as dist

from trainer_client.distributed import ParallelDims, free_port, init_parallel


@pytest.mark.parametrize(("dp_size", "cp_size", "blocks_per_row"), [(2, 8, 4 + 2), (3, 4, 2), (1, 6, 3 + 2), (2, 2, 0)])
def test_every_aligned_block_of_every_dp_row_gets_a_group(dp_size: int, cp_size: int, blocks_per_row: int) -> None:
    dims = ParallelDims(dp_size=dp_size, cp_size=cp_size)
    blocks = dims.cp_block_ranks()
    assert len(blocks) == dp_size * blocks_per_row
    assert len(set(blocks)) == len(blocks)
    for degree in {len(block) for _, block in blocks}:
        assert 2 <= degree < cp_size and cp_size % degree == 0
        # Per size, a DP row's blocks partition its CP ranks into aligned runs.
        for dp_rank in range(dp_size):
            of_row = [block for row, block in blocks if row == dp_rank and len(block) == degree]
            assert [cp_rank for block in of_row for cp_rank in block] == list(range(cp_size))
            assert all(block == tuple(range(block[0], block[0] + degree)) and block[0] % degree == 0
                       for block in of_row)


def test_global_ranks_are_row_major_over_dp_then_cp() -> None:
    dims = ParallelDims(dp_size=2, cp_size=4)
    assert [dims.global_rank(*dims.coordinates(g)) for g in range(8)] == list(range(8))
    assert dims.global_rank(1, 2) == 6


def test_each_rank_joins_one_block_group_per_size() -> None:
    dims = ParallelDims(dp_size=2, cp_size=8)
    memberships = Counter((dims.global_rank(row, cp_rank), len(block))
                          for row, block in dims.cp_block_ranks() for cp_rank in block)
    assert set(memberships.values()) == {1} and len(memberships) == 16 * 2


class _Joined(Exception):
    """Stops init_parallel once the world group is joined: what it was joined with is what is checked."""


def test_the_world_group_is_bound_to_the_ranks_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bound to a device, NCCL makes the world communicator at once and splits the mesh's and the blocks' groups
    from it, rather than giving each its own buffers."""
    joined: list[dict[str, object]] = []

    def init_process_group(backend: str, **kwargs: object) -> None:
        joined.append({"backend": backend, **kwargs})
        raise _Joined

    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    with pytest.raises(_Joined):
        init_parallel(ParallelDims(dp_size=1, cp_size=1))
    assert joined[0]["backend"] == "nccl" and joined[0]["device_id"] == torch.device("cuda", 0)


def test_a_destroyed_group_is_freed_even_when_torch_dynamo_comes_later() -> None:
    """torch._dynamo holds every group that exists when it is first imported; a held gloo group's worker threads
    outlive the interpreter and can abort the process as it exits. Importing trainer_client.distributed imports
    torch._dynamo first. A fresh interpreter, because this one imported torch._dynamo long ago."""
    code = f"""
import gc, weakref
import torch.distributed as dist
import trainer_client.distributed
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
import torch.nn.attention.varlen  # imports torch._dynamo, as the DACP attention does once a run is under way
world = weakref.ref(dist.group.WORLD)
dist.destroy_process_group()
gc.collect()
print("freed" if world() is None else "held")
"""
    assert subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout == "freed\n"
