"""Hugging Face Hub ids for ``--model``, ``--tokenizer``, ``--data`` and ``--eval-data``: which specs are Hub ids,
and the snapshot folder in the Hugging Face cache that each one resolves to.

A Hub id is ``ORG/NAME``, optionally pinned to a branch, tag or commit (``ORG/NAME@REVISION``). A data set's id
may also name a split (``ORG/NAME[@REVISION][:SPLIT]``; the default is ``train``). A spec that exists as a local
path is read as that path, built-in names (``tiny``, ``synthetic:…``) have no slash, and a data set's name with a
data file's suffix (``data/train.jsonl``, ``is_data_file_name``) is a file, missing if it does not exist, so only
what is left is looked up on the Hub (``hub_ref``: the one place that decides).

``fetch`` resolves an id with ``huggingface_hub.snapshot_download``, the loader that ``transformers`` and
``hf download`` use too. So the cache, ``HF_HOME``/``HF_HUB_CACHE``, ``HF_HUB_OFFLINE``, ``HF_ENDPOINT`` and
``HF_TOKEN`` mean what they mean there. It downloads what the cache lacks, and what it downloads depends on the
kind (``RepoKind``):

- a model (``MODEL``, what the trainer builds): its ``*.json`` files, then its safetensors weights: the shards that
  its ``model.safetensors.index.json`` lists, or ``model.safetensors``;
- a model's config (``MODEL_CONFIG``, what the planner's model shape and a resume's identity read): its
  ``config.json`` alone, or the model's snapshot when this process fetched that already;
- a tokenizer: its tokenizer files;
- a data set: the whole repository.

The snapshot folder is then read by the local loaders: ``from_pretrained`` for a model or tokenizer, and
``datasets.load_dataset`` of the folder for a data set. A data set goes through its snapshot because, when
offline, ``load_dataset("ORG/NAME")`` (datasets 5.2) reads only datasets' own Arrow cache, whatever the Hub cache
holds, and takes the latest revision found there.

A process resolves each id once: ``fetch`` keeps what it found, per cache folder, and a repository fetched for
another kind (the weights after the config, the tokenizer of the model's repository) is read at the commit found
first. Every later use (the config, the weights, the tokenizer, the identity a resume checks) reads the same
commit. The trainer calls
``fetch_on_rank_0_first`` before it builds anything:

1. rank 0 resolves every Hub id of the run, and downloads what is missing;
2. the other ranks wait on the gloo group, within the collective timeout, and receive rank 0's commits or its
   error (rank 0 raises its own, with its traceback);
3. every other rank then resolves the commit that rank 0 found (``pin``). A push to the Hub between the two
   look-ups cannot give the ranks different data. On a cache the ranks share, this reads the cache alone, with no
   network call: a commit needs no look-up.

A failure is a ``HubError`` (a ``ValueError``) naming the id and how to fix it: an id not in the cache while
offline (``hf download …``), no such repository or revision, a gated repository, or a Hub that cannot be reached.
The callers add the flag.
"""

from __future__ import annotations

import glob
import json
import logging
import re
from dataclasses import dataclass, replace
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trainer_client.distributed import ParallelContext

__all__ = ["DATA_FILE_SUFFIXES", "HubError", "HubRef", "HubSnapshot", "RepoKind", "fetch", "fetch_on_rank_0_first",
           "hub_ref", "is_data_file_name", "pin"]

logger = logging.getLogger("trainer_client.hub")

_NAME = r"[A-Za-z0-9](?:[\w.-]*[A-Za-z0-9_])?"
# ORG/NAME, then @REVISION (a branch, a tag such as v1.0, refs/pr/1, or a commit), then :SPLIT for a data set.
_HUB_ID = re.compile(rf"(?P<repo_id>{_NAME}/{_NAME})(?:@(?P<revision>[^\s@:]+))?(?::(?P<split>\S+))?")
# The suffixes of the data files --data reads: a name that ends in one is a file, never a data set's Hub id.
DATA_FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")
SHARD_INDEX = "model.safetensors.index.json"  # transformers' name: which safetensors file holds each tensor


class HubError(ValueError):
    """A Hub id that does not resolve: the message names it and says how to fix it."""


