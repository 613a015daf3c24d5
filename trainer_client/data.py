"""Training data: global batches of token sequences, identical on every rank.

Sources, chosen by ``--data``:

- ``synthetic:NAME`` (NAME in wikipedia | lmsys | chatqa2): lengths drawn from
  the planning core's Table-1-shaped samplers
  (``scheduler_service.core.samplers.sample_lengths``), token ids uniform over the
  vocabulary. Global batch ``s`` depends on ``(seed, s)`` alone, so every rank,
  every scheduler and every rerun sees the same batches in the same order.
- a JSONL file, one record per line, or a local Hugging Face ``datasets``
  directory (``Dataset.save_to_disk``), one record per row. Global batch ``s``
  is the next ``B`` records of the current epoch's order, carried on into the
  next epoch at the end: file order, or with ``shuffle`` a permutation seeded by
  ``(seed, epoch)``, another each epoch and the same on every rank and rerun.

Records (``RecordEncoder``), the first key present (and not null) decides:

- ``{"input_ids": [...]}``, tokenized already, with optional ``"labels"`` (same
  length; -100 = no loss, Hugging Face convention) or ``"loss_mask"`` (0/1);
- ``{"messages": [{"role": ..., "content": ...}, ...]}``: a chat, rendered with
  the tokenizer's chat template (``--tokenizer``); only assistant turns carry
  loss, every prompt token (system, user, tool, the template's markup before
  each answer) is masked;
- ``{"text": "..."}``: plain text, tokenized (with the end-of-text token) and
  trained on every token.

Both record readers read a record at a time: a JSONL file from the byte offset
of its line (an index of the offsets is built once, 12 bytes per record), a
``datasets`` directory as memory-mapped Arrow rows, so no rank holds the data.
Where the next batch starts (``GlobalBatch.next_position``: the epoch and the
index in its order) is saved in checkpoints and restored with ``seek``, so a
resumed run continues the same order. What a source is
(``DataSource.identity``: the synthetic set with its seed; a JSONL file with
its size and a digest of its first and last records; a ``datasets`` directory
with its rows and fingerprint) is saved beside them, so that a resume can tell
whether it reads the same data (``run_identity.py``).

Labels follow the Hugging Face convention (aligned with ``input_ids``); the
token at position ``t`` is trained to predict ``labels[t + 1]``
(``Sample.targets``). A record longer than ``max_length`` is an error naming the
record, unless ``truncate`` is set. ``LengthStats`` summarises the lengths a
run trained on.
"""

from __future__ import annotations

import hashlib
import json
import math
from array import array
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol

import numpy as np
import numpy.typing as npt

from scheduler_service.core.samplers import DATASETS, sample_lengths

__all__ = [
    "IGNORE_INDEX",
    "DataIdentity",
    "DataSource",
    "DatasetRecords",
    "GlobalBatch",
    "JsonlRecords",
    "LengthStats",
    "RecordEncoder",
    "RecordSource",
    "RecordTooLongError",
    "Sample",
    "SyntheticSource",
    "load_tokenizer",
    "make_source",
    "open_records",
]

IGNORE_INDEX = -100
SYNTHETIC_PREFIX = "synthetic:"
_TAIL_BLOCK_BYTES = 1 << 16  # a JSONL file's last record is looked for this many bytes at a time, from the end


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
class DataIdentity:
    """Which data a source yields: two sources with the same identity give the same global batches."""

    source: str  # synthetic:NAME, or the absolute path of the file or directory
    fingerprint: str  # what the source holds, as a user can read it

    def __str__(self) -> str:
        return f"{self.source} ({self.fingerprint})"


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

    def seek(self, position: Mapping[str, int]) -> None:
        """Nothing to restore: batch ``s`` depends on ``(seed, s)`` alone."""

    def identity(self) -> DataIdentity:
        # The batch size is the run's (checked on its own); the longest length clips the lengths drawn.
        return DataIdentity(source=f"{SYNTHETIC_PREFIX}{self.dataset}",
                            fingerprint=f"seed {self.seed}, max length {self.max_length}")


# ---------------------------------------------------------------------------------------------------- records


class Tokenizer(Protocol):
    """What the encoder needs of a transformers tokenizer."""

    eos_token_id: int | None

    def __len__(self) -> int: ...

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...


def load_tokenizer(path: str) -> Tokenizer:
    """A tokenizer from a local directory (``save_pretrained``); never downloads."""
    if not Path(path).is_dir():
        raise ValueError(f"--tokenizer {path!r} is not a local tokenizer directory (no hub downloads)")
    from transformers import AutoTokenizer

    tokenizer: Tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return tokenizer


