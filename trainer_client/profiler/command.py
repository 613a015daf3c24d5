"""The offline profiler: measure the performance model's coefficients on this machine, write a profile file.

    python -m trainer_client.profile --model tiny --device cpu --out profiles/cpu-tiny.json
    torchrun --nproc-per-node 2 -m trainer_client.profile --model tiny --device cpu --out cpu-tiny.json
    python -m trainer_client.profile --refit old.json --out refit.json           # this version's fit, no sweep
    python -m trainer_client.profile --rebase h200.json --onto h100-paper --name h100-eager --out h100-eager.json

It runs the sweeps (``profiler.sweeps``: compute, memory and, with more than one rank, the collectives and the
shard-size effect, all through the trainer's own micro-batch code) and writes what they measured as a profile
document (``profiler.document``), every fit beside its raw points; the attention efficiency per query length is
derived from the shard-size effect by the planning core (``scheduler_service.core.shard_effect``).

Under ``torchrun`` every rank measures and rank 0 writes the file. One process profiles no collective: its file
has no communication tables, so it plans CP > 1 as if communication were free (run it under torchrun for those).
Under torchrun across nodes (``--nnodes``), the collectives of groups that span nodes become the file's
inter-node tables (``communication.inter_node``); on one node there are none, and plans whose CP blocks span
nodes are refused with it.

``--refit`` and ``--rebase`` measure nothing: the first fits a profile file's compute again from its own points,
the second puts a measured compute onto another profile's hardware, memory and communication (how the default
``h100-eager`` was made from ``h200-qwen2.5-0.5b`` and ``h100-paper``).

The file is a schema-1 profile (``scheduler_service.core.profile``) naming the model it was measured for, with
``provenance`` (hardware, software versions, model shape, date, command). The default sweeps take about 15 s for
the tiny model in one process and 30–40 s under torchrun with 2 ranks, on the 2-core development machine;
``--sizes``, ``--repeats`` and friends trade time for precision.

A profile holds for the machine *as it was* while measured: on a shared host another job taking a core makes
every micro-batch slower (up to 2× on 2 cores). The service's feedback loop (``POST /feedback``) corrects such
drift online.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from scheduler_service.core.errors import PlanningError
from scheduler_service.core.models import ModelShape
from scheduler_service.core.perf_model import PerformanceModel
from scheduler_service.core.profile import builtin_profiles, parse_profile
from scheduler_service.core.shard_effect import predicted_shard_s
from trainer_client.dacp.kernels import AttentionBackend
from trainer_client.distributed.torch_compat import check_torch_version
from trainer_client.models.parallelize import ActivationCheckpointing, Sharding
from trainer_client.profiler.document import build_document, document_json, rebase_compute, refit_compute
from trainer_client.profiler.measure import utc_now
from trainer_client.profiler.sweeps import CPU_SIZES, CUDA_SIZES, ProfileOptions, run_sweeps

__all__ = ["EXIT_USER_ERROR", "ProfileOptions", "build_parser", "main", "measure_profile", "summary"]

EXIT_USER_ERROR = 2


def measure_profile(options: ProfileOptions, *, command: str | None = None) -> dict[str, Any] | None:
    """Measure and return the profile document as its file holds it, on rank 0 (``None`` on the others).

    Every rank of an initialised process group must call it; without one it measures alone. ``command`` is
    recorded in the provenance (the CLI passes its own).
    """
    measured = run_sweeps(options)
    if measured is None:
        return None
    command = command or f"trainer_client.profiler.command.measure_profile() from {Path(sys.argv[0]).name}"
    return document_json(build_document(options, measured, command=command))


def _ints(text: str) -> tuple[int, ...]:
    """Comma-separated integers; ``auto`` (none given) leaves the choice to ``ProfileOptions``."""
    if text == "auto":
        return ()
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    defaults = ProfileOptions(model="tiny")
    parser = argparse.ArgumentParser(prog="python -m trainer_client.profile", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", help="a built-in model name, a local HF checkpoint directory or a Hugging Face "
                                        "Hub id (required to measure)")
    parser.add_argument("--refit", type=Path, metavar="PROFILE",
                        help="measure nothing: fit this profile file's compute again from its own points with this "
                             "version's model (the launch-bound form among them), and write it to --out")
    parser.add_argument("--rebase", type=Path, metavar="PROFILE",
                        help="measure nothing: this measured profile file's compute onto --onto's hardware, memory "
                             "and communication (a device computing at the same rates), written to --out")
    parser.add_argument("--onto", metavar="PROFILE", help="with --rebase: a shipped profile's name or a file")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--out", type=Path, required=True, help="where to write the profile JSON")
    parser.add_argument("--name", help="the profile's name (default: DEVICE-MODEL)")
    parser.add_argument("--sizes", type=_ints, default="auto",
                        help="packed tokens of the compute sweep; auto: "
                             f"{','.join(map(str, CPU_SIZES))} on CPU, {','.join(map(str, CUDA_SIZES))} on CUDA")
    parser.add_argument("--short-length", type=int, default=defaults.short_length,
                        help="tokens per sequence in the many-short mixes")
    parser.add_argument("--memory-sizes", type=_ints, default=defaults.memory_sizes,
                        help="packed tokens of the memory sweep")
    parser.add_argument("--comm-sizes", type=_ints, default=defaults.comm_sizes,
                        help="bytes per collective (world size > 1)")
    parser.add_argument("--shard-sizes", type=_ints, default=defaults.shard_sizes,
                        help="sequence lengths computed whole vs sharded over blocks of every hybrid group size "
                             "and the whole world (world size > 1)")
    parser.add_argument("--warmup", type=int, default=defaults.warmup, help="untimed runs before each timing")
    parser.add_argument("--repeats", type=int, default=defaults.repeats, help="timed runs per case (median)")
    parser.add_argument("--threads", type=int, help="torch threads per process (default: torch's choice)")
    parser.add_argument("--memory-budget-bytes", type=float,
                        help="device memory the BucketSize is derived for (default: the device's)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], help="default: as the trainer")
    parser.add_argument("--attention-backend", default="auto", choices=[b.value for b in AttentionBackend])
    parser.add_argument("--activation-checkpointing", default=defaults.activation_checkpointing,
                        choices=[a.value for a in ActivationCheckpointing],
                        help="measure activations as the trainer will run with this --activation-checkpointing")
    parser.add_argument("--sharding", default=defaults.sharding, choices=[s.value for s in Sharding],
                        help="lay the model over the profiling ranks as the trainer will with this --sharding")
    parser.add_argument("--compile", action="store_true",
                        help="measure each decoder layer under torch.compile, as the trainer will run with --compile")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def summary(document: dict[str, Any]) -> str:
    """A few lines for the terminal: the fits, their errors, the BucketSize, the collective tables per group size
    and the shard effect per degree (of a measured profile: a rebased one, measured as a whole by nothing, names
    no model shape to size a BucketSize for, and its compute's fits are the measurement's)."""
    compute, memory = document["compute"], document["memory"]
    kept, paper = compute["fit"][compute["fit"].get("form", "extended")], compute["fit"]["paper_eq14"]
    lines = [
        f"profile {document['name']} for model {document['model'] or 'any'} on {document['hardware']['device']}",
        f"compute: alpha {kept['alpha_s_per_flop']:.3e} s/FLOP, {kept['alpha_s_per_token']:.3e} s/token, "
        f"{kept['alpha_s_per_sequence']:.3e} s/sequence, beta {kept['beta_s_per_layer']:.3e} s/layer"
        + (f", launch-bound floor {kept['floor_s_per_layer']:.3e} s/layer" if kept.get("floor_s_per_layer") else "")
        + f"; fit error median {kept['median_relative_error']:.1%}, max {kept['max_relative_error']:.1%} "
        f"(eq. 14 alone: median {paper['median_relative_error']:.1%}, max {paper['max_relative_error']:.1%})",
    ]
    if "provenance" not in document:
        return "\n".join(lines)
    perf = PerformanceModel(model=ModelShape(**document["provenance"]["model"]), profile=parse_profile(document))
    lines.append(
        f"memory: {memory['activation_bytes_per_token']['fixed']:.0f} B/token + {memory['beta_bytes']:.0f} B; "
        f"static {sum(memory['static_bytes'].values())} B; fit error max {memory['fit']['max_relative_error']:.1%}; "
        f"BucketSize for {document['hardware']['device_memory_bytes']:.3g} B on one rank: {perf.bucket_size(1)}")
    communication = document["communication"]
    for link, section in (("", communication), (" across nodes", communication.get("inter_node") or {})):
        groups: dict[int, dict[str, list[list[float]]]] = {
            section.get("world_size") or 0: section.get("tables", {}),
            **{int(size): tables for size, tables in section.get("tables_by_group_size", {}).items()}}
        for group_size, tables in sorted(groups.items()):
            if tables:
                lines.append(f"communication{link} over {group_size} ranks: " + "; ".join(
                    f"{name} {table[0][1] * 1e6:.0f} us @ {table[0][0]:.0f} B .. {table[-1][1] * 1e6:.0f} us @ "
                    f"{table[-1][0]:.0f} B" for name, table in tables.items()))
    if "shard_effect" in compute:
        lines.extend(_shard_table(compute, perf))
    return "\n".join(lines)


def _shard_table(compute: dict[str, Any], perf: PerformanceModel) -> list[str]:
    """The shard cost, and the per-degree shard effect: measured whole and shard times, the model's shard time (the
    shard cost included) with efficiency 1 and (where the profile carries one) with its attention efficiency curve."""
    with_curve = bool(compute.get("attention_efficiency"))
    lines = [f"shard cost: {compute.get('alpha_s_per_shard', 0.0) * 1e3:.2f} ms per sharded sequence and rank beyond "
             f"the model's terms (compute.fit.shard_cost)",
             "shard effect (one sequence whole on each rank vs zigzag shards over every aligned block of d ranks; "
             "ms per micro-batch):",
             f"  {'tokens':>6} {'d':>3} {'query':>6} {'whole':>8} {'shard':>8} {'speedup':>7} {'par.eff':>7} "
             f"{'model':>8} {'error':>6}" + (f" {'+curve':>8} {'error':>6}" if with_curve else "")]
    for row in compute["shard_effect"]:
        line = (f"  {row['num_tokens']:>6} {row['degree']:>3} {row['query_tokens']:>6.0f} {row['whole_s'] * 1e3:>8.2f} "
                f"{row['shard_s'] * 1e3:>8.2f} {row['speedup']:>6.2f}x {row['parallel_efficiency']:>7.0%} "
                f"{row['predicted_shard_s'] * 1e3:>8.2f} {row['shard_relative_error']:>6.0%}")
        if with_curve:
            predicted_s = predicted_shard_s(perf, row["num_tokens"], row["degree"], row.get("ulysses_degree", 1))
            line += f" {predicted_s * 1e3:>8.2f} {abs(predicted_s - row['shard_s']) / row['shard_s']:>6.0%}"
        lines.append(line)
    if with_curve:
        lines.append("attention efficiency (relative throughput by query tokens): " + ", ".join(
            f"{query:g}: {relative:.2f}" for query, relative in compute["attention_efficiency"]["points"]))
    else:
        lines.append(f"attention efficiency: {compute['fit']['attention_efficiency']['result']}")
    return lines


def _refit(args: argparse.Namespace, argv: Sequence[str] | None) -> int:
    """``--refit``: the file's compute fitted again, every other section as it was measured."""
    document = _read_document(args.refit, "--refit")
    refit = refit_compute(document, name=args.name or document.get("name", "refit"), command=_command(argv),
                          date=utc_now())
    return _write(refit, args.out)


