"""Emulations of the torch releases the trainer supports, for CPU tests: the single-tensor collectives under each
release's names (2.13's old names warn that they are deprecated, as there) over the installed torch's own, torch's
flash attention operator given a CPU kernel, and flash-attn installed or not.

The flash operator (``aten::_flash_attention_forward`` and its backward, which ``torch_compat`` calls in every
release) has no CPU kernel in any release; here it gets one that checks its arguments as the CUDA kernel does and
computes causal attention per segment in float64, aligned bottom-right (the flash kernels' convention, or top-left
for the test of a kernel that would align so), with the analytic gradient backward. Its C++ autograd, its dispatch
and Dynamo's view of it are torch's own. The fake ``flash_attn_varlen_func`` has flash-attn 2.7's signature.

Shape legend: T query tokens, S key tokens, H query heads, G key/value heads, D head dim.
"""

from __future__ import annotations

import contextlib
import itertools
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from trainer_client.dacp import kernels
from trainer_client.distributed.torch_compat import torch_apis

RELEASES = ("2.10", "2.11", "2.12", "2.13")


def _segments(cu_seq: torch.Tensor) -> list[tuple[int, int]]:
    return list(itertools.pairwise(cu_seq.tolist()))


def _check(q_THD: torch.Tensor, k_SGD: torch.Tensor, v_SGD: torch.Tensor, cu_seq_q: torch.Tensor,
           cu_seq_k: torch.Tensor, max_q: int, max_k: int) -> None:
    """The checks the flash kernel makes of its arguments."""
    if cu_seq_q.dtype != torch.int32 or cu_seq_k.dtype != torch.int32:
        raise RuntimeError(f"cu_seqlens must be int32, got {cu_seq_q.dtype} and {cu_seq_k.dtype}")
    if q_THD.dim() != 3 or k_SGD.dim() != 3 or v_SGD.shape != k_SGD.shape:
        raise RuntimeError(f"expected q [T, H, D] and k, v [S, G, D], got {q_THD.shape}, {k_SGD.shape}, {v_SGD.shape}")
    if q_THD.stride(-1) != 1 or k_SGD.stride(-1) != 1 or v_SGD.stride(-1) != 1:
        raise RuntimeError("Input tensor must have contiguous last dimension")
    if q_THD.shape[1] % k_SGD.shape[1]:
        raise RuntimeError(f"Number of heads in key/value ({k_SGD.shape[1]}) must divide number of heads in query "
                           f"({q_THD.shape[1]})")
    if max(cu_seq_q.diff().tolist(), default=0) > max_q or max(cu_seq_k.diff().tolist(), default=0) > max_k:
        raise RuntimeError(f"max_q {max_q} / max_k {max_k} below a segment's length")


def _weights(q_THD: torch.Tensor, k_SHD: torch.Tensor, scale: float, bottom_right: bool) -> torch.Tensor:
    num_q, num_k = q_THD.shape[0], k_SHD.shape[0]
    scores_HTS = torch.einsum("thd,shd->hts", q_THD, k_SHD) * scale
    visible_TS = torch.ones(num_q, num_k, dtype=torch.bool).tril(diagonal=num_k - num_q if bottom_right else 0)
    return scores_HTS.masked_fill(~visible_TS, float("-inf")).softmax(dim=-1)


def reference_varlen(q_THD: torch.Tensor, k_SGD: torch.Tensor, v_SGD: torch.Tensor, cu_seq_q: torch.Tensor,
                     cu_seq_k: torch.Tensor, max_q: int, max_k: int, *, scale: float | None,
                     bottom_right: bool = True) -> torch.Tensor:
    """Causal attention per segment, aligned bottom-right (or top-left), after the flash kernel's checks; fewer
    K/V heads than query heads as the kernel takes them (query head h reads K/V head h // (H / G))."""
    _check(q_THD, k_SGD, v_SGD, cu_seq_q, cu_seq_k, max_q, max_k)
    scale = q_THD.shape[-1] ** -0.5 if scale is None else scale
    repeats = q_THD.shape[1] // k_SGD.shape[1]
    k_SHD, v_SHD = k_SGD.repeat_interleave(repeats, dim=1), v_SGD.repeat_interleave(repeats, dim=1)
    outputs = [torch.einsum("hts,shd->thd", _weights(q_THD[q0:q1], k_SHD[k0:k1], scale, bottom_right), v_SHD[k0:k1])
               for (q0, q1), (k0, k1) in zip(_segments(cu_seq_q), _segments(cu_seq_k), strict=True)]
    return torch.cat(outputs)


