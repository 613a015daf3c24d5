"""``SkrullTrainer`` trains the model plain transformers and the bundled trainer train, and keeps the Trainer's own
features working (gloo ranks on CPU, fp32).

* DP 2 × CP 1: step for step, the losses and gradient norms of plain ``transformers.Trainer`` with token-sum loss
  normalisation (``average_tokens_across_devices``, its default) on padded batches of the same sequences; and
  ``save_model`` writes the trained weights, which transformers loads.
* DP 1 × CP 2 and DP 2 × CP 2, planning with the scheduler service: those of the bundled trainer on the same plans
  (its embedded planner's), the plans holding sequences kept whole and sharded, the DP 2 × CP 2 ones spanning
  micro-batches with hybrid groups and DP ranks with different micro-batch counts; the evaluation loss too, and the
  Trainer's callbacks, logs, TensorBoard events and evaluation schedule. Under DDP: accelerate 1.15 shards with FSDP
  only on accelerators (given ``fsdp`` on CPU it trains with DDP), so the FSDP2 path is not exercised on CPU.
* A run resumed from the Trainer's own checkpoint continues bit for bit (a shuffled epoch boundary inside).
* LoRA adapters saved by the Trainer load with peft, equal to what trained.

Each run is made once per module (its fixture) and read by the tests that check it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, Trainer

from tests.hf_runs import (
    PaddingCollator,
    Recorder,
    batches,
    dataset,
    fresh_accelerate_state,
    logged_steps,
    records,
    training_arguments,
    write_jsonl,
)
from trainer_client.config import TrainConfig
from trainer_client.distributed import ParallelDims, init_parallel, spawn_gloo
from trainer_client.hf import SkrullArguments, SkrullTrainer
from trainer_client.models.model import build_model
from trainer_client.planning.source import PlanSource
from trainer_client.trainer import Trainer as BundledTrainer

pytestmark = pytest.mark.slow

RELATIVE_TOLERANCE = 1e-6  # fp32: the same sums in another order
PROFILE = "h100-paper"  # the bundled trainer's CPU default, given to both so that they plan the same plans
# A DP 2 × CP 2 layout whose plans of these batches hold spanning micro-batches with hybrid groups, micro-batches within
# CP groups with sequences sharded over them, and DP ranks with different micro-batch counts (checked below).
NUM_STEPS, GLOBAL_BATCH, MAX_LENGTH, SEED, BUCKET_SIZE = 3, 16, 256, 5, 192


def _steps(log_history: list[dict[str, float]]) -> list[tuple[float, float]]:
    return [(entry["loss"], entry["grad_norm"]) for entry in logged_steps(log_history)]


def _run(tmp_path_factory: pytest.TempPathFactory, name: str, fn: Callable[..., None], world_size: int,
         *args: Any) -> Path:
    """``fn(out, *args)`` on ``world_size`` gloo ranks; the folder ``out`` it wrote its results to."""
    out = tmp_path_factory.mktemp(name)
    spawn_gloo(fn, world_size, out, *args)
    return out


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


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _run(tmp_path_factory, "plain", _plain_and_skrull, 2)


def test_dp2_cp1_trains_plain_transformers_trainers_losses(plain_run: Path) -> None:
    results = torch.load(plain_run / "results.pt")
    plain, skrull = results["steps"]["plain"], results["steps"]["skrull"]
    assert len(plain) == len(skrull) == NUM_STEPS
    for step, ((plain_loss, plain_norm), (loss, norm)) in enumerate(zip(plain, skrull, strict=True), start=1):
        assert loss == pytest.approx(plain_loss, rel=RELATIVE_TOLERANCE), f"step {step}"
        assert norm == pytest.approx(plain_norm, rel=RELATIVE_TOLERANCE), f"step {step}"


def test_save_model_writes_the_trained_weights_and_the_models_own_attention_is_back(plain_run: Path) -> None:
    results = torch.load(plain_run / "results.pt")
    assert results["attention"] == "sdpa"  # the model's own attention again once training is over
    loaded = AutoModelForCausalLM.from_pretrained(plain_run / "saved")
    for name, tensor in loaded.state_dict().items():
        torch.testing.assert_close(tensor, results["trained"][name], rtol=0, atol=0, msg=name)


# ------------------------------------------------------------------------------------- against the bundled trainer


def _plans_of(global_batches: list[Any], *, dp: int, cp: int) -> list[Any]:
    source = PlanSource(scheduler="skrull", dp_size=dp, cp_size=cp, model="tiny", bucket_size=BUCKET_SIZE,
                        profile=PROFILE)
    return [source.decide(step, batch.sequence_lengths).plan for step, batch in enumerate(global_batches)]


def _bundled_and_skrull(out: Path, dp: int, cp: int, scheduler_url: str) -> None:
    """The bundled trainer (replicated, planning with the embedded planner), then ``SkrullTrainer`` under
    accelerate's DDP, planning with the scheduler service at ``scheduler_url``; both evaluate every two steps and
    after the last, the Trainer reporting to TensorBoard."""
    fresh_accelerate_state()
    global_batches = batches(num_steps=NUM_STEPS, global_batch=GLOBAL_BATCH, max_length=MAX_LENGTH, seed=SEED)
    train_file = write_jsonl(out / f"train-{dist.get_rank()}.jsonl", records(global_batches))
    held_out = records(batches(num_steps=1, global_batch=12, max_length=MAX_LENGTH, seed=SEED + 1))
    eval_file = write_jsonl(out / f"eval-{dist.get_rank()}.jsonl", held_out)
    config = TrainConfig(dp=dp, cp=cp, model="tiny", data=str(train_file), shuffle=False, global_batch=GLOBAL_BATCH,
                         steps=NUM_STEPS, scheduler="skrull", bucket_size=BUCKET_SIZE, max_length=MAX_LENGTH,
                         profile=PROFILE, lr=1e-3, min_lr_ratio=1.0, sharding="none", seed=0,
                         eval_data=str(eval_file), eval_every=2, progress=False)
    bundled = BundledTrainer(config, init_parallel(ParallelDims.of(config)))
    history = bundled.train()
    bundled.close()

    recorder = Recorder()
    args = training_arguments(out / "hf", per_device_train_batch_size=GLOBAL_BATCH // dp, max_steps=NUM_STEPS,
                              eval_strategy="steps", eval_steps=2, report_to=["tensorboard"])
    trainer = SkrullTrainer(model=build_model("tiny", attn_implementation="sdpa", seed=0), args=args,
                            train_dataset=dataset(records(global_batches)), eval_dataset=dataset(held_out),
                            data_collator=PaddingCollator(), callbacks=[recorder],
                            skrull=SkrullArguments(bucket_size=BUCKET_SIZE, cp=cp, profile=PROFILE,
                                                   scheduler_url=scheduler_url))
    trainer.train()
    if dist.get_rank() == 0:
        (out / "results.json").write_text(json.dumps({
            "fallbacks": trainer.skrull_batches.num_fallbacks,
            "bundled": [(m.loss, m.grad_norm, m.eval_loss) for m in history],
            "wrapped": type(trainer.model_wrapped).__name__, "steps": _steps(trainer.state.log_history),
            "eval": [entry["eval_loss"] for entry in trainer.state.log_history if "eval_loss" in entry],
            "events": recorder.events, "logs": recorder.logs}))


LAYOUTS = {"dp1-cp2": (1, 2), "dp2-cp2": (2, 2)}


def _plans_served(port: int) -> float:
    """The plans the service at ``port`` has answered, by its Prometheus metrics."""
    metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith('skrull_plan_requests_total{scheduler="skrull",status="200"}'))


@pytest.fixture(scope="module", params=list(LAYOUTS))
def bundled_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
                live_port: int) -> dict[str, Any]:
    dp, cp = LAYOUTS[request.param]
    served = _plans_served(live_port)
    out = _run(tmp_path_factory, request.param, _bundled_and_skrull, dp * cp, dp, cp,
               f"http://127.0.0.1:{live_port}")
    results: dict[str, Any] = json.loads((out / "results.json").read_text())
    return {**results, "out": out, "plans_served": _plans_served(live_port) - served}


def test_the_plans_hold_what_the_comparison_claims() -> None:
    for dp, cp in LAYOUTS.values():
        plans = _plans_of(batches(num_steps=NUM_STEPS, global_batch=GLOBAL_BATCH, max_length=MAX_LENGTH, seed=SEED),
                          dp=dp, cp=cp)
        micro_batches = [mb for plan in plans for rank in plan.dp_ranks for mb in rank.micro_batches]
        assert any(mb.distributed for mb in micro_batches) and any(any(mb.local) for mb in micro_batches)
        if dp > 1:
            assert any(spanning.micro_batch.sharded for plan in plans for spanning in plan.spanning)
            assert any(len({len(rank.micro_batches) for rank in plan.dp_ranks}) > 1 for plan in plans)


def test_the_trainer_plans_with_the_scheduler_service_when_given_one(bundled_run: dict[str, Any]) -> None:
    # Every step's batch, and the held-out set's two batches (8 and 4 records) at each of the two evaluations
    assert bundled_run["plans_served"] == NUM_STEPS + 2 * 2
    assert bundled_run["fallbacks"] == 0


def test_losses_and_evaluations_equal_the_bundled_trainers_on_the_same_plans(bundled_run: dict[str, Any]) -> None:
    bundled = bundled_run["bundled"]
    assert bundled_run["wrapped"] == "DistributedDataParallel"
    assert len(bundled_run["steps"]) == len(bundled) == NUM_STEPS
    for step, ((loss, norm), (bundled_loss, bundled_norm, _)) in enumerate(
            zip(bundled_run["steps"], bundled, strict=True), start=1):
        assert loss == pytest.approx(bundled_loss, rel=RELATIVE_TOLERANCE), f"step {step}"
        assert norm == pytest.approx(bundled_norm, rel=RELATIVE_TOLERANCE), f"step {step}"
    # Evaluated after step 2 and after the last, by both
    assert bundled_run["eval"] == [pytest.approx(bundled[step][2], rel=RELATIVE_TOLERANCE) for step in (1, 2)]


def test_the_trainers_callbacks_and_logs_see_every_step_and_evaluation(bundled_run: dict[str, Any]) -> None:
    assert bundled_run["events"] == ["train_begin", "step_end 1", "step_end 2", "evaluate 2", "step_end 3",
                                     "evaluate 3", "train_end"]
    step_logs = [logs for logs in bundled_run["logs"] if "loss" in logs]
    assert len(step_logs) == NUM_STEPS and all({"grad_norm", "learning_rate"} <= set(logs) for logs in step_logs)


def test_the_trainer_reports_to_tensorboard(bundled_run: dict[str, Any]) -> None:
    """TensorBoard's events hold the losses the Trainer logged."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (logging_dir,) = (bundled_run["out"] / "hf" / "runs").iterdir()  # the Trainer's default: output_dir/runs/<...>
    events = EventAccumulator(str(logging_dir))
    events.Reload()
    logged = [(event.step, event.value) for event in events.Scalars("train/loss")]
    assert logged == [(step, pytest.approx(loss, rel=1e-6))
                      for step, (loss, _) in enumerate(bundled_run["steps"], start=1)]
    assert [event.value for event in events.Scalars("eval/loss")] == [pytest.approx(loss, rel=1e-6)
                                                                     for loss in bundled_run["eval"]]


