"""Whole runs whose plans mix all three collective schemes train to static CP's losses: the bundled trainer under
torchrun (4 CPU processes, dp 1 × cp 4) and ``SkrullSFTTrainer`` (4 gloo ranks).

The run plans with a profile whose tables make the choice of scheme differ by collective (``mixed_schemes_profile``):
an all-to-all over 2 ranks cheap per byte but with a fixed cost per call, one over 4 ranks dear per byte, and
all-gathers dear per byte. Short collectives stay all-gather-KV, the whole group's longer ones go 2D, blocks of 2
Ulysses; the precondition test pins that the run's two steps hold all three. The seed systems' static ``ulysses``
trains to the same losses too.
"""

from __future__ import annotations

import copy
import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from scheduler_service.core.choices import CollectiveScheme
from scheduler_service.core.plan import Plan, make_problem
from scheduler_service.core.planner import make_plan
from scheduler_service.core.profile import builtin_profiles, parse_profile
from trainer_client.data import SyntheticSource
from trainer_client.demo import read_metrics, run_trainer, trainer_command

CP_SIZE, GLOBAL_BATCH, BUCKET_SIZE, MAX_LENGTH, STEPS, SEED, DATA = 4, 8, 512, 2048, 2, 0, "lmsys"
RELATIVE_TOLERANCE = 1e-5


def mixed_schemes_profile(path: Path) -> Path:
    """``h100-paper`` with the collective tables of the module docstring, written to ``path``."""
    raw = copy.deepcopy(builtin_profiles()["h100-paper"].raw)
    sizes = (1 << 16, 1 << 20, 1 << 24)

    def table(fixed_s: float, s_per_byte: float) -> list[list[float]]:
        return [[size, fixed_s + size * s_per_byte] for size in sizes]

    gather = table(2e-5, 1e-9)
    raw["name"] = "mixed-schemes"
    raw["communication"].update(
        world_size=CP_SIZE, tables={"all_gather": gather, "reduce_scatter": gather, "all_to_all": table(6e-5, 1e-9)},
        tables_by_group_size={"2": {"all_gather": gather, "reduce_scatter": gather,
                                    "all_to_all": table(6e-5, 1e-11)}})
    path.write_text(json.dumps(raw))
    return path


def run_plans(profile: Path) -> list[Plan]:
    """The plans the trainer's embedded planner makes for the run's steps (the lengths do not depend on the vocab)."""
    source = SyntheticSource(dataset=DATA, global_batch_size=GLOBAL_BATCH, vocab_size=1024, max_length=MAX_LENGTH,
                             seed=SEED)
    return [make_plan(make_problem(sequence_lengths=list(source.batch(step).sequence_lengths), dp_size=1,
                                   cp_size=CP_SIZE, model="tiny", bucket_size=BUCKET_SIZE,
                                   profile=parse_profile(json.loads(profile.read_text())))).plan
            for step in range(STEPS)]


def schemes_of(plans: list[Plan]) -> Counter[CollectiveScheme]:
    return Counter(CollectiveScheme.of(c.degree, c.ulysses_degree) for plan in plans for dp_plan in plan.dp_ranks
                   for mb in dp_plan.micro_batches for c in mb.collectives())


def test_the_runs_plans_below_mix_all_three_schemes(tmp_path: Path) -> None:
    """The precondition of the runs below: without all three in their plans they would prove nothing of the mix."""
    assert set(schemes_of(run_plans(mixed_schemes_profile(tmp_path / "profile.json")))) == set(CollectiveScheme)


def _losses(tmp_path: Path, scheduler: str, profile: Path) -> list[float]:
    metrics_out = tmp_path / f"{scheduler}.jsonl"
    run = run_trainer(trainer_command(
        scheduler=scheduler, metrics_out=metrics_out, scheduler_url=None, nproc=CP_SIZE, dp=1, cp=CP_SIZE,
        steps=STEPS, global_batch=GLOBAL_BATCH, bucket_size=BUCKET_SIZE, data=f"synthetic:{DATA}", seed=SEED,
        extra=("--max-length", str(MAX_LENGTH), "--profile", str(profile))), timeout_s=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return [float(step["loss"]) for step in read_metrics(metrics_out)]  # type: ignore[arg-type]


@pytest.mark.slow
def test_the_bundled_trainer_mixing_schemes_and_static_ulysses_train_to_static_cps_losses(
        tmp_path: Path) -> None:
    profile = mixed_schemes_profile(tmp_path / "profile.json")
    static_cp = _losses(tmp_path, "deepspeed", profile)
    assert len(static_cp) == STEPS
    # skrull's plans mix all three schemes; static ulysses as a user runs it (usp's 2D is in skrull's mix)
    for scheduler in ("skrull", "ulysses"):
        assert _losses(tmp_path, scheduler, profile) == pytest.approx(static_cp, rel=RELATIVE_TOLERANCE), scheduler


def _hf_runs(out: Path, profile: str) -> None:
    """``SkrullSFTTrainer`` on the same records, planned by ``skrull`` (mixing schemes) and by ``deepspeed``."""
    import torch.distributed as dist
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import SFTConfig

    from tests.hf_runs import batches, fresh_accelerate_state, logged_steps, records, training_arguments
    from tests.hub_cache import save_tokenizer
    from trainer_client.hf import SkrullArguments, SkrullSFTTrainer
    from trainer_client.models.model import build_model

    tokenizer = AutoTokenizer.from_pretrained(save_tokenizer(out / f"tokenizer-{dist.get_rank()}"))
    rows = records(batches(num_steps=STEPS, global_batch=GLOBAL_BATCH, max_length=MAX_LENGTH, seed=SEED))
    losses: dict[str, Any] = {}
    for scheduler in ("skrull", "deepspeed"):
        fresh_accelerate_state()
        args = training_arguments(out / scheduler, SFTConfig, per_device_train_batch_size=GLOBAL_BATCH,
                                  max_steps=STEPS, max_length=MAX_LENGTH)
        trainer = SkrullSFTTrainer(model=build_model("tiny", attn_implementation="sdpa", seed=0), args=args,
                                   train_dataset=Dataset.from_list(rows), processing_class=tokenizer,
                                   skrull=SkrullArguments(bucket_size=BUCKET_SIZE, cp=CP_SIZE, profile=profile,
                                                          scheduler=scheduler))
        plans: list[Plan] = []
        decide = trainer.skrull_batches.decide

        def recording(batch: Any, decide: Any = decide, plans: list[Plan] = plans) -> Any:
            decision = decide(batch)
            plans.append(decision.plan)
            return decision

        trainer.skrull_batches.decide = recording  # type: ignore[method-assign]
        trainer.train()
        losses[scheduler] = [step["loss"] for step in logged_steps(trainer.state.log_history)]
        losses[f"{scheduler}_schemes"] = sorted(schemes_of(plans))
    if dist.get_rank() == 0:
        (out / "losses.json").write_text(json.dumps(losses))


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning")
def test_skrull_sft_trainer_mixing_schemes_trains_to_static_cps_losses(tmp_path: Path) -> None:
    from trainer_client.distributed import spawn_gloo

    profile = mixed_schemes_profile(tmp_path / "profile.json")
    spawn_gloo(_hf_runs, CP_SIZE, tmp_path, str(profile))
    losses = json.loads((tmp_path / "losses.json").read_text())
    assert len(losses["deepspeed"]) == STEPS
    assert losses["skrull_schemes"] == sorted(CollectiveScheme)  # the plans it ran mixed all three
    assert losses["skrull"] == pytest.approx(losses["deepspeed"], rel=RELATIVE_TOLERANCE)
