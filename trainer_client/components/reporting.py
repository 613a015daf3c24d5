"""Where each step's metrics go, written by rank 0 alone: ``--metrics-out`` (``MetricsFile``, one JSON line per
step) and the experiment trackers ``--report-to`` names (``Tracker``): TensorBoard, Weights & Biases, MLflow.
Every tracker gets the same scalars (``scalars``: what each JSON line carries, as numbers) at the trainer's step.
``open_reports`` opens a run's reporters; the trainer writes each step through ``Reports`` and closes it at the
end of the run, or as failed when the run fails.

Where each tracker writes, after the conventions of Hugging Face Trainer's ``report_to``:

* TensorBoard: event files in ``--logging-dir`` (default ``runs/<job id>``, the run's own folder);
* W&B: its run folder under ``--logging-dir``/wandb; project ``WANDB_PROJECT`` (default ``skrull``), run name
  the job id, run id the job id with ``:`` as ``-`` (W&B reserves ``:``); ``WANDB_MODE=offline`` keeps the run
  local, and W&B reads its other settings (``WANDB_ENTITY``, ``WANDB_API_KEY``) from the environment itself. The
  folder, the name and the id are W&B's own settings too (``WANDB_DIR``, ``WANDB_NAME``, ``WANDB_RUN_ID``), and an
  argument of ``wandb.init`` overrides its variable: each is given only where the user has not set its variable;
* MLflow: the tracking URI MLflow resolves (``MLFLOW_TRACKING_URI``, else its default ``sqlite:///mlflow.db`` in
  the working directory: one database for every run, as MLflow's UI expects); experiment
  ``MLFLOW_EXPERIMENT_NAME`` (default ``skrull``), run name the job id.

The job id is ``--job-id``; without one, the run's name and the time it started (``default_job_id``:
``qwen2.5-0.5b-ultrachat-20261128-081500``, from ``--checkpoint-dir``'s name, else the model's and the data's); give
one to continue its W&B and MLflow runs after ``--resume``.

Each tracker's package is an extra of its own (``pip install 'skrull[wandb]'``) and is imported only by a run
that reports to it; ``choices.check_installed`` refuses a missing one when ``TrainConfig`` is built, on every rank,
before any process group. Measured import cost on the 2-core development machine: ``wandb`` 0.4–1.9 s,
``mlflow`` 1.1–3.9 s, ``torch.utils.tensorboard`` under 0.1 s after torch; a new MLflow SQLite database takes
1.5 s or more to create its tables.

Every reporter numbers a step as the logs and the checkpoints do (``StepMetrics.step``: 1-based, ``step-<n>``
after ``n`` steps, the last step ``--steps``), a ``--metrics-out`` line's ``step`` and each tracker's step alike.
Resuming: the numbering continues after the checkpoint's step. TensorBoard first discards the events after it (the
killed run may have logged them). Under ``--resume`` W&B resumes the run of the same id and MLflow continues the
latest run of the job's name; W&B accepts each step once, so it keeps the killed run's points for the steps
after the checkpoint and drops the repeats, and MLflow appends, so it holds both. Without ``--resume`` a job id
W&B already has is refused when the run starts.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from trainer_client.config_choices import SYNTHETIC_PREFIX, Tracker
from trainer_client.planning.source import PlanOrigin

if TYPE_CHECKING:
    from trainer_client.components.step_metrics import StepMetrics

__all__ = [
    "DEFAULT_LOGGING_ROOT",
    "DEFAULT_PROJECT",
    "MetricsFile",
    "MlflowRun",
    "Reporter",
    "Reports",
    "TensorBoardLog",
    "WandbRun",
    "default_job_id",
    "open_reports",
    "scalars",
]

DEFAULT_LOGGING_ROOT = Path("runs")  # --logging-dir defaults to runs/<job id>, as TensorBoard's own default
DEFAULT_PROJECT = "skrull"  # the W&B project and the MLflow experiment unless WANDB_PROJECT / MLFLOW_EXPERIMENT_NAME


def default_job_id(*, model: str, data: str, checkpoint_dir: Path | None) -> str:
    """The job's name where ``--job-id`` gives none: its ``--checkpoint-dir``'s name, else its ``--model``'s and
    ``--data``'s, and the time it started (``ultrachat-sft-20261128-081500``), in the characters a job id may
    hold."""
    if checkpoint_dir is not None:
        name = checkpoint_dir.resolve().name
    else:  # the last part of each: qwen2.5-0.5b from Qwen/Qwen2.5-0.5B@main, chats from data/chats.jsonl:train
        parts = [spec.removeprefix(SYNTHETIC_PREFIX).split("@")[0].rstrip("/").rsplit("/", 1)[-1].split(":")[0]
                 for spec in (model, data)]
        name = "-".join(re.sub(r"\.(jsonl|json|parquet|csv)$", "", part) for part in parts)
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-._")[:100] or "run"
    return f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


def scalars(metrics: StepMetrics) -> dict[str, float]:
    """The step's metrics as every tracker logs them; a metric the step has no value of (the eval loss of a step
    not evaluated, the predicted time of a plan without one, the peak memory where none is measured) is left out."""
    named: dict[str, float | None] = {
        "train/loss": metrics.loss,
        "eval/loss": metrics.eval_loss,
        "train/lr": metrics.lr,
        "train/grad_norm": metrics.grad_norm,
        "train/tokens_per_s": metrics.tokens_per_s,
        "train/epoch": metrics.epoch,
        "time/step_s": metrics.step_time_s,
        "time/micro_batches_measured_ms": metrics.micro_batch_time_s * 1e3,
        "time/micro_batches_predicted_ms": metrics.estimated_time_ms,
        "plan/from_service": float(metrics.plan_source == PlanOrigin.SERVICE),
        "plan/fallbacks": metrics.plan_fallbacks,
        "plan/micro_batches": metrics.num_micro_batches,
        "memory/peak_bytes": metrics.peak_memory_bytes,
    }
    return {name: float(value) for name, value in named.items() if value is not None}


class Reporter(Protocol):
    """One destination of the step metrics."""

    def write(self, metrics: StepMetrics) -> None: ...

    def close(self, *, failed: bool) -> None:
        """``failed``: the run stopped before its last step, which a tracker records in the run's status."""