def reference_varlen_backward(grad_THD: torch.Tensor, q_THD: torch.Tensor, k_SGD: torch.Tensor, v_SGD: torch.Tensor,
                              cu_seq_q: torch.Tensor, cu_seq_k: torch.Tensor, *, scale: float | None,
                              bottom_right: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dQ, dK, dV of ``reference_varlen``: per segment, ``P = softmax(S)``, ``dV = Pᵀ dO``, ``dS = P ⊙ (dO Vᵀ −
    rowsum(dO ⊙ O))``, ``dQ = dS K · scale``, ``dK = dSᵀ Q · scale``; each K/V head summed over its query heads."""
    scale = q_THD.shape[-1] ** -0.5 if scale is None else scale
    num_kv_heads = k_SGD.shape[1]
    repeats = q_THD.shape[1] // num_kv_heads
    k_SHD, v_SHD = k_SGD.repeat_interleave(repeats, dim=1), v_SGD.repeat_interleave(repeats, dim=1)
    dq_THD, dk_SHD, dv_SHD = torch.zeros_like(q_THD), torch.zeros_like(k_SHD), torch.zeros_like(v_SHD)
    for (q0, q1), (k0, k1) in zip(_segments(cu_seq_q), _segments(cu_seq_k), strict=True):
        p_HTS = _weights(q_THD[q0:q1], k_SHD[k0:k1], scale, bottom_right)
        do_THD, v_seg = grad_THD[q0:q1], v_SHD[k0:k1]
        o_THD = torch.einsum("hts,shd->thd", p_HTS, v_seg)
        dv_SHD[k0:k1] = torch.einsum("hts,thd->shd", p_HTS, do_THD)
        dp_HTS = torch.einsum("thd,shd->hts", do_THD, v_seg)
        ds_HTS = p_HTS * (dp_HTS - (do_THD * o_THD).sum(-1).transpose(0, 1).unsqueeze(-1))
        dq_THD[q0:q1] = torch.einsum("hts,shd->thd", ds_HTS, k_SHD[k0:k1]) * scale
        dk_SHD[k0:k1] = torch.einsum("hts,thd->shd", ds_HTS, q_THD[q0:q1]) * scale

    def per_kv_head(grad_SHD: torch.Tensor) -> torch.Tensor:
        return grad_SHD.view(grad_SHD.shape[0], num_kv_heads, repeats, -1).sum(2)

    return dq_THD, per_kv_head(dk_SHD), per_kv_head(dv_SHD)


@contextlib.contextmanager
def flash_operator_on_cpu(*, bottom_right: bool = True) -> Iterator[None]:
    """``aten::_flash_attention_forward`` and ``_flash_attention_backward`` given CPU kernels (the references above)
    while the block runs."""

    def forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cum_seq_q: torch.Tensor,
                cum_seq_k: torch.Tensor, max_q: int, max_k: int, dropout_p: float, is_causal: bool,
                return_debug_mask: bool, *, scale: float | None = None, **kwargs: Any) -> tuple[torch.Tensor, ...]:
        assert is_causal and dropout_p == 0.0 and not return_debug_mask and not any(kwargs.values())
        out = reference_varlen(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, scale=scale,
                               bottom_right=bottom_right)
        return (out, query.new_zeros((query.shape[1], query.shape[0]), dtype=torch.float),
                torch.zeros(2, dtype=torch.uint64), torch.zeros((), dtype=torch.uint64), query.new_empty(0))

    def backward(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 out: torch.Tensor, logsumexp: torch.Tensor, cum_seq_q: torch.Tensor, cum_seq_k: torch.Tensor,
                 max_q: int, max_k: int, dropout_p: float, is_causal: bool, rng_state: torch.Tensor,
                 unused: torch.Tensor, *, scale: float | None = None,
                 **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return reference_varlen_backward(grad_out, query, key, value, cum_seq_q, cum_seq_k, scale=scale,
                                         bottom_right=bottom_right)

    library = torch.library.Library("aten", "IMPL")
    library.impl("_flash_attention_forward", forward, "CPU")
    library.impl("_flash_attention_backward", backward, "CPU")
    try:
        yield
    finally:
        library._destroy()


def flash_attn_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                           cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = 0.0,
                           softmax_scale: float | None = None, causal: bool = False,
                           window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0, alibi_slopes: Any = None,
                           deterministic: bool = False, return_attn_probs: bool = False,
                           block_table: Any = None) -> torch.Tensor:
    """flash-attn 2.7's ``flash_attn_varlen_func``: GQA native, causal aligned bottom-right."""
    assert causal and dropout_p == 0.0 and tuple(window_size) == (-1, -1) and not return_attn_probs
    if not q.is_contiguous():
        raise RuntimeError("flash-attn: query must have contiguous last dimension")
    return reference_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale=softmax_scale)


