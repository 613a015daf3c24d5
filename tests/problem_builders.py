"""Planning problems for tests: the type of the ``problem_of`` fixture (conftest) and hypothesis strategies."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from hypothesis import strategies as st

from scheduler_service.core.errors import BaselineCannotPlanError
from scheduler_service.core.plan import PlanningProblem, SchedulerName, make_problem
from scheduler_service.core.profile import DEFAULT_PROFILE, Profile, resolve_profile

__all__ = ["ADDITIVE_PROFILE", "LAUNCH_BOUND_FLOOR_S_PER_LAYER", "ProblemFactory", "hybrid_problems",
           "refusal_is_the_peers_own", "with_floor"]

ProblemFactory = Callable[..., PlanningProblem]

# The shipped profile whose costs add (no launch-bound floor): the paper's setting, which most scenarios of the
# tests are built in. The default profile (h100-eager) has a floor of its own.
ADDITIVE_PROFILE = "h100-paper"
# A launch-bound floor that binds the short micro-batches of these problems under the additive profile and leaves
# the long ones compute-bound: 0.4 ms per layer (about 10 ms for qwen2.5-0.5b).
LAUNCH_BOUND_FLOOR_S_PER_LAYER = 4e-4


def with_floor(floor_s_per_layer: float, profile: str | Profile = ADDITIVE_PROFILE) -> Profile:
    """``profile`` priced in the launch-bound form: no CP rank with work takes less than ``floor·layers``."""
    base = resolve_profile(profile)
    compute = dataclasses.replace(base.compute, floor_s_per_layer=floor_s_per_layer)
    return dataclasses.replace(base, name=f"{base.name}-floor", compute=compute,
                               raw={**base.raw, "compute": {**base.raw["compute"],
                                                            "floor_s_per_layer": floor_s_per_layer}})


@st.composite
def hybrid_problems(draw: st.DrawFn, max_sequences: int = 24) -> PlanningProblem:
    """Short sequences mixed with ones long enough to shard, over CP sizes with no, one or two hybrid block
    sizes (1, 2, 4, 6, 8, 12, 16), priced additively, with a small launch-bound floor or by the default profile
    (the measured floor of an eager GPU: most short micro-batches at it)."""
    cp_size = draw(st.sampled_from([1, 2, 4, 6, 8, 12, 16]))
    bucket_size = draw(st.integers(256, 16_384))
    long_lengths = st.integers(bucket_size // 4, bucket_size * cp_size)
    lengths = draw(st.lists(st.one_of(st.integers(1, bucket_size), long_lengths), min_size=1,
                            max_size=max_sequences))
    profile = draw(st.sampled_from([ADDITIVE_PROFILE, "floor", DEFAULT_PROFILE]))
    return make_problem(sequence_lengths=lengths, dp_size=draw(st.integers(1, 3)), cp_size=cp_size,
                        model=draw(st.sampled_from(["tiny", "qwen2.5-0.5b", "qwen2.5-7b"])), bucket_size=bucket_size,
                        profile=with_floor(LAUNCH_BOUND_FLOOR_S_PER_LAYER) if profile == "floor" else profile)


def refusal_is_the_peers_own(scheduler: SchedulerName, problem: PlanningProblem,
                             error: BaselineCannotPlanError) -> bool:
    """Whether a baseline's refusal is one its own system makes: Megatron's dynamic CP refuses every pool but a
    power of two of at least 2 ranks, and plans all of those; the HF samplers refuse a sequence or micro-batch over
    one CP group's capacity, or fewer sequences than DP ranks; the static SP schedulers refuse a CP group of one rank,
    or one whose size (Ulysses) or every proper divisor (USP) the model's heads do not split evenly over."""
    pool = problem.dp_size * problem.cp_size
    if scheduler is SchedulerName.DYNAMIC_CP:
        return (pool < 2 or pool & (pool - 1) != 0) and error.scheduler == "dynamic_cp"
    cp_size, heads_allow = problem.cp_size, problem.perf.heads_allow
    if scheduler is SchedulerName.ULYSSES and (cp_size == 1 or not heads_allow(cp_size)):
        return error.scheduler == "ulysses"
    if scheduler is SchedulerName.USP and not any(cp_size % u == 0 and heads_allow(u) for u in range(2, cp_size)):
        return error.scheduler == "usp"
    return error.scheduler == scheduler.value and (
        f"holds {problem.micro_batch_capacity}" in error.reason or problem.num_sequences < problem.dp_size)
