"""A Hugging Face cache built in code, so that tests resolve Hub ids with no network.

``HubCache(root)`` writes the layout that ``huggingface_hub`` reads: ``models--ORG--NAME`` and
``datasets--ORG--NAME`` folders, each with ``refs/main`` holding a commit and ``snapshots/<commit>/`` holding the
repository's files. The cache ``hf download`` fills also has ``blobs/``, which the snapshot's files link to.
Reading needs only the snapshot.

- ``add_model`` puts the ``tiny`` catalogue model (seed 0, ``save_pretrained``, in one file or in shards with
  their index) and a tokenizer into one repository, as Hub model repositories hold them.
- ``add_model_config`` puts the ``tiny`` model's ``config.json`` alone into one, as ``hf download ORG/NAME
  config.json`` leaves a model in the cache: enough for its shape, not for training.
- ``add_dataset`` puts records into one repository, one parquet or JSONL file per split, named as the Hub's
  parquet files are named.
- ``offline(monkeypatch)`` points this process at the cache, offline: ``huggingface_hub``'s and ``datasets``'
  settings, which they read when imported, and the environment.
- ``env()`` does the same for a subprocess (torchrun).

``save_tokenizer`` is the tests' tokenizer, ``skrull-tokenizer``'s (``trainer_client.chat_tokenizer``): a byte-level
BPE trained on a few KB of ``WORDS``, with a ChatML template.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from trainer_client.chat_tokenizer import WORDS, save_chat_tokenizer
from trainer_client.config_choices import CHAT_TEMPLATES

__all__ = ["CHATML", "WORDS", "HubCache", "commit_of", "save_tiny_model", "save_tokenizer"]

CHATML = CHAT_TEMPLATES["chatml"]


def save_tokenizer(folder: Path) -> Path:
    """The tests' tokenizer, ``skrull-tokenizer``'s with its defaults: a byte-level BPE of 320 tokens trained on a
    few KB of ``WORDS``, with a ChatML template, saved in ``folder`` as a Hub tokenizer is."""
    save_chat_tokenizer(folder)
    return folder


def save_tiny_model(folder: Path, *, max_shard_size: str | None = None) -> Path:
    """The ``tiny`` catalogue model with seed 0 (what ``build_model("tiny", seed=0)`` makes), saved in ``folder``:
    in one file, or in shards of at most ``max_shard_size`` (``"300KB"``) with ``model.safetensors.index.json``."""
    from trainer_client.models.model import build_model

    model = build_model("tiny", seed=0)
    if max_shard_size is None:
        model.save_pretrained(folder)
    else:
        model.save_pretrained(folder, max_shard_size=max_shard_size)
    return folder


def commit_of(text: str) -> str:
    """A commit hash, as the Hub's are (40 hex digits), derived from ``text``."""
    return hashlib.sha1(text.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class HubCache:
    """A Hugging Face cache folder (``HF_HUB_CACHE``); datasets' Arrow cache lies beside it."""

    root: Path

    @property
    def datasets_cache(self) -> Path:
        return self.root.parent / f"{self.root.name}-datasets"

    def snapshot(self, repo_id: str, *, repo_type: str = "model", commit: str | None = None) -> Path:
        """An empty snapshot folder of ``repo_id`` at ``commit``, which ``refs/main`` now names; fill it."""
        from huggingface_hub.file_download import repo_folder_name

        storage = self.root / repo_folder_name(repo_id=repo_id, repo_type=repo_type)
        commit = commit or commit_of(f"{repo_type}:{repo_id}")
        (storage / "refs").mkdir(parents=True, exist_ok=True)
        (storage / "refs" / "main").write_text(commit)
        folder = storage / "snapshots" / commit
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    def add_model(self, repo_id: str, *, commit: str | None = None, max_shard_size: str | None = None) -> Path:
        """The ``tiny`` model (seed 0; in shards of at most ``max_shard_size``) and the tests' tokenizer as a model
        repository; its snapshot folder."""
        folder = self.snapshot(repo_id, commit=commit)
        save_tiny_model(folder, max_shard_size=max_shard_size)
        save_tokenizer(folder)
        return folder

    def add_model_config(self, repo_id: str, *, commit: str | None = None) -> Path:
        """The ``tiny`` model's ``config.json`` alone as a model repository in the cache; its snapshot folder."""
        from trainer_client.models.model import model_config

        folder = self.snapshot(repo_id, commit=commit)
        model_config("tiny").save_pretrained(folder)
        return folder

    def add_dataset(self, repo_id: str, splits: Mapping[str, Sequence[Mapping[str, object]]], *,
                    file_format: str = "parquet", commit: str | None = None) -> Path:
        """``splits``' records as a data set repository, ``data/<split>-00000-of-00001.<parquet|jsonl>`` each;
        its snapshot folder."""
        folder = self.snapshot(repo_id, repo_type="dataset", commit=commit)
        (folder / "data").mkdir(exist_ok=True)
        for split, records in splits.items():
            path = folder / "data" / f"{split}-00000-of-00001.{file_format}"
            if file_format == "parquet":
                import pyarrow as pa
                import pyarrow.parquet as pq

                pq.write_table(pa.Table.from_pylist([dict(record) for record in records]), path)
            elif file_format == "jsonl":
                path.write_text("".join(json.dumps(record) + "\n" for record in records))
            else:
                raise ValueError(f"file_format {file_format!r}: parquet or jsonl")
        return folder

    def env(self) -> dict[str, str]:
        """The environment of a process that reads this cache alone, offline."""
        return {"HF_HUB_CACHE": str(self.root), "HF_HUB_OFFLINE": "1", "HF_DATASETS_CACHE": str(self.datasets_cache)}

    def offline(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Point this process at the cache, offline, until the test ends: ``huggingface_hub`` and ``datasets``
        read these settings when imported, so their module attributes are set as well as the environment."""
        import datasets.config
        from huggingface_hub import constants

        for name, value in self.env().items():
            monkeypatch.setenv(name, value)
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(self.root))
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
        monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
        monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", self.datasets_cache)
