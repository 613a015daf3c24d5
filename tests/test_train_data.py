"""Training data: deterministic synthetic batches, streamed JSONL and datasets records (token ids, chats with prompt
masking, text) with a tokenizer built here, resumable positions, clear errors."""

from __future__ import annotations

import csv
import json
import os
import re
from pathlib import Path

import datasets.config
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from datasets import Dataset, DatasetDict
from transformers import PreTrainedTokenizerFast

from scheduler_service.core.samplers import sample_lengths
from tests.hub_cache import CHATML, save_tokenizer
from trainer_client.data import (
    CHAT_ROLES,
    IGNORE_INDEX,
    SHAREGPT_ROLES,
    BadRecordError,
    DataSource,
    JsonlRecords,
    LengthStats,
    RecordSource,
    RecordTooLongError,
    Sample,
    load_tokenizer,
    make_source,
)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def _write(path: Path, records: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _source(spec: Path | str, *, global_batch: int = 2, max_length: int = 64, tokenizer: Path | None = None,
            truncate: bool = False, shuffle: bool = False, seed: int = 0) -> DataSource:
    return make_source(str(spec), global_batch_size=global_batch, vocab_size=1024, max_length=max_length, seed=seed,
                       truncate=truncate, tokenizer=str(tokenizer) if tokenizer else None, shuffle=shuffle)


def _numbered(path: Path, num_records: int) -> Path:
    """Records told apart by their first token: record ``k`` starts with ``k + 1``."""
    return _write(path, [{"input_ids": [k + 1, 1000]} for k in range(num_records)])


def _first_tokens(source: DataSource, steps: range) -> list[int]:
    return [int(sample.input_ids[0]) - 1 for step in steps for sample in source.batch(step).samples]


def test_synthetic_batches_are_the_same_on_every_call_and_follow_the_sampler() -> None:
    source = make_source("synthetic:chatqa2", global_batch_size=8, vocab_size=1024, max_length=4096, seed=3)
    first, again = source.batch(5), source.batch(5)
    assert first.sequence_lengths == again.sequence_lengths
    assert all(np.array_equal(a.input_ids, b.input_ids) for a, b in zip(first.samples, again.samples, strict=True))
    expected = sample_lengths("chatqa2", 8, np.random.default_rng([3, 5]), max_length=4096)
    assert first.sequence_lengths == tuple(int(n) for n in expected)
    assert source.batch(6).sequence_lengths != first.sequence_lengths


def test_targets_are_labels_shifted_left() -> None:
    sample = Sample(input_ids=np.array([5, 6, 7, 8]), labels=np.array([5, IGNORE_INDEX, 7, 8]))
    assert sample.targets.tolist() == [IGNORE_INDEX, 7, 8, IGNORE_INDEX]
    assert sample.num_loss_tokens == 2


def test_jsonl_reads_labels_and_loss_masks_in_order_and_starts_again_after_the_epoch(tmp_path: Path) -> None:
    path = _write(tmp_path / "d.jsonl", [
        {"input_ids": [1, 2, 3]},
        {"input_ids": [4, 5, 6], "labels": [-100, 5, 6]},
        {"input_ids": [7, 8, 9], "loss_mask": [0, 0, 1]},
    ])
    source = _source(path)
    first, second, third = source.batch(0), source.batch(1), source.batch(2)
    assert [s.labels.tolist() for s in first.samples] == [[1, 2, 3], [-100, 5, 6]]
    assert [s.labels.tolist() for s in second.samples] == [[-100, -100, 9]]  # the epoch's last: the record left
    assert [s.labels.tolist() for s in third.samples] == [[1, 2, 3], [-100, 5, 6]]  # the next epoch


def test_a_source_moved_to_a_saved_position_continues_with_the_same_batches(tmp_path: Path) -> None:
    path = _write(tmp_path / "d.jsonl", [{"input_ids": list(range(1, n + 2))} for n in range(7)])
    source = _source(path, global_batch=3)
    batches = [source.batch(step) for step in range(4)]
    resumed = _source(path, global_batch=3)
    resumed.seek(batches[1].next_position)
    assert [resumed.batch(step).sequence_lengths for step in (2, 3)] == [b.sequence_lengths for b in batches[2:]]


def test_a_shuffled_epoch_trains_every_record_once_in_another_order_each_epoch(tmp_path: Path) -> None:
    path = _numbered(tmp_path / "d.jsonl", 12)
    order = _first_tokens(_source(path, global_batch=4, shuffle=True, seed=7), range(6))  # two epochs
    first_epoch, second_epoch = order[:12], order[12:]
    assert sorted(first_epoch) == sorted(second_epoch) == list(range(12))
    assert first_epoch != list(range(12)) and second_epoch != first_epoch
    assert _first_tokens(_source(path, global_batch=4, shuffle=True, seed=7), range(6)) == order  # every rank's
    assert _first_tokens(_source(path, global_batch=4, shuffle=True, seed=8), range(3)) != first_epoch
    assert _first_tokens(_source(path, global_batch=4), range(6)) == list(range(12)) * 2  # --no-shuffle


def test_an_epochs_last_batch_takes_the_records_left_and_no_batch_holds_two_epochs(tmp_path: Path) -> None:
    path = _numbered(tmp_path / "d.jsonl", 5)
    source = _source(path, global_batch=3, shuffle=True, seed=1)
    assert isinstance(source, RecordSource)
    assert source.steps_for_epochs(2) == 4  # 5 records in batches of 3 and 2, twice
    batches = [source.batch(step) for step in range(4)]
    assert [len(batch.samples) for batch in batches] == [3, 2, 3, 2]
    assert [source.epochs_done(batch.next_position) for batch in batches] == [0.6, 1.0, 1.6, 2.0]
    first_tokens = [[int(sample.input_ids[0]) - 1 for sample in batch.samples] for batch in batches]
    assert first_tokens[0] + first_tokens[1] == source.order(0).tolist()
    assert first_tokens[2] + first_tokens[3] == source.order(1).tolist()


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("epochs", [1, 2])
def test_epochs_of_57_records_in_batches_of_8_train_every_record_once_an_epoch_and_end_on_the_epoch(
    tmp_path: Path, epochs: int, shuffle: bool,
) -> None:
    source = _source(_numbered(tmp_path / "d.jsonl", 57), global_batch=8, shuffle=shuffle, seed=4)
    assert isinstance(source, RecordSource)
    steps = source.steps_for_epochs(epochs)
    assert steps == 8 * epochs
    batches = [source.batch(step) for step in range(steps)]
    assert [len(batch.samples) for batch in batches] == ([8] * 7 + [1]) * epochs
    ends = [source.epochs_done(batch.next_position) for batch in batches]
    assert ends[7::8] == [float(epoch) for epoch in range(1, epochs + 1)]  # exactly, each epoch's last step
    trained = [int(sample.input_ids[0]) - 1 for batch in batches for sample in batch.samples]
    for epoch in range(epochs):
        assert sorted(trained[57 * epoch:57 * (epoch + 1)]) == list(range(57))  # each record once an epoch
    assert source.epochs_text(epochs) == {
        1: "1 epoch of 57 records in global batches of 8: 8 steps, the last of 1 record",
        2: "2 epochs of 57 records in global batches of 8: 16 steps, each epoch's last of 1 record"}[epochs]


def test_an_epoch_of_whole_batches_is_logged_without_a_last_batch(tmp_path: Path) -> None:
    source = _source(_numbered(tmp_path / "d.jsonl", 64), global_batch=16)
    assert isinstance(source, RecordSource)
    assert source.epochs_text(2) == "2 epochs of 64 records in global batches of 16: 8 steps"
    assert source.epochs_text(0.5) == "0.5 epochs of 64 records in global batches of 16: 2 steps"


@pytest.mark.parametrize("shuffle", [False, True])
def test_a_resumed_source_continues_the_same_order_mid_epoch(tmp_path: Path, shuffle: bool) -> None:
    path = _numbered(tmp_path / "d.jsonl", 7)
    source = _source(path, global_batch=3, shuffle=shuffle, seed=3)
    batches = [source.batch(step) for step in range(5)]
    resumed = _source(path, global_batch=3, shuffle=shuffle, seed=3)
    resumed.seek(batches[2].next_position)  # mid the second epoch
    assert [resumed.batch(step).sequence_lengths for step in (3, 4)] == [b.sequence_lengths for b in batches[3:]]


def test_a_records_order_is_part_of_what_a_resume_checks(tmp_path: Path) -> None:
    path = _numbered(tmp_path / "d.jsonl", 3)
    orders = {(str(source.identity()), source.order_seed) for source in (
        _source(path, shuffle=shuffle, seed=seed) for shuffle, seed in ((True, 1), (True, 2), (False, 1)))}
    assert len(orders) == 3  # the seed of a shuffled order is an item of its own (run_identity.py)
    assert str(_source(path).identity()).endswith(", file order)")


def test_a_position_of_another_kind_is_refused_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"data position \{'offset': 10, 'line': 2\}"):
        _source(_numbered(tmp_path / "d.jsonl", 3)).seek({"offset": 10, "line": 2})


