"""``make gpu-check`` (``benchmarks/gpu_check.py``): without CUDA it says so and exits 2, a missing dependency is named
with how to bring it, and its steps, rehearsed on the CPU, all run and fill the summary."""

from __future__ import annotations

import json
import os
import subprocess
import sys
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
        "gpu-tests", "profile", "accuracy", "train-skrull-dp1-cp1", "train-skrull-dp1-cp1-auto",
        "train-deepspeed-dp1-cp1"]
    assert all(step["ok"] for step in summary["steps"])
    assert summary["gpu_tests"]["skipped"] == 2  # no CUDA: the GPU tests skip, and say so
    assert summary["profile"]["fit"]["extended"]["median_relative_error"] >= 0
    (accuracy,) = summary["accuracy"]
    assert accuracy["cp_size"] == 1 and accuracy["micro_batches"] > 0 and accuracy["by_size"]
    assert [run["steps"] for run in summary["training"]] == [2, 2, 2]
    (agreement,) = summary["loss_agreement"]
    assert agreement["layout"] == "dp1-cp1" and agreement["max_relative_difference"] < 1e-5
    assert "losses skrull vs deepspeed at dp1-cp1" in result.stdout
    auto = summary["auto"]  # --profile auto measured its profile into the check's cache, then trained with it
    assert auto["auto_profile_s"] is not None and Path(auto["auto_profile"]).is_file()
    assert auto["fit"]["median_relative_error"] >= 0 and auto["sweep_fit"]["median_relative_error"] >= 0
    assert summary["compiled"] == {}  # --compile runs on a GPU; tests/test_compile.py compiles on the CPU
    assert "--profile auto measured in" in result.stdout
