"""The trained module on every rank without a whole copy of the model per rank: built empty, sharded, then filled
from rank 0.

``build_training_module`` runs on every rank, in this order (torchtitan's meta-device initialisation):

1. every rank builds the model's structure on the meta device (``model.build_empty_model``: shapes, no
   memory);
2. rank 0 alone makes the weights in host memory, exactly as one process always made them
   (``model.build_model``: the checkpoint read once through transformers, or the catalogue shape's seeded random
   init; then the adapters' seeded init), after checking, for a checkpoint (a local folder, or the snapshot of a
   Hub id that rank 0 fetched before any rank built anything, ``hub.py``), the shape of every tensor its
   safetensors files hold against that structure (their headers only); every rank receives rank 0's verdict over
   the gloo group, so a mismatch, or any failure to build, stops every rank before any allocates the model;
3. the LoRA adapters are injected (``lora.py``), the model is wrapped in the trainer's loss (``loss.py``),
   activation checkpointing and FSDP2 are applied to the empty module (``parallelize.py``), and only then each
   rank allocates what it keeps (``to_empty``): its shards, or under ``--sharding none`` the whole replica;
4. ``set_model_state_dict(..., broadcast_from_rank0=True)`` sends rank 0's weights one tensor at a time, each
   rank keeping its shard. The buffers no state dict holds (RoPE's ``inv_freq``) are broadcast beside them.

So every rank starts with rank 0's weights: the same as when every rank built them, bit for bit. Host memory is
one whole model on rank 0 while it loads, and one tensor in flight on the others, whatever the world size; device
memory is each rank's shards and one tensor in flight. (Before, every rank built the whole fp32 model on its GPU
and read the whole checkpoint: about 470 GB of host memory for a 14B model on 8 ranks.) The other ranks wait for
rank 0's load within the collective timeout (``--collective-timeout``, 600 s by default): raise it for a model
whose checkpoint takes longer to read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from transformers import PreTrainedModel

from trainer_client.config_choices import FsdpUnits
from trainer_client.distributed import ParallelContext
from trainer_client.models.lora import LoraSettings, apply_lora
from trainer_client.models.loss import DEFAULT_CHUNK_TOKENS, CausalLMLoss
from trainer_client.models.model import build_empty_model, build_model, model_folder
from trainer_client.models.parallelize import ActivationCheckpointing, Sharding, parallelize

__all__ = ["CheckpointMismatch", "ModelLayout", "build_training_module", "check_checkpoint", "check_weights_present",
           "checkpoint_shapes"]

_SINGLE_FILE = "model.safetensors"
_INDEX_FILE = "model.safetensors.index.json"
# What transformers' from_pretrained loads weights from; a folder with none of them has only a config.
_WEIGHT_FILES = (_SINGLE_FILE, _INDEX_FILE, "pytorch_model.bin", "pytorch_model.bin.index.json")


class CheckpointMismatch(ValueError):
    """A checkpoint's tensors are not those of the model its config.json describes."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelLayout:
    """How the trainer lays the model over its ranks (``parallelize.py``)."""

    sharding: Sharding
    activation_checkpointing: ActivationCheckpointing
    param_dtype: torch.dtype  # what the model computes in; the master weights stay float32
    loss_chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    compiled: bool = False  # each decoder layer under torch.compile (--compile)
    fsdp_units: FsdpUnits = FsdpUnits.LAYER  # what FSDP2 shards as one unit (parallelize.py)
    cuda_graphs: bool = False  # each decoder layer captured as CUDA graphs per token bucket (--cuda-graphs)

    @classmethod
    def on(cls, device: torch.device, *, dtype: str | None, sharding: Sharding,
           activation_checkpointing: ActivationCheckpointing,
           loss_chunk_tokens: int = DEFAULT_CHUNK_TOKENS, compiled: bool = False) -> ModelLayout:
        """The layout on ``device``: computing in ``dtype`` (float32 or bfloat16), by default bfloat16 on CUDA and
        float32 on CPU."""
        dtype = dtype or ("bfloat16" if device.type == "cuda" else "float32")
        return cls(sharding=sharding, activation_checkpointing=activation_checkpointing,
                   param_dtype=torch.bfloat16 if dtype == "bfloat16" else torch.float32,
                   loss_chunk_tokens=loss_chunk_tokens, compiled=compiled)

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """What the forward runs under autocast in: FSDP computes in ``param_dtype`` itself (its
        ``MixedPrecisionPolicy``), so only replicated bfloat16 training needs autocast."""
        return self.param_dtype if self.sharding is Sharding.NONE and self.param_dtype != torch.float32 else None


def build_training_module(
    model: str, *, parallel: ParallelContext, layout: ModelLayout, seed: int, lora: LoraSettings | None = None,
) -> CausalLMLoss:
    """The trainer's module for ``model`` (a catalogue name, a local checkpoint folder or a Hub id), sharded over
    ``parallel.shard_mesh`` and holding rank 0's weights on every rank. Every rank calls it."""
    lm = build_empty_model(model)
    reference = _reference_on_rank_0(model, lm, parallel=parallel, seed=seed, lora=lora)
    if lora is not None:
        apply_lora(lm, lora)  # in place, before sharding: frozen weights and adapters in FSDP's units
    module = parallelize(CausalLMLoss(lm, chunk_tokens=layout.loss_chunk_tokens, compute_dtype=layout.param_dtype),
                         parallel.shard_mesh, sharding=layout.sharding,
                         activation_checkpointing=layout.activation_checkpointing, param_dtype=layout.param_dtype,
                         compile=layout.compiled, fsdp_units=layout.fsdp_units, cuda_graphs=layout.cuda_graphs)
    module.to_empty(device=parallel.device)
    lm.tie_weights()  # to_empty allocates each module's parameters apart: an unsharded tied LM head comes untied
    _fill_from_rank_0(lm, reference)
    del reference
    lm.train()
    return module


