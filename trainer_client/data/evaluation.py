"""Held-out evaluation (``--eval-data``): the mean token loss of a set of records the run does not train on.

Every rank reads and encodes the whole set when the trainer starts (``EvalSet.load``), so a record too long for
the layout, or unreadable, stops every rank with the same error before any step, as a bad ``--data`` does.
The set is cut into global batches of ``--global-batch`` records in file order (the last one shorter), each
planned by the run's scheduler and packed and sharded exactly as a training batch (``Trainer.evaluate``), with
forward passes only: no gradient, no optimizer step. The token losses of all ranks are summed and divided by
the set's loss tokens, so the figure is the plain mean over the set's loss tokens, the same under every
scheduler and every layout up to floating-point summation order.

Evaluation batches carry negative step numbers (``-1``, ``-2``, …): the plan source keys the plans it prefetches
by step, and a training step is never negative.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer_client.data.encoding import RecordEncoder
from trainer_client.data.records import open_records
from trainer_client.data.samples import GlobalBatch, RecordTooLongError

__all__ = ["EvalSet"]


@dataclass(frozen=True, kw_only=True, slots=True)
class EvalSet:
    """The held-out records as global batches, encoded once."""

    source: str
    batches: tuple[GlobalBatch, ...]

    @property
    def num_loss_tokens(self) -> int:
        return sum(batch.num_loss_tokens for batch in self.batches)

    @classmethod
    def load(cls, spec: str, *, encoder: RecordEncoder, global_batch_size: int) -> EvalSet:
        """Read and encode every record of ``spec``; raise ``ValueError`` naming ``--eval-data`` and the record."""
        try:
            records = open_records(spec)
        except (OSError, ValueError) as error:
            raise ValueError(f"--eval-data {spec}: {error}") from None
        if records.num_records == 0:
            raise ValueError(f"--eval-data {spec} holds no records")
        samples = []
        for index in range(records.num_records):
            record, where = records.read(index)
            try:
                samples.append(encoder.encode(record, where))
            except RecordTooLongError as error:
                raise ValueError(f"--eval-data {spec}: {error}; evaluation plans each record as training does, "
                                 "so none may be longer than training's --max-length") from None
            except ValueError as error:
                raise ValueError(f"--eval-data {spec}: {error}") from None
        batches = tuple(GlobalBatch(step=-1 - number, samples=tuple(samples[start:start + global_batch_size]))
                        for number, start in enumerate(range(0, len(samples), global_batch_size)))
        evaluation = cls(source=spec, batches=batches)
        if evaluation.num_loss_tokens == 0:
            raise ValueError(f"--eval-data {spec}: no record has a token with loss (all labels are -100)")
        return evaluation
