"""A training step with a hand-built hybrid DACP plan gives the deepspeed plan's loss and gradients (4 gloo ranks)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from scheduler_service.core.check import check_plan
from scheduler_service.core.plan import DPRankPlan, MicroBatch, Plan, ShardedGroup
from tests.train_reference import unscheduled_step
from trainer_client.config import TrainConfig
from trainer_client.data import GlobalBatch, make_source
from trainer_client.distributed import ParallelDims, init_parallel, spawn_gloo
from trainer_client.planning.source import PlanDecision, PlanOrigin
from trainer_client.trainer import Trainer

DP, CP = 1, 4
GLOBAL_BATCH, MAX_LENGTH, BUCKET_SIZE = 8, 256, 1024


def _config() -> TrainConfig:
    return TrainConfig(dp=DP, cp=CP, model="tiny", data="synthetic:lmsys", global_batch=GLOBAL_BATCH, steps=1,
                       scheduler="deepspeed", bucket_size=BUCKET_SIZE, max_length=MAX_LENGTH, seed=0, progress=False)


def _hybrid_plan(lengths: tuple[int, ...]) -> Plan:
    """Shortest three local, longest over the whole CP group, the rest over blocks of two CP ranks.

    Micro-batch 1 shards two sequences over the block (0, 1) in two groups and leaves CP ranks 2 and 3 idle.
    """
    o = sorted(range(len(lengths)), key=lengths.__getitem__)  # indices, shortest first
    first = MicroBatch(local=((o[0],), (o[1],), (), (o[2],)), distributed=(o[7],),
                       sharded=(ShardedGroup(cp_ranks=(0, 1), sequences=(o[6],)),
                                ShardedGroup(cp_ranks=(2, 3), sequences=(o[5],))))
    second = MicroBatch(local=((),) * CP, distributed=(),
                        sharded=(ShardedGroup(cp_ranks=(0, 1), sequences=(o[4],)),
                                 ShardedGroup(cp_ranks=(0, 1), sequences=(o[3],))))
    return Plan(dp_ranks=(DPRankPlan(micro_batches=(first, second)),))


def _deepspeed_plan(lengths: tuple[int, ...]) -> Plan:
    """Static CP: every sequence its own micro-batch, sharded over the whole CP group."""
    return Plan(dp_ranks=(DPRankPlan(micro_batches=tuple(MicroBatch(local=((),) * CP, distributed=(index,))
                                                         for index in range(len(lengths)))),))


def _one_step_on_both_plans(out_dir: Path) -> None:
    config = _config()
    parallel = init_parallel(ParallelDims.of(config))
    trainer = Trainer(config, parallel)
    batch = trainer.source.batch(0)
    for name, plan in (("hybrid", _hybrid_plan(batch.sequence_lengths)),
                       ("deepspeed", _deepspeed_plan(batch.sequence_lengths))):
        check_plan(plan, sequence_lengths=batch.sequence_lengths, dp_size=DP, cp_size=CP, bucket_size=BUCKET_SIZE)
        decision = PlanDecision(step=0, scheduler=name, origin=PlanOrigin.EMBEDDED, plan=plan, bucket_size=BUCKET_SIZE)
        with trainer.batches.share(batch, decision) as share:
            loss, num_loss_tokens = trainer.forward_backward(share)
        packs = [pack() for pack in trainer.batches.packers(batch, decision)]  # what the step ran, packed again
        torch.save([pack.is_padding for pack in packs], out_dir / f"idle_{name}_{parallel.cp_rank}.pt")
        grads = trainer.gradients()  # collective under FSDP
        if parallel.is_main:
            torch.save({"loss": loss, "num_loss_tokens": num_loss_tokens, "grads": grads}, out_dir / f"{name}.pt")
    trainer.close()
    dist.barrier()


@pytest.fixture(scope="module")
def step_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    out_dir = tmp_path_factory.mktemp("hybrid_step")
    spawn_gloo(_one_step_on_both_plans, DP * CP, out_dir)
    return {path.stem: torch.load(path) for path in out_dir.glob("*.pt")}


def _source_batch(config: TrainConfig) -> GlobalBatch:
    """The batch every rank builds (the tiny model's vocabulary is 1024)."""
    return make_source(config.data, global_batch_size=config.global_batch, vocab_size=1024, max_length=MAX_LENGTH,
                       seed=config.seed).batch(0)


@pytest.mark.slow
def test_hybrid_plan_gives_the_deepspeed_plans_loss_and_gradients(step_results: dict[str, dict]) -> None:
    hybrid, deepspeed = step_results["hybrid"], step_results["deepspeed"]
    assert hybrid["num_loss_tokens"] == deepspeed["num_loss_tokens"]
    assert hybrid["loss"] == pytest.approx(deepspeed["loss"], rel=1e-5)
    assert hybrid["grads"].keys() == deepspeed["grads"].keys()
    for name, grad in deepspeed["grads"].items():
        torch.testing.assert_close(hybrid["grads"][name], grad, rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.slow
def test_hybrid_step_equals_single_processunscheduled_step(step_results: dict[str, dict]) -> None:
    batch = _source_batch(_config())
    reference_loss, reference_grads = unscheduled_step(batch)
    hybrid = step_results["hybrid"]
    assert hybrid["num_loss_tokens"] == batch.num_loss_tokens
    assert hybrid["loss"] == pytest.approx(reference_loss, rel=1e-5)
    for name, grad in reference_grads.items():
        torch.testing.assert_close(hybrid["grads"][name], grad, rtol=1e-4, atol=1e-6,
                                   msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.slow
def test_only_ranks_outside_every_collective_run_a_padding_micro_batch(step_results: dict[str, dict]) -> None:
    idle = [step_results[f"idle_hybrid_{cp_rank}"] for cp_rank in range(CP)]
    assert idle == [[False, False], [False, False], [False, True], [False, True]]
