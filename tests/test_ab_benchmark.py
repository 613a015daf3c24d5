"""``benchmarks.ab``'s latency spread: two planner processes take turns on the same batches, and its table reports
each side's percentiles, the batches that span and whose estimates changed."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from benchmarks import ab
from benchmarks.ab_side import SPREAD_DATASETS
from scheduler_service.core.profile import builtin_profiles


def test_two_sides_of_the_same_tree_plan_every_batch_to_the_same_estimate(tmp_path: Path) -> None:
    profile_file = tmp_path / "profile.json"
    profile_file.write_text(json.dumps(builtin_profiles()["h100-paper"].raw))
    spread = ab.measure_spread((ab.REPOSITORY, ab.REPOSITORY), num_batches=2, rounds=1, profile_file=profile_file)
    assert spread.fastest_s.shape == (2, 2 * len(SPREAD_DATASETS))
    assert np.isfinite(spread.fastest_s).all() and (spread.fastest_s > 0).all()
    assert (spread.estimate_s[0] == spread.estimate_s[1]).all() and (spread.estimate_s > 0).all()
    assert (spread.spanning[0] == spread.spanning[1]).all()


def test_the_spread_table_reports_percentiles_spanning_batches_and_changed_estimates(
        capsys: pytest.CaptureFixture[str]) -> None:
    num_batches = 100
    count = num_batches * len(SPREAD_DATASETS)
    fastest_s = np.full((2, count), 0.004)
    fastest_s[:, :2] = [[0.012, 0.012], [0.008, 0.008]]  # two LMSys-like batches: 3x the median before, 2x after
    spanning = np.zeros((2, count), bool)
    spanning[:, :2] = True
    estimate_s = np.ones((2, count))
    estimate_s[1, num_batches] = 0.9  # one ChatQA2-like batch planned faster after
    ab.spread_table(ab.Spread(fastest_s, spanning, estimate_s), num_batches, 3, "HEAD~1")
    rows = {line.split("|")[1].strip(): [cell.strip() for cell in line.strip("|").split("|")[1:]]
            for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "---" not in line}
    assert rows["lmsys"] == ["4.00", "4.00", "12.00", "8.00", "3.00", "2.00", "2", "12.00", "8.00", "0"]
    assert rows["chatqa2"][-1] == "1" and rows["chatqa2"][6:9] == ["0", "–", "–"]
