"""The torch APIs that differ between the releases the trainer supports, resolved once, in one place.

The trainer and the profiler call what this module resolves, never the version-dependent names themselves:

==========================  ==========================  =======================  ===============================
API                         2.10                        2.11                     2.12, 2.13
==========================  ==========================  =======================  ===============================
``varlen_attn`` causality   ``is_causal=True``          ``window_size=(-1, 0)``  ``window_size=(-1, 0)``
``varlen_attn`` scale       none (1/√D): q is rescaled  ``scale=``               ``scale=``
``varlen_attn`` GQA         K/V heads repeated          K/V heads repeated       ``enable_gqa=True``
gather into one tensor      ``all_gather_into_tensor``  the same                 2.13: ``all_gather_single``
reduce-scatter, one tensor  ``reduce_scatter_tensor``   the same                 2.13: ``reduce_scatter_single``
==========================  ==========================  =======================  ===============================

The single-tensor collectives were renamed in 2.13 (pytorch #186123), where the old names still work but warn
that they are deprecated; the new names are used wherever they exist. Every ``varlen_attn`` above runs the flash
kernel, which aligns a causal mask to the bottom right when a segment has fewer queries than keys, as DACP's
zigzag chunks need (``dacp/packing.py``); ``CausalVarlenAttn`` checks that once per device and takes an exact path
where a kernel aligns top-left.

Features are detected, not versions compared: ``varlen_attn``'s parameters say which call it takes, the
``torch.distributed`` attributes which collectives exist. ``torch_apis()`` resolves them at its first call and
keeps them; tests that emulate a release clear it (``torch_apis.cache_clear()``).

``SUPPORTED_TORCH`` is the range the project tests (pyproject's ``trainer`` extra declares the same);
``check_torch_version`` names a torch outside it at start-up: an older one is refused, a newer one warned of.

The few private torch APIs the trainer needs (no public form exists in the supported releases) are reached only
through this module too, each with why it is needed: ``group_options`` (a timeout for the groups ``DeviceMesh``
creates), ``flatten_mesh`` (one group over a mesh's dimensions, FSDP2's), ``dynamo_supported`` (whether
``--compile`` can run), ``default_store`` (the rendezvous store, where the first failing rank leaves its reason),
``composable_checkpoint`` (activation checkpointing that keeps parameter names, so FSDP2 and DCP see the same
state dict) and ``memory_tracker`` (the peak of tensors on CPU, for the profiler). A release that drops one fails
here with its name, not deep in a run.

Shape legend: T query tokens, S key tokens, H query heads, G key/value heads, D head dim.
"""

from __future__ import annotations

import functools
import inspect
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "SUPPORTED_TORCH",
    "CausalVarlenAttn",
    "TorchApis",
    "UnsupportedTorch",
    "check_torch_version",
    "composable_checkpoint",
    "default_store",
    "dynamo_supported",
    "flatten_mesh",
    "group_options",
    "memory_tracker",
    "torch_apis",
    "torch_release",
]

MIN_TORCH = (2, 10)  # the first release with torch.nn.attention.varlen
MAX_TORCH = (2, 14)  # exclusive: the first release not tested
SUPPORTED_TORCH = f">={MIN_TORCH[0]}.{MIN_TORCH[1]},<{MAX_TORCH[0]}.{MAX_TORCH[1]}"

Collective = Callable[..., Any]  # (output, input, group=..., async_op=...) -> Work | None
VarlenKernel = Callable[..., torch.Tensor]  # (q_THD, k_SGD, v_SGD, cu_q, cu_k, max_q, max_k, softmax_scale)


class UnsupportedTorch(ValueError):
    """The installed torch is outside the range the trainer is tested with."""


def torch_release(version: str) -> tuple[int, int]:
    """(major, minor) of a torch version string such as ``2.11.0+cu130`` or ``2.13.0a0+git1234``."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise UnsupportedTorch(f"cannot read a torch release from the version {version!r}")
    return int(match.group(1)), int(match.group(2))


def check_torch_version(version: str | None = None) -> str | None:
    """Name ``version`` (default: the installed torch) and the supported range unless it lies in it: raise
    ``UnsupportedTorch`` for an older torch, which lacks what the trainer calls; return a warning for a newer one,
    which the trainer resolves its calls on as on any other but was not tested with."""
    version = version or torch.__version__
    release = torch_release(version)
    if release < MIN_TORCH:
        raise UnsupportedTorch(f"torch {version} is older than the Skrull trainer supports, torch{SUPPORTED_TORCH}: "
                               f"install one in that range (pip install 'torch{SUPPORTED_TORCH}')")
    if release >= MAX_TORCH:
        return (f"torch {version} is newer than the releases the Skrull trainer is tested with, "
                f"torch{SUPPORTED_TORCH}; report what breaks")
    return None


@dataclass(frozen=True, kw_only=True, slots=True)
class TorchApis:
    """The installed torch's version-dependent calls, as the trainer uses them."""

    all_gather_single: Collective  # (output [group_size · n, ...], input [n, ...], group=, async_op=)
    reduce_scatter_single: Collective  # (output [n, ...], input [group_size · n, ...], group=, async_op=)
    varlen_attn: VarlenKernel | None  # causal, bottom-right, with GQA; None: no torch.nn.attention.varlen