class RepoKind(StrEnum):
    """What a snapshot is fetched for: it decides the repository type and the files downloaded."""

    MODEL = "model"  # --model, for the trainer: config and weights
    MODEL_CONFIG = "model config"  # --model, for its shape or identity: config.json alone
    TOKENIZER = "tokenizer"  # --tokenizer: the tokenizer's files (of a model repository)
    DATASET = "dataset"  # --data, --eval-data: the whole data set repository

    @property
    def repo_type(self) -> str:
        return "dataset" if self is RepoKind.DATASET else "model"


# The files of each kind (fnmatch patterns over the repository's paths, in which * matches /); None: every file.
# A model's weights are added once its index is read (``_download``): exactly the files it lists, so a
# repository's other copies of them (sub-folders of other precisions or formats) are not downloaded.
_FILES: dict[RepoKind, tuple[str, ...] | None] = {
    RepoKind.MODEL: ("*.json",),
    RepoKind.MODEL_CONFIG: ("config.json",),
    RepoKind.TOKENIZER: ("*.json", "*.txt", "*.model", "*.jinja", "*.tiktoken"),
    RepoKind.DATASET: None,
}


@dataclass(frozen=True, kw_only=True, slots=True)
class HubRef:
    """A Hub id as a flag gave it."""

    kind: RepoKind
    repo_id: str
    revision: str | None = None  # a branch, tag or commit; None: the default branch
    split: str | None = None  # a data set's split; None: train

    def __str__(self) -> str:
        return self.repo_id if self.revision is None else f"{self.repo_id}@{self.revision}"

    @property
    def fetch_command(self) -> str:
        """The command that puts this repository into the Hugging Face cache."""
        words = ["hf download", self.repo_id]
        if self.kind is RepoKind.DATASET:
            words.append("--repo-type dataset")
        if self.revision is not None:
            words.append(f"--revision {self.revision}")
        return " ".join(words)


@dataclass(frozen=True, kw_only=True, slots=True)
class HubSnapshot:
    """A Hub id resolved: the commit and its folder in the Hugging Face cache."""

    ref: HubRef  # without a split: a data set's snapshot holds every split
    commit: str
    path: Path


def is_data_file_name(spec: str) -> bool:
    """Whether ``spec`` (before a ``:SPLIT`` or ``@REVISION``) ends in a data file's suffix: ``data/train.jsonl``,
    ``x.parquet``."""
    name = spec.partition(":")[0].partition("@")[0]
    return Path(name).suffix.lower() in DATA_FILE_SUFFIXES


def hub_ref(spec: str, kind: RepoKind) -> HubRef | None:
    """``spec`` as a Hub id of ``kind``, or None: a local path (which wins over a Hub id of the same name), a
    built-in name, a data file's name (for a data set: ``data/trian.jsonl`` is a missing file, never an id), or
    no Hub id at all. Only a data set's id takes a split."""
    match = _HUB_ID.fullmatch(spec)
    if match is None or Path(spec).exists() or Path(spec.partition(":")[0]).exists():
        return None
    if kind is RepoKind.DATASET and is_data_file_name(spec):
        return None
    if match["split"] is not None and kind is not RepoKind.DATASET:
        return None
    return HubRef(kind=kind, repo_id=match["repo_id"], revision=match["revision"], split=match["split"])


# What this process resolved, by (cache folder, kind, id, revision asked for): every use reads the same commit.
_snapshots: dict[tuple[str, RepoKind, str, str | None], HubSnapshot] = {}


def _key(ref: HubRef) -> tuple[str, RepoKind, str, str | None]:
    from huggingface_hub import constants

    return (constants.HF_HUB_CACHE, ref.kind, ref.repo_id, ref.revision)


def fetch(ref: HubRef) -> HubSnapshot:
    """``ref``'s snapshot in the Hugging Face cache, downloading what the cache lacks (unless offline); the same
    snapshot on every call in this process, and the same commit for every kind of one repository. Raises
    ``HubError``."""
    key = _key(ref)
    if key not in _snapshots:
        # A model's snapshot with its weights holds its config: nothing more to fetch.
        with_weights = (_snapshots.get(_key(replace(ref, kind=RepoKind.MODEL)))
                        if ref.kind is RepoKind.MODEL_CONFIG else None)
        _snapshots[key] = with_weights or _download(ref, _commit_found(ref) or ref.revision)
    return _snapshots[key]


def _commit_found(ref: HubRef) -> str | None:
    """The commit this process resolved ``ref``'s repository to for another kind, if it did."""

    def repository(key: tuple[str, RepoKind, str, str | None]) -> tuple[str, str, str, str | None]:
        cache, kind, repo_id, revision = key
        return cache, kind.repo_type, repo_id, revision

    wanted = repository(_key(ref))
    return next((snapshot.commit for key, snapshot in _snapshots.items() if repository(key) == wanted), None)


