"""``skrull-advise`` (``python -m trainer_client.advise``): the layout of N GPUs that trains a data set fastest.

It reads a sample of sequence lengths from ``--data`` (what the trainer's ``--data`` takes, plus a file of lengths
or a synthetic sample: ``advise.inputs``), prices every layout with the planning core (``core.advise``), prints
the ranked table with the reason the winner wins and the layouts left out, and writes the document
``POST /advise`` answers (``--json``, validated by the service's model), the winner's trainer config file
(``--emit-config``, validated by the trainer's ``TrainConfig``; refused for a file of lengths, which the trainer
cannot train on) and a chart of throughput per layout, Skrull against static CP (``--plot``). The words, the
commands and the document are the service's (``scheduler_service.contract.advice``). A sequence longer than a
layout trains (or than ``--max-length``) is left out or, with ``--truncate``, cut, as the trainer treats records;
each layout says how many and what share of the tokens, so outliers no layout holds do not stop the advice.

It is the trainer's command, not the service's, because reading a data set or a checkpoint is the trainer's
work; torch is needed only for those (records, checkpoint folders).

Bad input exits with status 2 and one line naming the field or flag and the limit.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from skrull_proto.advise import AdviceDocument
from tqdm import tqdm

from scheduler_service.contract.advice import (
    DEFAULT_GLOBAL_BATCH,
    DTYPE_BYTES,
    TrainerSources,
    advice_document,
    global_batch_size,
    shell_command,
    trainer_argv,
    trainer_launcher,
    trainer_settings,
    why,
)
from scheduler_service.core.advise import Advice, Exclusion, LayoutProblem, advise
from scheduler_service.core.errors import PlanningError
from scheduler_service.core.memory import ActivationCheckpointing, Sharding
from scheduler_service.core.models import MODEL_CATALOGUE
from scheduler_service.core.samplers import DATASETS
from trainer_client.advise.inputs import is_lengths_file, read_lengths, read_model, read_profile

if TYPE_CHECKING:
    from matplotlib.axes import Axes

__all__ = ["build_parser", "config_command", "format_advice", "main", "plot_advice", "run", "write_config",
           "write_document"]

EXIT_BAD_INPUT = 2
DEFAULT_SAMPLE_SIZE = 20_000


class _DefaultsHelp(argparse.HelpFormatter):
    """Each flag's default after its help, where it has one and its help does not already say it: argparse's own
    ``ArgumentDefaultsHelpFormatter`` prints "(default: None)" after flags without one and a second default after
    flags that name theirs."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (not action.option_strings or "default" in text
                or action.default is None or action.default is argparse.SUPPRESS or action.default is False):
            return text
        return f"{text} (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="skrull-advise", description="The layout of N GPUs that trains a data set "
                                                                       "fastest.", formatter_class=_DefaultsHelp)
    parser.add_argument("--data", required=True, metavar="SOURCE",
                        help=f"synthetic:{{{','.join(DATASETS)}}}, records as the trainer's --data takes them (a "
                             "JSONL, parquet, CSV or JSON file, a dataset folder, a Hugging Face Hub dataset "
                             "ORG/NAME[@REVISION][:SPLIT]), or a file of lengths (one integer per line)")
    parser.add_argument("--model", required=True, metavar="NAME_OR_DIR",
                        help=f"a built-in model ({', '.join(MODEL_CATALOGUE)}), a local HF checkpoint directory or "
                             "a Hugging Face Hub id ORG/NAME[@REVISION]")
    parser.add_argument("--gpus", type=int, required=True, help="GPUs to lay out as dp × cp")
    parser.add_argument("--gpus-per-node", type=int, default=8,
                        help="GPUs per node: CP blocks larger than a node pay inter-node collectives")
    batch = parser.add_mutually_exclusive_group()
    batch.add_argument("--global-batch", type=int, metavar="SEQUENCES",
                       help=f"sequences per optimizer step (default {DEFAULT_GLOBAL_BATCH})")
    batch.add_argument("--tokens-per-step", type=int, help="a token budget per optimizer step instead")
    parser.add_argument("--profile", help="a profile name, or a profile file from python -m trainer_client.profile "
                                          "(default: the planner's)")
    parser.add_argument("--sharding", nargs="+", choices=[mode.value for mode in Sharding],
                        help="sharding modes to consider (default: all)")
    parser.add_argument("--activation-checkpointing", nargs="+", choices=[mode.value for mode in
                                                                          ActivationCheckpointing],
                        help="checkpointing modes to consider (default: the profile's)")
    parser.add_argument("--cp-sizes", nargs="+", type=int, help="CP degrees to consider (default: every power of two "
                                                                "dividing --gpus)")
    parser.add_argument("--num-batches", type=int, default=8, help="global batches drawn to price each layout on")
    parser.add_argument("--seed", type=int, default=0, help="seeds the sample and the batches")
    parser.add_argument("--sample-size", type=int, default=DEFAULT_SAMPLE_SIZE,
                        help="lengths drawn from a synthetic source; most records read from a larger data set")
    parser.add_argument("--tokenizer", help="a local tokenizer directory or a Hugging Face Hub id (for messages and "
                                            "text records)")
    parser.add_argument("--dtype", choices=list(DTYPE_BYTES), default="bfloat16",
                        help="the dtype the trainer computes in (float32 on CPU)")
    parser.add_argument("--max-length", type=int, metavar="TOKENS",
                        help="the trainer's --max-length: the longest sequence trained whole; a longer one is left "
                             "out (default: each layout's longest trainable sequence)")
    parser.add_argument("--truncate", action="store_true",
                        help="the trainer's --truncate: cut sequences longer than a layout trains instead of leaving "
                             "them out")
    parser.add_argument("--json", type=Path, metavar="FILE", help="write the advice document here")
    parser.add_argument("--emit-config", type=Path, metavar="FILE.yaml",
                        help="write the winner's trainer settings here, a config file for python -m "
                             "trainer_client.train --config (the command line printed, as a file; --data must be "
                             "records, not a file of lengths)")
    parser.add_argument("--plot", type=Path, metavar="FILE.png", help="draw throughput per layout here")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


