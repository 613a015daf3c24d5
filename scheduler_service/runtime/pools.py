"""The process pools heavy work runs in, and the tasks they run.

A ``WorkerPool`` is a bounded ``ProcessPoolExecutor`` (spawned, niced
processes) with admission control: at most ``workers + queue`` tasks are
admitted at once, and the next is refused at once with ``ServiceBusyError``
(429) and the seconds until the soonest admitted one should end
(Retry-After); ``admit`` takes the slot before a task's arguments are
prepared, so a request refused for a full pool costs no more work. Its tasks
call ``work`` in the pool process: they plan a request validated before it
was sent (``work.plan_validated``) and send back the plan, its bulk as JSON
bytes, or they parse and refit a report and send back a job id or a refit
job; an error is raised in the caller as it was raised in the process (core
errors pickle).

Pool processes exit when the server process is gone, even after a SIGKILL
(``lifeline``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import multiprocessing
import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import TypeVar

from skrull_proto import PlanRequest, SchedulerName

from scheduler_service.core.feedback import JobFeedback
from scheduler_service.runtime.errors import ServiceBusyError, ServiceUnavailableError
from scheduler_service.runtime.events import ClientWatch, ServiceEvents
from scheduler_service.runtime.lifeline import end_with_parent, exit_now
from scheduler_service.runtime.parsing import parse_feedback_request
from scheduler_service.runtime.work import plan_request, refit_job

__all__ = ["PoolSlot", "WorkerPool", "feedback_job_id_in_worker", "refit_in_worker", "warm_cpsat_worker"]

logger = logging.getLogger("scheduler_service.runtime.pools")

# Pool processes yield the CPU to the event loop (probes, small plans).
_POOL_NICE = 10
# A task is given up (503) only long after it should have ended: its expected time several times over (niced
# pool processes on a busy machine run slower than the calibration) plus a grace (spawn, imports, model building).
_POOL_PATIENCE = 4.0
_POOL_GRACE_S = 60.0
T = TypeVar("T")


class WorkerPool:
    """A process pool with admission control: at most ``workers + queue`` tasks admitted at once; the next is
    refused with ``ServiceBusyError`` (429) and the seconds until the soonest admitted task should end."""

    def __init__(self, name: str, *, workers: int, queue: int, events: ServiceEvents, alternative: str) -> None:
        self.name = name
        self.workers = workers
        self.capacity = workers + queue
        self._events = events
        self._alternative = alternative  # what the 429 suggests instead of waiting
        self._executor: ProcessPoolExecutor | None = None
        self._deadlines: dict[int, float] = {}  # admitted task -> when it should end
        self._next_ticket = 0

    @property
    def in_flight(self) -> int:
        """Tasks admitted and not yet finished (running or waiting for a process)."""
        return len(self._deadlines)

    def start(self) -> None:
        self._executor = self._new_executor()

    def close(self) -> None:
        if self._executor is not None:
            # Queued tasks are dropped; running ones end by their own bounds (the time limit, the cost limit),
            # and waiting for them lets the processes exit cleanly.
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None

    def submit_unadmitted(self, fn: Callable[[], T]) -> Future[T]:
        """Start-up work (a warm-up) that bypasses admission."""
        assert self._executor is not None
        return self._executor.submit(fn)

    def _new_executor(self) -> ProcessPoolExecutor:
        # spawn, not fork: the server process has threads (event loop, anyio workers) that fork would copy mid-state.
        return ProcessPoolExecutor(max_workers=self.workers, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=_init_worker)

    def admit(self, *, expected_s: float) -> PoolSlot:
        """A slot for one task, or ``ServiceBusyError`` (429) at once, before the task's arguments are prepared:
        a request the pool cannot take costs no more work. Used as a context manager, which frees a slot no task
        was run in."""
        now = time.monotonic()
        if self.in_flight >= self.capacity:
            self._events.pool_refused(self.name)
            soonest_s = min(self._deadlines.values()) - now
            raise ServiceBusyError(
                f"the {self.name} pool is full ({self.workers} working + {self.capacity - self.workers} waiting); "
                f"retry later{self._alternative}", retry_after_s=max(1, math.ceil(soonest_s)), limit=self.capacity)
        if self._executor is None:
            raise ServiceUnavailableError(f"the {self.name} pool is not running")
        ticket = self._next_ticket
        self._next_ticket += 1
        # A waiting task ends one expected time after the running ones; the estimate only feeds Retry-After.
        queued_behind = max(0, self.in_flight - self.workers + 1)
        self._deadlines[ticket] = now + expected_s * (1 + queued_behind)
        self._events.pool_admitted(self.name)
        return PoolSlot(self, ticket, patience_s=_POOL_PATIENCE * expected_s * (1 + queued_behind) + _POOL_GRACE_S,
                        expected_s=expected_s)

    async def run(self, fn: Callable[..., T], *args: object, expected_s: float, watch: ClientWatch | None) -> T:
        """``fn(*args)`` in a pool process, admitted or refused at once (``admit``)."""
        with self.admit(expected_s=expected_s) as slot:
            return await slot.run(fn, *args, watch=watch)

    async def _run_admitted(self, slot: PoolSlot, fn: Callable[..., T], *args: object,
                            watch: ClientWatch | None) -> T:
        """The slot is held until the task really ends, even if its request stops waiting (``watch``: the client
        hung up): the process is busy until then. A task still queued when its request stops waiting is
        dropped."""
        executor = self._executor
        if executor is None:
            raise ServiceUnavailableError(f"the {self.name} pool is not running")
        try:
            future = executor.submit(fn, *args)
        except (BrokenProcessPool, RuntimeError) as error:
            self._replace_broken(executor)
            raise ServiceUnavailableError(f"the {self.name} pool is unavailable; retry") from error
        slot.submitted = True
        loop = asyncio.get_running_loop()
        ticket = slot.ticket

        def release_on_loop(_: Future[T]) -> None:
            # Runs on the pool's manager thread; the bookkeeping stays on the event loop. A closed loop means the
            # app is gone, and its bookkeeping with it.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._release, ticket)

        future.add_done_callback(release_on_loop)
        try:
            result = asyncio.wrap_future(future)
            return await asyncio.wait_for(result if watch is None else watch.until_gone(result),
                                          timeout=slot.patience_s)
        except BrokenProcessPool as error:
            self._replace_broken(executor)
            raise ServiceUnavailableError(f"a {self.name} pool process died; retry") from error
        except TimeoutError as error:
            raise ServiceUnavailableError(f"the {self.name} pool did not finish within {_POOL_PATIENCE:g} × "
                                          f"{slot.expected_s:g} s plus grace") from error

    def _release(self, ticket: int) -> None:
        if self._deadlines.pop(ticket, None) is not None:
            self._events.pool_released(self.name)

    def _replace_broken(self, broken: ProcessPoolExecutor) -> None:
        if self._executor is broken:
            broken.shutdown(wait=False, cancel_futures=True)
            self._executor = self._new_executor()
            logger.error("a pool broke; started a new one", extra={"pool": self.name})


class PoolSlot:
    """One task's admission to a ``WorkerPool`` (``admit``), held until the task it runs ends; freed on leaving
    the ``with`` block when no task was run in it (its request was refused while it was prepared)."""

    def __init__(self, pool: WorkerPool, ticket: int, *, patience_s: float, expected_s: float) -> None:
        self.pool = pool
        self.ticket = ticket
        self.patience_s = patience_s  # how long the request waits for its task before giving it up (503)
        self.expected_s = expected_s
        self.submitted = False  # from then on the task's end frees the slot

    def __enter__(self) -> PoolSlot:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if not self.submitted:
            self.pool._release(self.ticket)

    async def run(self, fn: Callable[..., T], *args: object, watch: ClientWatch | None) -> T:
        """``fn(*args)`` in a pool process, in this slot (once)."""
        assert not self.submitted, "a slot runs one task"
        return await self.pool._run_admitted(self, fn, *args, watch=watch)


# ---- the pool process side -----------------------------------------------------------------------------------

def _init_worker() -> None:
    os.nice(_POOL_NICE)
    # A pool process otherwise outlives a server killed with SIGKILL: it holds both ends of its task queue, so it
    # never reads an end of file.
    end_with_parent(exit_now)


def feedback_job_id_in_worker(body: bytes) -> str:
    """First phase of a heavy report: parse it (seconds for a few MB), so the event loop learns its job."""
    return parse_feedback_request(body, None).job_id


def refit_in_worker(body: bytes, job: JobFeedback, max_sequence_length: int) -> JobFeedback:
    """Second phase: parse again (cheaper than sending a million parsed lists back and forth) and refit."""
    return refit_job(job, parse_feedback_request(body, None), max_sequence_length)


def warm_cpsat_worker() -> str:
    """Import the planner and CP-SAT and solve a tiny batch (proven optimal in milliseconds, well within the
    default time limit), so the first real request pays no start-up."""
    request = PlanRequest(sequence_lengths=[4000, 3000, 2000, 1000, 500, 200], dp_size=2, cp_size=2,
                          bucket_size=4096, scheduler=SchedulerName.CPSAT)
    batch = plan_request(request)
    assert batch.summary.solver_status is not None
    return batch.summary.solver_status