@dataclass(frozen=True, kw_only=True, slots=True)
class RecordEncoder:
    """A record (one JSON line or dataset row) → ``Sample``, with every error naming the record."""

    max_length: int
    truncate: bool = False
    vocab_size: int | None = None
    tokenizer: Tokenizer | None = None

    def __post_init__(self) -> None:
        if self.tokenizer is not None and self.vocab_size is not None and len(self.tokenizer) > self.vocab_size:
            raise ValueError(f"the tokenizer has {len(self.tokenizer)} tokens; the model's vocabulary only "
                             f"{self.vocab_size}")

    def encode(self, record: object, where: str) -> Sample:
        if not isinstance(record, dict):
            raise ValueError(f"record {where} is not a JSON object")
        # A datasets row holds every column of the set: a column that is None in this row is absent.
        if record.get("input_ids") is not None:
            input_ids, labels = self._tokenized(record, where)
        elif record.get("messages") is not None:
            input_ids, labels = self._chat(record["messages"], where)
        elif record.get("text") is not None:
            input_ids, labels = self._text(record["text"], where)
        else:
            raise ValueError(f"record {where} has none of 'input_ids', 'messages', 'text'")
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

    @staticmethod
    def _tokenized(record: dict[str, Any], where: str) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        input_ids = np.asarray(record["input_ids"], dtype=np.int64)
        if record.get("labels") is not None:
            return input_ids, np.asarray(record["labels"], dtype=np.int64)
        if record.get("loss_mask") is not None:
            mask = np.asarray(record["loss_mask"], dtype=bool)
            if mask.shape != input_ids.shape:
                raise ValueError(f"record {where}: loss_mask has {mask.size} entries, input_ids {input_ids.size}")
            return input_ids, np.where(mask, input_ids, IGNORE_INDEX)
        return input_ids, input_ids.copy()

    def _needs_tokenizer(self, kind: str, where: str) -> Tokenizer:
        if self.tokenizer is None:
            raise ValueError(f"record {where} holds {kind}: give --tokenizer (a local tokenizer directory)")
        return self.tokenizer

    def _text(self, text: object, where: str) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        tokenizer = self._needs_tokenizer("text", where)
        if not isinstance(text, str):
            raise ValueError(f"record {where}: 'text' must be a string")
        ids = tokenizer.encode(text, add_special_tokens=False)
        if tokenizer.eos_token_id is not None:
            ids.append(tokenizer.eos_token_id)  # the model learns where a document ends
        input_ids = np.asarray(ids, dtype=np.int64)
        return input_ids, input_ids.copy()

    def _chat(self, messages: object, where: str) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """Render the chat; train only the tokens each assistant turn adds after its prompt.

        The prompt of assistant turn ``k`` is the template of ``messages[:k]`` with the generation prompt; its
        answer is what the template of ``messages[:k + 1]`` adds to that. Templates render prefixes of a chat as
        prefixes of its tokens (checked: a template that does not is an error naming the record).
        """
        tokenizer = self._needs_tokenizer("a chat", where)
        if not (isinstance(messages, list) and messages and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages)):
            raise ValueError(f"record {where}: 'messages' must be a non-empty list of {{role, content}} strings")
        if not any(m["role"] == "assistant" for m in messages):
            raise ValueError(f"record {where}: the chat has no assistant turn to train on")

        def render(turns: list[dict[str, str]], *, prompt: bool) -> list[int]:
            ids: list[int] = tokenizer.apply_chat_template(turns, tokenize=True, return_dict=False,
                                                           add_generation_prompt=prompt)
            return ids

        ids: list[int] = []
        trained: list[bool] = []
        for k, message in enumerate(messages):
            if message["role"] == "assistant":
                prompt = render(messages[:k], prompt=True) if k else []
                self._extend(ids, trained, prompt, train=False, where=where)
            self._extend(ids, trained, render(messages[: k + 1], prompt=False), train=message["role"] == "assistant",
                         where=where)
        input_ids = np.asarray(ids, dtype=np.int64)
        return input_ids, np.where(np.asarray(trained), input_ids, IGNORE_INDEX)

    @staticmethod
    def _extend(ids: list[int], trained: list[bool], rendered: list[int], *, train: bool, where: str) -> None:
        """Append what ``rendered`` adds to ``ids`` (which it must start with), marked ``train``."""
        if rendered[: len(ids)] != ids:
            raise ValueError(f"record {where}: the chat template does not render a prefix of the chat as a prefix "
                             "of its tokens; prompt masking needs it to")
        trained.extend([train] * (len(rendered) - len(ids)))
        ids.extend(rendered[len(ids):])


