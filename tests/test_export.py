"""The trained model leaves as a Hugging Face folder: written by ``--output-dir`` under every sharding mode, or by
``skrull-export`` from any checkpoint, it loads with transformers and computes the trained model's logits; bad
flags and folders stop with an error naming them before any work."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from tokenizers import Tokenizer, models, pre_tokenizers
from torch.distributed.tensor import DTensor
from torch.multiprocessing import ProcessRaisedException
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from tests.job_store_backends import read_only, small_tmpfs
from trainer_client.components.checkpoint import COMPLETE, RUN_IDENTITY, saved_run_identity, step_dir
from trainer_client.components.model_export import main as export_main
from trainer_client.components.run_identity import model_identity
from trainer_client.config import TrainConfig
from trainer_client.demo import trainer_env
from trainer_client.distributed import ParallelDims, init_parallel, spawn_gloo
from trainer_client.models.model import build_model
from trainer_client.models.parallelize import Sharding
from trainer_client.train import main as train_main
from trainer_client.trainer import Trainer

# dp 3: FSDP splits the tiny model's 64-wide rows unevenly (22, 21, 21), so the gather must strip its padding.
DP, CP, STEPS, GLOBAL_BATCH, BUCKET_SIZE = 3, 1, 2, 6, 512
SHARDINGS = [sharding.value for sharding in Sharding]
INPUT_IDS = torch.tensor([[5, 17, 300, 2, 911, 64, 64, 1000, 3]])
FOLDER_FILES = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                "tokenizer_config.json"}


def _tokenizer_folder(parent: Path) -> Path:
    """Any tokenizer saved like a hub one: the folder must carry it, whatever it is."""
    vocabulary = {"<unk>": 0, "long": 1, "context": 2}
    tokenizer = Tokenizer(models.WordLevel(vocabulary, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    folder = parent / "tokenizer"
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>").save_pretrained(folder)
    return folder


def _config(**changes: object) -> TrainConfig:
    base: dict[str, object] = dict(dp=DP, cp=CP, model="tiny", data="synthetic:lmsys", global_batch=GLOBAL_BATCH,
                                   steps=STEPS, bucket_size=BUCKET_SIZE, seed=0, progress=False)
    return TrainConfig(**{**base, **changes})  # type: ignore[arg-type]


def _train_every_sharding(out_dir: Path) -> None:
    """Each mode's run exports after every step; rank 0 then saves the weights the run ended with, gathered
    from the live (sharded) model tensor by tensor: the reference the folders are checked against."""
    for sharding in SHARDINGS:
        config = _config(sharding=sharding, checkpoint_dir=out_dir / f"checkpoints-{sharding}",
                         checkpoint_every=1, output_dir=out_dir / f"model-{sharding}", export_every=1,
                         tokenizer=str(out_dir / "tokenizer"))
        trainer = Trainer(config, init_parallel(ParallelDims.of(config)))
        try:
            trainer.train()
            trained = {name: tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
                       for name, tensor in trainer.module.lm.state_dict().items()}
        finally:
            trainer.close()
        if dist.get_rank() == 0:
            torch.save(trained, out_dir / f"trained-{sharding}.pt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out_dir = tmp_path_factory.mktemp("export")
    _tokenizer_folder(out_dir)
    spawn_gloo(_train_every_sharding, DP * CP, out_dir)
    return out_dir


def _checkpoint_with_record(checkpoint: Path, destination: Path, record: str | None) -> Path:
    """``checkpoint``'s DCP files, linked, beside another ``run.json`` (or none)."""
    destination.mkdir(parents=True)
    for part in checkpoint.iterdir():
        if part.name != RUN_IDENTITY:
            (destination / part.name).symlink_to(part)
    if record is not None:
        (destination / RUN_IDENTITY).write_text(record)
    return destination


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        logits: torch.Tensor = model(input_ids=INPUT_IDS).logits
    return logits


def _trained_model(runs: Path, sharding: str) -> torch.nn.Module:
    model = build_model("tiny", attn_implementation="sdpa")
    model.load_state_dict(torch.load(runs / f"trained-{sharding}.pt"))
    return model


