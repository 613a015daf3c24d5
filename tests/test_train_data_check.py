"""The training records are checked before the first step: one pass finds every record that cannot train, by file and
line, with counts; by default the run stops before any step, with ``--skip-bad-records`` it trains the others and lists
the ones it left out in the run folder and in ``run.json``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch.distributed as dist
from transformers import PreTrainedTokenizerFast

from tests.hub_cache import save_tokenizer
from trainer_client.components.checkpoint import saved_run_identity, step_dir
from trainer_client.config import TrainConfig
from trainer_client.data import Defect, RecordSource, make_source
from trainer_client.data.record_check import BAD_RECORDS_FILE, BadRecordsError, RecordCheck, check_records
from trainer_client.distributed import ParallelDims, init_parallel, spawn_gloo
from trainer_client.trainer import Trainer

CHAT = {"messages": [{"role": "user", "content": "what does the scheduler pack"},
                     {"role": "assistant", "content": "short chats beside long ones"}]}
LONG_CHAT = {"messages": [{"role": "user", "content": "the model reads long documents " * 40},
                          {"role": "assistant", "content": "and answers"}]}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def _write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def _bad_records(path: Path) -> Path:
    """60 good chats with, at lines 4, 8, 11, 23, 40, 51 and 57, one record of each defect a tokenizer and its
    template do not cause."""
    lines = [json.dumps(CHAT)] * 60
    lines[3] = json.dumps({"messages": []})
    lines[7] = json.dumps({"messages": [{"role": "user", "content": "hello"}]})
    lines[10] = json.dumps({"input_ids": [5, 6, 7], "labels": [-100, -100, -100]})
    lines[22] = json.dumps({"tokens": [5, 6]})
    lines[39] = "{not json"
    lines[50] = json.dumps(LONG_CHAT)
    lines[56] = json.dumps({"input_ids": [5, 5000]})
    return _write_lines(path, lines)


def _check(path: Path, tokenizer: Path, *, max_length: int = 128, plan_capacity: int | None = None,
           truncate: bool = False) -> RecordCheck:
    source = make_source(str(path), global_batch_size=4, vocab_size=1024, max_length=max_length, seed=0,
                         truncate=truncate, tokenizer=str(tokenizer))
    assert isinstance(source, RecordSource)
    return check_records(source.records, source.encoder, indices=np.arange(source.records.num_records),
                         plan_capacity=plan_capacity)


def test_one_pass_finds_every_record_that_cannot_train_by_its_line(tmp_path: Path, tokenizer_dir: Path) -> None:
    path = _bad_records(tmp_path / "chats.jsonl")
    checked = _check(path, tokenizer_dir)
    assert [(record.where, record.defect) for record in checked.bad] == [
        (f"{path}:4", Defect.EMPTY_CHAT), (f"{path}:8", Defect.NO_ASSISTANT), (f"{path}:11", Defect.NO_LOSS),
        (f"{path}:23", Defect.MALFORMED), (f"{path}:40", Defect.MALFORMED), (f"{path}:51", Defect.TOO_LONG),
        (f"{path}:57", Defect.MALFORMED)]
    long_tokens = checked.bad[5].num_tokens
    assert long_tokens is not None and long_tokens > 128
    assert checked.report(max_length=128, plan_capacity="256 tokens") == [
        f"  longer than --max-length 128, 1 record: {path}:51 ({long_tokens} tokens)",
        f"  no token with loss, 1 record: {path}:11",
        f"  an empty chat, 1 record: {path}:4",
        f"  a chat without an assistant turn, 1 record: {path}:8",
        "  malformed, 3 records:",
        f"    record {path}:23 has none of 'input_ids', 'messages', 'conversations', 'prompt' and 'completion', "
        "'text' (its keys: tokens); --text-field names another key of plain text",
        f"    record {path}:40 is not JSON: Expecting property name enclosed in double quotes: line 1 column 2 "
        "(char 1)",
        f"    record {path}:57: token ids must lie in [0, 1024)",
    ]
    assert checked.fixes() == ["--truncate cuts records to --max-length",
                               "--loss-on all trains every token of chats and prompt–completion records"]
    # The distribution of what trains: the 53 good chats.
    assert checked.summary().startswith("53 records, ")


def test_a_template_that_breaks_prefixes_is_found_for_each_chat_it_breaks(tmp_path: Path, tokenizer_dir: Path) -> None:
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
    tokenizer.chat_template = "{{ messages | length }}" + str(tokenizer.chat_template)  # the count moves the start
    tokenizer.save_pretrained(tmp_path / "counting")
    checked = _check(_write_lines(tmp_path / "chats.jsonl", [json.dumps(CHAT)] * 3), tmp_path / "counting")
    assert [record.defect for record in checked.bad] == [Defect.TEMPLATE] * 3


def test_a_record_longer_than_a_plan_holds_is_named_with_the_fix(tmp_path: Path, tokenizer_dir: Path) -> None:
    path = _write_lines(tmp_path / "chats.jsonl", [json.dumps(CHAT), json.dumps(LONG_CHAT)])
    checked = _check(path, tokenizer_dir, max_length=1024, plan_capacity=128)
    (record,) = checked.bad
    assert (record.where, record.defect) == (f"{path}:2", Defect.BEYOND_PLAN)
    assert checked.report(max_length=1024, plan_capacity="128 tokens (bucket size 64 × cp 1 × dp 2)") == [
        f"  longer than a plan of this layout holds (128 tokens (bucket size 64 × cp 1 × dp 2)), 1 record: "
        f"{path}:2 ({record.num_tokens} tokens)"]
    assert "a larger --bucket-size" in checked.fixes()[0]


def test_the_shares_of_the_ranks_merge_into_the_check_of_the_whole_set(tmp_path: Path, tokenizer_dir: Path) -> None:
    path = _bad_records(tmp_path / "chats.jsonl")
    source = make_source(str(path), global_batch_size=4, vocab_size=1024, max_length=128, seed=0,
                         tokenizer=str(tokenizer_dir))
    assert isinstance(source, RecordSource)
    whole = check_records(source.records, source.encoder, indices=np.arange(60))
    shares = [check_records(source.records, source.encoder, indices=np.arange(rank, 60, 3)) for rank in range(3)]
    merged = RecordCheck.merged(shares)
    assert merged.bad == whole.bad
    assert np.array_equal(merged.num_tokens, whole.num_tokens)
    assert np.array_equal(merged.num_loss_tokens, whole.num_loss_tokens)


def _numbered_source(path: Path, num_records: int, *, shuffle: bool) -> RecordSource:
    path.write_text("".join(json.dumps({"input_ids": [k + 1, 1000]}) + "\n" for k in range(num_records)))
    source = make_source(str(path), global_batch_size=3, vocab_size=1024, max_length=8, seed=5, shuffle=shuffle)
    assert isinstance(source, RecordSource)
    return source


@pytest.mark.parametrize("shuffle", [False, True])
def test_records_left_out_are_in_no_epoch_and_the_others_in_each_once(tmp_path: Path, shuffle: bool) -> None:
    source = _numbered_source(tmp_path / "d.jsonl", 10, shuffle=shuffle)
    whole = source.identity()
    source.leave_out((2, 7))
    assert source.num_records == 8 and source.steps_for_epochs(3) == 9  # batches of 3, 3 and 2 an epoch
    trained = [int(sample.input_ids[0]) - 1 for step in range(8) for sample in source.batch(step).samples]
    assert sorted(trained[:8]) == sorted(trained[8:16]) == [0, 1, 3, 4, 5, 6, 8, 9]
    assert source.identity().fingerprint != whole.fingerprint
    assert "2 records left out" in source.identity().fingerprint


@pytest.mark.parametrize("shuffle", [False, True])
def test_leaving_none_out_keeps_the_order_and_the_identity(tmp_path: Path, shuffle: bool) -> None:
    untouched = _numbered_source(tmp_path / "a.jsonl", 10, shuffle=shuffle)
    checked = _numbered_source(tmp_path / "a.jsonl", 10, shuffle=shuffle)
    checked.leave_out(())
    assert [checked.order(epoch).tolist() for epoch in range(3)] == [untouched.order(epoch).tolist()
                                                                     for epoch in range(3)]
    assert checked.identity() == untouched.identity()


# ---- the trainer: 2 gloo ranks, dp 1 × cp 2 --------------------------------------------------------------------


def _config(data: Path, tokenizer: Path, **changes: object) -> TrainConfig:
    base: dict[str, object] = dict(dp=1, cp=2, model="tiny", data=str(data), tokenizer=str(tokenizer), steps=3,
                                   global_batch=8, bucket_size=64, progress=False, shuffle=False)
    return TrainConfig(**{**base, **changes})  # type: ignore[arg-type]


def _start(data: Path, tokenizer: Path, out: Path, changes: dict[str, object]) -> None:
    """Build the trainer on every rank; record on rank 0 what stopped it, or train it."""
    config = _config(data, tokenizer, **changes)
    parallel = init_parallel(ParallelDims.of(config))
    try:
        trainer = Trainer(config, parallel)
    except BadRecordsError as error:
        if parallel.is_main:
            out.write_text(str(error))
        return
    try:
        history = trainer.train()
    finally:
        trainer.close()
    if parallel.is_main:
        out.write_text(json.dumps([metrics.loss for metrics in history]))
    dist.barrier()


@pytest.mark.slow
def test_bad_records_stop_every_rank_before_step_0_naming_them_all(tmp_path: Path, tokenizer_dir: Path) -> None:
    data, out, checkpoints = _bad_records(tmp_path / "chats.jsonl"), tmp_path / "out.txt", tmp_path / "ck"
    spawn_gloo(_start, 2, data, tokenizer_dir, out, {"checkpoint_dir": checkpoints, "checkpoint_every": 1})
    first, *listed, hint = out.read_text().splitlines()
    assert first == (f"--data {data}: 7 of 60 records cannot train (all listed in "
                     f"{checkpoints / BAD_RECORDS_FILE}):")
    assert [line.split(",")[0].strip() for line in listed if not line.startswith("    ")] == [
        "longer than --max-length 128", "no token with loss", "an empty chat", "a chat without an assistant turn",
        "malformed"]
    assert hint == ("hint: --truncate cuts records to --max-length; --loss-on all trains every token of chats and "
                    "prompt–completion records; --skip-bad-records trains the other 53 and leaves these out")
    assert not list(checkpoints.glob("step-*"))  # no step trained, no checkpoint written
    assert len((checkpoints / BAD_RECORDS_FILE).read_text().splitlines()) == 7


@pytest.mark.slow
def test_skip_bad_records_trains_the_others_and_records_what_it_left_out(tmp_path: Path, tokenizer_dir: Path) -> None:
    data, out, checkpoints = _bad_records(tmp_path / "chats.jsonl"), tmp_path / "out.txt", tmp_path / "ck"
    spawn_gloo(_start, 2, data, tokenizer_dir, out, {"checkpoint_dir": checkpoints, "skip_bad_records": True})
    assert len(json.loads(out.read_text())) == 3
    listed = [json.loads(line) for line in (checkpoints / BAD_RECORDS_FILE).read_text().splitlines()]
    assert [record["where"] for record in listed] == [f"{data}:{line}" for line in (4, 8, 11, 23, 40, 51, 57)]
    identity = saved_run_identity(step_dir(checkpoints, 3))
    assert identity is not None and "7 records left out" in identity.data.fingerprint
