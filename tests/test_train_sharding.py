"""Sharding modes and activation checkpointing change memory, never the losses (4 gloo ranks, dp 2 × cp 2, fp32)."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from scheduler_service.core.models import MODEL_CATALOGUE
from scheduler_service.core.perf_model import PerformanceModel
from scheduler_service.core.profile import resolve_profile
from trainer_client.config import TrainConfig
from trainer_client.distributed import (
    DEFAULT_COLLECTIVE_TIMEOUT_S,
    ParallelContext,
    ParallelDims,
    init_parallel,
    spawn_gloo,
)
from trainer_client.profiler.measure import device_memory_bytes
from trainer_client.trainer import Trainer

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


def _local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def _state_bytes(trainer: Trainer) -> int:
    """This rank's weights, gradients and AdamW states after a step, counted tensor by tensor (local shards)."""
    params = list(trainer.module.parameters())
    states = [value for state in trainer.optimizer.state.values() for value in state.values()
              if isinstance(value, torch.Tensor) and value.ndim > 0]
    storages = {p.grad.untyped_storage().data_ptr(): p.grad.untyped_storage().nbytes()
                for p in params if p.grad is not None and not isinstance(p.grad, DTensor)}
    grads = (sum(storages.values()) if storages  # replicated: views of the one flat all-reduced buffer
             else sum(_local_bytes(p.grad) for p in params if p.grad is not None))
    return sum(_local_bytes(p) for p in params) + grads + sum(_local_bytes(v) for v in states)


def _planner_buckets(parallel: ParallelContext) -> dict[str, list[int]]:
    """(the trainer's derived bucket, the bucket of the plan it trains) per sharding mode, from the H100 profile's
    activations in this host's memory."""
    buckets = {}
    for sharding in ("none", "zero2", "zero3"):
        config = TrainConfig(dp=DP, cp=CP, model="tiny", global_batch=4, steps=1, profile="h100-paper",
                             progress=False, sharding=sharding)
        trainer = Trainer(config, parallel)
        decision = trainer.batches.decide(trainer.source.batch(0))
        buckets[sharding] = [trainer.bucket_size, decision.bucket_size]
        trainer.close()
    return buckets


def _train_every_mode(out_dir: Path) -> None:
    parallel = init_parallel(ParallelDims.of(TrainConfig(dp=DP, cp=CP)))
    results: dict[str, object] = {"timeouts_s": [t.total_seconds() for t in _group_timeouts(parallel)],
                                  "buckets": _planner_buckets(parallel)}
    for name, sharding, checkpointing, global_batch in RUNS:
        # within CP groups: the padding of DP ranks with fewer micro-batches, or none, is what is tested
        config = TrainConfig(dp=DP, cp=CP, model="tiny", data="synthetic:lmsys", global_batch=global_batch,
                             steps=STEPS, bucket_size=512, seed=0, progress=False, sharding=sharding,
                             activation_checkpointing=checkpointing, spanning=False)
        trainer = Trainer(config, parallel)
        history = trainer.train()
        trainer.close()
        state_bytes = torch.tensor([_state_bytes(trainer)])
        dist.all_reduce(state_bytes, op=dist.ReduceOp.MAX)
        results[name] = {"losses": [m.loss for m in history], "grad_norms": [m.grad_norm for m in history],
                         "state_bytes": int(state_bytes.item()),
                         "num_parameters": sum(p.numel() for p in trainer.module.parameters()),
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


# Bytes per parameter (replicated, sharded over all DP × CP ranks) in fp32 on CPU: weights 4, gradients 4, AdamW 8.
STATIC_BYTES = {"none": (4 + 4 + 8 + 4, 0), "zero2": (4 + 4, 4 + 4 + 8), "zero3": (0, 4 + 4 + 8)}


@pytest.mark.slow
def test_the_planner_uses_the_bucket_the_trainers_sharding_leaves_room_for(results: dict[str, dict]) -> None:
    shape, profile = MODEL_CATALOGUE["tiny"], resolve_profile("h100-paper")
    perf = PerformanceModel(model=shape, profile=profile)
    per_token = perf.activation_bytes_per_token + perf.gathered_kv_bytes_per_token(CP)
    host_per_rank = device_memory_bytes(torch.device("cpu")) / (DP * CP)  # on CPU: none reserved, not the H100's 80 GB
    for sharding, (replicated, sharded) in STATIC_BYTES.items():
        static = shape.num_parameters * (replicated + sharded / (DP * CP))
        free = host_per_rank - profile.memory.beta_bytes - static
        trainer_bucket, planned_bucket = results["buckets"][sharding]
        assert trainer_bucket == planned_bucket == int(free // per_token), sharding
    assert results["buckets"]["zero3"][0] > results["buckets"]["zero2"][0] > results["buckets"]["none"][0]


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["none", "zero2", "zero3"])
def test_state_left_after_a_step_is_the_sharded_share_the_memory_model_counts(results: dict[str, dict],
                                                                               sharding: str) -> None:
    run = results[sharding]
    assert run["num_parameters"] == MODEL_CATALOGUE["tiny"].num_parameters
    # After the step the zero2 unsharded weights and gradients and the none-mode all-reduce copy are freed:
    # what stays is 16 bytes per parameter, whole or split over the ranks (FSDP pads each shard, < 1 %).
    _, sharded = STATIC_BYTES[sharding]
    persistent = 16 if sharding == "none" else sharded / (DP * CP)
    assert run["state_bytes"] == pytest.approx(run["num_parameters"] * persistent, rel=0.01)
