"""DACP attention: local sequences stay on their rank, distributed ones attend over the CP group.

One CP rank's packed tokens are ``[local sequences | zigzag shards of distributed
sequences]`` (``packing.py``). Per attention layer:

1. launch the asynchronous all-gather of the shards' K/V over the CP group;
2. meanwhile run causal varlen attention over the local sequences, which never
   leave the rank (the overlap of the paper's Fig. 2(d));
3. wait, then run the distributed queries (two zigzag chunks per sequence)
   against their causal prefix of the gathered K/V (the Llama 3 all-gather-KV
   scheme: exact, works with many packed documents and with gloo).

The backward of the all-gather is a reduce-scatter of dK/dV (``_GatheredKV``),
so forward and backward equal unsharded attention. Cost per layer and CP rank:
one all-gather of ``cp_size × shard`` K/V rows forward, one reduce-scatter of
the same size backward; local sequences move no bytes.

Kernels (``AttentionBackend``), all *causal aligned bottom-right* as flash-attn
is when ``seqlen_q != seqlen_k``:
``flash_attn`` (``flash_attn_varlen_func``, CUDA, fp16/bf16, when installed) →
``torch_varlen`` (``torch.nn.attention.varlen.varlen_attn``, CUDA, fp16/bf16) →
``sdpa`` (``scaled_dot_product_attention`` per sequence; CPU, any dtype).
``auto`` picks the first that applies; tests force ``sdpa`` by name or with
``SKRULL_ATTENTION_BACKEND=sdpa``.

Shape legend: T query tokens, S key tokens, H query heads, G key/value heads,
D head dim, X = 2 (K and V stacked for one collective), N cp_size.
"""

from __future__ import annotations

import functools
import os
from enum import StrEnum
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from trainer_client.packing import DacpMetadata

__all__ = [
    "AttentionBackend",
    "KVAllGather",
    "dacp_attn_varlen_func",
    "resolve_backend",
    "varlen_causal_attn_func",
]

BACKEND_ENV = "SKRULL_ATTENTION_BACKEND"
_HALF_DTYPES = (torch.float16, torch.bfloat16)


class AttentionBackend(StrEnum):
    AUTO = "auto"
    FLASH_ATTN = "flash_attn"
    TORCH_VARLEN = "torch_varlen"
    SDPA = "sdpa"


@functools.cache
def _flash_attn_varlen_func() -> Any:
    try:
        from flash_attn import flash_attn_varlen_func  # optional `gpu` extra; needs CUDA to build
    except ImportError:
        return None
    return flash_attn_varlen_func


def resolve_backend(backend: str | AttentionBackend, *, device: torch.device, dtype: torch.dtype) -> AttentionBackend:
    """The kernel to run: ``backend`` itself, or for ``auto`` the environment override or the best available."""
    backend = AttentionBackend(os.environ.get(BACKEND_ENV, backend) if backend == AttentionBackend.AUTO else backend)
    if backend != AttentionBackend.AUTO:
        return backend
    if device.type == "cuda" and dtype in _HALF_DTYPES:
        return AttentionBackend.FLASH_ATTN if _flash_attn_varlen_func() is not None else AttentionBackend.TORCH_VARLEN
    return AttentionBackend.SDPA


# ---------------------------------------------------------------------------------------------------- kernels


def _sdpa_varlen(
    q_THD: torch.Tensor, k_SGD: torch.Tensor, v_SGD: torch.Tensor,
    cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, softmax_scale: float | None,
) -> torch.Tensor:
    """One SDPA call per segment; causal mask aligned bottom-right when a query segment is shorter than its keys."""
    outputs_THD = []
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for q_start, q_end, k_start, k_end in zip(bounds_q[:-1], bounds_q[1:], bounds_k[:-1], bounds_k[1:], strict=True):
        num_q, num_k = q_end - q_start, k_end - k_start
        q_1HTD = q_THD[q_start:q_end].transpose(0, 1).unsqueeze(0)
        k_1GSD = k_SGD[k_start:k_end].transpose(0, 1).unsqueeze(0)
        v_1GSD = v_SGD[k_start:k_end].transpose(0, 1).unsqueeze(0)
        if num_q == num_k:
            mask_TS, is_causal = None, True
        else:
            mask_TS = torch.ones(num_q, num_k, dtype=torch.bool, device=q_THD.device).tril(diagonal=num_k - num_q)
            is_causal = False
        o_1HTD = F.scaled_dot_product_attention(q_1HTD, k_1GSD, v_1GSD, attn_mask=mask_TS, is_causal=is_causal,
                                                scale=softmax_scale, enable_gqa=True)
        outputs_THD.append(o_1HTD[0].transpose(0, 1))
    return torch.cat(outputs_THD)


def varlen_causal_attn_func(
    q_THD: torch.Tensor,
    k_SGD: torch.Tensor,
    v_SGD: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    softmax_scale: float | None = None,
    backend: str | AttentionBackend = AttentionBackend.AUTO,
) -> torch.Tensor:
    """Causal attention over packed segments, flash-attn's ``flash_attn_varlen_func`` contract (bottom-right)."""
    if q_THD.shape[0] == 0:
        return q_THD.new_empty(q_THD.shape)
    kernel = resolve_backend(backend, device=q_THD.device, dtype=q_THD.dtype)
    if kernel == AttentionBackend.FLASH_ATTN:
        flash_attn_varlen_func = _flash_attn_varlen_func()
        if flash_attn_varlen_func is None:
            raise ValueError("attention backend flash_attn needs the flash-attn package (pip install skrull[gpu])")
        return flash_attn_varlen_func(q_THD, k_SGD.contiguous(), v_SGD.contiguous(), cu_seqlens_q, cu_seqlens_k,
                                      max_seqlen_q, max_seqlen_k, softmax_scale=softmax_scale, causal=True)
    if kernel == AttentionBackend.TORCH_VARLEN:
        from torch.nn.attention.varlen import varlen_attn

        out_THD = varlen_attn(q_THD, k_SGD.contiguous(), v_SGD.contiguous(), cu_seqlens_q, cu_seqlens_k,
                              max_seqlen_q, max_seqlen_k, scale=softmax_scale, window_size=(-1, 0), enable_gqa=True)
        assert isinstance(out_THD, torch.Tensor)  # a tuple only when return_aux asks for the LSE
        return out_THD
    return _sdpa_varlen(q_THD, k_SGD, v_SGD, cu_seqlens_q, cu_seqlens_k, softmax_scale)


