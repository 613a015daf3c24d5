"""``skrull-advise`` (``python -m scheduler_service advise``): the layout of N GPUs that trains a data set fastest.

It reads a sample of sequence lengths from ``--data`` (what the trainer's ``--data`` takes, plus a file of
lengths), prices every layout with the planning core (``core.advise``), prints the ranked table with the reason
the winner wins and the layouts left out, and writes the document ``POST /advise`` answers (``--json``) and a
chart of throughput per layout, Skrull against static CP (``--plot``).

``--data`` sources:

* ``synthetic:NAME``: ``--sample-size`` lengths drawn from the planning core's Table-1-shaped samplers;
* a JSONL file or a ``datasets`` directory of records: each record's length as the trainer encodes it
  (``trainer_client.data.RecordEncoder``: ``input_ids``, ``messages`` or ``text`` with ``--tokenizer``), at most
  ``--sample-size`` records chosen evenly (seeded) from a larger set;
* a file of lengths: one positive integer per line (a first line that is a number marks it).

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
import numpy.typing as npt
from tqdm import tqdm

from scheduler_service.contract.profiles import load_profile
from scheduler_service.core.advise import Advice, AdviseRequest, Exclusion, GlobalBatch, advise
from scheduler_service.core.errors import PlanningError
from scheduler_service.core.memory import ActivationCheckpointing, Sharding
from scheduler_service.core.models import MODEL_CATALOGUE, ModelShape, resolve_model
from scheduler_service.core.profile import Profile, resolve_profile
from scheduler_service.core.samplers import DATASETS, sample_lengths

if TYPE_CHECKING:
    from matplotlib.axes import Axes

__all__ = ["add_arguments", "build_parser", "format_advice", "handle", "main", "plot_advice", "read_lengths", "run"]

EXIT_BAD_INPUT = 2
SYNTHETIC_PREFIX = "synthetic:"
DEFAULT_SAMPLE_SIZE = 20_000
DEFAULT_GLOBAL_BATCH = 64


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", required=True, metavar="SOURCE",
                        help=f"synthetic:{{{','.join(DATASETS)}}}, a JSONL file or a datasets directory of records "
                             "(as the trainer's --data), or a file of lengths (one integer per line)")
    parser.add_argument("--model", required=True, metavar="NAME_OR_DIR",
                        help=f"a built-in model ({', '.join(MODEL_CATALOGUE)}) or a local HF checkpoint directory")
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
    parser.add_argument("--tokenizer", help="a local tokenizer directory (for messages and text records)")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                        help="the dtype the trainer computes in (float32 on CPU)")
    parser.add_argument("--json", type=Path, metavar="FILE", help="write the advice document here")
    parser.add_argument("--plot", type=Path, metavar="FILE.png", help="draw throughput per layout here")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(handler=handle)


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
    parser = argparse.ArgumentParser(prog="skrull-advise", description=__doc__.splitlines()[0],
                                     formatter_class=_DefaultsHelp)
    add_arguments(parser)
    return parser


# ---- the sample ----------------------------------------------------------------------------------------------------


def read_lengths(source: str, *, sample_size: int, seed: int, tokenizer: str | None = None) -> npt.NDArray[np.int64]:
    """The sample of ``--data`` (module docstring); ``ValueError`` naming the flag and the problem."""
    if sample_size < 1:
        raise ValueError(f"--sample-size must be positive, got {sample_size}")
    if source.startswith(SYNTHETIC_PREFIX):
        name = source.removeprefix(SYNTHETIC_PREFIX)
        if name not in DATASETS:
            raise ValueError(f"--data {source}: unknown synthetic set; known: {', '.join(DATASETS)}")
        return sample_lengths(name, sample_size, np.random.default_rng(seed))
    path = Path(source)
    if not path.exists():
        raise ValueError(f"--data {source!r} is neither synthetic:NAME nor a file nor a datasets directory")
    if path.is_file() and _is_lengths_file(path):
        return _lengths_file(path)
    return _record_lengths(source, sample_size=sample_size, seed=seed, tokenizer=tokenizer)


def _is_lengths_file(path: Path) -> bool:
    with path.open("rb") as lines:
        for line in lines:
            if line.strip():
                return line.strip().lstrip(b"-+").isdigit()
    raise ValueError(f"--data {path} is empty")


def _lengths_file(path: Path) -> npt.NDArray[np.int64]:
    lengths = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if line.strip():
            try:
                lengths.append(int(line))
            except ValueError:
                raise ValueError(f"--data {path}:{number}: {line.strip()[:40]!r} is not a sequence length (a file of "
                                 "lengths holds one integer per line)") from None
    return np.asarray(lengths, dtype=np.int64)


def _record_lengths(source: str, *, sample_size: int, seed: int, tokenizer: str | None) -> npt.NDArray[np.int64]:
    """Each chosen record's length as the trainer encodes it (its labels and masks do not change the length)."""
    try:
        from trainer_client.data import RecordEncoder, load_tokenizer, open_records
    except ImportError as error:  # the service image has no trainer
        raise ValueError(f"--data {source}: reading records needs the trainer extra (pip install 'skrull[trainer]'): "
                         f"{error}") from None
    records = open_records(source)
    encoder = RecordEncoder(max_length=1 << 62, tokenizer=load_tokenizer(tokenizer) if tokenizer else None)
    num_records = records.num_records
    chosen = (np.arange(num_records) if num_records <= sample_size
              else np.sort(np.random.default_rng(seed).choice(num_records, size=sample_size, replace=False)))
    lengths = np.empty(chosen.size, dtype=np.int64)
    for position, index in enumerate(chosen.tolist()):
        record, where = records.read(index)
        lengths[position] = encoder.encode(record, where).num_tokens
    return lengths


