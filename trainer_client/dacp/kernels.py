"""The causal varlen attention kernels DACP attention runs on each rank, with flash-attn's
``flash_attn_varlen_func`` contract: packed segments, ``cu_seqlens`` bounds, causal *aligned bottom-right* when a
query segment is shorter than its keys (a sharded sequence's chunk attending to its causal prefix).

Kernels (``AttentionBackend``):
``flash_attn`` (``flash_attn_varlen_func``, CUDA, fp16/bf16, when installed) →
``torch_varlen`` (``torch.nn.attention.varlen.varlen_attn`` in whichever form the installed torch has it,
``torch_compat.py``; CUDA, fp16/bf16) →
``sdpa`` (``scaled_dot_product_attention`` per sequence; CPU, any dtype).
``auto`` picks the first that applies; tests force ``sdpa`` by name or with
``SKRULL_ATTENTION_BACKEND=sdpa``.

Shape legend: T query tokens, S key tokens, H query heads, G key/value heads, D head dim.
"""

from __future__ import annotations

import functools
import os
from enum import StrEnum
from typing import Any

import torch
import torch.nn.functional as F

from trainer_client.distributed.torch_compat import VarlenKernel, torch_apis

__all__ = [
    "AttentionBackend",
    "VarlenKernel",
    "resolve_backend",
    "resolve_kernel",
    "varlen_causal_attn_func",
]

BACKEND_ENV = "SKRULL_ATTENTION_BACKEND"
# A CPU query segment shorter than its keys runs as two flash calls (``_BottomRightCausalCPU``) from this many
# queries, below it as one call with a mask: there the rectangle is small, and the second call and the merge cost
# more than its masked blocks. ``make bench-cpu-costs``, a layer of tiny Qwen2 forward and backward, a sequence over
# 2 ranks (chunks of a quarter of it): the masked call 0.2 ms cheaper up to 512 tokens, the two within 10 % of each
# other at 1,024, the two calls ahead from 2,048.
CPU_SPLIT_MIN_QUERIES = 256
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




def _sdpa_varlen(
    q_THD: torch.Tensor, k_SGD: torch.Tensor, v_SGD: torch.Tensor,
    cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, softmax_scale: float | None,
) -> torch.Tensor:
    """One SDPA call per segment; causal aligned bottom-right when a query segment is shorter than its keys (on CPU
    from ``CPU_SPLIT_MIN_QUERIES`` queries ``_BottomRightCausalCPU``, otherwise a boolean mask)."""
    outputs_THD = []
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for q_start, q_end, k_start, k_end in zip(bounds_q[:-1], bounds_q[1:], bounds_k[:-1], bounds_k[1:], strict=True):
        num_q, num_k = q_end - q_start, k_end - k_start
        if num_q == 0:  # an empty segment (a row padded to a token bucket keeps its segments' number fixed)
            continue
        q_1HTD = q_THD[q_start:q_end].transpose(0, 1).unsqueeze(0)
        k_1GSD = k_SGD[k_start:k_end].transpose(0, 1).unsqueeze(0)
        v_1GSD = v_SGD[k_start:k_end].transpose(0, 1).unsqueeze(0)
        if num_q == num_k:
            o_1HTD = F.scaled_dot_product_attention(q_1HTD, k_1GSD, v_1GSD, is_causal=True, scale=softmax_scale,
                                                    enable_gqa=True)
        elif q_THD.device.type == "cpu" and num_q >= CPU_SPLIT_MIN_QUERIES:
            o_1HTD = _BottomRightCausalCPU.apply(q_1HTD, k_1GSD, v_1GSD, softmax_scale)
        else:
            mask_TS = torch.ones(num_q, num_k, dtype=torch.bool, device=q_THD.device).tril(diagonal=num_k - num_q)
            o_1HTD = F.scaled_dot_product_attention(q_1HTD, k_1GSD, v_1GSD, attn_mask=mask_TS, scale=softmax_scale,
                                                    enable_gqa=True)
        outputs_THD.append(o_1HTD[0].transpose(0, 1))
    return torch.cat(outputs_THD)


