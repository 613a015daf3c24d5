"""``examples/sft.yaml`` end to end, as a user runs it: torchrun with ``--config`` and flags over it trains the
example's Hub model on its Hub data set's parquet split, out of an offline cache built here; reports every step
to W&B (offline) and MLflow (a file store); keeps the two newest checkpoints; and a second run given more
``--steps`` resumes from the newest, evaluating on a JSONL file of held-out chats instead of the Hub split."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.hub_cache import HubCache
from tests.wandb_records import wandb_records
from trainer_client.demo import read_metrics, trainer_env

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "sft.yaml"
# The example's 8 GPUs, long records and hundreds of steps, made 2 CPU processes and tiny batches.
SMALL = ["--dp", "1", "--cp", "2", "--global-batch", "4", "--bucket-size", "256", "--max-length", "512",
         "--checkpoint-every", "1", "--no-progress"]


def _chat(k: int) -> dict[str, object]:
    """A chat of a user turn and an assistant turn, their lengths varying with ``k``."""
    return {"messages": [{"role": "user", "content": "how long is the document " * (k % 5 + 1)},
                         {"role": "assistant", "content": "the scheduler packs short chats " * (k % 7 + 1)}]}


@pytest.mark.slow
def test_the_sft_example_trains_keeps_its_two_newest_checkpoints_and_resumes_from_the_newest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    example = yaml.safe_load(EXAMPLE.read_text())
    hub = HubCache(tmp_path / "hub")
    hub.add_model(example["model"])  # the tiny model and the tests' tokenizer, under the example's id
    data_id, train_split = example["data"].split(":")
    test_split = example["eval_data"].split(":")[1]
    hub.add_dataset(data_id, {train_split: [_chat(k) for k in range(24)],
                              test_split: [_chat(k) for k in range(100, 104)]}, file_format="parquet")
    work = tmp_path / "work"  # the example's relative paths land here
    work.mkdir()
    shutil.copy(EXAMPLE, work / "sft.yaml")
    held_out = work / "held-out.jsonl"
    held_out.write_text("".join(json.dumps(_chat(k)) + "\n" for k in range(200, 204)))
    tracking_uri = (tmp_path / "mlruns").as_uri()
    env = {**trainer_env(), **hub.env(), "WANDB_MODE": "offline", "WANDB_SILENT": "true",
           "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"), "WANDB_CACHE_DIR": str(tmp_path / "wandb-cache"),
           "WANDB_DATA_DIR": str(tmp_path / "wandb-data"), "MLFLOW_TRACKING_URI": tracking_uri,
           "MLFLOW_ALLOW_FILE_STORE": "true"}

    def train(*flags: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                               "-m", "trainer_client.train", "--config", "sft.yaml", *SMALL, *flags],
                              cwd=work, env=env, capture_output=True, text=True, timeout=600, check=False)

    checkpoints = Path(example["checkpoint_dir"])
    first = train("--steps", "3")  # replaces the file's epochs
    assert first.returncode == 0, first.stderr[-3000:]
    assert sorted(path.name for path in (work / checkpoints).iterdir()) == ["step-00000002", "step-00000003"]

    resumed = train("--steps", "5", "--eval-data", held_out.name)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {checkpoints / 'step-00000003'}: 3 steps done" in resumed.stderr
    assert sorted(path.name for path in (work / checkpoints).iterdir()) == ["step-00000004", "step-00000005"]
    metrics = read_metrics(work / example["metrics_out"])
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5]
    assert all(math.isfinite(m["loss"]) for m in metrics)  # type: ignore[arg-type]
    evaluated = {m["step"]: m["eval_loss"] for m in metrics if m["eval_loss"] is not None}
    assert evaluated.keys() == {3, 5} and all(math.isfinite(loss) for loss in evaluated.values())  # type: ignore[arg-type]
    losses = {m["step"]: m["loss"] for m in metrics}  # the trackers number steps as the metrics file does

    # W&B: one offline run folder per process that reported, each step's loss once, at the step's number
    logged: dict[int, float] = {}
    for run_file in (work / "runs" / example["job_id"] / "wandb").glob("offline-run-*/run-*.wandb"):
        for record in wandb_records(run_file):
            for item in record.history.item if record.HasField("history") else ():
                if (item.key or ".".join(item.nested_key)) == "train/loss":
                    logged[record.history.step.num] = float(item.value_json)
    assert logged == losses

    # MLflow: the job's one run, continued by the resumed run
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3.17 refuses its file store unless told
    client = MlflowClient(tracking_uri)
    (run,) = client.search_runs([client.get_experiment_by_name("skrull").experiment_id])
    assert (run.info.run_name, run.info.status) == (example["job_id"], "FINISHED")
    assert {point.step: point.value for point in client.get_metric_history(run.info.run_id, "train/loss")} == losses
