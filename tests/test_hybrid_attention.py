"""Hybrid DACP attention over blocks of the CP group equals unsharded attention; backward overlaps its collectives.

Four gloo ranks, cp_size 4, float64. Process groups come from ``init_parallel``, as in training.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist

import trainer_client.dacp.kernels as kernels
from scheduler_service.core.plan import MicroBatch, ShardedGroup
from tests.attention_reference import reference_attention
from trainer_client.dacp.attention import KVAllGather, dacp_attn_varlen_func
from trainer_client.dacp.kernels import AttentionBackend
from trainer_client.dacp.packing import pack_micro_batch
from trainer_client.dacp.zigzag import zigzag_positions
from trainer_client.data import Sample
from trainer_client.distributed import ParallelDims, init_parallel, spawn_gloo

CP = 4
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 2, 8
LENGTHS = (5, 17, 64, 33, 1, 100, 2, 9, 40, 3)
MICRO_BATCHES = {
    "blocks_and_whole_group": MicroBatch(
        local=((0, 4), (6,), (), (9,)), distributed=(2,),
        sharded=(ShardedGroup(cp_ranks=(0, 1), sequences=(1, 3)), ShardedGroup(cp_ranks=(2, 3), sequences=(5, 7)))),
    # CP ranks 0 and 1 are in three collectives: the whole group and the block (0, 1) twice.
    "rank_in_several_groups": MicroBatch(
        local=((0,), (), (6,), (4,)), distributed=(9,),
        sharded=(ShardedGroup(cp_ranks=(0, 1), sequences=(5,)), ShardedGroup(cp_ranks=(2, 3), sequences=(3, 1)),
                 ShardedGroup(cp_ranks=(0, 1), sequences=(8, 2)))),
    # CP rank 0 runs only local attention; ranks 1-3 have no local sequence.
    "blocks_only": MicroBatch(
        local=((0, 4, 6), (), (), ()), distributed=(),
        sharded=(ShardedGroup(cp_ranks=(2, 3), sequences=(1, 5)),)),
}
ORDERING_CASE = "rank_in_several_groups"


def _collectives(micro_batch: MicroBatch, cp_rank: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    blocks = [(tuple(range(CP)), micro_batch.distributed)] if micro_batch.distributed else []
    return blocks + [(g.cp_ranks, g.sequences) for g in micro_batch.sharded if cp_rank in g.cp_ranks]


def _rows(micro_batch: MicroBatch, cp_rank: int) -> list[tuple[int, int]]:
    """(sequence index, global position) of each packed row, straight from the zigzag rule within each block."""
    rows = [(index, position) for index in micro_batch.local[cp_rank] for position in range(LENGTHS[index])]
    for block, indices in _collectives(micro_batch, cp_rank):
        for index in indices:
            positions = zigzag_positions(LENGTHS[index], cp_size=len(block), cp_rank=cp_rank - block[0])
            rows += [(index, int(p)) for p in positions]
    return rows


def _sequence_tensors(seed: int = 0) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    shapes = {"q": NUM_HEADS, "k": NUM_KV_HEADS, "v": NUM_KV_HEADS, "grad_out": NUM_HEADS}
    return [{name: torch.randn(length, heads, HEAD_DIM, generator=generator, dtype=torch.float64)
             for name, heads in shapes.items()} for length in LENGTHS]


def _take(rows: list[tuple[int, int]], key: str, source: list[dict[str, torch.Tensor]]) -> torch.Tensor:
    """The packed rows of one tensor; padding rows get an arbitrary value (they must influence nothing)."""
    shape = tuple(source[0][key].shape[1:])
    if not rows:
        return torch.zeros(0, *shape, dtype=torch.float64)
    return torch.stack([source[i][key][p] if p < LENGTHS[i] else torch.full(shape, 7.0, dtype=torch.float64)
                        for i, p in rows])


class _Marker(torch.autograd.Function):
    """Identity that records ``event`` when its backward runs."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, events: list[str], event: str) -> torch.Tensor:
        ctx.events, ctx.event = events, event
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        ctx.events.append(ctx.event)
        return grad, None, None


def _recording(events: list[str]) -> tuple[list[Any], kernels.VarlenKernel]:
    """Patches that log reduce-scatter launches and waits, and a kernel that marks the start and end of local
    attention's backward."""
    launch, wait = KVAllGather._launch_reduce_scatter, KVAllGather._wait_reduce_scatter
    varlen = kernels.resolve_kernel(AttentionBackend.SDPA, device=torch.device("cpu"), dtype=torch.float64)

    def logged_launch(self: KVAllGather, grad: torch.Tensor) -> None:
        events.append("reduce_scatter_launched")
        launch(self, grad)

    def logged_wait(self: KVAllGather) -> torch.Tensor:
        events.append("reduce_scatter_waited")
        return wait(self)

    def marked_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                      cu_seqlens_k: torch.Tensor, *args: Any) -> torch.Tensor:
        if cu_seqlens_q is not cu_seqlens_k:  # a collective's attention; local attention passes one cu_seqlens
            return varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *args)
        q, k, v = (_Marker.apply(x, events, "local_backward_ended") for x in (q, k, v))
        out = varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *args)
        return _Marker.apply(out, events, "local_backward_started")

    return ([mock.patch.object(KVAllGather, "_launch_reduce_scatter", logged_launch),
             mock.patch.object(KVAllGather, "_wait_reduce_scatter", logged_wait)], marked_varlen)


