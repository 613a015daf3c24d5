"""What the runtime tells the layer above it while it works, without knowing that layer.

``ServiceEvents`` is what the runtime reports (plans made, pool admissions,
reports adopted, job-store failures); the web layer's Prometheus metrics
implement it.
``ClientWatch`` is how a wait learns that its client hung up; the web layer
implements it over the ASGI connection. Both are protocols so that the runtime
imports no metrics library and no web framework.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import TYPE_CHECKING, Protocol, TypeVar

if TYPE_CHECKING:
    from scheduler_service.runtime.work import PlanSummary

__all__ = ["ClientWatch", "ServiceEvents"]

T = TypeVar("T")


class ServiceEvents(Protocol):
    def plan_made(self, summary: PlanSummary, *, num_sequences: int) -> None:
        """A plan of ``num_sequences`` sequences was answered."""

    def pool_admitted(self, pool: str) -> None:
        """A task was admitted to ``pool`` (running or waiting for a process)."""

    def pool_released(self, pool: str) -> None:
        """A task admitted to ``pool`` ended, however it ended."""

    def pool_refused(self, pool: str) -> None:
        """``pool`` was full: the request was answered busy."""

    def feedback_adopted(self, num_micro_batches: int) -> None:
        """A report of ``num_micro_batches`` measured micro-batches refit its job."""

    def jobs_kept(self, num_jobs: int) -> None:
        """The job store now keeps ``num_jobs`` jobs."""

    def job_store_failed(self, operation: str) -> None:
        """A call of the job store (``get``, ``keep``, ``replace``, or ``open`` at the start) failed."""


class ClientWatch(Protocol):
    async def until_gone(self, work: Awaitable[T]) -> T:
        """``work``'s result, unless the client hangs up first: then ``work`` is cancelled and
        ``ClientDisconnectedError`` raised."""
        ...