@functools.cache
def torch_apis() -> TorchApis:
    """The calls of the installed torch, resolved at the first call."""
    return TorchApis(
        all_gather_single=_collective("all_gather_single", "all_gather_into_tensor"),
        reduce_scatter_single=_collective("reduce_scatter_single", "reduce_scatter_tensor"),
        varlen_attn=_varlen_kernel(),
    )


def _collective(name: str, before_2_13: str) -> Collective:
    collective: Collective | None = getattr(dist, name, None) or getattr(dist, before_2_13, None)
    if collective is None:
        raise UnsupportedTorch(f"torch {torch.__version__} has neither torch.distributed.{name} nor "
                               f"{before_2_13}; the trainer supports torch{SUPPORTED_TORCH}")
    return collective


def _varlen_kernel() -> VarlenKernel | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    parameters = inspect.signature(varlen_attn).parameters
    if "window_size" not in parameters and "is_causal" not in parameters:
        raise UnsupportedTorch(f"torch {torch.__version__}'s varlen_attn takes neither window_size nor is_causal "
                               f"({', '.join(parameters)}); the trainer supports torch{SUPPORTED_TORCH}")
    return CausalVarlenAttn(varlen_attn, native_gqa="enable_gqa" in parameters, window="window_size" in parameters,
                            scale="scale" in parameters)


