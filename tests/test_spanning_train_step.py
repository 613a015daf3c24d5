"""Training steps with spanning micro-batches (blocks over several DP replicas) give the loss and gradients of static
CP over the whole world and of unscheduled training (gloo, 4 and 8 processes)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from scheduler_service.core.check import check_plan
from scheduler_service.core.plan import DPRankPlan, MicroBatch, Plan, ShardedGroup, SpanningMicroBatch
from tests.train_reference import unscheduled_step
from trainer_client.config import TrainConfig
from trainer_client.data import GlobalBatch, make_source
from trainer_client.distributed import ParallelDims, init_parallel, spawn_gloo
from trainer_client.planning.source import PlanDecision, PlanOrigin
from trainer_client.trainer import Trainer

GLOBAL_BATCH, MAX_LENGTH = 8, 256


# A batch (seed 1) no sequence of which needs more than one CP group of 2 ranks × 192 tokens, and which the planner
# still plans with a spanning micro-batch (one replica would otherwise run its 256-token sequences alone).
CHOSEN_SEED, CHOSEN_BUCKET_SIZE = 1, 192


def _source_batch(seed: int = 0) -> GlobalBatch:
    """The batch every rank builds (the tiny model's vocabulary is 1024)."""
    return make_source("synthetic:lmsys", global_batch_size=GLOBAL_BATCH, vocab_size=1024, max_length=MAX_LENGTH,
                       seed=seed).batch(0)


def _bucket_size(cp: int) -> int:
    """The longest sequence of the batch is 1.5 × what one CP group holds."""
    return math.ceil(max(_source_batch().sequence_lengths) / (1.5 * cp))


def _config(dp: int, cp: int, sharding: str, case: str) -> TrainConfig:
    """``case``: "needed" (the planner's plan of a batch whose longest sequence one CP group cannot hold),
    "chosen" (the planner's plan of a batch it spans though none needs it), "hand_built" (whole sequences of up to
    MAX_LENGTH tokens on one rank)."""
    bucket_size = {"needed": _bucket_size(cp), "chosen": CHOSEN_BUCKET_SIZE, "hand_built": MAX_LENGTH}[case]
    return TrainConfig(dp=dp, cp=cp, model="tiny", data="synthetic:lmsys", global_batch=GLOBAL_BATCH, steps=1,
                       scheduler="skrull", bucket_size=bucket_size, max_length=MAX_LENGTH,
                       seed=CHOSEN_SEED if case == "chosen" else 0, progress=False, sharding=sharding)


def _static_world_plan(lengths: tuple[int, ...], dp: int, cp: int) -> Plan:
    """Static CP over the whole world: every sequence its own micro-batch, sharded over all dp × cp ranks."""
    return Plan(dp_ranks=(DPRankPlan(micro_batches=()),) * dp, spanning=tuple(
        SpanningMicroBatch(first_dp_rank=0, num_dp_ranks=dp,
                           micro_batch=MicroBatch(local=((),) * (dp * cp), distributed=(index,)))
        for index in range(len(lengths))))


def _interleaved_plan(lengths: tuple[int, ...]) -> Plan:
    """DP 4 × CP 2: two spanning blocks that overlap (DP replicas 0-1, then all four) beside one of replicas 2-3, and
    micro-batches within CP groups, so that every rank's collectives on four kinds of group must keep one order."""
    o = sorted(range(len(lengths)), key=lengths.__getitem__, reverse=True)  # longest first
    pair = SpanningMicroBatch(first_dp_rank=0, num_dp_ranks=2, micro_batch=MicroBatch(
        local=((o[7],), (), (), ()), distributed=(o[0],)))
    world = SpanningMicroBatch(first_dp_rank=0, num_dp_ranks=4, micro_batch=MicroBatch(
        local=((),) * 8, distributed=(o[1],), sharded=(ShardedGroup(cp_ranks=(4, 5, 6, 7), sequences=(o[2],)),)))
    other_pair = SpanningMicroBatch(first_dp_rank=2, num_dp_ranks=2, micro_batch=MicroBatch(
        local=((), (), (), ()), distributed=(o[3],)))
    within = (DPRankPlan(micro_batches=(MicroBatch(local=((o[4],), ()), distributed=()),)),
              DPRankPlan(micro_batches=(MicroBatch(local=((), ()), distributed=(o[5],)),)),
              DPRankPlan(micro_batches=()),
              DPRankPlan(micro_batches=(MicroBatch(local=((o[6],), ()), distributed=()),)))
    return Plan(dp_ranks=within, spanning=(pair, world, other_pair))


def _uneven_plan(lengths: tuple[int, ...]) -> Plan:
    """DP 2 × CP 2: the four longest sequences each in a spanning micro-batch, the rest each in a micro-batch of DP
    replica 0: replica 1's last micro-batch is a spanning one while replica 0 has one more (under FSDP the gradient
    reduce-scatter of replica 1 must not meet replica 0 inside a spanning micro-batch)."""
    o = sorted(range(len(lengths)), key=lengths.__getitem__, reverse=True)  # longest first
    return Plan(dp_ranks=(DPRankPlan(micro_batches=tuple(MicroBatch(local=((), ()), distributed=(index,))
                                                         for index in o[4:])),
                          DPRankPlan(micro_batches=())),
                spanning=tuple(SpanningMicroBatch(first_dp_rank=0, num_dp_ranks=2, micro_batch=MicroBatch(
                    local=((),) * 4, distributed=(index,))) for index in o[:4]))


def _steps(out_dir: Path, dp: int, cp: int, sharding: str, case: str) -> None:
    config = _config(dp, cp, sharding, case)
    parallel = init_parallel(ParallelDims.of(config))
    trainer = Trainer(config, parallel)
    batch = trainer.source.batch(0)
    if case == "hand_built":
        planned = (_interleaved_plan if dp == 4 else _uneven_plan)(batch.sequence_lengths)
    else:
        planned = trainer.batches.decide(batch).plan  # the embedded planner's
    assert planned is not None
    for name, plan in (("planned", planned), ("static", _static_world_plan(batch.sequence_lengths, dp, cp))):
        check_plan(plan, sequence_lengths=batch.sequence_lengths, dp_size=dp, cp_size=cp,
                   bucket_size=config.bucket_size)
        decision = PlanDecision(step=0, scheduler=name, origin=PlanOrigin.EMBEDDED, plan=plan,
                                bucket_size=config.bucket_size)
        with trainer.batches.share(batch, decision) as share:
            loss, num_loss_tokens = trainer.forward_backward(share)
        grads = trainer.gradients()  # collective under FSDP
        if parallel.is_main:
            torch.save({"loss": loss, "num_loss_tokens": num_loss_tokens, "grads": grads, "plan": plan},
                       out_dir / f"{name}.pt")
    trainer.close()
    dist.barrier()


def _run(tmp_path: Path, dp: int, cp: int, sharding: str, case: str = "needed") -> dict[str, dict]:
    spawn_gloo(_steps, dp * cp, tmp_path, dp, cp, sharding, case)
    return {path.stem: torch.load(path, weights_only=False) for path in tmp_path.glob("*.pt")}


def _assert_same_step(results: dict[str, dict]) -> None:
    planned, static = results["planned"], results["static"]
    assert planned["num_loss_tokens"] == static["num_loss_tokens"]
    assert planned["loss"] == pytest.approx(static["loss"], rel=1e-5)
    planned_norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in planned["grads"].values()]))
    static_norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in static["grads"].values()]))
    assert float(planned_norm) == pytest.approx(float(static_norm), rel=1e-5)
    for name, grad in static["grads"].items():
        torch.testing.assert_close(planned["grads"][name], grad, rtol=1e-5, atol=1e-7,
                                   msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["none", "zero2", "zero3"])
