"""DACP attention equals unsharded causal attention, forward and backward (float64, gloo, cp ∈ {1, 2, 4})."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from scheduler_service.core.plan import MicroBatch
from tests.attention_reference import reference_attention
from trainer_client.dacp.attention import KVAllGather, dacp_attn_varlen_func
from trainer_client.dacp.kernels import (
    CPU_SPLIT_MIN_QUERIES,
    AttentionBackend,
    _BottomRightCausalCPU,
    varlen_causal_attn_func,
)
from trainer_client.dacp.packing import pack_micro_batch
from trainer_client.dacp.zigzag import zigzag_positions
from trainer_client.data import Sample
from trainer_client.distributed import spawn_gloo

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 2, 8
LENGTHS = (5, 17, 64, 33, 1, 100, 2, 9)


def _micro_batches(cp_size: int) -> dict[str, MicroBatch]:
    def spread(indices: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
        local: list[list[int]] = [[] for _ in range(cp_size)]
        for slot, index in enumerate(indices):
            local[slot % cp_size].append(index)
        return tuple(tuple(rank_local) for rank_local in local)

    return {
        "local_only": MicroBatch(local=spread(tuple(range(len(LENGTHS)))), distributed=()),
        "distributed_only": MicroBatch(local=spread(()), distributed=tuple(range(len(LENGTHS)))),
        "mixed": MicroBatch(local=spread((0, 1, 4, 6, 7)), distributed=(2, 3, 5)),
        "one_rank_idle_locally": MicroBatch(local=((0, 1, 4), *[()] * (cp_size - 1)), distributed=(5,)),
    }


def _sequence_tensors(seed: int = 0) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    tensors = []
    for length in LENGTHS:
        def randn(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=generator, dtype=torch.float64)

        tensors.append({"q": randn(length, NUM_HEADS, HEAD_DIM), "k": randn(length, NUM_KV_HEADS, HEAD_DIM),
                        "v": randn(length, NUM_KV_HEADS, HEAD_DIM), "grad_out": randn(length, NUM_HEADS, HEAD_DIM)})
    return tensors


def _reference(tensors: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    results = []
    for seq in tensors:
        q, k, v = (seq[name].clone().requires_grad_() for name in "qkv")
        out = reference_attention(q, k, v)
        (out * seq["grad_out"]).sum().backward()
        results.append({"out": out.detach(), "q": q.grad, "k": k.grad, "v": v.grad})
    return results


def _rows(micro_batch: MicroBatch, cp_size: int, cp_rank: int) -> list[tuple[int, int]]:
    """(sequence index, global position) of each packed row, straight from the zigzag rule."""
    rows = [(index, position) for index in micro_batch.local[cp_rank] for position in range(LENGTHS[index])]
    for index in micro_batch.distributed:
        rows += [(index, int(p)) for p in zigzag_positions(LENGTHS[index], cp_size=cp_size, cp_rank=cp_rank)]
    return rows


def _take(rows: list[tuple[int, int]], key: str, source: list[dict[str, torch.Tensor]],
          shape: tuple[int, ...]) -> torch.Tensor:
    """The packed rows of one tensor; padding rows get an arbitrary value (they must influence nothing)."""
    if not rows:
        return torch.zeros(0, *shape, dtype=torch.float64)
    return torch.stack([source[i][key][p] if p < LENGTHS[i] else torch.full(shape, 7.0, dtype=torch.float64)
                        for i, p in rows])


def _check_rank(cp_size: int, cp_rank: int, group: dist.ProcessGroup | None) -> None:
    tensors = _sequence_tensors()
    expected = _reference(tensors)
    samples = [Sample(input_ids=torch.zeros(n, dtype=torch.int64).numpy(),
                      labels=torch.zeros(n, dtype=torch.int64).numpy()) for n in LENGTHS]
    for name, micro_batch in _micro_batches(cp_size).items():
        packed = pack_micro_batch(samples, micro_batch, cp_size=cp_size, cp_rank=cp_rank, cp_group=group)
        rows = _rows(micro_batch, cp_size, cp_rank)
        real = torch.tensor([position < LENGTHS[index] for index, position in rows], dtype=torch.bool)

        q_THD = _take(rows, "q", tensors, (NUM_HEADS, HEAD_DIM)).requires_grad_()
        k_TGD = _take(rows, "k", tensors, (NUM_KV_HEADS, HEAD_DIM)).requires_grad_()
        v_TGD = _take(rows, "v", tensors, (NUM_KV_HEADS, HEAD_DIM)).requires_grad_()
        grad_out_THD = _take(rows, "grad_out", tensors, (NUM_HEADS, HEAD_DIM)) * real[:, None, None]
        out_THD = dacp_attn_varlen_func(q_THD, k_TGD, v_TGD, packed.metadata, backend=AttentionBackend.SDPA)
        (out_THD * grad_out_THD).sum().backward()

        where = f"cp_size {cp_size} cp_rank {cp_rank} {name}"
        torch.testing.assert_close(out_THD.detach()[real], _take(rows, "out", expected, (NUM_HEADS, HEAD_DIM))[real],
                                   rtol=1e-10, atol=1e-10, msg=lambda m, where=where: f"{where} forward: {m}")
        for key, grad in (("q", q_THD.grad), ("k", k_TGD.grad), ("v", v_TGD.grad)):
            assert grad is not None
            shape = tuple(grad.shape[1:])
            torch.testing.assert_close(grad[real], _take(rows, key, expected, shape)[real], rtol=1e-10, atol=1e-10,
                                       msg=lambda m, key=key, where=where: f"{where} d{key}: {m}")
            torch.testing.assert_close(grad[~real], torch.zeros_like(grad[~real]), msg=f"{where} padding d{key}")


def _check_cp_group() -> None:
    _check_rank(dist.get_world_size(), dist.get_rank(), dist.group.WORLD)


def test_dacp_attention_matches_unsharded_reference_on_one_rank() -> None:
    _check_rank(1, 0, None)


@pytest.mark.parametrize("cp_size", [2, 4])
def test_dacp_attention_matches_unsharded_reference(cp_size: int) -> None:
    spawn_gloo(_check_cp_group, cp_size)


@pytest.mark.parametrize(("num_q", "num_k"), [(3, 10), (CPU_SPLIT_MIN_QUERIES, 2 * CPU_SPLIT_MIN_QUERIES + 5)],
                         ids=["masked call", "two flash calls"])
def test_bottom_right_causal_alignment_when_queries_are_a_suffix(num_q: int, num_k: int) -> None:
    """Queries ``num_k − num_q ..`` of a sequence see what they see in the whole sequence, on either CPU path."""
    generator = torch.Generator().manual_seed(1)
    q_THD = torch.randn(num_k, 2, 4, generator=generator, dtype=torch.float64)
    k_TGD = torch.randn(num_k, 1, 4, generator=generator, dtype=torch.float64)
    v_TGD = torch.randn(num_k, 1, 4, generator=generator, dtype=torch.float64)
    full = reference_attention(q_THD, k_TGD, v_TGD)
    cu_q, cu_k = torch.tensor([0, num_q], dtype=torch.int32), torch.tensor([0, num_k], dtype=torch.int32)
    suffix = varlen_causal_attn_func(q_THD[num_k - num_q:], k_TGD, v_TGD, cu_q, cu_k, num_q, num_k, backend="sdpa")
    torch.testing.assert_close(suffix, full[num_k - num_q:])


@pytest.mark.parametrize(("num_q", "num_k"), [(3, 11), (16, 16), (1, 7), (24, 96)])
def test_bottom_right_causal_on_cpu_equals_the_masked_kernel_forward_and_backward(num_q: int, num_k: int) -> None:
    """The CPU path of a query segment shorter than its keys (two flash calls merged by log-sum-exp) against one SDPA
    call with the bottom-right causal mask, grouped K/V heads included; and its gradients against finite
    differences."""
    generator = torch.Generator().manual_seed(num_q * 100 + num_k)

    def tensor(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, dtype=torch.float64).requires_grad_()

    q_1HTD, k_1GSD, v_1GSD = tensor(1, NUM_HEADS, num_q, HEAD_DIM), tensor(1, 2, num_k, HEAD_DIM), tensor(
        1, 2, num_k, HEAD_DIM)
    mask_TS = torch.ones(num_q, num_k, dtype=torch.bool).tril(diagonal=num_k - num_q)
    expected = torch.nn.functional.scaled_dot_product_attention(q_1HTD, k_1GSD, v_1GSD, attn_mask=mask_TS,
                                                                enable_gqa=True)
    actual = _BottomRightCausalCPU.apply(q_1HTD, k_1GSD, v_1GSD, None)
    torch.testing.assert_close(actual, expected)
    grad_out = torch.randn(expected.shape, generator=generator, dtype=torch.float64)
    for got, want in zip(torch.autograd.grad(actual, (q_1HTD, k_1GSD, v_1GSD), grad_out),
                         torch.autograd.grad(expected, (q_1HTD, k_1GSD, v_1GSD), grad_out), strict=True):
        torch.testing.assert_close(got, want)
    assert torch.autograd.gradcheck(lambda q, k, v: _BottomRightCausalCPU.apply(q, k, v, 0.5),
                                    (q_1HTD, k_1GSD, v_1GSD))


def test_kv_all_gather_fails_loudly_on_misuse() -> None:
    gather = KVAllGather(None, group_size=1)
    with pytest.raises(RuntimeError, match="wait called before start"):
        gather.wait()
    gather.start(torch.zeros(2, 2))
    with pytest.raises(RuntimeError, match="start called twice"):
        gather.start(torch.zeros(2, 2))
    with pytest.raises(ValueError, match="block's process group"):
        KVAllGather(None, group_size=2)
    with pytest.raises(RuntimeError, match="waited before it was launched"):
        KVAllGather(None, group_size=1)._wait_reduce_scatter()
    with pytest.raises(RuntimeError, match="launched before the all-gather finished"):
        KVAllGather(None, group_size=1)._launch_reduce_scatter(torch.zeros(2, 2))
