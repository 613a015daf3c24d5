"""``SkrullTrainer`` trains the model plain transformers and the bundled trainer train, and keeps the Trainer's own
features working (gloo ranks on CPU, fp32).

* DP 2 × CP 1: step for step, the losses and gradient norms of plain ``transformers.Trainer`` with token-sum loss
  normalisation (``average_tokens_across_devices``, its default) on padded batches of the same sequences.
* DP 1 × CP 2 and DP 2 × CP 2, under DDP and FSDP2: those of the bundled trainer on the same plans, the DP 2 × CP 2
  plans holding spanning micro-batches with hybrid groups and DP ranks with different micro-batch counts; the
  evaluation loss too, and the Trainer's callbacks, logs, TensorBoard events and evaluation schedule.
* A run resumed from the Trainer's own checkpoint continues bit for bit (a shuffled epoch boundary inside).
* ``save_model`` writes a model transformers loads, and LoRA adapters peft loads, equal to what trained.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, Trainer, TrainerCallback

from tests.hf_runs import (
    PaddingCollator,
    batches,
    dataset,
    fresh_accelerate_state,
    logged_steps,
    records,
    training_arguments,
    write_jsonl,
)
from trainer_client.config import TrainConfig
from trainer_client.distributed import init_parallel, spawn_gloo
from trainer_client.hf import SkrullArguments, SkrullTrainer
from trainer_client.model import build_model
from trainer_client.plan_client import PlanSource
from trainer_client.trainer import Trainer as BundledTrainer

RELATIVE_TOLERANCE = 1e-6  # fp32: the same sums in another order
PROFILE = "h100-paper"  # the bundled trainer's CPU default, given to both so that they plan the same plans
# A DP 2 × CP 2 layout whose plans of these batches hold spanning micro-batches with hybrid groups, micro-batches within
# CP groups with sequences sharded over them, and DP ranks with different micro-batch counts (checked below).
NUM_STEPS, GLOBAL_BATCH, MAX_LENGTH, SEED, BUCKET_SIZE = 3, 16, 256, 5, 192


def _steps(log_history: list[dict[str, float]]) -> list[tuple[float, float]]:
    return [(entry["loss"], entry["grad_norm"]) for entry in logged_steps(log_history)]


class Recorder(TrainerCallback):
    """The Trainer's events a run went through, by name, and what it logged."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.logs: list[dict[str, float]] = []

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.events.append("train_begin")

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.events.append(f"step_end {state.global_step}")

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.events.append(f"evaluate {state.global_step}")

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None,
               **kwargs: Any) -> None:
        self.logs.append(dict(logs or {}))

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.events.append("train_end")


# ------------------------------------------------------------------------------------- against plain transformers


def _plain_and_skrull(out: Path) -> None:
    fresh_accelerate_state()
    rows = records(batches(num_steps=NUM_STEPS, global_batch=GLOBAL_BATCH, max_length=MAX_LENGTH, seed=0))
    steps = {}
    for name in ("plain", "skrull"):
        args = training_arguments(out / name, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                                  max_steps=NUM_STEPS)
        model = build_model("tiny", attn_implementation="sdpa", seed=0)
        common = {"model": model, "args": args, "train_dataset": dataset(rows), "data_collator": PaddingCollator()}
        trainer = (Trainer(**common) if name == "plain"
                   else SkrullTrainer(**common, skrull=SkrullArguments(bucket_size=128, profile=PROFILE)))
        trainer.train()
        steps[name] = _steps(trainer.state.log_history)
    trainer.save_model(str(out / "saved"))
    trained = {name: tensor.clone() for name, tensor in trainer.model.state_dict().items()}
    if dist.get_rank() == 0:
        torch.save({"steps": steps, "trained": trained, "attention": trainer.model.config._attn_implementation},
                   out / "results.pt")


@pytest.mark.slow
def test_dp2_cp1_trains_plain_transformers_trainers_losses_and_saves_a_model_transformers_loads(
    tmp_path: Path,
) -> None:
    spawn_gloo(_plain_and_skrull, 2, tmp_path)
    results = torch.load(tmp_path / "results.pt")
    plain, skrull = results["steps"]["plain"], results["steps"]["skrull"]
    assert len(plain) == len(skrull) == NUM_STEPS
    for step, ((plain_loss, plain_norm), (loss, norm)) in enumerate(zip(plain, skrull, strict=True), start=1):
        assert loss == pytest.approx(plain_loss, rel=RELATIVE_TOLERANCE), f"step {step}"
        assert norm == pytest.approx(plain_norm, rel=RELATIVE_TOLERANCE), f"step {step}"
    assert results["attention"] == "sdpa"  # the model's own attention again once training is over
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    for name, tensor in loaded.state_dict().items():
        torch.testing.assert_close(tensor, results["trained"][name], rtol=0, atol=0, msg=name)


# ------------------------------------------------------------------------------------- against the bundled trainer