def test_rejects_record_longer_than_max_length_naming_it(tmp_path: Path) -> None:
    path = _write(tmp_path / "d.jsonl", [{"input_ids": [1, 2]}, {"input_ids": list(range(20))}])
    with pytest.raises(RecordTooLongError, match=r"d\.jsonl:2 has 20 tokens; the maximum is 8.*--truncate"):
        _source(path, max_length=8).batch(0)
    assert _source(path, max_length=8, truncate=True).batch(0).sequence_lengths == (2, 8)


@pytest.mark.parametrize(("record", "message"), [
    ({"tokens": [1]}, r"none of 'input_ids', 'messages', 'conversations', 'prompt' and 'completion', 'text' \(its "
                        r"keys: tokens\); --text-field names another key of plain text"),
    ({"input_ids": []}, "non-empty"),
    ({"input_ids": [1, 2], "labels": [1]}, "labels has 1 entries"),
    ({"input_ids": [1, 5000]}, r"token ids must lie in \[0, 1024\)"),
    ({"text": "hello"}, "give --tokenizer"),
])
def test_rejects_malformed_records(tmp_path: Path, record: dict[str, object], message: str) -> None:
    path = _write(tmp_path / "d.jsonl", [record])
    with pytest.raises(ValueError, match=message):
        _source(path, global_batch=1).batch(0)


