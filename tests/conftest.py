"""Shared fixtures: small planning problems built from the core's own validation path."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest

from scheduler_service.core.plan import PlanningProblem, make_problem

ProblemFactory = Callable[..., PlanningProblem]


@pytest.fixture
def problem_of() -> ProblemFactory:
    def build(lengths: Sequence[int], *, dp_size: int = 2, cp_size: int = 4, bucket_size: int = 4096,
              model: str = "qwen2.5-0.5b") -> PlanningProblem:
        return make_problem(sequence_lengths=list(lengths), dp_size=dp_size, cp_size=cp_size, model=model,
                            bucket_size=bucket_size)

    return build
