"""Command line: ``python -m scheduler_service plan`` is the twin of POST /plan; ``serve`` runs the service.
(The twin of POST /advise, ``skrull-advise``, is the trainer's command, ``trainer_client.advise``: it reads data
sets and checkpoints as the trainer does, and the service never imports the trainer.)

``plan`` reads a request (the wire contract) from a file or stdin and prints
the response JSON, a readable table (``--table``) and/or draws a Gantt chart
beside the deepspeed baseline (``--plot``). Bad input goes to stderr with exit
code 2; the same request gives the same plan as the service. Both readable forms
show a plan's spanning micro-batches where its replicas run them: first, each
once the last of its replicas is free (the simulator's ``spanning_ready_s``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal, get_args, get_origin

from pydantic import ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined
from skrull_proto import PlanRequest, PlanResponse

from scheduler_service.contract.profiles import load_profile
from scheduler_service.contract.wire import request_to_problem, result_to_response
from scheduler_service.core.baselines import deepspeed
from scheduler_service.core.errors import PlanningError
from scheduler_service.core.plan import MicroBatch, Plan, SpanningMicroBatch
from scheduler_service.core.planner import DEFAULT_CPSAT_TIME_LIMIT_S, PlanResult, make_plan
from scheduler_service.core.simulate import (
    CPRankEstimate,
    MicroBatchEstimate,
    PlanEstimate,
    simulate,
    spanning_ready_s,
)
from scheduler_service.core.spanning import with_needed_spanning

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["build_parser", "cp_rank_shares", "format_table", "gantt_figure", "main", "plot_gantt"]

EXIT_BAD_INPUT = 2


def _add_plan_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("plan", help="plan one global batch (the CLI twin of POST /plan)")
    parser.add_argument("request", nargs="?", default="-", help="request JSON file; '-' or absent reads stdin")
    parser.add_argument("--table", action="store_true", help="print a per-rank summary instead of JSON")
    parser.add_argument("--plot", metavar="FILE.png", type=Path, help="draw per-rank micro-batch times vs deepspeed")
    parser.add_argument("--profile-file", type=Path, help="a profile JSON file to plan with (overrides 'profile')")
    parser.add_argument("--time-limit", type=float, default=DEFAULT_CPSAT_TIME_LIMIT_S,
                        help=f"cpsat time limit in seconds (default {DEFAULT_CPSAT_TIME_LIMIT_S:g})")
    parser.add_argument("--search-budget", type=int, metavar="UNITS",
                        help="skrull's plan-level search budget (overrides the request's; default: the planner's "
                             "for the batch's size): a larger one never plans worse")
    parser.set_defaults(handler=_run_plan)


def _serve_flag(parser: argparse.ArgumentParser, name: str, field: FieldInfo) -> None:
    """One ``serve`` flag for a ``Settings`` field, typed and described by the field itself. Every flag defaults
    to None, so the field's SKRULL_* variable applies unless the flag is given; pydantic validates the value."""
    from scheduler_service.runtime.settings import ENV_PREFIX

    env = ENV_PREFIX + name.upper()
    default = "" if field.default in (PydanticUndefined, None) else f", default {field.default}"
    description = (field.description or name.replace("_", " ")).rstrip(".")
    help_text = f"{description} ({env}{default})".replace("%", "%%")
    flag = "--" + name.replace("_", "-")
    annotation = field.annotation
    if annotation is bool:
        parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
    elif get_origin(annotation) is Literal:
        parser.add_argument(flag, dest=name, choices=get_args(annotation), default=None, help=help_text)
    else:
        kind: Callable[[str], object] = float if annotation is float else int if annotation is int else str
        parser.add_argument(flag, dest=name, type=kind, default=None, help=help_text)


def _add_serve_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve", help="run the planning service (FastAPI under uvicorn)",
        description="Run the planning service. Every flag overrides its SKRULL_* environment variable.",
    )
    parser.set_defaults(handler=_run_serve)
    try:
        from scheduler_service.runtime.settings import Settings
    except ImportError:  # no service extra (pydantic-settings): `plan` still works, `serve` cannot run anyway
        return
    for name, field in Settings.model_fields.items():
        _serve_flag(parser, name, field)