# ---- output ----------------------------------------------------------------------------------------------------------


def format_advice(advice: Advice, sources: TrainerSources, *, config_file: Path | None = None,
                  lengths_file: bool = False) -> str:
    """The ranked layouts, why the winner wins, the layouts left out and the winner's command, and the command
    that trains from ``config_file`` when the winner's settings are written there. With ``lengths_file`` (the
    sample was a file of lengths) the command says that its ``--data`` needs the records instead. The ``spanning``
    column counts the batches whose plans span DP replicas (``no``: the layout's cannot); a ``left out`` (or, with
    ``--truncate``, ``cut``) column appears when the ranked layouts lose sequences of the sample."""
    problem = advice.problem
    too_long = "seqs cut" if problem.truncate else "seqs left out"
    with_too_long = any(priced.num_sequences_too_long for priced in advice.layouts)
    lines = [f"{problem.model.name} on {problem.num_gpus} GPUs ({problem.gpus_per_node} per node), profile "
             f"{problem.profile.name}: {problem.num_batches} global batches of {advice.mean_sequences_per_batch:.0f} "
             f"sequences ({advice.mean_tokens_per_batch:,.0f} tokens) drawn from {problem.lengths.size:,} "
             f"(longest {int(problem.lengths.max()):,})",
             f"{'#':>2} {'dp × cp':>8} {'sharding':>8} {'ckpt':>9} {'bucket':>7} {'step ms':>9} {'p10-p90 ms':>15} "
             f"{'tok/s/GPU':>10} {'vs static CP':>12} {'headroom':>8} {'sharded':>7} {'nodes':>5} {'spanning':>8}"
             + (f" {too_long:>14}" if with_too_long else "")]
    for rank, priced in enumerate(advice.layouts, start=1):
        layout, spread = priced.layout, priced.step_time_spread
        spanning = f"{priced.num_batches_spanning}/{problem.num_batches}" if layout.spanning else "no"
        lines.append(
            f"{rank:>2} {f'{layout.dp_size} × {layout.cp_size}':>8} {layout.sharding.value:>8} "
            f"{layout.activation_checkpointing.value:>9} {layout.bucket_size:>7} "
            f"{priced.predicted_step_time_s * 1e3:>9.1f} "
            f"{f'{spread.p10_s * 1e3:.0f}-{spread.p90_s * 1e3:.0f}':>15} {priced.tokens_per_s_per_gpu:>10,.0f} "
            f"{f'{priced.speedup_vs_static_cp:.2f}x':>12} {priced.memory_headroom_fraction:>8.1%} "
            f"{priced.sharded_share:>7.0%} {'spans' if layout.spans_nodes else 'one':>5} {spanning:>8}"
            + (f" {f'{priced.num_sequences_too_long} ({priced.too_long_token_share:.2%})':>14}" if with_too_long
               else ""))
    lines += ["", f"why: {why(advice)}"]
    if advice.excluded:
        lines += ["", "left out:", *_excluded_lines(advice)]
    winner = advice.layouts[0]
    if winner.num_sequences_too_long and not problem.truncate:
        lines += ["", f"the trainer refuses a record longer than --max-length "
                      f"{problem.sequence_limit(winner.layout)} (synthetic data is drawn cut to it): leave the "
                      f"{winner.num_sequences_too_long} longer sequence(s) out of --data, or add --truncate to cut "
                      "them"]
    winner_command = shell_command(trainer_argv(advice, winner.layout, sources))
    lines += ["", "train with the winner (with the records these lengths were measured from as --data: the trainer "
                  "cannot train on a file of lengths):" if lengths_file else "train with the winner:",
              f"  {winner_command}"]
    if config_file is not None:
        lines += [f"or with its config file {config_file}:", f"  {config_command(advice, config_file)}"]
    return "\n".join(lines)


