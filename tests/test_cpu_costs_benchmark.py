"""``make bench-cpu-costs`` runs and prints both of its tables (what it measures is for the docs, not asserted)."""

from __future__ import annotations

import pytest

from benchmarks import cpu_costs


def test_the_benchmark_prints_the_attention_and_collective_tables(capsys: pytest.CaptureFixture[str]) -> None:
    assert cpu_costs.main(["--repeats", "1", "--collective-runs", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    attention = [line for line in lines if line.endswith("x) |")]  # the ratios to whole ÷ 2
    assert [line.split(" | ")[0] for line in attention] == ["| 256", "| 512", "| 1,024", "| 2,048", "| 4,096"]
    assert any(line.startswith("| all-gather |") for line in lines)
    assert any(line.startswith("| reduce-scatter |") for line in lines)
