"""Shared fixtures: small planning problems built from the core's own validation path, a live service, job state
of each test's own, and a real Redis server."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence

import pytest
import redis

from scheduler_service.core.plan import PlanningProblem, make_problem
from scheduler_service.core.planner import warm_up
from scheduler_service.runtime.settings import Settings
from scheduler_service.web.app import create_app
from tests.problem_builders import ProblemFactory
from tests.servers import uvicorn_in_thread


@pytest.fixture(scope="session", autouse=True)
def _warm_kernels() -> None:
    """The planning core's kernels compiled once, in this process, before any test starts a process that plans:
    with a cold cache, servers, pools and torchrun ranks would otherwise each compile them at once."""
    warm_up()


@contextlib.contextmanager
def _own_job_state(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SKRULL_STATE_URL", str(tmp_path_factory.mktemp("state") / "jobs.sqlite3"))
        yield


# Every app and server a test starts keeps its jobs in a file of its own (Settings read SKRULL_STATE_URL), never
# in the user's default file: one per test, and one per module and session for the apps their fixtures start.
@pytest.fixture(scope="session", autouse=True)
def _session_job_state(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    with _own_job_state(tmp_path_factory):
        yield


@pytest.fixture(scope="module", autouse=True)
def _module_job_state(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    with _own_job_state(tmp_path_factory):
        yield


@pytest.fixture(autouse=True)
def _job_state(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    with _own_job_state(tmp_path_factory):
        yield


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real ``redis-server`` (Debian's ``redis-server`` package) on a free loopback port, in a folder of its own;
    its URL. Skips where the binary is absent (CI's clean clone installs no system packages)."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server): Redis job-store tests skipped")
    folder = tmp_path_factory.mktemp("redis")
    with socket.socket() as probe:  # a port free now; redis-server cannot pick one itself (--port 0 disables TCP)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(folder),
                                "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL,
                               stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while not _accepts(port):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"redis-server did not start on port {port}")
        time.sleep(0.05)
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        process.terminate()
        process.wait(timeout=30)


@pytest.fixture
def redis_url(redis_server: str) -> str:
    """The Redis server, emptied for this test."""
    with redis.Redis.from_url(redis_server) as client:
        client.flushdb()
    return redis_server


def _accepts(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture
def problem_of() -> ProblemFactory:
    def build(lengths: Sequence[int], *, dp_size: int = 2, cp_size: int = 4, bucket_size: int = 4096,
              model: str = "qwen2.5-0.5b") -> PlanningProblem:
        return make_problem(sequence_lengths=list(lengths), dp_size=dp_size, cp_size=cp_size, model=model,
                            bucket_size=bucket_size)

    return build


@pytest.fixture(scope="session")
def live_port() -> Iterator[int]:
    """The service under a real uvicorn on a free loopback port (in a thread), for clients that need a socket."""
    with uvicorn_in_thread(create_app(Settings(cpsat_warmup=False, access_log=False))) as port:
        yield port
