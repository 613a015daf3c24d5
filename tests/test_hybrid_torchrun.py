"""Hybrid DACP end to end: 4 CPU processes under torchrun, dp 1 × cp 4, on long-heavy synthetic data where the
embedded planner shards a sequence over a block of 2 CP ranks; the losses equal DeepSpeed's (static CP)."""

from __future__ import annotations

from pathlib import Path

import pytest

from scheduler_service.core import gds
from scheduler_service.core.plan import Plan, PlanningProblem, make_problem
from scheduler_service.core.simulate import simulate
from trainer_client.data import SyntheticSource
from trainer_client.demo import read_metrics, run_trainer, trainer_command
from trainer_client.profiler.auto import CPU_PROFILE

# A batch whose plan shards one mid-length sequence over a block of 2 (most small batches under the tiny model's
# profile are cheapest whole or over the whole group; the precondition test below pins this one).
BUCKET_SIZE, CP_SIZE, GLOBAL_BATCH, SEED = 1024, 4, 8, 3
TRAINER_ARGS = dict(nproc=CP_SIZE, dp=1, cp=CP_SIZE, steps=1, global_batch=GLOBAL_BATCH, bucket_size=BUCKET_SIZE,
                    data="synthetic:chatqa2", seed=SEED, scheduler_url=None)


def step_zero_plan() -> tuple[PlanningProblem, Plan]:
    """What the trainer's embedded planner plans for the run's only batch (lengths do not depend on the vocab)."""
    batch = SyntheticSource(dataset="chatqa2", global_batch_size=GLOBAL_BATCH, vocab_size=1024,
                            max_length=BUCKET_SIZE * CP_SIZE, seed=SEED).batch(0)
    problem = make_problem(sequence_lengths=list(batch.sequence_lengths), dp_size=1, cp_size=CP_SIZE, model="tiny",
                           bucket_size=BUCKET_SIZE, profile=CPU_PROFILE)  # the trainer's on CPU
    return problem, gds.skrull(problem)


def test_step_zero_of_the_run_below_is_planned_with_a_block_of_two() -> None:
    """The precondition of the torchrun test: without a group in its plan it would prove nothing about groups."""
    _, plan = step_zero_plan()
    assert [group.degree for mb in plan.dp_ranks[0].micro_batches for group in mb.sharded] == [2]


@pytest.mark.slow
def test_a_plan_with_a_block_group_trains_to_deepspeeds_loss(tmp_path: Path) -> None:
    losses = {}
    for scheduler in ("skrull", "deepspeed"):
        metrics_out = tmp_path / f"{scheduler}.jsonl"
        run = run_trainer(trainer_command(scheduler=scheduler, metrics_out=metrics_out, **TRAINER_ARGS),
                          timeout_s=300)
        assert run.returncode == 0, run.stderr[-3000:]
        (step,) = read_metrics(metrics_out)
        assert step["plan_source"] == "embedded"
        losses[scheduler] = step["loss"]
        if scheduler == "skrull":  # the trainer ran the plan with the group: its estimate is that plan's
            problem, plan = step_zero_plan()
            assert step["estimated_time_ms"] == pytest.approx(simulate(problem, plan).iteration_time_s * 1e3)
    assert losses["skrull"] == pytest.approx(losses["deepspeed"], rel=1e-5)
