"""What every problem answer of the service holds, checked in one place."""

from __future__ import annotations

import httpx
from skrull_proto import Problem

__all__ = ["assert_problem"]


def assert_problem(response: httpx.Response, status: int, field: str | None = None) -> Problem:
    """``response`` is an RFC 9457 problem with ``status``, carrying its request id and, given one, naming
    ``field``; the problem, parsed."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/problem+json"
    problem = Problem.model_validate_json(response.content)
    assert problem.status == status
    assert problem.request_id == response.headers["x-request-id"]
    if field is not None:
        assert problem.field == field, problem
    return problem