def _model(name_or_dir: str) -> ModelShape:
    if Path(name_or_dir).is_dir():
        try:
            from trainer_client.model import model_shape
        except ImportError as error:
            raise ValueError(f"--model {name_or_dir}: reading a checkpoint's config needs the trainer extra: "
                             f"{error}") from None
        return model_shape(name_or_dir)
    return resolve_model(name_or_dir)


def _profile(name_or_file: str | None) -> Profile:
    if name_or_file is not None and Path(name_or_file).is_file():
        return load_profile(Path(name_or_file))
    return resolve_profile(name_or_file)


# ---- output ----------------------------------------------------------------------------------------------------------


def format_advice(advice: Advice) -> str:
    """The ranked layouts, why the winner wins, the layouts left out and the winner's command."""
    request = advice.request
    lines = [f"{request.model.name} on {request.num_gpus} GPUs ({request.gpus_per_node} per node), profile "
             f"{request.profile.name}: {request.num_batches} global batches of {advice.mean_sequences_per_batch:.0f} "
             f"sequences ({advice.mean_tokens_per_batch:,.0f} tokens) drawn from {request.lengths.size:,} "
             f"(longest {int(request.lengths.max()):,})",
             f"{'#':>2} {'dp × cp':>8} {'sharding':>8} {'ckpt':>9} {'bucket':>7} {'step ms':>9} {'p10-p90 ms':>15} "
             f"{'tok/s/GPU':>10} {'vs static CP':>12} {'headroom':>8} {'sharded':>7} {'nodes':>5}"]
    for rank, priced in enumerate(advice.layouts, start=1):
        layout, spread = priced.layout, priced.confidence
        lines.append(
            f"{rank:>2} {f'{layout.dp_size} × {layout.cp_size}':>8} {layout.sharding.value:>8} "
            f"{layout.activation_checkpointing.value:>9} {layout.bucket_size:>7} "
            f"{priced.predicted_step_time_s * 1e3:>9.1f} "
            f"{f'{spread.p10_s * 1e3:.0f}-{spread.p90_s * 1e3:.0f}':>15} {priced.tokens_per_s_per_gpu:>10,.0f} "
            f"{f'{priced.speedup_vs_static_cp:.2f}x':>12} {priced.memory_headroom_fraction:>8.1%} "
            f"{priced.sharded_share:>7.0%} {'spans' if layout.spans_nodes else 'one':>5}")
    lines += ["", f"why: {advice.why}"]
    if advice.excluded:
        lines += ["", "left out:", *_excluded_lines(advice)]
    lines += ["", "train with the winner:", f"  {advice.layouts[0].to_json()['trainer_command']}"]
    return "\n".join(lines)


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


def plot_advice(advice: Advice, path: Path) -> None:
    """Tokens/s per GPU per layout, Skrull beside static CP on the same layout, best first."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layouts = advice.layouts
    figure, axis = plt.subplots(figsize=(max(6.0, 0.9 * len(layouts) + 2), 4.5))
    _draw_throughput(axis, advice)
    axis.set_title(f"{advice.request.model.name} on {advice.request.num_gpus} GPUs: predicted throughput per layout")
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
    lengths = read_lengths(args.data, sample_size=args.sample_size, seed=args.seed, tokenizer=args.tokenizer)
    global_batch = (GlobalBatch(num_tokens=args.tokens_per_step) if args.tokens_per_step is not None
                    else GlobalBatch(num_sequences=args.global_batch or DEFAULT_GLOBAL_BATCH))
    request = AdviseRequest(
        sequence_lengths=lengths, model=_model(args.model), profile=_profile(args.profile), num_gpus=args.gpus,
        gpus_per_node=args.gpus_per_node, global_batch=global_batch,
        shardings=tuple(Sharding(mode) for mode in args.sharding or Sharding),
        activation_checkpointing=tuple(ActivationCheckpointing(mode) for mode in args.activation_checkpointing or ()),
        cp_sizes=tuple(args.cp_sizes or ()), num_batches=args.num_batches, seed=args.seed,
        compute_bytes=2 if args.dtype == "bfloat16" else 4, data=args.data, model_source=args.model,
        profile_source=args.profile,
    )
    with tqdm(total=request.num_layouts, desc="pricing layouts", unit="layout", disable=args.no_progress,
              file=sys.stderr) as bar:
        def progress(done: int, total: int) -> None:
            bar.total = total
            bar.update(done - bar.n)

        advice = advise(request, progress=progress)
    print(format_advice(advice))
    if args.json is not None:
        args.json.write_text(json.dumps(advice.to_json(), indent=2) + "\n")
    if args.plot is not None:
        plot_advice(advice, args.plot)
    return 0


def handle(args: argparse.Namespace) -> int:
    """``run``, bad input reported as one line on stderr with exit status 2 (both entry points)."""
    try:
        return run(args)
    except PlanningError as error:
        where = f" ({error.field})" if error.field else ""
        print(f"error{where}: {error.message}", file=sys.stderr)
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
    return EXIT_BAD_INPUT


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return handle(args)


if __name__ == "__main__":
    sys.exit(main())