def _run_serve(args: argparse.Namespace) -> int:
    from pydantic import ValidationError as SettingsError

    from scheduler_service.runtime.settings import Settings
    from scheduler_service.web.server import apply_overrides, serve  # uvicorn is only needed to serve

    try:
        settings = apply_overrides({name: getattr(args, name) for name in Settings.model_fields})
    except SettingsError as error:
        print(_format_validation_error(error).replace("invalid request", "invalid setting"), file=sys.stderr)
        return EXIT_BAD_INPUT
    serve(settings)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m scheduler_service",
                                     description="Plan one global batch as POST /plan does (plan), or run the "
                                                 "planning service (serve).")
    subparsers = parser.add_subparsers(dest="command", required=True)
    _add_plan_parser(subparsers)
    _add_serve_parser(subparsers)
    return parser


def _read_request(source: str) -> PlanRequest:
    text = sys.stdin.read() if source == "-" else Path(source).read_text()
    return PlanRequest.model_validate_json(text)


def _format_validation_error(error: ValidationError) -> str:
    lines = []
    for item in error.errors():
        location = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in item["loc"]).lstrip(".")
        lines.append(f"{location or 'request'}: {item['msg']}")
    return "invalid request: " + "; ".join(lines)


def _groups_cell(micro_batch: MicroBatch, lengths: Sequence[int], first_rank: int = 0) -> str:
    """``[0,1]:2/18432 [2,3]:1/9000``: each hybrid group's ranks (counted from ``first_rank``: a spanning
    micro-batch's groups by world rank, as the wire names them), its sequences and their tokens."""
    return " ".join(f"[{','.join(str(first_rank + rank) for rank in group.cp_ranks)}]:{len(group.sequences)}/"
                    f"{sum(lengths[i] for i in group.sequences)}" for group in micro_batch.sharded) or "-"


def _dp_span(spanning: SpanningMicroBatch) -> str:
    """``DP 0-1``: the replicas a spanning micro-batch runs over."""
    return f"DP {spanning.dp_ranks[0]}-{spanning.dp_ranks[-1]}"


def _spanning_starts_s(plan: Plan, estimate: PlanEstimate) -> list[float]:
    """When each spanning micro-batch starts: once the last of its replicas has run the spanning ones before it
    (the simulator's own rule, applied to the plan's spanning micro-batches up to it)."""
    times_s = [span_estimate.time_s for span_estimate in estimate.spanning]
    return [max(spanning_ready_s(plan.spanning[:position], times_s[:position], len(plan.dp_ranks))[dp_rank]
                for dp_rank in spanning.dp_ranks)
            for position, spanning in enumerate(plan.spanning)]


def _own_starts_s(plan: Plan, estimate: PlanEstimate) -> list[float]:
    """When each DP replica starts its own micro-batches: once it has run its spanning ones (0 without)."""
    return spanning_ready_s(plan.spanning, [span_estimate.time_s for span_estimate in estimate.spanning],
                            len(plan.dp_ranks))


def _replica_ranks(spanning: SpanningMicroBatch, estimate: MicroBatchEstimate, dp_rank: int,
                   cp_size: int) -> tuple[CPRankEstimate, ...]:
    """The estimates of replica ``dp_rank``'s CP ranks in a spanning micro-batch (its world ranks of the block)."""
    offset = (dp_rank - spanning.first_dp_rank) * cp_size
    return estimate.cp_ranks[offset:offset + cp_size]


