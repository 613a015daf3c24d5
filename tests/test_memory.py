"""The static memory model: bytes per parameter by sharding mode, LoRA's adapters, and the BucketSize they give."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from scheduler_service.core.errors import InvalidRequestError
from scheduler_service.core.memory import (
    LORA_TARGETS,
    ActivationCheckpointing,
    LoraShape,
    Sharding,
    static_bytes_per_parameter,
    training_profile,
)
from scheduler_service.core.models import resolve_model
from scheduler_service.core.perf_model import PerformanceModel
from scheduler_service.core.profile import resolve_profile


def _bucket_size(model: str, sharding: Sharding, lora: LoraShape | None, ranks: int = 8) -> int:
    shape = resolve_model(model)
    profile = training_profile(resolve_profile("h100-paper"), shape, sharding=sharding, compute_bytes=2,
                               activation_checkpointing=ActivationCheckpointing.NONE, lora=lora)
    return PerformanceModel(model=shape, profile=profile).bucket_size(num_state_shards=ranks)


@pytest.mark.parametrize("sharding", list(Sharding))
def test_a_frozen_parameter_keeps_no_gradient_and_no_optimizer_state(sharding: Sharding) -> None:
    trained = static_bytes_per_parameter(sharding, compute_bytes=2)
    frozen = static_bytes_per_parameter(sharding, compute_bytes=2, trained=False)
    assert frozen.replicated + frozen.sharded <= 6
    assert trained.replicated + trained.sharded - (frozen.replicated + frozen.sharded) >= 12  # grads + moments


def test_sharded_modes_split_the_optimizer_state_over_the_ranks() -> None:
    assert static_bytes_per_parameter(Sharding.NONE, compute_bytes=2).sharded == 0
    assert static_bytes_per_parameter(Sharding.ZERO3, compute_bytes=2).replicated == 0
    zero2 = static_bytes_per_parameter(Sharding.ZERO2, compute_bytes=2)
    assert (zero2.replicated, zero2.sharded) == (6, 16)


def test_lora_adapters_count_rank_times_in_plus_out_per_targeted_projection() -> None:
    shape = resolve_model("qwen2.5-7b")
    q_only = LoraShape(rank=8, targets=("q_proj",))
    assert q_only.num_parameters(shape) == shape.num_layers * 8 * (3584 + 28 * 128)
    everything = LoraShape(rank=8)
    assert everything.num_parameters(shape) < shape.num_parameters // 100


@pytest.mark.parametrize("model", ["qwen2.5-7b", "llama-3-8b"])
@pytest.mark.parametrize("sharding", list(Sharding))
def test_lora_grows_the_bucket_size_of_every_sharding_mode(model: str, sharding: Sharding) -> None:
    full = _bucket_size(model, sharding, lora=None)  # 0 under none: 20 bytes per parameter fill an H100
    lora = _bucket_size(model, sharding, lora=LoraShape(rank=16))
    assert lora > full and lora > 5_000


def test_a_larger_lora_rank_leaves_a_smaller_bucket() -> None:
    assert _bucket_size("qwen2.5-7b", Sharding.ZERO2, LoraShape(rank=8)) > _bucket_size(
        "qwen2.5-7b", Sharding.ZERO2, LoraShape(rank=256))


@pytest.mark.parametrize(("lora", "field"), [
    (lambda: LoraShape(rank=0), "lora.rank"),
    (lambda: LoraShape(rank=8, targets=("qkv_proj",)), "lora.targets"),
    (lambda: LoraShape(rank=8, targets=()), "lora.targets"),
])
def test_bad_lora_shapes_name_the_field(lora: object, field: str) -> None:
    with pytest.raises(InvalidRequestError) as raised:
        lora()  # type: ignore[operator]
    assert raised.value.field == field
    assert field != "lora.targets" or all(target in str(raised.value) for target in LORA_TARGETS)


def test_a_profile_measured_with_other_checkpointing_is_refused() -> None:
    profile = resolve_profile("h100-paper")
    measured = dataclasses.replace(profile, raw={"memory": {"activation_checkpointing": "full"}})
    with pytest.raises(InvalidRequestError, match="activation checkpointing full"):
        training_profile(measured, resolve_model("qwen2.5-7b"), sharding=Sharding.ZERO2, compute_bytes=2,
                         activation_checkpointing=ActivationCheckpointing.NONE)


def _lora_bucket_table_rows() -> list[str]:
    """The table the README and the training guide print, from the memory model."""
    rows = []
    for model in ("qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b", "llama-3-8b", "qwen2.5-14b"):
        cells = []
        for sharding in (Sharding.ZERO2, Sharding.ZERO3, Sharding.NONE):
            full, lora = (_bucket_size(model, sharding, lora) for lora in (None, LoraShape(rank=16)))
            cells.append(f"{f'{full:,}' if full else 'does not fit'} → {lora:,}")
        rows.append(f"| {model} | {' | '.join(cells)} |")
    return rows


@pytest.mark.parametrize("document", ["README.md", "docs/guides/training.md"])
def test_the_documented_lora_bucket_table_is_the_memory_models(document: str) -> None:
    text = (Path(__file__).parents[1] / document).read_text()
    table = text.split("<!-- lora-bucket-table:", 1)[1].split("\n\n", 1)[0].splitlines()[3:]
    assert [row.strip() for row in table] == _lora_bucket_table_rows()
