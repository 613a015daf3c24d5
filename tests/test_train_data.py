"""Training data: deterministic synthetic batches from the core's samplers, JSONL records with clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from scheduler_service.core.samplers import sample_lengths
from trainer_client.data import IGNORE_INDEX, JsonlSource, RecordTooLongError, Sample, make_source


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


def _write(path: Path, records: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_jsonl_reads_labels_and_loss_masks(tmp_path: Path) -> None:
    path = _write(tmp_path / "d.jsonl", [
        {"input_ids": [1, 2, 3]},
        {"input_ids": [4, 5, 6], "labels": [-100, 5, 6]},
        {"input_ids": [7, 8, 9], "loss_mask": [0, 0, 1]},
    ])
    source = JsonlSource(path=path, global_batch_size=2, max_length=16)
    assert [s.labels.tolist() for s in source.records] == [[1, 2, 3], [-100, 5, 6], [-100, -100, 9]]
    assert source.batch(1).sequence_lengths == (3, 3)  # records 2 and 0: the file wraps around


def test_rejects_record_longer_than_max_length_naming_it(tmp_path: Path) -> None:
    path = _write(tmp_path / "d.jsonl", [{"input_ids": [1, 2]}, {"input_ids": list(range(20))}])
    with pytest.raises(RecordTooLongError, match=r"d\.jsonl:2 has 20 tokens; the maximum is 8.*--truncate"):
        JsonlSource(path=path, global_batch_size=2, max_length=8)
    truncated = JsonlSource(path=path, global_batch_size=2, max_length=8, truncate=True)
    assert truncated.batch(0).sequence_lengths == (2, 8)


@pytest.mark.parametrize(("record", "message"), [
    ({"tokens": [1]}, "no 'input_ids'"),
    ({"input_ids": []}, "non-empty"),
    ({"input_ids": [1, 2], "labels": [1]}, "labels has 1 entries"),
    ({"input_ids": [1, 5000]}, r"token ids must lie in \[0, 1024\)"),
])
def test_rejects_malformed_records(tmp_path: Path, record: dict[str, object], message: str) -> None:
    path = _write(tmp_path / "d.jsonl", [record])
    with pytest.raises(ValueError, match=message):
        JsonlSource(path=path, global_batch_size=1, max_length=64, vocab_size=1024)


def test_rejects_unknown_data_spec() -> None:
    with pytest.raises(ValueError, match="unknown synthetic data set 'imdb'"):
        make_source("synthetic:imdb", global_batch_size=1, vocab_size=8, max_length=8, seed=0)
    with pytest.raises(ValueError, match="neither synthetic:NAME"):
        make_source("/no/such/file.jsonl", global_batch_size=1, vocab_size=8, max_length=8, seed=0)
