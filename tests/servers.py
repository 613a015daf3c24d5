"""Servers the tests talk to over a real socket: the app under uvicorn in a thread of the test process
(``uvicorn_in_thread``), and the real ``python -m scheduler_service serve`` process (``serve``)."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import uvicorn
from fastapi import FastAPI

__all__ = ["Served", "descendants", "is_running", "serve", "uvicorn_in_thread"]


@contextlib.contextmanager
def uvicorn_in_thread(app: FastAPI) -> Iterator[int]:
    """``app`` under a real uvicorn in a daemon thread, on a free loopback port (port 0, read back after binding),
    lifespan included; its port."""
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_config=None, access_log=False, lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def _stat_fields(pid: int) -> list[str]:
    """``/proc/PID/stat`` after the command name (which may hold spaces): state, parent pid, …"""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def is_running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie waiting for a reaper is not)."""
    try:
        return _stat_fields(pid)[0] != "Z"
    except OSError:
        return False


def descendants(pid: int) -> set[int]:
    """Every running process below ``pid``: its children, theirs, and so on."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = _stat_fields(int(stat.parent.name))
            if fields[0] != "Z":
                parents[int(stat.parent.name)] = int(fields[1])
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


_RUNNING = re.compile(r"Uvicorn running on http://127\.0\.0\.1:(\d+)")


@dataclass
class Served:
    base_url: str
    process: subprocess.Popen[str]
    pending: queue.Queue[str]  # stderr lines, read by a thread
    log_lines: list[str] = field(default_factory=list)

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        """Until ``/readyz`` answers 200. A multi-worker supervisor logs its port once bound, but the socket
        listens only once a worker has started."""
        deadline = time.monotonic() + timeout_s
        while not self.ready():
            assert time.monotonic() < deadline, "no worker became ready"
            time.sleep(0.1)

    def ready(self) -> bool:
        try:
            return httpx.get(self.base_url + "/readyz", timeout=10).status_code == 200
        except httpx.ConnectError:
            return False

    def log_entries(self) -> list[dict[str, object]]:
        while not self.pending.empty():
            self.log_lines.append(self.pending.get())
        return [json.loads(line) for line in self.log_lines if line.startswith("{")]


def _read_lines(stream: object, lines: queue.Queue[str]) -> None:
    for line in stream:  # type: ignore[attr-defined]
        lines.put(line)


@contextlib.contextmanager
def serve(env: Mapping[str, str] | None = None, *, port: int = 0) -> Iterator[Served]:
    """``python -m scheduler_service serve`` on ``port``, by default 0 (uvicorn binds a free port and logs it, so
    there is no race for a port number), stopped with SIGTERM (graceful: the lifespan's exit runs). One worker
    unless ``env`` asks for more: the tests count the server's child processes and kill it."""
    env = {**os.environ, "SKRULL_WORKERS": "1", "SKRULL_CPSAT_WARMUP": "false",
           "SKRULL_CPSAT_DEFAULT_TIME_LIMIT_S": "0.3", **(env or {})}
    process = subprocess.Popen(
        [sys.executable, "-m", "scheduler_service", "serve", "--host", "127.0.0.1", "--port", str(port)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=_read_lines, args=(process.stderr, lines), daemon=True)
    reader.start()
    log_lines: list[str] = []
    port = None
    deadline = time.monotonic() + 60
    while port is None and time.monotonic() < deadline and process.poll() is None:
        try:
            line = lines.get(timeout=0.5)
        except queue.Empty:
            continue
        log_lines.append(line)
        if match := _RUNNING.search(line):
            port = int(match.group(1))
    try:
        if port is None:
            process.kill()
            pytest.fail("server did not start:\n" + "".join(log_lines))
        yield Served(base_url=f"http://127.0.0.1:{port}", process=process, pending=lines, log_lines=log_lines)
    finally:
        if process.poll() is None:
            process.terminate()
        process.wait(timeout=30)
        reader.join(timeout=10)  # it ends at the pipe's end of file
        assert process.stderr is not None
        process.stderr.close()