def test_a_sequence_longer_than_one_cp_group_trains_as_static_cp_over_the_world(tmp_path: Path,
                                                                                sharding: str) -> None:
    results = _run(tmp_path, dp=2, cp=2, sharding=sharding)
    plan = results["planned"]["plan"]
    longest = max(range(GLOBAL_BATCH), key=_source_batch().sequence_lengths.__getitem__)
    assert any(longest in spanning.micro_batch.indices() for spanning in plan.spanning), plan
    _assert_same_step(results)
    if sharding == "none":
        batch = _source_batch()
        reference_loss, reference_grads = unscheduled_step(batch)
        assert results["planned"]["loss"] == pytest.approx(reference_loss, rel=1e-5)
        for name, grad in reference_grads.items():
            torch.testing.assert_close(results["planned"]["grads"][name], grad, rtol=1e-4, atol=1e-6,
                                       msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["none", "zero2", "zero3"])
def test_overlapping_spanning_blocks_and_cp_groups_keep_one_collective_order(tmp_path: Path, sharding: str) -> None:
    _assert_same_step(_run(tmp_path, dp=4, cp=2, sharding=sharding, case="hand_built"))


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["zero2", "zero3"])
def test_a_replica_that_ends_on_a_spanning_micro_batch_does_not_hang_fsdp(tmp_path: Path, sharding: str) -> None:
    _assert_same_step(_run(tmp_path, dp=2, cp=2, sharding=sharding, case="hand_built"))


@pytest.mark.slow
def test_a_spanning_block_of_wide_cp_groups_trains_as_static_cp(tmp_path: Path) -> None:
    results = _run(tmp_path, dp=2, cp=4, sharding="none")
    assert results["planned"]["plan"].spanning
    _assert_same_step(results)


@pytest.mark.slow
def test_a_batch_the_planner_chooses_to_span_trains_as_static_cp_over_the_world(tmp_path: Path) -> None:
    assert max(_source_batch(CHOSEN_SEED).sequence_lengths) <= 2 * CHOSEN_BUCKET_SIZE  # no sequence needs it
    results = _run(tmp_path, dp=2, cp=2, sharding="zero3", case="chosen")
    assert results["planned"]["plan"].spanning
    _assert_same_step(results)