def pin(ref: HubRef, commit: str) -> HubSnapshot:
    """Resolve ``ref`` to ``commit`` (the one another process found) for the rest of this process."""
    _snapshots[_key(ref)] = snapshot = _download(ref, commit)
    return snapshot


def _download(ref: HubRef, revision: str | None) -> HubSnapshot:
    patterns = _FILES[ref.kind]
    folder = _snapshot_download(ref, revision, patterns)
    weights: tuple[str, ...] = ()
    if ref.kind is RepoKind.MODEL:  # then exactly the weights its index lists, at the commit just found
        assert patterns is not None
        weights = _weight_files(ref, folder)
        folder = _snapshot_download(ref, folder.name, (*patterns, *(glob.escape(name) for name in weights)))
    snapshot = HubSnapshot(ref=replace(ref, split=None), commit=folder.name, path=folder)  # one for every split
    _check_files(snapshot, weights)
    return snapshot


def _weight_files(ref: HubRef, folder: Path) -> tuple[str, ...]:
    """The safetensors files of a model's weights: the shards its ``SHARD_INDEX`` lists, else
    ``model.safetensors``."""
    index = folder / SHARD_INDEX
    if not index.is_file():
        return ("model.safetensors",)
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        return tuple(sorted({str(name) for name in weight_map.values()}))
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise HubError(f"the model repository {ref} (commit {folder.name}) has a {SHARD_INDEX} that is no safetensors "
                       f"index (a weight_map from each tensor to its file): {type(error).__name__}: {error}") from None