def _same_folder(first: Path, second: Path) -> None:
    """Equal weights (every tensor bit for bit), config and generation config."""
    first_weights, second_weights = load_file(first / "model.safetensors"), load_file(second / "model.safetensors")
    assert first_weights.keys() == second_weights.keys()
    for name, tensor in first_weights.items():
        assert torch.equal(tensor, second_weights[name]), name
    for config in ("config.json", "generation_config.json"):
        assert json.loads((first / config).read_text()) == json.loads((second / config).read_text())


@pytest.mark.slow
@pytest.mark.parametrize("sharding", SHARDINGS)
def test_output_dir_holds_a_folder_transformers_loads_with_the_trained_models_logits(
    runs: Path, sharding: str
) -> None:
    folder = runs / f"model-{sharding}"
    assert {path.name for path in folder.iterdir()} >= FOLDER_FILES
    exported = AutoModelForCausalLM.from_pretrained(folder)
    trained_logits = _logits(_trained_model(runs, sharding))
    untrained_logits = _logits(build_model("tiny", attn_implementation="sdpa"))
    assert not torch.allclose(trained_logits, untrained_logits)  # so equal logits mean the trained weights
    torch.testing.assert_close(_logits(exported), trained_logits)
    assert exported.config.tie_word_embeddings and exported.lm_head.weight is exported.model.embed_tokens.weight


@pytest.mark.slow
def test_export_every_writes_earlier_steps_into_step_folders_and_the_last_into_output_dir_itself(runs: Path) -> None:
    folder = runs / "model-zero2"
    assert sorted(path.name for path in folder.iterdir() if path.is_dir()) == [step_dir(folder, 1).name]
    first_step = load_file(step_dir(folder, 1) / "model.safetensors")
    last_step = load_file(folder / "model.safetensors")
    assert not all(torch.equal(tensor, last_step[name]) for name, tensor in first_step.items())
    # AutoTokenizer would pick the class of the config's model type (Qwen2Tokenizer), not this made-up one's
    tokenizer = PreTrainedTokenizerFast.from_pretrained(step_dir(folder, 1))
    assert tokenizer("long context")["input_ids"] == [1, 2]


@pytest.mark.slow
@pytest.mark.parametrize("sharding", SHARDINGS)
def test_skrull_export_of_a_checkpoint_writes_the_folder_the_trainer_exported_at_its_step(
    runs: Path, sharding: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    checkpoints, exported = runs / f"checkpoints-{sharding}", runs / f"model-{sharding}"
    # the --checkpoint-dir (its latest: the last step), and a step folder of an earlier step
    assert export_main([str(checkpoints), str(tmp_path / "last"), "--tokenizer", str(runs / "tokenizer")]) == 0
    assert export_main([str(step_dir(checkpoints, 1)), str(tmp_path / "first")]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"exported {step_dir(checkpoints, STEPS)} to {tmp_path / 'last'}",
        f"exported {step_dir(checkpoints, 1)} to {tmp_path / 'first'}",
    ]
    _same_folder(tmp_path / "last", exported)
    _same_folder(tmp_path / "first", step_dir(exported, 1))
    assert {path.name for path in (tmp_path / "last").iterdir()} >= FOLDER_FILES


@pytest.mark.slow
def test_skrull_export_runs_as_a_module_in_one_process(runs: Path, tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "trainer_client.export", str(runs / "checkpoints-zero3"),
                             str(tmp_path / "model")], env=trainer_env(), capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    _same_folder(tmp_path / "model", runs / "model-zero3")


@contextlib.contextmanager
def _unwritable_folder(tmp_path: Path) -> Iterator[Path]:
    """A folder this process may not write in: by its mode, or for root (whom modes do not stop) a read-only
    tmpfs."""
    folder = tmp_path / "read-only"
    if os.geteuid() != 0:
        folder.mkdir(mode=0o500)
        try:
            yield folder
        finally:
            folder.chmod(0o700)
        return
    with small_tmpfs(folder) as mount_point, read_only(mount_point):
        yield mount_point


def test_rejects_an_output_dir_whose_parent_is_missing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    output_dir = tmp_path / "missing" / "model"
    message = f"--output-dir {output_dir}: its parent directory {tmp_path / 'missing'} does not exist"
    with pytest.raises(ValueError, match=message):
        _config(output_dir=output_dir)
    # the CLI: exit status 2 and the message, before any process group or model is set up
    assert train_main(["--dp", "1", "--cp", "1", "--output-dir", str(output_dir)]) == 2
    assert capsys.readouterr().err == f"error: {message}\n"
    assert not dist.is_initialized()


def test_rejects_an_output_dir_that_cannot_be_written(tmp_path: Path) -> None:
    with _unwritable_folder(tmp_path) as folder:
        with pytest.raises(ValueError, match=f"--output-dir {folder / 'model'}: {folder} is not writable"):
            _config(output_dir=folder / "model")
        with pytest.raises(ValueError, match=f"--output-dir {folder}: {folder} is not writable"):
            _config(output_dir=folder)
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match=f"--output-dir {tmp_path / 'file'} is not a directory"):
        _config(output_dir=tmp_path / "file")


