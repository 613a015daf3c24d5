"""Sharding and activation checkpointing, applied to a model from outside (torchtitan's ``parallelize`` step).

``parallelize(module, mesh, ...)`` takes the trainer's ``CausalLMLoss`` (``loss.py``) and

1. wraps activation checkpointing around each decoder layer (``ActivationCheckpointing``):
   ``selective`` recomputes each layer's MLP (the largest activations, ``intermediate_size`` wide) and never
   attention, whose recomputation would all-gather K/V again; ``full`` recomputes the whole layer, attention
   and its all-gather included (Megatron's full recomputation). Composable checkpointing
   (``torch.distributed._composable.checkpoint``) hooks the module, so parameter names do not change and
   checkpoints stay interchangeable between modes.
2. compiles each decoder layer (``compile=True``, the trainer's ``--compile``): ``torch.compile`` per block, in
   place (``Module.compile``: parameter names, and so checkpoints, do not change), with dynamic shapes, since
   every packed row has another length. Compiled blocks fuse the norms, projections, RoPE and MLP into a few
   kernels, which is what the eager trainer's launch-bound floor pays for on a GPU (one kernel launch per
   operator). A micro-batch whose sequences are all local traces its attention kernel too (one forward and one
   backward graph per layer); the collectives of sharded sequences run eagerly
   (``attention.dacp_attention_with_collectives``). ``cuda_graphs=True`` (``--cuda-graphs``) compiles each
   block with static shapes in ``reduce-overhead`` mode instead: CUDA graphs per token bucket, replayed with one
   launch each (``check_cuda_graphs`` says where they cannot run).
3. shards with FSDP2 (``fully_shard``) over the flattened DP × CP mesh (``Sharding``). CP ranks hold different
   tokens of the same global batch, so for the optimizer they are data-parallel ranks like any other. Under
   ``zero3`` every decoder layer is one unit and the root (embeddings, final norm, the tied LM head) another, so
   that a layer's parameters are gathered only while it runs. Under ``zero2`` they stay gathered for the whole
   step whatever the units, so ``fsdp_units`` (``--fsdp-units``) decides: ``layer`` as under ``zero3``, or
   ``model``, one unit for the whole model (the trainer's default where the whole model's fp32 gradients fit in
   the activation memory the last backward has freed by then), whose hooks run once per micro-batch instead of
   once per layer (FSDP2 pays each hook in Python: a new ``torch._dynamo.disable`` wrapper per call, the walk of
   the layer's inputs and outputs), at the price of no overlap of the step's first all-gather and last
   reduce-scatter with compute and of the whole model's reduce-scatter input at once in the last backward
   (``benchmarks.host`` measures both).

Under FSDP the ranks of one CP group run the same micro-batches in the same order, the idle ones (no token, no
collective) as zero-loss padding micro-batches: a rank skipping one would pair its next FSDP collective (over
all ranks) with a peer still inside a CP collective that waits for it. Per micro-batch the trainer then calls
``prepare_micro_batch``:

* ``zero2``: parameters stay unsharded across a rank's micro-batches (``reshard_after_forward=False`` and no
  reshard after backward until the last one); gradients accumulate unsharded and are reduce-scattered once, in
  the backward of the rank's last micro-batch (``set_requires_gradient_sync``). Each rank's FSDP collectives
  are one all-gather per unit (first forward) and one reduce-scatter per unit (last backward), so DP ranks may
  run different numbers of micro-batches; one with none runs one zero-loss padding micro-batch.
* ``zero3``: parameters are resharded after every forward and gathered again for backward; gradients are
  reduce-scattered every micro-batch. Every rank gathers per micro-batch, so every rank runs the same number:
  the plan's longest DP rank's count, topped up with zero-loss padding micro-batches.
* ``none``: replicated parameters, gradients summed by one flat all-reduce after the last micro-batch
  (``reduce_gradients``; DDP would need the same number of micro-batches on every DP rank, which Skrull's plans
  do not give).

Gradients are summed, not averaged, over ranks (``set_gradient_divide_factor(1)``): the loss is already divided
by the global batch's loss tokens (``Trainer``). On CUDA, FSDP keeps bf16 parameters and compute and reduces
gradients in fp32 (``MixedPrecisionPolicy``); on CPU everything is fp32.

Static memory per parameter, by sharding mode, is ``scheduler_service.core.memory``'s: the planner and the layout
advisor derive BucketSize from it.
"""

