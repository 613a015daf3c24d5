"""Training checkpoints with ``torch.distributed.checkpoint`` (DCP): every rank writes its own shards.

A checkpoint after ``n`` optimizer steps is the folder ``<dir>/step-<n>`` holding

* ``model`` and ``optimizer``: the sharded state dicts of ``get_state_dict`` (FSDP2 DTensors are saved shard
  by shard; replicated tensors once), keyed by the model's own parameter names, so a checkpoint loads under
  any sharding mode and activation checkpointing;
* ``train``: the steps done and the data position (where the next global batch starts), identical on every
  rank; the learning rate is a function of the step (``optim.lr_schedule``);
* ``rng``: each rank's torch RNG state under its own key (ranks may have drawn differently);
* ``run.json``, written by rank 0: the identity of the run that wrote it (model, dp × cp, global batch, data,
  schedule; ``run_identity.py``), which ``--resume`` checks before it reads any of the above;
* ``complete``, written last: the marker that the checkpoint is whole.

**Complete.** DCP's coordinator, rank 0, writes the checkpoint's ``.metadata`` only after every rank's shards are
written (and synced), and DCP's save returns on no rank before that. Rank 0 then writes ``run.json`` and, last,
creates the empty file ``complete`` (one ``open(O_CREAT)``: it exists whole or not at all). A folder without it was
cut short (the job was killed while saving, or an async save was still writing): ``latest_checkpoint``, which
``--resume`` and ``skrull-export`` read, picks the newest folder that has it and logs each newer one it skips, so
a job killed at any moment resumes from the last checkpoint written whole. ``--resume`` loads it when there is
one and otherwise starts from scratch, so the same command serves the first launch and every restart under
``torchrun --max-restarts``. In fp32 on CPU a resumed run trains exactly the batches the killed one had not and
reproduces the uninterrupted run's losses bit for bit (``tests/test_train_checkpoint.py``).

Trainers before the marker kept a file ``<dir>/latest`` naming the newest checkpoint, replaced only once its save
had finished: the folder it names counts as complete. The first save into such a directory marks that folder and
removes the file, so from then on the markers alone decide (the file would otherwise name a folder this run may
rewrite).

**Async** (``--async-checkpoint``). ``dcp.async_save`` copies the state to CPU memory before it returns (its
default stager does, CPU tensors included, so the next optimizer step may change the parameters at once) and
writes it in a thread; the training step does not wait for the write. That thread runs DCP's collectives, on a
gloo group of its own (``Checkpointer``): async saving needs a group that reduces CPU tensors (NCCL cannot), and a
group shared with the training's collectives would interleave the two threads' calls in a different order on
different ranks. When the write is done, rank 0 completes the checkpoint in that thread (``run.json``, the
marker, pruning). A save waits for the one before it to be complete, and so does the end of training
(``Checkpointer.wait``).

**Pruning** (``--keep-last N``). Once a checkpoint is complete, rank 0 removes every step folder older than the
``N`` newest complete checkpoints up to it, whole or cut short; folders of later steps stay
(``prune_checkpoints``). The checkpoint just completed is always kept, so a kill at any moment leaves one to
resume.

``skrull-export`` (``model_export``) reads a checkpoint's model part alone into an unsharded model, in one process
without a process group (``resolve_checkpoint``, ``load_model_weights``).
"""

from __future__ import annotations

import functools
import json
import logging
import re
import shutil
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from trainer_client.components.run_identity import RunIdentity

__all__ = ["COMPLETE", "LEGACY_LATEST", "RUN_IDENTITY", "Checkpointer", "TrainState", "cut_short", "is_complete",
           "latest_checkpoint", "load_checkpoint", "load_model_weights", "prune_checkpoints", "resolve_checkpoint",
           "saved_run_identity", "step_dir"]

COMPLETE = "complete"
LEGACY_LATEST = "latest"
RUN_IDENTITY = "run.json"
_STEP_FOLDER = re.compile(r"step-(\d+)")

logger = logging.getLogger("trainer_client.components.checkpoint")


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainState:
    """What a checkpoint restores beside the model and optimizer."""

    num_steps_done: int  # the learning rate follows from it (``optim.lr_schedule``)
    data_position: dict[str, int]


def step_dir(directory: Path, num_steps_done: int) -> Path:
    return directory / f"step-{num_steps_done:08d}"


def _num_steps_done(folder: Path) -> int:
    match = _STEP_FOLDER.fullmatch(folder.name)
    assert match is not None, folder
    return int(match[1])


def _step_folders(directory: Path) -> list[Path]:
    """The ``step-<n>`` folders of ``directory``, oldest first."""
    folders = [path for path in directory.glob("step-*") if _STEP_FOLDER.fullmatch(path.name) and path.is_dir()]
    return sorted(folders, key=_num_steps_done)


def is_complete(checkpoint: Path) -> bool:
    """Whether ``checkpoint`` was written whole: it has the marker, or an older trainer's ``latest`` names it."""
    if (checkpoint / COMPLETE).is_file():
        return True
    legacy = checkpoint.parent / LEGACY_LATEST
    return legacy.is_file() and legacy.read_text().strip() == checkpoint.name


def latest_checkpoint(directory: Path) -> Path | None:
    """The newest complete checkpoint in ``directory``, or None; each newer folder, cut short, is logged and skipped."""
    for folder in reversed(_step_folders(directory)):
        if is_complete(folder):
            return folder
        logger.info("skipping %s: it has no %s marker, so its save did not finish", folder, COMPLETE)
    return None