@pytest.mark.parametrize(("changes", "message"), [
    ({"export_every": 2}, "--export-every needs --output-dir"),
    ({"export_every": 0, "output_dir": "model"}, "--export-every must be positive, got 0"),
    ({"export_every": -1, "output_dir": "model"}, "--export-every must be positive, got -1"),
    ({"output_dir": "same", "checkpoint_dir": "same"}, "--output-dir and --checkpoint-dir are both"),
])
def test_rejects_export_flags_that_do_not_go_together(
    tmp_path: Path, changes: dict[str, object], message: str
) -> None:
    folders = {key: tmp_path / str(value) for key, value in changes.items() if key.endswith("_dir")}
    with pytest.raises(ValueError, match=message):
        _config(**{**changes, **folders})


@pytest.mark.slow
def test_every_rank_stops_before_training_on_a_bad_output_dir(tmp_path: Path) -> None:
    metrics_out = tmp_path / "metrics.jsonl"
    output_dir = tmp_path / "missing" / "model"
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "trainer_client.train", "--dp", "2", "--cp", "1", "--no-progress", "--metrics-out", str(metrics_out),
         "--output-dir", str(output_dir), "--export-every", "1"],
        env=trainer_env(), capture_output=True, text=True, timeout=180, check=False,
    )
    assert result.returncode != 0
    assert result.stderr.count(f"error: --output-dir {output_dir}: its parent directory") == 1, result.stderr[-3000:]
    assert not metrics_out.exists()


def _start_trainer(config: TrainConfig) -> None:
    Trainer(config, init_parallel(ParallelDims.of(config))).close()


@pytest.mark.slow
def test_a_bad_tokenizer_stops_the_trainer_before_it_trains_not_at_its_export(tmp_path: Path) -> None:
    no_tokenizer = tmp_path / "no-tokenizer"
    config = _config(dp=1, cp=1, output_dir=tmp_path / "model", tokenizer=str(no_tokenizer))
    with pytest.raises(ProcessRaisedException, match=f"--tokenizer '{no_tokenizer}' is not a local tokenizer"):
        spawn_gloo(_start_trainer, 1, config)


