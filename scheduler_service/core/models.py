"""Model catalogue: the transformer shapes the performance model needs.

Shapes are copied from each model's published ``config.json`` (Hugging Face
model cards). ``tiny`` is the trainer's random-init test model; it lives here
so the trainer and the planner agree on it. Any other model is described inline
with the same fields (``ModelShape(...)`` or a JSON object on the wire).
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler_service.core.errors import InvalidRequestError, UnknownModelError

__all__ = ["MODEL_CATALOGUE", "SHAPE_LIMITS", "ModelShape", "resolve_model"]


# Far beyond any real model, small enough that eq. 13 stays finite in float64 (the wire contract has the same).
SHAPE_LIMITS = {
    "hidden_size": 1 << 18,
    "num_layers": 1 << 12,
    "num_attention_heads": 1 << 12,
    "num_key_value_heads": 1 << 12,
    "head_dim": 1 << 12,
    "intermediate_size": 1 << 20,
    "vocab_size": 1 << 23,
}


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelShape:
    """The architecture numbers of a decoder-only transformer (Llama/Qwen2 family)."""

    name: str
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False

    def __post_init__(self) -> None:
        for field_name, limit in SHAPE_LIMITS.items():
            value = getattr(self, field_name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= limit:
                raise InvalidRequestError(
                    f"model.{field_name} must be an integer between 1 and {limit}, got {value!r}",
                    field=f"model.{field_name}",
                )
        if self.num_attention_heads % self.num_key_value_heads:
            raise InvalidRequestError(
                f"model.num_attention_heads {self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}",
                field="model.num_key_value_heads",
            )

    @property
    def heads(self) -> tuple[int, int]:
        """(query heads, K/V heads): what a Ulysses or 2D collective splits over its ranks
        (``check.scheme_violation``)."""
        return self.num_attention_heads, self.num_key_value_heads

    @property
    def kv_hidden_size(self) -> int:
        """h_kv of eq. 13 and eq. 15: the width of K (or V) per token."""
        return self.num_key_value_heads * self.head_dim

    @property
    def num_parameters(self) -> int:
        """Parameter count of a Llama/Qwen2-style model (SwiGLU MLP, RMSNorm)."""
        h, q_width, kv_width = self.hidden_size, self.num_attention_heads * self.head_dim, self.kv_hidden_size
        attention = h * q_width + 2 * h * kv_width + q_width * h
        if self.attention_bias:
            attention += q_width + 2 * kv_width
        mlp = 3 * h * self.intermediate_size
        per_layer = attention + mlp + 2 * h
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embeddings + h


MODEL_CATALOGUE: dict[str, ModelShape] = {
    shape.name: shape
    for shape in (
        ModelShape(
            name="tiny",
            hidden_size=64,
            num_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=176,
            vocab_size=1024,
            tie_word_embeddings=True,
            attention_bias=True,
        ),
        ModelShape(
            name="small",
            hidden_size=256,
            num_layers=4,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=32,
            intermediate_size=704,
            vocab_size=4096,
            tie_word_embeddings=True,
            attention_bias=True,
        ),
        ModelShape(
            name="qwen2.5-0.5b",
            hidden_size=896,
            num_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            head_dim=64,
            intermediate_size=4864,
            vocab_size=151936,
            tie_word_embeddings=True,
            attention_bias=True,
        ),
        ModelShape(
            name="qwen2.5-1.5b",
            hidden_size=1536,
            num_layers=28,
            num_attention_heads=12,
            num_key_value_heads=2,
            head_dim=128,
            intermediate_size=8960,
            vocab_size=151936,
            tie_word_embeddings=True,
            attention_bias=True,
        ),
        ModelShape(
            name="qwen2.5-7b",
            hidden_size=3584,
            num_layers=28,
            num_attention_heads=28,
            num_key_value_heads=4,
            head_dim=128,
            intermediate_size=18944,
            vocab_size=152064,
            attention_bias=True,
        ),
        ModelShape(
            name="qwen2.5-14b",
            hidden_size=5120,
            num_layers=48,
            num_attention_heads=40,
            num_key_value_heads=8,
            head_dim=128,
            intermediate_size=13824,
            vocab_size=152064,
            attention_bias=True,
        ),
        ModelShape(
            name="llama-3-8b",
            hidden_size=4096,
            num_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            intermediate_size=14336,
            vocab_size=128256,
        ),
        # Without GQA (as many K/V heads as query heads): all-gather-KV moves as much as Ulysses from 2 ranks on, so
        # the choice of scheme matters most here (docs/concepts/schemes.md).
        ModelShape(
            name="llama-2-7b",
            hidden_size=4096,
            num_layers=32,
            num_attention_heads=32,
            num_key_value_heads=32,
            head_dim=128,
            intermediate_size=11008,
            vocab_size=32000,
        ),
    )
}


def resolve_model(model: str | ModelShape) -> ModelShape:
    """Look a model up by (case-insensitive) name, or pass an inline shape through."""
    if isinstance(model, ModelShape):
        return model
    shape = MODEL_CATALOGUE.get(model.lower())
    if shape is None:
        raise UnknownModelError(model, list(MODEL_CATALOGUE))
    return shape