# ---------------------------------------------------------------------------------------------------- communication


class _GatheredKV(torch.autograd.Function):
    """Identity on the gathered buffer forward (after the wait); reduce-scatter of its gradient backward."""

    @staticmethod
    def forward(ctx: Any, kv_local_TXGD: torch.Tensor, comm: KVAllGather) -> torch.Tensor:
        ctx.group = comm.group
        return comm._finish()

    @staticmethod
    def backward(ctx: Any, grad_gathered_NTXGD: torch.Tensor) -> tuple[torch.Tensor, None]:
        num_ranks = dist.get_world_size(ctx.group)
        grad_local_TXGD = grad_gathered_NTXGD.new_empty(
            (grad_gathered_NTXGD.shape[0] // num_ranks, *grad_gathered_NTXGD.shape[1:])
        )
        # Every rank holds dK/dV for every rank's shard; the owner gets their sum.
        dist.reduce_scatter_single(grad_local_TXGD, grad_gathered_NTXGD.contiguous(), group=ctx.group)
        return grad_local_TXGD, None


class KVAllGather:
    """One asynchronous all-gather of K/V rows over the CP group, differentiable; use once: start, then wait."""

    def __init__(self, group: dist.ProcessGroup | None, cp_size: int) -> None:
        if cp_size > 1 and group is None:
            raise ValueError("distributed sequences with cp_size > 1 need the CP process group (DacpMetadata.cp_group)")
        self.group = group
        self.cp_size = cp_size
        self._input: torch.Tensor | None = None
        self._buffer: torch.Tensor | None = None
        self._work: dist.Work | None = None
        self._waited = False

    def start(self, kv_local_TXGD: torch.Tensor) -> None:
        if self._input is not None:
            raise RuntimeError("KVAllGather.start called twice; make one object per collective")
        self._input = kv_local_TXGD
        if self.cp_size == 1:
            return
        assert dist.get_world_size(self.group) == self.cp_size, "CP group size disagrees with the metadata"
        self._buffer = kv_local_TXGD.new_empty((self.cp_size * kv_local_TXGD.shape[0], *kv_local_TXGD.shape[1:]))
        self._work = dist.all_gather_single(self._buffer, kv_local_TXGD.detach().contiguous(), group=self.group,
                                            async_op=True)

    def wait(self) -> torch.Tensor:
        """The gathered rows, rank-major ``[cp_size · T, ...]``; gradients flow back to this rank's rows."""
        if self._input is None:
            raise RuntimeError("KVAllGather.wait called before start")
        if self._waited:
            raise RuntimeError("KVAllGather.wait called twice")
        self._waited = True
        if self.cp_size == 1:
            return self._input
        return _GatheredKV.apply(self._input, self)

    def _finish(self) -> torch.Tensor:
        assert self._work is not None and self._buffer is not None
        self._work.wait()
        return self._buffer


# ---------------------------------------------------------------------------------------------------- public


def dacp_attn_varlen_func(
    q_THD: torch.Tensor,
    k_TGD: torch.Tensor,
    v_TGD: torch.Tensor,
    metadata: DacpMetadata,
    *,
    softmax_scale: float | None = None,
    backend: str | AttentionBackend = AttentionBackend.AUTO,
) -> torch.Tensor:
    """Causal attention of one CP rank's packed micro-batch; equal to unsharded per-sequence attention."""
    num_local = metadata.num_local_tokens
    if q_THD.shape[0] != num_local + metadata.num_distributed_tokens:
        raise ValueError(f"packed tokens ({q_THD.shape[0]}) != local {num_local} + distributed "
                         f"{metadata.num_distributed_tokens} of the metadata")
    gather = None
    if metadata.has_distributed:
        # Launch the communication first: local attention below runs while K/V travel.
        gather = KVAllGather(metadata.cp_group, metadata.cp_size)
        gather.start(torch.stack([k_TGD[num_local:], v_TGD[num_local:]], dim=1))
    outputs = []
    if num_local:
        outputs.append(varlen_causal_attn_func(
            q_THD[:num_local], k_TGD[:num_local], v_TGD[:num_local],
            metadata.cu_seqlens_local, metadata.cu_seqlens_local, metadata.max_seqlen_local, metadata.max_seqlen_local,
            softmax_scale=softmax_scale, backend=backend,
        ))
    if gather is not None:
        kv_gathered_SXGD = gather.wait()
        kv_prefix_SXGD = kv_gathered_SXGD[metadata.kv_index_dist]
        outputs.append(varlen_causal_attn_func(
            q_THD[num_local:], kv_prefix_SXGD[:, 0], kv_prefix_SXGD[:, 1],
            metadata.cu_seqlens_q_dist, metadata.cu_seqlens_k_dist,
            metadata.max_seqlen_q_dist, metadata.max_seqlen_k_dist,
            softmax_scale=softmax_scale, backend=backend,
        ))
    if not outputs:
        return q_THD.new_empty(q_THD.shape)
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)
