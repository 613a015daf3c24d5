"""``make bench-trl`` (``benchmarks/against_trl.py``): its table from the runs' records, its chats, and a short run of
every row on two gloo processes, whose Skrull rows train TRL padding's chats, tokens and losses step for step
(what it measures is for the docs, not asserted)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks import against_trl
from benchmarks.against_trl import Run, format_table, losses_verdict, make_chats, runs_for, summarize


def _result(*, steps_s: list[float], tokens: list[int], losses: list[float]) -> dict[str, Any]:
    return {"steps_s": steps_s, "steps_cpu_s": [step / 2 for step in steps_s], "tokens": tokens, "losses": losses,
            "peak_bytes": None}


def test_runs_are_trls_four_ways_to_batch_and_skrull_at_every_split_of_the_processes() -> None:
    assert [run.name for run in runs_for(2)] == ["TRL padding", "TRL padding_free", "TRL packing (bfd)",
                                                 "TRL batch_rebalance", "Skrull DP 2 × CP 1", "Skrull DP 1 × CP 2"]
    assert [run.key for run in runs_for(4) if run.skrull_cp] == ["skrull-dp4-cp1", "skrull-dp2-cp2", "skrull-dp1-cp4"]
    assert [run.key for run in runs_for(1) if not run.same_chats] == ["bfd", "batch_rebalance"]


def test_the_table_gives_tokens_per_second_per_process_and_losses_against_the_same_rounds_trl_padding() -> None:
    runs = [Run(name="TRL padding", key="padding"), Run(name="TRL packing (bfd)", key="bfd", same_chats=False),
            Run(name="Skrull DP 2 × CP 1", key="skrull-dp2-cp1", skrull_cp=1)]
    # two rounds of three steps, the first left out; round 2's padding ran slower and its losses moved
    results = {"padding": [_result(steps_s=[9.0, 1.0, 1.0], tokens=[1, 100, 100], losses=[2.0, 2.0, 1.0]),
                           _result(steps_s=[9.0, 2.0, 2.0], tokens=[1, 100, 100], losses=[4.0, 4.0, 2.0])],
               "bfd": [_result(steps_s=[9.0, 0.5, 0.5], tokens=[1, 100, 100], losses=[2.0, 2.2, 1.0]),
                       _result(steps_s=[9.0, 0.5, 0.5], tokens=[1, 100, 100], losses=[4.0, 4.4, 2.0])],
               "skrull-dp2-cp1": [_result(steps_s=[9.0, 0.5, 0.5], tokens=[1, 100, 100], losses=[2.0, 2.0, 1.0]),
                                  _result(steps_s=[9.0, 0.4, 0.4], tokens=[1, 100, 100], losses=[4.0, 4.0, 2.00002])]}
    padding, bfd, skrull = summarize(runs, results, {"bfd": 2**20}, warmup=1, num_processes=2)
    assert padding.tokens_per_s_per_process == pytest.approx((50 + 25) / 2)  # the median over the rounds
    assert (padding.step_s_median, padding.speedup, padding.max_relative_loss_difference) == (1.5, 1.0, None)
    assert skrull.tokens_per_s_per_process == pytest.approx((100 + 125) / 2)
    assert skrull.speedup == pytest.approx(112.5 / 37.5) and skrull.cpu_speedup == pytest.approx(112.5 / 37.5)
    assert skrull.max_relative_loss_difference == pytest.approx(1e-5)  # against its own round's padding
    assert bfd.max_relative_loss_difference == pytest.approx(0.1) and bfd.peak_bytes == 2**20
    table = format_table([padding, bfd, skrull], memory="peak memory")
    assert table.splitlines()[2].startswith("| TRL padding | 38 | 1.00x | 1,500 ms (1,000–2,000) | 1.00x | n/a |")
    assert "| 1 MiB | 1.0e-01 (other chats per step) |" in table
    assert table.splitlines()[-1].endswith("| 1.0e-05 |")
    assert losses_verdict([padding, bfd, skrull], tolerance=2e-5) == (
        True, "every Skrull run's losses within 2e-05 of TRL padding's, at every step")
    assert losses_verdict([padding, bfd, skrull], tolerance=1e-6) == (
        False, "losses further than 1e-06 from TRL padding's: Skrull DP 2 × CP 1 1.0e-05")


def test_the_chats_have_the_demos_long_tail_and_none_is_longer_than_max_length() -> None:
    from trl.chat_template_utils import qwen2_5_chat_template

    from trainer_client.chat_tokenizer import builtin_corpus, train_chat_tokenizer

    tokenizer = train_chat_tokenizer(builtin_corpus())
    tokenizer.chat_template = qwen2_5_chat_template
    chats, lengths = make_chats(tokenizer, num_chats=64, max_length=512, seed=0)
    assert [len(tokenizer.apply_chat_template(chat["messages"], tokenize=True, return_dict=True)["input_ids"])
            for chat in chats] == lengths
    assert max(lengths) <= 512 and min(lengths) < 512 / 4  # LMSys-like: from a short chat to the cut
    assert [message["role"] for message in chats[0]["messages"]] == ["system", "user", "assistant"]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning")
def test_every_row_runs_and_skrulls_rows_train_trl_paddings_chats_and_losses(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    out = tmp_path / "bench.json"
    assert against_trl.main(["--steps", "2", "--warmup", "1", "--rounds", "1", "--memory-steps", "1", "--max-length",
                             "256", "--global-batch", "8", "--per-device-batch", "2", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "every Skrull run's losses within 1e-05 of TRL padding's, at every step" in printed
    document = json.loads(out.read_text())
    assert [row["name"] for row in document["rows"]] == [run.name for run in runs_for(2)]
    runs = {key: rounds[0] for key, rounds in document["runs"].items()}
    for key in ("padding_free", "skrull-dp2-cp1", "skrull-dp1-cp2"):  # the same chats in every step
        assert runs[key]["tokens"] == runs["padding"]["tokens"]
        assert runs[key]["losses"] == pytest.approx(runs["padding"]["losses"], rel=1e-5)
    assert all(document["memory_bytes"][key] > 0 for key in runs)  # the CPU pass: every run's resident peak
    assert all(f"| {row['name']} |" in printed for row in document["rows"])