class MetricsFile:
    """``--metrics-out``: one JSON line per step, each step once. A resumed run keeps the lines of the steps its
    checkpoint holds (``steps_done``) and rewrites the ones after (which the killed run may have logged)."""

    def __init__(self, path: Path, *, steps_done: int) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        kept = []
        if steps_done and path.is_file():
            kept = [line for line in path.read_text().splitlines()  # steps 1 … steps_done are the checkpoint's
                    if line.strip() and json.loads(line)["step"] <= steps_done]
        self._handle = path.open("w")
        self._handle.writelines(line + "\n" for line in kept)
        self._handle.flush()

    def write(self, metrics: StepMetrics) -> None:
        self._handle.write(metrics.to_json() + "\n")
        self._handle.flush()

    def close(self, *, failed: bool) -> None:
        self._handle.close()


class TensorBoardLog:
    """``--report-to tensorboard``: the scalars as TensorBoard events in ``directory``. A resumed run first
    discards the events of the steps after its checkpoint's ``steps_done`` (``purge_step``), which the killed run
    may have logged."""

    def __init__(self, directory: Path, *, steps_done: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(directory), purge_step=steps_done + 1 if steps_done else None)

    def write(self, metrics: StepMetrics) -> None:
        for name, value in scalars(metrics).items():
            self._writer.add_scalar(name, value, global_step=metrics.step)
        self._writer.flush()

    def close(self, *, failed: bool) -> None:
        self._writer.close()


