"""The CLI twin of POST /plan: JSON in, JSON or a table or a chart out, errors on stderr."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from skrull_proto import PlanResponse

from scheduler_service.cli import main
from scheduler_service.contract.wire import response_to_plan
from scheduler_service.core.check import find_violations

REQUEST = {
    "sequence_lengths": [812, 30311, 97, 4000, 150, 22000, 64, 900, 12000, 300],
    "dp_size": 2,
    "cp_size": 4,
    "model": "qwen2.5-0.5b",
    "bucket_size": 26000,
}
HEURISTICS = ["skrull", "skrull_binary", "skrull_paper", "deepspeed", "sorted", "round_robin", "balanced"]


def run_cli(args: list[str], stdin: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "scheduler_service", *args], input=stdin, capture_output=True,
                          text=True, timeout=120)


def test_plan_reads_stdin_and_prints_the_response_contract() -> None:
    completed = run_cli(["plan"], json.dumps(REQUEST))
    assert completed.returncode == 0, completed.stderr
    response = PlanResponse.model_validate_json(completed.stdout)
    assert response.scheduler == "skrull" and response.bucket_size == 26000
    assert len(response.dp_ranks) == 2
    scheduled = sorted(i for dp in response.dp_ranks for mb in dp.micro_batches
                       for i in [*mb.distributed, *(j for local in mb.local for j in local)])
    assert scheduled == list(range(10))
    assert response.speedup_vs_deepspeed > 1


@pytest.mark.parametrize("scheduler", HEURISTICS)
def test_every_scheduler_answers_the_design_request_shape(scheduler: str, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    request_file = tmp_path / "request.json"
    request_file.write_text(json.dumps({**REQUEST, "scheduler": scheduler}))
    assert main(["plan", str(request_file)]) == 0
    response = PlanResponse.model_validate_json(capsys.readouterr().out)
    assert response.scheduler == scheduler and response.bucket_size == REQUEST["bucket_size"]
    # a valid plan of this request: 2 DP ranks, micro-batches of 4 local lists, no empty micro-batch, every
    # sequence exactly once, no CP rank over the bucket
    assert find_violations(response_to_plan(response), sequence_lengths=REQUEST["sequence_lengths"], dp_size=2,
                           cp_size=4, bucket_size=26000) == []


def test_table_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    request_file = tmp_path / "request.json"
    request_file.write_text(json.dumps(REQUEST))
    chart = tmp_path / "gantt.png"
    assert main(["plan", str(request_file), "--table", "--plot", str(chart)]) == 0
    table = capsys.readouterr().out
    assert "scheduler skrull" in table and "speedup" in table and "tokens per CP rank" in table
    assert "% of the lower bound" in table
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"sequence_lengths": []}, "sequence_lengths"),
        ({"sequence_lengths": [10, -3]}, "sequence_lengths[1]"),
        ({"sequence_lengths": [10, 300000]}, "sequence 1 has 300000 tokens; at most bucket_size 26000 × cp_size 4"),
        ({"dp_size": 0}, "dp_size"),
        ({"cp_size": -2}, "cp_size"),
        ({"model": "gpt-17"}, "unknown model 'gpt-17'"),
        ({"scheduler": "magic"}, "scheduler"),
        ({"sequence_lengths": ["ten"]}, "sequence_lengths[0]"),
    ],
)
def test_bad_input_goes_to_stderr_with_a_non_zero_exit(change: dict[str, object], message: str, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    request_file = tmp_path / "request.json"
    request_file.write_text(json.dumps({**REQUEST, **change}))
    assert main(["plan", str(request_file)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert message in captured.err


def test_malformed_json_and_missing_file_are_clear_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    assert main(["plan", str(broken)]) == 2
    assert "invalid request" in capsys.readouterr().err
    assert main(["plan", str(tmp_path / "absent.json")]) == 2
    assert "cannot read request" in capsys.readouterr().err


def test_search_budget_flag_trades_time_for_plan_quality(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    request_file = tmp_path / "request.json"
    request_file.write_text(json.dumps(REQUEST))
    times_ms = []
    for budget in ("0", "512"):
        assert main(["plan", str(request_file), "--search-budget", budget]) == 0
        times_ms.append(json.loads(capsys.readouterr().out)["estimated_iteration_time_ms"])
    assert times_ms[1] <= times_ms[0]
    assert main(["plan", str(request_file), "--search-budget", "-1"]) == 2
    assert "search_budget" in capsys.readouterr().err
