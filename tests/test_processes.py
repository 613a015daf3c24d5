"""``stop_process``, the one way the project's tools stop a child: SIGTERM, a grace period, then SIGKILL."""

from __future__ import annotations

import signal
import subprocess
import sys

from scheduler_service.processes import stop_process


def _child(code: str) -> subprocess.Popen[bytes]:
    process = subprocess.Popen([sys.executable, "-c", f"import signal, time\n{code}\nprint('ready', flush=True)\n"
                                "time.sleep(60)"], stdout=subprocess.PIPE)
    assert process.stdout is not None and process.stdout.readline() == b"ready\n"
    return process


def test_a_child_that_ends_on_sigterm_is_stopped_by_it_and_its_pipe_closed() -> None:
    process = _child("")
    stop_process(process)
    assert process.returncode == -signal.SIGTERM
    assert process.stdout is not None and process.stdout.closed


def test_a_child_that_ignores_sigterm_is_killed_after_the_grace_period() -> None:
    process = _child("signal.signal(signal.SIGTERM, signal.SIG_IGN)")
    stop_process(process, grace_s=0.5)
    assert process.returncode == -signal.SIGKILL


def test_a_child_that_already_ended_is_left_as_it_ended() -> None:
    process = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    process.wait()
    stop_process(process)
    assert process.returncode == 3
