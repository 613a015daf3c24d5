"""What makes a checkpoint this run's (``RunIdentity``), and the check ``--resume`` makes with it.

Rank 0 writes the run's identity beside every checkpoint (``step-<n>/run.json``, ``checkpoint.py``). Resuming
compares the saved identity with this run's, item by item, before any DCP state is read (``check_resume``):

- ``--model``, ``--dp`` × ``--cp``, ``--global-batch``, the LoRA adapters: another value means the saved state
  is not this run's (another architecture or adapters; other ranks' shards and RNG; other batches from the saved
  data position), so every rank stops with ``ResumeMismatch`` naming each difference;
- ``--data`` (where the data lies and what it holds, ``data.DataIdentity``): refused the same way unless
  ``--resume-accept-data-change`` says the change is meant; then a warning names it and training goes on from
  the saved data position;
- the schedule (``--steps``, ``--warmup-steps``, ``--lr``, ``--min-lr-ratio``, ``--lr-scheduler``): changing it
  is how a run is extended, so it is accepted, and a warning names each change.

A checkpoint without ``run.json`` holds no record to check against: it is resumed with a warning that says so,
and the checkpoints this run writes carry the record.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from trainer_client.choices import LRSchedulerName
from trainer_client.config import TrainConfig
from trainer_client.data import DataIdentity, DataSource
from trainer_client.lora import LoraSettings
from trainer_client.model import model_folder

__all__ = ["Change", "Difference", "ResumeMismatch", "RunIdentity", "check_resume", "differences", "model_identity"]

ACCEPT_DATA_CHANGE_FLAG = "--resume-accept-data-change"


class ResumeMismatch(ValueError):
    """The checkpoint ``--resume`` found was written by another run; every rank stops before any step."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RunIdentity:
    """What a checkpoint must share with the run that resumes it, and the schedule it was trained on."""

    model: str  # model_identity(--model)
    dp: int
    cp: int
    global_batch: int
    data: DataIdentity
    steps: int
    warmup_steps: int
    lr: float
    min_lr_ratio: float
    lora: LoraSettings | None = None  # the adapters a LoRA run trains (absent from records of full fine-tuning)
    lr_scheduler: str = LRSchedulerName.WARMUP_COSINE  # absent from records written before there was a choice

    @classmethod
    def of(cls, config: TrainConfig, data: DataSource) -> RunIdentity:
        return cls(model=model_identity(config.model), dp=config.dp, cp=config.cp, global_batch=config.global_batch,
                   data=data.identity(), steps=config.steps, warmup_steps=config.warmup_steps, lr=config.lr,
                   min_lr_ratio=config.min_lr_ratio, lora=config.lora, lr_scheduler=config.lr_scheduler)

    def to_json(self) -> str:
        fields = dataclasses.asdict(self)
        fields["lora"] = self.lora.to_json() if self.lora is not None else None
        return json.dumps(fields, indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str) -> RunIdentity:
        fields = json.loads(text)
        try:
            lora = fields.get("lora")
            return cls(**{**fields, "data": DataIdentity(**fields["data"]),
                          "lora": LoraSettings.from_json(lora) if lora is not None else None})
        except (KeyError, TypeError) as error:
            raise ValueError(f"not a run identity: {error}") from None


def model_identity(model: str) -> str:
    """A catalogue name in lower case (``build_model`` ignores case), a checkpoint (a local folder or a Hub id's
    snapshot) by a digest of its ``config.json`` wherever it lies; the keys that say where and with which
    transformers it was saved are left out, since they do not change the model. A Hub id's config.json alone is
    fetched."""
    directory = model_folder(model, weights=False)
    if directory is None:
        return model.lower()
    config = json.loads((directory / "config.json").read_text())
    architecture = {key: value for key, value in config.items()
                    if not key.startswith("_") and key != "transformers_version"}
    digest = hashlib.sha256(json.dumps(architecture, sort_keys=True).encode()).hexdigest()[:16]
    return f"config.json sha256 {digest}"


class Change(StrEnum):
    """What ``--resume`` does when an item of the checkpoint's identity differs from this run's."""

    REFUSED = "refused"  # the saved state is not this run's
    DATA = "data"  # refused unless --resume-accept-data-change
    SCHEDULE = "schedule"  # accepted and logged


# Each item by the flags that set it, what a difference does, and its value as the user reads it.
_ITEMS: tuple[tuple[str, Change, Callable[[RunIdentity], object]], ...] = (
    ("--model", Change.REFUSED, lambda run: run.model),
    ("--dp × --cp", Change.REFUSED, lambda run: f"{run.dp} × {run.cp}"),
    ("--global-batch", Change.REFUSED, lambda run: run.global_batch),
    ("--lora-rank, --lora-alpha, --lora-targets", Change.REFUSED,
     lambda run: "none (full fine-tuning)" if run.lora is None else
     f"rank {run.lora.rank}, alpha {run.lora.alpha}, targets {','.join(run.lora.targets)}"),
    ("--data", Change.DATA, lambda run: run.data),
    ("--steps", Change.SCHEDULE, lambda run: run.steps),
    ("--warmup-steps", Change.SCHEDULE, lambda run: run.warmup_steps),
    ("--lr", Change.SCHEDULE, lambda run: run.lr),
    ("--min-lr-ratio", Change.SCHEDULE, lambda run: run.min_lr_ratio),
    ("--lr-scheduler", Change.SCHEDULE, lambda run: run.lr_scheduler),
)


@dataclass(frozen=True, kw_only=True, slots=True)
class Difference:
    item: str
    change: Change
    saved: str
    current: str

    def __str__(self) -> str:
        return f"{self.item}: saved {self.saved}, this run {self.current}"


def differences(saved: RunIdentity, current: RunIdentity) -> list[Difference]:
    return [Difference(item=item, change=change, saved=str(value(saved)), current=str(value(current)))
            for item, change, value in _ITEMS if value(saved) != value(current)]


def check_resume(
    checkpoint: Path, saved: RunIdentity | None, current: RunIdentity, *, accept_data_change: bool,
) -> list[str]:
    """Raise ``ResumeMismatch`` naming every difference that stops resuming ``checkpoint`` (``saved``: its
    identity, None when it has none); otherwise return the warnings that name what was accepted."""
    if saved is None:
        return [f"checkpoint {checkpoint} has no record of the run that wrote it, so its model, dp × cp, global "
                "batch and data cannot be checked: resuming it as this run's"]
    found = differences(saved, current)
    refused = [d for d in found if d.change is Change.REFUSED or (d.change is Change.DATA and not accept_data_change)]
    if refused:
        advice = "resume with the saved values, or give another --checkpoint-dir to start afresh"
        if any(d.change is Change.DATA for d in refused):
            advice += f"; {ACCEPT_DATA_CHANGE_FLAG} trains the new data from the saved data position"
        raise ResumeMismatch("\n".join([f"checkpoint {checkpoint} was written by another run:",
                                        *(f"  {d}" for d in refused), advice]))
    warnings = [f"{ACCEPT_DATA_CHANGE_FLAG}: checkpoint {checkpoint} was trained on {d.saved}; this run trains on "
                f"{d.current} from the saved data position" for d in found if d.change is Change.DATA]
    schedule = [f"{d.item} {d.saved} → {d.current}" for d in found if d.change is Change.SCHEDULE]
    if schedule:
        warnings.append(f"resuming checkpoint {checkpoint} with another schedule: {', '.join(schedule)}")
    return warnings