class _BottomRightCausalCPU(torch.autograd.Function):
    """Causal attention aligned bottom-right (``T < S`` queries: query ``i`` sees keys ``0 .. S − T + i``) on CPU,
    in two calls of torch's CPU flash kernel: the keys before the queries' own block, all visible, and the square
    block, causal. They are merged by their log-sum-exps (the ring-attention merge), and the backward runs each
    part's flash backward with the merged output and log-sum-exp, which gives each part its exact share of the
    gradients.

    Why not one call with a boolean mask: the kernel then computes and masks every block of the ``T × S`` rectangle
    (a causal call skips those above the diagonal) and reads the mask. Per CP rank of a sequence zigzag-sharded over
    2 (forward and backward, one layer of tiny Qwen2), that cost 1.15x the whole sequence's attention over 2 at
    2,048 tokens and 1.38x at 4,096, this 1.08x and 1.04x: the sharded micro-batches of ``make demo`` ran
    slower than a profile priced them. Equal to the masked call within float rounding (tests/test_attention.py)."""

    @staticmethod
    def forward(ctx: Any, q_1HTD: torch.Tensor, k_1GSD: torch.Tensor, v_1GSD: torch.Tensor,
                softmax_scale: float | None) -> torch.Tensor:
        heads_per_kv = q_1HTD.shape[1] // k_1GSD.shape[1]
        k_1HSD = k_1GSD.to(q_1HTD.dtype).repeat_interleave(heads_per_kv, dim=1)
        v_1HSD = v_1GSD.to(q_1HTD.dtype).repeat_interleave(heads_per_kv, dim=1)
        prefix = k_1HSD.shape[2] - q_1HTD.shape[2]  # keys every query sees
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        o_1HTD, lse_1HT = flash(q_1HTD, k_1HSD[:, :, prefix:], v_1HSD[:, :, prefix:], is_causal=True,
                                scale=softmax_scale)
        if prefix:
            prefix_o_1HTD, prefix_lse_1HT = flash(q_1HTD, k_1HSD[:, :, :prefix], v_1HSD[:, :, :prefix],
                                                  is_causal=False, scale=softmax_scale)
            merged_lse_1HT = torch.logaddexp(prefix_lse_1HT, lse_1HT)
            o_1HTD = (torch.exp(prefix_lse_1HT - merged_lse_1HT).unsqueeze(-1) * prefix_o_1HTD
                      + torch.exp(lse_1HT - merged_lse_1HT).unsqueeze(-1) * o_1HTD).to(q_1HTD.dtype)
            lse_1HT = merged_lse_1HT
        ctx.save_for_backward(q_1HTD, k_1HSD, v_1HSD, o_1HTD, lse_1HT)
        ctx.softmax_scale, ctx.heads_per_kv, ctx.prefix = softmax_scale, heads_per_kv, prefix
        return o_1HTD

    @staticmethod
    def backward(ctx: Any, do_1HTD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:
        q_1HTD, k_1HSD, v_1HSD, o_1HTD, lse_1HT = ctx.saved_tensors
        prefix, flash_backward = ctx.prefix, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        do_1HTD = do_1HTD.contiguous()
        dq_1HTD, dk_1HSD, dv_1HSD = flash_backward(do_1HTD, q_1HTD, k_1HSD[:, :, prefix:], v_1HSD[:, :, prefix:],
                                                   o_1HTD, lse_1HT, 0.0, True, scale=ctx.softmax_scale)
        if prefix:
            prefix_dq_1HTD, prefix_dk_1HSD, prefix_dv_1HSD = flash_backward(
                do_1HTD, q_1HTD, k_1HSD[:, :, :prefix], v_1HSD[:, :, :prefix], o_1HTD, lse_1HT, 0.0, False,
                scale=ctx.softmax_scale)
            dq_1HTD = dq_1HTD + prefix_dq_1HTD
            dk_1HSD = torch.cat([prefix_dk_1HSD, dk_1HSD], dim=2)
            dv_1HSD = torch.cat([prefix_dv_1HSD, dv_1HSD], dim=2)
        _, num_heads, num_keys, head_dim = dk_1HSD.shape
        kv_shape = (1, num_heads // ctx.heads_per_kv, ctx.heads_per_kv, num_keys, head_dim)
        return dq_1HTD, dk_1HSD.reshape(kv_shape).sum(2), dv_1HSD.reshape(kv_shape).sum(2), None


def _flash_attn_kernel(q_THD: torch.Tensor, k_SGD: torch.Tensor, v_SGD: torch.Tensor, cu_seqlens_q: torch.Tensor,
                       cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                       softmax_scale: float | None) -> torch.Tensor:
    flash_attn_varlen_func = _flash_attn_varlen_func()
    if flash_attn_varlen_func is None:
        raise ValueError("attention backend flash_attn needs the flash-attn package (pip install skrull[gpu])")
    out: torch.Tensor = flash_attn_varlen_func(q_THD, k_SGD.contiguous(), v_SGD.contiguous(), cu_seqlens_q,
                                               cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=softmax_scale,
                                               causal=True)
    return out


def _sdpa_kernel(q_THD: torch.Tensor, k_SGD: torch.Tensor, v_SGD: torch.Tensor, cu_seqlens_q: torch.Tensor,
                 cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                 softmax_scale: float | None) -> torch.Tensor:
    return _sdpa_varlen(q_THD, k_SGD, v_SGD, cu_seqlens_q, cu_seqlens_k, softmax_scale)


def resolve_kernel(backend: str | AttentionBackend, *, device: torch.device, dtype: torch.dtype) -> VarlenKernel:
    """The causal varlen kernel ``backend`` names on ``device`` for ``dtype`` (``resolve_backend``), with
    flash-attn's contract: resolved once per micro-batch, not in every layer."""
    kernel = resolve_backend(backend, device=device, dtype=dtype)
    if kernel == AttentionBackend.FLASH_ATTN:
        return _flash_attn_kernel
    if kernel == AttentionBackend.TORCH_VARLEN:
        varlen_attn = torch_apis().varlen_attn
        if varlen_attn is None:
            raise ValueError(f"attention backend torch_varlen needs torch.nn.attention.varlen (torch "
                             f"{torch.__version__} has none)")
        return varlen_attn
    return _sdpa_kernel


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
    kernel = resolve_kernel(backend, device=q_THD.device, dtype=q_THD.dtype)
    return kernel(q_THD, k_SGD, v_SGD, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale)

