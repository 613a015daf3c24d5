"""A/B of the planner against another revision: plan quality per ``make bench`` case, and planning latency with
the two versions alternating.

Run ``python -m benchmarks.ab REV`` (say ``HEAD~5``): REV is checked out in a temporary git worktree, and
``benchmarks/ab_side.py`` of this checkout runs against each tree in turn (``PYTHONPATH``), in subprocesses.
Quality is deterministic and measured once per side: hybrid over binary Skrull and each one's ratio to the lower
bound per case, and each one's gap to the proven optimum of the 40 tiny batches ``make bench`` draws. Latency
is the CPU time of whole ``make_plan`` calls, the two sides alternating over ``--rounds`` rounds, so a shared
machine slows both alike. The latency spread (p50 and p99 over ``--spread-batches`` batches of 256 sequences per
dataset) has both sides plan each batch in turn, in two long-lived processes, and says how many batches' estimates
changed. Both sides plan under the same profile document (``--profile``: a shipped name of this
checkout or a file; default this checkout's default), so a change of the default between the revisions does not
pass for a change of the planner (a revision older than the launch-bound floor, de5b402, reads a profile without
its floor).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from benchmarks.ab_side import SPREAD_DATASETS
from scheduler_service.core.profile import DEFAULT_PROFILE, builtin_profiles

REPOSITORY = Path(__file__).resolve().parent.parent
SIDE = Path(__file__).resolve().parent / "ab_side.py"


def run_side(tree: Path, *arguments: str) -> Any:
    """``ab_side.py`` against the source tree ``tree``; its JSON."""
    completed = subprocess.run([sys.executable, str(SIDE), *arguments], cwd=tree, check=True, capture_output=True,
                               text=True, env={**os.environ, "PYTHONPATH": str(tree)})
    return json.loads(completed.stdout)


def quality_table(before: dict[str, Any], after: dict[str, Any], revision: str) -> None:
    print(f"\n## Plan quality: {revision} (before) and this checkout (after)\n")
    print("| case | hybrid / binary before | after | skrull / bound before | after "
          "| skrull_binary / bound before | after | make_plan's time: after / before |")
    print("|---|---|---|---|---|---|---|---|")
    for case, rows_before in before["cases"].items():
        cells = []
        rows_after = after["cases"][case]
        for column in ("gain", "skrull", "binary"):
            for rows in (rows_before, rows_after):
                values = {"gain": [row[1] / row[0] for row in rows],
                          "skrull": [row[0] / row[2] for row in rows],
                          "binary": [row[1] / row[2] for row in rows]}[column]
                cells.append(f"{statistics.fmean(values):.4f}")
        # a revision before this column measured make_plan's default plan has no fourth value: gds.skrull's it was
        planned = [(row_after[3], row_before[3] if len(row_before) > 3 else row_before[0])
                   for row_after, row_before in zip(rows_after, rows_before, strict=True)]
        cells.append(f"{float(np.exp(np.mean([np.log(a / b) for a, b in planned]))):.4f}")
        print(f"| {case} | {' | '.join(cells)} |")
    print("\nTiny batches, each scheduler against the proven optimum of its space (optimal / mean gap / worst gap):\n")
    for name in ("skrull", "skrull_binary"):
        summary = []
        for side in (before, after):
            gaps = np.array(side["tiny_gaps"][name])
            summary.append(f"{int((gaps < 1e-6).sum())} of {gaps.size}, {gaps.mean():+.2%}, {gaps.max():+.2%}")
        print(f"- {name}: before {summary[0]}; after {summary[1]}")


def latency_table(before: list[Any], after: list[Any], revision: str) -> None:
    print(f"\n## Planning latency, CPU p50 of whole make_plan calls (ms): {revision} (before) and this checkout "
          f"(after), {len(before)} alternating rounds\n")
    print("| batch | skrull before | after | ratio | skrull_binary before | after | ratio |")
    print("|---|---|---|---|---|---|---|")
    for case in before[0]:
        cells = []
        for scheduler in ("skrull", "skrull_binary"):
            medians = [statistics.median(t for run in side for t in run[case][scheduler]) * 1e3
                       for side in (before, after)]
            cells += [f"{medians[0]:.2f}", f"{medians[1]:.2f}", f"{medians[1] / medians[0]:.3f}"]
        print(f"| {case} | {' | '.join(cells)} |")


class Spread(NamedTuple):
    """Per side (before, after) and spread batch (``ab_side.spread_problems``): the fastest of its calls' CPU
    seconds, whether its plan spans replicas, and its estimate."""

    fastest_s: npt.NDArray[np.float64]  # (2, batches)
    spanning: npt.NDArray[np.bool_]  # (2, batches)
    estimate_s: npt.NDArray[np.float64]  # (2, batches)


def measure_spread(trees: tuple[Path, Path], num_batches: int, rounds: int, profile_file: Path) -> Spread:
    """Both sides' ``ab_side.py spread`` processes plan each batch in turn, which goes first alternating, for
    ``rounds`` rounds: a slow spell of the shared machine falls on both alike."""
    count = num_batches * len(SPREAD_DATASETS)
    fastest_s, spanning, estimate_s = np.full((2, count), np.inf), np.zeros((2, count), bool), np.zeros((2, count))
    with contextlib.ExitStack() as processes:  # each side's pipes closed and the process waited for on the way out
        sides = [processes.enter_context(subprocess.Popen(
            [sys.executable, str(SIDE), "spread", str(num_batches), str(profile_file)], cwd=tree,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(tree)}))
            for tree in trees]
        for process in sides:
            assert process.stdout is not None and process.stdout.readline().strip() == "ready"
        for round_number in range(rounds):
            for index in range(count):
                for side in (0, 1) if (index + round_number) % 2 == 0 else (1, 0):
                    process = sides[side]
                    assert process.stdin is not None and process.stdout is not None
                    process.stdin.write(f"{index}\n")
                    process.stdin.flush()
                    seconds, spanned, estimate = json.loads(process.stdout.readline())
                    fastest_s[side, index] = min(fastest_s[side, index], seconds)
                    spanning[side, index], estimate_s[side, index] = spanned, estimate
    return Spread(fastest_s, spanning, estimate_s)


def spread_table(spread: Spread, num_batches: int, rounds: int, revision: str) -> None:
    print(f"\n## Latency spread, 256 sequences: {num_batches} batches of each dataset, each batch's own cost (the "
          f"fastest of {rounds} calls, CPU), the two sides taking turns batch by batch: {revision} (before) and "
          "this checkout (after)\n")
    print("| dataset | p50 ms before | after | p99 ms before | after | p99 / p50 before | after "
          "| batches that span | their median ms before | after | batches whose estimate changed |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for number, dataset in enumerate(SPREAD_DATASETS):
        batches = slice(number * num_batches, (number + 1) * num_batches)
        own_ms = spread.fastest_s[:, batches] * 1e3
        p50, p99 = np.percentile(own_ms, 50, axis=1), np.percentile(own_ms, 99, axis=1)
        spanned = spread.spanning[1, batches]
        spanned_ms = [f"{np.median(side[spanned]):.2f}" if spanned.any() else "–" for side in own_ms]
        changed = int((spread.estimate_s[0, batches] != spread.estimate_s[1, batches]).sum())
        print(f"| {dataset} | {p50[0]:.2f} | {p50[1]:.2f} | {p99[0]:.2f} | {p99[1]:.2f} | {p99[0] / p50[0]:.2f} "
              f"| {p99[1] / p50[1]:.2f} | {int(spanned.sum())} | {spanned_ms[0]} | {spanned_ms[1]} | {changed} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("revision", help="the git revision to compare with (before)")
    parser.add_argument("--batches", type=int, default=5, help="sampled global batches per case")
    parser.add_argument("--tiny", type=int, default=40, help="tiny batches solved by CP-SAT")
    parser.add_argument("--rounds", type=int, default=4, help="alternating latency rounds")
    parser.add_argument("--calls", type=int, default=50, help="make_plan calls per round on 256 sequences")
    parser.add_argument("--spread-batches", type=int, default=100,
                        help="batches of 256 sequences per dataset for the latency spread (0: none)")
    parser.add_argument("--spread-rounds", type=int, default=3, help="calls per batch for the latency spread")
    parser.add_argument("--profile", default=DEFAULT_PROFILE, help="a shipped profile's name or a profile file")
    args = parser.parse_args()
    shipped = builtin_profiles()
    document = shipped[args.profile].raw if args.profile in shipped else json.loads(Path(args.profile).read_text())
    print(f"Both sides priced by profile {document['name']}")
    with tempfile.TemporaryDirectory() as folder:
        profile_file = Path(folder) / "profile.json"
        profile_file.write_text(json.dumps(document))
        other = Path(folder) / "before"
        subprocess.run(["git", "worktree", "add", "--detach", str(other), args.revision], cwd=REPOSITORY,
                       check=True, capture_output=True)
        try:
            quality = [run_side(tree, "quality", str(args.batches), str(args.tiny), str(profile_file))
                       for tree in (other, REPOSITORY)]
            rounds: list[list[Any]] = [[], []]
            for _ in range(args.rounds):
                for side, tree in enumerate((other, REPOSITORY)):
                    rounds[side].append(run_side(tree, "latency", str(args.calls), str(profile_file)))
            spread = (measure_spread((other, REPOSITORY), args.spread_batches, args.spread_rounds, profile_file)
                      if args.spread_batches else None)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(other)], cwd=REPOSITORY, check=True)
    quality_table(quality[0], quality[1], args.revision)
    latency_table(rounds[0], rounds[1], args.revision)
    if spread is not None:
        spread_table(spread, args.spread_batches, args.spread_rounds, args.revision)


if __name__ == "__main__":
    main()