from __future__ import annotations

import shutil
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from scheduler_service.core.memory import ActivationCheckpointing, Sharding
from trainer_client.config_choices import FsdpUnits
from trainer_client.distributed.torch_compat import composable_checkpoint, dynamo_supported
from trainer_client.models.loss import CausalLMLoss

__all__ = [
    "ActivationCheckpointing",
    "FsdpUnits",
    "Sharding",
    "apply_activation_checkpointing",
    "apply_compile",
    "apply_fsdp",
    "check_compile",
    "check_compile_layout",
    "check_cuda_graphs",
    "num_padding_micro_batches",
    "parallelize",
    "prepare_micro_batch",
    "reduce_gradients",
    "reshard",
]


def parallelize(
    module: CausalLMLoss, mesh: DeviceMesh, *, sharding: Sharding, activation_checkpointing: ActivationCheckpointing,
    param_dtype: torch.dtype, compile: bool = False, fsdp_units: FsdpUnits = FsdpUnits.LAYER,
    cuda_graphs: bool = False,
) -> CausalLMLoss:
    """Activation checkpointing, then (``compile``) ``torch.compile`` per block, captured as CUDA graphs with
    ``cuda_graphs``, then FSDP2 over ``mesh`` (1-D: the flattened DP × CP ranks), torchtitan's order; in place."""
    apply_activation_checkpointing(module, activation_checkpointing)
    if compile or cuda_graphs:
        apply_compile(module, cuda_graphs=cuda_graphs)
    if sharding is not Sharding.NONE:
        apply_fsdp(module, mesh, reshard_after_forward=sharding is Sharding.ZERO3, param_dtype=param_dtype,
                   units=fsdp_units)
    return module


def apply_activation_checkpointing(module: CausalLMLoss, mode: ActivationCheckpointing) -> None:
    for layer in module.decoder_layers():
        if mode is ActivationCheckpointing.FULL:
            # Recompute everything: the K/V all-gather of every rank must rerun.
            composable_checkpoint(layer, early_stop=False)
        elif mode is ActivationCheckpointing.SELECTIVE:
            composable_checkpoint(layer.get_submodule("mlp"))


def apply_compile(module: CausalLMLoss, *, cuda_graphs: bool = False) -> None:
    """Compile each decoder layer's ``forward`` in place (parameter names, and so checkpoints, do not change; the
    layer's hooks, FSDP's and activation checkpointing's, stay around it, eager). Only the token dimension is
    dynamic: packed rows differ in length at every micro-batch, and a graph specialised to each length would
    recompile at every one, but the hidden sizes do not change, and graphs specialised to them run with fewer guards
    and wrapper work than with every dimension symbolic. The first layer's inputs are marked
    (``_mark_token_dims_dynamic``); each compiled layer marks its outputs' dynamic dimensions, so the next layer's
    input comes marked. Inductor's size asserts are off: they check, at every call, shapes the graph was traced with.

    ``cuda_graphs`` (``--cuda-graphs``): every row is padded to a token bucket, so shapes are static per bucket, and
    each layer's graphs are captured per bucket and replayed (inductor's ``reduce-overhead`` mode, CUDA graph
    trees): one launch per graph instead of one per kernel. ``check_cuda_graphs`` says where that can run."""
    layers = module.decoder_layers()
    if cuda_graphs:
        for layer in layers:
            layer.forward = torch.compile(layer.forward, mode="reduce-overhead", dynamic=False)
        return
    layers[0].register_forward_pre_hook(_mark_token_dims_dynamic, with_kwargs=True)
    for layer in layers:
        layer.forward = torch.compile(layer.forward, options={"size_asserts": False})