def cut_short(directory: Path) -> list[Path]:
    """The step folders of ``directory`` newer than its newest complete checkpoint, oldest first: saves that did not
    finish."""
    folders = []
    for folder in reversed(_step_folders(directory)):
        if is_complete(folder):
            break
        folders.append(folder)
    return folders[::-1]


def prune_checkpoints(directory: Path, *, keep_last: int, newest: Path) -> list[Path]:
    """Remove the step folders of ``directory`` older than the ``keep_last`` newest complete checkpoints up to
    ``newest`` (a complete one), whether complete or cut short; later folders stay. Returns the folders removed."""
    assert keep_last >= 1 and is_complete(newest), (keep_last, newest)
    folders = [folder for folder in _step_folders(directory) if _num_steps_done(folder) <= _num_steps_done(newest)]
    oldest_kept = [folder for folder in folders if is_complete(folder)][-keep_last:][0]
    removed = [folder for folder in folders if _num_steps_done(folder) < _num_steps_done(oldest_kept)]
    for folder in removed:
        shutil.rmtree(folder)
    return removed


def resolve_checkpoint(path: Path) -> Path:
    """The checkpoint ``path`` names: the newest complete one of a ``--checkpoint-dir``, or a ``step-<n>`` folder
    itself."""
    checkpoint = latest_checkpoint(path) or path
    try:
        dcp.FileSystemReader(checkpoint).read_metadata()
    except (FileNotFoundError, NotADirectoryError):
        step_folders = sorted(folder.name for folder in path.glob("step-*"))
        hint = (f"; none of its step folders is complete ({', '.join(step_folders)}): give one to read it as it is"
                if step_folders else "")
        raise ValueError(f"{path} is not a checkpoint of the trainer: it holds neither a complete step-<n> folder "
                         f"(a --checkpoint-dir) nor DCP metadata (a step-<n> folder){hint}") from None
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


class Checkpointer:
    """Saves the trainer's checkpoints into ``directory``, synchronously or (``async_save``) in a thread, keeping the
    ``keep_last`` newest complete ones (None: all). Every rank makes one, in the same order among its process groups,
    and calls each method: they are collective."""

    def __init__(self, directory: Path, *, keep_last: int | None = None, async_save: bool = False,
                 timeout: timedelta) -> None:
        self.directory = directory
        self.keep_last = keep_last
        self._is_main = dist.get_rank() == 0
        # The async save's collectives run in its thread: on CPU tensors, apart from the training's (module docstring).
        self._group = dist.new_group(backend="gloo", timeout=timeout) if async_save else None
        self._pending: Future[None] | None = None

    def save(self, *, module: torch.nn.Module, optimizer: torch.optim.Optimizer, state: TrainState,
             identity: RunIdentity) -> Path:
        """Save after ``state.num_steps_done`` steps, once the save before it is complete; returns the checkpoint.
        Synchronous, it is complete on return; async, its state is copied on return and it completes later."""
        self.wait()
        path = step_dir(self.directory, state.num_steps_done)
        model_state, optimizer_state = get_state_dict(module, optimizer)
        if self._is_main:
            _retire_legacy_latest(self.directory)
            if path.exists():
                shutil.rmtree(path)  # written by a killed run after the checkpoint its restart resumed from: replace it
        dist.barrier()
        content = {"model": model_state, "optimizer": optimizer_state, "train": _train_entry(state),
                   "rng": {f"rank{dist.get_rank()}": torch.get_rng_state()}}
        complete = functools.partial(self._complete, path, identity)
        if self._group is None:
            dcp.save(content, checkpoint_id=path)
            complete()
            dist.barrier()  # nobody resumes or saves again before the marker is in place
        else:
            upload = dcp.async_save(content, checkpoint_id=path, process_group=self._group)
            assert isinstance(upload, Future)  # the default stager copies before returning: no AsyncSaveResponse
            self._pending = _then(upload, complete)
        return path

    def wait(self) -> None:
        """Block until the async save in progress, if any, is complete; raise its error."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        """Let the async save in progress finish, then end its group. Training calls ``wait`` at its end, so an error
        here follows another failure, which is the one to report: it is logged."""
        try:
            self.wait()
        except Exception as error:  # see the docstring
            logger.warning("the checkpoint save in progress failed: %s", error)
        if self._group is not None:
            dist.destroy_process_group(self._group)
            self._group = None

    def _complete(self, path: Path, identity: RunIdentity) -> None:
        """Once DCP's save returned: rank 0 records the run, marks the checkpoint complete and prunes older ones."""
        if not self._is_main:
            return
        (path / RUN_IDENTITY).write_text(identity.to_json())
        (path / COMPLETE).touch(exist_ok=False)  # last: the checkpoint is whole
        if self.keep_last is not None:
            for folder in prune_checkpoints(self.directory, keep_last=self.keep_last, newest=path):
                logger.info("removed %s (--keep-last %d)", folder, self.keep_last)


def _then(upload: Future[Any], complete: Callable[[], None]) -> Future[None]:
    """A future done when ``upload`` is and ``complete`` has run after it (in the thread that finished ``upload``),
    failing with the first of their errors."""
    done: Future[None] = Future()

    def finish(_: Future[Any]) -> None:
        try:
            upload.result()
            complete()
        except Exception as error:  # handed to whoever waits for the save
            done.set_exception(error)
        else:
            done.set_result(None)

    upload.add_done_callback(finish)
    return done


def _retire_legacy_latest(directory: Path) -> None:
    """Mark complete the checkpoint an older trainer's ``latest`` names, and remove the file (module docstring)."""
    legacy = directory / LEGACY_LATEST
    if not legacy.is_file():
        return
    named = directory / legacy.read_text().strip()
    if named.is_dir():
        (named / COMPLETE).touch()
    legacy.unlink()


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