def config_command(advice: Advice, config_file: Path) -> str:
    """The winner's command line that reads its settings from ``config_file``."""
    return shell_command((*trainer_launcher(advice.problem), "--config", str(config_file)))


def _excluded_lines(advice: Advice) -> list[str]:
    """One line per excluded layout; the layouts of one mode that the model does not fit at all share one."""
    lines: list[str] = []
    no_memory: dict[tuple[Sharding, ActivationCheckpointing], tuple[list[str], str]] = {}
    for item in advice.excluded:
        layout = item.layout
        if item.exclusion is Exclusion.NO_MEMORY:
            key = (layout.sharding, layout.activation_checkpointing)
            no_memory.setdefault(key, ([], item.reason))[0].append(f"{layout.dp_size} × {layout.cp_size}")
        else:
            lines.append(f"  {layout.label}: {item.reason}")
    for (sharding, checkpointing), (splits, reason) in no_memory.items():
        lines.insert(0, f"  dp × cp {', '.join(splits)} ({sharding}, activation checkpointing {checkpointing}): "
                        f"{reason}")
    return lines


def write_document(advice: Advice, sources: TrainerSources, path: Path) -> None:
    """The advice document, validated by the model the service answers with (``AdviceDocument``) before it is
    written, so a file the service would refuse is never left behind; written as built (each layout's rank
    first)."""
    document = advice_document(advice, sources)
    AdviceDocument.model_validate(document)
    path.write_text(json.dumps(document, indent=2) + "\n")


def write_config(advice: Advice, sources: TrainerSources, path: Path) -> None:
    """The winner's trainer settings as a YAML config file, the values its printed command line gives as flags
    (``trainer_settings``). They are checked by the trainer's own ``TrainConfig`` before the file is written, so
    that a file the trainer would refuse is never left behind; that import brings torch, as only this output
    needs."""
    import yaml

    from trainer_client.config import TrainConfig

    winner = advice.layouts[0]
    settings = trainer_settings(advice, winner.layout, sources)
    TrainConfig(**settings)
    header = (f"# skrull-advise's winner: {winner.layout.label}, {winner.tokens_per_s_per_gpu:,.0f} tokens/s per GPU "
              f"predicted\n# {config_command(advice, path)}\n")
    path.write_text(header + yaml.safe_dump(settings, sort_keys=False))


