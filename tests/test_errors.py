"""Core errors cross process boundaries intact: a pool process raises them, the service raises them again."""

from __future__ import annotations

import pickle

import pytest

from scheduler_service.core import errors
from scheduler_service.core.errors import (
    BadSequenceLengthError,
    BaselineCannotPlanError,
    InfeasiblePlanError,
    InvalidRequestError,
    PlanCheckError,
    PlanningError,
    SequenceTooLongError,
    UnknownModelError,
    UnknownProfileError,
    UnknownSchedulerError,
)
from scheduler_service.runtime.errors import RequestLimitError

EXAMPLES: list[PlanningError] = [
    PlanningError("cannot plan", field="body"),
    InvalidRequestError("dp_size must be positive", field="dp_size"),
    SequenceTooLongError(index=17, num_tokens=250_000, bucket_size=26_000, cp_size=8),
    BadSequenceLengthError("sequence 3 length must be positive, got -5 (and 2 more bad lengths)", index=3, limit=1),
    UnknownModelError("llama-9000", ["qwen2.5-0.5b", "llama3-8b"]),
    UnknownSchedulerError("magic", ["skrull", "deepspeed"]),
    UnknownProfileError("h900", ["a100"]),
    InfeasiblePlanError("no plan fits 40 GB", field="sequence_lengths"),
    BaselineCannotPlanError("batch_rebalance", "sequence 3 has 90000 tokens and one CP group holds 32000"),
    PlanCheckError([f"violation {i}" for i in range(7)]),
    RequestLimitError("too many cells", field="sequence_lengths", limit=1_000_000),
]


def test_every_core_error_class_has_an_example() -> None:
    classes = {getattr(errors, name) for name in errors.__all__ if isinstance(getattr(errors, name), type)}
    assert classes <= {type(example) for example in EXAMPLES}


@pytest.mark.parametrize("error", EXAMPLES, ids=lambda error: type(error).__name__)
def test_core_error_pickle_round_trip_keeps_message_and_fields(error: PlanningError) -> None:
    restored = pickle.loads(pickle.dumps(error))
    assert type(restored) is type(error)
    assert restored.message == error.message and str(restored) == str(error) and restored.args == error.args
    assert vars(restored) == vars(error)
