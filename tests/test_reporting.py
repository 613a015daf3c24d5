"""``--report-to`` (``trainer_client.components.reporting``): TensorBoard, W&B and MLflow each hold, read back from what
they wrote, every scalar of every step at the trainer's step; a resumed run continues the numbering; a failed run is
recorded as failed, also one torchrun stops with SIGTERM, and the trainer closes its reports, planner and
checkpointer whatever raises; a tracker whose package is missing is refused when the config is built, naming its
extra. W&B runs offline and MLflow against a file store, both in the test's folder."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any
from unittest import mock

import pytest

import trainer_client.distributed
import trainer_client.trainer
from tests.wandb_records import wandb_records
from trainer_client import train
from trainer_client.components.checkpoint import Checkpointer
from trainer_client.components.reporting import Reports, open_reports, scalars
from trainer_client.components.step_metrics import StepMetrics
from trainer_client.config import TrainConfig
from trainer_client.config_choices import Tracker
from trainer_client.distributed import ParallelDims, init_parallel, spawn_gloo
from trainer_client.loop import SkrullBatches
from trainer_client.planning.source import PlanOrigin
from trainer_client.train import build_parser, config_from_args
from trainer_client.trainer import Trainer

JOB_ID = "team:run-1"


def _metrics(step: int, *, loss: float, eval_loss: float | None = None) -> StepMetrics:
    return StepMetrics(step=step, loss=loss, tokens=4096, loss_tokens=4000, step_time_s=0.5, tokens_per_s=8192.0,
                       plan_source=PlanOrigin.SERVICE.value, scheduler="skrull", estimated_time_ms=420.0 + step,
                       num_micro_batches=3, micro_batch_time_s=0.4 + step / 100, num_padding_micro_batches=0,
                       plan_fallbacks=step, lr=1e-3 / step, grad_norm=0.5 + step, peak_memory_bytes=1 << 30,
                       memory_kind="cuda_max_allocated", eval_loss=eval_loss)


STEPS = (_metrics(1, loss=2.0), _metrics(2, loss=1.5, eval_loss=1.75), _metrics(3, loss=1.25))
RESUMED = (_metrics(3, loss=1.125), _metrics(4, loss=1.0, eval_loss=1.5))  # from a checkpoint after step 2


def _config(tracker: Tracker, tmp_path: Path, *, resume: bool = False) -> TrainConfig:
    logging_dir = tmp_path / "run" if tracker is not Tracker.MLFLOW else None  # MLflow writes to its tracking URI
    return TrainConfig(dp=1, cp=1, report_to=(tracker,), logging_dir=logging_dir, job_id=JOB_ID,
                       resume=resume, checkpoint_dir=tmp_path / "checkpoints")


def _report(config: TrainConfig, steps: Sequence[StepMetrics], *, failed: bool = False) -> None:
    reports = open_reports(job_id=JOB_ID, steps_done=steps[0].step - 1, metrics_out=config.metrics_out,
                           report_to=config.report_to, logging_dir=config.logging_dir, resume=config.resume)
    for metrics in steps:
        reports.write(metrics)
    reports.close(failed=failed)


def _expected(steps: Sequence[StepMetrics]) -> dict[str, list[tuple[int, float]]]:
    """Each scalar's (step, value) points, in step order."""
    points: dict[str, list[tuple[int, float]]] = {}
    for metrics in steps:
        for name, value in scalars(metrics).items():
            points.setdefault(name, []).append((metrics.step, value))
    return points


def test_the_scalars_are_the_metrics_line_with_the_steps_missing_values_left_out() -> None:
    assert scalars(STEPS[1]) == {
        "train/loss": 1.5, "eval/loss": 1.75, "train/lr": 5e-4, "train/grad_norm": 2.5, "train/tokens_per_s": 8192.0,
        "time/step_s": 0.5, "time/micro_batches_measured_ms": pytest.approx(420.0),
        "time/micro_batches_predicted_ms": 422.0, "plan/from_service": 1.0, "plan/fallbacks": 2.0,
        "plan/micro_batches": 3.0, "memory/peak_bytes": float(1 << 30),
    }
    assert "eval/loss" not in scalars(STEPS[0])
    unplanned = StepMetrics(**{**{name: getattr(STEPS[0], name) for name in StepMetrics.__slots__},
                               "plan_source": PlanOrigin.EMBEDDED.value, "estimated_time_ms": None,
                               "peak_memory_bytes": None})
    assert scalars(unplanned)["plan/from_service"] == 0.0
    assert {"time/micro_batches_predicted_ms", "memory/peak_bytes"}.isdisjoint(scalars(unplanned))


