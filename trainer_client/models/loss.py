"""The training loss of one packed micro-batch, with the LM head and cross-entropy chunked over tokens.

``CausalLMLoss`` wraps a causal LM (a transformers ``*ForCausalLM``): the decoder gives hidden states, and
``chunked_cross_entropy`` applies the LM head and the token cross-entropy ``chunk_tokens`` tokens at a time,
each chunk under activation checkpointing. The fp32 logits of a whole 32K-token row over a 152K vocabulary
(~20 GB) are never held: at most one chunk's (``chunk_tokens × V`` fp32, and its gradient) at a time, forward
and backward; the price is one extra LM-head matmul per chunk in backward. It returns the *sum* of token losses;
``run_micro_batch`` divides it by the global batch's loss tokens before backward, so that the gradients of a
step's micro-batches, whatever their number on each rank, add up to those of the global batch's mean loss.

The wrapper is the trainer's root module: ``parallelize.py`` shards it (the embeddings, final norm and tied LM
head are the root FSDP unit), so the LM head's weight is unsharded while ``forward`` runs.

Shape legend: T tokens of the packed row, D hidden size, V vocabulary.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel

from trainer_client.dacp.kernels import AttentionBackend
from trainer_client.dacp.packing import PackedMicroBatch
from trainer_client.data import IGNORE_INDEX
from trainer_client.models.model import model_inputs

__all__ = ["DEFAULT_CHUNK_TOKENS", "CausalLMLoss", "chunked_cross_entropy", "micro_batch_loss", "run_micro_batch"]

DEFAULT_CHUNK_TOKENS = 4096


def _chunk_loss(hidden_TD: torch.Tensor, weight_VD: torch.Tensor, targets_T: torch.Tensor) -> torch.Tensor:
    logits_TV = F.linear(hidden_TD, weight_VD).float()
    return F.cross_entropy(logits_TV, targets_T, ignore_index=IGNORE_INDEX, reduction="sum")


def chunked_cross_entropy(
    hidden_TD: torch.Tensor, weight_VD: torch.Tensor, targets_T: torch.Tensor, *, chunk_tokens: int
) -> torch.Tensor:
    """Summed cross-entropy of ``hidden_TD @ weight_VDᵀ`` against ``targets_T``, ``chunk_tokens`` rows at a time."""
    if hidden_TD.shape[0] == 0:
        raise ValueError("chunked_cross_entropy needs at least one token")
    total = None
    for start in range(0, hidden_TD.shape[0], chunk_tokens):
        rows = slice(start, start + chunk_tokens)
        chunk = checkpoint(_chunk_loss, hidden_TD[rows], weight_VD, targets_T[rows], use_reentrant=False)
        total = chunk if total is None else total + chunk
    assert total is not None
    return total


class CausalLMLoss(torch.nn.Module):
    """A causal LM whose forward takes a packed micro-batch and returns its summed token loss."""

    def __init__(self, lm: PreTrainedModel, *, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                 compute_dtype: torch.dtype | None = None) -> None:
        """``compute_dtype``: what the layers compute in (the sharding's parameter dtype, or autocast's), for the
        attention kernel to be chosen once per micro-batch (``model.model_inputs``)."""
        super().__init__()
        if chunk_tokens < 1:
            raise ValueError(f"loss chunk must hold at least one token, got {chunk_tokens}")
        head = lm.get_output_embeddings()
        if getattr(head, "bias", None) is not None:
            raise ValueError("the chunked loss supports LM heads without bias (Qwen2, Llama)")
        self.lm = lm
        self.chunk_tokens = chunk_tokens
        self.compute_dtype = compute_dtype

    def decoder_layers(self) -> list[torch.nn.Module]:
        """The transformer blocks, in order: the units of sharding and activation checkpointing."""
        layers: torch.nn.ModuleList = self.lm.get_decoder().get_submodule("layers")
        return list(layers)

    def forward(self, pack: PackedMicroBatch, attention_backend: str) -> torch.Tensor:
        inputs = model_inputs(pack, attention_backend, compute_dtype=self.compute_dtype)
        hidden_1TD = self.lm.get_decoder()(**inputs).last_hidden_state
        weight_VD = self.lm.get_output_embeddings().weight
        return chunked_cross_entropy(hidden_1TD[0], weight_VD, pack.targets_T, chunk_tokens=self.chunk_tokens)


def micro_batch_loss(
    module: CausalLMLoss, pack: PackedMicroBatch, *, autocast_dtype: torch.dtype | None = None,
    attention_backend: str = AttentionBackend.AUTO.value,
) -> torch.Tensor:
    """The forward of one packed micro-batch: its summed token loss (autocast when the run computes in it)."""
    device_type = pack.input_ids_T.device.type
    autocast = (torch.autocast(device_type, dtype=autocast_dtype) if autocast_dtype is not None
                else nullcontext())
    with autocast:
        token_loss_sum: torch.Tensor = module(pack, attention_backend)
    return token_loss_sum


def run_micro_batch(
    module: CausalLMLoss, pack: PackedMicroBatch, *, num_loss_tokens: int,
    autocast_dtype: torch.dtype | None = None, attention_backend: str = AttentionBackend.AUTO.value,
) -> torch.Tensor:
    """Forward and backward of one packed micro-batch (gradients accumulate); returns its summed token loss.

    The loss is divided by the global batch's ``num_loss_tokens`` before backward (appendix A). The profiler and
    the accuracy benchmark time exactly this.
    """
    token_loss_sum = micro_batch_loss(module, pack, autocast_dtype=autocast_dtype,
                                      attention_backend=attention_backend)
    (token_loss_sum / max(num_loss_tokens, 1)).backward()
    return token_loss_sum.detach()
