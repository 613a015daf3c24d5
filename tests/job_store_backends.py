"""The job store's real backends, and their real faults, for tests: a ``redis-server`` that a test can stop and
start again on its port, or pause (it hangs), a SQLite file corrupted and restored, and a small tmpfs that fills up
or turns read-only (mounting needs root; the tests that need it skip, saying why, elsewhere)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

__all__ = ["RedisServer", "corrupted", "filled", "read_only", "small_tmpfs"]

_ESTABLISHED = "01"  # a TCP state in /proc/net/tcp (include/net/tcp_states.h); a closed peer leaves 08, CLOSE_WAIT


class RedisServer:
    """Debian's ``redis-server`` on a free loopback port, its files in ``folder``. ``durable``: every write is in
    its append-only file before it answers, so a server stopped and started again still holds what it
    acknowledged (as the shipped ``deploy/k8s/redis.yaml`` keeps it); otherwise it keeps nothing on disk."""

    def __init__(self, folder: Path, *, durable: bool = False) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.skip("redis-server is not installed (apt-get install redis-server): Redis job-store tests skipped")
        with socket.socket() as probe:  # a port free now; redis-server cannot pick one itself (--port 0 disables TCP)
            probe.bind(("127.0.0.1", 0))
            self.port: int = probe.getsockname()[1]
        folder.mkdir(parents=True, exist_ok=True)
        persistence = ["--appendonly", "yes", "--appendfsync", "always"] if durable else ["--appendonly", "no"]
        self._command = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(folder),
                         "--save", "", *persistence]
        self._process: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        """Start it on its port; returns once it accepts connections."""
        self._process = process = subprocess.Popen(self._command, stdout=subprocess.DEVNULL,
                                                   stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while not self._accepts():
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                pytest.fail(f"redis-server did not start on port {self.port}")
            time.sleep(0.05)

    def stop(self) -> None:
        """Stop it (SIGTERM); returns once the port refuses connections."""
        if self._process is not None:
            self._process.terminate()
            self._process.wait(timeout=30)
            self._process = None

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Stopped with SIGSTOP, and continued (SIGCONT) afterwards: meanwhile it hangs as a wedged server does. The
        kernel still accepts connections and receives what clients send (``num_waiting_connections``), and nothing
        answers."""
        assert self._process is not None, "not running"
        self._process.send_signal(signal.SIGSTOP)
        try:
            yield
        finally:
            self._process.send_signal(signal.SIGCONT)

    def num_waiting_connections(self) -> int:
        """Its open connections that hold bytes it has not read: while it is paused, the clients waiting for its
        answer. A client that gave up and closed its connection is no longer counted. Read from the kernel's table of
        TCP sockets (``/proc/net/tcp``: local address, remote address, state, send and receive queues)."""
        rows = (line.split() for line in Path("/proc/net/tcp").read_text().splitlines()[1:])
        return sum(1 for _, local, _, state, queues, *_ in rows
                   if int(local.split(":")[1], 16) == self.port and state == _ESTABLISHED
                   and int(queues.split(":")[1], 16) > 0)

    def _accepts(self) -> bool:
        with socket.socket() as probe:
            return probe.connect_ex(("127.0.0.1", self.port)) == 0


@contextlib.contextmanager
def corrupted(path: Path) -> Iterator[None]:
    """The SQLite file at ``path`` overwritten with bytes that are no database, then restored as it was. Its
    write-ahead log is checkpointed into the file first, so every page a connection reads is the garbage."""
    with contextlib.closing(sqlite3.connect(path)) as db:
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    saved = path.read_bytes()
    path.write_bytes(b"\xa5" * len(saved))
    try:
        yield
    finally:
        path.write_bytes(saved)


@contextlib.contextmanager
def small_tmpfs(mount_point: Path, *, size_kib: int = 1024) -> Iterator[Path]:
    """A tmpfs of ``size_kib`` mounted at ``mount_point`` for the test; skips where mounting is not allowed."""
    mount_point.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kib}k,mode=0700", "tmpfs",
                              str(mount_point)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"a full or read-only file system needs a tmpfs, and mounting one failed (root is needed): "
                    f"{mounted.stderr.strip()}")
    try:
        yield mount_point
    finally:  # lazily: a test that failed holding a file there still leaves no mount behind
        subprocess.run(["umount", "--lazy", str(mount_point)], check=True)


@contextlib.contextmanager
def filled(mount_point: Path) -> Iterator[None]:
    """Every free byte of the file system at ``mount_point`` taken by one file, removed afterwards."""
    filler = mount_point / "filler"
    descriptor = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        block = b"\0" * 4096
        with contextlib.suppress(OSError):  # ENOSPC: full
            while True:
                os.write(descriptor, block)
    finally:
        os.close(descriptor)
    try:
        yield
    finally:
        filler.unlink()


@contextlib.contextmanager
def read_only(mount_point: Path) -> Iterator[None]:
    """The file system at ``mount_point`` remounted read-only, then writable again. The kernel refuses while a
    process holds a file there open for writing: a SQLite store must have let go of its file first."""
    subprocess.run(["mount", "-o", "remount,ro", str(mount_point)], check=True)
    try:
        yield
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(mount_point)], check=True)