Position = dict[str, int]  # where a record source resumes: {"epoch": e, "index": i in epoch e's order}


class RecordReader(Protocol):
    """Records by index, ``0 … num_records − 1``."""

    @property
    def num_records(self) -> int: ...

    def read(self, index: int) -> tuple[object, str]:
        """Record ``index`` and where it is (for errors)."""
        ...

    def identity(self) -> DataIdentity: ...


@dataclass(frozen=True, kw_only=True, slots=True)
class JsonlRecords:
    """A JSONL file, a record per non-blank line, read from the byte offset of its line."""

    path: Path
    _offsets: array = field(init=False, repr=False)  # of each record's line
    _line_numbers: array = field(init=False, repr=False)

    def __post_init__(self) -> None:
        offsets, line_numbers = array("Q"), array("I")
        with self.path.open("rb") as lines:
            offset = 0
            for line_number, line in enumerate(lines, start=1):
                if line.strip():
                    offsets.append(offset)
                    line_numbers.append(line_number)
                offset += len(line)
        if not offsets:
            raise ValueError(f"{self.path} holds no records")
        object.__setattr__(self, "_offsets", offsets)
        object.__setattr__(self, "_line_numbers", line_numbers)

    @property
    def num_records(self) -> int:
        return len(self._offsets)

    def read(self, index: int) -> tuple[object, str]:
        where = f"{self.path}:{self._line_numbers[index]}"
        with self.path.open("rb") as lines:
            lines.seek(self._offsets[index])
            line = lines.readline()
        try:
            return json.loads(line), where
        except json.JSONDecodeError as error:
            raise ValueError(f"record {where} is not JSON: {error}") from None

    def identity(self) -> DataIdentity:
        """The path, the size and a digest of the first and last records: appending, cutting or replacing the file
        changes it, without reading a large file whole."""
        num_bytes = self.path.stat().st_size
        with self.path.open("rb") as lines:
            first = next((line for line in lines if line.strip()), b"").strip()
            last = _last_line(lines, num_bytes)
        digest = hashlib.sha256(first + b"\n" + last).hexdigest()[:16]
        return DataIdentity(source=str(self.path.resolve()),
                            fingerprint=f"{num_bytes} bytes, first and last records sha256 {digest}")


def _last_line(lines: IO[bytes], num_bytes: int) -> bytes:
    """The last non-blank line of a file of ``num_bytes``, stripped, read backwards a block at a time."""
    tail, end = b"", num_bytes
    while True:
        start = max(0, end - _TAIL_BLOCK_BYTES)
        lines.seek(start)
        tail = lines.read(end - start) + tail
        end = start
        stripped = tail.rstrip()
        if b"\n" in stripped or start == 0:  # a whole line, or the file's first
            return stripped.rsplit(b"\n", 1)[-1].strip()


@dataclass(frozen=True, kw_only=True, slots=True)
class DatasetRecords:
    """A local Hugging Face ``datasets`` directory (``save_to_disk``), memory-mapped; rows in order."""

    path: Path
    dataset: Any = field(init=False, repr=False)

    def __post_init__(self) -> None:
        try:
            from datasets import load_from_disk
        except ImportError:
            raise ValueError(f"--data {self.path} is a directory: reading a datasets directory needs the "
                             "'datasets' package (pip install 'skrull[data]')") from None
        dataset = load_from_disk(str(self.path))
        if not hasattr(dataset, "num_rows") or isinstance(dataset.num_rows, dict):
            raise ValueError(f"--data {self.path} holds several splits; give the directory of one split")
        if dataset.num_rows == 0:
            raise ValueError(f"{self.path} holds no records")
        object.__setattr__(self, "dataset", dataset)

    @property
    def num_records(self) -> int:
        return int(self.dataset.num_rows)

    def read(self, index: int) -> tuple[object, str]:
        return self.dataset[index], f"{self.path}[{index}]"

    def identity(self) -> DataIdentity:
        """The path, the number of rows and the fingerprint ``datasets`` keeps of the content (a digest of how it was
        made, saved by ``save_to_disk``)."""
        return DataIdentity(source=str(self.path.resolve()),
                            fingerprint=f"{self.dataset.num_rows} rows, datasets fingerprint "
                                        f"{self.dataset._fingerprint}")


