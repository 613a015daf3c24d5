"""Stopping a child process the way every tool of the project stops one (the demo's and the benchmarks' service,
``make docker-smoke``'s dockerd): SIGTERM, a grace period for it to finish what it holds, then SIGKILL. Standard
library only, so that ``deploy/docker_smoke.py`` runs it on a Python without the project's dependencies."""

from __future__ import annotations

import subprocess
from typing import Any

__all__ = ["stop_process"]


def stop_process(process: subprocess.Popen[Any], *, grace_s: float = 20.0) -> None:
    """Terminate ``process`` unless it has ended, kill it if it is still running ``grace_s`` seconds later, and wait
    for it either way (no zombie is left); then close the pipes the caller left open."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    for pipe in (process.stdin, process.stdout, process.stderr):
        if pipe is not None:
            pipe.close()
