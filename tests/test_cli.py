"""The CLI twin of POST /plan: JSON in, JSON or a table or a chart out, errors on stderr."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from skrull_proto import PlanResponse

from scheduler_service.cli import format_table, gantt_figure, main
from scheduler_service.contract.wire import response_to_plan
from scheduler_service.core.check import check_plan, find_violations
from scheduler_service.core.plan import DPRankPlan, MicroBatch, Plan, SchedulerName, SpanningMicroBatch, make_problem
from scheduler_service.core.planner import PlanResult, make_plan
from scheduler_service.core.simulate import iteration_lower_bound_s, simulate

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


# ---- spanning micro-batches -----------------------------------------------------------------------------------

# sequence 2 (120000 tokens) is longer than one CP group holds (bucket_size 20000 × cp_size 4): every plan runs it in a
# micro-batch over both DP replicas
SPANNING_REQUEST = {"sequence_lengths": [100, 200, 120000, 3000, 700, 30000, 5000], "dp_size": 2, "cp_size": 4,
                    "model": "qwen2.5-0.5b", "bucket_size": 20000}

# By hand, so a block waits: DP 0-1 run sequence 0 (30000 tokens, more than cp_size 2 × bucket_size 10000) together,
# then all four replicas run sequence 1 (50000 tokens) together; replicas 2 and 3 are free from the start, so they
# wait for 0 and 1 before it. Then each replica's own micro-batch of one short sequence.
WAIT_LENGTHS = [30000, 50000, 1000, 2000, 3000, 4000]
WAIT_PLAN = Plan(
    dp_ranks=tuple(DPRankPlan(micro_batches=(MicroBatch(local=((index,), ()), distributed=()),))
                   for index in range(2, 6)),
    spanning=(SpanningMicroBatch(first_dp_rank=0, num_dp_ranks=2, micro_batch=MicroBatch(local=((),) * 4,
                                                                                         distributed=(0,))),
              SpanningMicroBatch(first_dp_rank=0, num_dp_ranks=4, micro_batch=MicroBatch(local=((),) * 8,
                                                                                         distributed=(1,)))),
)


def waiting_result() -> PlanResult:
    problem = make_problem(sequence_lengths=WAIT_LENGTHS, dp_size=4, cp_size=2, model="qwen2.5-0.5b",
                           bucket_size=10000)
    check_plan(WAIT_PLAN, sequence_lengths=WAIT_LENGTHS, dp_size=4, cp_size=2, bucket_size=10000)
    estimate = simulate(problem, WAIT_PLAN)
    return PlanResult(scheduler=SchedulerName.SKRULL, problem=problem, plan=WAIT_PLAN, estimate=estimate,
                      baseline_time_s=2 * estimate.iteration_time_s, solve_time_s=1e-3,
                      lower_bound_s=iteration_lower_bound_s(problem))


def rows_of(table: str, dp_rank: int, mb: str) -> list[str]:
    """The table's rows of DP rank ``dp_rank`` whose ``mb`` column is ``mb`` ("0", "s0", "sum")."""
    return [row for row in table.splitlines()[2:] if row.split()[:2] == [str(dp_rank), mb]]


