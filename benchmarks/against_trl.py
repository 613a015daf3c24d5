"""TRL's own batching against Skrull's plans on one SFT script (``make bench-trl``): tokens per second and loss.

One script, ``examples/trl_sft.py``'s ``SFTConfig`` (``assistant_only_loss``, ``max_length``, the learning rate
2e-5 decaying linearly, SFTConfig's defaults otherwise, gradient checkpointing among them), run as:

* ``TRL padding``: ``SFTTrainer`` as the example runs it: each forward pads ``per_device_train_batch_size`` chats to
  the longest;
* ``TRL padding_free``: ``padding_free=True``: a forward's chats flattened into one row, the position ids starting
  again at each chat; ``max_length=None``, since TRL 1.16 refuses padding-free without packing while ``max_length``
  would go unenforced (no chat here is longer);
* ``TRL packing (bfd)``: ``packing=True`` with the best-fit-decreasing packer: the data set packed into rows of at
  most ``max_length`` tokens before training; ``per_device_train_batch_size`` rows, as few as cover the packed set
  in the same number of steps. Whether documents attend across each other: TRL 1.16's ``bfd`` resets the position
  ids at each document and collates padding-free, without an attention mask, and transformers 5.23 builds a
  block-diagonal mask from such position ids for SDPA and eager attention (``masking_utils.
  find_packed_sequence_indices``; flash-attn's varlen kernel takes the boundaries, ``cu_seq_lens``), so they do not;
  TRL's ``wrapped`` strategy, which cuts documents, and packing without position ids would;
* ``TRL batch_rebalance``: padding, with ``train_sampling_strategy="batch_rebalance"``, transformers' sampler that
  balances each optimizer step's lengths over the ranks and micro-batches (#47340);
* ``Skrull DP d × CP c``: ``SkrullSFTTrainer`` (the example's three changed lines) at every split of the processes,
  with ``SkrullArguments.batch_per_process`` so that the same ``SFTConfig`` gives the same global batch at every CP
  degree.

The same for every run: the model (random init, seed 0), the chats and their order, the global batch of every
optimizer step (``per_device_train_batch_size × gradient_accumulation_steps × processes`` chats), the steps, the
learning-rate schedule; fp32 on the CPU, bf16 autocast on a GPU. TRL padding, padding_free and Skrull train the same
chats in every step, and the Trainer divides every step's summed token loss by the loss tokens of the whole global
batch (``average_tokens_across_devices``), as Skrull does: their losses agree step for step up to the order of
floating-point sums. ``bfd`` and ``batch_rebalance`` train other chats in a step (the packer and the sampler reorder
them), so their losses are another trajectory's, not a check.

The chats: a system prompt, a question and an answer, whose lengths in tokens are drawn from the LMSys-shaped sampler
the demo draws from (``synthetic:lmsys``, a long tail, cut at ``--max-length``), written in the words of the
project's small chat tokenizer (``trainer_client.chat_tokenizer``) with Qwen2.5's chat template, which TRL turns into
its training template for ``assistant_only_loss``. Nothing is downloaded.

Measured, on global rank 0: each step's wall time, from the end of the previous step (the start of training, for the
first) to the end of this one (its data, forward and backward passes, gradient reduction, optimizer), the first
``--warmup`` steps of every run left out; each step's trained tokens, TRL's own ``num_tokens`` count (the tokens of
every rank's batches, padding left out; Skrull logs the same count); beside the wall time, the CPU time global rank
0's process spent over the step (all its threads), which other work on a shared machine disturbs less. Tokens per
second per process are a run's trained tokens over its time over the processes (the median over the rounds), and
the same per CPU second; the step time's median and its 10th-90th percentiles are over every kept step of every
round. Runs are interleaved: each of ``--rounds`` rounds runs every run once, starting one run later each round, so
that a machine that slows down slows all alike. Losses are the Trainer's logged ones (the global batch's mean token
loss), each step's relative difference from TRL padding's in the same round, the largest over the steps and rounds;
the exit status is ``EXIT_LOSSES_DIFFER`` where a Skrull run's is above ``--loss-tolerance``.

Peak memory: on a GPU, the allocator's peak (``torch.cuda.max_memory_allocated``) during each run, the largest over
ranks and rounds. A CPU has no such counter, and runs that share a process share its heap (glibc keeps freed memory
for every run, as ``init_parallel`` sets it for Skrull's: ``trainer_client.distributed.host_memory``); so after the
timed rounds, each run trains ``--memory-steps`` more steps with glibc's defaults back, its freed heap returned to
the system and the process's peak resident set reset (``/proc/self/clear_refs``) before it: its peak resident
memory above what the process held at its start, the largest over ranks.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import gc
import itertools
import json
import logging
import math
import os
import platform
import re
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence, Sized
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np

__all__ = ["EXIT_LOSSES_DIFFER", "Row", "Run", "RunResult", "format_table", "losses_verdict", "main", "make_chats",
           "runs_for", "summarize"]

LEARNING_RATE = 2e-5  # examples/trl_sft.py's
CPU_PROFILE = "cpu-tiny"  # measured with 2 ranks of the tiny model on CPU: what the planner prices here
# Skrull's losses against TRL padding's, step for step: fp32 on the CPU agrees to float rounding; bf16 autocast
# rounds each run's differently ordered sums to 8 bits of mantissa
LOSS_TOLERANCE = {"cpu": 1e-5, "cuda": 1e-2}
EXIT_LOSSES_DIFFER = 3  # everything ran, and a Skrull run's losses are further from TRL padding's (a crash exits 1)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
_GLIBC_DEFAULT_THRESHOLD = 128 * 1024  # both thresholds' defaults


@dataclass(frozen=True, kw_only=True, slots=True)
class Run:
    """One way to batch the same script: its name in the table and on the command line, the ``SFTConfig`` fields it
    changes, and Skrull's CP degree (None: TRL's ``SFTTrainer``)."""

    name: str
    key: str
    config: dict[str, Any] = dataclasses.field(default_factory=dict)
    skrull_cp: int | None = None
    same_chats: bool = True  # every step trains TRL padding's chats of that step

    @property
    def is_reference(self) -> bool:
        return self.key == "padding"


def runs_for(num_processes: int) -> list[Run]:
    """TRL's four ways to batch and Skrull at every DP × CP split of ``num_processes``."""
    return [Run(name="TRL padding", key="padding"),
            Run(name="TRL padding_free", key="padding_free", config={"padding_free": True, "max_length": None}),
            Run(name="TRL packing (bfd)", key="bfd", config={"packing": True, "packing_strategy": "bfd"},
                same_chats=False),
            Run(name="TRL batch_rebalance", key="batch_rebalance",
                config={"train_sampling_strategy": "batch_rebalance"}, same_chats=False),
            *(Run(name=f"Skrull DP {num_processes // cp} × CP {cp}", key=f"skrull-dp{num_processes // cp}-cp{cp}",
                  skrull_cp=cp)
              for cp in range(1, num_processes + 1) if num_processes % cp == 0)]