def _reference_on_rank_0(model: str, empty: PreTrainedModel, *, parallel: ParallelContext, seed: int,
                         lora: LoraSettings | None) -> PreTrainedModel | None:
    """On rank 0, the whole model in host memory, as one process builds it (a checkpoint's shapes checked
    first): the weights every rank gets. Every rank receives rank 0's verdict over the gloo group before any
    allocates its shards or joins a collective of the training backend, so a refusal or a failure stops every
    rank at once, and the others wait out a long load (a large checkpoint, a slow disk) on gloo, within the
    collective timeout, rather than inside NCCL."""
    reference = None
    verdict: list[tuple[bool, str] | None] = [None]  # (a user error, the message), or None: built
    if parallel.is_main:
        try:
            directory = model_folder(model)
            if directory is not None:
                check_checkpoint(directory, empty)
            reference = build_model(model, seed=seed)
            if lora is not None:
                apply_lora(reference, lora)  # seeded by build_model: the adapters follow the weights in the stream
        except CheckpointMismatch as error:
            verdict[0] = (True, str(error))
        except Exception as error:  # every rank must hear of it: the others are waiting for these weights
            verdict[0] = (False, f"rank 0 could not build {model}: {type(error).__name__}: {error}")
    dist.broadcast_object_list(verdict, src=0, group=parallel.object_group)
    if verdict[0] is not None:
        user_error, message = verdict[0]
        raise CheckpointMismatch(message) if user_error else RuntimeError(message)
    return reference


@torch.no_grad()
def _fill_from_rank_0(lm: PreTrainedModel, reference: PreTrainedModel | None) -> None:
    """Give ``lm`` (allocated, uninitialised, perhaps sharded) ``reference``'s weights and buffers; ``reference``
    exists on global rank 0 only. Every rank calls it."""
    full_state = reference.state_dict() if reference is not None else {}
    set_model_state_dict(lm, full_state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    reference_buffers = dict(reference.named_buffers()) if reference is not None else {}
    for name, buffer in lm.named_buffers():  # the same names in the same order on every rank
        if reference is not None:
            buffer.copy_(reference_buffers[name])
        dist.broadcast(buffer, src=0)


# ---------------------------------------------------------------------------------------------------- checks


def check_weights_present(model: str) -> None:
    """Raise ``ValueError`` naming ``--model`` and what its folder holds when it is a folder without weights (its
    config alone): checked when the run starts, before its data is read, rather than when rank 0 loads the model."""
    directory = model_folder(model)
    if directory is None or any((directory / name).is_file() for name in _WEIGHT_FILES):
        return
    held = sorted(path.name for path in directory.iterdir())
    raise ValueError(f"--model {model}: the folder {directory} holds no weights, only {', '.join(held) or 'nothing'}; "
                     f"a model folder holds one of {', '.join(_WEIGHT_FILES)} (save_pretrained writes them), or give a "
                     "built-in model to train from a random initialisation")


def checkpoint_shapes(directory: Path) -> dict[str, tuple[int, ...]] | None:
    """Every tensor a Hugging Face checkpoint folder's safetensors files hold, by name, with its shape: from their
    headers alone, no tensor read. None for a folder without safetensors (``pytorch_model.bin``)."""
    index = directory / _INDEX_FILE
    if index.is_file():
        files = sorted({directory / name for name in json.loads(index.read_text())["weight_map"].values()})
    elif (directory / _SINGLE_FILE).is_file():
        files = [directory / _SINGLE_FILE]
    else:
        return None
    shapes = {}
    for file in files:
        with safe_open(file, framework="pt") as tensors:
            for name in tensors.keys():  # noqa: SIM118 (safe_open is no mapping)
                shapes[name] = tuple(tensors.get_slice(name).get_shape())
    return shapes


def check_checkpoint(directory: Path, empty: PreTrainedModel) -> None:
    """Raise ``CheckpointMismatch`` naming every tensor of the checkpoint whose shape is not the model's, and every
    weight of the model the checkpoint lacks (a tied LM head may be absent); ``empty`` is the model its config
    describes, on the meta device. A folder without safetensors is left to transformers' loader."""
    saved = checkpoint_shapes(directory)
    if saved is None:
        return
    expected = {name: tuple(tensor.shape) for name, tensor in empty.state_dict().items()}
    tied = ({name for name, _ in empty.named_parameters(remove_duplicate=False)}
            - {name for name, _ in empty.named_parameters()})
    problems = [f"{name}: the checkpoint holds {list(saved[name])}, the model needs {list(shape)}"
                for name, shape in expected.items() if name in saved and saved[name] != shape]
    missing = sorted(name for name in expected if name not in saved and name not in tied)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        problems.append(f"missing from the checkpoint: {shown}")
    if problems:
        raise CheckpointMismatch(f"checkpoint {directory} does not match the model its config.json describes "
                                 f"({type(empty).__name__}): " + "; ".join(problems))
