"""``--resume`` checks what it resumes: a checkpoint of another model, dp × cp, global batch or data stops every
rank before any step, naming each difference; a changed data source goes on when accepted, a changed schedule
always, each with a warning naming the change."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch.distributed as dist

from trainer_client import trainer as trainer_module
from trainer_client.components.checkpoint import COMPLETE, RUN_IDENTITY, saved_run_identity
from trainer_client.components.run_identity import ResumeMismatch, RunIdentity, check_resume, model_identity
from trainer_client.config import TrainConfig
from trainer_client.data import DataIdentity, DataSource, make_source
from trainer_client.distributed import ParallelDims, init_parallel, spawn_gloo
from trainer_client.models.lora import LoraSettings
from trainer_client.trainer import Trainer

CHECKPOINT = Path("ck/step-00000002")
SAVED = RunIdentity(model="tiny", dp=2, cp=2, global_batch=16,
                    data=DataIdentity(source="synthetic:lmsys", fingerprint="max length 1024"),
                    steps=20, warmup_steps=2, lr=1e-3, min_lr_ratio=0.1, seed=0, weight_decay=0.0, max_grad_norm=1.0,
                    loss_on="assistant")


def _check(current: RunIdentity, *, accept_data_change: bool = False, saved: RunIdentity | None = SAVED) -> list[str]:
    return check_resume(CHECKPOINT, saved, current, accept_data_change=accept_data_change)


def _write_jsonl(path: Path, records: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def _source(spec: Path | str, *, seed: int = 0, shuffle: bool = False) -> DataSource:
    return make_source(str(spec), global_batch_size=2, vocab_size=1024, max_length=64, seed=seed, shuffle=shuffle)


def _data_identity(spec: Path | str, *, seed: int = 0) -> DataIdentity:
    return _source(spec, seed=seed).identity()


# ------------------------------------------------------------------------------------------------ the record


def test_the_identity_is_a_readable_json_file_that_reads_back_equal() -> None:
    text = SAVED.to_json()
    assert json.loads(text)["data"] == {"source": "synthetic:lmsys", "fingerprint": "max length 1024"}
    assert RunIdentity.from_json(text) == SAVED


@pytest.mark.parametrize(("fingerprint", "seed", "read"), [
    ("seed 3, max length 1024", 3, "max length 1024"),
    ("812 bytes, first and last records sha256 0123, shuffled with seed 7", 7,
     "812 bytes, first and last records sha256 0123, shuffled"),
    ("812 bytes, first and last records sha256 0123, file order", None,
     "812 bytes, first and last records sha256 0123, file order"),
])
def test_a_record_written_before_the_seed_had_its_own_item_reads_it_from_the_fingerprint(
    fingerprint: str, seed: int | None, read: str
) -> None:
    fields = json.loads(SAVED.to_json())
    for later in ("seed", "weight_decay", "max_grad_norm", "loss_on"):
        del fields[later]
    fields["data"]["fingerprint"] = fingerprint
    old = RunIdentity.from_json(json.dumps(fields))
    assert (old.seed, old.data.fingerprint, old.weight_decay) == (seed, read, None)
    # what the record lacks is not compared: this run's weight decay and clipping pass without a word
    current = dataclasses.replace(old, weight_decay=0.01, max_grad_norm=0.5, loss_on="all")
    assert _check(current, saved=old) == []


def test_where_the_model_was_read_is_recorded_and_not_compared_its_digest_is(tmp_path: Path) -> None:
    assert _check(dataclasses.replace(SAVED, model_source=str(tmp_path / "moved"))) == []


def test_a_checkpoint_without_a_record_has_no_identity_and_a_broken_record_names_its_file(tmp_path: Path) -> None:
    assert saved_run_identity(tmp_path) is None
    (tmp_path / RUN_IDENTITY).write_text('{"model": "tiny"}')
    with pytest.raises(ValueError, match=rf"{RUN_IDENTITY} is not the record of a run"):
        saved_run_identity(tmp_path)


# ------------------------------------------------------------------------------------------------ the check


def test_resuming_the_same_run_passes_without_a_warning() -> None:
    assert _check(SAVED) == []


@pytest.mark.parametrize(("change", "named"), [
    ({"model": "small"}, "--model: saved tiny, this run small"),
    ({"dp": 4, "cp": 1}, "--dp × --cp: saved 2 × 2, this run 4 × 1"),
    ({"global_batch": 8}, "--global-batch: saved 16, this run 8"),
])
def test_another_model_layout_or_global_batch_is_refused_naming_both_values(
    change: dict[str, object], named: str
) -> None:
    with pytest.raises(ResumeMismatch, match=r"^checkpoint ck/step-00000002 was written by another run:\n") as refusal:
        _check(dataclasses.replace(SAVED, **change), accept_data_change=True)  # the flag accepts data changes only
    assert f"\n  {named}\n" in str(refusal.value)


def test_one_message_names_every_difference() -> None:
    other = dataclasses.replace(SAVED, model="small", global_batch=8,
                                data=DataIdentity(source="synthetic:wikipedia", fingerprint="max length 1024"))
    with pytest.raises(ResumeMismatch) as refusal:
        _check(other)
    assert str(refusal.value).splitlines()[1:] == [
        "  --model: saved tiny, this run small",
        "  --global-batch: saved 16, this run 8",
        "  --data: saved synthetic:lmsys (max length 1024), this run synthetic:wikipedia (max length 1024)",
        "resume with the saved values, or give another --checkpoint-dir to start afresh; --resume-accept-data-change "
        "trains the new data from the saved data position",
    ]


def test_other_data_is_refused_unless_accepted_and_then_named_in_a_warning() -> None:
    other = dataclasses.replace(SAVED, data=DataIdentity(source="synthetic:lmsys", fingerprint="max length 2048"))
    with pytest.raises(ResumeMismatch, match="--data: saved synthetic:lmsys .max length 1024., this run "
                                             r"synthetic:lmsys .max length 2048.\n.*--resume-accept-data"):
        _check(other)
    assert _check(other, accept_data_change=True) == [
        "--resume-accept-data-change: checkpoint ck/step-00000002 was trained on synthetic:lmsys (max length 1024); "
        "this run trains on synthetic:lmsys (max length 2048) from the saved data position"]


def test_another_seed_is_named_plainly_and_refused_as_other_data_is() -> None:
    with pytest.raises(ResumeMismatch) as refusal:
        _check(dataclasses.replace(SAVED, seed=1))
    assert str(refusal.value).splitlines()[1] == "  --seed: saved 0, this run 1"
    assert _check(dataclasses.replace(SAVED, seed=1), accept_data_change=True) == [
        "--resume-accept-data-change: checkpoint ck/step-00000002 was trained on --seed 0; this run trains on --seed 1 "
        "from the saved data position"]


def test_other_hyperparameters_are_accepted_with_a_warning_naming_each_change() -> None:
    changed = dataclasses.replace(SAVED, steps=40, warmup_steps=0, lr=2e-3, min_lr_ratio=0.0, weight_decay=0.01,
                                  max_grad_norm=0.5, loss_on="all")
    assert _check(changed) == [
        "resuming checkpoint ck/step-00000002 with other hyperparameters: --steps 20 → 40, --warmup-steps 2 → 0, "
        "--lr 0.001 → 0.002, --min-lr-ratio 0.1 → 0.0, --weight-decay 0.0 → 0.01, --max-grad-norm 1.0 → 0.5, "
        "--loss-on assistant → all"]


@pytest.mark.parametrize("field", [field.name for field in dataclasses.fields(RunIdentity)
                                   if field.name != "model_source"])
def test_every_item_of_the_identity_is_checked(field: str) -> None:
    value = getattr(SAVED, field)
    if isinstance(value, DataIdentity):
        changed: object = dataclasses.replace(value, fingerprint="other")
    elif field == "lora":  # full fine-tuning saved; LoRA adapters now
        changed = LoraSettings(rank=8, alpha=16)
    elif isinstance(value, int | float):
        changed = value + 1
    else:
        changed = value * 2
    try:
        warnings = _check(dataclasses.replace(SAVED, **{field: changed}))
    except ResumeMismatch:
        return
    assert warnings, f"a changed {field} passed unnoticed"


def test_a_checkpoint_without_a_record_is_resumed_with_a_warning_saying_nothing_was_checked() -> None:
    assert _check(dataclasses.replace(SAVED, model="small"), saved=None) == [
        "checkpoint ck/step-00000002 has no record of the run that wrote it, so its model, dp × cp, global batch "
        "and data cannot be checked: resuming it as this run's"]


def test_accepting_a_data_change_needs_resume() -> None:
    with pytest.raises(ValueError, match="--resume-accept-data-change goes with --resume"):
        TrainConfig(dp=1, cp=1, checkpoint_dir=Path("ck"), resume_accept_data_change=True)


# ------------------------------------------------------------------------------------------------ what the items hold


def test_a_jsonl_file_is_another_source_when_records_are_added_removed_or_changed_at_either_end(
    tmp_path: Path
) -> None:
    # The last record is longer than the blocks it is looked for in, from the end of the file.
    records: list[dict[str, object]] = [{"input_ids": [n] * 10} for n in range(50)]
    records.append({"input_ids": list(range(20_000))})
    path = _write_jsonl(tmp_path / "d.jsonl", records)
    saved = _data_identity(path)
    assert saved.source == str(path.resolve())
    assert saved.fingerprint.startswith(f"{path.stat().st_size} bytes, first and last records sha256 ")
    changes: list[list[dict[str, object]]] = [
        [*records, {"input_ids": [1]}],
        records[:-1],
        [{"input_ids": [9] * 10}, *records[1:]],
        [*records[:-1], {"input_ids": [9, *range(1, 20_000)]}],  # the same size: one digit at the record's start
    ]
    for changed in changes:
        assert _data_identity(_write_jsonl(path, changed)).fingerprint != saved.fingerprint
    _write_jsonl(path, records)
    assert _data_identity(path) == saved
    path.write_text(path.read_text() + "\n\n")  # blank lines hold no record: the same records, more bytes
    assert _data_identity(path).fingerprint.split(", ")[1] == saved.fingerprint.split(", ")[1]
    assert _data_identity(_write_jsonl(tmp_path / "copy.jsonl", records)).source != saved.source


def test_the_seed_of_records_is_their_orders_and_in_file_order_they_have_none(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "d.jsonl", [{"input_ids": [1, 2]}])
    assert _source(path, seed=5, shuffle=True).order_seed == 5
    assert _source(path, seed=5).order_seed is None  # file order: the seed changes nothing a resume trains
    assert _source(path, seed=5, shuffle=True).identity().fingerprint.endswith(", shuffled")


def test_a_datasets_directory_is_known_by_its_rows_and_datasets_fingerprint(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"input_ids": [[1, 2], [3]]}).save_to_disk(tmp_path / "a")
    datasets.Dataset.from_dict({"input_ids": [[1, 2], [4]]}).save_to_disk(tmp_path / "b")
    saved = _data_identity(tmp_path / "a")
    assert saved.fingerprint.startswith("2 rows, datasets fingerprint ")
    assert _data_identity(tmp_path / "a") == saved
    assert _data_identity(tmp_path / "b").fingerprint != saved.fingerprint


def test_a_synthetic_source_is_its_name_and_longest_length_and_its_seed_an_item_of_its_own() -> None:
    assert _data_identity("synthetic:lmsys") == DataIdentity(source="synthetic:lmsys", fingerprint="max length 64")
    assert _source("synthetic:lmsys", seed=1).order_seed == 1


def test_a_model_directory_is_known_by_its_config_wherever_and_however_it_was_saved(tmp_path: Path) -> None:
    assert model_identity("Tiny") == "tiny"
    config = {"model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 2}
    for name, extra in (("a", {"transformers_version": "4.50.0"}), ("b", {"transformers_version": "5.0.0",
                                                                          "_name_or_path": "/elsewhere"})):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({**config, **extra}))
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "config.json").write_text(json.dumps({**config, "hidden_size": 128}))
    assert model_identity(str(tmp_path / "a")) == model_identity(str(tmp_path / "b"))
    assert model_identity(str(tmp_path / "a")).startswith("config.json sha256 ")
    assert model_identity(str(tmp_path / "c")) != model_identity(str(tmp_path / "a"))


# ------------------------------------------------------------------------------------------------ on every rank

DP, CP, GLOBAL_BATCH = 2, 2, 8


def _config(data: Path, checkpoints: Path, **changes: object) -> TrainConfig:
    base: dict[str, object] = dict(dp=DP, cp=CP, model="tiny", data=str(data), global_batch=GLOBAL_BATCH, steps=4,
                                   bucket_size=512, progress=False, checkpoint_dir=checkpoints, resume=True)
    return TrainConfig(**{**base, **changes})  # type: ignore[arg-type]


def _resume_on_every_rank(config: TrainConfig, out_dir: Path) -> None:
    """Each rank writes what stopped it (or that nothing did) to a file of its own."""
    try:
        Trainer(config, init_parallel(ParallelDims.of(config))).close()
        outcome = "resumed"
    except ResumeMismatch as refusal:
        outcome = f"ResumeMismatch: {refusal}"
    (out_dir / f"rank{dist.get_rank()}.txt").write_text(outcome)


def _resume_where_only_rank_0_may_pick(config: TrainConfig, out_dir: Path) -> None:
    """As ``_resume_on_every_rank``, where a rank other than 0 that looks for the newest checkpoint fails: on a
    shared file system it could see another one."""
    if dist.get_rank() != 0:
        def only_rank_0_picks(directory: Path) -> Path | None:
            raise AssertionError(f"rank {dist.get_rank()} looked for the newest checkpoint in {directory} itself")
        trainer_module.latest_checkpoint = only_rank_0_picks  # type: ignore[assignment]
    _resume_on_every_rank(config, out_dir)


@pytest.mark.slow  # four processes
@pytest.mark.parametrize("ranks_run", [_resume_on_every_rank, _resume_where_only_rank_0_may_pick])
def test_every_rank_refuses_a_checkpoint_of_another_global_batch_before_reading_its_state(
    tmp_path: Path, ranks_run: Callable[[TrainConfig, Path], None]
) -> None:
    data = _write_jsonl(tmp_path / "d.jsonl", [{"input_ids": list(range(1, n + 3))} for n in range(32)])
    checkpoints = tmp_path / "ck"
    config = _config(data, checkpoints)
    # The record alone, no DCP state: a trainer that read the state before checking would fail on its absence.
    step = checkpoints / "step-00000002"
    step.mkdir(parents=True)
    saved = dataclasses.replace(RunIdentity.of(config, _source(data, shuffle=config.shuffle)), global_batch=16)
    (step / RUN_IDENTITY).write_text(saved.to_json())
    (step / COMPLETE).touch()
    spawn_gloo(ranks_run, DP * CP, config, tmp_path)  # every rank gets rank 0's pick and its verdict
    outcomes = {(tmp_path / f"rank{rank}.txt").read_text() for rank in range(DP * CP)}
    assert outcomes == {f"ResumeMismatch: checkpoint {step} was written by another run:\n"
                        f"  --global-batch: saved 16, this run {GLOBAL_BATCH}\n"
                        "resume with the saved values, or give another --checkpoint-dir to start afresh"}

