"""LoRA (``--lora-rank``): only the adapters train, every scheduler and sharding mode gives static CP's losses, the
memory model grows the BucketSize, and the result leaves as a merged model or an adapter that transformers and
peft load with the trained logits (4 gloo ranks, dp 2 × cp 2, fp32)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from peft import PeftModel
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from trainer_client.components.checkpoint import latest_checkpoint, saved_run_identity
from trainer_client.components.model_export import main as export_main
from trainer_client.components.run_identity import Change, RunIdentity, differences
from trainer_client.config import TrainConfig
from trainer_client.data import DataIdentity
from trainer_client.distributed import ParallelDims, init_parallel, spawn_gloo
from trainer_client.models.lora import LORA_TARGETS, LoraSettings, apply_lora, check_lora_targets
from trainer_client.models.model import build_model
from trainer_client.trainer import Trainer

DP, CP, STEPS = 2, 2, 2
RANK, ALPHA = 4, 16
INPUT_IDS = torch.tensor([[5, 17, 300, 2, 911, 64, 64, 1000, 3]])
# (name, scheduler, sharding, activation checkpointing, export); "adapter" trains the base folder written first
RUNS = (
    ("zero2", "skrull", "zero2", "none", "merged"),
    ("zero2_static_cp", "deepspeed", "zero2", "none", "merged"),
    ("zero3_full", "skrull", "zero3", "full", "merged"),
    ("none_selective", "skrull", "none", "selective", "merged"),
    ("adapter", "skrull", "zero2", "none", "adapter"),
)


def _config(**changes: object) -> TrainConfig:
    base: dict[str, object] = dict(dp=DP, cp=CP, model="tiny", data="synthetic:lmsys", global_batch=8, steps=STEPS,
                                   bucket_size=512, seed=0, progress=False, lr=1e-2, lora_rank=RANK,
                                   lora_alpha=ALPHA)
    return TrainConfig(**{**base, **changes})  # type: ignore[arg-type]


def _train_every_run(out_dir: Path) -> None:
    parallel = init_parallel(ParallelDims.of(_config()))
    results: dict[str, object] = {}
    for name, scheduler, sharding, checkpointing, export in RUNS:
        model = str(out_dir / "base") if export == "adapter" else "tiny"
        config = _config(model=model, scheduler=scheduler, sharding=sharding, activation_checkpointing=checkpointing,
                         checkpoint_dir=out_dir / f"checkpoints-{name}", output_dir=out_dir / f"model-{name}",
                         export_lora=export)
        trainer = Trainer(config, parallel)
        try:
            history = trainer.train()
            trained = {key: tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
                       for key, tensor in trainer.module.lm.state_dict().items()}
            trainable = sorted(key for key, param in trainer.module.lm.named_parameters() if param.requires_grad)
        finally:
            trainer.close()
        if parallel.is_main:
            torch.save(trained, out_dir / f"trained-{name}.pt")
            results[name] = {"losses": [m.loss for m in history], "trainable": trainable}
    buckets = {}
    for lora_rank in (None, RANK):
        trainer = Trainer(_config(bucket_size=None, profile="h100-paper", lora_rank=lora_rank,
                                  lora_alpha=ALPHA if lora_rank else None), parallel)
        buckets[str(lora_rank)] = trainer.bucket_size
        trainer.close()
    if parallel.is_main:
        results["buckets"] = buckets
        (out_dir / "results.json").write_text(json.dumps(results))
    dist.barrier()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, dict]]:
    out_dir = tmp_path_factory.mktemp("lora")
    build_model("tiny", seed=1).save_pretrained(out_dir / "base")  # a local base model, as a user's checkpoint
    spawn_gloo(_train_every_run, DP * CP, out_dir)
    return out_dir, json.loads((out_dir / "results.json").read_text())


def _adapted(model: str, trained: Path) -> torch.nn.Module:
    """The model a run trained, rebuilt in this process: the base, its adapters, the trained weights."""
    lm = build_model(model, attn_implementation="sdpa")
    apply_lora(lm, LoraSettings(rank=RANK, alpha=ALPHA))
    lm.load_state_dict(torch.load(trained))
    return lm


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        logits: torch.Tensor = model(input_ids=INPUT_IDS).logits
    return logits


@pytest.mark.slow
def test_only_the_adapters_train_and_the_base_weights_stay_as_they_were(runs: tuple[Path, dict[str, dict]]) -> None:
    out_dir, results = runs
    trainable = results["zero2"]["trainable"]
    assert trainable and all(".lora_A." in name or ".lora_B." in name for name in trainable)
    assert {name.split(".")[-4] for name in trainable} == set(LORA_TARGETS)
    untrained = build_model("tiny").state_dict()
    trained = torch.load(out_dir / "trained-zero2.pt")
    for name, tensor in trained.items():
        base_name = name.replace(".base_layer", "")
        if "lora_" not in name:
            assert torch.equal(tensor, untrained[base_name]), name
    assert any(not torch.equal(trained[name], torch.zeros_like(trained[name]))
               for name in trainable if ".lora_B." in name)  # lora_B starts at zero: it moved


@pytest.mark.slow
@pytest.mark.parametrize("name", ["zero2", "zero3_full", "none_selective"])
def test_lora_losses_equal_static_cp_at_every_step_under_every_sharding(
    runs: tuple[Path, dict[str, dict]], name: str
) -> None:
    _, results = runs
    torch.testing.assert_close(results[name]["losses"], results["zero2_static_cp"]["losses"], rtol=1e-5, atol=0)


@pytest.mark.slow
def test_lora_grows_the_bucket_size_the_trainer_derives(runs: tuple[Path, dict[str, dict]]) -> None:
    _, results = runs
    assert results["buckets"][str(RANK)] > results["buckets"]["None"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["zero2", "zero3_full", "none_selective"])
def test_the_merged_export_loads_in_transformers_with_the_trained_logits(
    runs: tuple[Path, dict[str, dict]], name: str
) -> None:
    out_dir, _ = runs
    exported = AutoModelForCausalLM.from_pretrained(out_dir / f"model-{name}")
    assert not any("lora" in key for key in exported.state_dict())  # a plain model: the adapters are merged
    trained_logits = _logits(_adapted("tiny", out_dir / f"trained-{name}.pt"))
    assert not torch.allclose(trained_logits, _logits(build_model("tiny", attn_implementation="sdpa")))
    torch.testing.assert_close(_logits(exported), trained_logits)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")  # peft 0.21 on transformers 5
def test_the_adapter_export_loads_with_peft_on_its_base_folder(runs: tuple[Path, dict[str, dict]]) -> None:
    out_dir, _ = runs
    adapter = out_dir / "model-adapter"
    assert {path.name for path in adapter.iterdir()} >= {"adapter_config.json", "adapter_model.safetensors"}
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == str(
        out_dir / "base")
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(out_dir / "base"), adapter)
    torch.testing.assert_close(_logits(loaded), _logits(_adapted(str(out_dir / "base"),
                                                                 out_dir / "trained-adapter.pt")))


@pytest.mark.slow
def test_skrull_export_of_a_lora_checkpoint_writes_the_trainers_folder(
    runs: tuple[Path, dict[str, dict]], tmp_path: Path
) -> None:
    out_dir, _ = runs
    assert export_main([str(out_dir / "checkpoints-zero2"), str(tmp_path / "merged")]) == 0
    exported, trainer_export = load_file(tmp_path / "merged" / "model.safetensors"), load_file(
        out_dir / "model-zero2" / "model.safetensors")
    assert exported.keys() == trainer_export.keys()
    for key, tensor in exported.items():
        assert torch.equal(tensor, trainer_export[key]), key
    assert export_main([str(out_dir / "checkpoints-adapter"), str(tmp_path / "adapter"), "--model",
                        str(out_dir / "base"), "--lora", "adapter"]) == 0
    assert load_file(tmp_path / "adapter" / "adapter_model.safetensors").keys() == load_file(
        out_dir / "model-adapter" / "adapter_model.safetensors").keys()


@pytest.mark.slow
def test_skrull_export_refuses_an_adapter_of_a_run_without_lora(
    runs: tuple[Path, dict[str, dict]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_dir, _ = runs
    checkpoint = out_dir / "checkpoints-zero2"
    newest = latest_checkpoint(checkpoint)
    assert newest is not None
    saved = saved_run_identity(newest)
    assert saved is not None and saved.lora == LoraSettings(rank=RANK, alpha=ALPHA)
    assert export_main([str(checkpoint), str(tmp_path / "adapter"), "--lora", "adapter"]) == 2
    assert "give the folder (or Hugging Face Hub id) the run was trained from as --model" in capsys.readouterr().err


def test_a_resume_with_other_adapters_is_refused() -> None:
    identity = RunIdentity(model="tiny", dp=1, cp=1, global_batch=8, data=DataIdentity(source="s", fingerprint="f"),
                           steps=4, warmup_steps=0, lr=1e-3, min_lr_ratio=0.1, lora=LoraSettings(rank=8, alpha=16))
    for other in (None, LoraSettings(rank=16, alpha=16), LoraSettings(rank=8, alpha=16, targets=("q_proj",))):
        found = differences(identity, dataclasses.replace(identity, lora=other))
        assert [(d.item, d.change) for d in found] == [("--lora-rank, --lora-alpha, --lora-targets", Change.REFUSED)]
    assert RunIdentity.from_json(identity.to_json()) == identity


def test_lora_settings_are_built_of_the_config() -> None:
    assert LoraSettings.of(_config()) == LoraSettings(rank=RANK, alpha=ALPHA)
    assert LoraSettings.of(_config(lora_alpha=None, lora_targets="q_proj,v_proj")) == LoraSettings(
        rank=RANK, alpha=2 * RANK, targets=("q_proj", "v_proj"))
    assert LoraSettings.of(_config(lora_rank=None, lora_alpha=None)) is None


@pytest.mark.parametrize(("changes", "message"), [
    ({"lora_rank": 0}, "--lora-rank must be positive, got 0"),
    ({"lora_alpha": 0}, "--lora-alpha must be positive, got 0"),
    ({"lora_targets": ("q_proj", "qkv_proj")}, "--lora-targets q_proj,qkv_proj: qkv_proj names no projection of a "
                                               "decoder layer; choose from q_proj,k_proj"),
    ({"lora_targets": ()}, "--lora-targets \\(empty\\)"),
    ({"lora_rank": None}, "--lora-alpha and --lora-targets go with --lora-rank"),
    ({"export_lora": "adapter"}, "--export-lora adapter needs --lora-rank and --output-dir"),
    ({"export_lora": "adapter", "output_dir": Path("model")},
     "--export-lora adapter writes an adapter for the base model folder it was trained on, and --model tiny is a "
     "built-in random-init model"),
])
def test_bad_lora_flags_are_refused_naming_the_flag(changes: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _config(**changes)


def test_targets_that_name_no_linear_layer_of_the_model_are_refused_before_peft_sees_them() -> None:
    class AttentionOnly(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q_proj, self.v_proj = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    with pytest.raises(ValueError, match="--lora-targets gate_proj,up_proj names no linear layer of this model; its "
                                         "linear layers are q_proj,v_proj"):
        check_lora_targets(AttentionOnly(), ("q_proj", "gate_proj", "up_proj"))
