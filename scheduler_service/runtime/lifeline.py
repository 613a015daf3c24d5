"""Every process the service starts ends with the process that started it.

``serve`` with several workers is a uvicorn supervisor whose worker processes
start pool processes of their own. Killed with SIGKILL, a parent cannot stop
its children: they are re-parented to init, go on answering with stale settings
and profiles, and hold the port, so a restart fails with "Address already in
use". So each child watches its parent's *sentinel*, a pipe end that becomes
readable when the parent is gone, however it died, and ends when it fires.
Linux's parent-death signal (``PR_SET_PDEATHSIG``) would fire when the *thread*
that started the child ends, and pools start processes from whichever thread
submits to them.

A pool process ends at once (``exit_now``): it holds no state. A uvicorn
worker is stopped as its supervisor would stop it (``stop_gracefully``: SIGTERM,
so it closes its listening socket, its pools and its job store), and ends
regardless ``grace_s`` later. The multiprocessing resource tracker needs no
watch: it exits when the last process holding its pipe is gone.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
import time
from collections.abc import Callable

__all__ = ["end_with_parent", "exit_now", "stop_gracefully"]


def end_with_parent(end: Callable[[], None]) -> bool:
    """Call ``end`` (on a daemon thread) once this process's multiprocessing parent is gone; False, and nothing
    watched, where this process was not started by multiprocessing (a single-worker server, a test)."""
    parent = multiprocessing.parent_process()
    if parent is None or parent.sentinel is None:
        return False

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        end()

    threading.Thread(target=watch, name="end-with-parent", daemon=True).start()
    return True


def exit_now() -> None:
    """End this process at once, skipping clean-up: for processes that hold nothing to save."""
    os._exit(1)


def stop_gracefully(grace_s: float) -> Callable[[], None]:
    """An ``end`` that asks this process to stop (SIGTERM, which uvicorn handles as a shutdown) and ends it
    ``grace_s`` later if it has not stopped by then."""
    def stop() -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        os._exit(1)
    return stop
