"""The trained module on every rank (``loading.py``): rank 0's weights, bit for bit what one process builds, under
every sharding mode and with LoRA, from a catalogue shape or a local checkpoint; no rank but rank 0 ever holds
the whole model in host memory; a checkpoint whose shapes are not its config's is refused on every rank before any
of them allocates the model."""

from __future__ import annotations

import gc
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers import AutoModelForCausalLM, Qwen2Config

from trainer_client.distributed import ParallelDims, init_parallel, spawn_gloo
from trainer_client.models.loading import CheckpointMismatch, ModelLayout, build_training_module, check_checkpoint
from trainer_client.models.lora import LoraSettings, apply_lora
from trainer_client.models.model import build_empty_model, build_model
from trainer_client.models.parallelize import ActivationCheckpointing, Sharding

WORLD_SIZE = 4
LORA = LoraSettings(rank=4, alpha=8)
# About 39M parameters (156 MB in float32), its largest tensor 17 MB: a model that shows in a process's memory.
LARGE = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
             intermediate_size=2048, vocab_size=8192, tie_word_embeddings=False)


def _save_checkpoint(directory: Path, **shape: Any) -> Path:
    torch.manual_seed(1)
    AutoModelForCausalLM.from_config(Qwen2Config(**shape)).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("checkpoints")
    small = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=512, tie_word_embeddings=False)
    mismatched = _save_checkpoint(root / "mismatched", **small)
    config = json.loads((mismatched / "config.json").read_text())
    (mismatched / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    complete = _save_checkpoint(root / "small", **small)
    weightless = root / "weightless"  # its config alone: the weights went missing
    weightless.mkdir()
    (weightless / "config.json").write_text((complete / "config.json").read_text())
    return {"large": _save_checkpoint(root / "large", **LARGE), "small": complete, "mismatched": mismatched,
            "weightless": weightless}


def _layout(sharding: Sharding) -> ModelLayout:
    return ModelLayout(sharding=sharding, activation_checkpointing=ActivationCheckpointing.NONE,
                       param_dtype=torch.float32)


def _reset_peak_rss() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # Linux: the peak resident set starts again from the current one


def _peak_rss_bytes() -> int:
    return int(re.search(r"VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024


def _every_rank(checkpoints: dict[str, Path], out: Path) -> None:
    rank = dist.get_rank()
    parallel = init_parallel(ParallelDims(dp_size=2, cp_size=2))
    report: dict[str, Any] = {}

    # The host memory loading takes: the peak resident set while loading, above the resident set before.
    gc.collect()
    _reset_peak_rss()
    before = _peak_rss_bytes()
    build_training_module(str(checkpoints["large"]), parallel=parallel, layout=_layout(Sharding.ZERO2), seed=0)
    report["rss_growth_bytes"] = _peak_rss_bytes() - before

    for model in ("tiny", str(checkpoints["small"])):
        for sharding in Sharding:
            for lora in (None, LORA):
                module = build_training_module(model, parallel=parallel, layout=_layout(sharding), seed=0, lora=lora)
                full = get_model_state_dict(module.lm, options=StateDictOptions(full_state_dict=True,
                                                                                cpu_offload=True))
                buffers = {name: buffer.clone() for name, buffer in module.lm.named_buffers()}
                tied = module.lm.get_output_embeddings().weight is module.lm.get_input_embeddings().weight
                report[f"{Path(model).name} {sharding} {'lora' if lora else 'full'}"] = {
                    "weights": full if rank == 0 else None, "buffers": buffers, "tied": tied}

    allocated: list[str] = []
    original_to_empty = torch.nn.Module.to_empty

    def to_empty(module: torch.nn.Module, **kwargs: Any) -> torch.nn.Module:
        allocated.append(type(module).__name__)
        return original_to_empty(module, **kwargs)

    torch.nn.Module.to_empty = to_empty  # type: ignore[method-assign]
    try:
        for case, error_type in (("mismatched", CheckpointMismatch), ("weightless", RuntimeError)):
            try:
                build_training_module(str(checkpoints[case]), parallel=parallel, layout=_layout(Sharding.ZERO2),
                                      seed=0)
            except error_type as error:
                report[case] = {"error": str(error), "allocated": list(allocated)}
    finally:
        torch.nn.Module.to_empty = original_to_empty  # type: ignore[method-assign]
    torch.save(report, out / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def reports(checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("reports")
    spawn_gloo(_every_rank, WORLD_SIZE, checkpoints, out)
    return [torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in range(WORLD_SIZE)]


def _one_process(model: str, lora: LoraSettings | None) -> torch.nn.Module:
    """The model as one process builds it whole: what every rank held before the sharded loading."""
    lm = build_model(model, seed=0)
    if lora is not None:
        apply_lora(lm, lora)
    return lm


@pytest.mark.slow
@pytest.mark.parametrize("sharding", list(Sharding))
@pytest.mark.parametrize("lora", [None, LORA], ids=["full", "lora"])
@pytest.mark.parametrize("model", ["tiny", "small"])
def test_every_rank_holds_the_weights_one_process_builds(
    reports: list[dict[str, Any]], checkpoints: dict[str, Path], model: str, sharding: Sharding,
    lora: LoraSettings | None,
) -> None:
    path = model if model == "tiny" else str(checkpoints[model])
    expected = _one_process(path, lora)
    case = f"{Path(path).name} {sharding} {'lora' if lora else 'full'}"
    weights = reports[0][case]["weights"]
    assert set(weights) == set(expected.state_dict())
    for name, tensor in expected.state_dict().items():
        assert torch.equal(weights[name], tensor), name
    for report in reports:  # buffers no state dict holds (RoPE's inv_freq), and the tied head, on every rank
        for name, buffer in expected.named_buffers():
            assert torch.equal(report[case]["buffers"][name], buffer), name
        assert report[case]["tied"] == expected.config.tie_word_embeddings


@pytest.mark.slow
def test_only_rank_0_ever_holds_the_whole_model_in_host_memory(reports: list[dict[str, Any]]) -> None:
    model_bytes = 4 * sum(p.numel() for p in AutoModelForCausalLM.from_config(
        Qwen2Config(**LARGE), dtype=torch.float32).parameters())
    growth = [report["rss_growth_bytes"] for report in reports]
    assert growth[0] > 0.9 * model_bytes, growth  # rank 0 reads the checkpoint: the measure sees a whole model
    for rank, grown in enumerate(growth[1:], start=1):
        # Its quarter of the model and a tensor in flight (0.4 of the model here); every rank held a whole copy
        # (1.05) when each built the model itself.
        assert grown < 0.6 * model_bytes, f"rank {rank} grew by {grown / 1e6:.0f} MB; the model is " \
                                          f"{model_bytes / 1e6:.0f} MB"


@pytest.mark.slow
def test_a_checkpoint_of_other_shapes_is_refused_on_every_rank_before_any_allocates(
    reports: list[dict[str, Any]],
) -> None:
    for report in reports:
        assert report["mismatched"]["allocated"] == []
        assert "model.layers.0.mlp.up_proj.weight: the checkpoint holds [128, 64], the model needs [96, 64]" \
            in report["mismatched"]["error"]


@pytest.mark.slow
def test_rank_0_failing_to_load_stops_every_rank_before_any_allocates(reports: list[dict[str, Any]]) -> None:
    for report in reports:
        assert report["weightless"]["allocated"] == []
        assert report["weightless"]["error"].startswith("rank 0 could not build")
        assert "weightless" in report["weightless"]["error"]


def test_check_checkpoint_names_missing_tensors(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    check_checkpoint(checkpoints["small"], build_empty_model(str(checkpoints["small"])))
    check_checkpoint(checkpoints["weightless"], build_empty_model(str(checkpoints["small"])))  # no safetensors
    deeper = tmp_path / "deeper"
    deeper.mkdir()
    config = json.loads((checkpoints["small"] / "config.json").read_text())
    config.pop("layer_types", None)  # per layer: written for the 2 layers saved
    (deeper / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    (deeper / "model.safetensors").symlink_to(checkpoints["small"] / "model.safetensors")
    with pytest.raises(CheckpointMismatch, match=r"missing from the checkpoint: model\.layers\.2\."):
        check_checkpoint(deeper, build_empty_model(str(deeper)))
