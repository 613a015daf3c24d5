"""``--profile auto``: every rank measures the run's profile once, the cache serves it after, and a cache entry that is
corrupt or was made for another machine or layout is measured again, never trusted (2 gloo ranks, the tiny model;
the CUDA choices with a faked GPU)."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

import trainer_client.profiler.auto as auto
from trainer_client.config import TrainConfig
from trainer_client.distributed import ParallelDims, init_parallel, spawn_gloo
from trainer_client.models.loading import ModelLayout
from trainer_client.models.parallelize import ActivationCheckpointing, Sharding
from trainer_client.profiler.auto import CPU_PROFILE, auto_profile, cache_path, default_profile, profile_key
from trainer_client.profiler.sweeps import ProfileOptions
from trainer_client.trainer import Trainer

# As short as still fits every term: the tiny model, three sizes, one timed run each.
SHORT = dict(model="tiny", sizes=(32, 128, 512), short_length=16, memory_sizes=(64, 256), comm_sizes=(1 << 12, 1 << 16),
             shard_sizes=(64, 256), warmup=0, repeats=1, progress=False)
LAYOUT = ModelLayout(sharding=Sharding.ZERO2, activation_checkpointing=ActivationCheckpointing.NONE,
                     param_dtype=torch.float32)


def _options(**changes: Any) -> ProfileOptions:
    return ProfileOptions(**{**SHORT, **changes})


def _every_rank(cache: Path, out: Path) -> None:
    """Four runs in a row on both ranks, each recording whether it measured and which profile it got."""
    import os

    os.environ["XDG_CACHE_HOME"] = str(cache)
    parallel = init_parallel(ParallelDims(dp_size=1, cp_size=2))
    measured: list[bool] = []
    real_measure = auto.measure_profile

    def counting_measure(*args: Any, **kwargs: Any) -> Any:
        measured[-1] = True
        return real_measure(*args, **kwargs)

    auto.measure_profile = counting_measure
    key_path = cache_path(profile_key(_options(), parallel.device, world_size=2))
    groups_before = len(dist.distributed_c10d._world.pg_map)
    results = []
    for case in ("empty cache", "cached", "corrupt", "another key", "no provenance", "unwritable cache"):
        if parallel.is_main and case == "corrupt":
            key_path.write_text('{"name": "half a fi')
        if parallel.is_main and case == "another key":
            document = json.loads(key_path.read_text())
            document["provenance"]["auto_key"]["torch"] = "2.10.0"
            key_path.write_text(json.dumps(document))
        if parallel.is_main and case == "no provenance":
            document = json.loads(key_path.read_text())
            document["provenance"] = None
            key_path.write_text(json.dumps(document))
        if parallel.is_main and case == "unwritable cache":  # a file where the cache's folder should be (root
            shutil.rmtree(key_path.parent)                     # writes into read-only folders)
            key_path.parent.write_text("not a folder")
        dist.barrier()
        measured.append(False)
        profile = auto_profile("tiny", parallel=parallel, layout=LAYOUT, options=_options())
        results.append({"case": case, "measured": measured[-1], "name": profile.name,
                        "alpha": profile.compute.alpha_s_per_flop,
                        "groups_left": len(dist.distributed_c10d._world.pg_map) - groups_before})
    (out / f"rank{parallel.global_rank}.json").write_text(json.dumps(results))
    dist.barrier()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, list[dict[str, Any]]]:
    cache, out = tmp_path_factory.mktemp("cache"), tmp_path_factory.mktemp("out")
    spawn_gloo(_every_rank, 2, cache, out)
    return {rank: json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)}


@pytest.mark.slow
def test_every_rank_measures_once_and_the_cache_serves_the_next_run(runs: dict[int, list[dict[str, Any]]]) -> None:
    for results in runs.values():
        first, second = results[0], results[1]
        assert first["measured"] and not second["measured"]
        assert first["name"].startswith("auto-") and second == {**first, "case": "cached", "measured": False}
    assert runs[0] == runs[1]  # every rank plans with the same profile


@pytest.mark.slow
@pytest.mark.parametrize("case", ["corrupt", "another key", "no provenance"])
def test_an_untrustworthy_cache_entry_is_measured_again(runs: dict[int, list[dict[str, Any]]], case: str) -> None:
    for results in runs.values():
        assert next(r for r in results if r["case"] == case)["measured"]


@pytest.mark.slow
def test_a_cache_that_cannot_be_written_costs_a_measurement_not_the_run(runs: dict[int, list[dict[str, Any]]]) -> None:
    for results in runs.values():
        unwritable = results[-1]
        assert unwritable["case"] == "unwritable cache" and unwritable["measured"]
        assert unwritable["name"].startswith("auto-")


@pytest.mark.slow
def test_the_sweep_ends_the_process_groups_it_made_in_the_runs_world(runs: dict[int, list[dict[str, Any]]]) -> None:
    for results in runs.values():
        assert [r["groups_left"] for r in results] == [0] * len(results)


def test_the_key_changes_with_everything_a_profile_depends_on() -> None:
    cpu = torch.device("cpu")
    base = profile_key(_options(), cpu, world_size=1)
    variants = [profile_key(_options(compile=True), cpu, world_size=1),
                profile_key(_options(sharding="zero3"), cpu, world_size=1),
                profile_key(_options(activation_checkpointing="full"), cpu, world_size=1),
                profile_key(_options(dtype="bfloat16"), cpu, world_size=1),
                profile_key(_options(repeats=3), cpu, world_size=1),
                profile_key(_options(model="qwen2.5-0.5b"), cpu, world_size=1),
                profile_key(_options(attention_backend="sdpa"), cpu, world_size=1),
                profile_key(_options(), cpu, world_size=2)]
    digests = {key.digest() for key in [base, *variants]}
    assert len(digests) == 1 + len(variants)
    assert profile_key(_options(), cpu, world_size=1) == base  # and nothing else does
    assert base.torch == torch.__version__ and base.transformers and base.profiler  # nor other code


def test_gpus_default_to_auto_and_cpus_to_the_additive_h100_paper() -> None:
    assert default_profile(torch.device("cuda", 0)) == "auto"
    assert default_profile(torch.device("cpu")) == "h100-paper"  # additive, as a CPU's costs are


def test_on_a_gpu_auto_sweeps_below_1k_tokens_in_the_runs_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(
        name="NVIDIA H200", total_memory=143 << 30, major=9, minor=0))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    layout = ModelLayout.on(torch.device("cuda", 0), dtype=None, sharding=Sharding.ZERO3,
                            activation_checkpointing=ActivationCheckpointing.FULL, compiled=True)
    options = auto.auto_profile_options("qwen2.5-0.5b", torch.device("cuda", 0), layout, attention_backend="sdpa",
                                        progress=True)
    assert options.device == "cuda" and min(options.sizes) < 1024 and options.dtype == "bfloat16"
    assert options.attention_backend == "sdpa"  # the run's backend is what is timed
    assert (options.sharding, options.activation_checkpointing, options.compile) == ("zero3", "full", True)
    key = profile_key(options, torch.device("cuda", 0), world_size=8)
    assert (key.device, key.compiled, key.world_size) == ("NVIDIA H200", True, 8)


def test_a_trainer_without_profile_on_cpu_plans_with_the_additive_h100_paper(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(auto, "measure_profile", lambda *a, **k: pytest.fail("a CPU run measured a profile"))
    trainer = Trainer(TrainConfig(dp=1, cp=1, steps=1, global_batch=2, progress=False),
                      init_parallel(ParallelDims(dp_size=1, cp_size=1)))
    try:
        assert trainer.profile == CPU_PROFILE == "h100-paper"  # named to the service too: its default has a floor
    finally:
        trainer.close()
        dist.destroy_process_group()


@pytest.mark.slow
def test_a_trainer_with_profile_auto_plans_with_what_it_measured(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(auto, "auto_profile_options", lambda model, device, layout, **kwargs: _options())
    caplog.set_level(logging.INFO, logger="trainer_client.profiler.auto")
    trainer = Trainer(TrainConfig(dp=1, cp=1, steps=1, global_batch=4, profile="auto", progress=False),
                      init_parallel(ParallelDims(dp_size=1, cp_size=1)))
    try:
        assert trainer.profile is not None and not isinstance(trainer.profile, str)
        assert trainer.profile.name.startswith("auto-")
        assert trainer.batches.plans is not None and trainer.batches.plans.profile is trainer.profile
        assert "measuring this machine" in caplog.text
        assert list((tmp_path / "skrull" / "profiles").glob("auto-*.json"))
    finally:
        trainer.close()
        dist.destroy_process_group()
