"""Static memory of a training layout: what a sharding mode keeps per parameter, and what LoRA changes.

The profile measures activations; the bytes of weights, gradients and AdamW moments follow from how the trainer
lays them out (``trainer_client.models.parallelize``), so they are computed here, once, for the trainer (its
derived BucketSize) and for the layout advisor (every mode it prices). With w = compute dtype bytes, 4 = fp32:

* a trained parameter: ``none`` 4 + 4 + 8 + 4 replicated (fp32 weights, gradients, AdamW moments, the flat
  all-reduce buffer); ``zero2`` unsharded compute weights (w) and fp32 gradients (4, FSDP accumulates them in
  the reduce dtype across micro-batches) replicated, fp32 weights, gradients and moments (16) sharded;
  ``zero3`` all 16 sharded.
* a frozen parameter (LoRA's base model) has no gradient and no optimizer state: ``none`` 4 replicated;
  ``zero2`` w replicated (the gathered weights) and 4 sharded; ``zero3`` 4 sharded.

LoRA (Hu et al., 2021) adds ``rank × (in + out)`` trained parameters to each targeted projection of each layer,
so with the base frozen the static bytes shrink to a few per parameter and the BucketSize grows (the paper's
appendix names PEFT as the way to a larger BucketSize).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from scheduler_service.core.errors import InvalidRequestError
from scheduler_service.core.models import ModelShape
from scheduler_service.core.profile import Profile

__all__ = [
    "LORA_TARGETS",
    "ActivationCheckpointing",
    "LoraShape",
    "Sharding",
    "StaticBytes",
    "static_bytes_per_parameter",
    "training_profile",
]

FP32_BYTES = 4
ADAMW_MOMENTS = 2  # exp_avg and exp_avg_sq, fp32, one per parameter each


class Sharding(StrEnum):
    """How parameters, gradients and optimizer state lie over the DP × CP ranks
    (``trainer_client.models.parallelize``)."""

    ZERO2 = "zero2"
    ZERO3 = "zero3"
    NONE = "none"


class ActivationCheckpointing(StrEnum):
    NONE = "none"
    SELECTIVE = "selective"
    FULL = "full"


@dataclass(frozen=True, kw_only=True, slots=True)
class StaticBytes:
    """Bytes per parameter every rank keeps whole (``replicated``) and split over all ranks (``sharded``)."""

    replicated: float
    sharded: float

    def per_rank(self, num_parameters: int, num_state_shards: int) -> float:
        """The bytes one rank keeps of ``num_parameters`` parameters whose sharded part is split over
        ``num_state_shards`` ranks."""
        return num_parameters * (self.replicated + self.sharded / num_state_shards)


def static_bytes_per_parameter(sharding: Sharding, *, compute_bytes: int, trained: bool = True) -> StaticBytes:
    """What a sharding mode keeps per parameter at the peak of a step (the last micro-batch's backward)."""
    if not trained:
        if sharding is Sharding.NONE:
            return StaticBytes(replicated=FP32_BYTES, sharded=0.0)
        if sharding is Sharding.ZERO2:
            return StaticBytes(replicated=compute_bytes, sharded=FP32_BYTES)
        return StaticBytes(replicated=0.0, sharded=FP32_BYTES)
    master = FP32_BYTES * (2 + ADAMW_MOMENTS)  # fp32 weights, fp32 gradients, AdamW moments
    if sharding is Sharding.NONE:
        return StaticBytes(replicated=master + FP32_BYTES, sharded=0.0)  # + the flat all-reduce buffer
    if sharding is Sharding.ZERO2:
        return StaticBytes(replicated=compute_bytes + FP32_BYTES, sharded=master)  # unsharded weights, fp32 grads
    return StaticBytes(replicated=0.0, sharded=master)


# The linear projections of a Llama/Qwen2 decoder layer, as (input width, output width) of a ModelShape.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _projection_widths(model: ModelShape) -> dict[str, tuple[int, int]]:
    h, q_width, kv_width, mlp = (model.hidden_size, model.num_attention_heads * model.head_dim,
                                 model.kv_hidden_size, model.intermediate_size)
    return {"q_proj": (h, q_width), "k_proj": (h, kv_width), "v_proj": (h, kv_width), "o_proj": (q_width, h),
            "gate_proj": (h, mlp), "up_proj": (h, mlp), "down_proj": (mlp, h)}


@dataclass(frozen=True, kw_only=True, slots=True)
class LoraShape:
    """Low-rank adapters of ``rank`` on the projections named in ``targets`` of every decoder layer."""

    rank: int
    targets: tuple[str, ...] = LORA_TARGETS

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise InvalidRequestError(f"lora rank must be positive, got {self.rank}", field="lora.rank")
        unknown = sorted(set(self.targets) - set(LORA_TARGETS))
        if not self.targets or unknown:
            raise InvalidRequestError(f"lora targets {unknown or '(none)'} name no projection of the model; "
                                      f"choose from {', '.join(LORA_TARGETS)}", field="lora.targets")

    def num_parameters(self, model: ModelShape) -> int:
        """Trained adapter parameters: ``rank × (in + out)`` per targeted projection per layer."""
        widths = _projection_widths(model)
        return model.num_layers * sum(self.rank * sum(widths[target]) for target in self.targets)


def _combined(parts: Sequence[tuple[int, StaticBytes]], per: int) -> StaticBytes:
    """Bytes of several groups of parameters, expressed per one of ``per`` parameters."""
    return StaticBytes(replicated=sum(count * part.replicated for count, part in parts) / per,
                       sharded=sum(count * part.sharded for count, part in parts) / per)


def training_profile(profile: Profile, model: ModelShape, *, sharding: Sharding, compute_bytes: int,
                     activation_checkpointing: ActivationCheckpointing, lora: LoraShape | None = None) -> Profile:
    """``profile`` with the static bytes of this layout, per base-model parameter, so that the BucketSize derived
    from it is the one the trainer's memory allows. A measured profile records the activation checkpointing its
    activations were measured with; it must be the layout's."""
    measured_with = profile.raw.get("memory", {}).get("activation_checkpointing")
    if measured_with is not None and measured_with != activation_checkpointing:
        raise InvalidRequestError(
            f"profile {profile.name} measured activations with activation checkpointing {measured_with}, this "
            f"layout uses {activation_checkpointing}: measure a profile with python -m trainer_client.profile "
            f"--activation-checkpointing {activation_checkpointing}, or give the bucket size",
            field="activation_checkpointing")
    base = model.num_parameters
    if lora is None:
        static = static_bytes_per_parameter(sharding, compute_bytes=compute_bytes)
    else:
        static = _combined([(base, static_bytes_per_parameter(sharding, compute_bytes=compute_bytes, trained=False)),
                            (lora.num_parameters(model), static_bytes_per_parameter(sharding,
                                                                                    compute_bytes=compute_bytes))],
                           per=base)
    memory = dataclasses.replace(profile.memory, replicated_bytes_per_parameter=static.replicated,
                                 sharded_bytes_per_parameter=static.sharded)
    return dataclasses.replace(profile, memory=memory)
