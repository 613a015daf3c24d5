"""Training checkpoints with ``torch.distributed.checkpoint`` (DCP): every rank writes its own shards.

A checkpoint after ``n`` optimizer steps is the folder ``<dir>/step-<n>`` holding

* ``model`` and ``optimizer``: the sharded state dicts of ``get_state_dict`` (FSDP2 DTensors are saved shard
  by shard; replicated tensors once), keyed by the model's own parameter names, so a checkpoint loads under
  any sharding mode and activation checkpointing;
* ``train``: the steps done, the LR schedule's state and the data position (where the next global batch
  starts), identical on every rank;
* ``rng``: each rank's torch RNG state under its own key (ranks may have drawn differently);

and ``run.json``, written by rank 0: the identity of the run that wrote it (model, dp × cp, global batch, data,
schedule; ``run_identity.py``), which ``--resume`` checks before it reads any of the above.

``<dir>/latest`` names the newest complete checkpoint; it is replaced (write, then rename) only after DCP has
finished writing and ``run.json`` is in place, so a job killed while saving resumes from the one before.
``--resume`` loads the latest when there is one and otherwise starts from scratch, so the same command serves the
first launch and every restart under ``torchrun --max-restarts``. In fp32 on CPU a resumed run trains exactly
the batches the killed one had not and reproduces the uninterrupted run's losses bit for bit
(``tests/test_train_checkpoint.py``).

``skrull-export`` (``export.py``) reads a checkpoint's model part alone into an unsharded model, in one process
without a process group (``resolve_checkpoint``, ``load_model_weights``).
"""

from __future__ import annotations

import json
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from trainer_client.run_identity import RunIdentity

__all__ = ["LATEST", "RUN_IDENTITY", "TrainState", "latest_checkpoint", "load_checkpoint", "load_model_weights",
           "resolve_checkpoint", "save_checkpoint", "saved_run_identity", "step_dir"]

LATEST = "latest"
RUN_IDENTITY = "run.json"


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainState:
    """What a checkpoint restores beside the model and optimizer."""

    num_steps_done: int  # the learning rate follows from it (``optim.warmup_cosine_schedule``)
    data_position: dict[str, int]


def step_dir(directory: Path, num_steps_done: int) -> Path:
    return directory / f"step-{num_steps_done:08d}"


def latest_checkpoint(directory: Path) -> Path | None:
    """The newest complete checkpoint in ``directory``, or None."""
    marker = directory / LATEST
    if not marker.is_file():
        return None
    path = directory / marker.read_text().strip()
    if not path.is_dir():
        raise ValueError(f"{marker} names {path}, which does not exist; remove {marker} to start from scratch")
    return path


def resolve_checkpoint(path: Path) -> Path:
    """The checkpoint ``path`` names: the latest one of a ``--checkpoint-dir``, or a ``step-<n>`` folder itself."""
    checkpoint = latest_checkpoint(path) or path
    try:
        dcp.FileSystemReader(checkpoint).read_metadata()
    except (FileNotFoundError, NotADirectoryError):
        step_folders = sorted(folder.name for folder in path.glob("step-*"))
        hint = f"; give one of its step folders: {', '.join(step_folders)}" if step_folders else ""
        raise ValueError(f"{path} is not a checkpoint of the trainer: it holds neither a {LATEST} file (a "
                         f"--checkpoint-dir) nor DCP metadata (a step-<n> folder){hint}") from None
    return checkpoint


def saved_run_identity(path: Path) -> RunIdentity | None:
    """The identity of the run that wrote the checkpoint ``path``; None when it has no record of it."""
    record = path / RUN_IDENTITY
    if not record.is_file():
        return None
    try:
        return RunIdentity.from_json(record.read_text())
    except ValueError as error:
        raise ValueError(f"{record} is not the record of a run: {error}") from None


def save_checkpoint(
    directory: Path, *, module: torch.nn.Module, optimizer: torch.optim.Optimizer, state: TrainState,
    identity: RunIdentity,
) -> Path:
    """Every rank calls this (DCP is collective); rank 0 then writes the run's identity beside it and points
    ``latest`` at it."""
    path = step_dir(directory, state.num_steps_done)
    model_state, optimizer_state = get_state_dict(module, optimizer)
    if dist.get_rank() == 0 and path.exists():
        shutil.rmtree(path)  # written by a killed run after the checkpoint its restart resumed from: replace it
    dist.barrier()
    dcp.save({"model": model_state, "optimizer": optimizer_state, "train": _train_entry(state),
              "rng": {f"rank{dist.get_rank()}": torch.get_rng_state()}}, checkpoint_id=path)
    if dist.get_rank() == 0:
        (path / RUN_IDENTITY).write_text(identity.to_json())
        marker = directory / LATEST
        temporary = marker.with_suffix(".tmp")
        temporary.write_text(path.name + "\n")
        temporary.replace(marker)
    dist.barrier()  # nobody resumes or saves again before the marker is in place
    return path


def load_checkpoint(path: Path, *, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> TrainState:
    """Restore ``module``, ``optimizer`` and this rank's RNG from ``path`` (collective); returns the rest."""
    model_state, optimizer_state = get_state_dict(module, optimizer)
    rng_key = f"rank{dist.get_rank()}"
    state: dict[str, Any] = {"model": model_state, "optimizer": optimizer_state,
                             "train": _train_entry(TrainState(num_steps_done=0, data_position={})),
                             "rng": {rng_key: torch.get_rng_state()}}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(module, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    torch.set_rng_state(state["rng"][rng_key])
    train = json.loads(state["train"])
    return TrainState(num_steps_done=int(train["num_steps_done"]), data_position=train["data_position"])


def _train_entry(state: TrainState) -> str:
    # One JSON string: DCP loads only the keys the destination already has, and a string is one opaque value.
    return json.dumps({"num_steps_done": state.num_steps_done, "data_position": state.data_position})


def load_model_weights(path: Path, module: torch.nn.Module) -> None:
    """Restore only the model's weights of checkpoint ``path`` into ``module``, an unsharded twin of the module
    the trainer saved (so it has the saved keys), in this one process: no process group, no optimizer state read."""
    state = {"model": module.state_dict()}
    with warnings.catch_warnings():
        # DCP warns on every load without a process group; one process is what is meant here.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load(state, checkpoint_id=path, no_dist=True)
    module.load_state_dict(state["model"])