def format_table(result: PlanResult) -> str:
    """A readable per-DP-rank, per-micro-batch summary of a plan and its estimate. Each DP rank's lines are its
    timeline: the spanning micro-batches it is part of (``s<p>``, ``spanning[p]`` of the response) come first, with
    when they start, so its micro-batches' times and waits add up to its sum."""
    problem = result.problem
    lengths = problem.sequence_lengths
    starts_s = _spanning_starts_s(result.plan, result.estimate)
    lines = [
        f"scheduler {result.scheduler.value}  model {problem.perf.model.name}  profile {problem.perf.profile.name}  "
        f"dp {problem.dp_size}  cp {problem.cp_size}  bucket_size {problem.bucket_size}  "
        f"sequences {problem.num_sequences}",
        f"{'dp':>3} {'mb':>3} {'#local':>6} {'#dist':>5} {'dist tok':>9} {'#grp':>4} "
        f"{'tokens per CP rank (local + dist/N + grp/s)':<44} {'time ms':>9}  groups [cp ranks]:sequences/tokens",
    ]
    for dp_rank, (dp_plan, dp_estimate) in enumerate(zip(result.plan.dp_ranks, result.estimate.dp_ranks,
                                                         strict=True)):
        for position, (spanning, span_estimate, start_s) in enumerate(zip(
                result.plan.spanning, result.estimate.spanning, starts_s, strict=True)):
            if dp_rank in spanning.dp_ranks:
                lines.append(_spanning_line(spanning, span_estimate, position, dp_rank, start_s, problem.cp_size,
                                            lengths))
        for mb_index, (mb, mb_estimate) in enumerate(zip(dp_plan.micro_batches, dp_estimate.micro_batches,
                                                         strict=True)):
            per_rank = " ".join(f"{rank.tokens:.0f}" for rank in mb_estimate.cp_ranks)
            num_local = sum(len(rank_local) for rank_local in mb.local)
            distributed_tokens = sum(lengths[i] for i in mb.distributed)
            lines.append(f"{dp_rank:>3} {mb_index:>3} {num_local:>6} {len(mb.distributed):>5} "
                         f"{distributed_tokens:>9} {len(mb.sharded):>4} {per_rank:<44} "
                         f"{mb_estimate.time_s * 1e3:>9.2f}  {_groups_cell(mb, lengths)}")
        lines.append(f"{dp_rank:>3} {'sum':>3} {'':>6} {'':>5} {'':>9} {'':>4} {'':<44} "
                     f"{dp_estimate.time_s * 1e3:>9.2f}")
    if result.plan.spanning:
        lines.append("s<p>: spanning[p], one micro-batch over several DP replicas (on each replica's lines; tokens "
                     "of that replica's CP ranks, groups by world rank); each replica runs them first, in order")
    lines.append(
        f"estimated iteration {result.estimate.iteration_time_s * 1e3:.2f} ms, within "
        f"{result.estimate.iteration_time_s / result.lower_bound_s - 1:.1%} of the lower bound "
        f"{result.lower_bound_s * 1e3:.2f} ms; deepspeed {result.baseline_time_s * 1e3:.2f} ms; speedup "
        f"{result.speedup_vs_deepspeed:.2f}x; solved in {result.solve_time_s * 1e3:.2f} ms"
    )
    if result.solver is not None:
        bound = "none" if result.solver.bound_s is None else f"{result.solver.bound_s * 1e3:.2f} ms"
        lines.append(f"solver status {result.solver.status}; lower bound {bound}")
    return "\n".join(lines)


def _spanning_line(spanning: SpanningMicroBatch, estimate: MicroBatchEstimate, position: int, dp_rank: int,
                   start_s: float, cp_size: int, lengths: Sequence[int]) -> str:
    """Replica ``dp_rank``'s line of a spanning micro-batch: the block's counts and time, the replica's CP ranks'
    tokens, and which replicas it spans, from when, with how many sequences and tokens."""
    mb = spanning.micro_batch
    per_rank = " ".join(f"{rank.tokens:.0f}" for rank in _replica_ranks(spanning, estimate, dp_rank, cp_size))
    num_local = sum(len(rank_local) for rank_local in mb.local)
    sequences = mb.indices()
    first_rank = spanning.world_ranks(cp_size)[0]
    groups = f"; groups {_groups_cell(mb, lengths, first_rank)}" if mb.sharded else ""
    return (f"{dp_rank:>3} {f's{position}':>3} {num_local:>6} {len(mb.distributed):>5} "
            f"{sum(lengths[i] for i in mb.distributed):>9} {len(mb.sharded):>4} {per_rank:<44} "
            f"{estimate.time_s * 1e3:>9.2f}  spans {_dp_span(spanning)} from {start_s * 1e3:.2f} ms: "
            f"{len(sequences)} sequences/{sum(lengths[i] for i in sequences)} tokens{groups}")


# How a CP rank's work is drawn, per placement: greys and gold with hatches, apart from the micro-batch colours
# (matplotlib's C0..C9) of the DP panels above.
_PLACEMENT_STYLES: dict[str, tuple[str, str | None]] = {  # placement -> (face colour, hatch)
    "local": ("0.35", None),
    "distributed": ("0.8", "///"),
    "sharded (hybrid group)": ("gold", "..."),
    "fixed, launch-bound floor, padding + exposed communication": ("white", "xx"),
}


