"""A run stopped by SIGINT or SIGTERM: every rank finishes the step in flight, saves it, and exits with 128 + the
signal; a second Ctrl-C abandons the step instead.

**Where the signals come from.** torchrun starts each rank in a session of its own, so a terminal's Ctrl-C reaches
the launcher alone (torchrun's agent, or ``skrull-train``'s, which is the same agent in-process). The agent sends each
rank the signal it got, waits ``--shutdown-timeout`` seconds (torchrun: 30 unless ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``
says otherwise), SIGKILLs the ranks still running and ends. On a second signal while it waits, it sends them SIGTERM
and waits as long again (torch 2.13, ``elastic.agent.server.api.SimpleElasticAgent.run``). A cluster's preemption sends
SIGTERM to the launcher (Kubernetes: the container's first process) or to every process of the job (SLURM), then
SIGKILL after its grace period.

**On a rank, within ``graceful_stops``** (the trainer's loop):

* the first SIGINT or SIGTERM is only recorded: the step goes on;
* at each step boundary every rank learns whether any rank got one (``stop_agreed``: one all-reduce MAX of the
  signal's number over a gloo group; measured 0.7-1.0 ms a step with 2 ranks on the busy 2-core development machine,
  where a tiny model's step takes 300 ms); then every rank saves a checkpoint there and leaves its loop with
  ``TrainingStopped``, so a signal that reached one rank stops them all after the same step;
* a SIGINT after a stop signal, or any signal after a SIGINT (the agent's SIGTERM on a second Ctrl-C), raises
  ``TrainingStopped`` at once: the step is abandoned, and a save in progress with it, whose folder stays without its
  ``complete`` marker, so that ``--resume`` takes the checkpoint before it (``checkpoint.py``; DCP gathers what broke
  a save from every rank and raises a ``CheckpointException`` in its place, which ``train.py`` reads as the stop).
  Within ``saved_whole`` (a save nothing marks complete: the Hugging Face Trainer's) it waits for the save to end.
  A second SIGTERM changes nothing: SLURM signals every process and the agent forwards its own copy.

**Outside it** (the run being built or closed) SIGINT and SIGTERM raise ``SystemExit(128 + signal)`` at once, so that
the ``finally`` blocks close the trackers. So does a signal within the loop once another rank has reported a failure
(``distributed.report_failure``): that is torchrun stopping the ranks a failure left, and no collective with the
failed rank would answer.

A rank's Python handler runs between bytecodes of the main thread, so a rank blocked in a collective (C++) handles
its signal when the collective returns.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import torch
import torch.distributed as dist

from trainer_client.distributed import reported_failure

__all__ = ["STOP_SIGNALS", "TrainingStopped", "abandoned", "graceful_stops", "received_signal", "saved_whole",
           "stop_agreed", "stop_signals"]

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class TrainingStopped(SystemExit):
    """Training stopped on ``signal``: at a step boundary (``checkpoint``: the checkpoint saved there, if the run saves
    any), or ``abandoned`` where it was (on a second signal, ``then``). Exit status 128 + ``signal``: a
    ``SystemExit``, so that a script that does not catch it ends quietly with that status, as a process the signal
    ended would."""

    def __init__(self, signum: signal.Signals, *, checkpoint: Path | None = None, abandoned: bool = False,
                 then: signal.Signals | None = None) -> None:
        super().__init__(128 + signum)
        self.signal = signum
        self.checkpoint = checkpoint
        self.abandoned = abandoned
        self.then = then

    def __reduce__(self) -> tuple[type[TrainingStopped], tuple[signal.Signals], dict[str, object]]:
        # Pickled by DCP, which gathers what broke a save on every rank: the constructor takes the signal, not the
        # exit status SystemExit's own reduction would pass it.
        return type(self), (self.signal,), self.__dict__

    @property
    def exit_status(self) -> int:
        return 128 + self.signal

    def how(self) -> str:
        """``SIGTERM``; ``SIGINT twice``; ``SIGINT, then SIGTERM`` (torchrun's agent sends SIGTERM on a second
        Ctrl-C)."""
        if self.then is None:
            return self.signal.name
        return f"{self.signal.name} twice" if self.then is self.signal else f"{self.signal.name}, then {self.then.name}"


@dataclass(slots=True)
class _Signals:
    """What this process's handler saw: signal handlers are the process's, so this state is too."""

    received: signal.Signals | None = None  # the first stop signal, not one that followed a peer's failure
    abandoned: TrainingStopped | None = None  # the handler raised: the work in progress was given up on this
    graceful: bool = False  # within graceful_stops: the first signal waits for the step boundary
    whole: bool = False  # within saved_whole: a second signal waits for the save to end


_signals = _Signals()


def received_signal() -> signal.Signals | None:
    """The first SIGINT or SIGTERM this process got as a stop (not one after a peer's failure), if any."""
    return _signals.received


def abandoned() -> TrainingStopped | None:
    """The stop on which this process gave up the work in progress (a signal outside the loop, or a second one): a
    collective that breaks afterwards broke on it (the signals reach every rank), not on a failure."""
    return _signals.abandoned


def _on_signal(signum: int, frame: FrameType | None) -> None:
    got = signal.Signals(signum)
    if reported_failure() is not None:  # the launcher stops the ranks a failure left: exit at once, as a failure
        raise SystemExit(128 + signum)
    first, then = _signals.received, None
    if first is None:
        _signals.received = first = got
        if _signals.graceful:
            return  # the step boundary stops the run
    elif first is signal.SIGTERM and got is signal.SIGTERM:
        return  # SLURM signals every process, and the agent forwards its own copy
    else:
        then = got
    _signals.abandoned = TrainingStopped(first, abandoned=True, then=then)
    if _signals.whole:
        return  # raised when the save ends
    if _signals.graceful:
        raise _signals.abandoned
    raise SystemExit(128 + first)  # not a TrainingStopped: nothing to say of a run not training (module docstring)


@contextmanager
def _handlers() -> Iterator[None]:
    """Within: ``_on_signal`` handles SIGINT and SIGTERM; after it, the previous handlers again. Only the main thread
    can set handlers: elsewhere this changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.signal(signum, _on_signal) for signum in STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


@contextmanager
def stop_signals() -> Iterator[None]:
    """Within: SIGINT and SIGTERM raise ``SystemExit(128 + signal)`` at once, so that ``finally`` blocks run (Python's
    default action ends a process at once on SIGTERM, and prints a traceback on SIGINT), except inside
    ``graceful_stops``; the record of what came starts afresh."""
    global _signals
    _signals = _Signals()
    with _handlers():
        yield


@contextmanager
def graceful_stops() -> Iterator[None]:
    """Within (a training loop that calls ``stop_agreed`` at each step boundary): the first SIGINT or SIGTERM is
    recorded for the boundary; a second one as the module docstring says. Sets the handlers itself where no
    ``stop_signals`` is around it (a Hugging Face Trainer in a script)."""
    outer = _signals.graceful
    if not outer:  # a loop afresh: what stopped an earlier one (a Trainer's, in the same script) is done with
        _signals.received, _signals.abandoned = None, None
    _signals.graceful = True
    try:
        with _handlers():
            yield
    finally:
        _signals.graceful = outer


@contextmanager
def saved_whole() -> Iterator[None]:
    """Within (a save that nothing marks whole, such as the Hugging Face Trainer's: its ``resume_from_checkpoint=True``
    takes the newest folder): a second signal abandons the step only once the save has ended."""
    _signals.whole = True
    try:
        yield
    finally:
        _signals.whole = False
    if _signals.graceful and _signals.abandoned is not None:
        raise _signals.abandoned


def stop_agreed(group: dist.ProcessGroup | None) -> signal.Signals | None:
    """Whether any rank of ``group`` got a stop signal, and which (the larger number where they differ: SIGTERM);
    every rank of ``group`` calls it at the same step boundary. ``group``: a gloo group (CPU tensors: no device
    sync)."""
    signum = torch.tensor([int(_signals.received or 0)], dtype=torch.int32)
    dist.all_reduce(signum, op=dist.ReduceOp.MAX, group=group)
    return signal.Signals(int(signum.item())) if signum.item() else None