# ---------------------------------------------------------------------------------------------------- the chats


def make_chats(tokenizer: Any, *, num_chats: int, max_length: int, seed: int) -> tuple[list[dict[str, Any]], list[int]]:
    """``num_chats`` chats (a system prompt, a question, an answer) whose lengths in ``tokenizer``'s tokens under its
    chat template follow the LMSys-shaped sampler, none longer than ``max_length``; and those lengths."""
    from scheduler_service.core.samplers import sample_lengths
    from trainer_client.chat_tokenizer import WORDS

    rng = np.random.default_rng(seed)
    targets = sample_lengths("lmsys", num_chats, rng, max_length=max_length)
    sample = " ".join(rng.choice(WORDS, size=1000))
    tokens_per_word = len(tokenizer.encode(sample, add_special_tokens=False)) / 1000

    def length_of(messages: list[dict[str, str]]) -> int:
        return len(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"])

    chats, lengths = [], []
    for target in targets:
        num_words = max(int(target / tokens_per_word), 4)
        words = list(rng.choice(WORDS, size=num_words))
        split = max(num_words // 2, 1)
        messages = [{"role": "system", "content": " ".join(rng.choice(WORDS, size=3))},
                    {"role": "user", "content": " ".join(words[:split])},
                    {"role": "assistant", "content": " ".join(words[split:]) or "the"}]
        while (length := length_of(messages)) > max_length:  # the template's markers pushed it over: cut the answer
            answer = messages[2]["content"].split()
            keep = max(len(answer) - math.ceil((length - max_length) / tokens_per_word) - 1, 1)
            if keep == len(answer):
                raise ValueError(f"a chat of {length} tokens cannot be cut to --max-length {max_length}")
            messages[2]["content"] = " ".join(answer[:keep])
        chats.append({"messages": messages})
        lengths.append(length)
    return chats, lengths


def packed_rows(lengths: Sequence[int], max_length: int) -> int:
    """The rows TRL's ``bfd`` packer makes of sequences of ``lengths`` tokens, at most ``max_length`` a row."""
    from datasets import Dataset
    from trl.data_utils import pack_dataset

    packed = pack_dataset(Dataset.from_dict({"input_ids": [[0] * length for length in lengths]}), max_length, "bfd")
    return len(packed)


# ---------------------------------------------------------------------------------------------------- one run


@dataclass(frozen=True, kw_only=True, slots=True)
class RunResult:
    """One run on global rank 0: each step's wall time, its process's CPU time over the step, the step's trained
    tokens and logged loss; the run's peak memory (None where not measured)."""

    steps_s: list[float]
    steps_cpu_s: list[float]
    tokens: list[int]
    losses: list[float]
    peak_bytes: int | None = None


def _sft_config(args: argparse.Namespace, run: Run, *, num_processes: int, num_packed_rows: int, out: Path,
                max_steps: int) -> Any:
    from trl import SFTConfig

    per_device, accumulation = args.per_device_batch, args.global_batch // (args.per_device_batch * num_processes)
    if run.key == "bfd":  # as few rows a forward as cover the packed set in the run's steps
        per_device, accumulation = math.ceil(num_packed_rows / (args.steps * num_processes)), 1
    settings: dict[str, Any] = {
        # examples/trl_sft.py's
        "output_dir": str(out), "per_device_train_batch_size": per_device, "gradient_accumulation_steps": accumulation,
        "max_steps": max_steps, "max_length": args.max_length, "assistant_only_loss": True,
        "learning_rate": LEARNING_RATE, "logging_steps": 1, "report_to": [], "save_strategy": "no",
        "use_cpu": args.device == "cpu",
        # the benchmark's: fp32 on the CPU, the chats in file order, no progress bar, no log lines but errors
        "bf16": args.device == "cuda", "seed": args.seed, "train_sampling_strategy": "sequential",
        "disable_tqdm": True, "log_level": "error", "log_level_replica": "error", **run.config}
    return SFTConfig(**settings)


def _train(run: Run, args: argparse.Namespace, *, chats: list[dict[str, Any]], tokenizer_dir: Path,
           num_packed_rows: int, out: Path, max_steps: int) -> RunResult:
    """Train ``run`` for ``max_steps`` steps on this rank; every rank calls it."""
    import torch
    import torch.distributed as dist
    from accelerate.state import AcceleratorState
    from datasets import Dataset
    from transformers import AutoTokenizer, PrinterCallback, TrainerCallback
    from trl import SFTTrainer

    from trainer_client.distributed import destroy_groups
    from trainer_client.hf import SkrullArguments, SkrullSFTTrainer
    from trainer_client.models.model import build_model

    class Clock(TrainerCallback):
        """When training started and each step ended; what each step logged."""

        def __init__(self) -> None:
            self.clocks: list[tuple[float, float]] = []  # wall, this process's CPU time (all its threads)
            self.logs: list[dict[str, float]] = []

        def on_train_begin(self, *_: Any, **__: Any) -> None:
            self.clocks.append((time.perf_counter(), time.process_time()))

        def on_step_end(self, *_: Any, **__: Any) -> None:
            self.clocks.append((time.perf_counter(), time.process_time()))

        def on_log(self, *_: Any, logs: dict[str, float] | None = None, **__: Any) -> None:
            if logs and "loss" in logs:
                self.logs.append(dict(logs))

    clock = Clock()

    AcceleratorState._reset_state(reset_partial_state=True)  # the previous run's accelerator, not this one's
    num_processes = dist.get_world_size()
    config = _sft_config(args, run, num_processes=num_processes, num_packed_rows=num_packed_rows, out=out,
                         max_steps=max_steps)
    model = build_model(args.model, attn_implementation="sdpa", seed=args.seed)
    model.name_or_path = args.model  # as from_pretrained names a checkpoint: a measured profile is for this model
    common = {"model": model, "args": config,
              "train_dataset": Dataset.from_list(chats), "callbacks": [clock],
              "processing_class": AutoTokenizer.from_pretrained(tokenizer_dir)}
    skrull = None
    if run.skrull_cp is not None:
        skrull = SkrullSFTTrainer(**common, skrull=SkrullArguments(
            bucket_size=args.bucket_size, cp=run.skrull_cp, profile=args.profile, batch_per_process=True))
    trainer = skrull or SFTTrainer(**common)
    trainer.remove_callback(PrinterCallback)
    num_rows = len(cast(Sized, trainer.train_dataset))
    if run.key == "bfd" and num_rows != num_packed_rows:
        raise RuntimeError(f"TRL packed the chats into {num_rows} rows, the benchmark expected {num_packed_rows}: its "
                           f"per_device_train_batch_size would not cover them in {args.steps} steps")
    cuda = torch.device(args.device).type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    peak_bytes = int(torch.cuda.max_memory_allocated()) if cuda else None
    if skrull is not None:  # not Trainer.end: it would end the process group the next run needs
        skrull.skrull_batches.close()
        destroy_groups(skrull.parallel)
    tokens_seen = [0, *(int(logs["num_tokens"]) for logs in clock.logs)]
    return RunResult(steps_s=[end[0] - start[0] for start, end in itertools.pairwise(clock.clocks)],
                     steps_cpu_s=[end[1] - start[1] for start, end in itertools.pairwise(clock.clocks)],
                     tokens=[after - before for before, after in itertools.pairwise(tokens_seen)],
                     losses=[float(logs["loss"]) for logs in clock.logs], peak_bytes=peak_bytes)


# ---------------------------------------------------------------------------------------------------- the ranks


def _status_bytes(field: str) -> int:
    """A size from ``/proc/self/status`` (``VmRSS``, ``VmHWM``), in bytes."""
    match = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.MULTILINE)
    assert match is not None, field
    return int(match.group(1)) * 1024


def _reset_host_peak() -> int:
    """glibc's default thresholds back, its freed heap returned to the system, the peak resident set reset to the
    current one; that resident set, in bytes."""
    gc.collect()
    libc = ctypes.CDLL(None)
    libc.mallopt(_M_MMAP_THRESHOLD, _GLIBC_DEFAULT_THRESHOLD)
    libc.mallopt(_M_TRIM_THRESHOLD, _GLIBC_DEFAULT_THRESHOLD)
    libc.malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")  # Linux: resets VmHWM to VmRSS
    return _status_bytes("VmRSS")


def host_peak_measurable() -> bool:
    """Whether this machine has what the CPU memory pass needs: Linux's ``clear_refs`` and glibc's ``mallopt``."""
    return (platform.system() == "Linux" and Path("/proc/self/clear_refs").exists()
            and platform.libc_ver()[0] == "glibc")


def _rank(out: Path, args: argparse.Namespace, runs: list[Run], chats: list[dict[str, Any]], tokenizer_dir: Path,
          num_packed_rows: int) -> None:
    """Every round's runs on this rank, then the CPU memory pass; global rank 0 writes ``results.json``."""
    import datasets
    import torch.distributed as dist
    import transformers

    from trainer_client.distributed import max_over_ranks
    from trainer_client.distributed.host_memory import retain_freed_memory

    os.environ["OMP_NUM_THREADS"] = "1"  # accelerate sets its own count where it is unset (see benchmarks.hf_trainer)
    transformers.logging.set_verbosity_error()
    datasets.disable_progress_bars()  # TRL's tokenizing and truncating, every run
    logging.getLogger("trainer_client.hf").setLevel(logging.ERROR)  # Skrull's start-up line, once a run
    # TRL 1.16's SFTConfig defaults the name transformers 5.23 deprecated (gradient_checkpointing=True), every run
    warnings.filterwarnings("ignore", "`gradient_checkpointing` is deprecated", FutureWarning)
    if args.device == "cpu":
        retain_freed_memory()  # every run alike, not only those after Skrull's first init_parallel
    results: dict[str, list[dict[str, Any]]] = {run.key: [] for run in runs}
    for round_index in range(args.rounds):
        start = round_index % len(runs)
        for run in [*runs[start:], *runs[:start]]:
            dist.barrier()
            result = _train(run, args, chats=chats, tokenizer_dir=tokenizer_dir, num_packed_rows=num_packed_rows,
                            out=out / f"run-{round_index}-{run.key}", max_steps=args.steps)
            if result.peak_bytes is not None:
                result = dataclasses.replace(result, peak_bytes=int(max_over_ranks(result.peak_bytes, _device(args))))
            results[run.key].append(dataclasses.asdict(result))
    memory: dict[str, int] = {}
    if args.device == "cpu" and args.memory_steps > 0 and host_peak_measurable():
        for run in runs:
            dist.barrier()
            baseline = _reset_host_peak()
            _train(run, args, chats=chats, tokenizer_dir=tokenizer_dir, num_packed_rows=num_packed_rows,
                   out=out / f"memory-{run.key}", max_steps=args.memory_steps)
            memory[run.key] = int(max_over_ranks(_status_bytes("VmHWM") - baseline, _device(args)))
    if dist.get_rank() == 0:
        (out / "results.json").write_text(json.dumps({"runs": results, "memory_bytes": memory}))


def _device(args: argparse.Namespace) -> Any:
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")


# ---------------------------------------------------------------------------------------------------- the table


@dataclass(frozen=True, kw_only=True, slots=True)
class Row:
    """One run's line of the table."""

    name: str
    tokens_per_s_per_process: float
    speedup: float  # over TRL padding's tokens per second
    cpu_speedup: float  # over TRL padding's tokens per CPU second of global rank 0's process
    step_s_median: float
    step_s_p10: float
    step_s_p90: float
    peak_bytes: int | None
    max_relative_loss_difference: float | None  # None: TRL padding itself
    same_chats: bool
    is_skrull: bool


def summarize(runs: Sequence[Run], results: dict[str, list[dict[str, Any]]], memory_bytes: dict[str, int], *,
              warmup: int, num_processes: int) -> list[Row]:
    """The table's rows from every round's results of every run (``results[run.key][round]``: a ``RunResult`` as a
    dict); the reference is TRL padding's run of the same round."""
    reference = next(run for run in runs if run.is_reference)

    def throughput(result: dict[str, Any], clock: str = "steps_s") -> float:
        return sum(result["tokens"][warmup:]) / sum(result[clock][warmup:]) / num_processes

    padding_rate = statistics.median(throughput(result) for result in results[reference.key])
    padding_cpu_rate = statistics.median(throughput(result, "steps_cpu_s") for result in results[reference.key])
    rows = []
    for run in runs:
        rounds = results[run.key]
        steps = sorted(step for result in rounds for step in result["steps_s"][warmup:])
        deciles = statistics.quantiles(steps, n=10, method="inclusive") if len(steps) > 1 else [steps[0]] * 9
        differences = [abs(loss - base) / abs(base)
                       for result, base_result in zip(rounds, results[reference.key], strict=True)
                       for loss, base in zip(result["losses"], base_result["losses"], strict=True)]
        peaks = [result["peak_bytes"] for result in rounds if result["peak_bytes"] is not None]
        rate = statistics.median(throughput(result) for result in rounds)
        cpu_rate = statistics.median(throughput(result, "steps_cpu_s") for result in rounds)
        rows.append(Row(name=run.name, tokens_per_s_per_process=rate, speedup=rate / padding_rate,
                        cpu_speedup=cpu_rate / padding_cpu_rate, step_s_median=statistics.median(steps),
                        step_s_p10=deciles[0], step_s_p90=deciles[-1],
                        peak_bytes=max(peaks) if peaks else memory_bytes.get(run.key),
                        max_relative_loss_difference=None if run.is_reference else max(differences),
                        same_chats=run.same_chats, is_skrull=run.skrull_cp is not None))
    return rows


def losses_verdict(rows: Sequence[Row], *, tolerance: float) -> tuple[bool, str]:
    """Whether every Skrull run's losses are within ``tolerance`` (relative) of TRL padding's at every step, and the
    line that says so."""
    apart = [row for row in rows if row.is_skrull and (row.max_relative_loss_difference or 0.0) > tolerance]
    if not apart:
        return True, f"every Skrull run's losses within {tolerance:.0e} of TRL padding's, at every step"
    return False, (f"losses further than {tolerance:.0e} from TRL padding's: "
                   + ", ".join(f"{row.name} {row.max_relative_loss_difference:.1e}" for row in apart))


def format_table(rows: Sequence[Row], *, memory: str) -> str:
    """The rows as a Markdown table; ``memory`` says what its memory column measured."""
    lines = [f"| run | tokens/s per process | vs TRL padding | step time, median (p10–p90) | tokens per CPU second: "
             f"vs TRL padding | {memory} | losses vs TRL padding (largest relative difference per step) |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        peak = f"{row.peak_bytes / 2**20:,.0f} MiB" if row.peak_bytes is not None else "n/a"
        if row.max_relative_loss_difference is None:
            loss = "(the reference)"
        elif row.same_chats:
            loss = f"{row.max_relative_loss_difference:.1e}"
        else:
            loss = f"{row.max_relative_loss_difference:.1e} (other chats per step)"
        lines.append(f"| {row.name} | {row.tokens_per_s_per_process:,.0f} | {row.speedup:.2f}x | "
                     f"{row.step_s_median * 1e3:,.0f} ms ({row.step_s_p10 * 1e3:,.0f}–{row.step_s_p90 * 1e3:,.0f}) | "
                     f"{row.cpu_speedup:.2f}x | "
                     f"{peak} | {loss} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cpu: gloo processes, fp32; cuda: one process per GPU, bf16 autocast")
    parser.add_argument("--processes", type=int, help="processes (default: 2 on the CPU, every GPU on cuda)")
    parser.add_argument("--model", default="tiny", help="a catalogue model (random init) or a local checkpoint")
    parser.add_argument("--global-batch", type=int, default=16, help="chats per optimizer step")
    parser.add_argument("--per-device-batch", type=int, default=4, help="per_device_train_batch_size")
    parser.add_argument("--max-length", type=int, default=1024, help="SFTConfig.max_length; no chat is longer")
    parser.add_argument("--bucket-size", type=int, help="SkrullArguments.bucket_size (default: --max-length)")
    parser.add_argument("--profile", help=f"the planner's profile (default: {CPU_PROFILE} on the CPU, the planner's "
                                          "own on cuda)")
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="steps of each run left out of the times")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--memory-steps", type=int, default=2,
                        help="CPU: steps of each run's memory pass after the rounds (0: none)")
    parser.add_argument("--runs", help="run keys, comma-separated (default: all; padding is always run)")
    parser.add_argument("--loss-tolerance", type=float,
                        help="Skrull's losses against TRL padding's, relative, at every step (default: "
                             + ", ".join(f"{value:.0e} on {device}" for device, value in LOSS_TOLERANCE.items())
                             + f"); beyond it the exit status is {EXIT_LOSSES_DIFFER}")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="write every step's time, tokens and loss here (JSON)")
    args = parser.parse_args(argv)
    if args.bucket_size is None:
        args.bucket_size = args.max_length
    if args.profile is None and args.device == "cpu":
        args.profile = CPU_PROFILE
    if args.loss_tolerance is None:
        args.loss_tolerance = LOSS_TOLERANCE[args.device]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    import datasets
    import torch
    from transformers import AutoTokenizer
    from trl.chat_template_utils import qwen2_5_chat_template

    from trainer_client.chat_tokenizer import builtin_corpus, train_chat_tokenizer
    from trainer_client.distributed import spawn_ranks

    args = parse_args(argv)
    datasets.disable_progress_bars()  # TRL's packer, here and in every run
    num_processes = args.processes or (2 if args.device == "cpu" else torch.cuda.device_count())
    if args.global_batch % (args.per_device_batch * num_processes):
        raise SystemExit(f"--global-batch {args.global_batch} is not a multiple of --per-device-batch "
                         f"{args.per_device_batch} × {num_processes} processes: the Trainer's global batch is "
                         "per_device_train_batch_size × gradient_accumulation_steps × processes")
    if args.warmup >= args.steps:
        raise SystemExit(f"--warmup {args.warmup} leaves none of --steps {args.steps}")
    runs = runs_for(num_processes)
    if args.runs is not None:
        keys = {"padding", *args.runs.split(",")}
        unknown = keys - {run.key for run in runs}
        if unknown:
            raise SystemExit(f"--runs {', '.join(sorted(unknown))}: unknown; known: "
                             f"{', '.join(run.key for run in runs)}")
        runs = [run for run in runs if run.key in keys]
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder)
        trained = train_chat_tokenizer(builtin_corpus())
        trained.chat_template = qwen2_5_chat_template  # the example's model's; TRL makes a training template of it
        trained.save_pretrained(out / "tokenizer")
        chats, lengths = make_chats(AutoTokenizer.from_pretrained(out / "tokenizer"),
                                    num_chats=args.steps * args.global_batch, max_length=args.max_length,
                                    seed=args.seed)
        num_packed_rows = packed_rows(lengths, args.max_length)
        started = time.perf_counter()
        spawn_ranks(_rank, num_processes, out, args, runs, chats, out / "tokenizer", num_packed_rows,
                    device_type=args.device)
        wall_s = time.perf_counter() - started
        results = json.loads((out / "results.json").read_text())
    rows = summarize(runs, results["runs"], results["memory_bytes"], warmup=args.warmup, num_processes=num_processes)
    memory = ("peak GPU memory (allocated)" if args.device == "cuda"
              else "peak memory (resident, above the run's start)" if results["memory_bytes"] else "peak memory")
    print(f"{args.model} on {num_processes} {args.device} processes; {len(chats)} chats of {min(lengths)}-"
          f"{max(lengths)} tokens (median {statistics.median(lengths):.0f}; bfd packs them into {num_packed_rows} "
          f"rows of at most {args.max_length}); global batch {args.global_batch} chats "
          f"(per_device_train_batch_size {args.per_device_batch}), {args.steps} steps a run, the first "
          f"{args.warmup} left out; {args.rounds} interleaved rounds; Skrull's BucketSize {args.bucket_size}, "
          f"profile {args.profile or 'the default'}; {wall_s:.0f} s")
    print(format_table(rows, memory=memory))
    agree, verdict = losses_verdict(rows, tolerance=args.loss_tolerance)
    print(verdict)
    if args.out is not None:
        args.out.write_text(json.dumps({"arguments": {key: str(value) for key, value in vars(args).items()},
                                        "chat_lengths": lengths, "packed_rows": num_packed_rows,
                                        "rows": [dataclasses.asdict(row) for row in rows], "losses_agree": agree,
                                        **results}, indent=1))
    return 0 if agree else EXIT_LOSSES_DIFFER


if __name__ == "__main__":
    sys.exit(main())