@pytest.mark.parametrize("kind", ["empty folder", "file", "missing"])
def test_skrull_export_refuses_a_folder_that_is_no_checkpoint(
    kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "not-a-checkpoint"
    if kind == "empty folder":
        path.mkdir()
    elif kind == "file":
        path.write_text("")
    assert export_main([str(path), str(tmp_path / "model")]) == 2
    assert capsys.readouterr().err == (f"error: {path} is not a checkpoint of the trainer: it holds neither a complete "
                                       "step-<n> folder (a --checkpoint-dir) nor DCP metadata (a step-<n> folder)\n")
    assert not (tmp_path / "model").exists()


@pytest.mark.slow
def test_skrull_export_refuses_bad_arguments_naming_them(
    runs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    checkpoints = runs / "checkpoints-zero2"
    latest = step_dir(checkpoints, STEPS)
    without_record = _checkpoint_with_record(latest, tmp_path / "without-record" / latest.name, None)
    cut_short = tmp_path / "cut-short"  # its steps' data is whole, but none was marked complete
    for step in (1, STEPS):
        shutil.copytree(step_dir(checkpoints, step), step_dir(cut_short, step), ignore=shutil.ignore_patterns(COMPLETE))
    cases = [
        ([str(cut_short), str(tmp_path / "model")],
         f"{cut_short} is not a checkpoint of the trainer: it holds neither a complete step-<n> folder (a "
         f"--checkpoint-dir) nor DCP metadata (a step-<n> folder); none of its step folders is complete "
         f"({step_dir(cut_short, 1).name}, {step_dir(cut_short, STEPS).name}): give one to read it as it is"),
        ([str(checkpoints), str(tmp_path / "missing" / "model")],
         f"OUT_DIR {tmp_path / 'missing' / 'model'}: its parent directory {tmp_path / 'missing'} does not exist"),
        ([str(checkpoints), str(tmp_path / "model"), "--model", "small"],
         f"--model small is not the model checkpoint {latest} was trained from: its run.json records tiny, "
         "--model is small"),
        ([str(without_record), str(tmp_path / "model")],
         f"checkpoint {without_record} has no record of the model that trained it: give --model"),
        ([str(checkpoints), str(tmp_path / "model"), "--tokenizer", str(tmp_path / "no-tokenizer")],
         f"--tokenizer {str(tmp_path / 'no-tokenizer')!r} is not a local tokenizer directory, nor a Hugging Face Hub "
         "id (ORG/NAME[@REVISION])"),
    ]
    for argv, message in cases:
        assert export_main(argv) == 2, argv
        assert capsys.readouterr().err == f"error: {message}\n"
        assert not (tmp_path / "model").exists()


@pytest.mark.slow
def test_skrull_export_of_a_run_trained_from_a_local_folder_takes_that_folder_as_model(
    runs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base_model = runs / "model-zero2"  # an exported folder, as the --model of a further fine-tuning run
    first_step = step_dir(runs / "checkpoints-zero2", 1)
    saved = saved_run_identity(first_step)
    assert saved is not None
    record = dataclasses.replace(saved, model=model_identity(str(base_model)))
    checkpoint = _checkpoint_with_record(first_step, tmp_path / "checkpoint" / first_step.name, record.to_json())
    assert export_main([str(checkpoint), str(tmp_path / "model")]) == 2
    assert capsys.readouterr().err == (f"error: checkpoint {checkpoint} was trained from a local model folder "
                                       f"({record.model}): give that folder as --model\n")
    assert export_main([str(checkpoint), str(tmp_path / "model"), "--model", str(base_model)]) == 0
    _same_folder(tmp_path / "model", step_dir(base_model, 1))  # the checkpoint's weights, not the folder's
    # a record of where the model was read (the trainer writes it): no --model needed while the folder holds it
    recorded = dataclasses.replace(record, model_source=str(base_model.resolve()))
    checkpoint = _checkpoint_with_record(first_step, tmp_path / "sourced" / first_step.name, recorded.to_json())
    assert export_main([str(checkpoint), str(tmp_path / "sourced-model")]) == 0
    _same_folder(tmp_path / "sourced-model", step_dir(base_model, 1))
    moved = dataclasses.replace(record, model_source=str(tmp_path / "moved"))
    checkpoint = _checkpoint_with_record(first_step, tmp_path / "moved-record" / first_step.name, moved.to_json())
    capsys.readouterr()
    assert export_main([str(checkpoint), str(tmp_path / "moved-model")]) == 2
    assert capsys.readouterr().err == (f"error: checkpoint {checkpoint} was trained from {tmp_path / 'moved'}, which "
                                       f"no longer holds that model ({record.model}): give the model's folder or Hub "
                                       "id as --model\n")
