"""Bad input gets a typed error naming the field, the index and the limit."""

import pytest

from scheduler_service.core.errors import (
    InvalidRequestError,
    SequenceTooLongError,
    UnknownModelError,
    UnknownProfileError,
    UnknownSchedulerError,
)
from scheduler_service.core.models import ModelShape
from scheduler_service.core.plan import PlanLimits, make_problem
from scheduler_service.core.planner import make_plan

BASE = {"sequence_lengths": [100, 200], "dp_size": 1, "cp_size": 2, "model": "qwen2.5-0.5b", "bucket_size": 1000}


def problem(**overrides: object):  # type: ignore[no-untyped-def]
    return make_problem(**{**BASE, **overrides})  # type: ignore[arg-type]


def test_rejects_sequence_longer_than_cp_capacity() -> None:
    with pytest.raises(SequenceTooLongError) as caught:
        problem(sequence_lengths=[10, 2001])
    assert caught.value.field == "sequence_lengths[1]"
    assert "sequence 1 has 2001 tokens; at most bucket_size 1000 × cp_size 2 = 2000 fit" in str(caught.value)


def test_rejects_empty_batch() -> None:
    with pytest.raises(InvalidRequestError, match="empty") as caught:
        problem(sequence_lengths=[])
    assert caught.value.field == "sequence_lengths"


@pytest.mark.parametrize("bad", [0, -5])
def test_rejects_non_positive_lengths_naming_the_index(bad: int) -> None:
    with pytest.raises(InvalidRequestError, match="must be positive") as caught:
        problem(sequence_lengths=[10, 20, bad])
    assert caught.value.field == "sequence_lengths[2]"


@pytest.mark.parametrize("field", ["dp_size", "cp_size", "bucket_size"])
@pytest.mark.parametrize("bad", [0, -1])
def test_rejects_non_positive_sizes(field: str, bad: int) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        problem(**{field: bad})
    assert caught.value.field == field


def test_rejects_unknown_model_and_scheduler_and_profile() -> None:
    with pytest.raises(UnknownModelError, match=r"qwen2\.5-0\.5b"):
        problem(model="gpt-17")
    with pytest.raises(UnknownProfileError):
        problem(profile="tpu-v9")
    with pytest.raises(UnknownSchedulerError, match="skrull") as caught:
        make_plan(problem(), "magic")
    assert caught.value.field == "scheduler"


def test_rejects_batch_larger_than_the_configured_maximum() -> None:
    with pytest.raises(InvalidRequestError, match="at most 3") as caught:
        problem(sequence_lengths=[1, 2, 3, 4], limits=PlanLimits(max_sequences=3))
    assert caught.value.field == "sequence_lengths"


def test_rejects_inline_model_with_bad_shape() -> None:
    with pytest.raises(InvalidRequestError) as caught:
        ModelShape(name="x", hidden_size=64, num_layers=0, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=16, intermediate_size=128, vocab_size=100)
    assert caught.value.field == "model.num_layers"


def test_derives_bucket_size_from_the_profile_when_absent() -> None:
    derived = problem(bucket_size=None, dp_size=4, cp_size=8)
    assert derived.bucket_size > 10_000


def test_model_too_large_for_the_device_is_a_clear_error() -> None:
    with pytest.raises(InvalidRequestError, match="no activation memory") as caught:
        problem(bucket_size=None, model="qwen2.5-14b", dp_size=1, cp_size=1)
    assert caught.value.field == "bucket_size"


def test_rejects_inline_model_with_absurd_size() -> None:
    with pytest.raises(InvalidRequestError, match="between 1 and 262144") as caught:
        ModelShape(name="x", hidden_size=10**200, num_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=16, intermediate_size=128, vocab_size=100)
    assert caught.value.field == "model.hidden_size"