def test_table_lists_a_spanning_micro_batch_on_each_replica_it_spans(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    request_file = tmp_path / "request.json"
    request_file.write_text(json.dumps({**SPANNING_REQUEST, "breakdown": True}))
    assert main(["plan", str(request_file)]) == 0
    response = json.loads(capsys.readouterr().out)
    [span] = response["spanning"]
    assert span["dp_ranks"] == [0, 1]
    assert main(["plan", str(request_file), "--table"]) == 0
    table = capsys.readouterr().out
    sequences = [*span["distributed"], *(i for local in span["local"] for i in local),
                 *(i for group in span.get("sharded", []) for i in group["sequences"])]
    tokens = sum(SPANNING_REQUEST["sequence_lengths"][i] for i in sequences)
    for dp_rank, dp in enumerate(response["dp_ranks"]):
        [row] = rows_of(table, dp_rank, "s0")  # before the replica's own micro-batches (if any): it runs it first
        lines = table.splitlines()
        assert all(lines.index(row) < lines.index(own) for mb in range(len(dp["micro_batches"]))
                   for own in rows_of(table, dp_rank, str(mb)))
        assert f"spans DP 0-1 from 0.00 ms: {len(sequences)} sequences/{tokens} tokens" in row
        # the block's time; the tokens of this replica's CP ranks, world ranks 4·dp_rank … 4·dp_rank + 3
        assert f"{span['estimated_time_ms']:.2f}" in row.split()
        replica_ranks = span["ranks"][4 * dp_rank:4 * dp_rank + 4]
        assert row.split()[6:10] == [f"{rank['tokens']:.0f}" for rank in replica_ranks]
        # the replica's sum is still its time: the block, then its own micro-batches
        [total] = rows_of(table, dp_rank, "sum")
        assert total.split()[-1] == f"{dp['estimated_time_ms']:.2f}"
        own_ms = sum(mb["estimated_time_ms"] for mb in dp["micro_batches"])
        assert dp["estimated_time_ms"] == pytest.approx(span["estimated_time_ms"] + own_ms, abs=1e-3)
    assert "s<p>: spanning[p], one micro-batch over several DP replicas" in table


def test_table_shows_when_a_spanning_micro_batch_waits_for_its_replicas() -> None:
    result = waiting_result()
    table = format_table(result)
    first_ms, second_ms = (estimate.time_s * 1e3 for estimate in result.estimate.spanning)
    for dp_rank in range(4):
        [second] = rows_of(table, dp_rank, "s1")
        # every replica starts the block over DP 0-3 once replicas 0 and 1 have run theirs: 2 and 3 wait
        assert f"spans DP 0-3 from {first_ms:.2f} ms: 1 sequences/50000 tokens" in second
        assert len(rows_of(table, dp_rank, "s0")) == (dp_rank < 2)
        own_ms = result.estimate.dp_ranks[dp_rank].micro_batches[0].time_s * 1e3
        [total] = rows_of(table, dp_rank, "sum")
        assert float(total.split()[-1]) == pytest.approx(first_ms + second_ms + own_ms, abs=0.01)
    assert "spans DP 0-1 from 0.00 ms: 1 sequences/30000 tokens" in rows_of(table, 0, "s0")[0]


def test_table_of_a_plan_without_spanning_micro_batches_has_no_line_of_them() -> None:
    result = make_plan(make_problem(sequence_lengths=REQUEST["sequence_lengths"], dp_size=2, cp_size=4,
                                    model="qwen2.5-0.5b", bucket_size=26000), SchedulerName.SKRULL_BINARY)
    assert result.plan.spanning == ()
    table = format_table(result)
    rows = table.splitlines()[2:-1]  # between the header and the estimate
    num_micro_batches = sum(len(dp.micro_batches) for dp in result.plan.dp_ranks)
    assert [row.split()[1] for row in rows].count("sum") == 2 and len(rows) == num_micro_batches + 2
    assert "spans" not in table and "s<p>" not in table


def test_plot_draws_each_spanning_micro_batch_once_across_the_dp_rows_it_spans() -> None:
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    result = waiting_result()
    figure = gantt_figure(result)
    try:
        skrull_panel = figure.axes[0]
        blocks = {patch.get_gid(): patch for patch in skrull_panel.patches if patch.get_gid()}
        assert set(blocks) == {"spanning-0", "spanning-1"}
        first_ms, second_ms = (estimate.time_s * 1e3 for estimate in result.estimate.spanning)

        def rows_and_times(block: Rectangle) -> tuple[set[int], float, float]:
            """The DP rows a bar covers (row d at y = d), its start and its end."""
            covered = {d for d in range(4) if block.get_y() < d < block.get_y() + block.get_height()}
            return covered, block.get_x(), block.get_x() + block.get_width()

        assert rows_and_times(blocks["spanning-0"]) == ({0, 1}, 0.0, pytest.approx(first_ms))
        assert rows_and_times(blocks["spanning-1"]) == ({0, 1, 2, 3}, pytest.approx(first_ms),
                                                        pytest.approx(first_ms + second_ms))
        assert {text.get_text() for text in skrull_panel.texts} == {"spans DP 0-1", "spans DP 0-3"}
        # each replica's own micro-batch starts when the last block it is part of ends: one bar per row
        own = [patch for patch in skrull_panel.patches if not patch.get_gid() and isinstance(patch, Rectangle)]
        assert sorted(round(patch.get_y() + patch.get_height() / 2) for patch in own) == [0, 1, 2, 3]
        assert all(patch.get_x() == pytest.approx(first_ms + second_ms) for patch in own)
    finally:
        plt.close(figure)


def test_plot_of_a_plan_without_spanning_micro_batches_draws_no_block() -> None:
    import matplotlib.pyplot as plt

    result = make_plan(make_problem(sequence_lengths=REQUEST["sequence_lengths"], dp_size=2, cp_size=4,
                                    model="qwen2.5-0.5b", bucket_size=26000), SchedulerName.SKRULL_BINARY)
    figure = gantt_figure(result)
    try:
        for panel in figure.axes[:2]:
            assert not panel.texts and not any(patch.get_gid() for patch in panel.patches)
            # every DP rank's first micro-batch starts at 0
            assert min(patch.get_x() for patch in panel.patches) == 0.0
    finally:
        plt.close(figure)