def cp_rank_shares(rank: CPRankEstimate) -> dict[str, float]:
    """One CP rank's estimated seconds by what it spends them on (the keys of ``_PLACEMENT_STYLES``); they add up
    to its ``time_s``."""
    return {"local": rank.local_compute_s, "distributed": rank.distributed_compute_s,
            "sharded (hybrid group)": rank.sharded_compute_s,
            "fixed, launch-bound floor, padding + exposed communication": rank.fixed_s + rank.launch_bound_s
                                                                          + rank.padding_s + rank.exposed_comm_s}


def _plot_shares(axis: Axes, cp_ranks: Sequence[CPRankEstimate], start_ms: float) -> None:
    """One micro-batch's CP ranks from ``start_ms``, each rank's estimated time split by what it runs."""
    for cp_rank, rank_estimate in enumerate(cp_ranks):
        left_ms = start_ms
        for placement, share_s in cp_rank_shares(rank_estimate).items():
            if share_s > 0:
                width_ms = share_s * 1e3
                colour, hatch = _PLACEMENT_STYLES[placement]
                axis.barh(cp_rank, width_ms, left=left_ms, facecolor=colour, hatch=hatch, edgecolor="black",
                          linewidth=0.2)
                left_ms += width_ms


def _plot_cp_ranks(axis: Axes, result: PlanResult) -> None:
    """The slowest DP rank's micro-batches on each of its CP ranks, each rank's estimated time split into local,
    distributed and hybrid-group compute and the rest (idle time, waiting for the slowest rank, is left blank).
    Its spanning micro-batches come first, its CP ranks' part of each from when the block starts."""
    from matplotlib.patches import Patch

    plan, estimate, cp_size = result.plan, result.estimate, result.problem.cp_size
    dp_rank = max(range(len(estimate.dp_ranks)), key=lambda i: estimate.dp_ranks[i].time_s)
    for spanning, span_estimate, start_s in zip(plan.spanning, estimate.spanning,
                                                _spanning_starts_s(plan, estimate), strict=True):
        if dp_rank in spanning.dp_ranks:
            _plot_shares(axis, _replica_ranks(spanning, span_estimate, dp_rank, cp_size), start_s * 1e3)
            axis.axvline((start_s + span_estimate.time_s) * 1e3, color="black", linewidth=0.6)
    start_ms = _own_starts_s(plan, estimate)[dp_rank] * 1e3
    for mb_estimate in estimate.dp_ranks[dp_rank].micro_batches:
        _plot_shares(axis, mb_estimate.cp_ranks, start_ms)
        start_ms += mb_estimate.time_s * 1e3
        axis.axvline(start_ms, color="black", linewidth=0.6)  # micro-batch boundary: every CP rank syncs here
    axis.set_yticks(range(cp_size), [f"CP {j}" for j in range(cp_size)])
    axis.invert_yaxis()
    axis.legend(handles=[Patch(label=name, facecolor=colour, hatch=hatch, edgecolor="black", linewidth=0.2)
                         for name, (colour, hatch) in _PLACEMENT_STYLES.items()],
                loc="upper center", bbox_to_anchor=(0.5, -0.3), fontsize="small", ncols=3, frameon=False)
    axis.set_title(f"{result.scheduler.value}, DP rank {dp_rank} (the slowest) per CP rank: estimated time by "
                   "what it runs; black lines end micro-batches")


def _plot_spanning(axis: Axes, plan: Plan, estimate: PlanEstimate) -> None:
    """Each spanning micro-batch as one hatched block across the rows of the DP replicas it spans, from when it
    starts, labelled with them: one step of the whole block, not one per replica."""
    for position, (spanning, span_estimate, start_s) in enumerate(zip(
            plan.spanning, estimate.spanning, _spanning_starts_s(plan, estimate), strict=True)):
        first, last = spanning.dp_ranks[0], spanning.dp_ranks[-1]
        width_ms, centre = span_estimate.time_s * 1e3, (first + last) / 2
        [block] = axis.barh(centre, width_ms, left=start_s * 1e3, height=last - first + 0.8, facecolor="white",
                            hatch="\\\\", edgecolor="indigo", linewidth=1.0)
        block.set_gid(f"spanning-{position}")
        axis.text(start_s * 1e3 + width_ms / 2, centre, f"spans {_dp_span(spanning)}", ha="center", va="center",
                  fontsize="small", color="indigo", clip_on=True,
                  bbox={"facecolor": "white", "edgecolor": "none", "pad": 1})