def _read_document(path: Path, flag: str) -> dict[str, Any]:
    try:
        document = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"{flag} {path}: {error}") from None
    if not isinstance(document, dict) or not isinstance(document.get("compute"), dict):
        raise ValueError(f"{flag} {path}: not a profile document (no compute section)")
    return document


def _command(argv: Sequence[str] | None) -> str:
    return " ".join(["python", "-m", "trainer_client.profile", *(argv if argv is not None else sys.argv[1:])])


def _write(document: dict[str, Any], out: Path) -> int:
    parse_profile(document)  # the core's ranges
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(document, indent=2) + "\n")
    print(summary(document))
    print(f"wrote {out}")
    return 0


def _rebase(args: argparse.Namespace, argv: Sequence[str] | None) -> int:
    """``--rebase``: the measured file's compute onto ``--onto``'s other sections."""
    if args.onto is None:
        raise ValueError("--rebase needs --onto: the profile whose hardware, memory and communication to keep")
    measured = _read_document(args.rebase, "--rebase")
    shipped = builtin_profiles()
    base = shipped[args.onto].raw if args.onto in shipped else _read_document(Path(args.onto), "--onto")
    rebased = rebase_compute(base, measured, name=args.name or f"{base.get('name', 'base')}+{measured.get('name')}",
                             command=_command(argv), date=utc_now())
    return _write(rebased, args.out)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    is_main = int(os.environ.get("RANK", "0")) == 0
    logging.basicConfig(level=logging.INFO if is_main else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.refit is not None:
            return _refit(args, argv)
        if args.rebase is not None:
            return _rebase(args, argv)
        if args.model is None:
            raise ValueError("--model is required to measure a profile (or --refit a profile file)")
        if (warning := check_torch_version()) is not None and is_main:
            logging.getLogger("trainer_client.profile").warning(warning)
        options = ProfileOptions(
            model=args.model, device=args.device, name=args.name, sizes=args.sizes,
            short_length=args.short_length, memory_sizes=args.memory_sizes, comm_sizes=args.comm_sizes,
            shard_sizes=args.shard_sizes, warmup=args.warmup, repeats=args.repeats,
            memory_budget_bytes=args.memory_budget_bytes, dtype=args.dtype,
            attention_backend=args.attention_backend, activation_checkpointing=args.activation_checkpointing,
            sharding=args.sharding, compile=args.compile,
            seed=args.seed, progress=not args.no_progress,
        )
        if args.threads is not None:
            if args.threads < 1:
                raise ValueError(f"--threads must be positive, got {args.threads}")
            torch.set_num_threads(args.threads)
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        launcher = ("python" if world_size == 1 else f"torchrun --nproc-per-node {world_size}"
                    if local_world_size >= world_size else
                    f"torchrun --nnodes {world_size // local_world_size} --nproc-per-node {local_world_size}")
        command = " ".join([launcher, "-m", "trainer_client.profile", *(argv if argv is not None else sys.argv[1:])])
        document = measure_profile(options, command=command)
        if document is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(document, indent=2) + "\n")
            print(summary(document))
            print(f"wrote {args.out}")
    except (ValueError, PlanningError) as error:
        if is_main:
            print(f"error: {error}", file=sys.stderr)
        return EXIT_USER_ERROR
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
