"""Evaluation (``--eval-data``) and TensorBoard (``--report-to tensorboard``): the held-out mean token loss is the
same under every scheduler and sharding mode and equals the unsharded model's, it is logged beside the training
loss, and a held-out record too long for the layout stops every rank before any step (4 gloo ranks, dp 2 × cp 2,
fp32)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.distributed.tensor import DTensor

from trainer_client.config import TrainConfig
from trainer_client.data import IGNORE_INDEX, RecordEncoder
from trainer_client.data.evaluation import EvalSet
from trainer_client.demo import trainer_env
from trainer_client.distributed import ParallelDims, init_parallel, spawn_gloo
from trainer_client.models.model import build_model
from trainer_client.trainer import Trainer

DP, CP, STEPS, GLOBAL_BATCH, BUCKET_SIZE = 2, 2, 3, 4, 256
# (name, scheduler, sharding): static CP, Skrull and a baseline, under each sharding mode
RUNS = (("deepspeed", "deepspeed", "zero2"), ("skrull", "skrull", "zero2"), ("sorted_zero3", "sorted", "zero3"),
        ("skrull_none", "skrull", "none"))


def _write_records(path: Path, lengths: list[int], seed: int) -> Path:
    generator = random.Random(seed)
    with path.open("w") as records:
        for length in lengths:
            labels = [IGNORE_INDEX] * (length // 3) + [generator.randrange(1024) for _ in range(length - length // 3)]
            input_ids = [generator.randrange(1024) for _ in range(length)]
            records.write(json.dumps({"input_ids": input_ids, "labels": labels}) + "\n")
    return path


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("eval-data")
    _write_records(folder / "train.jsonl", [random.Random(1).randint(16, 400) for _ in range(12)], seed=1)
    # 7 records, global batch 4: a shorter last batch; lengths up to the whole CP group's buckets, so some shard
    _write_records(folder / "eval.jsonl", [500, 30, 12, 260, 90, 7, 480], seed=2)
    return folder


def _config(data: Path, **changes: object) -> TrainConfig:
    base: dict[str, object] = dict(dp=DP, cp=CP, model="tiny", data=str(data / "train.jsonl"), steps=STEPS,
                                   global_batch=GLOBAL_BATCH, bucket_size=BUCKET_SIZE, seed=0, progress=False,
                                   eval_data=str(data / "eval.jsonl"), eval_every=2, lr=1e-2)
    return TrainConfig(**{**base, **changes})  # type: ignore[arg-type]


def _train_every_run(data: Path, out_dir: Path) -> None:
    parallel = init_parallel(ParallelDims.of(TrainConfig(dp=DP, cp=CP)))
    results = {}
    for name, scheduler, sharding in RUNS:
        config = _config(data, scheduler=scheduler, sharding=sharding, metrics_out=out_dir / f"{name}.jsonl",
                         report_to=("tensorboard",), logging_dir=out_dir / f"tensorboard-{name}")
        trainer = Trainer(config, parallel)
        try:
            history = trainer.train()
            trained = {key: tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
                       for key, tensor in trainer.module.lm.state_dict().items()}
        finally:
            trainer.close()
        results[name] = {"eval_losses": [m.eval_loss for m in history], "losses": [m.loss for m in history]}
        if parallel.is_main:
            torch.save(trained, out_dir / f"trained-{name}.pt")
    if parallel.is_main:
        (out_dir / "results.json").write_text(json.dumps(results))
    dist.barrier()


@pytest.fixture(scope="module")
def runs(data: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, dict]]:
    out_dir = tmp_path_factory.mktemp("eval")
    spawn_gloo(_train_every_run, DP * CP, data, out_dir)
    return out_dir, json.loads((out_dir / "results.json").read_text())


def _unsharded_eval_loss(trained: Path, eval_data: Path) -> float:
    """One process, stock SDPA attention, one record at a time: the mean token loss over the whole set."""
    model = build_model("tiny", attn_implementation="sdpa")
    model.load_state_dict(torch.load(trained))
    evaluation = EvalSet.load(str(eval_data), encoder=RecordEncoder(max_length=1 << 20), global_batch_size=1)
    total = 0.0
    with torch.no_grad():
        for batch in evaluation.batches:
            (sample,) = batch.samples
            logits_TV = model(input_ids=torch.from_numpy(sample.input_ids)[None]).logits[0]
            total += float(F.cross_entropy(logits_TV, torch.from_numpy(sample.targets), ignore_index=IGNORE_INDEX,
                                           reduction="sum"))
    return total / evaluation.num_loss_tokens


@pytest.mark.slow
def test_the_eval_loss_is_the_same_under_every_scheduler_and_sharding(runs: tuple[Path, dict[str, dict]]) -> None:
    _, results = runs
    reference = results["deepspeed"]["eval_losses"]
    assert [loss is not None for loss in reference] == [False, True, True]  # after step 2 (--eval-every) and the last
    for name, *_ in RUNS:
        assert [loss is None for loss in results[name]["eval_losses"]] == [True, False, False]
        torch.testing.assert_close(results[name]["eval_losses"][1:], reference[1:], rtol=1e-5, atol=0)
    assert reference[1] != reference[2]  # the model trained between the two evaluations


@pytest.mark.slow
@pytest.mark.parametrize("name", ["skrull", "sorted_zero3"])
def test_the_eval_loss_is_the_unsharded_models_mean_token_loss(
    runs: tuple[Path, dict[str, dict]], data: Path, name: str
) -> None:
    out_dir, results = runs
    expected = _unsharded_eval_loss(out_dir / f"trained-{name}.pt", data / "eval.jsonl")
    assert results[name]["eval_losses"][-1] == pytest.approx(expected, rel=1e-5)


@pytest.mark.slow
def test_metrics_and_tensorboard_log_the_eval_loss_beside_the_training_loss(
    runs: tuple[Path, dict[str, dict]],
) -> None:
    out_dir, results = runs
    lines = [json.loads(line) for line in (out_dir / "skrull.jsonl").read_text().splitlines()]
    assert [line["eval_loss"] for line in lines] == results["skrull"]["eval_losses"]
    events = EventAccumulator(str(out_dir / "tensorboard-skrull"))
    events.Reload()
    scalars = {tag: [(event.step, event.value) for event in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    assert {"train/loss", "eval/loss", "train/lr", "train/grad_norm", "train/tokens_per_s", "plan/from_service",
            "time/micro_batches_measured_ms", "time/micro_batches_predicted_ms"} <= scalars.keys()
    for tag, key in (("train/loss", "loss"), ("train/lr", "lr"), ("train/grad_norm", "grad_norm"),
                     ("eval/loss", "eval_loss")):
        logged = [(line["step"], line[key]) for line in lines if line[key] is not None]
        assert [step for step, _ in scalars[tag]] == [step for step, _ in logged], tag
        torch.testing.assert_close([value for _, value in scalars[tag]], [value for _, value in logged], rtol=1e-6,
                                   atol=0)


def test_the_eval_set_is_cut_into_global_batches_in_file_order(data: Path) -> None:
    evaluation = EvalSet.load(str(data / "eval.jsonl"), encoder=RecordEncoder(max_length=512), global_batch_size=4)
    assert [batch.sequence_lengths for batch in evaluation.batches] == [(500, 30, 12, 260), (90, 7, 480)]
    assert [batch.step for batch in evaluation.batches] == [-1, -2]  # never a training step's key


@pytest.mark.parametrize(("changes", "message"), [
    ({"eval_every": 2, "eval_data": None}, "--eval-every needs --eval-data"),
    ({"eval_every": -1}, "--eval-every must not be negative, got -1"),
    ({"eval_data": "synthetic:lmsys"}, "--eval-data synthetic:lmsys is synthetic; evaluation needs held-out records"),
])
def test_bad_eval_flags_are_refused_naming_the_flag(data: Path, changes: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _config(data, **changes)


def test_an_eval_set_missing_empty_or_without_loss_tokens_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=f"--eval-data {tmp_path / 'missing.jsonl'}: no such file: "):
        EvalSet.load(str(tmp_path / "missing.jsonl"), encoder=RecordEncoder(max_length=64), global_batch_size=2)
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match=f"--eval-data {tmp_path / 'empty.jsonl'}: .* holds no records"):
        EvalSet.load(str(tmp_path / "empty.jsonl"), encoder=RecordEncoder(max_length=64), global_batch_size=2)
    (tmp_path / "masked.jsonl").write_text(json.dumps({"input_ids": [1, 2], "labels": [-100, -100]}) + "\n")
    with pytest.raises(ValueError, match="no record has a token with loss"):
        EvalSet.load(str(tmp_path / "masked.jsonl"), encoder=RecordEncoder(max_length=64), global_batch_size=2)


@pytest.mark.slow
def test_a_held_out_record_too_long_for_the_layout_stops_every_rank_before_any_step(
    data: Path, tmp_path: Path
) -> None:
    too_long = _write_records(tmp_path / "eval.jsonl", [20, BUCKET_SIZE * CP + 1], seed=3)
    metrics_out = tmp_path / "metrics.jsonl"
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(DP * CP),
         "-m", "trainer_client.train", "--dp", str(DP), "--cp", str(CP), "--no-progress", "--data",
         str(data / "train.jsonl"), "--eval-data", str(too_long), "--bucket-size", str(BUCKET_SIZE),
         "--metrics-out", str(metrics_out)],
        env=trainer_env(), capture_output=True, text=True, timeout=180, check=False,
    )
    assert result.returncode != 0
    message = (f"error: --eval-data {too_long}: record {too_long}:2 has {BUCKET_SIZE * CP + 1} tokens; the maximum "
               f"is {BUCKET_SIZE * CP}")
    assert result.stderr.count(message) == 1, result.stderr[-3000:]
    assert not metrics_out.exists()
