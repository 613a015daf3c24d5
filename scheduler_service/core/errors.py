"""Domain errors of the planning core.

Every error a caller can fix names the offending request field (a JSON-pointer
style path such as ``sequence_lengths[17]``) and carries the numbers involved,
so the web layer and the CLI can report it verbatim. The edges map these to
HTTP problem+json or to a non-zero exit; the core never knows about either.
Every error pickles with its message and fields (``PlanningError.__reduce__``),
so one raised in a pool process is raised again, unchanged, by the caller.

    PlanningError (ValueError)
    ├── InvalidRequestError        a field is malformed or out of range
    │   ├── SequenceTooLongError   a sequence exceeds bucket_size × cp_size (× dp_size where blocks span replicas)
    │   ├── UnknownModelError
    │   ├── UnknownSchedulerError
    │   └── UnknownProfileError
    ├── InfeasiblePlanError        a scheduler could not honour the memory bound
    │   └── BaselineCannotPlanError  a peer's scheduler cannot plan the batch as its own system would
    └── PlanCheckError             a plan violates the contract (internal bug or bad plan)
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "BadSequenceLengthError",
    "BaselineCannotPlanError",
    "InfeasiblePlanError",
    "InvalidRequestError",
    "PlanCheckError",
    "PlanningError",
    "SequenceTooLongError",
    "UnknownModelError",
    "UnknownProfileError",
    "UnknownSchedulerError",
    "quoted",
]

_QUOTED_CHARS = 64


def quoted(value: str) -> str:
    """``value`` as an error echoes it: quoted, cut to a short prefix (a 3 MB model name must not come back)."""
    if len(value) <= _QUOTED_CHARS:
        return repr(value)
    return f"{value[:_QUOTED_CHARS]!r}… ({len(value)} characters)"


class PlanningError(ValueError):
    """Base class: the request cannot be planned as given."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field

    def __reduce__(self) -> tuple[Any, ...]:
        # Exception pickles as ``cls(*args)``, which subclasses with their own ``__init__`` arguments cannot
        # take: rebuild from the message and the fields instead.
        return _restore, (type(self), dict(vars(self)))


def _restore(cls: type[PlanningError], state: dict[str, Any]) -> PlanningError:
    """A pickled error rebuilt without its ``__init__``: ``args`` is the message, the fields as they were."""
    error = cls.__new__(cls, state["message"])
    vars(error).update(state)
    return error


class InvalidRequestError(PlanningError):
    """A request field is malformed or outside its allowed range; ``limit``: the bound it broke, where one did."""

    def __init__(self, message: str, *, field: str | None = None, limit: int | float | None = None) -> None:
        super().__init__(message, field=field)
        self.limit = limit


class BadSequenceLengthError(InvalidRequestError):
    """A batch's length that is not a positive integer within the service's cap: the first such, by ``index``."""

    def __init__(self, message: str, *, index: int, limit: int | None) -> None:
        super().__init__(message, field=f"sequence_lengths[{index}]", limit=limit)
        self.index = index


class SequenceTooLongError(InvalidRequestError):
    """A sequence does not fit even when sharded over the whole CP group, or, where blocks may span DP replicas
    (``dp_size`` given), over the whole world: its capacity is ``bucket_size × cp_size × dp_size``."""

    limit: int  # the capacity, in tokens

    def __init__(self, *, index: int, num_tokens: int, bucket_size: int, cp_size: int,
                 dp_size: int | None = None) -> None:
        limit = bucket_size * cp_size * (dp_size or 1)
        over = f"bucket_size {bucket_size} × cp_size {cp_size}" + (
            f" × dp_size {dp_size} = {limit} fit (the world's capacity)" if dp_size is not None else f" = {limit} fit")
        super().__init__(f"sequence {index} has {num_tokens} tokens; at most {over}",
                         field=f"sequence_lengths[{index}]", limit=limit)
        self.index = index
        self.num_tokens = num_tokens


class UnknownModelError(InvalidRequestError):
    def __init__(self, name: str, known: list[str]) -> None:
        super().__init__(f"unknown model {quoted(name)}; known models: {', '.join(sorted(known))}", field="model")


class UnknownSchedulerError(InvalidRequestError):
    def __init__(self, name: str, known: list[str]) -> None:
        super().__init__(f"unknown scheduler {quoted(name)}; known schedulers: {', '.join(known)}", field="scheduler")


class UnknownProfileError(InvalidRequestError):
    def __init__(self, name: str, known: list[str]) -> None:
        super().__init__(f"unknown profile {quoted(name)}; known profiles: {', '.join(sorted(known))}", field="profile")


class InfeasiblePlanError(PlanningError):
    """A scheduler found no plan that honours the per-rank memory bound."""


class BaselineCannotPlanError(InfeasiblePlanError):
    """A baseline (a peer's scheduler as its own code runs it) cannot plan this batch: the message says which
    baseline, what in the batch it cannot hold, and why its own system would not either. A comparison names the
    batch and the baseline rather than leave it out of a mean."""

    def __init__(self, scheduler: str, reason: str) -> None:
        super().__init__(f"{scheduler} cannot plan this batch: {reason}", field="scheduler")
        self.scheduler = scheduler
        self.reason = reason


class PlanCheckError(PlanningError):
    """A plan violates the wire contract; ``violations`` lists every problem found."""

    def __init__(self, violations: list[str]) -> None:
        shown = "; ".join(violations[:5])
        more = f" (and {len(violations) - 5} more)" if len(violations) > 5 else ""
        super().__init__(f"invalid plan: {shown}{more}", field="plan")
        self.violations = violations
