"""Batches that exercise every kernel of the planning core, and their plans as plain data.

``python -m tests.planning_cases`` prints the plans as JSON: the test of the kernels runs it once compiled and once
with ``NUMBA_DISABLE_JIT=1``, where every kernel is the Python function it is written as.
"""

from __future__ import annotations

import json
from typing import Any

import numba
import numpy as np

from scheduler_service.core import dacp
from scheduler_service.core.dacp_search import BINARY, HYBRID, STATIC
from scheduler_service.core.errors import BaselineCannotPlanError
from scheduler_service.core.plan import PlanningProblem, SchedulerName, make_problem
from scheduler_service.core.planner import make_plan
from scheduler_service.core.profile import DEFAULT_PROFILE
from scheduler_service.core.samplers import DATASETS, sample_lengths
from tests.problem_builders import ADDITIVE_PROFILE, LAUNCH_BOUND_FLOOR_S_PER_LAYER, with_floor

# (dp_size, cp_size, bucket_size, model): one CP rank, binary-only (cp 2), hybrid with one and two block sizes
SHAPES = [(2, 4, 8192, "qwen2.5-0.5b"), (1, 8, 4096, "qwen2.5-0.5b"), (3, 6, 6000, "qwen2.5-7b"),
          (4, 2, 16384, "qwen2.5-0.5b"), (2, 1, 30000, "tiny")]
NUM_SEQUENCES = 24
SEARCH_BUDGETS = (None, 40)  # the default, and enough for the iterated local search to kick on these batches


def problems() -> list[PlanningProblem]:
    """Every shape under the additive profile, and the first two with a small launch-bound floor and under the
    default profile (its measured floor) too; then batches that span DP replicas: each of the first shapes with
    one sequence longer than a CP group holds, and a short batch with one outlier that a replica would run alone; and
batches whose rows are padded to token buckets; and a batch whose collectives take every scheme."""
    priced = [(shape, ADDITIVE_PROFILE) for shape in SHAPES] + [
        (shape, profile) for shape in SHAPES[:2]
        for profile in (with_floor(LAUNCH_BOUND_FLOOR_S_PER_LAYER), DEFAULT_PROFILE)]
    within_groups = [
        make_problem(sequence_lengths=sample_lengths(sampler, NUM_SEQUENCES, np.random.default_rng(seed),
                                                     max_length=bucket_size * cp_size).tolist(),
                     dp_size=dp_size, cp_size=cp_size, model=model, bucket_size=bucket_size, profile=profile)
        for seed, sampler in enumerate(DATASETS)
        for (dp_size, cp_size, bucket_size, model), profile in priced]
    spanning = [
        make_problem(sequence_lengths=[*sample_lengths("lmsys", NUM_SEQUENCES - 1, np.random.default_rng(7),
                                                       max_length=bucket_size * cp_size).tolist(),
                                       bucket_size * cp_size * 3 // 2],
                     dp_size=dp_size, cp_size=cp_size, model=model, bucket_size=bucket_size)
        for dp_size, cp_size, bucket_size, model in SHAPES[:4] if dp_size > 1]
    outlier = make_problem(sequence_lengths=[300] * 60 + [30000], dp_size=4, cp_size=8, model="qwen2.5-0.5b",
                           bucket_size=26000)
    bucketed = [make_problem(sequence_lengths=sample_lengths(sampler, NUM_SEQUENCES, np.random.default_rng(11),
                                                             max_length=8192 * 4).tolist(),
                             dp_size=2, cp_size=4, model="qwen2.5-0.5b", bucket_size=8192, token_buckets=4)
                for sampler in ("lmsys", "chatqa2")]
    # long sequences of a model without GQA: the choice gives collectives Ulysses (u = 8), 2D (u = 2, 4) and
    # all-gather-KV
    schemes = make_problem(sequence_lengths=sample_lengths("chatqa2", NUM_SEQUENCES, np.random.default_rng(3),
                                                           max_length=8 * 8000).tolist(),
                           dp_size=2, cp_size=8, model="llama-2-7b", profile="h100-paper", bucket_size=8000)
    return within_groups + spanning + [outlier] + bucketed + [schemes]


def plans() -> list[dict[str, Any]]:
    """Every heuristic scheduler's plan of every problem (and Skrull's with each search budget), with its estimate,
    and DACP's decisions of the whole batch as one micro-batch in each search space."""
    found: list[dict[str, Any]] = []
    for problem in problems():
        for name in SchedulerName:
            if name is SchedulerName.CPSAT:
                continue
            for budget in SEARCH_BUDGETS if name is SchedulerName.SKRULL else (None,):
                try:
                    result = make_plan(problem, name, search_budget=budget)
                except BaselineCannotPlanError as error:  # a peer's refusal is part of its answer
                    found.append({"scheduler": name.value, "refused": str(error)})
                    continue
                places = result.plan.places(problem.num_sequences)
                critical = result.estimate.dp_ranks[0].micro_batches[0].critical if result.plan.dp_ranks[0] \
                    .micro_batches else None
                found.append({"scheduler": name.value, "budget": budget,
                              "places": [places.micro_batch.tolist(), places.degree.tolist(),
                                         places.first_rank.tolist(), places.dp_rank.tolist()],
                              "spanning": repr(result.plan.spanning),
                              "schemes": [c.ulysses_degree for dp_plan in result.plan.dp_ranks
                                          for micro_batch in dp_plan.micro_batches for c in micro_batch.collectives()],
                              "time_s": result.estimate.iteration_time_s, "baseline_s": result.baseline_time_s,
                              "critical": None if critical is None else [critical.time_s, critical.exposed_comm_s]})
        if problem.num_sequences and sum(problem.sequence_lengths) <= problem.micro_batch_capacity:
            for space in (STATIC, BINARY, HYBRID):
                decided = dacp.decide(problem, range(problem.num_sequences), space)
                assert decided is not None
                found.append({"space": space, "micro_batch": repr(decided[0]), "time_s": decided[1]})
    return found


def kernels_compiled_after_warm_up() -> list[str]:
    """The kernels that planning every problem with every heuristic scheduler compiles after ``planner.warm_up``:
    the first-use costs a warmed service would still pay on the request path (none, in a fresh process)."""
    import gc
    import importlib
    import pkgutil

    import scheduler_service.core as core
    from scheduler_service.core.jit import _Kernel
    from scheduler_service.core.planner import warm_up

    for module in pkgutil.iter_modules(core.__path__):
        if module.name != "cpsat":  # OR-Tools, offline only
            importlib.import_module(f"scheduler_service.core.{module.name}")

    def uncompiled() -> set[str]:
        return {f"{kernel.py_func.__module__}.{kernel.py_func.__qualname__}" for kernel in gc.get_objects()
                if isinstance(kernel, _Kernel) and kernel._can_compile}

    warm_up()
    before = uncompiled()
    plans()
    return sorted(before - uncompiled())


if __name__ == "__main__":
    print(json.dumps({"jit_disabled": bool(numba.config.DISABLE_JIT), "plans": plans()}))
