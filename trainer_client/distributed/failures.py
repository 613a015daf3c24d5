"""A rank's failure, told to its peers: the first rank to fail names itself and its reason, and every other rank stops
with that reason (``PeerFailed``) instead of its own broken collective's.

A rank that raises does not leave the others waiting for the collective timeout (``mesh.py``): before it
tears its process groups down it reports its reason in the default group's store
(``report_failure``; under torchrun the agent's store, which outlives every
worker). Its peers' next collective then fails at once (gloo: the connection
closes; torchrun also stops every worker as soon as one exits), and each of them
finds the first report there and stops with ``PeerFailed`` naming that rank and
its reason instead of its own broken collective (``train.py``). The first report
wins, so a peer's consequential error never takes the blame. A rank killed
outright (a signal, the OOM killer) reports nothing: the first peer whose
collective breaks reports that, and torchrun's summary names the killed rank by
its exit signal. A rank's signal handler reads the report too (``reported_failure``):
torchrun's SIGTERM after a failure ends a rank at once, where a SIGTERM without
one stops the run at its next step boundary (``components/stop.py``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch.distributed as dist

from trainer_client.distributed.torch_compat import default_store

__all__ = ["FirstFailure", "PeerFailed", "report_failure", "reported_failure"]

_FIRST_FAILURE_KEY = "skrull/first_failure"  # in the default group's store: per job, and per torchrun restart


@dataclass(frozen=True, kw_only=True, slots=True)
class FirstFailure:
    """The first rank of the job to fail, and why."""

    global_rank: int
    reason: str  # "ExceptionType: message"
    user_error: bool = False  # the user's to fix (a ValueError), which that rank prints: its peers exit quietly


class PeerFailed(RuntimeError):
    """Another rank failed first; this rank stops with its reason (its own error, a collective cut short by that
    failure, is chained as the cause)."""

    __module__ = "trainer_client.distributed"  # where users import it: a rank's traceback names it so

    def __init__(self, first: FirstFailure) -> None:
        super().__init__(f"global rank {first.global_rank} failed: {first.reason}")
        self.first = first


def report_failure(error: Exception, *, user_error: bool = False) -> FirstFailure | None:
    """Report ``error`` (``user_error``: the user's to fix) as this rank's failure unless a rank reported first;
    returns the first report.

    Every rank calls this on failure, before it destroys its process groups, so that a peer woken by the torn-down
    connection finds the report. None without a process group, or when the store is gone (outside torchrun it
    lives in global rank 0, which may have exited).
    """
    if not dist.is_initialized():
        return None
    mine = json.dumps({"global_rank": dist.get_rank(), "reason": f"{type(error).__name__}: {error}",
                       "user_error": user_error})
    try:
        # compare_set with expected "" sets the key only if it is absent, atomically; it returns the stored value.
        first = default_store().compare_set(_FIRST_FAILURE_KEY, "", mine)
    except (RuntimeError, dist.DistError):
        return None
    return FirstFailure(**json.loads(first))


def reported_failure() -> FirstFailure | None:
    """The first failure a rank of this job reported (``report_failure``), without reporting one; None when none
    was, without a process group, or when the store is gone."""
    if not dist.is_initialized():
        return None
    try:
        store = default_store()
        if not store.check([_FIRST_FAILURE_KEY]):
            return None
        first = store.get(_FIRST_FAILURE_KEY)
    except (RuntimeError, dist.DistError):
        return None
    return FirstFailure(**json.loads(first))
