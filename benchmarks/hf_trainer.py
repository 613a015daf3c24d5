"""The Hugging Face Trainer path's step time against the bundled trainer's, on the same plans (``make bench-hf``).

Both train the ``tiny`` model (random init, seed 0) on the same synthetic LMSys-like global batches, planned by the
embedded ``skrull`` planner under the same profile and BucketSize, so that every step runs the same micro-batches;
gloo ranks on this machine's CPU, one thread each, fp32, parameters replicated (the bundled trainer's ``--sharding
none``, ``SkrullTrainer`` under accelerate's DDP: on CPU accelerate has no FSDP). The bundled trainer runs its own
step (``Trainer.batch`` and ``Trainer.train_step``, as its loop calls them); ``SkrullTrainer`` runs
``Trainer.train`` with logging every step, nothing saved or reported.

A step's time is the wall time from the end of the previous step (the start of training, for the first) to the end
of this one, on global rank 0: its data, its plan, its forward and backward passes, the gradient reduction and the
optimizer; beside it, the CPU time global rank 0's process spent over the same interval (all its threads), which
other processes on the machine disturb less. The first ``--warmup`` steps of every run are left out. Runs are
interleaved: ``--rounds`` rounds, each running both paths once, in alternating order (bundled first, then the
Trainer first), so that a machine that slows down over time slows both. Prints, per layout, the median step time of
each path over every kept step of every round, wall and CPU, and their ratios; ``--out`` writes every step time as
JSON.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from trainer_client.distributed import spawn_gloo

__all__ = ["main"]

PROFILE = "h100-paper"  # the bundled trainer's CPU default; both paths plan under it


def _records(args: argparse.Namespace) -> list[dict[str, list[int]]]:
    """The run's global batches, in order, as records of input ids and labels (what the Trainer's data set holds)."""
    from trainer_client.data import make_source

    source = make_source("synthetic:lmsys", global_batch_size=args.global_batch, vocab_size=1024,
                         max_length=args.max_length, seed=args.seed)
    return [{"input_ids": sample.input_ids.tolist(), "labels": sample.labels.tolist()}
            for step in range(args.steps) for sample in source.batch(step).samples]


def _clocks() -> tuple[float, float]:
    """Wall time, and the CPU time of this process (all its threads: the prefetch thread, gloo's)."""
    return time.perf_counter(), time.process_time()


def _differences(clocks: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Each step's wall and CPU time, from the clocks read when training started and at each step's end."""
    return [(wall - last_wall, cpu - last_cpu) for (last_wall, last_cpu), (wall, cpu) in itertools.pairwise(clocks)]


def _bundled_steps(args: argparse.Namespace, dp: int, cp: int, parallel: Any,
                   data: Path) -> list[tuple[float, float]]:
    from trainer_client.config import TrainConfig
    from trainer_client.trainer import Trainer as BundledTrainer

    config = TrainConfig(dp=dp, cp=cp, model="tiny", data=str(data), shuffle=False, global_batch=args.global_batch,
                         max_length=args.max_length, steps=args.steps, scheduler="skrull", bucket_size=args.bucket_size,
                         profile=PROFILE, sharding="none", seed=args.seed, lr=1e-3, min_lr_ratio=1.0, progress=False)
    trainer = BundledTrainer(config, parallel)
    clocks = [_clocks()]
    for index in range(args.steps):
        trainer.train_step(index, trainer.batch(index))
        clocks.append(_clocks())
    trainer.close()
    return _differences(clocks)


def _trainer_steps(args: argparse.Namespace, dp: int, cp: int, records: list[dict[str, list[int]]],
                   out: Path) -> list[tuple[float, float]]:
    from accelerate.state import AcceleratorState
    from datasets import Dataset
    from transformers import TrainerCallback, TrainingArguments
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    from trainer_client.hf import SkrullArguments, SkrullTrainer
    from trainer_client.models.model import build_model

    class StepEnds(TrainerCallback):
        """When training started and each step ended."""

        def __init__(self) -> None:
            self.clocks: list[tuple[float, float]] = []

        def on_train_begin(self, *_: Any, **__: Any) -> None:
            self.clocks.append(_clocks())

        def on_step_end(self, *_: Any, **__: Any) -> None:
            self.clocks.append(_clocks())

    AcceleratorState._reset_state(reset_partial_state=True)  # the previous run's accelerator, not this one's
    ends = StepEnds()
    training = TrainingArguments(output_dir=str(out), use_cpu=True, per_device_train_batch_size=args.global_batch // dp,
                                 max_steps=args.steps, learning_rate=1e-3, lr_scheduler_type="constant",
                                 optim="adamw_torch", logging_steps=1, report_to=[], save_strategy="no",
                                 disable_tqdm=True, seed=args.seed, train_sampling_strategy="sequential")
    trainer = SkrullTrainer(model=build_model("tiny", attn_implementation="sdpa", seed=args.seed), args=training,
                            train_dataset=Dataset.from_list(records),
                            data_collator=DataCollatorForLanguageModeling(pad_token_id=0), callbacks=[ends],
                            skrull=SkrullArguments(bucket_size=args.bucket_size, cp=cp, profile=PROFILE))
    trainer.train()
    trainer.skrull_batches.close()  # not Trainer.end: it would end the process group the next run needs
    return _differences(ends.clocks)


def _rounds(out: Path, args: argparse.Namespace, dp: int, cp: int) -> None:
    """Every round's runs of both paths on this rank; rank 0 writes their step times."""
    from trainer_client.distributed import ParallelDims, init_parallel

    # One thread per rank for both paths, as spawn_gloo sets it: where OMP_NUM_THREADS is unset, accelerate sets its
    # own count, the physical cores over the local world size (unset here: all the cores, for every rank).
    os.environ["OMP_NUM_THREADS"] = "1"

    parallel = init_parallel(ParallelDims(dp_size=dp, cp_size=cp))
    records = _records(args)
    data = out / f"batches-{dist.get_rank()}.jsonl"  # the same records, for the bundled trainer, in file order
    data.write_text("".join(json.dumps(record) + "\n" for record in records))
    runs: dict[str, list[list[tuple[float, float]]]] = {"bundled": [], "trainer": []}
    for round_index in range(args.rounds):
        order = ("bundled", "trainer") if round_index % 2 == 0 else ("trainer", "bundled")
        for path in order:
            dist.barrier()
            steps = (_bundled_steps(args, dp, cp, parallel, data) if path == "bundled"
                     else _trainer_steps(args, dp, cp, records, out / f"run-{round_index}"))
            runs[path].append(steps)
    if dist.get_rank() == 0:
        (out / "steps.json").write_text(json.dumps(runs))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--layouts", default="1x2,2x1", help="DP×CP layouts, comma-separated")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=8, help="steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="steps of each run left out")
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument("--bucket-size", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="write every step time here (JSON)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    table, everything = [], {}
    for layout in args.layouts.split(","):
        dp, cp = (int(part) for part in layout.split("x"))
        if args.global_batch % dp:
            raise SystemExit(f"--global-batch {args.global_batch} is not a multiple of dp {dp}: the Trainer's batch is "
                             "per_device_train_batch_size × dp")
        with tempfile.TemporaryDirectory() as folder:
            spawn_gloo(_rounds, dp * cp, Path(folder), args, dp, cp)
            runs = json.loads((Path(folder) / "steps.json").read_text())
        everything[layout] = runs
        row = [f"DP {dp} × CP {cp}"]
        for clock in (0, 1):  # wall, CPU
            medians = {path: statistics.median(step[clock] for run in path_runs for step in run[args.warmup:])
                       for path, path_runs in runs.items()}
            row += [f"{medians['bundled'] * 1e3:,.1f}", f"{medians['trainer'] * 1e3:,.1f}",
                    f"{medians['trainer'] / medians['bundled']:.3f}"]
        table.append(f"| {' | '.join(row)} |")
    print(f"median step time, ms, global rank 0 ({args.rounds} interleaved rounds × {args.steps - args.warmup} steps "
          f"each path; global batch {args.global_batch}, max length {args.max_length}, BucketSize {args.bucket_size})")
    print("| layout | wall: bundled trainer | wall: SkrullTrainer | wall: Trainer / bundled | CPU: bundled trainer "
          "| CPU: SkrullTrainer | CPU: Trainer / bundled |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(table))
    if args.out is not None:
        args.out.write_text(json.dumps({"arguments": {key: str(value) for key, value in vars(args).items()},
                                        "steps_s": everything}, indent=1))


if __name__ == "__main__":
    main()