def _snapshot_download(ref: HubRef, revision: str | None, patterns: tuple[str, ...] | None) -> Path:
    """``snapshot_download`` of ``patterns``' files (None: all), its errors ``HubError``s naming ``ref`` and the
    fix."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HFValidationError,
        IncompleteSnapshotError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    what = f"the {ref.kind.repo_type} repository {ref}"
    fetch_it = f"fetch it with `{ref.fetch_command}` where the Hub can be reached"
    try:
        return Path(snapshot_download(ref.repo_id, repo_type=ref.kind.repo_type, revision=revision,
                                      allow_patterns=list(patterns) if patterns is not None else None))
    except HFValidationError as error:
        raise HubError(f"{ref.repo_id!r} is no local path, nor a valid Hugging Face Hub id: {error}") from None
    except GatedRepoError:  # before RepositoryNotFoundError, its base class
        page = f"{constants.ENDPOINT}/{'datasets/' if ref.kind is RepoKind.DATASET else ''}{ref.repo_id}"
        raise HubError(f"{what} is gated on the Hugging Face Hub: accept its conditions at {page}, and log this "
                       "machine in to that account (hf auth login, or HF_TOKEN)") from None
    except RepositoryNotFoundError:
        raise HubError(f"{what} is not on the Hugging Face Hub ({constants.ENDPOINT}), or is private and this "
                       "machine is not logged in to an account that can read it (hf auth login, or HF_TOKEN); no "
                       "local path has that name either") from None
    except RevisionNotFoundError:
        raise HubError(f"the {ref.kind.repo_type} repository {ref.repo_id} has no revision {revision!r} on the "
                       "Hugging Face Hub") from None
    except IncompleteSnapshotError:  # before LocalEntryNotFoundError, its base class
        raise HubError(f"the Hugging Face cache ({constants.HF_HUB_CACHE}) holds only part of {what} (an "
                       f"interrupted download?), and the Hub is not reached (HF_HUB_OFFLINE, or no network): "
                       f"{fetch_it}") from None
    except LocalEntryNotFoundError as error:
        if constants.HF_HUB_OFFLINE:
            raise HubError(f"{what} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}), and HF_HUB_OFFLINE "
                           f"is set: {fetch_it} (into this cache: the same HF_HOME or HF_HUB_CACHE), or unset "
                           "HF_HUB_OFFLINE; no local path has that name either") from None
        cause = error.__cause__
        reason = f"{type(cause).__name__}: {cause}" if cause is not None else str(error)
        raise HubError(f"the Hugging Face Hub ({constants.ENDPOINT}) could not be reached for {what}, which is not "
                       f"in the cache ({constants.HF_HUB_CACHE}): {reason}. Check the network (or HF_ENDPOINT, the "
                       f"proxy), or {fetch_it} and run with HF_HUB_OFFLINE=1") from None


def _check_files(snapshot: HubSnapshot, weights: tuple[str, ...]) -> None:
    """Refuse a snapshot without what its kind is read for (``weights``: a model's, ``_weight_files``), before a
    loader fails on it with less to say."""
    ref = snapshot.ref
    if ref.kind is RepoKind.MODEL:
        needed = [("config.json",), ("model.safetensors", SHARD_INDEX)]
        reader = "the trainer reads a transformers model: its config.json and safetensors weights"
    elif ref.kind is RepoKind.MODEL_CONFIG:
        needed = [("config.json",)]
        reader = "a model's shape is read from its config.json"
    elif ref.kind is RepoKind.TOKENIZER:
        needed = [("tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt", "tokenizer.model",
                   "spiece.model")]
        reader = "a transformers tokenizer has one of them"
    else:
        return
    completes = f"or the cache holds only part of it (`{ref.fetch_command}` completes it)"
    for names in needed:
        if not any((snapshot.path / name).is_file() for name in names):
            raise HubError(f"the {ref.kind.repo_type} repository {ref} (commit {snapshot.commit}) holds no "
                           f"{' or '.join(names)} ({reader}), {completes}")
    # Only an index's shards can be missing here: a lone model.safetensors was checked above.
    missing = [name for name in weights if not (snapshot.path / name).is_file()]
    if missing:
        raise HubError(f"the model repository {ref} (commit {snapshot.commit}) lacks {', '.join(missing)}, which its "
                       f"{SHARD_INDEX} lists among the {len(weights)} files of its weights: the repository is broken, "
                       f"{completes}")


def fetch_on_rank_0_first(
    parallel: ParallelContext, *, model: str, tokenizer: str | None = None, data: str | None = None,
    eval_data: str | None = None,
) -> None:
    """Resolve the run's Hub ids on rank 0 first, downloading what the cache lacks while the other ranks wait, then
    on every other rank at rank 0's commits (module docstring). Every rank calls it with the same flags; without a
    Hub id among them it returns at once, with no collective. A failure on rank 0 stops every rank: rank 0 raises
    its own error, the others a ``HubError`` (a user error) or a ``RuntimeError`` with its message."""
    import torch.distributed as dist

    wanted = [(f"{flag} {spec}", ref) for flag, spec, kind in (
        ("--model", model, RepoKind.MODEL), ("--tokenizer", tokenizer, RepoKind.TOKENIZER),
        ("--data", data, RepoKind.DATASET), ("--eval-data", eval_data, RepoKind.DATASET),
    ) if spec is not None and (ref := hub_ref(spec, kind)) is not None]
    if not wanted:
        return
    # Rank 0's answer: (a user error, the message) or None, and the commits it resolved, in the order of ``wanted``.
    answer: list[tuple[tuple[bool, str] | None, list[str]]] = [(None, [])]
    own_error: Exception | None = None  # rank 0's, raised as it is once the others have heard of it
    if parallel.is_main:
        commits: list[str] = []
        try:
            for given, ref in wanted:
                snapshot = _resolve(given, ref, commit=None)
                commits.append(snapshot.commit)
                logger.info("%s: commit %s in %s", given, snapshot.commit, snapshot.path)
            answer[0] = (None, commits)
        except HubError as error:
            answer[0], own_error = ((True, str(error)), []), error
        except Exception as error:  # every rank must hear of it: the others are waiting for these commits
            answer[0] = ((False, f"rank 0 could not fetch the run's Hub ids: {type(error).__name__}: {error}"), [])
            own_error = error
    dist.broadcast_object_list(answer, src=0, group=parallel.object_group)
    if own_error is not None:
        raise own_error  # with its traceback
    failure, commits = answer[0]
    if failure is not None:
        user_error, message = failure
        raise HubError(message) if user_error else RuntimeError(message)
    if not parallel.is_main:
        for (given, ref), commit in zip(wanted, commits, strict=True):
            _resolve(given, ref, commit=commit)


def _resolve(given: str, ref: HubRef, *, commit: str | None) -> HubSnapshot:
    """``fetch`` (or ``pin`` to ``commit``), its error naming the flag and spec ``given``."""
    try:
        return fetch(ref) if commit is None else pin(ref, commit)
    except HubError as error:
        raise HubError(f"{given}: {error}") from None
