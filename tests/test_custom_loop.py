"""A training loop of one's own on Skrull's public API trains the model the bundled trainer trains.

``examples/custom_loop.py`` (its own AdamW, gradient all-reduce and loop, no ``Trainer``) runs as its page says,
``torchrun --nproc-per-node 4``, on its built-in defaults; ``python -m trainer_client.train`` runs with the same
model, data, seed, dp × cp, global batch, bucket size and optimizer (a constant learning rate, as the example's,
and its default FSDP ``zero2`` against the example's replicated all-reduce). Every step's loss and gradient norm
must agree within the trainer's own equivalence tolerance. The gradient norm is what catches a wrong normaliser:
AdamW's update does not see a gradient's scale, and a tiny model on random tokens hardly moves in four steps, so
a per-micro-batch mean changes the losses by a few parts in a million and a mean over ranks not at all, while
the gradient norm grows eightfold or shrinks fourfold.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.hub_cache import save_tokenizer
from trainer_client.demo import read_metrics, run_trainer, trainer_command, trainer_env

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "custom_loop.py"
# The example's defaults (dp 2 × cp 2, the tiny model, synthetic:lmsys, seed 0, lr 1e-3, clipping at 1.0).
STEPS, GLOBAL_BATCH, BUCKET_SIZE = 4, 16, 1024
RELATIVE_TOLERANCE = 1e-5  # the trainer's own: every scheduler and sharding mode agrees with it this closely


@pytest.mark.slow
def test_custom_loop_example_matches_the_bundled_trainer_step_for_step(tmp_path: Path) -> None:
    example = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", str(EXAMPLE)],
        cwd=tmp_path, env=trainer_env(), capture_output=True, text=True, timeout=300, check=False,
    )
    assert example.returncode == 0, example.stderr[-3000:]
    metrics_out = tmp_path / "trainer.jsonl"
    trainer = run_trainer(trainer_command(scheduler="skrull", metrics_out=metrics_out, scheduler_url=None,
                                          steps=STEPS, global_batch=GLOBAL_BATCH, bucket_size=BUCKET_SIZE,
                                          extra=["--min-lr-ratio", "1"]), timeout_s=300)
    assert trainer.returncode == 0, trainer.stderr[-3000:]

    # "step    1 loss 6.947246 grad_norm 1.424592e-01", one line per step from rank 0, numbered from 1 as the trainer's
    printed = [line.split() for line in example.stdout.splitlines() if line.startswith("step ")]
    bundled = read_metrics(metrics_out)
    assert [int(fields[1]) for fields in printed] == [m["step"] for m in bundled] == list(range(1, STEPS + 1))
    for fields, metrics in zip(printed, bundled, strict=True):
        assert float(fields[3]) == pytest.approx(metrics["loss"], rel=RELATIVE_TOLERANCE), f"step {fields[1]}"
        assert float(fields[5]) == pytest.approx(metrics["grad_norm"], rel=RELATIVE_TOLERANCE), f"step {fields[1]}"
    assert any(m["num_micro_batches"] > 2 for m in bundled)  # several micro-batches: accumulation is exercised


@pytest.mark.slow
def test_custom_loop_example_trains_chats_with_a_tokenizer(tmp_path: Path) -> None:
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": "the model reads " * (k % 4 + 1)},
        {"role": "assistant", "content": "long documents " * (k % 3 + 1)}]}) + "\n" for k in range(8)))
    example = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(EXAMPLE),
         "--dp", "1", "--cp", "2", "--data", str(chats), "--tokenizer", str(save_tokenizer(tmp_path / "tokenizer")),
         "--global-batch", "4", "--steps", "2"],
        cwd=tmp_path, env=trainer_env(), capture_output=True, text=True, timeout=300, check=False,
    )
    assert example.returncode == 0, example.stderr[-3000:]
    assert [line.split()[1] for line in example.stdout.splitlines() if line.startswith("step ")] == ["1", "2"]