def test_rejects_unknown_data_spec() -> None:
    with pytest.raises(ValueError, match="unknown synthetic data set 'imdb'"):
        make_source("synthetic:imdb", global_batch_size=1, vocab_size=8, max_length=8, seed=0)
    with pytest.raises(ValueError, match=r"--data lmsys: 'lmsys' is neither a JSONL file, nor a parquet, CSV or JSON "
                                         r"file, nor a dataset folder \(DIR\[:SPLIT\]\), nor a Hugging Face Hub "
                                         r"dataset id \(ORG/NAME\[@REVISION\]\[:SPLIT\]\)"):
        make_source("lmsys", global_batch_size=1, vocab_size=8, max_length=8, seed=0)


@pytest.mark.parametrize("spec", ["data/train.jsonl", "data/trian.parquet:test", "org/set.csv", "x.parquet"])
def test_a_missing_data_file_is_named_as_one_never_looked_up_on_the_hub(spec: str) -> None:
    with pytest.raises(ValueError, match=f"--data {re.escape(spec)}: no such file: '{re.escape(spec)}' in "
                                         f"{re.escape(str(Path.cwd()))} \\(a name with a data file's suffix is a file, "
                                         "never a Hugging Face Hub id\\)$"):
        make_source(spec, global_batch_size=1, vocab_size=8, max_length=8, seed=0)


CHAT = {"messages": [
    {"role": "system", "content": "answer briefly"},
    {"role": "user", "content": "what does the scheduler pack"},
    {"role": "assistant", "content": "short chats beside long ones"},
    {"role": "user", "content": "why"},
    {"role": "assistant", "content": "so that every rank finishes at the same time"},
]}


