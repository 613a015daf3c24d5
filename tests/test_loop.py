"""The loop API on 2 gloo ranks: every plan is checked exactly once on every rank, whichever rank planned it."""

from __future__ import annotations

import json
from pathlib import Path

import torch.distributed as dist

import scheduler_service.core.planner
import trainer_client.loop
from trainer_client.data import make_source
from trainer_client.distributed import ParallelDims, init_parallel, spawn_gloo
from trainer_client.loop import PlanningFailed, SkrullBatches

BUCKET_SIZE = 1024
SCHEDULERS = ("skrull", "deepspeed")  # the compiled path (checked as places) and a plan checked as it is


def _count_checks(out_dir: Path) -> None:
    parallel = init_parallel(ParallelDims(dp_size=2, cp_size=1))
    counts: dict[str, int] = {}
    where = {"loop": (trainer_client.loop, ("check_plan",)),
             "planner": (scheduler_service.core.planner, ("check_plan", "check_places"))}
    for module, names in where.values():
        for name in names:
            checker = getattr(module, name)

            def counted(*args: object, _checker=checker, **kwargs: object) -> object:
                counts[scheduler] = counts.get(scheduler, 0) + 1
                return _checker(*args, **kwargs)

            setattr(module, name, counted)
    source = make_source("synthetic:lmsys", global_batch_size=8, vocab_size=1024, max_length=BUCKET_SIZE, seed=0)
    for scheduler in SCHEDULERS:
        with SkrullBatches(parallel, model="tiny", bucket_size=BUCKET_SIZE, scheduler=scheduler) as batches:
            counts[scheduler] = 0  # rank 0's warm-up plans are checked too; only the batches' plans are counted
            for step in range(2):
                batches.plan(source.batch(step))
    (out_dir / f"rank{dist.get_rank()}.json").write_text(json.dumps(counts))


def test_each_plan_is_checked_once_on_every_rank(tmp_path: Path) -> None:
    spawn_gloo(_count_checks, 2, tmp_path)
    for rank in range(2):
        counts = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert counts == {scheduler: 2 for scheduler in SCHEDULERS}, f"rank {rank}: checks per scheduler {counts}"


def _plan_too_long(out_dir: Path) -> None:
    parallel = init_parallel(ParallelDims(dp_size=2, cp_size=1))
    source = make_source("synthetic:chatqa2", global_batch_size=8, vocab_size=1024, max_length=100_000, seed=0)
    with SkrullBatches(parallel, model="tiny", bucket_size=64) as batches:
        try:
            batches.plan(source.batch(0))
        except PlanningFailed as error:
            (out_dir / f"rank{dist.get_rank()}.txt").write_text(str(error))


def test_a_batch_no_planner_can_plan_stops_every_rank_with_rank_0s_reason(tmp_path: Path) -> None:
    # Sequences above bucket_size × cp_size × dp_size (the world): rank 0 cannot plan, and no rank may hang.
    spawn_gloo(_plan_too_long, 2, tmp_path)
    reasons = {(tmp_path / f"rank{rank}.txt").read_text() for rank in range(2)}
    (reason,) = reasons
    assert reason.startswith("cannot plan global batch 0: sequence ")
    assert reason.endswith("at most bucket_size 64 × cp_size 1 × dp_size 2 = 128 fit (the world's capacity)")


def _schemes_off(out_dir: Path) -> None:
    parallel = init_parallel(ParallelDims(dp_size=1, cp_size=2))
    refusal = None
    try:
        SkrullBatches(parallel, model="tiny", bucket_size=BUCKET_SIZE, scheduler="ulysses", schemes=False)
    except ValueError as error:
        refusal = str(error)
    with SkrullBatches(parallel, model="tiny", bucket_size=BUCKET_SIZE, schemes=False) as batches:
        asks = None if batches.plans is None else batches.plans._request([100, 200]).schema_version
    (out_dir / f"rank{dist.get_rank()}.json").write_text(json.dumps({"refusal": refusal, "asks": asks}))


def test_schemes_off_reach_rank_0s_plans_and_refuse_a_static_ulysses_scheduler_on_every_rank(tmp_path: Path) -> None:
    spawn_gloo(_schemes_off, 2, tmp_path)
    found = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert [rank["refusal"] for rank in found] == [
        "scheduler ulysses runs every collective as Ulysses, and schemes are off (every collective all-gather-KV): "
        "keep them on, or choose another scheduler"] * 2
    assert [rank["asks"] for rank in found] == [2, None]  # the contract without Ulysses or 2D; rank 0 alone plans
