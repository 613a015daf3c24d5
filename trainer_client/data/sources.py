"""Global batches of what ``--data`` names, identical on every rank (``make_source``):

- ``synthetic:NAME`` (NAME in wikipedia | lmsys | chatqa2, ``SyntheticSource``): lengths drawn from the planning
  core's Table-1-shaped samplers (``scheduler_service.core.samplers.sample_lengths``), token ids uniform over the
  vocabulary. Global batch ``s`` depends on ``(seed, s)`` alone, so every rank, every scheduler and every rerun sees
  the same batches in the same order.
- records (``RecordSource``): those of a file, a dataset folder or a Hub data set (``records.open_records``),
  encoded one at a time (``encoding.RecordEncoder``). Global batch ``s`` is the next ``B`` records of the current
  epoch's order, or the records left where fewer than ``B`` are: no batch holds two epochs' records, so every epoch
  ends with a step, as Hugging Face Trainer's last batch with ``drop_last=False`` does, and ``--epochs N`` trains
  each record exactly N times. The order is file order, or with ``shuffle`` a permutation seeded by
  ``(seed, epoch)``, another each epoch and the same on every rank and rerun.

Where the next batch starts (``GlobalBatch.next_position``: the epoch and the index in its order) is saved in
checkpoints and restored with ``seek``, so a resumed run continues the same order. What a source is
(``identity``) is saved beside them, so that a resume can tell whether it reads the same data
(``run_identity.py``): a synthetic set's name and longest length (its seed, ``order_seed``, is compared on its
own); for records, what the records are (``records.py``), their order (shuffled, with ``order_seed``, or file
order) and the records left out.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from fractions import Fraction

import numpy as np
import numpy.typing as npt

from scheduler_service.core.samplers import DATASETS, sample_lengths
from trainer_client.config_choices import SYNTHETIC_PREFIX, LossOn
from trainer_client.data.encoding import RecordEncoder, record_encoder
from trainer_client.data.records import RecordReader, open_records
from trainer_client.data.samples import DataIdentity, GlobalBatch, Sample

__all__ = ["DataSource", "RecordSource", "SyntheticSource", "make_source"]


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

    @property
    def order_seed(self) -> int:
        """The seed the batches depend on (``run_identity`` compares it on its own)."""
        return self.seed

    def identity(self) -> DataIdentity:
        # The batch size is the run's (checked on its own); the longest length clips the lengths drawn; the seed is
        # order_seed.
        return DataIdentity(source=f"{SYNTHETIC_PREFIX}{self.dataset}", fingerprint=f"max length {self.max_length}")


Position = dict[str, int]  # where a record source resumes: {"epoch": e, "index": i in epoch e's order}


@dataclass(kw_only=True, slots=True)
class RecordSource:
    """Global batches of the next ``global_batch_size`` records of the epoch's order, an epoch's last batch the
    records left (module docstring); call ``batch`` for steps in order. ``leave_out`` takes records out of every
    epoch (``--skip-bad-records``)."""

    records: RecordReader
    encoder: RecordEncoder
    global_batch_size: int
    shuffle: bool = False
    seed: int = 0
    position: Position = field(default_factory=dict)
    left_out: tuple[int, ...] = ()  # record indices no epoch holds, ascending
    _trained: npt.NDArray[np.int64] | None = field(default=None, init=False, repr=False)  # the others, ascending
    _order: tuple[int, npt.NDArray[np.int64]] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.global_batch_size < 1:
            raise ValueError(f"global batch size must be positive, got {self.global_batch_size}")

    def leave_out(self, indices: tuple[int, ...]) -> None:
        """Train every record but ``indices`` (ascending), from the first batch on; an epoch is then the others.
        With none left out, the order is exactly that of a source that never left any out."""
        if not indices:
            return
        trained = np.setdiff1d(np.arange(self.records.num_records), np.asarray(indices, dtype=np.int64))
        if trained.size == 0:
            raise ValueError("every record is left out: none is left to train")
        self.left_out, self._trained, self._order = tuple(indices), trained, None

    @property
    def num_records(self) -> int:
        """The records an epoch trains: all the source holds but those left out."""
        return self.records.num_records - len(self.left_out)

    def batch(self, step: int) -> GlobalBatch:
        epoch, index = self.position.get("epoch", 0), self.position.get("index", 0)
        if index >= self.num_records:  # the last batch ended the epoch
            epoch, index = epoch + 1, 0
        end = min(index + self.global_batch_size, self.num_records)
        samples = []
        for record_index in self.order(epoch)[index:end]:
            record, where = self.records.read(int(record_index))
            samples.append(self.encoder.encode(record, where))
        self.position = {"epoch": epoch, "index": end}
        return GlobalBatch(step=step, samples=tuple(samples), next_position=dict(self.position))

    def order(self, epoch: int) -> npt.NDArray[np.int64]:
        """The records of ``epoch`` (their indices in the source) in the order they are trained: file order, or a
        permutation seeded by ``(seed, epoch)`` of the records trained."""
        if self._order is None or self._order[0] != epoch:
            order = (np.random.default_rng([self.seed, epoch]).permutation(self.num_records) if self.shuffle
                     else np.arange(self.num_records))
            self._order = (epoch, order if self._trained is None else self._trained[order])
        return self._order[1]

    def epochs_done(self, position: Mapping[str, int]) -> float:
        """The epochs trained up to ``position`` (a batch's ``next_position``): 1.5 halfway through the second."""
        return position.get("epoch", 0) + position.get("index", 0) / self.num_records

    @property
    def steps_per_epoch(self) -> int:
        """An epoch's optimizer steps: its last batch holds the records left (``num_records % global_batch_size``
        where that is not 0)."""
        return math.ceil(self.num_records / self.global_batch_size)

    def steps_for_epochs(self, epochs: float) -> int:
        """Optimizer steps of ``epochs`` epochs, as Hugging Face Trainer counts them for ``num_train_epochs``:
        ``epochs × steps_per_epoch``, rounded up. ``epochs`` is read as the decimal it prints as: 0.1 of 30 steps is
        3, where the floats' product, 3.0000000000000004, would round up to 4."""
        return math.ceil(Fraction(str(epochs)) * self.steps_per_epoch)

    def epochs_text(self, epochs: float) -> str:
        """What ``epochs`` epochs train, as the trainer logs it: ``1 epoch of 57 records in global batches of 8: 8
        steps, the last of 1 record``."""
        steps = self.steps_for_epochs(epochs)
        text = (f"{epochs:g} {'epoch' if epochs == 1 else 'epochs'} of {_counted(self.num_records, 'record')} in "
                f"global batches of {self.global_batch_size}: {_counted(steps, 'step')}")
        left = self.num_records % self.global_batch_size
        if not left or epochs < 1:
            return text
        last = "the last" if epochs == 1 else "each epoch's last"
        return f"{text}, {last} of {_counted(left, 'record')}"

    def seek(self, position: Mapping[str, int]) -> None:
        if set(position) - {"epoch", "index"}:
            raise ValueError(f"data position {dict(position)} is not one of a record source ({{'epoch', 'index'}})")
        self.position = dict(position)

    @property
    def order_seed(self) -> int | None:
        """The seed of the records' order: shuffled, ``seed``; in file order, none (``run_identity`` compares it on
        its own)."""
        return self.seed if self.shuffle else None

    def identity(self) -> DataIdentity:
        """The records' identity, the records left out and the order (its seed is ``order_seed``): another order or
        choice of records gives other batches from the same position."""
        records = self.records.identity()
        order = "shuffled" if self.shuffle else "file order"
        left_out = ""
        if self.left_out:
            digest = hashlib.sha256(np.asarray(self.left_out, dtype=np.int64).tobytes()).hexdigest()[:16]
            left_out = f", {len(self.left_out)} records left out (sha256 {digest})"
        return DataIdentity(source=records.source, fingerprint=f"{records.fingerprint}{left_out}, {order}")


DataSource = SyntheticSource | RecordSource


def make_source(
    spec: str, *, global_batch_size: int, vocab_size: int, max_length: int, seed: int, truncate: bool = False,
    tokenizer: str | None = None, shuffle: bool = False, loss_on: LossOn = LossOn.ASSISTANT,
    chat_template: str | None = None, text_field: str = "text",
) -> DataSource:
    """``synthetic:NAME``, or the records of a data file, a dataset folder or a Hub data set (``open_records``),
    encoded as ``record_encoder`` says; ``shuffle``: a record source's epochs in a seeded order, not file order."""
    if spec.startswith(SYNTHETIC_PREFIX):
        return SyntheticSource(dataset=spec.removeprefix(SYNTHETIC_PREFIX), global_batch_size=global_batch_size,
                               vocab_size=vocab_size, max_length=max_length, seed=seed)
    try:
        records = open_records(spec)
    except ValueError as error:
        raise ValueError(f"--data {spec}: {error}") from None
    encoder = record_encoder(max_length=max_length, truncate=truncate, vocab_size=vocab_size, tokenizer=tokenizer,
                             loss_on=loss_on, chat_template=chat_template, text_field=text_field)
    return RecordSource(records=records, encoder=encoder, global_batch_size=global_batch_size, shuffle=shuffle,
                        seed=seed)


def _counted(count: int, noun: str) -> str:
    """``1 record``, ``57 records``."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"