@dataclass(kw_only=True, slots=True)
class RecordSource:
    """Global batches of the next ``global_batch_size`` records of the epoch's order (module docstring); call
    ``batch`` for steps in order."""

    records: RecordReader
    encoder: RecordEncoder
    global_batch_size: int
    shuffle: bool = False
    seed: int = 0
    position: Position = field(default_factory=dict)
    _order: tuple[int, npt.NDArray[np.int64]] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.global_batch_size < 1:
            raise ValueError(f"global batch size must be positive, got {self.global_batch_size}")

    def batch(self, step: int) -> GlobalBatch:
        epoch, index = self.position.get("epoch", 0), self.position.get("index", 0)
        samples = []
        for _ in range(self.global_batch_size):
            if index >= self.records.num_records:
                epoch, index = epoch + 1, 0
            record, where = self.records.read(int(self.order(epoch)[index]))
            samples.append(self.encoder.encode(record, where))
            index += 1
        self.position = {"epoch": epoch, "index": index}
        return GlobalBatch(step=step, samples=tuple(samples), next_position=dict(self.position))

    def order(self, epoch: int) -> npt.NDArray[np.int64]:
        """The records of ``epoch`` in the order they are trained: file order, or a permutation seeded by
        ``(seed, epoch)``."""
        if self._order is None or self._order[0] != epoch:
            num_records = self.records.num_records
            order = (np.random.default_rng([self.seed, epoch]).permutation(num_records) if self.shuffle
                     else np.arange(num_records))
            self._order = (epoch, order)
        return self._order[1]

    def steps_for_epochs(self, epochs: int) -> int:
        """Optimizer steps that train every record ``epochs`` times (the last batch may reach into the next
        epoch)."""
        return math.ceil(epochs * self.records.num_records / self.global_batch_size)

    def seek(self, position: Mapping[str, int]) -> None:
        if set(position) - {"epoch", "index"}:
            raise ValueError(f"data position {dict(position)} is not one of a record source ({{'epoch', 'index'}})")
        self.position = dict(position)

    def identity(self) -> DataIdentity:
        """The records' identity and their order: another seed or order gives other batches from the same
        position."""
        records = self.records.identity()
        order = f"shuffled with seed {self.seed}" if self.shuffle else "file order"
        return DataIdentity(source=records.source, fingerprint=f"{records.fingerprint}, {order}")


DataSource = SyntheticSource | RecordSource


def open_records(spec: str) -> RecordReader:
    """The records of a JSONL file or a ``datasets`` directory."""
    path = Path(spec)
    if path.is_file():
        return JsonlRecords(path=path)
    if path.is_dir():
        return DatasetRecords(path=path)
    raise ValueError(f"{spec!r} is neither a JSONL file nor a datasets directory")


def make_source(
    spec: str, *, global_batch_size: int, vocab_size: int, max_length: int, seed: int, truncate: bool = False,
    tokenizer: str | None = None, shuffle: bool = False,
) -> DataSource:
    """``synthetic:NAME``, a JSONL file or a ``datasets`` directory (``tokenizer``: a local tokenizer folder;
    ``shuffle``: a record source's epochs in a seeded order, not file order)."""
    if spec.startswith(SYNTHETIC_PREFIX):
        return SyntheticSource(dataset=spec.removeprefix(SYNTHETIC_PREFIX), global_batch_size=global_batch_size,
                               vocab_size=vocab_size, max_length=max_length, seed=seed)
    if not Path(spec).exists():
        raise ValueError(f"--data {spec!r} is neither synthetic:NAME ({', '.join(DATASETS)}) nor a JSONL file nor "
                         "a datasets directory")
    records = open_records(spec)
    encoder = RecordEncoder(max_length=max_length, truncate=truncate, vocab_size=vocab_size,
                            tokenizer=load_tokenizer(tokenizer) if tokenizer is not None else None)
    return RecordSource(records=records, encoder=encoder, global_batch_size=global_batch_size, shuffle=shuffle,
                        seed=seed)


@dataclass(slots=True)
class LengthStats:
    """The sequence lengths a run trained on (4 bytes per sequence), and how many tokens carried loss."""

    lengths: array = field(default_factory=lambda: array("I"))
    num_loss_tokens: int = 0

    def add(self, batch: GlobalBatch) -> None:
        self.lengths.extend(batch.sequence_lengths)
        self.num_loss_tokens += batch.num_loss_tokens

    def summary(self) -> str:
        if not self.lengths:
            return "no sequences"
        lengths = np.asarray(self.lengths)
        p50, p90, p99 = np.percentile(lengths, [50, 90, 99])
        total = int(lengths.sum())
        return (f"{lengths.size} sequences, {total} tokens ({self.num_loss_tokens / total:.0%} with loss); "
                f"length min {lengths.min()}, median {p50:.0f}, p90 {p90:.0f}, p99 {p99:.0f}, max {lengths.max()}")
