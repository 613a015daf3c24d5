"""The model: a Hugging Face ``transformers`` causal LM with DACP attention plugged in from outside.

``build_model`` makes either a random-init model of a catalogue shape
(``scheduler_service.core.models.MODEL_CATALOGUE``: ``tiny`` for tests and the
demo, up to Qwen2.5-14B) or loads a Hugging Face checkpoint (config +
safetensors): a local folder, or a Hub id (``ORG/NAME[@REVISION]``) whose
snapshot ``hub.py`` finds in the Hugging Face cache, or downloads into it
(``model_folder``). The planner's view of a model (``model_shape``) and its
config need only its ``config.json``, so a Hub id's weights are not downloaded
for them. Catalogue shapes become a ``Qwen2ForCausalLM``
(Qwen2 hard-wires Q/K/V biases); a shape without attention bias becomes a
``LlamaForCausalLM``, the same architecture minus the biases.

The model knows nothing about DP or CP. DACP attention is registered in
transformers' attention registry under ``"dacp"``, and ``model_inputs`` gives it
one packed micro-batch through the forward's keyword arguments:

    model(**model_inputs(pack))  # input_ids, position_ids, use_cache=False, the local segments, dacp

Causality comes from the packing (``cu_seqlens``, zigzag prefixes), so no mask
function is registered beside it: transformers then builds no mask and does not
look for packed sequences in ``position_ids`` (which costs a host sync per
forward), and a dense [T, T] mask is what DACP exists to avoid. The local
segments travel as tensors, so that a compiled block traces the local kernel
with them as inputs, every length dynamic: ``dacp_cu_seqlens`` (their
boundaries) and ``dacp_max_seqlen`` (an empty tensor whose first dimension is
the longest one: a Python int would be a constant a compiled graph specialises
on, and recompiles at the next length). The rest of the micro-batch (``dacp``,
an ``attention.DacpAttention``) is read only where it has collectives, which run
eagerly.

Shape legend: T tokens of the packed row, H query heads, D head dim.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import (
    AttentionInterface,
    AutoConfig,
    AutoModelForCausalLM,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
)

from scheduler_service.core.models import MODEL_CATALOGUE, ModelShape
from trainer_client.dacp.attention import DacpAttention, dacp_attention_with_collectives
from trainer_client.dacp.kernels import AttentionBackend, resolve_kernel
from trainer_client.dacp.packing import PackedMicroBatch
from trainer_client.hub import HubError, RepoKind, fetch, hub_ref

__all__ = ["DACP_ATTENTION", "build_empty_model", "build_model", "check_attention_settings", "config_shape",
           "model_config", "model_folder", "model_inputs", "model_shape", "register_dacp_attention"]

DACP_ATTENTION = "dacp"
MAX_POSITION_EMBEDDINGS = 1 << 20  # RoPE is computed from position ids on the fly; this only bounds them


def dacp_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: q/k/v ``[1, heads, T, D]`` → output ``[1, T, heads, D]``. Runs in
    every layer of every micro-batch: views only on the way in (a ``squeeze`` is a view forward and backward, where
    ``query[0]`` copies its gradient), the kernel resolved once per micro-batch (``model_inputs``), the model's
    settings checked once (``check_attention_settings``)."""
    dacp: DacpAttention | None = kwargs.get("dacp")
    if dacp is None:
        raise ValueError("DACP attention needs its micro-batch: call the model with **model_inputs(pack) "
                         "(trainer_client.models.model.model_inputs)")
    q_THD, k_TGD, v_TGD = (tensor.squeeze(0).transpose(0, 1) for tensor in (query, key, value))
    device_type = query.device.type
    if torch.is_autocast_enabled(device_type):
        # RoPE multiplies by float32 cos/sin, which promotes q/k back to float32 under autocast; the varlen
        # kernels (flash-attn, torch varlen) take the autocast dtype only.
        dtype = torch.get_autocast_dtype(device_type)
        q_THD, k_TGD, v_TGD = q_THD.to(dtype), k_TGD.to(dtype), v_TGD.to(dtype)
    kernel = dacp.kernel or resolve_kernel(AttentionBackend.AUTO, device=query.device, dtype=q_THD.dtype)
    if dacp.has_collectives:
        out_THD = dacp_attention_with_collectives(q_THD, k_TGD, v_TGD, dacp.metadata, softmax_scale=scaling,
                                                  kernel=kernel)
    else:
        cu_seqlens, max_seqlen = kwargs["dacp_cu_seqlens"], kwargs["dacp_max_seqlen"].shape[0]
        out_THD = kernel(q_THD, k_TGD, v_TGD, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, scaling)
    return out_THD.unsqueeze(0), None


