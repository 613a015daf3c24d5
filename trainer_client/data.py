"""Training data: global batches of token sequences, identical on every rank.

Two sources, chosen by ``--data``:

- ``synthetic:NAME`` (NAME in wikipedia | lmsys | chatqa2): lengths drawn from
  the planning core's Table-1-shaped samplers
  (``scheduler_service.core.samplers.sample_lengths``), token ids uniform over the
  vocabulary. Global batch ``s`` depends on ``(seed, s)`` alone, so every rank,
  every scheduler and every rerun sees the same batches in the same order.
- a JSONL file, one record per line: ``{"input_ids": [...]}`` with optional
  ``"labels"`` (same length; -100 = no loss, Hugging Face convention) or
  ``"loss_mask"`` (same length; 0/1). Global batch ``s`` is records
  ``[s·B, (s+1)·B)`` modulo the file length, in file order.

Labels follow the Hugging Face convention (aligned with ``input_ids``); the
token at position ``t`` is trained to predict ``labels[t + 1]``
(``Sample.targets``). A record longer than ``max_length`` is an error naming the
record, unless ``truncate`` is set.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import numpy.typing as npt

from scheduler_service.core.samplers import DATASETS, sample_lengths

__all__ = [
    "IGNORE_INDEX",
    "GlobalBatch",
    "JsonlSource",
    "RecordTooLongError",
    "Sample",
    "SyntheticSource",
    "make_source",
]

IGNORE_INDEX = -100
SYNTHETIC_PREFIX = "synthetic:"


class RecordTooLongError(ValueError):
    """A record exceeds the configured maximum length and truncation is off."""


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
class SyntheticSource:
    dataset: str
    global_batch_size: int
    vocab_size: int
    max_length: int
    seed: int

    def __post_init__(self) -> None:
        if self.dataset not in DATASETS:
            raise ValueError(f"unknown synthetic data set {self.dataset!r}; known: {', '.join(DATASETS)}")
        if self.global_batch_size < 1:
            raise ValueError(f"global batch size must be positive, got {self.global_batch_size}")

    def batch(self, step: int) -> GlobalBatch:
        rng = np.random.default_rng([self.seed, step])
        lengths = sample_lengths(self.dataset, self.global_batch_size, rng, max_length=self.max_length)
        samples = []
        for length in lengths:
            input_ids = rng.integers(0, self.vocab_size, size=int(length), dtype=np.int64)
            samples.append(Sample(input_ids=input_ids, labels=input_ids.copy()))
        return GlobalBatch(step=step, samples=tuple(samples))

    def seek(self, position: dict[str, int]) -> None:
        """Nothing to restore: batch ``s`` depends on ``(seed, s)`` alone."""


@dataclass(frozen=True, kw_only=True, slots=True)
class JsonlSource:
    path: Path
    global_batch_size: int
    max_length: int
    truncate: bool = False
    vocab_size: int | None = None
    records: tuple[Sample, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.global_batch_size < 1:
            raise ValueError(f"global batch size must be positive, got {self.global_batch_size}")
        records = tuple(self._read())
        if not records:
            raise ValueError(f"{self.path} holds no records")
        object.__setattr__(self, "records", records)

    def _read(self) -> list[Sample]:
        samples: list[Sample] = []
        with self.path.open() as lines:
            for line_number, line in enumerate(lines, start=1):
                if line.strip():
                    samples.append(self._parse(json.loads(line), f"{self.path}:{line_number}"))
        return samples

    def _parse(self, record: dict[str, object], where: str) -> Sample:
        if not isinstance(record, dict) or "input_ids" not in record:
            raise ValueError(f"record {where} has no 'input_ids'")
        input_ids = np.asarray(record["input_ids"], dtype=np.int64)
        if "labels" in record:
            labels = np.asarray(record["labels"], dtype=np.int64)
        elif "loss_mask" in record:
            mask = np.asarray(record["loss_mask"], dtype=bool)
            if mask.shape != input_ids.shape:
                raise ValueError(f"record {where}: loss_mask has {mask.size} entries, input_ids {input_ids.size}")
            labels = np.where(mask, input_ids, IGNORE_INDEX)
        else:
            labels = input_ids.copy()
        if input_ids.ndim != 1 or input_ids.size == 0:
            raise ValueError(f"record {where}: input_ids must be a non-empty list of token ids")
        if labels.shape != input_ids.shape:
            raise ValueError(f"record {where}: labels has {labels.size} entries, input_ids {input_ids.size}")
        if self.vocab_size is not None and (input_ids.min() < 0 or input_ids.max() >= self.vocab_size):
            raise ValueError(f"record {where}: token ids must lie in [0, {self.vocab_size})")
        if input_ids.size > self.max_length:
            if not self.truncate:
                raise RecordTooLongError(
                    f"record {where} has {input_ids.size} tokens; the maximum is {self.max_length} "
                    f"(bucket_size × cp_size unless --max-length says otherwise); pass --truncate to cut it"
                )
            input_ids, labels = input_ids[: self.max_length], labels[: self.max_length]
        return Sample(input_ids=input_ids, labels=labels)

    def batch(self, step: int) -> GlobalBatch:
        num_records = len(self.records)
        start = step * self.global_batch_size
        samples = tuple(self.records[(start + offset) % num_records] for offset in range(self.global_batch_size))
        return GlobalBatch(step=step, samples=samples)

    def seek(self, position: dict[str, int]) -> None:
        """Nothing to restore: batch ``s`` is records ``[s·B, (s+1)·B)``."""


def make_source(
    spec: str, *, global_batch_size: int, vocab_size: int, max_length: int, seed: int, truncate: bool = False
) -> SyntheticSource | JsonlSource:
    """``synthetic:NAME`` or a path to a JSONL file."""
    if spec.startswith(SYNTHETIC_PREFIX):
        return SyntheticSource(dataset=spec.removeprefix(SYNTHETIC_PREFIX), global_batch_size=global_batch_size,
                               vocab_size=vocab_size, max_length=max_length, seed=seed)
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"--data {spec!r} is neither synthetic:NAME ({', '.join(DATASETS)}) nor a JSONL file")
    return JsonlSource(path=path, global_batch_size=global_batch_size, max_length=max_length, truncate=truncate,
                       vocab_size=vocab_size)
