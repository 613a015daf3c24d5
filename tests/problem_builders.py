"""Planning problems for tests: the type of the ``problem_of`` fixture (conftest) and hypothesis strategies."""

from __future__ import annotations

from collections.abc import Callable

from hypothesis import strategies as st

from scheduler_service.core.plan import PlanningProblem, make_problem

__all__ = ["ProblemFactory", "hybrid_problems"]

ProblemFactory = Callable[..., PlanningProblem]


@st.composite
def hybrid_problems(draw: st.DrawFn, max_sequences: int = 24) -> PlanningProblem:
    """Short sequences mixed with ones long enough to shard, over CP sizes with no, one or two hybrid block
    sizes (1, 2, 4, 6, 8, 12, 16)."""
    cp_size = draw(st.sampled_from([1, 2, 4, 6, 8, 12, 16]))
    bucket_size = draw(st.integers(256, 16_384))
    long_lengths = st.integers(bucket_size // 4, bucket_size * cp_size)
    lengths = draw(st.lists(st.one_of(st.integers(1, bucket_size), long_lengths), min_size=1,
                            max_size=max_sequences))
    return make_problem(sequence_lengths=lengths, dp_size=draw(st.integers(1, 3)), cp_size=cp_size,
                        model=draw(st.sampled_from(["tiny", "qwen2.5-0.5b", "qwen2.5-7b"])), bucket_size=bucket_size)