def test_the_metrics_file_numbers_steps_as_the_trackers_and_a_resume_replaces_the_lines_after_its_checkpoint(
    tmp_path: Path,
) -> None:
    config = TrainConfig(dp=1, cp=1, metrics_out=tmp_path / "metrics.jsonl", checkpoint_dir=tmp_path / "checkpoints")
    _report(config, STEPS, failed=True)  # killed after step 3 was logged, its checkpoint the one after step 2
    _report(config.model_copy(update={"resume": True}), RESUMED)
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(line["step"], line["loss"]) for line in lines] == [(1, 2.0), (2, 1.5), (3, 1.125), (4, 1.0)]
    assert [line["step"] for line in lines] == [step for step, _ in _expected([*STEPS[:2], *RESUMED])["train/loss"]]


def test_tensorboard_holds_every_scalar_and_a_resume_replaces_the_steps_after_its_checkpoint(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _report(_config(Tracker.TENSORBOARD, tmp_path), STEPS)
    _report(_config(Tracker.TENSORBOARD, tmp_path, resume=True), RESUMED)

    events = EventAccumulator(str(tmp_path / "run"))
    events.Reload()
    logged = {tag: [(event.step, event.value) for event in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    expected = _expected([*STEPS[:2], *RESUMED])
    assert logged.keys() == expected.keys()
    for tag, points in expected.items():  # TensorBoard stores float32
        assert logged[tag] == [(step, pytest.approx(value, rel=1e-6)) for step, value in points], tag


def test_a_wandb_offline_run_holds_every_scalar_at_the_trainer_step_and_a_failed_run_exits_1(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    for variable, value in (("WANDB_MODE", "offline"), ("WANDB_SILENT", "true"), ("WANDB_PROJECT", "long-sft"),
                            ("WANDB_CONFIG_DIR", str(tmp_path / "config")), ("WANDB_CACHE_DIR", str(tmp_path)),
                            ("WANDB_DATA_DIR", str(tmp_path))):
        monkeypatch.setenv(variable, value)

    _report(_config(Tracker.WANDB, tmp_path), STEPS, failed=True)
    import wandb

    wandb.teardown()  # W&B's service writes the run file after finish() returns; it has written it when it stops

    (run_file,) = (tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb")
    records = wandb_records(run_file)
    (run,) = [record.run for record in records if record.HasField("run")]
    assert (run.project, run.display_name, run.run_id) == ("long-sft", JOB_ID, "team-run-1")
    logged: dict[str, list[tuple[int, float]]] = {}
    for record in records:
        if record.HasField("history"):
            for item in record.history.item:
                name = item.key or ".".join(item.nested_key)
                if not name.startswith("_"):
                    logged.setdefault(name, []).append((record.history.step.num, float(item.value_json)))
    assert logged == _expected(STEPS)
    (exit_record,) = [record.exit for record in records if record.HasField("exit")]
    assert exit_record.exit_code == 1


def test_wandb_honours_the_folder_name_and_id_the_user_set_in_its_own_variables(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    for variable, value in (("WANDB_MODE", "offline"), ("WANDB_SILENT", "true"),
                            ("WANDB_CONFIG_DIR", str(tmp_path / "config")), ("WANDB_CACHE_DIR", str(tmp_path)),
                            ("WANDB_DATA_DIR", str(tmp_path)), ("WANDB_DIR", str(tmp_path / "tracked")),
                            ("WANDB_NAME", "nightly"), ("WANDB_RUN_ID", "nightly-7")):
        monkeypatch.setenv(variable, value)

    _report(_config(Tracker.WANDB, tmp_path), STEPS[:1])
    import wandb

    wandb.teardown()

    assert not (tmp_path / "run").exists()  # --logging-dir, where the run would be without WANDB_DIR
    (run_file,) = (tmp_path / "tracked" / "wandb").glob("offline-run-*/run-*.wandb")
    (run,) = [record.run for record in wandb_records(run_file) if record.HasField("run")]
    assert (run.display_name, run.run_id) == ("nightly", "nightly-7")


def test_mlflow_holds_every_scalar_and_a_resume_continues_the_jobs_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlflow import MlflowClient

    monkeypatch.chdir(tmp_path)
    # A file store: MLflow's default, SQLite, spends seconds creating its tables, and the run does not differ.
    tracking_uri = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking_uri)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3.17 refuses its file store unless told
    client = MlflowClient(tracking_uri)

    _report(_config(Tracker.MLFLOW, tmp_path), STEPS[:2], failed=True)  # killed after step 2's checkpoint
    (run,) = client.search_runs([client.get_experiment_by_name("skrull").experiment_id])
    assert (run.info.run_name, run.info.status) == (JOB_ID, "FAILED")

    _report(_config(Tracker.MLFLOW, tmp_path, resume=True), RESUMED)
    (run,) = client.search_runs([run.info.experiment_id])
    assert run.info.status == "FINISHED"
    expected = _expected([*STEPS[:2], *RESUMED])
    assert run.data.metrics.keys() == expected.keys()
    for name, points in expected.items():
        assert [(point.step, point.value) for point in client.get_metric_history(run.info.run_id, name)] == points


def test_a_tracker_whose_package_is_missing_is_refused_naming_its_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed: neither found nor importable
    with pytest.raises(ValueError, match=r"--report-to wandb needs the wandb package, which is not installed: "
                                         r"pip install 'skrull\[wandb\]'"):
        TrainConfig(dp=1, cp=1, report_to=(Tracker.TENSORBOARD, Tracker.WANDB))
    # the others do not need it
    TrainConfig(dp=1, cp=1, report_to=(Tracker.TENSORBOARD, Tracker.MLFLOW))


@pytest.mark.parametrize(("changes", "message"), [
    ({"report_to": ("tensorboard", "comet")}, "--report-to 'comet' is unknown; known: tensorboard, wandb, mlflow"),
    ({"logging_dir": Path("runs")}, "--logging-dir goes with --report-to"),
    ({"logging_dir": Path("runs"), "report_to": ("mlflow",)},
     r"--logging-dir is TensorBoard's and W&B's folder, and --report-to mlflow has neither: MLflow writes to its "
     r"tracking URI \(MLFLOW_TRACKING_URI\), so leave --logging-dir out"),
])
def test_refuses_an_unknown_tracker_and_a_logging_dir_no_tracker_reads(changes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TrainConfig(dp=1, cp=1, **changes)
    if "report_to" in changes and "logging_dir" in changes:  # one tracker that reads it is enough
        TrainConfig(dp=1, cp=1, **{**changes, "report_to": ("mlflow", "tensorboard")})


def test_report_to_takes_a_comma_separated_list_of_trackers() -> None:
    args = build_parser().parse_args(["--dp", "1", "--cp", "1", "--report-to", "mlflow, tensorboard,mlflow",
                                      "--logging-dir", "logs"])
    config = config_from_args(args)
    assert (config.report_to, config.logging_dir) == ((Tracker.MLFLOW, Tracker.TENSORBOARD), Path("logs"))
    assert config_from_args(build_parser().parse_args(["--dp", "1", "--cp", "1"])).report_to == ()


# ------------------------------------------------------------------------------------------------ closing the run


class _Unhandled(BaseException):
    """SIGTERM reached the handler the test had installed, not main's."""


def test_sigterm_stops_main_through_its_finally_so_the_trainer_is_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    # torchrun stops the ranks still running with SIGTERM once one failed; Python's default action would end the
    # process at once, without closing the trackers.
    closed: list[bool] = []

    class Stopped:  # a trainer torchrun stops while it trains
        def __init__(self, config: TrainConfig, parallel: object) -> None:
            pass

        def train(self) -> list[StepMetrics]:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(10)  # a handler that raises interrupts the sleep
            return []

        def close(self) -> None:
            closed.append(True)

    def unhandled(signum: int, frame: FrameType | None) -> None:
        raise _Unhandled

    # train.py imports them when a rank starts, so that --help imports no torch.
    monkeypatch.setattr(trainer_client.trainer, "Trainer", Stopped)
    monkeypatch.setattr(trainer_client.distributed, "init_parallel", lambda dims, timeout_s: None)
    previous = signal.signal(signal.SIGTERM, unhandled)
    try:
        with pytest.raises(SystemExit) as stopped:
            train.main(["--dp", "1", "--cp", "1"])
        assert stopped.value.code == 128 + signal.SIGTERM
        assert closed == [True]
        assert signal.getsignal(signal.SIGTERM) is unhandled  # main's handler lasts as long as main
    finally:
        signal.signal(signal.SIGTERM, previous)


class _Recorded:
    """A reporter that records its closing in ``closed``."""

    def __init__(self, closed: list[str]) -> None:
        self.closed = closed

    def write(self, metrics: StepMetrics) -> None:
        pass

    def close(self, *, failed: bool) -> None:
        self.closed.append(f"reports failed={failed}")


def _closes_what_it_opened_whatever_raises(out_dir: Path) -> None:
    """One rank: a trainer whose planner fails to close, and one whose reports fail to open."""
    config = TrainConfig(dp=1, cp=1, steps=1, global_batch=2, bucket_size=256, progress=False,
                         checkpoint_dir=out_dir / "checkpoints")
    parallel = init_parallel(ParallelDims.of(config))
    closed: list[str] = []
    checkpointer_close, batches_close = Checkpointer.close, SkrullBatches.close
    planner_fails_to_close = True

    def closing_checkpointer(checkpointer: Checkpointer) -> None:
        closed.append("checkpointer")
        checkpointer_close(checkpointer)

    def closing_batches(batches: SkrullBatches) -> None:
        closed.append("batches")
        batches_close(batches)
        if planner_fails_to_close:
            raise RuntimeError("the planner failed to close")

    def unreachable_tracker(*args: Any, **kwargs: Any) -> Reports:
        raise ConnectionError("the tracker is unreachable")

    outcome: dict[str, Any] = {}
    with (mock.patch.object(Checkpointer, "close", closing_checkpointer),
          mock.patch.object(SkrullBatches, "close", closing_batches)):
        with mock.patch("trainer_client.trainer.open_reports", lambda *args, **kwargs: Reports([_Recorded(closed)])):
            trainer = Trainer(config, parallel)
            try:
                trainer.close()
            except RuntimeError as error:
                closed.append(str(error))
            trainer.close()  # closes nothing twice
        outcome["close"], closed[:] = list(closed), []
        planner_fails_to_close = False
        with mock.patch("trainer_client.trainer.open_reports", unreachable_tracker):
            try:
                Trainer(config, parallel)
            except ConnectionError as error:
                closed.append(str(error))
        outcome["init"] = closed
    (out_dir / "outcome.json").write_text(json.dumps(outcome))


def test_the_trainer_closes_what_it_opened_once_newest_first_whatever_raises(tmp_path: Path) -> None:
    spawn_gloo(_closes_what_it_opened_whatever_raises, 1, tmp_path)
    outcome = json.loads((tmp_path / "outcome.json").read_text())
    # train() never ran: the reports record a failed run; the planner's error comes after the checkpointer closed
    assert outcome["close"] == ["reports failed=True", "batches", "checkpointer", "the planner failed to close"]
    assert outcome["init"] == ["batches", "checkpointer", "the tracker is unreachable"]


@pytest.mark.slow  # a process importing torch and MLflow
def test_a_run_torchrun_stops_with_sigterm_is_a_failed_mlflow_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tracking_uri = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking_uri)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # here and in the trainer's process
    script = textwrap.dedent("""
        import sys, time
        from trainer_client import train
        from trainer_client.trainer import Trainer

        def blocked(self):
            print("training", flush=True)
            time.sleep(60)  # as a rank waiting in a collective for a peer that failed

        Trainer.train = blocked
        sys.exit(train.main(sys.argv[1:]))
    """)
    run = subprocess.Popen([sys.executable, "-c", script, "--dp", "1", "--cp", "1", "--steps", "1", "--global-batch",
                            "2", "--bucket-size", "256", "--no-progress", "--report-to", "mlflow", "--job-id", JOB_ID],
                           cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert run.stdout is not None and run.stdout.readline() == "training\n", run.communicate()[1][-3000:]
        run.send_signal(signal.SIGTERM)  # what torchrun sends the ranks still running
        _, stderr = run.communicate(timeout=120)
    finally:
        run.kill()
    assert run.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri)
    (recorded,) = client.search_runs([client.get_experiment_by_name("skrull").experiment_id])
    assert (recorded.info.run_name, recorded.info.status) == (JOB_ID, "FAILED")
