"""The torch APIs that differ between the releases the trainer supports, resolved once, in one place.

The trainer and the profiler call what this module resolves, never the version-dependent names themselves:

==========================  ==========================  =====================================================
API                         2.10 – 2.12                 2.13
==========================  ==========================  =====================================================
gather into one tensor      ``all_gather_into_tensor``  ``all_gather_single``
reduce-scatter, one tensor  ``reduce_scatter_tensor``   ``reduce_scatter_single``
==========================  ==========================  =====================================================

The single-tensor collectives were renamed in 2.13 (pytorch #186123), where the old names still work but warn
that they are deprecated; the new names are used wherever they exist.

The varlen attention kernel is torch's own flash kernel, ``aten::_flash_attention_forward``, called as an operator
rather than through ``torch.nn.attention.varlen.varlen_attn``: that wrapper is a Python custom op, whose
dispatch (defaults filled in, a Python autograd function) cost about 150 µs of host time per call on the
development machine where the operator costs 35 µs (``benchmarks.host``), and whose signature changed in every
release (2.10 ``is_causal`` and no ``scale``, 2.11 ``window_size``, 2.12 ``enable_gqa``). The operator takes the
same arguments in every supported release (``is_causal``, ``scale``), differentiates in C++ (its backward is
``aten::_flash_attention_backward``), is traced by Dynamo as any operator, and runs fewer K/V heads than query heads
natively, which ``varlen_attn`` refused before 2.12 (K/V heads had to be repeated). Its causal mask aligns to the
bottom right when a segment has fewer queries than keys, as DACP's zigzag chunks need (``dacp/packing.py``);
``CausalVarlenAttn`` checks that once per device and takes an exact path where a kernel aligns top-left.

Features are detected, not versions compared: the ``torch.distributed`` attributes say which collectives exist.
``torch_apis()`` resolves them at its first call and keeps them; tests that emulate a release clear it
(``torch_apis.cache_clear()``).

``SUPPORTED_TORCH`` is the range the project tests (pyproject's ``trainer`` extra declares the same);
``check_torch_version`` names a torch outside it at start-up: an older one is refused, a newer one warned of.

The few private torch APIs the trainer needs (no public form exists in the supported releases) are reached only
through this module too, each with why it is needed: the flash operator (above), ``group_options`` (a
timeout for the groups ``DeviceMesh`` creates), ``flatten_mesh`` (one group over a mesh's dimensions, FSDP2's),
``dynamo_supported`` (whether ``--compile`` can run), ``default_store`` (the rendezvous store, where the first
failing rank leaves its reason), ``composable_checkpoint`` (activation checkpointing that keeps parameter names, so
FSDP2 and DCP see the same state dict) and ``memory_tracker`` (the peak of tensors on CPU, for the profiler). A
release that drops one fails here with its name, not deep in a run.

Shape legend: T query tokens, S key tokens, H query heads, G key/value heads, D head dim.
"""

from __future__ import annotations

import functools
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

MIN_TORCH = (2, 10)  # the first release tested (the first with torch.nn.attention.varlen)
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
    varlen_attn: VarlenKernel | None  # causal, bottom-right, with GQA; None: no flash operator in this build


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
    flash_forward = getattr(torch.ops.aten, "_flash_attention_forward", None)
    return None if flash_forward is None else CausalVarlenAttn(flash_forward)


class CausalVarlenAttn:
    """Causal varlen attention aligned bottom-right through ``aten::_flash_attention_forward`` (module docstring).

    Bottom-right alignment is what the flash kernel of every supported release gives; it is checked once per device
    and dtype on one query against two keys, which bottom-right lets the query see both of and top-left only the
    first. A kernel that aligns top-left gets every query segment padded in front to its keys' length
    (``_padded_to_keys``): a square segment aligns the same either way, so the result is exact, at the cost of
    computing the padding rows.
    """

    def __init__(self, flash_forward: Callable[..., Any]) -> None:
        self.flash_forward = flash_forward
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
        # dropout 0, causal, no debug mask; the kernel needs only the last dimension contiguous, as packed rows are
        out = self.flash_forward(q_THD, k_SGD, v_SGD, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, 0.0,
                                 True, False, scale=softmax_scale)[0]
        assert isinstance(out, torch.Tensor)
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
