"""What makes a checkpoint this run's (``RunIdentity``), and the check ``--resume`` makes with it.

Rank 0 writes the run's identity beside every checkpoint (``step-<n>/run.json``, ``checkpoint.py``). Resuming
compares the saved identity with this run's, item by item, before any DCP state is read (``check_resume``):

- ``--model``, ``--dp`` × ``--cp``, ``--global-batch``, the LoRA adapters: another value means the saved state
  is not this run's (another architecture or adapters; other ranks' shards and RNG; other batches from the saved
  data position), so every rank stops with ``ResumeMismatch`` naming each difference;
- ``--data`` (where the data lies and what it holds, ``data.DataIdentity``): refused the same way unless
  ``--resume-accept-data-change`` says the change is meant; then a warning names it and training goes on from
  the saved data position;
- ``--seed`` (of the data's order: shuffled records, synthetic data): another seed gives other batches from the saved
  position, so it is refused as a change of the data is, and named on its own line;
- the hyperparameters (``--steps``, ``--warmup-steps``, ``--lr``, ``--min-lr-ratio``, ``--lr-scheduler``,
  ``--weight-decay``, ``--max-grad-norm``, ``--loss-on``): changing them is how a run is extended or tuned, so it is
  accepted, and a warning names each change. A record written before an item was recorded does not compare it.

A checkpoint without ``run.json`` holds no record to check against: it is resumed with a warning that says so,
and the checkpoints this run writes carry the record.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from trainer_client.config import TrainConfig
from trainer_client.config_choices import LRSchedulerName
from trainer_client.data import DataIdentity, DataSource
from trainer_client.hub import RepoKind, fetch, hub_ref
from trainer_client.models.lora import LoraSettings
from trainer_client.models.model import model_folder

__all__ = ["Change", "Difference", "ResumeMismatch", "RunIdentity", "check_resume", "differences", "model_identity",
           "model_source"]

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
    # None in a record written before each was recorded, which is then not compared:
    seed: int | None = None  # of the data's order (shuffled records, synthetic data); None where it has none
    weight_decay: float | None = None
    max_grad_norm: float | None = None
    loss_on: str | None = None
    # Where the model was read (not compared: the digest is the model): a local folder's absolute path, a Hub id at
    # the commit read; None for a catalogue name. skrull-export builds the model from it.
    model_source: str | None = None

    @classmethod
    def of(cls, config: TrainConfig, data: DataSource) -> RunIdentity:
        return cls(model=model_identity(config.model), dp=config.dp, cp=config.cp, global_batch=config.global_batch,
                   data=data.identity(), steps=config.steps, warmup_steps=config.warmup_steps, lr=config.lr,
                   min_lr_ratio=config.min_lr_ratio, lora=LoraSettings.of(config), lr_scheduler=config.lr_scheduler,
                   seed=data.order_seed, weight_decay=config.weight_decay, max_grad_norm=config.max_grad_norm,
                   loss_on=config.loss_on, model_source=model_source(config.model))

    def to_json(self) -> str:
        fields = dataclasses.asdict(self)
        fields["lora"] = self.lora.to_json() if self.lora is not None else None
        return json.dumps(fields, indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str) -> RunIdentity:
        fields = json.loads(text)
        try:
            lora, data = fields.get("lora"), DataIdentity(**fields["data"])
            if "seed" not in fields:  # a record that kept the seed in the data's fingerprint
                data, fields["seed"] = _seed_apart(data)
            return cls(**{**fields, "data": data, "lora": LoraSettings.from_json(lora) if lora is not None else None})
        except (KeyError, TypeError) as error:
            raise ValueError(f"not a run identity: {error}") from None


# How records written before the seed was an item of its own held it in the data's fingerprint: a synthetic set's
# "seed 0, max length 1024", a record source's "…, shuffled with seed 0".
_SEED_IN_FINGERPRINT = re.compile(r"^seed (?P<synthetic>-?\d+), |, shuffled with seed (?P<shuffled>-?\d+)")


def _seed_apart(data: DataIdentity) -> tuple[DataIdentity, int | None]:
    """An older record's data identity as this trainer writes it, and the seed its fingerprint held."""
    found = _SEED_IN_FINGERPRINT.search(data.fingerprint)
    if found is None:
        return data, None
    seed = int(found["synthetic"] if found["synthetic"] is not None else found["shuffled"])
    fingerprint = _SEED_IN_FINGERPRINT.sub(lambda match: "" if match["synthetic"] is not None else ", shuffled",
                                           data.fingerprint)
    return DataIdentity(source=data.source, fingerprint=fingerprint), seed


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