def _plans_of(rows_batches: list[Any], *, dp: int, cp: int) -> list[Any]:
    source = PlanSource(scheduler="skrull", dp_size=dp, cp_size=cp, model="tiny", bucket_size=BUCKET_SIZE,
                        profile=PROFILE)
    return [source.decide(step, batch.sequence_lengths).plan for step, batch in enumerate(rows_batches)]


def _bundled_and_skrull(out: Path, dp: int, cp: int, fsdp: str | None) -> None:
    fresh_accelerate_state()
    global_batches = batches(num_steps=NUM_STEPS, global_batch=GLOBAL_BATCH, max_length=MAX_LENGTH, seed=SEED)
    train_file = write_jsonl(out / f"train-{dist.get_rank()}.jsonl", records(global_batches))
    held_out = records(batches(num_steps=1, global_batch=12, max_length=MAX_LENGTH, seed=SEED + 1))
    eval_file = write_jsonl(out / f"eval-{dist.get_rank()}.jsonl", held_out)
    config = TrainConfig(dp=dp, cp=cp, model="tiny", data=str(train_file), shuffle=False, global_batch=GLOBAL_BATCH,
                         steps=NUM_STEPS, scheduler="skrull", bucket_size=BUCKET_SIZE, max_length=MAX_LENGTH,
                         profile=PROFILE, lr=1e-3, min_lr_ratio=1.0, sharding=fsdp or "none", seed=0,
                         eval_data=str(eval_file), eval_every=2, progress=False)
    bundled = BundledTrainer(config, init_parallel(config.dims))
    history = bundled.train()
    bundled.close()

    fsdp_settings = ({"fsdp": True, "fsdp_config": {"reshard_after_forward": fsdp == "zero3"}} if fsdp else {})
    recorder = Recorder()
    args = training_arguments(out / "hf", per_device_train_batch_size=GLOBAL_BATCH // dp, max_steps=NUM_STEPS,
                              eval_strategy="steps", eval_steps=2, report_to=["tensorboard"], **fsdp_settings)
    trainer = SkrullTrainer(model=build_model("tiny", attn_implementation="sdpa", seed=0), args=args,
                            train_dataset=dataset(records(global_batches)), eval_dataset=dataset(held_out),
                            data_collator=PaddingCollator(), callbacks=[recorder],
                            skrull=SkrullArguments(bucket_size=BUCKET_SIZE, cp=cp, profile=PROFILE))
    trainer.train()
    if dist.get_rank() == 0:
        (out / "results.json").write_text(json.dumps({
            "bundled": [(m.loss, m.grad_norm, m.eval_loss) for m in history],
            "skrull": _steps(trainer.state.log_history),
            "eval": [entry["eval_loss"] for entry in trainer.state.log_history if "eval_loss" in entry],
            "events": recorder.events, "logs": recorder.logs}))


@pytest.mark.slow
@pytest.mark.parametrize(("dp", "cp", "fsdp"), [(1, 2, None), (2, 2, None), (2, 2, "zero2"), (2, 2, "zero3")])
def test_losses_equal_the_bundled_trainers_on_the_same_plans(tmp_path: Path, dp: int, cp: int,
                                                             fsdp: str | None) -> None:
    plans = _plans_of(batches(num_steps=NUM_STEPS, global_batch=GLOBAL_BATCH, max_length=MAX_LENGTH, seed=SEED),
                      dp=dp, cp=cp)
    assert any(mb.distributed for plan in plans for rank in plan.dp_ranks for mb in rank.micro_batches)
    if dp > 1:  # what the DP 2 × CP 2 plans must hold to test what they claim
        assert any(spanning.micro_batch.sharded for plan in plans for spanning in plan.spanning)
        assert any(len({len(rank.micro_batches) for rank in plan.dp_ranks}) > 1 for plan in plans)
    spawn_gloo(_bundled_and_skrull, dp * cp, tmp_path, dp, cp, fsdp)
    results = json.loads((tmp_path / "results.json").read_text())
    assert len(results["skrull"]) == len(results["bundled"]) == NUM_STEPS
    for step, ((loss, norm), (bundled_loss, bundled_norm, _)) in enumerate(
            zip(results["skrull"], results["bundled"], strict=True), start=1):
        assert loss == pytest.approx(bundled_loss, rel=RELATIVE_TOLERANCE), f"step {step}"
        assert norm == pytest.approx(bundled_norm, rel=RELATIVE_TOLERANCE), f"step {step}"
    # Evaluated every two steps and after the last, by both
    assert results["eval"] == [pytest.approx(results["bundled"][step][2], rel=RELATIVE_TOLERANCE) for step in (1, 2)]
    assert results["events"] == ["train_begin", "step_end 1", "step_end 2", "evaluate 2", "step_end 3", "evaluate 3",
                                 "train_end"]
    assert [set(logs) >= {"loss", "grad_norm", "learning_rate"} for logs in results["logs"][:1]] == [True]