def gantt_figure(result: PlanResult) -> Figure:
    """The ``--plot`` chart (``plot_gantt``), open, for a caller that reads what it draws: per-DP-rank bars of
    consecutive micro-batch times, each spanning micro-batch as one block across its replicas' rows, the chosen
    scheduler beside deepspeed; below, the slowest DP rank's CP ranks with local, distributed and hybrid-group
    work in distinct colours."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # the deepspeed plan the reported baseline time is of: with spanning micro-batches where a batch needs them
    baseline = with_needed_spanning(result.problem, deepspeed)
    panels: list[tuple[str, Plan, PlanEstimate]] = [
        (result.scheduler.value, result.plan, result.estimate),
        ("deepspeed", baseline, simulate(result.problem, baseline)),
    ]
    dp_size, cp_size = result.problem.dp_size, result.problem.cp_size
    figure, axes = plt.subplots(
        len(panels) + 1, 1, figsize=(11, 1.8 + 0.6 * dp_size * len(panels) + 0.4 * cp_size),
        height_ratios=[*(dp_size + 1 for _ in panels), cp_size + 2], sharex=True, squeeze=False,
    )
    for axis, (title, plan, estimate) in zip(axes[:-1, 0], panels, strict=True):
        _plot_spanning(axis, plan, estimate)
        own_starts_s = _own_starts_s(plan, estimate)
        for dp_rank, dp_estimate in enumerate(estimate.dp_ranks):
            start_ms = own_starts_s[dp_rank] * 1e3
            for mb_index, mb_estimate in enumerate(dp_estimate.micro_batches):
                width_ms = mb_estimate.time_s * 1e3
                axis.barh(dp_rank, width_ms, left=start_ms, color=f"C{mb_index % 10}", edgecolor="black",
                          linewidth=0.3)
                start_ms += width_ms
        axis.set_yticks(range(len(estimate.dp_ranks)), [f"DP {i}" for i in range(len(estimate.dp_ranks))])
        axis.invert_yaxis()
        axis.set_title(f"{title}: {estimate.iteration_time_s * 1e3:.1f} ms per iteration (estimated)")
    _plot_cp_ranks(axes[-1, 0], result)
    axes[-1, 0].set_xlabel("time (ms); in the DP panels each colour block is one micro-batch")
    figure.tight_layout()
    return figure


def plot_gantt(result: PlanResult, path: Path) -> None:
    """Draw ``gantt_figure`` to ``path`` (PNG)."""
    figure = gantt_figure(result)  # chooses the Agg backend before pyplot is imported
    import matplotlib.pyplot as plt

    figure.savefig(path, dpi=120)
    plt.close(figure)


def _run_plan(args: argparse.Namespace) -> int:
    request = _read_request(args.request)
    extra_profiles = None
    if args.profile_file is not None:
        profile = load_profile(args.profile_file)
        extra_profiles = {profile.name: profile}
        request = request.model_copy(update={"profile": profile.name})
    problem = request_to_problem(request, extra_profiles=extra_profiles)
    if args.search_budget is not None:
        request = request.model_copy(update={"search_budget": args.search_budget})
        PlanRequest.model_validate(request.model_dump())  # a negative budget is refused like a bad request field
    time_limit_s = request.time_limit_s if request.time_limit_s is not None else args.time_limit
    result = make_plan(problem, request.scheduler, time_limit_s=float(time_limit_s),
                       search_budget=request.search_budget)
    if args.plot is not None:
        plot_gantt(result, args.plot)
    if args.table:
        print(format_table(result))
    else:
        response: PlanResponse = result_to_response(result, breakdown=request.breakdown)
        print(response.model_dump_json(indent=2))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.handler(args))
    except ValidationError as error:
        print(_format_validation_error(error), file=sys.stderr)
    except PlanningError as error:
        where = f" ({error.field})" if error.field else ""
        print(f"error{where}: {error.message}", file=sys.stderr)
    except (OSError, UnicodeDecodeError) as error:
        print(f"error: cannot read request: {error}", file=sys.stderr)
    return EXIT_BAD_INPUT