def test_chat_records_train_only_the_assistant_turns(tmp_path: Path, tokenizer_dir: Path) -> None:
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
    sample = _source(_write(tmp_path / "chat.jsonl", [CHAT]), global_batch=1, max_length=512,
                     tokenizer=tokenizer_dir).batch(0).samples[0]
    assert tokenizer.decode(sample.input_ids) == tokenizer.apply_chat_template(CHAT["messages"], tokenize=False)
    trained = [tokenizer.decode(sample.input_ids[run]) for run in _runs(sample.labels != IGNORE_INDEX)]
    assert trained == ["short chats beside long ones<|im_end|>\n",
                       "so that every rank finishes at the same time<|im_end|>\n"]


def _runs(mask: np.ndarray) -> list[slice]:
    """The maximal runs of True in ``mask``."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return [slice(start, stop) for start, stop in zip(edges[::2], edges[1::2], strict=True)]


def test_text_records_train_every_token_and_end_with_end_of_text(tmp_path: Path, tokenizer_dir: Path) -> None:
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
    sample = _source(_write(tmp_path / "text.jsonl", [{"text": "the model reads long documents"}]), global_batch=1,
                     tokenizer=tokenizer_dir).batch(0).samples[0]
    assert tokenizer.decode(sample.input_ids) == "the model reads long documents<|endoftext|>"
    assert np.array_equal(sample.labels, sample.input_ids)


def _sample(tmp_path: Path, tokenizer_dir: Path, record: dict[str, object], **encoding: object) -> Sample:
    source = make_source(str(_write(tmp_path / "records.jsonl", [record])), global_batch_size=1, vocab_size=1024,
                         max_length=512, seed=0, tokenizer=str(tokenizer_dir), **encoding)  # type: ignore[arg-type]
    return source.batch(0).samples[0]


def _trained_text(tokenizer_dir: Path, sample: Sample) -> list[str]:
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
    return [tokenizer.decode(sample.input_ids[run]) for run in _runs(sample.labels != IGNORE_INDEX)]


def test_a_prompt_completion_record_trains_its_completion_and_end_as_trl_does(tmp_path: Path,
                                                                             tokenizer_dir: Path) -> None:
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
    record = {"prompt": "what does the scheduler pack", "completion": " short chats beside long ones"}
    sample = _sample(tmp_path, tokenizer_dir, record)
    # tokenized apart, so that no token straddles prompt and completion; the completion ends with end-of-text
    assert sample.input_ids.tolist() == (tokenizer.encode(record["prompt"]) + tokenizer.encode(record["completion"])
                                         + [tokenizer.eos_token_id])
    assert _trained_text(tokenizer_dir, sample) == [" short chats beside long ones<|endoftext|>"]
    everything = _sample(tmp_path, tokenizer_dir, record, loss_on="all")
    assert np.array_equal(everything.labels, everything.input_ids)


def test_a_conversational_prompt_completion_record_is_a_chat_whose_completion_trains(tmp_path: Path,
                                                                                   tokenizer_dir: Path) -> None:
    prompt, completion = CHAT["messages"][:-1], CHAT["messages"][-1:]
    sample = _sample(tmp_path, tokenizer_dir, {"prompt": prompt, "completion": completion})
    chat = _sample(tmp_path, tokenizer_dir, CHAT)
    assert np.array_equal(sample.input_ids, chat.input_ids)
    assert _trained_text(tokenizer_dir, sample) == ["so that every rank finishes at the same time<|im_end|>\n"]


def test_a_sharegpt_conversation_is_the_chat_of_its_speakers(tmp_path: Path, tokenizer_dir: Path) -> None:
    speaker = {"system": "system", "user": "human", "assistant": "gpt"}
    conversations = [{"from": speaker[m["role"]], "value": m["content"]} for m in CHAT["messages"]]
    sample = _sample(tmp_path, tokenizer_dir, {"conversations": conversations})
    chat = _sample(tmp_path, tokenizer_dir, CHAT)
    assert np.array_equal(sample.input_ids, chat.input_ids) and np.array_equal(sample.labels, chat.labels)
    with pytest.raises(ValueError, match=r"'conversations' has speakers 'narrator'; ShareGPT's are human, user, gpt"):
        _sample(tmp_path, tokenizer_dir, {"conversations": [{"from": "narrator", "value": "once"}]})


def test_every_sharegpt_speaker_is_a_chat_role() -> None:
    assert set(SHAREGPT_ROLES.values()) <= set(CHAT_ROLES)


HELLO_BOT = [{"role": "user", "content": "hi"}, {"role": "bot", "content": "hello"}]


@pytest.mark.parametrize(("record", "refusal"), [
    ({"messages": HELLO_BOT}, "'messages' has roles 'bot'; a chat's are system, user, assistant, tool"),
    ({"prompt": HELLO_BOT[:1], "completion": HELLO_BOT[1:]},
     "'completion' has roles 'bot'; a chat's are system, user, assistant, tool"),
    ({"prompt": [{"role": "human", "content": "hi"}], "completion": [{"role": "assistant", "content": "hello"}]},
     "'prompt' has roles 'human'; a chat's are system, user, assistant, tool"),
    ({"conversations": [{"from": "human", "value": "hi"}, {"from": "bot", "value": "hello"}]},
     "'conversations' has speakers 'bot'; ShareGPT's are human, user, gpt"),
])
@pytest.mark.parametrize("loss_on", ["assistant", "all"])
def test_a_turn_of_a_role_outside_the_chat_roles_is_refused_naming_the_line_the_key_and_the_roles(
    tmp_path: Path, tokenizer_dir: Path, record: dict[str, object], refusal: str, loss_on: str,
) -> None:
    """Also with --loss-on all, which needs no assistant turn: a template renders any role (``<|im_start|>bot``)."""
    path = _write(tmp_path / "chats.jsonl", [CHAT, record])  # the second record: line 2
    source = make_source(str(path), global_batch_size=2, vocab_size=1024, max_length=512, seed=0,
                         tokenizer=str(tokenizer_dir), loss_on=loss_on)  # type: ignore[arg-type]
    with pytest.raises(BadRecordError, match=f"^record {re.escape(str(path))}:2: {re.escape(refusal)}"):
        source.batch(0)


@pytest.mark.parametrize(("loss_on", "trained"), [
    ("assistant", ["short chats beside long ones<|im_end|>\n", "so that every rank finishes at the same time"
                                                                "<|im_end|>\n"]),
    ("completion", ["so that every rank finishes at the same time<|im_end|>\n"]),
])
def test_loss_on_picks_a_chats_answers_as_trls_assistant_and_completion_only_loss(
    tmp_path: Path, tokenizer_dir: Path, loss_on: str, trained: list[str]
) -> None:
    assert _trained_text(tokenizer_dir, _sample(tmp_path, tokenizer_dir, CHAT, loss_on=loss_on)) == trained


def test_loss_on_all_trains_every_token_of_the_rendered_chat(tmp_path: Path, tokenizer_dir: Path) -> None:
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
    sample = _sample(tmp_path, tokenizer_dir, CHAT, loss_on="all")
    assert sample.input_ids.tolist() == tokenizer.apply_chat_template(CHAT["messages"], tokenize=True,
                                                                      return_dict=False)
    assert np.array_equal(sample.labels, sample.input_ids)
    # a chat without an assistant turn trains too: every token has loss
    assert _sample(tmp_path, tokenizer_dir, {"messages": CHAT["messages"][:2]}, loss_on="all").num_loss_tokens > 0


def test_text_field_names_the_key_of_plain_text(tmp_path: Path, tokenizer_dir: Path) -> None:
    sample = _sample(tmp_path, tokenizer_dir, {"body": "the model reads long documents"}, text_field="body")
    assert np.array_equal(sample.input_ids,
                          _sample(tmp_path, tokenizer_dir, {"text": "the model reads long documents"}).input_ids)


def test_a_tokenizer_without_a_chat_template_takes_one_by_name_or_from_a_file(tmp_path: Path,
                                                                            tokenizer_dir: Path) -> None:
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
    tokenizer.chat_template = None
    tokenizer.save_pretrained(tmp_path / "plain")
    with pytest.raises(ValueError, match=r"holds a chat, and the tokenizer has no chat template: give "
                                         r"--chat-template \(chatml, or a file of Jinja\)"):
        _sample(tmp_path, tmp_path / "plain", CHAT)
    templated = _sample(tmp_path, tokenizer_dir, CHAT)
    assert np.array_equal(_sample(tmp_path, tmp_path / "plain", CHAT, chat_template="chatml").labels, templated.labels)
    (tmp_path / "chatml.jinja").write_text(CHATML)
    from_file = _sample(tmp_path, tmp_path / "plain", CHAT, chat_template=str(tmp_path / "chatml.jinja"))
    assert np.array_equal(from_file.labels, templated.labels)
    with pytest.raises(ValueError, match=r"--chat-template 'llama9' is neither a file of Jinja nor a template known by "
                                         r"name \(chatml\)"):
        _sample(tmp_path, tmp_path / "plain", CHAT, chat_template="llama9")


def test_a_folder_that_holds_no_tokenizer_is_refused_naming_the_flag(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=f"--tokenizer {tmp_path}: transformers cannot load a tokenizer from "):
        load_tokenizer(str(tmp_path))


def test_a_datasets_directory_gives_the_batches_of_the_same_records_in_jsonl(tmp_path: Path,
                                                                            tokenizer_dir: Path) -> None:
    from datasets import Dataset

    records = [CHAT, {"text": "every rank finishes"}, {"text": "the scheduler packs"}]
    Dataset.from_list([{"messages": r.get("messages"), "text": r.get("text")} for r in records]).save_to_disk(
        tmp_path / "dataset")
    # a row holds every column; the first present key decides, so None columns must not count as present
    jsonl = _source(_write(tmp_path / "d.jsonl", records), global_batch=2, max_length=512, tokenizer=tokenizer_dir,
                    shuffle=True)
    folder = _source(tmp_path / "dataset", global_batch=2, max_length=512, tokenizer=tokenizer_dir, shuffle=True)
    for step in range(3):  # two epochs, each shuffled alike
        for expected, got in zip(jsonl.batch(step).samples, folder.batch(step).samples, strict=True):
            assert np.array_equal(expected.input_ids, got.input_ids) and np.array_equal(expected.labels, got.labels)


TOKEN_RECORDS = [{"input_ids": [k + 1, 7, 1000 - k], "labels": [-100, 7, 1000 - k]} for k in range(5)]
TEXT_RECORDS = [{"text": text} for text in ("the model reads", "long documents, and answers", "every rank finishes",
                                            "the scheduler packs", "short chats beside long ones")]


def _write_as(path: Path, records: list[dict[str, object]]) -> Path:
    """``records`` as a parquet, CSV (one column) or JSON-array file, by ``path``'s suffix."""
    if path.suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(records), path)
    elif path.suffix == ".csv":
        with path.open("w", newline="") as file:
            writer = csv.DictWriter(file, fieldnames=list(records[0]))
            writer.writeheader()
            writer.writerows(records)
    else:
        path.write_text(json.dumps(records, indent=1))
    return path


