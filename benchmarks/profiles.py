"""What the profile does to plan quality: plans made under the assumed ``h100-paper`` against plans made under the
compute measured on an H200 (``h200-qwen2.5-0.5b``, the launch-bound form), both judged by the measured one.

    python -m benchmarks.profiles            # about 20 s on the 2-core development machine

The judge is ``h100-paper`` with its compute replaced by the H200's measured compute (floor included): the H200 and
the H100 compute at the same rates, the measurement ran in one process and holds no collective, so the
communication (the paper's Table 5) and the memory terms stay ``h100-paper``'s. Every Qwen2.5-0.5B case of
``make bench`` (the profile was measured for that model only), the same seeded batches for both, each planned by
``skrull`` under each profile and by ``deepspeed``; the table gives each plan's iteration time under the judge and
how much faster the measured profile's plans are. The geometric mean is over every batch.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
from collections.abc import Sequence

import numpy as np

from benchmarks.planning import FIGURE_3, LONG_HEAVY, Case
from scheduler_service.core.plan import PlanningProblem, SchedulerName, make_problem
from scheduler_service.core.planner import HEURISTIC_SCHEDULERS, warm_up
from scheduler_service.core.profile import Profile, builtin_profiles
from scheduler_service.core.samplers import sample_lengths
from scheduler_service.core.simulate import simulate

__all__ = ["main", "measured_judge"]

MEASURED = "h200-qwen2.5-0.5b"
ASSUMED = "h100-paper"


def measured_judge() -> Profile:
    """``h100-paper`` computing at the H200's measured rates: its communication and memory, the measurement's
    compute."""
    profiles = builtin_profiles()
    assumed, measured = profiles[ASSUMED], profiles[MEASURED]
    return dataclasses.replace(assumed, name=f"{ASSUMED}+{MEASURED} compute", model=measured.model,
                               compute=measured.compute,
                               raw={**assumed.raw, "model": measured.model, "compute": measured.raw["compute"]})


def _problem(case: Case, lengths: list[int], profile: Profile) -> PlanningProblem:
    return make_problem(sequence_lengths=lengths, dp_size=case.dp_size, cp_size=case.cp_size, model=case.model,
                        bucket_size=case.bucket_size, profile=profile)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.profiles", description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=5, help="sampled global batches per case")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    warm_up()
    judge, assumed = measured_judge(), builtin_profiles()[ASSUMED]
    skrull, deepspeed = HEURISTIC_SCHEDULERS[SchedulerName.SKRULL], HEURISTIC_SCHEDULERS[SchedulerName.DEEPSPEED]
    cases = [case for case in dict.fromkeys([*FIGURE_3, *LONG_HEAVY]) if case.model == "qwen2.5-0.5b"]
    print(f"\n## Plans made under {ASSUMED} and under the H200's measured compute, judged by the measured compute "
          f"(skrull; mean over {args.batches} sampled global batches)\n")
    print("| case | deepspeed s | skrull planned under h100-paper s | skrull planned under measured s | "
          "measured's plans faster by | speedup over deepspeed (planned under h100-paper → measured) |")
    print("|---|---|---|---|---|---|")
    ratios: list[float] = []
    for case in cases:
        rng = np.random.default_rng(args.seed)
        times: dict[str, list[float]] = {"deepspeed": [], "assumed": [], "measured": []}
        for _ in range(args.batches):
            count = case.dp_size * case.batch_size
            lengths = sample_lengths(case.dataset, count, rng, max_length=case.bucket_size * case.cp_size).tolist()
            judged = _problem(case, lengths, judge)
            times["deepspeed"].append(simulate(judged, deepspeed(judged)).iteration_time_s)
            times["assumed"].append(simulate(judged, skrull(_problem(case, lengths, assumed))).iteration_time_s)
            times["measured"].append(simulate(judged, skrull(judged)).iteration_time_s)
            ratios.append(times["assumed"][-1] / times["measured"][-1])
        mean = {name: statistics.fmean(values) for name, values in times.items()}
        gain = mean["assumed"] / mean["measured"] - 1
        print(f"| {case.label} | {mean['deepspeed']:.3f} | {mean['assumed']:.3f} | {mean['measured']:.3f} | "
              f"{gain:+.1%} | {mean['deepspeed'] / mean['assumed']:.2f}x → "
              f"{mean['deepspeed'] / mean['measured']:.2f}x |")
    geomean = math.exp(statistics.fmean(math.log(ratio) for ratio in ratios))
    print(f"\nGeometric mean over {len(ratios)} batches: the measured profile's plans are {geomean - 1:+.1%} faster; "
          f"worst batch for the assumed profile {max(ratios) - 1:+.1%}.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