def model_source(model: str) -> str | None:
    """Where ``--model`` is read, as another process finds it again: a local folder's absolute path, a Hub id at the
    commit this process read (``ORG/NAME@COMMIT``); None for a catalogue name."""
    if Path(model).is_dir():
        return str(Path(model).resolve())
    ref = hub_ref(model, RepoKind.MODEL_CONFIG)
    return f"{ref.repo_id}@{fetch(ref).commit}" if ref is not None else None


class Change(StrEnum):
    """What ``--resume`` does when an item of the checkpoint's identity differs from this run's."""

    REFUSED = "refused"  # the saved state is not this run's
    DATA = "data"  # refused unless --resume-accept-data-change
    SCHEDULE = "schedule"  # accepted and logged


# Each item by the flags that set it, what a difference does, and its value as the user reads it (None: a record
# written before the item was recorded, which is not compared).
_ITEMS: tuple[tuple[str, Change, Callable[[RunIdentity], object]], ...] = (
    ("--model", Change.REFUSED, lambda run: run.model),
    ("--dp × --cp", Change.REFUSED, lambda run: f"{run.dp} × {run.cp}"),
    ("--global-batch", Change.REFUSED, lambda run: run.global_batch),
    ("--lora-rank, --lora-alpha, --lora-targets", Change.REFUSED,
     lambda run: "none (full fine-tuning)" if run.lora is None else
     f"rank {run.lora.rank}, alpha {run.lora.alpha}, targets {','.join(run.lora.targets)}"),
    ("--data", Change.DATA, lambda run: run.data),
    # the order of the records, or synthetic data, from the saved position on: another seed is other batches
    ("--seed", Change.DATA, lambda run: run.seed),
    ("--steps", Change.SCHEDULE, lambda run: run.steps),
    ("--warmup-steps", Change.SCHEDULE, lambda run: run.warmup_steps),
    ("--lr", Change.SCHEDULE, lambda run: run.lr),
    ("--min-lr-ratio", Change.SCHEDULE, lambda run: run.min_lr_ratio),
    ("--lr-scheduler", Change.SCHEDULE, lambda run: run.lr_scheduler),
    ("--weight-decay", Change.SCHEDULE, lambda run: run.weight_decay),
    ("--max-grad-norm", Change.SCHEDULE, lambda run: run.max_grad_norm),
    ("--loss-on", Change.SCHEDULE, lambda run: run.loss_on),
)


@dataclass(frozen=True, kw_only=True, slots=True)
class Difference:
    item: str
    change: Change
    saved: str
    current: str

    def __str__(self) -> str:
        return f"{self.item}: saved {self.saved}, this run {self.current}"

    def named(self, value: str) -> str:
        """``value`` with the flag it is of, where the value alone does not say (``--seed 0``; the data does)."""
        return value if self.item == "--data" else f"{self.item} {value}"


def differences(saved: RunIdentity, current: RunIdentity) -> list[Difference]:
    return [Difference(item=item, change=change, saved=_shown(value(saved)), current=_shown(value(current)))
            for item, change, value in _ITEMS
            if value(saved) != value(current) and not (value(saved) is None and item in _RECORDED_LATER)]


# Items an older record may lack (saved None): not compared. A seed of None is one the data's order never read.
_RECORDED_LATER = frozenset({"--weight-decay", "--max-grad-norm", "--loss-on"})


def _shown(value: object) -> str:
    return "none (file order)" if value is None else str(value)


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
    warnings = [f"{ACCEPT_DATA_CHANGE_FLAG}: checkpoint {checkpoint} was trained on {d.named(d.saved)}; this run "
                f"trains on {d.named(d.current)} from the saved data position"
                for d in found if d.change is Change.DATA]
    schedule = [f"{d.item} {d.saved} → {d.current}" for d in found if d.change is Change.SCHEDULE]
    if schedule:
        warnings.append(f"resuming checkpoint {checkpoint} with other hyperparameters: {', '.join(schedule)}")
    return warnings