class CausalVarlenAttn:
    """Causal varlen attention aligned bottom-right through this release's ``varlen_attn``, whichever of its forms
    it has.

    Bottom-right alignment is what the flash kernel behind every supported release gives; it is checked once per
    device and dtype on one query against two keys, which bottom-right lets the query see both of and top-left
    only the first. A kernel that aligns top-left gets every query segment padded in front to its keys' length
    (``_padded_to_keys``): a square segment aligns the same either way, so the result is exact, at the cost of
    computing the padding rows.
    """

    def __init__(self, varlen_attn: Callable[..., Any], *, native_gqa: bool, window: bool, scale: bool) -> None:
        self.varlen_attn = varlen_attn
        self.native_gqa = native_gqa
        self.window = window
        self.scale = scale
        self._bottom_right: dict[tuple[torch.device, torch.dtype, int], bool] = {}

    def __call__(self, q_THD: torch.Tensor, k_SGD: torch.Tensor, v_SGD: torch.Tensor, cu_seqlens_q: torch.Tensor,
                 cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                 softmax_scale: float | None) -> torch.Tensor:
        some_suffix = q_THD.shape[0] != k_SGD.shape[0]  # a segment has fewer queries than keys
        if some_suffix and not self.aligns_bottom_right(q_THD.device, q_THD.dtype, q_THD.shape[-1]):
            return _padded_to_keys(self._attend, q_THD, k_SGD, v_SGD, cu_seqlens_q, cu_seqlens_k, max_seqlen_k,
                                       softmax_scale)
        return self._attend(q_THD, k_SGD, v_SGD, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale)

    @torch.no_grad()
    def aligns_bottom_right(self, device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
        """Whether the kernel aligns a causal mask to the bottom right (probed once per device, dtype, head dim)."""
        key = (device, dtype, head_dim)
        if key not in self._bottom_right:
            q_1HD = torch.zeros(1, 1, head_dim, device=device, dtype=dtype)
            kv_2GD = torch.zeros(2, 1, head_dim, device=device, dtype=dtype)
            v_2GD = kv_2GD.clone()
            v_2GD[1] = 1.0  # uniform weights: 0.5 if the query sees both keys, 0 if it sees the first only
            one, two = (torch.tensor([0, n], dtype=torch.int32, device=device) for n in (1, 2))
            out_1HD = self._attend(q_1HD, kv_2GD, v_2GD, one, two, 1, 2, None)
            self._bottom_right[key] = bool(out_1HD.float().mean() > 0.25)
        return self._bottom_right[key]

    def _attend(self, q_THD: torch.Tensor, k_SGD: torch.Tensor, v_SGD: torch.Tensor, cu_seqlens_q: torch.Tensor,
                cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                softmax_scale: float | None) -> torch.Tensor:
        num_heads, num_kv_heads = q_THD.shape[1], k_SGD.shape[1]
        keywords: dict[str, Any] = {"window_size": (-1, 0)} if self.window else {"is_causal": True}
        if self.native_gqa:
            keywords["enable_gqa"] = True
        elif num_kv_heads != num_heads:
            # Query head h reads K/V head h // (H / G), as transformers' repeat_kv lays them out.
            k_SGD = k_SGD.repeat_interleave(num_heads // num_kv_heads, dim=1)
            v_SGD = v_SGD.repeat_interleave(num_heads // num_kv_heads, dim=1)
        head_dim = q_THD.shape[-1]
        if softmax_scale is not None and self.scale:
            keywords["scale"] = softmax_scale
        elif softmax_scale is not None and not math.isclose(softmax_scale, head_dim ** -0.5):
            q_THD = q_THD * (softmax_scale * math.sqrt(head_dim))  # the kernel's own scale is 1/√D
        out = self.varlen_attn(q_THD, k_SGD.contiguous(), v_SGD.contiguous(), cu_seqlens_q, cu_seqlens_k,
                               max_seqlen_q, max_seqlen_k, **keywords)
        assert isinstance(out, torch.Tensor)  # a tuple only when return_aux asks for the log-sum-exp
        return out


def _padded_to_keys(
    attend: VarlenKernel, q_THD: torch.Tensor, k_SGD: torch.Tensor, v_SGD: torch.Tensor, cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor, max_seqlen_k: int, softmax_scale: float | None,
) -> torch.Tensor:
    """Bottom-right causal attention from a kernel that aligns top-left: each query segment placed at the end of a
    segment as long as its keys (zeros in front), attended square, and read back. Query ``t`` of segment ``i``
    sits at row ``t + (cu_k[i + 1] − cu_q[i + 1])`` of the padded rows; all on the device, no host sync."""
    num_queries = q_THD.shape[0]
    offsets_T = torch.repeat_interleave(cu_seqlens_k[1:] - cu_seqlens_q[1:], cu_seqlens_q.diff(),
                                        output_size=num_queries)
    rows_T = torch.arange(num_queries, device=q_THD.device) + offsets_T
    padded_SHD = q_THD.new_zeros((k_SGD.shape[0], *q_THD.shape[1:])).index_copy(0, rows_T, q_THD)
    out_SHD = attend(padded_SHD, k_SGD, v_SGD, cu_seqlens_k, cu_seqlens_k, max_seqlen_k, max_seqlen_k, softmax_scale)
    return out_SHD.index_select(0, rows_T)


def group_options(backend: str, timeout: timedelta) -> Any:
    """Backend options carrying ``timeout``: how ``DeviceMesh`` is told a timeout for the groups it creates
    (``init_device_mesh`` takes no timeout; its ``backend_override`` takes options, whose timeout is private)."""
    options = (dist.ProcessGroupNCCL.Options() if backend == "nccl"
               else dist.ProcessGroupGloo._Options())  # type: ignore[attr-defined]
    options._timeout = timeout
    return options


def default_store() -> dist.Store:
    """The default process group's rendezvous store (private in every supported release)."""
    return dist.distributed_c10d._get_default_store()


def composable_checkpoint(module: torch.nn.Module, **options: Any) -> torch.nn.Module:
    """Activation checkpointing as a module hook (``torch.distributed._composable.checkpoint``): unlike
    ``checkpoint_wrapper`` it keeps parameter names, so FSDP2, DCP and the exported state dict agree."""
    from torch.distributed._composable import checkpoint

    return checkpoint(module, **options)


def memory_tracker() -> Any:
    """A ``MemTracker`` (``torch.distributed._tools.mem_tracker``): the peak bytes of tensors made while it is
    entered, per device, which the CPU allocator does not report."""
    from torch.distributed._tools.mem_tracker import MemTracker

    return MemTracker()


def flatten_mesh(mesh: DeviceMesh, name: str, *, backend_override: tuple[str, Any]) -> DeviceMesh:
    """The one-dimensional mesh over all of ``mesh``'s ranks (``DeviceMesh._flatten``): FSDP2 shards over DP × CP
    as one group, and a slice of the mesh does not make that group."""
    return mesh._flatten(name, backend_override=backend_override)


def dynamo_supported() -> bool:
    """Whether ``torch.compile`` works on this platform and Python (``torch._dynamo.is_dynamo_supported``; torch's
    own ``__init__`` does not import ``torch._dynamo``)."""
    from torch._dynamo import is_dynamo_supported

    return bool(is_dynamo_supported())