def _run_rank(out_dir: Path) -> None:
    parallel = init_parallel(ParallelDims(dp_size=1, cp_size=CP))
    cp_rank = parallel.cp_rank
    tensors = _sequence_tensors()
    samples = [Sample(input_ids=torch.zeros(n, dtype=torch.int64).numpy(),
                      labels=torch.zeros(n, dtype=torch.int64).numpy()) for n in LENGTHS]
    results: dict[str, Any] = {"block_groups": {key: dist.get_process_group_ranks(group)
                                                for key, group in parallel.cp_block_groups.items()}}
    own_first = cp_rank - cp_rank % 2
    assert parallel.cp_block_group(0, CP) is parallel.cp_group
    assert parallel.cp_block_group(own_first, 2) is parallel.cp_block_groups[(own_first, 2)]
    with pytest.raises(ValueError, match="no group for the block"):
        parallel.cp_block_group(2 - own_first, 2)  # the other half of the CP group
    for name, micro_batch in MICRO_BATCHES.items():
        packed = pack_micro_batch(samples, micro_batch, cp_size=CP, cp_rank=cp_rank, cp_group=parallel.cp_group,
                                  cp_block_groups=parallel.cp_block_groups)
        rows = _rows(micro_batch, cp_rank)
        q_THD, k_TGD, v_TGD = (_take(rows, key, tensors).requires_grad_() for key in "qkv")
        events: list[str] = []
        patches, kernel = _recording(events) if name == ORDERING_CASE else ([], None)
        for patch in patches:
            patch.start()
        try:
            out_THD = dacp_attn_varlen_func(q_THD, k_TGD, v_TGD, packed.metadata, backend=AttentionBackend.SDPA,
                                            kernel=kernel)
            if not packed.is_idle:  # as the trainer: an idle rank runs nothing (here: CP rank 1 of blocks_only)
                real = torch.tensor([position < LENGTHS[index] for index, position in rows], dtype=torch.bool)
                # Padding carries no loss: no gradient reaches a padding output.
                (out_THD * _take(rows, "grad_out", tensors) * real[:, None, None]).sum().backward()
        finally:
            for patch in patches:
                patch.stop()
        grads = {key: x.grad if x.grad is not None else torch.zeros_like(x)
                 for key, x in (("q", q_THD), ("k", k_TGD), ("v", v_TGD))}
        results[name] = {"rows": rows, "out": out_THD.detach(), **grads, "events": events}
    torch.save(results, out_dir / f"cp_rank_{cp_rank}.pt")


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out_dir = tmp_path_factory.mktemp("hybrid_attention")
    spawn_gloo(_run_rank, CP, out_dir)
    return [torch.load(out_dir / f"cp_rank_{cp_rank}.pt") for cp_rank in range(CP)]


@pytest.fixture(scope="module")
def reference() -> list[dict[str, torch.Tensor]]:
    results = []
    for seq in _sequence_tensors():
        q, k, v = (seq[name].clone().requires_grad_() for name in "qkv")
        out = reference_attention(q, k, v)
        (out * seq["grad_out"]).sum().backward()
        results.append({"out": out.detach(), "q": q.grad, "k": k.grad, "v": v.grad})
    return results


def test_each_rank_holds_the_groups_of_its_blocks(rank_results: list[dict[str, Any]]) -> None:
    assert rank_results[0]["block_groups"] == {(0, 2): [0, 1]}
    assert rank_results[3]["block_groups"] == {(2, 2): [2, 3]}


@pytest.mark.parametrize("name", list(MICRO_BATCHES))
def test_hybrid_attention_matches_unsharded_reference(
    rank_results: list[dict[str, Any]], reference: list[dict[str, torch.Tensor]], name: str
) -> None:
    for cp_rank, results in enumerate(rank_results):
        result = results[name]
        rows = result["rows"]
        real = torch.tensor([position < LENGTHS[index] for index, position in rows], dtype=torch.bool)
        for key in ("out", "q", "k", "v"):
            where = f"cp_rank {cp_rank} {name} {key}"
            got = result[key]
            torch.testing.assert_close(got[real], _take(rows, key, reference)[real], rtol=1e-10, atol=1e-10,
                                       msg=lambda m, where=where: f"{where}: {m}")
            if key != "out":  # padding rows get no gradient
                torch.testing.assert_close(got[~real], torch.zeros_like(got[~real]), msg=where)


def test_reduce_scatter_overlaps_local_attention_backward(rank_results: list[dict[str, Any]]) -> None:
    micro_batch = MICRO_BATCHES[ORDERING_CASE]
    ranks_with_both = [r for r in range(CP) if micro_batch.local[r] and _collectives(micro_batch, r)]
    assert len(ranks_with_both) == 3
    for cp_rank in ranks_with_both:
        events = rank_results[cp_rank][ORDERING_CASE]["events"]
        num_collectives = len(_collectives(micro_batch, cp_rank))
        assert events.count("reduce_scatter_launched") == events.count("reduce_scatter_waited") == num_collectives
        assert events.count("local_backward_started") == 1 and events.count("local_backward_ended") == 3
        launched = [i for i, event in enumerate(events) if event == "reduce_scatter_launched"]
        waited = [i for i, event in enumerate(events) if event == "reduce_scatter_waited"]
        local_started = events.index("local_backward_started")
        local_ended = max(i for i, event in enumerate(events) if event == "local_backward_ended")
        assert max(launched) < local_started, f"cp_rank {cp_rank}: {events}"
        assert local_ended < min(waited), f"cp_rank {cp_rank}: {events}"
