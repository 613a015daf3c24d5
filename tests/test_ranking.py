"""``benchmarks.ranking``: the ordering and regret maths on cases whose answer is known by hand, and the module on
the GPU recordings in ``benchmarks/measurements/`` (every recording re-planned exactly, finite figures)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import pytest

from benchmarks.ranking import (
    MICRO_BATCHES,
    PLANS,
    STEPS,
    Group,
    RankedSet,
    choice_regret,
    main,
    pair_outcomes,
    pairwise_ordering,
    rank_set,
    recorded_sets,
    regret_percentiles,
)

MEASUREMENTS = Path(__file__).resolve().parents[1] / "benchmarks" / "measurements"
GPU_CHECK = MEASUREMENTS / "h200-2026-11-26-gpu-check"


def _ordering(measured: list[float], predicted: list[float], **kwargs: Any) -> dict[str, Any]:
    return pairwise_ordering(pair_outcomes(measured, predicted), **kwargs)


def test_a_perfect_model_orders_every_pair_and_has_no_regret() -> None:
    measured = [0.1, 0.25, 0.3, 1.2, 0.7]
    outcomes = pair_outcomes(measured, [2 * t + 0.05 for t in measured])  # any increasing map of the times
    ordering = pairwise_ordering(outcomes)
    assert ordering["pairs"] == 10 and ordering["ordered"] == 1.0 and ordering["separated_ordered"] == 1.0
    assert ordering["wrong_pairs"] == ordering["priced_equal"] == 0
    assert regret_percentiles(outcomes.regret) == {"p50": 0.0, "p95": 0.0, "max": 0.0}
    assert regret_percentiles(outcomes.regret[outcomes.wrong]) == {"p50": None, "p95": None, "max": None}


def test_a_reversed_model_orders_no_pair_and_its_regret_is_the_measured_gap() -> None:
    outcomes = pair_outcomes([1.0, 2.0, 4.0], [3.0, 2.0, 1.0])
    ordering = pairwise_ordering(outcomes)
    assert ordering["ordered"] == 0.0 and ordering["wrong_pairs"] == 3
    # It picks the slower of each pair: 2/1 − 1, 4/1 − 1, 4/2 − 1.
    assert sorted(outcomes.regret.tolist()) == [1.0, 1.0, 3.0]
    # numpy's linear interpolation over [1, 1, 3]: p50 = 1, p95 at position 1.9 = 1 + 0.9·(3 − 1).
    assert regret_percentiles(outcomes.regret) == pytest.approx({"p50": 1.0, "p95": 2.8, "max": 3.0})
    assert regret_percentiles(outcomes.regret[outcomes.wrong]) == pytest.approx({"p50": 1.0, "p95": 2.8, "max": 3.0})


def test_a_pair_priced_equal_is_a_coin_flip_and_a_pair_measured_equal_is_always_right() -> None:
    outcomes = pair_outcomes([1.0, 1.5], [0.11, 0.11])  # both at the floor, measured 50 % apart
    assert outcomes.credit.tolist() == [0.5] and outcomes.regret.tolist() == [0.25]  # the mean of 0 and 50 %
    ordering = pairwise_ordering(outcomes)
    assert ordering["priced_equal"] == 1 and ordering["wrong_pairs"] == 0 and ordering["ordered"] == 0.5
    assert ordering["decided_pairs"] == 0 and ordering["decided_ordered"] is None
    tied = pair_outcomes([1.0, 1.0], [1.0, 2.0])
    assert tied.credit.tolist() == [1.0] and tied.regret.tolist() == [0.0] and not tied.priced_equal.any()


def test_pairs_measured_closer_than_the_gap_are_counted_apart() -> None:
    # The first two are 2 % apart and the model swaps them; the other pairs are far apart and ordered.
    outcomes = pair_outcomes([1.0, 1.02, 2.0], [1.1, 1.0, 3.0])
    ordering = pairwise_ordering(outcomes, min_gap=0.05)
    assert ordering["ordered"] == pytest.approx(2 / 3) and ordering["wrong_pairs"] == 1
    assert ordering["separated_pairs"] == 2 and ordering["separated_ordered"] == 1.0
    assert regret_percentiles(outcomes.regret[outcomes.wrong])["max"] == pytest.approx(0.02)
    assert pairwise_ordering(outcomes, min_gap=0.01)["separated_ordered"] == pytest.approx(2 / 3)


def test_pairs_are_formed_within_groups_only() -> None:
    outcomes = pair_outcomes([1.0, 2.0, 10.0, 20.0], [2.0, 1.0, 10.0, 20.0], groups=["a", "a", "b", "b"],
                             labels=["small", "small", "large", "large"])
    assert len(outcomes) == 2 and outcomes.credit.tolist() == [0.0, 1.0]
    assert outcomes.classes == ("small / small", "large / large")


def test_choosing_among_a_group_by_the_model() -> None:
    assert choice_regret([3.0, 1.0, 2.0], [1.0, 2.0, 3.0]) == pytest.approx(2.0)  # picks the 3.0: 3/1 − 1
    assert choice_regret([3.0, 1.0, 2.0], [3.0, 1.0, 2.0]) == 0.0
    assert choice_regret([3.0, 1.0, 2.0], [1.0, 1.0, 3.0]) == pytest.approx(1.0)  # a coin flip: (3 + 1)/2 / 1 − 1
    with pytest.raises(ValueError):
        pair_outcomes([1.0, 0.0], [1.0, 1.0])


def test_rank_set_summarises_every_group_and_each_batchs_choice() -> None:
    plans = RankedSet(fit="f", ranked=PLANS, groups=[
        Group(label="b0", measured_s=(5.0, 7.0), predicted_s=(5.1, 6.4)),
        Group(label="b1", measured_s=(4.0, 3.0), predicted_s=(3.5, 3.6))])  # the model picks the slower plan
    summary = rank_set(plans)
    assert summary["pairs"] == 2 and summary["ordered"] == 0.5 and summary["wrong_pairs"] == 1
    assert summary["choice_regret"]["max"] == pytest.approx(4 / 3 - 1)
    assert summary["wrong_regret"]["p50"] == pytest.approx(4 / 3 - 1)
    assert "choice_regret" not in rank_set(RankedSet(fit="f", ranked=MICRO_BATCHES, groups=plans.groups))


def test_the_paper_fit_is_priced_as_the_accuracy_benchmark_prices_it() -> None:
    pytest.importorskip("torch")
    from benchmarks.accuracy import _paper_profile
    from benchmarks.ranking import paper_profile
    from scheduler_service.core.profile import builtin_profiles

    shipped = builtin_profiles()["h200-qwen2.5-0.5b"]
    assert paper_profile(shipped) == _paper_profile(shipped.raw, shipped)


def _finite(summary: dict[str, Any]) -> bool:
    figures = [summary["ordered"], summary["separated_ordered"], *summary["regret"].values()]
    return all(isinstance(figure, float) and math.isfinite(figure) for figure in figures)


def test_the_recorded_figures_of_the_gpu_check_run(tmp_path: Path) -> None:
    """What make gpu-check computes on the GPU machine (standard library and numpy), on its recorded run."""
    with tarfile.open(GPU_CHECK / "logs.tar.gz") as archive:
        archive.extractall(tmp_path, filter="data")
    runs = {name: [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
            for name in ("train-skrull-dp1-cp1", "train-deepspeed-dp1-cp1")}
    summaries = {(s["fit"], s["ranked"]): s for s in map(rank_set, recorded_sets(
        json.loads((GPU_CHECK / "accuracy.json").read_text()), runs))}
    own = "the run's profile"
    assert set(summaries) == {(own, MICRO_BATCHES), (own, STEPS), (own, PLANS),
                              ("paper α·FLOPs + β (the run's fit)", MICRO_BATCHES),
                              ("paper α·FLOPs + β (the run's fit)", PLANS)}
    assert summaries[own, MICRO_BATCHES]["pairs"] == 122 * 121 // 2
    assert summaries[own, STEPS]["pairs"] == 15  # steps 2-4 of both schedulers: the first is warm-up
    assert summaries[own, PLANS]["pairs"] == 3 + 3  # the accuracy run's three batches, the trainer's three steps
    assert all(_finite(summary) for summary in summaries.values())


def test_a_run_recorded_with_0_based_steps_ranks_as_the_same_run_numbered_from_1(tmp_path: Path) -> None:
    """The trainer numbers a metrics line's step from 1 now; the recordings kept as they came back count from 0."""
    with tarfile.open(GPU_CHECK / "logs.tar.gz") as archive:
        archive.extractall(tmp_path, filter="data")
    recorded = {name: [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
                for name in ("train-skrull-dp1-cp1", "train-deepspeed-dp1-cp1")}
    assert all(records[0]["step"] == 0 for records in recorded.values())
    renumbered = {name: [{**record, "step": record["step"] + 1} for record in records]
                  for name, records in recorded.items()}
    assert ([rank_set(ranked) for ranked in recorded_sets(None, recorded)]
            == [rank_set(ranked) for ranked in recorded_sets(None, renumbered)])


def test_the_module_re_plans_every_recording_and_gives_finite_figures(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "ranking.json"
    assert main(["--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| h200-qwen2.5-0.5b (launch-bound, as shipped) | micro-batches | 14762 |" in printed
    report = json.loads(out.read_text())
    used = {note["recording"] for note in report["recordings"] if note["used"]}
    assert used == {"h200-2026-11-26/train-skrull", "h200-2026-11-26/train-deepspeed",
                    "h200-2026-11-26-floor/accuracy-odd.json", "h200-2026-11-26-gpu-check/accuracy.json",
                    "h200-2026-11-26-gpu-check/train-skrull-dp1-cp1",
                    "h200-2026-11-26-gpu-check/train-deepspeed-dp1-cp1"}
    (left_out,) = [note for note in report["recordings"] if not note["used"]]
    assert "compiled" in left_out["recording"]
    summaries = {(s["fit"], s["ranked"]): s for s in report["summaries"]}
    shipped = "h200-qwen2.5-0.5b (launch-bound, as shipped)"
    assert summaries[shipped, MICRO_BATCHES]["pairs"] == 2 * (122 * 121 // 2)  # within each recording, never across
    assert summaries[shipped, STEPS]["pairs"] == 10 * 9 // 2 + 6 * 5 // 2
    assert summaries[shipped, PLANS]["pairs"] == 3 + 3 + 5 + 3
    assert {fit for fit, _ in summaries} == {shipped, "paper α·FLOPs + β (its fit.paper_eq14)",
                                             "additive, no floor (its fit.extended)",
                                             "another run's measurement (repeatability)"}
    assert all(_finite(summary) for summary in summaries.values())
    # Below 2k tokens every micro-batch is at the shipped profile's floor: priced equal, a coin flip.
    floor = summaries[shipped, MICRO_BATCHES]["by_class"]["< 2048 / < 2048"]
    assert floor["priced_equal"] == floor["pairs"] and floor["ordered"] == 0.5


def test_what_make_gpu_check_runs_imports_only_the_standard_library_and_numpy() -> None:
    """The GPU machine's own Python has numpy but maybe not the service's packages: the maths and the recorded
    figures load neither the planning core nor torch (re-pricing imports the core when it is called)."""
    code = ("import sys, json; from benchmarks.ranking import rank_set, recorded_sets; "
            f"document = json.load(open({str(GPU_CHECK / 'accuracy.json')!r})); "
            "[rank_set(s) for s in recorded_sets(document, {})]; "
            "loaded = sorted(m for m in sys.modules if m.split('.')[0] in "
            "('scheduler_service', 'torch', 'pydantic', 'numba', 'trainer_client')); print(loaded)")
    result = subprocess.run([sys.executable, "-c", code], cwd=GPU_CHECK.parents[2], capture_output=True, text=True,
                            timeout=120, check=True)
    assert result.stdout.strip() == "[]", result.stdout
