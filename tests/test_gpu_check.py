"""``make gpu-check`` (``benchmarks/gpu_check.py``): without CUDA it says so and exits 2, a missing dependency is named
with how to bring it, and its steps, rehearsed on the CPU, all run and fill the summary."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'proto'}"}


def _gpu_check(*args: str, prelude: str = "") -> subprocess.CompletedProcess[str]:
    code = f"{prelude}\nimport sys\nfrom benchmarks.gpu_check import main\nsys.exit(main({list(args)!r}))"
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=600, check=False)


def test_without_cuda_it_says_so_and_exits_2(tmp_path: Path) -> None:
    result = _gpu_check("--out-dir", str(tmp_path))
    assert result.returncode == 2
    assert "no CUDA device here" in result.stderr and "--rehearse" in result.stderr


def test_make_gpu_check_exits_2_without_cuda(tmp_path: Path) -> None:
    result = subprocess.run(["make", "--no-print-directory", "gpu-check", f"GPU_PYTHON={sys.executable}",
                             f"GPU_CHECK_ARGS=--out-dir {tmp_path}"], cwd=ROOT, capture_output=True, text=True,
                            timeout=600, check=False)
    assert result.returncode == 2 and "no CUDA device here" in result.stderr


def test_a_missing_dependency_is_named_with_how_to_bring_it(tmp_path: Path) -> None:
    # The machine's Python without tenacity, as the H200's was.
    hide = "import importlib.util as u; _find = u.find_spec; u.find_spec = lambda n, *a: None if n == 'tenacity' " \
           "else _find(n, *a)"
    result = _gpu_check("--out-dir", str(tmp_path), prelude=hide)
    assert result.returncode == 2
    assert "the trainer needs tenacity" in result.stderr and "--wheels" in result.stderr


@pytest.mark.slow
def test_the_rehearsal_runs_every_step_and_fills_the_summary(tmp_path: Path) -> None:
    result = _gpu_check("--rehearse", "--steps", "2", "--out-dir", str(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [step["name"] for step in summary["steps"]] == [
        "gpu-tests", "profile", "accuracy", "train-skrull-dp1-cp1", "train-skrull-dp1-cp1-buckets",
        "train-skrull-dp1-cp1-auto", "train-deepspeed-dp1-cp1", "trl-bench"]
    assert all(step["ok"] for step in summary["steps"])
    assert summary["gpu_tests"]["skipped"] == 2  # no CUDA: the GPU tests skip, and say so
    assert summary["profile"]["fit"]["extended"]["median_relative_error"] >= 0
    (accuracy,) = summary["accuracy"]
    assert accuracy["cp_size"] == 1 and accuracy["micro_batches"] > 0 and accuracy["by_size"]
    assert [run["steps"] for run in summary["training"]] == [2, 2, 2, 2]
    (agreement,) = summary["loss_agreement"]
    assert agreement["layout"] == "dp1-cp1" and agreement["max_relative_difference"] < 1e-5
    assert "losses skrull vs deepspeed at dp1-cp1" in result.stdout
    auto = summary["auto"]  # --profile auto measured its profile into the check's cache, then trained with it
    assert auto["auto_profile_s"] is not None and Path(auto["auto_profile"]).is_file()
    assert auto["fit"]["median_relative_error"] >= 0 and auto["sweep_fit"]["median_relative_error"] >= 0
    # the faster paths beside eager: on the CPU the token buckets' padding alone (--compile and --cuda-graphs run on
    # a GPU; tests/test_trainer_paths.py compiles on the CPU)
    eager, buckets = summary["paths"]
    assert (eager["path"], buckets["path"]) == ("eager", "buckets") and buckets["flags"] == ["--token-buckets", "4"]
    assert buckets["floor_ms_per_layer"] is None  # no profile measures the padded rows' floor
    assert buckets["tokens_per_s"] > 0 and buckets["max_relative_loss_difference"] < 1e-5
    assert "path buckets --token-buckets 4: " in result.stdout
    assert "--profile auto measured in" in result.stdout
    # benchmarks.ranking over the accuracy run and the runs planned with step 2's profile (not --profile auto's)
    ranking = {(entry["fit"], entry["ranked"]): entry for entry in summary["ranking"]}
    own, paper = "the run's profile", "paper α·FLOPs + β (the run's fit)"
    assert {(own, "micro-batches"), (paper, "micro-batches"), (own, "steps"), (own, "plans of one batch"),
            (paper, "plans of one batch")} <= set(ranking)
    micro = ranking[own, "micro-batches"]
    assert micro["pairs"] == accuracy["micro_batches"] * (accuracy["micro_batches"] - 1) // 2
    assert 0 <= micro["ordered"] <= 1 and micro["regret"]["p95"] >= 0
    assert ranking[own, "steps"]["pairs"] == 1  # step 1 of skrull against step 1 of deepspeed (step 0: warm-up)
    assert f"ranking micro-batches by {own}: {micro['pairs']} pairs ordered" in result.stdout
    # TRL's four ways to batch and Skrull at both splits of the rehearsal's 2 processes, on one SFT script
    trl = summary["trl"]
    assert [row["name"] for row in trl["rows"]] == ["TRL padding", "TRL padding_free", "TRL packing (bfd)",
                                                    "TRL batch_rebalance", "Skrull DP 2 × CP 1", "Skrull DP 1 × CP 2"]
    assert trl["losses_agree"] and "against TRL (one SFT script" in result.stdout


def test_the_ranking_figures_of_a_recorded_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The summary's ranking on the H200's recorded check (its accuracy run, its trainer runs), and its lines."""
    from benchmarks.gpu_check import Check, _print_summary, _ranking_summary

    recorded = ROOT / "benchmarks" / "measurements" / "h200-2026-11-26-gpu-check"
    with tarfile.open(recorded / "logs.tar.gz") as archive:
        archive.extractall(tmp_path, filter="data")
    ranking = _ranking_summary(recorded / "accuracy.json", [tmp_path / "train-skrull-dp1-cp1.jsonl",
                                                            tmp_path / "train-deepspeed-dp1-cp1.jsonl"])
    by_kind = {(entry["fit"], entry["ranked"]): entry for entry in ranking}
    assert by_kind["the run's profile", "micro-batches"]["pairs"] == 122 * 121 // 2
    assert by_kind["the run's profile", "steps"]["pairs"] == 15
    assert by_kind["the run's profile", "plans of one batch"]["ordered"] == 1.0  # skrull's plans measured faster
    _print_summary(Check(machine={"torch": "2.11", "transformers": "5.17", "flash_attn": None}, ranking=ranking))
    printed = capsys.readouterr().out
    assert "ranking micro-batches by the run's profile: 7381 pairs ordered" in printed
    assert "ranking steps by the run's profile: 15 pairs ordered" in printed