# ------------------------------------------------------------------------------------- resume


def _trained_and_resumed(out: Path) -> None:
    """DP 1 × CP 2, four steps of 8 shuffled records out of 24 (an epoch boundary after step 3), checkpoints every
    two steps; then a new Trainer resumed from the checkpoint after step 2."""
    rows = records(batches(num_steps=3, global_batch=8, max_length=MAX_LENGTH, seed=SEED))
    runs = {}
    for name, resume in (("whole", None), ("resumed", str(out / "whole" / "checkpoint-2"))):
        fresh_accelerate_state()
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


@pytest.fixture(scope="module")
def resume_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _run(tmp_path_factory, "resume", _trained_and_resumed, 2)


def test_a_run_resumed_from_the_trainers_checkpoint_continues_bit_for_bit(resume_run: Path) -> None:
    runs = torch.load(resume_run / "results.pt")
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


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _run(tmp_path_factory, "lora", _lora, 2)


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")  # peft 0.21 on transformers 5
def test_lora_adapters_saved_by_the_trainer_load_with_peft(lora_run: Path) -> None:
    from peft import PeftModel

    results = torch.load(lora_run / "results.pt")
    loaded = PeftModel.from_pretrained(build_model("tiny", attn_implementation="sdpa", seed=0), lora_run / "adapters")
    adapters = {name: param for name, param in loaded.named_parameters() if "lora_" in name}
    assert adapters.keys() == results["trained"].keys()
    for name, tensor in results["trained"].items():
        torch.testing.assert_close(adapters[name], tensor, rtol=0, atol=0, msg=name)
    assert any(not torch.equal(tensor, results["initial"][name]) for name, tensor in results["trained"].items())
