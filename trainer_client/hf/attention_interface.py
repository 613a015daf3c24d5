"""The Trainer's model with DACP attention: checked replaceable at start, switched while Skrull runs it.

DACP attention reaches a transformers model through its attention interface: ``register_dacp_attention`` makes
``attn_implementation="dacp"`` available, and each micro-batch's metadata travels in the forward's keyword
arguments down to every attention layer (``model.model_inputs``). A model takes part only if its attention layers
call the interface (transformers finds that in the model's source) and pass those keyword arguments on
(``_supports_attention_backend``): Llama, Qwen2 and most decoders since transformers 5 do, older designs such as
Bloom do not, and are refused by name at start (``check_replaceable``). DACP attention also refuses attention dropout
and sliding-window layers (``model.check_attention_settings``).

``dacp_attention`` switches the model to DACP attention while the Trainer trains or evaluates through Skrull and
restores the implementation it had afterwards, so that the same model object generates (``model.generate``) with
its own attention outside them; a model's saved config names no attention implementation, so a checkpoint loads
with any.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn
from transformers import PreTrainedModel
from transformers.trainer_utils import unwrap_peft_model

from trainer_client.models.model import DACP_ATTENTION, check_attention_settings, register_dacp_attention

__all__ = ["check_replaceable", "dacp_attention"]


def check_replaceable(model: nn.Module | None) -> PreTrainedModel:
    """The transformers model inside ``model`` (a PEFT model's base), once it is known that DACP attention can
    replace its attention; else ``ValueError`` naming the model and why."""
    base = unwrap_peft_model(model)
    if not isinstance(base, PreTrainedModel):
        raise ValueError(f"model {type(base).__name__} is not a transformers PreTrainedModel: Skrull replaces the "
                         "attention of a transformers causal LM through its attention interface")
    if not (base._supports_attention_backend and type(base)._can_set_attn_implementation()):
        raise ValueError(f"model {type(base).__name__}: its attention cannot be replaced by DACP attention (it does "
                         "not call transformers' attention interface with the forward's keyword arguments); "
                         "Skrull needs a model that does, such as Llama or Qwen2")
    check_attention_settings(base.config)
    return base


@contextmanager
def dacp_attention(model: PreTrainedModel) -> Iterator[None]:
    """``model`` computes with DACP attention inside, with the implementation it had before afterwards."""
    register_dacp_attention()
    before = model.config._attn_implementation
    model.set_attn_implementation(DACP_ATTENTION)
    try:
        yield
    finally:
        model.set_attn_implementation(before)
