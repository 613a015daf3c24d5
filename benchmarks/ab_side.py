"""One side of ``benchmarks.ab``: plan quality or planning latency of the planner importable here, as JSON, or
(``spread``) a process that plans the batches it is told, one at a time, for the latency spread.

Run as a script against a source tree on ``PYTHONPATH`` (this checkout, or a worktree of another revision), so it
uses only what every revision has: ``make_problem``, ``make_plan``, ``gds.skrull``, ``gds.skrull_binary``,
``simulate``, ``iteration_lower_bound_s``, ``cpsat.solve`` and ``parse_profile``. Every problem is priced by the
profile document in the file its last argument names, the same for both sides.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from scheduler_service.core import gds
from scheduler_service.core.plan import PlanningProblem, make_problem
from scheduler_service.core.planner import make_plan
from scheduler_service.core.profile import Profile, parse_profile
from scheduler_service.core.samplers import sample_lengths
from scheduler_service.core.simulate import iteration_lower_bound_s, simulate

# make bench's cases: (dataset, model, bucket_size, dp_size, cp_size, sequences per DP rank)
CASES = [
    ("wikipedia", "qwen2.5-0.5b", 26_000, 4, 8, 64), ("lmsys", "qwen2.5-0.5b", 26_000, 4, 8, 64),
    ("chatqa2", "qwen2.5-0.5b", 26_000, 4, 8, 64), ("wikipedia", "qwen2.5-7b", 13_000, 4, 8, 64),
    ("lmsys", "qwen2.5-7b", 13_000, 4, 8, 64), ("chatqa2", "qwen2.5-7b", 13_000, 2, 16, 40),
    ("chatqa2", "qwen2.5-7b", 13_000, 4, 8, 64), ("longtail64k", "qwen2.5-0.5b", 26_000, 4, 8, 32),
    ("longtail64k", "qwen2.5-7b", 13_000, 4, 8, 32), ("docmix", "qwen2.5-0.5b", 26_000, 4, 8, 64),
    ("docmix", "qwen2.5-7b", 13_000, 2, 16, 40),
]
LATENCY_CASES = [(num_sequences, dataset) for num_sequences in (256, 4096) for dataset in ("lmsys", "chatqa2")]
SPREAD_DATASETS = ("lmsys", "chatqa2", "wikipedia")  # 256 sequences each, at the shape above


def label(case: tuple[Any, ...]) -> str:
    dataset, model, _, dp_size, cp_size, batch_size = case
    return f"{model} {dataset} <DP={dp_size},CP={cp_size},BS={batch_size}>"


def problem_of(case: tuple[Any, ...], rng: np.random.Generator, profile: Profile) -> PlanningProblem:
    dataset, model, bucket_size, dp_size, cp_size, batch_size = case
    lengths = sample_lengths(dataset, dp_size * batch_size, rng, max_length=bucket_size * cp_size)
    return make_problem(sequence_lengths=lengths.tolist(), dp_size=dp_size, cp_size=cp_size, model=model,
                        bucket_size=bucket_size, profile=profile)


def quality(num_batches: int, num_tiny: int, profile: Profile) -> dict[str, Any]:
    """Per case and batch: skrull's and skrull_binary's estimated times, the lower bound, and the estimated time of
    ``make_plan``'s default plan (what the service answers: since issue 36, with spanning micro-batches where they
    pay); per tiny batch, each one's gap to the proven optimum of its space."""
    from scheduler_service.core import cpsat

    cases: dict[str, list[list[float]]] = {}
    for case in CASES:
        rng = np.random.default_rng(0)
        rows = []
        for _ in range(num_batches):
            problem = problem_of(case, rng, profile)
            rows.append([simulate(problem, gds.skrull(problem)).iteration_time_s,
                         simulate(problem, gds.skrull_binary(problem)).iteration_time_s,
                         iteration_lower_bound_s(problem), make_plan(problem).estimate.iteration_time_s])
        cases[label(case)] = rows
    rng = np.random.default_rng(0)  # make bench's tiny batches, drawn the same way
    gaps: dict[str, list[float]] = {"skrull": [], "skrull_binary": []}
    for _ in range(num_tiny):
        cp_size, bucket_size = int(rng.choice([4, 8])), int(rng.choice([2048, 4096, 8192]))
        lengths = np.exp(rng.normal(np.log(1.2 * bucket_size), 1.0, int(rng.integers(3, 7)))) + 50
        problem = make_problem(sequence_lengths=np.minimum(lengths, bucket_size * cp_size).astype(int).tolist(),
                               dp_size=int(rng.integers(1, 3)), cp_size=cp_size,
                               model=str(rng.choice(["qwen2.5-0.5b", "qwen2.5-7b"])), bucket_size=bucket_size,
                               profile=profile)
        for name, scheduler, hybrid in (("skrull", gds.skrull, True), ("skrull_binary", gds.skrull_binary, False)):
            plan = scheduler(problem)
            optimum = cpsat.solve(problem, time_limit_s=20.0, hint=plan, hybrid=hybrid).plan
            gaps[name].append(simulate(problem, plan).iteration_time_s
                              / simulate(problem, optimum).iteration_time_s - 1)
    return {"cases": cases, "tiny_gaps": gaps}


