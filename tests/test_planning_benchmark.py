"""``make bench``'s collective-schemes table (``benchmarks/planning.py``) on one batch of the 7B long-heavy case: it
prints the case's row, names each refusal with its reason rather than drop it from a mean, and reports Megatron
before and after the choice and, on the batches it still beats, its two effects apart (what it measures is for the
docs, not asserted, beyond what the planner guarantees: the choice never makes a plan slower)."""

from __future__ import annotations

import pytest

from benchmarks import planning

CASE = planning.Case("chatqa2", "qwen2.5-7b", 13_000, 4, 8, 64)  # in LONG_HEAVY: the Megatron table reports it


def test_the_schemes_table_prints_the_case_its_refusals_megatron_before_and_after_and_why(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert CASE in planning.LONG_HEAVY
    planning.schemes_table([CASE], num_batches=1, seed=0, profile="h100-eager")
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("## Collective schemes under h100-eager") for line in lines)
    rows = [line for line in lines if line.startswith(f"| {CASE.label} |")]
    assert len(rows) == 3  # the schemes table's, the Megatron before / after table's, then why Megatron wins
    cells = [cell.strip() for cell in rows[0].strip("|").split("|")]
    assert cells[1] == "2, 4"  # 28 query and 4 K/V heads: Ulysses degrees 2 and 4 divide cp 8
    assert float(cells[2].removesuffix("x")) >= 1.0  # without the choice / with it: never slower with it
    assert cells[11] == "1/1"  # static Ulysses over cp 8 refused, counted ...
    assert any(line.startswith("- ulysses refused 1: model qwen2.5-7b's 28 query and 4 K/V heads do not split "
                               "evenly over Ulysses degree 8") for line in lines)  # ... and named
    assert cells[15] == "0/1"  # USP at u = 4 plans it
    megatron = [cell.strip() for cell in rows[1].strip("|").split("|")]
    assert len(megatron) == 7
    why = [cell.strip() for cell in rows[2].strip("|").split("|")]
    assert len(why) == 8
    assert why[1] == megatron[4].partition(" + ")[0]  # the batches taken apart are the ones Megatron beats after


def test_the_cli_runs_only_the_tables_asked_for(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        planning.main(["--tables", "no-such-table"])
    assert "invalid choice" in capsys.readouterr().err


def test_the_latency_table_has_its_planners_take_turns_batch_by_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    # a slow spell of a shared machine then slows every column alike, and the ratio of two columns stays true
    calls: list[tuple[str, str, bool]] = []
    monkeypatch.setattr(planning, "make_plan", lambda problem, scheduler, *, schemes: calls.append(
        (problem, scheduler, schemes)))
    variants = [("skrull", True), ("skrull", False)]
    latencies = planning._latencies(["first", "second"], variants, rounds=2)  # type: ignore[list-item]
    assert calls == [(batch, *variant) for _ in range(2) for batch in ("first", "second") for variant in variants]
    assert len(latencies) == 2
