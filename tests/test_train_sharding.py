"""Sharding modes and activation checkpointing change memory, never the losses (4 gloo ranks, dp 2 × cp 2, fp32)."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from trainer_client.distributed import DEFAULT_COLLECTIVE_TIMEOUT_S, ParallelContext, init_parallel, spawn_gloo
from trainer_client.trainer import TrainConfig, Trainer

DP, CP, STEPS = 2, 2, 2
# (name, sharding, activation checkpointing, global batch); a global batch of 1 leaves DP rank 1 without sequences
RUNS = (
    ("none", "none", "none", 8),
    ("zero2", "zero2", "none", 8),
    ("zero3", "zero3", "none", 8),
    ("zero2_selective", "zero2", "selective", 8),
    ("zero3_full", "zero3", "full", 8),
    ("none_one_sequence", "none", "none", 1),
    ("zero2_one_sequence", "zero2", "none", 1),
    ("zero3_one_sequence", "zero3", "none", 1),
)


def _group_timeouts(parallel: ParallelContext) -> list[timedelta]:
    groups = [dist.group.WORLD, parallel.object_group, parallel.mesh.get_group("dp"), parallel.mesh.get_group("cp"),
              parallel.shard_mesh.get_group(), *parallel.cp_block_groups.values()]
    return [group._get_backend(torch.device("cpu")).options._timeout for group in groups]  # type: ignore[union-attr]


def _train_every_mode(out_dir: Path) -> None:
    parallel = init_parallel(TrainConfig(dp=DP, cp=CP).dims)
    results: dict[str, object] = {"timeouts_s": [t.total_seconds() for t in _group_timeouts(parallel)]}
    for name, sharding, checkpointing, global_batch in RUNS:
        config = TrainConfig(dp=DP, cp=CP, model="tiny", data="synthetic:lmsys", global_batch=global_batch,
                             steps=STEPS, bucket_size=512, seed=0, progress=False, sharding=sharding,
                             activation_checkpointing=checkpointing)
        trainer = Trainer(config, parallel)
        history = trainer.train()
        trainer.close()
        results[name] = {"losses": [m.loss for m in history], "grad_norms": [m.grad_norm for m in history],
                         "padding": [m.num_padding_micro_batches for m in history],
                         "micro_batches": [m.num_micro_batches for m in history]}
    if parallel.is_main:
        (out_dir / "results.json").write_text(json.dumps(results))
    dist.barrier()


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    out_dir = tmp_path_factory.mktemp("sharding")
    spawn_gloo(_train_every_mode, DP * CP, out_dir)
    loaded: dict[str, dict] = json.loads((out_dir / "results.json").read_text())
    return loaded


@pytest.mark.slow
@pytest.mark.parametrize("name", [name for name, *_ in RUNS if name != "none" and "one_sequence" not in name])
def test_sharding_and_checkpointing_give_the_replicated_losses_step_for_step(results: dict[str, dict],
                                                                             name: str) -> None:
    assert results[name]["losses"] == pytest.approx(results["none"]["losses"], rel=1e-5)
    assert results[name]["grad_norms"] == pytest.approx(results["none"]["grad_norms"], rel=1e-4)


@pytest.mark.slow
def test_zero3_pads_ranks_with_fewer_micro_batches_and_counts_it(results: dict[str, dict]) -> None:
    assert sum(results["zero3"]["padding"]) > 0
    assert results["none"]["padding"] == [0] * STEPS
    assert results["zero3"]["micro_batches"] == results["none"]["micro_batches"]  # padding is not planned work


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["zero2", "zero3"])
def test_dp_rank_without_sequences_takes_part_in_sharded_training(results: dict[str, dict], sharding: str) -> None:
    run = results[f"{sharding}_one_sequence"]
    assert run["losses"] == pytest.approx(results["none_one_sequence"]["losses"], rel=1e-5)
    assert all(padding >= CP for padding in run["padding"])  # at least one per CP rank of the empty DP rank


@pytest.mark.slow
def test_every_process_group_has_the_one_collective_timeout(results: dict[str, dict]) -> None:
    assert results["timeouts_s"] == [DEFAULT_COLLECTIVE_TIMEOUT_S] * len(results["timeouts_s"])
