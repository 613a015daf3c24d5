"""What a Trainer's batch settings become under Skrull at each DP × CP split (``trainer_client.hf.layout``): the
global batch counted per DP rank by default, per process with ``SkrullArguments.batch_per_process`` (the same
whatever the CP degree), and rank 0's start-up line saying which. No process group: the world size is what
accelerate would report under torchrun."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from transformers import TrainingArguments

from tests.hf_runs import training_arguments
from trainer_client.hf import SkrullArguments
from trainer_client.hf.layout import batch_mapping, trainer_layout

NUM_PROCESSES = 4


def _arguments(tmp_path: Path) -> TrainingArguments:
    args: TrainingArguments = training_arguments(tmp_path, per_device_train_batch_size=4,
                                                 gradient_accumulation_steps=2)
    return args


def _as_one_of_four_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Arguments read from now on as in one of torchrun's 4 processes: accelerate's world size, and torchrun's (set
    once the arguments exist: building them would look for torchrun's rendezvous)."""
    monkeypatch.setattr(TrainingArguments, "world_size", property(lambda self: NUM_PROCESSES))
    monkeypatch.setenv("WORLD_SIZE", str(NUM_PROCESSES))


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_batch_per_process_keeps_the_global_batch_when_only_cp_changes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                        cp: int) -> None:
    per_process, per_dp_rank = _arguments(tmp_path), _arguments(tmp_path)  # 4 chats a forward, 2 accumulated
    _as_one_of_four_processes(monkeypatch)
    skrull = SkrullArguments(bucket_size=128, cp=cp)
    layout = trainer_layout(per_process, dataclasses.replace(skrull, batch_per_process=True))
    assert layout.global_batch == 4 * 2 * NUM_PROCESSES
    assert trainer_layout(per_dp_rank, skrull).global_batch == 4 * 2 * (NUM_PROCESSES // cp)  # a CP group shares one


def test_the_start_up_line_says_what_the_batch_settings_give_at_every_cp(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    args = _arguments(tmp_path)
    _as_one_of_four_processes(monkeypatch)
    per_dp_rank = ("per_device_train_batch_size counts sequences per DP rank, which the cp processes of a CP group "
                   "share: over 4 processes these settings train 32 at cp 1, 16 at cp 2, 8 at cp 4 "
                   "(SkrullArguments.batch_per_process=True keeps 32 at every cp)")
    assert batch_mapping(args, SkrullArguments(bucket_size=128, cp=2), NUM_PROCESSES) == per_dp_rank
    assert batch_mapping(args, SkrullArguments(bucket_size=128, cp=2, batch_per_process=True), NUM_PROCESSES) == (
        "per_device_train_batch_size counts sequences per process (SkrullArguments.batch_per_process): over 4 "
        "processes these settings train 32 sequences at every cp")
    assert batch_mapping(args, SkrullArguments(bucket_size=128, cp=2, global_batch=12), NUM_PROCESSES) == (
        "SkrullArguments.global_batch gives the global batch, 12 sequences at every cp")
    layout = trainer_layout(args, SkrullArguments(bucket_size=128, cp=2))
    assert layout.explanation.startswith(
        "Skrull: dp 2 × cp 2 over 4 processes; every optimizer step trains a global batch of 16 sequences "
        "(per_device_train_batch_size 4 × gradient_accumulation_steps 2 × dp 2)")
    assert per_dp_rank in layout.explanation
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (16, 1)  # one planned step a batch