def check_cuda_graphs(device: torch.device, *, sharding: Sharding, cp_size: int) -> None:
    """Raise ``ValueError`` saying why ``--cuda-graphs`` cannot run here, before any model is built: a CPU (no CUDA
    graphs); CP groups of more than one rank (sharded sequences run collectives inside every layer, which a captured
    graph cannot hold); FSDP sharding (it gathers parameters into new memory at every step, and a graph replays the
    addresses it was captured with). Spanning micro-batches are not planned (``--cuda-graphs`` plans within CP
    groups), so DP replicas share no collective inside a layer either."""
    if device.type != "cuda":
        raise ValueError("--cuda-graphs needs a CUDA device: CUDA graphs capture GPU kernels; on CPU run without it "
                         "(--token-buckets pads rows to the same buckets)")
    if cp_size > 1:
        raise ValueError(f"--cuda-graphs needs --cp 1: with CP {cp_size}, sharded sequences run collectives inside "
                         "every layer, which a captured graph cannot hold")
    if sharding is not Sharding.NONE:
        raise ValueError(f"--cuda-graphs needs --sharding none: {sharding} gathers the parameters into new memory "
                         "at every step, and a captured graph replays the addresses it was captured with")


def _mark_token_dims_dynamic(layer: torch.nn.Module, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
    """Mark the token dimensions of a decoder layer's inputs dynamic: the hidden states and RoPE's cos/sin ``[1, T,
    …]``, the positions ``[1, T]``, and the local segments' boundaries and longest length (``model.model_inputs``)."""
    hidden_states = args[0] if args else kwargs["hidden_states"]
    assert isinstance(hidden_states, torch.Tensor)
    torch._dynamo.maybe_mark_dynamic(hidden_states, 1)
    for name, dim in (("position_ids", 1), ("dacp_cu_seqlens", 0), ("dacp_max_seqlen", 0)):
        tensor = kwargs.get(name)
        if isinstance(tensor, torch.Tensor):
            torch._dynamo.maybe_mark_dynamic(tensor, dim)
    for tensor in kwargs.get("position_embeddings") or ():  # type: ignore[attr-defined]
        torch._dynamo.maybe_mark_dynamic(tensor, 1)


def check_compile_layout(activation_checkpointing: ActivationCheckpointing) -> None:
    """Raise ``ValueError`` for a checkpointing mode compiled blocks cannot run under: selective checkpointing's
    hooks on the MLP inside a compiled block can recompute through another compiled graph than the forward took,
    and fail (pytorch/pytorch#166926)."""
    if activation_checkpointing is ActivationCheckpointing.SELECTIVE:
        raise ValueError("--compile with --activation-checkpointing selective is not supported: use full (each "
                         "compiled block recomputed whole) or none")


def check_compile(device: torch.device, *, flag: str = "--compile") -> None:
    """Raise ``ValueError`` saying why ``flag`` (``--compile``, or ``--cuda-graphs``, which compiles too) cannot run
    here, before any model is built: a torch without a working ``torch.compile`` (Windows; Python newer than it
    supports), or a CPU with no C++ compiler for inductor's kernels."""
    if not dynamo_supported():
        raise ValueError(f"{flag} needs torch.compile, which torch {torch.__version__} does not support on this "
                         "platform or Python")
    if device.type == "cpu" and not any(shutil.which(name) for name in ("g++", "c++", "clang++")):
        raise ValueError(f"{flag} on CPU needs a C++ compiler (g++ or clang++) for inductor's kernels; none is on "
                         "PATH")
    if device.type == "cuda":
        major, _ = torch.cuda.get_device_capability(device)
        if major < 7:
            raise ValueError(f"{flag} needs a GPU of compute capability 7.0 or more for Triton; "
                             f"{torch.cuda.get_device_name(device)} has {major}.x")


@dataclass(slots=True)
class _GradientSync:
    """A sharded module's FSDP units and the gradient settings last given to them (None: FSDP's own defaults)."""

    units: tuple[FSDPModule, ...]
    requires_gradient_sync: bool | None = None
    reshard_after_backward: bool | None = None


_GRADIENT_SYNC: weakref.WeakKeyDictionary[torch.nn.Module, _GradientSync] = weakref.WeakKeyDictionary()


def apply_fsdp(
    module: CausalLMLoss, mesh: DeviceMesh, *, reshard_after_forward: bool, param_dtype: torch.dtype,
    units: FsdpUnits = FsdpUnits.LAYER,
) -> None:
    """FSDP units as ``units`` says, the root always one; gradients summed over ranks, reduced in fp32. The layers'
    inputs are not cast (``cast_forward_inputs``): the embeddings already give the parameters' dtype, and casting
    walks and rebuilds every layer's keyword arguments."""
    if units is FsdpUnits.MODEL and reshard_after_forward:
        raise ValueError("one FSDP unit for the whole model keeps every parameter gathered through the forward: "
                         "zero3 shards per layer")
    mixed_precision = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32,
                                           cast_forward_inputs=False)
    if units is FsdpUnits.LAYER:
        for layer in module.decoder_layers():
            fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mixed_precision)
    fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mixed_precision)
    sharded = _fsdp_units(module)
    for unit in sharded:
        # Sum, not mean: the loss is already normalised by the global token count. A plain SUM reduction (gloo
        # has no PREMUL_SUM) followed by a division by 1, which is exact.
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)
    _GRADIENT_SYNC[module] = _GradientSync(units=sharded)