def check_attention_settings(config: PretrainedConfig) -> None:
    """Raise ``ValueError`` for what DACP attention does not implement, once per model rather than in every layer:
    attention dropout and sliding-window layers."""
    if getattr(config, "attention_dropout", 0.0):
        raise ValueError("DACP attention does not implement attention dropout; set attention_dropout=0")
    if getattr(config, "use_sliding_window", False) or "sliding_attention" in (getattr(config, "layer_types", None)
                                                                                or ()):
        raise ValueError("DACP attention does not implement sliding-window layers")


def register_dacp_attention() -> None:
    """Make ``attn_implementation="dacp"`` available (idempotent). No mask function is registered with it: the
    packing is the mask (module docstring)."""
    AttentionInterface.register(DACP_ATTENTION, dacp_attention_forward)


def model_inputs(
    pack: PackedMicroBatch, attention_backend: str | AttentionBackend = AttentionBackend.AUTO,
    compute_dtype: torch.dtype | None = None,
) -> dict[str, Any]:
    """The keyword arguments of a transformers model (or its decoder) for one packed micro-batch.

    One packed row is a batch of one; the positions restart per local sequence and are global in shards, which
    RoPE needs. The cache stays off: training never uses it, and packed rows are not one sequence.
    ``compute_dtype``: what the model computes in, for the kernel to be chosen once here (the trainer knows it);
    without it, each layer chooses from its query.
    """
    metadata = pack.metadata
    device = pack.input_ids_T.device
    kernel = (None if compute_dtype is None
              else resolve_kernel(attention_backend, device=device, dtype=compute_dtype))
    return {"input_ids": pack.input_ids_T.unsqueeze(0), "position_ids": pack.position_ids_T.unsqueeze(0),
            "use_cache": False, "dacp_cu_seqlens": metadata.cu_seqlens_local,
            "dacp_max_seqlen": torch.empty((metadata.max_seqlen_local, 0), device=device),
            "dacp": DacpAttention(metadata, kernel)}


def _config_from_shape(shape: ModelShape) -> PretrainedConfig:
    common: dict[str, Any] = dict(
        hidden_size=shape.hidden_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.head_dim,
        intermediate_size=shape.intermediate_size,
        vocab_size=shape.vocab_size,
        tie_word_embeddings=shape.tie_word_embeddings,
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        attention_dropout=0.0,
        pad_token_id=0,
    )
    if shape.attention_bias:
        return Qwen2Config(use_sliding_window=False, **common)
    return LlamaConfig(attention_bias=False, mlp_bias=False, **common)


def model_folder(model: str, *, weights: bool = True) -> Path | None:
    """``model``'s Hugging Face folder: a local folder, or a Hub id's snapshot in the Hugging Face cache (fetched
    once per process, ``hub.py``), with its weights, or without ``weights`` its ``config.json`` alone (enough for
    its config, shape and identity); None for a catalogue name."""
    path = Path(model)
    if not path.is_dir():
        ref = hub_ref(model, RepoKind.MODEL if weights else RepoKind.MODEL_CONFIG)
        if ref is None:
            return None
        try:
            return fetch(ref).path
        except HubError as error:
            raise ValueError(f"--model {model}: {error}") from None
    if not (path / "config.json").is_file():
        raise ValueError(f"--model {model!r} is a directory without config.json; expected a HF checkpoint")
    return path