class WandbRun:
    """``--report-to wandb``: the scalars as one W&B history row per step, at the trainer's step."""

    def __init__(self, directory: Path, *, job_id: str, resume: bool) -> None:
        import wandb

        def unless_set(variable: str, value: str) -> str | None:
            """``value``, or None (W&B then reads ``variable`` itself) where the user set ``variable``."""
            return None if variable in os.environ else value

        run_dir = unless_set("WANDB_DIR", str(directory))
        if run_dir is not None:
            directory.mkdir(parents=True, exist_ok=True)  # else W&B warns that it finds no git repository there
        self._run = wandb.init(project=os.environ.get("WANDB_PROJECT", DEFAULT_PROJECT),
                               name=unless_set("WANDB_NAME", job_id),
                               id=unless_set("WANDB_RUN_ID", job_id.replace(":", "-")), dir=run_dir,
                               resume="allow" if resume else "never")

    def write(self, metrics: StepMetrics) -> None:
        self._run.log(scalars(metrics), step=metrics.step)

    def close(self, *, failed: bool) -> None:
        self._run.finish(exit_code=1 if failed else 0)


class MlflowRun:
    """``--report-to mlflow``: the scalars as MLflow metrics at the trainer's step, through a client of its own
    (not MLflow's global active run, which the code around the trainer may hold)."""

    def __init__(self, *, job_id: str, resume: bool) -> None:
        import mlflow
        from mlflow import MlflowClient

        self._client = MlflowClient(mlflow.get_tracking_uri())
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", DEFAULT_PROJECT)
        experiment = self._client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment is not None else self._client.create_experiment(name)
        # The job id can hold only letters, digits and . _ : -, so it needs no escaping in the filter.
        earlier = (self._client.search_runs([experiment_id], filter_string=f"attributes.run_name = '{job_id}'",
                                            order_by=["attributes.start_time DESC"], max_results=1)
                   if resume else [])
        if earlier:
            self.run_id = earlier[0].info.run_id
            self._client.update_run(self.run_id, status="RUNNING")
        else:
            self.run_id = self._client.create_run(experiment_id, run_name=job_id).info.run_id

    def write(self, metrics: StepMetrics) -> None:
        from mlflow.entities import Metric

        timestamp_ms = int(time.time() * 1000)
        self._client.log_batch(self.run_id, metrics=[Metric(name, value, timestamp_ms, metrics.step)
                                                     for name, value in scalars(metrics).items()])

    def close(self, *, failed: bool) -> None:
        self._client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


class Reports:
    """A run's reporters, written and closed together; none on a rank other than 0."""

    def __init__(self, reporters: Sequence[Reporter] = ()) -> None:
        self.reporters = tuple(reporters)

    def write(self, metrics: StepMetrics) -> None:
        for reporter in self.reporters:
            reporter.write(metrics)

    def close(self, *, failed: bool) -> None:
        """Close every reporter, also when closing one raises (that error is raised after the others closed)."""
        reporters, self.reporters = self.reporters, ()
        with ExitStack() as closing:
            for reporter in reporters:
                closing.callback(reporter.close, failed=failed)


def open_reports(*, job_id: str, steps_done: int, metrics_out: Path | None = None, report_to: Sequence[Tracker] = (),
                 logging_dir: Path | None = None, resume: bool = False) -> Reports:
    """Rank 0's reporters of job ``job_id`` (``--metrics-out``, ``--report-to``, ``--logging-dir``, ``--resume``),
    continuing after ``steps_done`` (a resumed run's checkpoint's); those opened before one that fails to open are
    closed again."""
    opened: list[Reporter] = []
    try:
        if metrics_out is not None:
            opened.append(MetricsFile(metrics_out, steps_done=steps_done))
        for tracker in report_to:
            opened.append(_open_tracker(tracker, job_id=job_id, steps_done=steps_done,
                                        directory=logging_dir or DEFAULT_LOGGING_ROOT / job_id, resume=resume))
    except BaseException:
        Reports(opened).close(failed=True)
        raise
    return Reports(opened)


def _open_tracker(tracker: Tracker, *, job_id: str, steps_done: int, directory: Path, resume: bool) -> Reporter:
    match tracker:
        case Tracker.TENSORBOARD:
            return TensorBoardLog(directory, steps_done=steps_done)
        case Tracker.WANDB:
            return WandbRun(directory, job_id=job_id, resume=resume)
        case Tracker.MLFLOW:
            return MlflowRun(job_id=job_id, resume=resume)
