"""What ``skrull-advise`` is given, read into the planning core's inputs: a sample of sequence lengths from
``--data``, a model shape from ``--model``, a profile from ``--profile``.

They live on the trainer's side because a data set's lengths are the lengths the trainer encodes
(``data.RecordEncoder``, with the run's tokenizer) and a checkpoint's shape is the one the trainer builds
(``model.model_shape``); the service never imports the trainer. torch and transformers are imported only for
records and checkpoints, so a synthetic sample or a file of lengths needs neither.

``--data`` sources:

* ``synthetic:NAME``: ``sample_size`` lengths drawn from the planning core's Table-1-shaped samplers;
* records, in any form the trainer's ``--data`` takes (a JSONL, parquet, CSV or JSON file, a dataset folder, a
  Hugging Face Hub data set ``ORG/NAME[@REVISION][:SPLIT]``, ``data.open_records``): each record's length as the
  trainer encodes it (``input_ids``, ``messages`` or ``text`` with ``--tokenizer``), at most ``sample_size``
  records chosen evenly (seeded) from a larger set;
* a file of lengths: one positive integer per line (a first line that is a number marks it, ``is_lengths_file``).
  The trainer cannot train on one, so the commands printed for it need the records it was measured from.

What is a record source, and what a Hub id, is decided where the trainer decides it (``data.open_records``), so
a mistyped ``data/train.jsonl`` is a missing file here as there. A Hub model's ``config.json`` alone is fetched
(``model.model_shape``).

Every error is a ``ValueError`` naming the flag, or the core's ``PlanningError`` naming the field.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import numpy.typing as npt

from scheduler_service.contract.profiles import load_profile
from scheduler_service.core.models import ModelShape, resolve_model
from scheduler_service.core.profile import Profile, resolve_profile
from scheduler_service.core.samplers import DATASETS, sample_lengths
from trainer_client.hub import RepoKind, hub_ref

__all__ = ["SYNTHETIC_PREFIX", "is_lengths_file", "read_lengths", "read_model", "read_profile"]

SYNTHETIC_PREFIX = "synthetic:"


def read_lengths(source: str, *, sample_size: int, seed: int, tokenizer: str | None = None) -> npt.NDArray[np.int64]:
    """The sample of ``--data`` (module docstring); ``ValueError`` naming the flag and the problem."""
    if sample_size < 1:
        raise ValueError(f"--sample-size must be positive, got {sample_size}")
    if source.startswith(SYNTHETIC_PREFIX):
        name = source.removeprefix(SYNTHETIC_PREFIX)
        if name not in DATASETS:
            raise ValueError(f"--data {source}: unknown synthetic set; known: {', '.join(DATASETS)}")
        return sample_lengths(name, sample_size, np.random.default_rng(seed))
    if is_lengths_file(source):
        return _lengths_file(Path(source))
    return _record_lengths(source, sample_size=sample_size, seed=seed, tokenizer=tokenizer)


def is_lengths_file(source: str) -> bool:
    """Whether ``--data source`` is a file of lengths: a file whose first non-blank line is a number."""
    path = Path(source)
    if not path.is_file():
        return False
    with path.open("rb") as lines:
        for line in lines:
            if line.strip():
                return line.strip().lstrip(b"-+").isdigit()
    raise ValueError(f"--data {path} is empty")


def _lengths_file(path: Path) -> npt.NDArray[np.int64]:
    lengths = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if line.strip():
            try:
                lengths.append(int(line))
            except ValueError:
                raise ValueError(f"--data {path}:{number}: {line.strip()[:40]!r} is not a sequence length (a file of "
                                 "lengths holds one integer per line)") from None
    return np.asarray(lengths, dtype=np.int64)


def _record_lengths(source: str, *, sample_size: int, seed: int, tokenizer: str | None) -> npt.NDArray[np.int64]:
    """Each chosen record's length as the trainer encodes it (its labels and masks do not change the length)."""
    try:
        from trainer_client.data import RecordEncoder, load_tokenizer, open_records
    except ImportError as error:  # an install without the trainer extra (torch)
        raise ValueError(f"--data {source}: reading records needs the trainer extra (pip install 'skrull[trainer]'): "
                         f"{error}") from None
    try:
        records = open_records(source)
    except ValueError as error:
        raise ValueError(f"--data {source}: {error}") from None
    encoder = RecordEncoder(max_length=1 << 62, tokenizer=load_tokenizer(tokenizer) if tokenizer else None)
    num_records = records.num_records
    chosen = (np.arange(num_records) if num_records <= sample_size
              else np.sort(np.random.default_rng(seed).choice(num_records, size=sample_size, replace=False)))
    lengths = np.empty(chosen.size, dtype=np.int64)
    for position, index in enumerate(chosen.tolist()):
        record, where = records.read(index)
        lengths[position] = encoder.encode(record, where).num_tokens
    return lengths


def read_model(name_or_dir: str) -> ModelShape:
    """A built-in model by name, or a checkpoint's shape as the trainer reads its config: a local folder, or a
    Hugging Face Hub id (``ORG/NAME[@REVISION]``, whose config.json alone is fetched)."""
    if Path(name_or_dir).is_dir() or hub_ref(name_or_dir, RepoKind.MODEL_CONFIG) is not None:
        try:
            from trainer_client.models.model import model_shape
        except ImportError as error:
            raise ValueError(f"--model {name_or_dir}: reading a checkpoint's config needs the trainer extra: "
                             f"{error}") from None
        return model_shape(name_or_dir)
    return resolve_model(name_or_dir)


def read_profile(name_or_file: str | None) -> Profile:
    """A profile file (``python -m trainer_client.profile`` writes one), a built-in profile by name, or the
    planner's default (None)."""
    if name_or_file is not None and Path(name_or_file).is_file():
        return load_profile(Path(name_or_file))
    return resolve_profile(name_or_file)