def latency(calls: int, profile: Profile) -> dict[str, Any]:
    """CPU seconds of each whole ``make_plan`` call, per latency case and scheduler."""
    found: dict[str, dict[str, list[float]]] = {}
    for num_sequences, dataset in LATENCY_CASES:
        rng = np.random.default_rng(0)
        problems = [problem_of((dataset, "qwen2.5-0.5b", 26_000, 4, 8, num_sequences // 4), rng, profile)
                    for _ in range(4)]
        for scheduler in ("skrull", "skrull_binary"):
            make_plan(problems[0], scheduler)  # first calls pay imports and compiling
            times = []
            for call in range(calls if num_sequences <= 256 else max(calls // 10, 3)):
                started = time.process_time()
                make_plan(problems[call % len(problems)], scheduler)
                times.append(time.process_time() - started)
            found.setdefault(f"{num_sequences} {dataset}", {})[scheduler] = times
    return found


def spread_problems(num_batches: int, profile: Profile) -> list[PlanningProblem]:
    """The spread's batches: ``num_batches`` of 256 sequences of each ``SPREAD_DATASETS``, in that order."""
    problems = []
    for dataset in SPREAD_DATASETS:
        rng = np.random.default_rng(0)
        problems += [problem_of((dataset, "qwen2.5-0.5b", 26_000, 4, 8, 64), rng, profile)
                     for _ in range(num_batches)]
    return problems


def serve_spread(num_batches: int, profile: Profile) -> None:
    """Plan the batch of each index read from stdin (``spread_problems``), once per line, and answer its CPU
    seconds, whether its plan spans replicas, and its estimate, a JSON line each; "ready" once warmed up."""
    problems = spread_problems(num_batches, profile)
    for problem in problems[::num_batches]:
        make_plan(problem)  # first calls pay imports and compiling
    print("ready", flush=True)
    for line in sys.stdin:
        problem = problems[int(line)]
        started = time.process_time()
        result = make_plan(problem)
        print(json.dumps([time.process_time() - started, bool(result.plan.spanning),
                          result.estimate.iteration_time_s]), flush=True)


if __name__ == "__main__":
    mode, priced_by = sys.argv[1], parse_profile(json.loads(Path(sys.argv[-1]).read_text()))
    if mode == "spread":
        serve_spread(int(sys.argv[2]), priced_by)
    else:
        print(json.dumps(quality(int(sys.argv[2]), int(sys.argv[3]), priced_by) if mode == "quality"
                         else latency(int(sys.argv[2]), priced_by)))
