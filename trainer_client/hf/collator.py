"""What a Trainer's data loader hands Skrull: each example as one sequence, the plan packs them.

The Trainer's data collator stays the user's (or TRL's): it still builds the labels (masks, the completion, the
assistant turns). ``SequenceCollator`` applies it to one example at a time and keeps that example's ``input_ids``
and ``labels`` as a ``Sample``, the padding a collator adds (``pad_to_multiple_of``) removed by its attention mask;
one data-loader batch is one global batch's samples, ``{"samples": (...)}``, which ``training_step`` plans. A
collator that packs by itself (transformers' ``DataCollatorWithFlattening``, TRL's ``padding_free``) would hand
Skrull one packed row for several examples, whose documents Skrull could not keep apart: ``check_collator`` refuses
it at start, by what it does to two examples.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from trainer_client.data import Sample

__all__ = ["SequenceCollator", "check_collator", "sample_of"]

Collator = Callable[[list[Any]], Any]


def sample_of(collator: Collator, example: Any) -> Sample:
    """``example`` collated alone, as one sequence: its input ids and labels, without the collator's padding."""
    batch = collator([example])
    if "labels" not in batch:
        raise ValueError(f"data_collator gives no labels (keys: {', '.join(batch)}): Skrull trains on labels aligned "
                         "with input_ids (-100: no loss), as a causal LM's collator makes them "
                         "(DataCollatorForLanguageModeling(mlm=False), or TRL's)")
    input_ids, labels = (torch.as_tensor(batch[key])[0] for key in ("input_ids", "labels"))
    if "attention_mask" in batch:
        kept = torch.as_tensor(batch["attention_mask"])[0].bool()
        input_ids, labels = input_ids[kept], labels[kept]
    return Sample(input_ids=input_ids.numpy().astype(np.int64), labels=labels.numpy().astype(np.int64))


class SequenceCollator:
    """A data-loader batch of examples as one global batch of samples: ``{"samples": (Sample, ...)}``."""

    def __init__(self, collator: Collator) -> None:
        self.collator = collator  # the Trainer's own, applied to each example alone

    def __call__(self, examples: list[Any]) -> dict[str, tuple[Sample, ...]]:
        return {"samples": tuple(sample_of(self.collator, example) for example in examples)}


def check_collator(collator: Collator, examples: Sequence[Any]) -> None:
    """Raise ``ValueError`` for a collator that packs by itself or gives no labels, found by collating the first
    examples of the training set together: a collator that pads gives a row per example, one that packs fewer."""
    batch = collator(list(examples))
    rows = torch.as_tensor(batch["input_ids"]).shape[0]
    if rows != len(examples):
        raise ValueError(f"data_collator packs by itself: it collated {len(examples)} examples into {rows} row(s) "
                         f"({type(collator).__name__}). Skrull's plan packs the sequences, each kept apart by DACP "
                         "attention: give a collator that pads (TRL: padding_free=False)")
    sample_of(collator, examples[0])
