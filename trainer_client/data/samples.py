"""Samples and global batches: what every source yields and every rank trains, and the errors of a record that
cannot become a sample.

Labels follow the Hugging Face convention (aligned with ``input_ids``); the token at position ``t`` is trained to
predict ``labels[t + 1]`` (``Sample.targets``). ``IGNORE_INDEX`` (-100) marks a label without loss. A record that
cannot train is a ``BadRecordError`` naming the record and its ``Defect`` (``record_check`` reports them together); one
longer than ``max_length`` without ``truncate`` is a ``RecordTooLongError``. ``LengthStats`` summarises the lengths a
run trained on.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["IGNORE_INDEX", "BadRecordError", "DataIdentity", "Defect", "GlobalBatch", "LengthStats",
           "RecordTooLongError", "Sample", "length_summary", "malformed"]

IGNORE_INDEX = -100


class Defect(StrEnum):
    """Why a record cannot train; ``data.check`` reports the records of each defect together, with its fix."""

    TOO_LONG = "too_long"  # longer than --max-length, and --truncate is off
    BEYOND_PLAN = "beyond_plan"  # longer than any plan of the layout holds (a --max-length above it)
    NO_LOSS = "no_loss"  # no token carries loss: nothing to learn from it
    EMPTY_CHAT = "empty_chat"
    NO_ASSISTANT = "no_assistant"  # a chat with no assistant turn, and only assistant turns carry loss
    TEMPLATE = "template"  # the chat template does not render a prefix of the chat as a prefix of its tokens
    MALFORMED = "malformed"  # not JSON, no known shape, wrong types, token ids outside the vocabulary


class BadRecordError(ValueError):
    """A record that cannot train, and why (``defect``); the message names the record."""

    def __init__(self, message: str, *, defect: Defect, where: str, num_tokens: int | None = None) -> None:
        super().__init__(message)
        self.defect = defect
        self.where = where
        self.num_tokens = num_tokens  # the record's tokens, where the defect is its length


class RecordTooLongError(BadRecordError):
    """A record exceeds the configured maximum length and truncation is off."""


def malformed(where: str, message: str) -> BadRecordError:
    """A record of no shape the encoder knows, of wrong types, or not JSON (``Defect.MALFORMED``)."""
    return BadRecordError(message, defect=Defect.MALFORMED, where=where)


@dataclass(frozen=True, kw_only=True, slots=True)
class Sample:
    """One sequence: token ids and labels aligned with them (``IGNORE_INDEX`` = no loss)."""

    input_ids: npt.NDArray[np.int64]
    labels: npt.NDArray[np.int64]

    def __post_init__(self) -> None:
        if self.input_ids.ndim != 1 or len(self.input_ids) == 0:
            raise ValueError(f"a sample needs a non-empty 1-D input_ids, got shape {self.input_ids.shape}")
        if self.labels.shape != self.input_ids.shape:
            raise ValueError(f"labels shape {self.labels.shape} != input_ids shape {self.input_ids.shape}")

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def targets(self) -> npt.NDArray[np.int64]:
        """What each position is trained to predict: ``labels`` shifted left by one; the last predicts nothing."""
        return np.concatenate([self.labels[1:], np.array([IGNORE_INDEX], dtype=np.int64)])

    @property
    def num_loss_tokens(self) -> int:
        return int(np.count_nonzero(self.targets != IGNORE_INDEX))


@dataclass(frozen=True, kw_only=True, slots=True)
class GlobalBatch:
    step: int
    samples: tuple[Sample, ...]
    next_position: dict[str, int] = field(default_factory=dict)  # where the source resumes after this batch
    sequence_lengths: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sequence_lengths", tuple(sample.num_tokens for sample in self.samples))

    @property
    def num_tokens(self) -> int:
        return sum(self.sequence_lengths)

    @property
    def num_loss_tokens(self) -> int:
        return sum(sample.num_loss_tokens for sample in self.samples)


@dataclass(frozen=True, kw_only=True, slots=True)
class DataIdentity:
    """Which data a source yields: two sources with the same identity give the same global batches."""

    source: str  # synthetic:NAME, the absolute path of a file or folder (and split), or a Hub ORG/NAME:SPLIT
    fingerprint: str  # what the source holds, as a user can read it

    def __str__(self) -> str:
        return f"{self.source} ({self.fingerprint})"


@dataclass(slots=True)
class LengthStats:
    """The sequence lengths a run trained on (4 bytes per sequence), and how many tokens carried loss."""

    lengths: array = field(default_factory=lambda: array("I"))
    num_loss_tokens: int = 0

    def add(self, batch: GlobalBatch) -> None:
        self.lengths.extend(batch.sequence_lengths)
        self.num_loss_tokens += batch.num_loss_tokens

    def summary(self) -> str:
        return length_summary(np.asarray(self.lengths), self.num_loss_tokens, unit="sequences")


def length_summary(lengths: npt.NDArray[np.integer[Any]], num_loss_tokens: int, *, unit: str) -> str:
    """How many ``unit`` (sequences, records: a plural) of these ``lengths``, their tokens, the share with loss, and
    the length distribution, as the trainer logs it."""
    if not lengths.size:
        return f"no {unit}"
    p50, p90, p99 = np.percentile(lengths, [50, 90, 99])
    total = int(lengths.sum())
    counted = f"{lengths.size} {unit.removesuffix('s') if lengths.size == 1 else unit}"
    return (f"{counted}, {total} tokens ({num_loss_tokens / total:.0%} with loss); "
            f"length min {lengths.min()}, median {p50:.0f}, p90 {p90:.0f}, p99 {p99:.0f}, max {lengths.max()}")
