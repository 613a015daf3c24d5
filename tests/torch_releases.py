"""Emulations of the torch releases the trainer supports, for CPU tests: fakes with each release's signature that
check their arguments as the release would and compute the reference, and attributes removed where the release
lacks them. The installed torch (2.13) provides the real collectives underneath.

Each fake ``varlen_attn`` takes exactly its release's parameters (so a keyword the release lacks is a
``TypeError``, as on the real one), refuses fewer K/V heads than query heads where the release has no GQA, and
computes causal attention aligned bottom-right per segment in float64 (the flash kernels' convention). The fake
``flash_attn_varlen_func`` has flash-attn 2.7's signature. The single-tensor collectives carry the release's names
(2.13's old names warn that they are deprecated, as there) over the installed torch's own.

Shape legend: T query tokens, S key tokens, H query heads, G key/value heads, D head dim.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.attention.varlen

from trainer_client.dacp import attention
from trainer_client.torch_compat import torch_apis

RELEASES = ("2.10", "2.11", "2.12", "2.13")


def reference_varlen(q_THD: torch.Tensor, k_SGD: torch.Tensor, v_SGD: torch.Tensor, cu_seq_q: torch.Tensor,
                     cu_seq_k: torch.Tensor, max_q: int, max_k: int, *, scale: float | None, gqa: bool,
                     bottom_right: bool = True) -> torch.Tensor:
    """Causal attention per segment, aligned bottom-right (or top-left), after the checks a varlen kernel
    makes."""
    if cu_seq_q.dtype != torch.int32 or cu_seq_k.dtype != torch.int32:
        raise RuntimeError(f"cu_seqlens must be int32, got {cu_seq_q.dtype} and {cu_seq_k.dtype}")
    if q_THD.dim() != 3 or k_SGD.dim() != 3 or v_SGD.shape != k_SGD.shape:
        raise RuntimeError(f"expected q [T, H, D] and k, v [S, G, D], got {q_THD.shape}, {k_SGD.shape}, {v_SGD.shape}")
    if not (k_SGD.is_contiguous() and v_SGD.is_contiguous()):
        raise RuntimeError("key and value must be contiguous")
    num_heads, num_kv_heads = q_THD.shape[1], k_SGD.shape[1]
    if num_kv_heads != num_heads and not (gqa and num_heads % num_kv_heads == 0):
        raise RuntimeError(f"number of heads in key/value ({num_kv_heads}) must equal the query's ({num_heads})")
    lengths_q, lengths_k = cu_seq_q.diff().tolist(), cu_seq_k.diff().tolist()
    if max(lengths_q, default=0) > max_q or max(lengths_k, default=0) > max_k:
        raise RuntimeError(f"max_q {max_q} / max_k {max_k} below a segment's length")
    scale = q_THD.shape[-1] ** -0.5 if scale is None else scale
    k_SHD = k_SGD.repeat_interleave(num_heads // num_kv_heads, dim=1)
    v_SHD = v_SGD.repeat_interleave(num_heads // num_kv_heads, dim=1)
    outputs = []
    bounds_q, bounds_k = cu_seq_q.tolist(), cu_seq_k.tolist()
    for q_start, q_end, k_start, k_end in zip(bounds_q[:-1], bounds_q[1:], bounds_k[:-1], bounds_k[1:], strict=True):
        num_q, num_k = q_end - q_start, k_end - k_start
        scores_HTS = torch.einsum("thd,shd->hts", q_THD[q_start:q_end], k_SHD[k_start:k_end]) * scale
        visible_TS = torch.ones(num_q, num_k, dtype=torch.bool).tril(diagonal=num_k - num_q if bottom_right else 0)
        weights_HTS = scores_HTS.masked_fill(~visible_TS, float("-inf")).softmax(dim=-1)
        outputs.append(torch.einsum("hts,shd->thd", weights_HTS, v_SHD[k_start:k_end]))
    return torch.cat(outputs)


def _causal(window_size: tuple[int, int]) -> None:
    if tuple(window_size) != (-1, 0):
        raise AssertionError(f"the trainer asks for causal attention, window_size (-1, 0); got {window_size}")


def varlen_attn_2_10(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seq_q: torch.Tensor,
                     cu_seq_k: torch.Tensor, max_q: int, max_k: int, is_causal: bool = False,
                     return_aux: Any = None) -> torch.Tensor:
    assert is_causal, "the trainer asks for causal attention"
    return reference_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=None, gqa=False)


def varlen_attn_2_11(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seq_q: torch.Tensor,
                     cu_seq_k: torch.Tensor, max_q: int, max_k: int, *, return_aux: Any = None,
                     scale: float | None = None, window_size: tuple[int, int] = (-1, -1)) -> torch.Tensor:
    _causal(window_size)
    return reference_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale, gqa=False)


def varlen_attn_2_12(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seq_q: torch.Tensor,
                     cu_seq_k: torch.Tensor | None, max_q: int, max_k: int, *, return_aux: Any = None,
                     scale: float | None = None, window_size: tuple[int, int] = (-1, -1), enable_gqa: bool = False,
                     seqused_k: torch.Tensor | None = None, block_table: torch.Tensor | None = None,
                     num_splits: int | None = None) -> torch.Tensor:
    _causal(window_size)
    assert cu_seq_k is not None and seqused_k is None and block_table is None
    return reference_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale, gqa=enable_gqa)


def varlen_attn_top_left(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seq_q: torch.Tensor,
                         cu_seq_k: torch.Tensor | None, max_q: int, max_k: int, *, return_aux: Any = None,
                         scale: float | None = None, window_size: tuple[int, int] = (-1, -1), enable_gqa: bool = False,
                         seqused_k: torch.Tensor | None = None, block_table: torch.Tensor | None = None,
                         num_splits: int | None = None) -> torch.Tensor:
    """A 2.12-style kernel whose causal mask aligns top-left (as cuDNN's and SDPA's ``is_causal`` do): no supported
    release has one, the trainer must stay exact if one comes."""
    _causal(window_size)
    assert cu_seq_k is not None
    return reference_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale, gqa=enable_gqa,
                            bottom_right=False)


VARLEN_ATTN: dict[str, Callable[..., torch.Tensor]] = {
    "2.10": varlen_attn_2_10, "2.11": varlen_attn_2_11, "2.12": varlen_attn_2_12, "2.13": varlen_attn_2_12,
}


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
    return reference_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale=softmax_scale,
                            gqa=True)


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
def emulated(release: str, *, flash_attn: bool = False,
             varlen_attn: Callable[..., torch.Tensor] | None = None) -> Iterator[None]:
    """The installed torch as ``release`` has it, for this process, while the block runs (``varlen_attn``: with
    that kernel instead of the release's); with ``flash_attn``, flash-attn installed too. Whichever supported
    release is installed provides the collectives underneath."""
    with contextlib.ExitStack() as stack:
        patch = stack.enter_context(_patch())
        patch(torch.nn.attention.varlen, "varlen_attn", varlen_attn or VARLEN_ATTN[release])
        for name, old_name, gathers in _COLLECTIVES:
            real = getattr(dist, name, None) or getattr(dist, old_name)
            if release == "2.13":
                patch(dist, name, _checked_collective(real, name, gathers=gathers))
                patch(dist, old_name, _checked_collective(real, old_name, gathers=gathers, deprecated_for=name))
            else:
                patch(dist, old_name, _checked_collective(real, old_name, gathers=gathers))
                patch(dist, name, None)
        patch(attention, "_flash_attn_varlen_func", lambda: flash_attn_varlen_func if flash_attn else None)
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
