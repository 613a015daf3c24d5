"""DACP attention: local sequences stay on their rank, sharded ones attend over their block of CP ranks.

One CP rank's packed row is ``[local sequences | shards of collective 0 |
shards of collective 1 | …]`` (``packing.py``): a collective is the set of
sequences zigzag-sharded over one aligned block of CP ranks, the whole CP group
for the plan's ``distributed`` sequences or a hybrid group's block
(``DacpMetadata.sharded``, one ``ShardedSpec`` each). Per attention layer:

1. launch the asynchronous all-gather of every collective's K/V shards over its
   block's process group, all of them before any wait;
2. meanwhile run causal varlen attention over the local sequences, which never
   leave the rank (the overlap of the paper's Fig. 2(d));
3. per collective, wait, then run its queries (two zigzag chunks per sequence)
   against their causal prefix of the gathered K/V (the Llama 3 all-gather-KV
   scheme: exact, works with many packed documents and with gloo).

Backward mirrors it: the gradient of each gathered buffer is reduce-scattered
to the shards' owners. The reduce-scatter is *launched* in the gather's
backward and *waited* in the backward of an identity node placed on the K/V
shard before local attention (``_AwaitKVGrad``); the autograd engine runs the
ready node made latest in forward first, so the order is: collective
attention backward → reduce-scatter launched → local attention backward (the
overlap) → wait. Forward and backward equal unsharded attention. Cost per layer,
CP rank and collective over a block of ``s`` ranks: one all-gather of
``s × shard`` K/V rows forward, one reduce-scatter of the same size backward;
local sequences move no bytes. ``KVAllGather`` holds all the communication and
raises on any out-of-order use.

Kernels (``AttentionBackend``), all *causal aligned bottom-right* as flash-attn
is when ``seqlen_q != seqlen_k``:
``flash_attn`` (``flash_attn_varlen_func``, CUDA, fp16/bf16, when installed) →
``torch_varlen`` (``torch.nn.attention.varlen.varlen_attn`` in whichever form the installed torch has it,
``torch_compat.py``; CUDA, fp16/bf16) →
``sdpa`` (``scaled_dot_product_attention`` per sequence; CPU, any dtype).
``auto`` picks the first that applies; tests force ``sdpa`` by name or with
``SKRULL_ATTENTION_BACKEND=sdpa``.

Shape legend: T query tokens, S key tokens, H query heads, G key/value heads,
D head dim, X = 2 (K and V stacked for one collective), N size of a block.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from enum import StrEnum
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from trainer_client.dacp.packing import DacpMetadata, ShardedSpec
from trainer_client.distributed.torch_compat import torch_apis

__all__ = [
    "AttentionBackend",
    "DacpAttention",
    "KVAllGather",
    "VarlenKernel",
    "dacp_attention_with_collectives",
    "dacp_attn_varlen_func",
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


# ---------------------------------------------------------------------------------------------------- kernels


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


VarlenKernel = Callable[..., torch.Tensor]  # (q_THD, k_SGD, v_SGD, cu_q, cu_k, max_q, max_k, softmax_scale)


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


# ---------------------------------------------------------------------------------------------------- communication


class _AwaitKVGrad(torch.autograd.Function):
    """Identity on a K/V shard forward, made before local attention; backward waits for its reduce-scatter.

    Its input gradient from ``_GatheredKV`` is only a placeholder: the reduced dK/dV come from the collective.
    """

    @staticmethod
    def forward(ctx: Any, kv_local_TXGD: torch.Tensor, comm: KVAllGather) -> torch.Tensor:
        ctx.comm = comm
        return kv_local_TXGD.view_as(kv_local_TXGD)

    @staticmethod
    def backward(ctx: Any, placeholder_TXGD: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.comm._wait_reduce_scatter(), None


class _GatheredKV(torch.autograd.Function):
    """The gathered buffer forward (after the wait); backward launches the reduce-scatter of its gradient."""

    @staticmethod
    def forward(ctx: Any, kv_local_TXGD: torch.Tensor, comm: KVAllGather) -> torch.Tensor:
        ctx.comm = comm
        ctx.shard_shape = kv_local_TXGD.shape
        return comm._wait_all_gather()

    @staticmethod
    def backward(ctx: Any, grad_gathered_NTXGD: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.comm._launch_reduce_scatter(grad_gathered_NTXGD)
        # Not the gradient (it is in flight): a free stand-in that lets the engine reach _AwaitKVGrad.
        return grad_gathered_NTXGD.new_zeros(()).expand(ctx.shard_shape), None


class KVAllGather:
    """One collective's K/V over a block of CP ranks: all-gather forward, reduce-scatter backward, both async.

    Use once per layer and collective: ``start`` (before local attention), then ``wait`` (after it). Backward
    calls ``_launch_reduce_scatter`` then ``_wait_reduce_scatter`` (again in that order for a retained graph).
    Every other order raises. Tensors are held only while a collective is in flight.
    """

    def __init__(self, group: dist.ProcessGroup | None, group_size: int) -> None:
        if group_size > 1 and group is None:
            raise ValueError(f"sequences sharded over {group_size} CP ranks need that block's process group "
                             "(ShardedSpec.group: pack with cp_group / cp_block_groups)")
        self.group = group
        self.group_size = group_size
        self._input: torch.Tensor | None = None
        self._send: torch.Tensor | None = None
        self._buffer: torch.Tensor | None = None
        self._work: dist.Work | None = None
        self._started = False
        self._waited = False
        self._gathered = False

    def start(self, kv_local_TXGD: torch.Tensor) -> None:
        """Launch the all-gather of this rank's shard ``[T, X, G, D]``."""
        if self._started:
            raise RuntimeError("KVAllGather.start called twice; make one object per collective")
        self._started = True
        if self.group_size == 1:
            self._input = kv_local_TXGD
            return
        assert dist.get_world_size(self.group) == self.group_size, "block group size disagrees with the metadata"
        # Made now, before local attention, so that its backward (the wait for dK/dV) runs after local attention's.
        self._input = _AwaitKVGrad.apply(kv_local_TXGD, self)
        self._send = kv_local_TXGD.detach().contiguous()
        self._buffer = self._send.new_empty((self.group_size * self._send.shape[0], *self._send.shape[1:]))
        self._work = torch_apis().all_gather_single(self._buffer, self._send, group=self.group, async_op=True)

    def wait(self) -> torch.Tensor:
        """The gathered rows, rank-major ``[group_size · T, ...]``; gradients flow back to this rank's rows."""
        if not self._started:
            raise RuntimeError("KVAllGather.wait called before start")
        if self._waited:
            raise RuntimeError("KVAllGather.wait called twice")
        self._waited = True
        kv_input, self._input = self._input, None
        assert kv_input is not None
        if self.group_size == 1:
            return kv_input
        gathered: torch.Tensor = _GatheredKV.apply(kv_input, self)
        return gathered

    def _wait_all_gather(self) -> torch.Tensor:
        assert self._work is not None and self._buffer is not None
        self._work.wait()
        buffer, self._buffer, self._send, self._work = self._buffer, None, None, None
        self._gathered = True
        return buffer

    def _launch_reduce_scatter(self, grad_gathered_NTXGD: torch.Tensor) -> None:
        if not self._gathered:
            raise RuntimeError("KVAllGather reduce-scatter launched before the all-gather finished")
        if self._work is not None:
            raise RuntimeError("KVAllGather reduce-scatter launched twice without a wait")
        # Every rank holds dK/dV for every rank's shard; the owner gets their sum.
        self._send = grad_gathered_NTXGD.contiguous()
        self._buffer = self._send.new_empty((self._send.shape[0] // self.group_size, *self._send.shape[1:]))
        self._work = torch_apis().reduce_scatter_single(self._buffer, self._send, group=self.group,
                                                             async_op=True)

    def _wait_reduce_scatter(self) -> torch.Tensor:
        if self._work is None or not self._gathered:
            raise RuntimeError("KVAllGather reduce-scatter waited before it was launched")
        self._work.wait()
        grad_local_TXGD, self._buffer, self._send, self._work = self._buffer, None, None, None
        assert grad_local_TXGD is not None
        return grad_local_TXGD


# ---------------------------------------------------------------------------------------------------- public


class DacpAttention:
    """One micro-batch's attention, as every layer receives it (the ``dacp`` keyword of ``model.model_inputs``): the
    packing metadata and the kernel resolved for it once.

    A plain object, on purpose: FSDP2 walks the dataclasses and containers among a layer's keyword arguments before
    and after every layer (for tensors to cast and to hook), and passes over an object like this one. Not a
    module-level global either: a layer recomputed under activation checkpointing, after another micro-batch's
    forward has run, must read its own micro-batch.
    """

    __slots__ = ("has_collectives", "kernel", "metadata")

    def __init__(self, metadata: DacpMetadata, kernel: VarlenKernel | None) -> None:
        self.metadata = metadata
        self.kernel = kernel  # None: resolved at each call from the query's device and dtype
        self.has_collectives = bool(metadata.sharded)


def dacp_attn_varlen_func(
    q_THD: torch.Tensor,
    k_TGD: torch.Tensor,
    v_TGD: torch.Tensor,
    metadata: DacpMetadata,
    *,
    softmax_scale: float | None = None,
    backend: str | AttentionBackend = AttentionBackend.AUTO,
    kernel: VarlenKernel | None = None,
) -> torch.Tensor:
    """Causal attention of one CP rank's packed micro-batch; equal to unsharded per-sequence attention.
    ``kernel``: the varlen kernel, resolved already (else from ``backend``)."""
    num_local = metadata.num_local_tokens
    if q_THD.shape[0] != metadata.num_tokens:
        raise ValueError(f"packed tokens ({q_THD.shape[0]}) != local {num_local} + sharded "
                         f"{metadata.num_sharded_tokens} of the metadata")
    if kernel is None:
        kernel = resolve_kernel(backend, device=q_THD.device, dtype=q_THD.dtype)
    # Launch every collective first: local attention below runs while K/V travel.
    gathers: list[tuple[ShardedSpec, slice, KVAllGather]] = []
    first_row = num_local
    for spec in metadata.sharded:
        rows = slice(first_row, first_row + spec.num_tokens)
        gather = KVAllGather(spec.group, spec.group_size)
        gather.start(torch.stack([k_TGD[rows], v_TGD[rows]], dim=1))
        gathers.append((spec, rows, gather))
        first_row = rows.stop
    outputs = []
    if num_local:
        # the whole row is local where nothing is sharded: no slice (its backward would copy the gradient)
        local = slice(None) if num_local == q_THD.shape[0] else slice(num_local)
        outputs.append(kernel(q_THD[local], k_TGD[local], v_TGD[local], metadata.cu_seqlens_local,
                              metadata.cu_seqlens_local, metadata.max_seqlen_local, metadata.max_seqlen_local,
                              softmax_scale))
    for spec, rows, gather in gathers:
        kv_gathered_SXGD = gather.wait()
        kv_prefix_SXGD = kv_gathered_SXGD[spec.kv_index]
        outputs.append(kernel(q_THD[rows], kv_prefix_SXGD[:, 0], kv_prefix_SXGD[:, 1], spec.cu_seqlens_q,
                              spec.cu_seqlens_k, spec.max_seqlen_q, spec.max_seqlen_k, softmax_scale))
    if not outputs:
        return q_THD.new_empty(q_THD.shape)
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)


# The collectives, their autograd functions and the per-collective Python cannot be traced: a compiled block calls
# this eagerly (a micro-batch with collectives is dominated by them anyway); one without runs the local kernel alone,
# which Dynamo traces (``model.dacp_attention_forward``).
dacp_attention_with_collectives = torch.compiler.disable(dacp_attn_varlen_func, recursive=True)