def plot_advice(advice: Advice, path: Path) -> None:
    """Tokens/s per GPU per layout, Skrull beside static CP on the same layout, best first."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layouts = advice.layouts
    figure, axis = plt.subplots(figsize=(max(6.0, 0.9 * len(layouts) + 2), 4.5))
    _draw_throughput(axis, advice)
    axis.set_title(f"{advice.problem.model.name} on {advice.problem.num_gpus} GPUs: predicted throughput per layout")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def _draw_throughput(axis: Axes, advice: Advice) -> None:
    positions = np.arange(len(advice.layouts))
    skrull = [priced.tokens_per_s_per_gpu for priced in advice.layouts]
    static_cp = [priced.tokens_per_s_per_gpu / priced.speedup_vs_static_cp for priced in advice.layouts]
    axis.bar(positions - 0.2, skrull, width=0.4, label="skrull", color="C0")
    axis.bar(positions + 0.2, static_cp, width=0.4, label="static CP (deepspeed)", color="0.6")
    labels = [f"{p.layout.dp_size}×{p.layout.cp_size}\n{p.layout.sharding.value}"
              + ("\n(spans nodes)" if p.layout.spans_nodes else "") for p in advice.layouts]
    axis.set_xticks(positions, labels, fontsize="small")
    axis.set_ylabel("tokens/s per GPU (predicted)")
    axis.set_ylim(0, 1.25 * max(skrull))  # room for the legend above the bars
    axis.legend(loc="upper right")


# ---- running ---------------------------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    lengths_file = is_lengths_file(args.data)
    if lengths_file and args.emit_config is not None:  # a config file must train as written
        raise ValueError(f"--emit-config {args.emit_config}: --data {args.data} is a file of sequence lengths, which "
                         "the advisor reads but the trainer cannot train on; give --data the records they were "
                         "measured from (anything the trainer's --data takes) to write a config file that trains")
    lengths = read_lengths(args.data, sample_size=args.sample_size, seed=args.seed, tokenizer=args.tokenizer)
    problem = LayoutProblem(
        sequence_lengths=lengths, model=read_model(args.model), profile=read_profile(args.profile),
        num_gpus=args.gpus, gpus_per_node=args.gpus_per_node,
        global_batch=global_batch_size(sequences=args.global_batch, tokens=args.tokens_per_step),
        shardings=tuple(Sharding(mode) for mode in args.sharding or Sharding),
        activation_checkpointing=tuple(ActivationCheckpointing(mode) for mode in args.activation_checkpointing or ()),
        cp_sizes=tuple(args.cp_sizes or ()), num_batches=args.num_batches, seed=args.seed,
        compute_bytes=DTYPE_BYTES[args.dtype], max_length=args.max_length, truncate=args.truncate,
    )
    sources = TrainerSources(data=args.data, tokenizer=args.tokenizer, model=args.model, profile=args.profile)
    with tqdm(total=problem.num_layouts, desc="pricing layouts", unit="layout", disable=args.no_progress,
              file=sys.stderr) as bar:
        def progress(done: int, total: int) -> None:
            bar.total = total
            bar.update(done - bar.n)

        advice = advise(problem, progress=progress)
    if args.emit_config is not None:  # before the text that names it
        write_config(advice, sources, args.emit_config)
    print(format_advice(advice, sources, config_file=args.emit_config, lengths_file=lengths_file))
    if args.json is not None:
        write_document(advice, sources, args.json)
    if args.plot is not None:
        plot_advice(advice, args.plot)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``run``, bad input reported as one line on stderr with exit status 2."""
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except PlanningError as error:
        where = f" ({error.field})" if error.field else ""
        print(f"error{where}: {error.message}", file=sys.stderr)
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
    return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