@pytest.fixture(autouse=True)
def _arrow_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """datasets converts a file into Arrow in its cache once: this module's own cache, never the user's."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path_factory.mktemp("arrow"))


@pytest.mark.parametrize("suffix", [".parquet", ".json", ".csv"])
def test_parquet_csv_and_json_array_files_give_the_batches_of_the_same_records_in_jsonl(
    tmp_path: Path, tokenizer_dir: Path, suffix: str
) -> None:
    records = TEXT_RECORDS if suffix == ".csv" else TOKEN_RECORDS  # a CSV cell holds text, not a list of ids
    jsonl = _source(_write(tmp_path / "d.jsonl", records), max_length=512, tokenizer=tokenizer_dir, shuffle=True)
    other = _source(_write_as(tmp_path / f"d{suffix}", records), max_length=512, tokenizer=tokenizer_dir,
                    shuffle=True)
    for step in range(4):  # two epochs, each shuffled alike
        for expected, got in zip(jsonl.batch(step).samples, other.batch(step).samples, strict=True):
            assert np.array_equal(expected.input_ids, got.input_ids) and np.array_equal(expected.labels, got.labels)


def test_a_json_file_of_json_lines_is_read_as_jsonl(tmp_path: Path) -> None:
    source = _source(_write(tmp_path / "d.json", TOKEN_RECORDS))
    assert isinstance(source, RecordSource) and isinstance(source.records, JsonlRecords)


def test_a_file_read_through_datasets_is_known_by_its_content_not_its_modification_time(tmp_path: Path) -> None:
    path = _write_as(tmp_path / "d.parquet", TOKEN_RECORDS)
    identity = _source(path).identity()
    assert identity.source == str(path.resolve())
    assert identity.fingerprint.startswith("5 rows, ") and "first and last 64 KiB sha256" in identity.fingerprint
    os.utime(path, (0, 0))
    assert _source(path).identity() == identity
    _write_as(path, [*TOKEN_RECORDS[:-1], {"input_ids": [9, 9, 9], "labels": [9, 9, 9]}])
    assert _source(path).identity() != identity


def test_a_dataset_folder_takes_a_split_after_a_colon(tmp_path: Path) -> None:
    DatasetDict({"train": Dataset.from_list(TOKEN_RECORDS[:3]), "test": Dataset.from_list(TOKEN_RECORDS[3:])}
                ).save_to_disk(tmp_path / "saved")
    (tmp_path / "files" / "data").mkdir(parents=True)  # data files laid out as a Hub data set's
    _write_as(tmp_path / "files" / "data" / "train-00000-of-00001.parquet", TOKEN_RECORDS[:3])
    _write_as(tmp_path / "files" / "data" / "test-00000-of-00001.parquet", TOKEN_RECORDS[3:])
    for folder in (tmp_path / "saved", tmp_path / "files"):
        test = _source(f"{folder}:test", shuffle=False)
        assert _first_tokens(test, range(1)) == [3, 4]
        assert test.identity().source == f"{folder.resolve()}:test"
    for folder in (tmp_path / "saved", tmp_path / "files"):  # train without a split
        train = _source(folder)
        assert _first_tokens(train, range(1)) == [0, 1]
        assert train.identity() == _source(f"{folder}:train").identity()
    DatasetDict({"test": Dataset.from_list(TOKEN_RECORDS[3:]), "validation": Dataset.from_list(TOKEN_RECORDS[:3])}
                ).save_to_disk(tmp_path / "held-out")
    with pytest.raises(ValueError, match=f"{tmp_path / 'held-out'} holds the splits test, validation; none is train, "
                                         f"so give one: {tmp_path / 'held-out'}:SPLIT"):
        _source(tmp_path / "held-out")
    with pytest.raises(ValueError, match=r"cannot be read as a data set: Unknown split \"validation\""):
        _source(f"{tmp_path / 'files'}:validation")


def test_length_stats_summarise_what_was_trained() -> None:
    source = make_source("synthetic:lmsys", global_batch_size=8, vocab_size=1024, max_length=4096, seed=0)
    stats = LengthStats()
    batches = [source.batch(step) for step in range(3)]
    for batch in batches:
        stats.add(batch)
    lengths = [n for b in batches for n in b.sequence_lengths]
    summary = stats.summary()
    assert summary.startswith(f"24 sequences, {sum(lengths)} tokens")
    assert f"min {min(lengths)}" in summary and f"max {max(lengths)}" in summary


def test_a_fraction_of_epochs_is_that_share_of_the_epochs_steps_rounded_up_as_hf_trainer_counts(
    tmp_path: Path,
) -> None:
    source = _source(_numbered(tmp_path / "d.jsonl", 10), global_batch=3)  # 4 steps an epoch: 3, 3, 3 and 1
    assert isinstance(source, RecordSource)
    assert (source.steps_for_epochs(0.5), source.steps_for_epochs(1), source.steps_for_epochs(2.5)) == (2, 4, 10)
    thirty = _source(_numbered(tmp_path / "e.jsonl", 30), global_batch=1)
    assert isinstance(thirty, RecordSource)
    assert thirty.steps_for_epochs(0.1) == 3  # 0.1 × 30 is 3.0000000000000004 in floats