def model_config(model: str) -> PretrainedConfig:
    """The transformers config of a catalogue shape or of a checkpoint (its config.json alone)."""
    path = model_folder(model, weights=False)
    if path is not None:
        config: PretrainedConfig = AutoConfig.from_pretrained(path, local_files_only=True)
        return config
    return _config_from_shape(_catalogue_shape(model))


def build_model(
    model: str,
    *,
    attn_implementation: str = DACP_ATTENTION,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | None = None,
) -> PreTrainedModel:
    """A catalogue shape with seeded random init, or a HF checkpoint (a local folder or a Hub id), whole in this
    process.

    The same ``(model, seed)`` gives bit-identical weights in every process, and leaves the random stream in the
    same state (LoRA draws its adapters from it next). The trainer builds it on rank 0 only, as the source of every
    rank's shards (``loading.py``).
    """
    register_dacp_attention()
    torch.manual_seed(seed)  # what draws next (LoRA's adapters) is seeded too
    path = model_folder(model)
    if path is not None:
        built: PreTrainedModel = AutoModelForCausalLM.from_pretrained(
            path, attn_implementation=attn_implementation, dtype=dtype, local_files_only=True
        )
    else:
        built = AutoModelForCausalLM.from_config(_config_from_shape(_catalogue_shape(model)),
                                                 attn_implementation=attn_implementation, dtype=dtype)
    if attn_implementation == DACP_ATTENTION:
        check_attention_settings(built.config)
    return built if device is None else _to(built, device)


def build_empty_model(model: str, *, attn_implementation: str = DACP_ATTENTION) -> PreTrainedModel:
    """``model``'s structure on the meta device: every parameter's shape and dtype (float32), no memory, no
    weights. Sharded and given its weights afterwards (``loading.py``)."""
    register_dacp_attention()
    config = model_config(model)
    if attn_implementation == DACP_ATTENTION:
        check_attention_settings(config)
    with torch.device("meta"):
        empty: PreTrainedModel = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation,
                                                                  dtype=torch.float32)
    return empty


def _catalogue_shape(model: str) -> ModelShape:
    shape = MODEL_CATALOGUE.get(model.lower())
    if shape is None:
        raise ValueError(f"--model {model!r} is neither a built-in model ({', '.join(MODEL_CATALOGUE)}), nor a "
                         "local checkpoint directory, nor a Hugging Face Hub id (ORG/NAME[@REVISION])")
    return shape


def _to(model: PreTrainedModel, device: torch.device) -> PreTrainedModel:
    torch.nn.Module.to(model, device)  # in place; PreTrainedModel.to's typing wraps the signature
    return model


def model_shape(model: str) -> ModelShape:
    """The planner's view of ``model``: a catalogue entry, or the shape read from a checkpoint's config (named by
    its folder, or by its Hub id; a Hub id's config.json alone is fetched)."""
    path = model_folder(model, weights=False)
    if path is None:
        return _catalogue_shape(model)
    return config_shape(model_config(model), name=path.name if Path(model).is_dir() else model)


def config_shape(config: PretrainedConfig, *, name: str) -> ModelShape:
    """The planner's view of a transformers config: what the performance model costs a sequence with (a checkpoint's
    ``model_shape``, or the model a Trainer was given, ``trainer_client.hf``)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return ModelShape(
        name=name,
        hidden_size=config.hidden_size,
        num_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        head_dim=head_dim,
        intermediate_size=config.intermediate_size,
        vocab_size=config.vocab_size,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        attention_bias=bool(getattr(config, "attention_bias", config.model_type == "qwen2")),
    )
