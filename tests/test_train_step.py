"""One training step gives the loss and gradients of the unscheduled batch, whatever the plan (4 gloo ranks)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.train_reference import unscheduled_step
from trainer_client.config import TrainConfig
from trainer_client.data import GlobalBatch, make_source
from trainer_client.distributed import ParallelDims, init_parallel, spawn_gloo
from trainer_client.trainer import Trainer

DP, CP = 2, 2
BUCKET_SIZE = 1024  # small enough that skrull mixes local and distributed sequences over several micro-batches
SCHEDULERS = ("skrull", "deepspeed", "skrull_paper", "sorted")


def _config(scheduler: str, global_batch: int = 16) -> TrainConfig:
    return TrainConfig(dp=DP, cp=CP, model="tiny", data="synthetic:lmsys", global_batch=global_batch, steps=1,
                       scheduler=scheduler, bucket_size=BUCKET_SIZE, seed=0, progress=False)


def _one_step_on_every_plan(out_dir: Path) -> None:
    parallel = init_parallel(ParallelDims.of(_config("skrull")))
    runs = [(scheduler, _config(scheduler)) for scheduler in SCHEDULERS]
    runs.append(("one_sequence", _config("skrull", global_batch=1)))  # DP rank 1 gets no micro-batch at all
    for name, config in runs:
        trainer = Trainer(config, parallel)
        batch = trainer.source.batch(0)
        with trainer.batches.plan(batch) as share:
            loss, num_loss_tokens = trainer.forward_backward(share)
        decision = share.decision
        grads = trainer.gradients()  # collective under FSDP
        if parallel.is_main:
            micro_batches = [len(d.micro_batches) for d in decision.plan.dp_ranks]
            torch.save({"loss": loss, "num_loss_tokens": num_loss_tokens, "grads": grads,
                        "micro_batches": micro_batches}, out_dir / f"{name}.pt")
        trainer.close()
    dist.barrier()


@pytest.fixture(scope="module")
def step_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    out_dir = tmp_path_factory.mktemp("step")
    spawn_gloo(_one_step_on_every_plan, DP * CP, out_dir)
    return {path.stem: torch.load(path) for path in out_dir.glob("*.pt")}


@pytest.fixture(scope="module")
def reference() -> tuple[GlobalBatch, float, dict[str, torch.Tensor]]:
    config = _config("skrull")
    batch = make_source(config.data, global_batch_size=config.global_batch, vocab_size=1024,
                        max_length=BUCKET_SIZE * CP, seed=config.seed).batch(0)
    return batch, *unscheduled_step(batch)


@pytest.mark.slow
@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_step_equals_single_processunscheduled_step(
    step_results: dict[str, dict], reference: tuple[GlobalBatch, float, dict[str, torch.Tensor]], scheduler: str
) -> None:
    batch, expected_loss, expected_grads = reference
    result = step_results[scheduler]
    assert result["num_loss_tokens"] == batch.num_loss_tokens
    assert result["loss"] == pytest.approx(expected_loss, rel=1e-5)
    for name, grad in expected_grads.items():
        torch.testing.assert_close(result["grads"][name], grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.slow
def test_skrull_and_deepspeed_plans_give_the_same_step(step_results: dict[str, dict]) -> None:
    skrull, deepspeed = step_results["skrull"], step_results["deepspeed"]
    assert skrull["micro_batches"] != deepspeed["micro_batches"]  # genuinely different schedules
    assert skrull["loss"] == pytest.approx(deepspeed["loss"], rel=1e-6)
    for name, grad in deepspeed["grads"].items():
        torch.testing.assert_close(skrull["grads"][name], grad, rtol=1e-4, atol=1e-7)


@pytest.mark.slow
def test_dp_rank_without_micro_batches_still_joins_the_step(step_results: dict[str, dict]) -> None:
    result = step_results["one_sequence"]
    assert result["micro_batches"] == [1, 0]
    assert all(torch.isfinite(g).all() for g in result["grads"].values())
