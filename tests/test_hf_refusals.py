"""What ``SkrullTrainer`` and ``SkrullSFTTrainer`` cannot run is refused by name when they are built, before any
step and before any process group: a model whose attention DACP cannot replace, a collator that packs by itself,
batch settings that contradict the plan, a CP degree the world size does not divide, a length-grouping sampler,
TRL's packing and padding-free collation, NEFTune, and a TRL outside the tested range. One process, no training."""

from __future__ import annotations

import logging
import tomllib
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from packaging.specifiers import SpecifierSet
from transformers import BloomConfig, BloomForCausalLM, DataCollatorWithFlattening

from tests.hf_runs import PaddingCollator, batches, dataset, records, training_arguments
from tests.hub_cache import save_tokenizer
from trainer_client.hf import SkrullArguments, SkrullSFTTrainer, SkrullTrainer
from trainer_client.hf.versions import TESTED, check_versions
from trainer_client.models.model import build_model

ROOT = Path(__file__).resolve().parents[1]
# TRL 1.16's SFTConfig defaults the name transformers 5.23 deprecated (gradient_checkpointing=True)
SFT_CONFIG_WARNING = "ignore:`gradient_checkpointing` is deprecated:FutureWarning"


def _rows() -> list[dict[str, list[int]]]:
    return records(batches(num_steps=1, global_batch=4, max_length=64, seed=0))


def _build(tmp_path: Path, *, model: Any = None, collator: Any = None, skrull: SkrullArguments | None = None,
           **arguments: Any) -> None:
    SkrullTrainer(model=model if model is not None else build_model("tiny", attn_implementation="sdpa", seed=0),
                  args=training_arguments(tmp_path, **{"per_device_train_batch_size": 4, **arguments}),
                  train_dataset=dataset(_rows()), data_collator=collator or PaddingCollator(),
                  skrull=skrull or SkrullArguments(bucket_size=128))


@pytest.mark.parametrize(("build", "message"), [
    pytest.param({"model": BloomForCausalLM(BloomConfig(vocab_size=1024, hidden_size=32, n_layer=1, n_head=2))},
                 r"model BloomForCausalLM: its attention cannot be replaced by DACP attention", id="model"),
    pytest.param({"collator": DataCollatorWithFlattening()},
                 r"data_collator packs by itself: it collated 2 examples into 1 row\(s\)", id="packing-collator"),
    pytest.param({"gradient_accumulation_steps": 3, "skrull": SkrullArguments(bucket_size=128, global_batch=16)},
                 r"per_device_train_batch_size 4 × gradient_accumulation_steps 3 × dp 1 = 12 sequences per optimizer "
                 r"step contradicts SkrullArguments.global_batch 16", id="gradient-accumulation"),
    pytest.param({"per_device_train_batch_size": 2, "skrull": SkrullArguments(bucket_size=128, global_batch=16)},
                 r"per_device_train_batch_size 2 × gradient_accumulation_steps 1 × dp 1 = 2 sequences", id="batch"),
    pytest.param({"skrull": SkrullArguments(bucket_size=128, cp=2)},
                 r"SkrullArguments.cp 2 does not divide the world size 1", id="cp"),
    pytest.param({"train_sampling_strategy": "group_by_length"},
                 r"train_sampling_strategy: 'group_by_length' groups sequences by length", id="sampler"),
    pytest.param({"neftune_noise_alpha": 5.0},
                 r"neftune_noise_alpha: NEFTune's noise is alpha / sqrt\(row length × hidden size\) of a forward's "
                 r"row, in the Trainer and TRL a padded batch's length", id="neftune"),
])
def test_the_trainer_refuses_what_skrull_cannot_run_by_name_before_any_process_group(
    tmp_path: Path, build: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        _build(tmp_path, **build)
    assert not dist.is_initialized()


def test_processes_accelerate_would_train_each_alone_are_refused_naming_use_cpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun launches two processes: without GPUs, accelerate sees one
    with pytest.raises(ValueError, match=r"use_cpu: torchrun launched 2 processes and accelerate trains with 1"):
        _build(tmp_path, use_cpu=False)
    assert not dist.is_initialized()


def _sft(tmp_path: Path, **config: Any) -> None:
    from transformers import AutoTokenizer
    from trl import SFTConfig

    chats = [{"messages": [{"role": "user", "content": "how long"}, {"role": "assistant", "content": "the model"}]}]
    SkrullSFTTrainer(model=build_model("tiny", attn_implementation="sdpa", seed=0),
                     args=SFTConfig(output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False, report_to=[],
                                    **config),
                     train_dataset=dataset(chats * 4),
                     processing_class=AutoTokenizer.from_pretrained(save_tokenizer(tmp_path / "tokenizer")),
                     skrull=SkrullArguments(bucket_size=128))


@pytest.mark.filterwarnings(SFT_CONFIG_WARNING)
@pytest.mark.parametrize(("config", "message"), [
    ({"packing": True}, r"packing: TRL would pack documents into max_length rows before Skrull sees them"),
    ({"padding_free": True}, r"padding_free: TRL's padding-free collator flattens a batch into one row"),
])
def test_the_sft_trainer_refuses_trls_own_packing_by_name(tmp_path: Path, config: dict[str, Any],
                                                           message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _sft(tmp_path, **config)
    assert not dist.is_initialized()


@pytest.mark.filterwarnings(SFT_CONFIG_WARNING)
def test_the_sft_trainer_refuses_a_trl_outside_the_tested_range(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # An installed TRL 1.15.0, as importlib.metadata finds it: its metadata first on the path.
    metadata = tmp_path / "site" / "trl-1.15.0.dist-info"
    metadata.mkdir(parents=True)
    (metadata / "METADATA").write_text("Metadata-Version: 2.1\nName: trl\nVersion: 1.15.0\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    with pytest.raises(ValueError, match=r"trl 1.15.0 is outside the range the Skrull Trainer integration is tested "
                                         r"with, trl<1.17,>=1.16: pip install 'skrull\[trl\]'"):
        _sft(tmp_path)


def test_transformers_or_accelerate_outside_the_tested_range_is_named_in_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="trainer_client.hf"):
        check_versions(("transformers", "accelerate"), installed={"transformers": "5.22.0", "accelerate": "1.15.2"})
    assert [record.getMessage().split(";")[0] for record in caplog.records] == [
        "transformers 5.22.0 is outside the range the Skrull Trainer integration is tested with, "
        f"transformers{TESTED['transformers']}"]


def test_the_tested_releases_are_the_pinned_ones_and_the_trl_extras_range() -> None:
    pins = dict(line.split("==") for line in (ROOT / "constraints.txt").read_text().split() if "==" in line)
    assert all(pins[package] in TESTED[package] for package in TESTED)
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (trl,) = [requirement for requirement in extras["trl"] if requirement.startswith("trl")]
    assert SpecifierSet(trl.removeprefix("trl")) == TESTED["trl"]
