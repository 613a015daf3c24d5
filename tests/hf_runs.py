"""What the Hugging Face Trainer tests share: their data, their Trainer arguments, and runs inside gloo ranks.

The data are the synthetic global batches the bundled trainer draws (``make_source``), written out as records of
``input_ids`` and ``labels``: the bundled trainer reads them as a JSONL file, the Trainer as a ``datasets.Dataset``,
both in file order, so that global batch ``s`` is the same sequences in both.

Ranks are forked from the test process (``spawn_gloo``). accelerate keeps its process state in class-level
singletons, which a rank would inherit from a Trainer built in the test process (a test of refusals builds them
with one process): ``fresh_accelerate_state`` clears them first in every rank.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from transformers import TrainerCallback, TrainingArguments

from trainer_client.data import GlobalBatch, make_source

__all__ = ["PaddingCollator", "Recorder", "batches", "dataset", "fresh_accelerate_state", "logged_steps", "records",
           "training_arguments", "write_jsonl"]

VOCAB_SIZE = 1024  # the tiny model's


def batches(*, num_steps: int, global_batch: int, max_length: int, seed: int) -> list[GlobalBatch]:
    """The first ``num_steps`` synthetic LMSys-like global batches (the bundled trainer's ``synthetic:lmsys``)."""
    source = make_source("synthetic:lmsys", global_batch_size=global_batch, vocab_size=VOCAB_SIZE,
                         max_length=max_length, seed=seed)
    return [source.batch(step) for step in range(num_steps)]


def records(global_batches: Sequence[GlobalBatch]) -> list[dict[str, list[int]]]:
    """Every sample of ``global_batches``, in order, as a record of its input ids and labels."""
    return [{"input_ids": sample.input_ids.tolist(), "labels": sample.labels.tolist()}
            for batch in global_batches for sample in batch.samples]


def write_jsonl(path: Path, rows: Sequence[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def dataset(rows: Sequence[dict[str, Any]]) -> Dataset:
    return Dataset.from_list(list(rows))


class PaddingCollator:
    """A causal LM's collator as a plain Trainer script writes one: right padding, ``-100`` labels on padding, an
    attention mask (the Trainer's model shifts the labels itself)."""

    def __call__(self, examples: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
        length = max(len(example["input_ids"]) for example in examples)
        input_ids = torch.zeros(len(examples), length, dtype=torch.long)
        labels = torch.full((len(examples), length), -100, dtype=torch.long)
        attention_mask = torch.zeros(len(examples), length, dtype=torch.long)
        for row, example in enumerate(examples):
            num_tokens = len(example["input_ids"])
            input_ids[row, :num_tokens] = torch.tensor(example["input_ids"])
            labels[row, :num_tokens] = torch.tensor(example["labels"])
            attention_mask[row, :num_tokens] = 1
        return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}


def training_arguments(output_dir: Path, arguments: type[TrainingArguments] = TrainingArguments,
                       **changes: Any) -> Any:
    """The tests' Trainer arguments (``arguments``: TRL's ``SFTConfig`` or another subclass): the bundled trainer's
    optimizer (AdamW, a constant learning rate of 1e-3, no weight decay, clipping at 1.0), fp32, every step logged,
    records in file order, nothing reported or saved unless a test says so."""
    settings: dict[str, Any] = {
        "output_dir": str(output_dir), "use_cpu": True, "learning_rate": 1e-3, "lr_scheduler_type": "constant",
        "optim": "adamw_torch", "weight_decay": 0.0, "max_grad_norm": 1.0, "logging_steps": 1, "report_to": [],
        "save_strategy": "no", "disable_tqdm": True, "seed": 0, "train_sampling_strategy": "sequential",
        "bf16": False, **changes}
    return arguments(**settings)


def fresh_accelerate_state() -> None:
    """Forget the process state a forked rank inherited from the test process, so that accelerate reads this
    rank's process group; one thread per rank, as ``spawn_gloo`` gives torch (accelerate warns where
    ``OMP_NUM_THREADS`` is unset)."""
    from accelerate.state import AcceleratorState

    os.environ["OMP_NUM_THREADS"] = "1"
    AcceleratorState._reset_state(reset_partial_state=True)


def logged_steps(log_history: Sequence[dict[str, float]]) -> list[dict[str, float]]:
    """The Trainer's per-step training logs (``loss``, ``grad_norm``, ...), in step order."""
    return [entry for entry in log_history if "loss" in entry]


class Recorder(TrainerCallback):
    """The Trainer's events a run went through, by name, and what it logged."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.logs: list[dict[str, float]] = []

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.events.append("train_begin")

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.events.append(f"step_end {state.global_step}")

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.events.append(f"evaluate {state.global_step}")

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None,
               **kwargs: Any) -> None:
        self.logs.append(dict(logs or {}))

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.events.append("train_end")