def _checked_collective(real: Callable[..., Any], name: str, *, gathers: bool,
                        deprecated_for: str | None = None) -> Callable[..., Any]:
    """A single-tensor collective as a release names it: its arguments checked, then the installed torch's own;
    ``deprecated_for``: it warns, as 2.13's old names do, that this newer name replaces it."""

    def collective(output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any = None,
                   async_op: bool = False) -> Any:
        if deprecated_for is not None:
            warnings.warn(f"`torch.distributed.{name}` is deprecated. Please use `torch.distributed."
                          f"{deprecated_for}` instead.", FutureWarning, stacklevel=2)
        world_size = dist.get_world_size(group)
        big, small = (output_tensor, input_tensor) if gathers else (input_tensor, output_tensor)
        if big.numel() != world_size * small.numel() or big.dtype != small.dtype:
            raise RuntimeError(f"{name}: {tuple(big.shape)} is not {world_size} × {tuple(small.shape)}")
        return real(output_tensor, input_tensor, group=group, async_op=async_op)

    collective.__name__ = name
    return collective


# Each single-tensor collective: (2.13's name, the name before it, gathers).
_COLLECTIVES = (("all_gather_single", "all_gather_into_tensor", True),
                ("reduce_scatter_single", "reduce_scatter_tensor", False))


@contextlib.contextmanager
def emulated(release: str, *, flash_attn: bool = False, bottom_right: bool = True) -> Iterator[None]:
    """The installed torch as ``release`` has it, for this process, while the block runs, its flash operator with a
    CPU kernel (``bottom_right`` False: one that aligns top-left); with ``flash_attn``, flash-attn installed too.
    Whichever supported release is installed provides the collectives underneath."""
    with contextlib.ExitStack() as stack:
        patch = stack.enter_context(_patch())
        stack.enter_context(flash_operator_on_cpu(bottom_right=bottom_right))
        for name, old_name, gathers in _COLLECTIVES:
            real = getattr(dist, name, None) or getattr(dist, old_name)
            if release == "2.13":
                patch(dist, name, _checked_collective(real, name, gathers=gathers))
                patch(dist, old_name, _checked_collective(real, old_name, gathers=gathers, deprecated_for=name))
            else:
                patch(dist, old_name, _checked_collective(real, old_name, gathers=gathers))
                patch(dist, name, None)
        patch(kernels, "_flash_attn_varlen_func", lambda: flash_attn_varlen_func if flash_attn else None)
        torch_apis.cache_clear()
        try:
            yield
        finally:
            torch_apis.cache_clear()


@contextlib.contextmanager
def _patch() -> Iterator[Callable[[Any, str, Any], None]]:
    """``patch(owner, name, value)`` sets (``None``: deletes) an attribute until the block ends."""
    saved: list[tuple[Any, str, Any]] = []
    missing = object()

    def patch(owner: Any, name: str, value: Any) -> None:
        saved.append((owner, name, getattr(owner, name, missing)))
        if value is None:
            if hasattr(owner, name):
                delattr(owner, name)
        else:
            setattr(owner, name, value)

    try:
        yield patch
    finally:
        for owner, name, value in reversed(saved):
            if value is missing:
                if hasattr(owner, name):
                    delattr(owner, name)
            else:
                setattr(owner, name, value)