@pytest.mark.slow
def test_the_trainer_reports_to_tensorboard(tmp_path: Path) -> None:
    """TensorBoard's events hold the losses the Trainer logged (DP 1 × CP 2, as above)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    spawn_gloo(_bundled_and_skrull, 2, tmp_path, 1, 2, None)
    results = json.loads((tmp_path / "results.json").read_text())
    (logging_dir,) = (tmp_path / "hf" / "runs").iterdir()  # the Trainer's default: output_dir/runs/<time and host>
    events = EventAccumulator(str(logging_dir))
    events.Reload()
    logged = [(event.step, event.value) for event in events.Scalars("train/loss")]
    assert logged == [(step, pytest.approx(loss, rel=1e-6))
                      for step, (loss, _) in enumerate(results["skrull"], start=1)]
    assert [event.value for event in events.Scalars("eval/loss")] == [pytest.approx(loss, rel=1e-6)
                                                                     for loss in results["eval"]]


# ------------------------------------------------------------------------------------- resume


def _trained_and_resumed(out: Path) -> None:
    """DP 1 × CP 2, four steps of 8 shuffled records out of 24 (an epoch boundary after step 3), checkpoints every
    two steps; then a new Trainer resumed from the checkpoint after step 2."""
    fresh_accelerate_state()
    rows = records(batches(num_steps=3, global_batch=8, max_length=MAX_LENGTH, seed=SEED))
    runs = {}
    for name, resume in (("whole", None), ("resumed", str(out / "whole" / "checkpoint-2"))):
        args = training_arguments(out / name, per_device_train_batch_size=8, max_steps=4, save_strategy="steps",
                                  save_steps=2, train_sampling_strategy="random")
        recorder = Recorder()
        trainer = SkrullTrainer(model=build_model("tiny", attn_implementation="sdpa", seed=0), args=args,
                                train_dataset=dataset(rows), data_collator=PaddingCollator(), callbacks=[recorder],
                                skrull=SkrullArguments(bucket_size=BUCKET_SIZE, cp=2, profile=PROFILE))
        trainer.train(resume_from_checkpoint=resume)
        runs[name] = {"steps": _steps(trainer.state.log_history), "events": recorder.events,
                      "weights": {key: value.clone() for key, value in trainer.model.state_dict().items()}}
    if dist.get_rank() == 0:
        torch.save(runs, out / "results.pt")


@pytest.mark.slow
def test_a_run_resumed_from_the_trainers_checkpoint_continues_bit_for_bit(tmp_path: Path) -> None:
    spawn_gloo(_trained_and_resumed, 2, tmp_path)
    runs = torch.load(tmp_path / "results.pt")
    whole, resumed = runs["whole"], runs["resumed"]
    assert whole["events"] == ["train_begin", *(f"step_end {step}" for step in range(1, 5)), "train_end"]
    assert resumed["events"] == ["train_begin", "step_end 3", "step_end 4", "train_end"]
    # Steps 1 and 2 come with the checkpoint's state; 3 and 4 are trained again, to exactly the same floats.
    assert resumed["steps"] == whole["steps"]
    for name, tensor in whole["weights"].items():
        assert torch.equal(resumed["weights"][name], tensor), name


# ------------------------------------------------------------------------------------- LoRA


def _lora(out: Path) -> None:
    from peft import LoraConfig, get_peft_model

    fresh_accelerate_state()
    rows = records(batches(num_steps=2, global_batch=8, max_length=MAX_LENGTH, seed=SEED))
    model = get_peft_model(build_model("tiny", attn_implementation="sdpa", seed=0),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    initial = {name: param.detach().clone() for name, param in model.named_parameters() if param.requires_grad}
    trainer = SkrullTrainer(model=model, args=training_arguments(out / "run", per_device_train_batch_size=8,
                                                                 max_steps=2),
                            train_dataset=dataset(rows), data_collator=PaddingCollator(),
                            skrull=SkrullArguments(bucket_size=BUCKET_SIZE, cp=2, profile=PROFILE))
    trainer.train()
    trainer.save_model(str(out / "adapters"))
    if dist.get_rank() == 0:
        trained = {name: param.detach().clone() for name, param in model.named_parameters() if param.requires_grad}
        torch.save({"initial": initial, "trained": trained}, out / "results.pt")


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")  # peft 0.21 on transformers 5
def test_lora_adapters_saved_by_the_trainer_load_with_peft(tmp_path: Path) -> None:
    from peft import PeftModel

    spawn_gloo(_lora, 2, tmp_path)
    results = torch.load(tmp_path / "results.pt")
    loaded = PeftModel.from_pretrained(build_model("tiny", attn_implementation="sdpa", seed=0), tmp_path / "adapters")
    adapters = {name: param for name, param in loaded.named_parameters() if "lora_" in name}
    assert adapters.keys() == results["trained"].keys()
    for name, tensor in results["trained"].items():
        torch.testing.assert_close(adapters[name], tensor, rtol=0, atol=0, msg=name)
    assert any(not torch.equal(tensor, results["initial"][name]) for name, tensor in results["trained"].items())