def _fsdp_units(module: torch.nn.Module) -> tuple[FSDPModule, ...]:
    return tuple(unit for unit in module.modules() if isinstance(unit, FSDPModule))


def _gradient_sync(module: torch.nn.Module) -> _GradientSync:
    """``module``'s FSDP units and their settings: registered by ``apply_fsdp``, else (a module sharded by another
    library, accelerate under the Hugging Face Trainer, ``trainer_client.hf``; or a replicated one, none) found at
    the first micro-batch."""
    sync = _GRADIENT_SYNC.get(module)
    if sync is None:
        sync = _GRADIENT_SYNC[module] = _GradientSync(units=_fsdp_units(module))
    return sync


def prepare_micro_batch(module: torch.nn.Module, *, sharding: Sharding, is_last: bool) -> None:
    """Tell FSDP whether this rank's coming micro-batch is its last of the step (where gradients are reduced): set
    on each unit alone, and only when it changes (FSDP's own setters walk every module of the model)."""
    sync = _gradient_sync(module)
    if not sync.units:
        return
    requires_gradient_sync = is_last or sharding is Sharding.ZERO3
    if sync.requires_gradient_sync is not requires_gradient_sync:
        for unit in sync.units:
            unit.set_requires_gradient_sync(requires_gradient_sync, recurse=False)
        sync.requires_gradient_sync = requires_gradient_sync
    if sharding is Sharding.ZERO2 and sync.reshard_after_backward is not is_last:
        for unit in sync.units:
            unit.set_reshard_after_backward(is_last, recurse=False)
        sync.reshard_after_backward = is_last


def num_padding_micro_batches(sharding: Sharding, *, num_planned: int, max_planned: int) -> int:
    """Zero-loss micro-batches a rank appends to the plan's so that its FSDP collectives match every other rank's.

    ``num_planned``: micro-batches the plan gives this rank's DP rank; ``max_planned``: the most any DP rank has.
    """
    if sharding is Sharding.ZERO3:
        return max_planned - num_planned
    if sharding is Sharding.ZERO2:
        return 0 if num_planned else 1
    return 0


def reduce_gradients(params: Sequence[torch.nn.Parameter], totals: torch.Tensor, *, sharding: Sharding) -> torch.Tensor:
    """Sum ``totals`` (fp32, 1-D: the step's loss and counts) over all ranks and return the sums; replicated
    (``none``), every gradient is summed in the same flat all-reduce, one collective, and ranks that ran no
    micro-batch contribute zeros. Under FSDP the gradients were reduce-scattered in the last backward already."""
    if sharding is not Sharding.NONE:
        dist.all_reduce(totals)
        return totals
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1).float() for g in grads] + [totals])
    dist.all_reduce(flat)
    offset = 0
    for param, grad in zip(params, grads, strict=True):
        param.grad = flat[offset:offset + grad.numel()].view_as(param).to(param.dtype)
        offset += grad.numel()
    return flat[offset:]


def reshard(module: torch.nn.Module) -> None:
    """Free every FSDP unit's gathered parameters (local: no collective); a no-op for a replicated module."""
    for unit in module.modules():
        if isinstance(unit, FSDPModule):
            unit.reshard()
