"""Shared fixtures: small planning problems built from the core's own validation path, a live service, job state
of each test's own, and real Redis servers (a shared one, and one a test may stop and start again)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import redis

from scheduler_service.core.plan import PlanningProblem, make_problem
from scheduler_service.core.planner import warm_up
from scheduler_service.runtime.settings import Settings
from scheduler_service.web.app import create_app
from tests.job_store_backends import RedisServer
from tests.problem_builders import ADDITIVE_PROFILE, ProblemFactory
from tests.servers import uvicorn_in_thread

# One torch thread per process, in every process a test starts too (they inherit it): pytest-xdist keeps a worker
# busy on every core, and a process that also took a thread per core (a one-rank trainer, a profile, torch in the
# worker itself: none is imported above) would have OpenMP's spinning threads fight them, many times slower (the
# rehearsal's --profile auto: 38-71 s instead of 4). torchrun sets the same for several ranks, spawn_gloo too.
os.environ.setdefault("OMP_NUM_THREADS", "1")


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
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def redis_url(redis_server: str) -> str:
    """The Redis server, emptied for this test."""
    with redis.Redis.from_url(redis_server) as client:
        client.flushdb()
    return redis_server


@pytest.fixture
def restartable_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A Redis server of this test's own, which it may stop and start again on the same port; durable, so what
    it acknowledged survives the restart."""
    server = RedisServer(tmp_path / "redis", durable=True)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def problem_of() -> ProblemFactory:
    def build(lengths: Sequence[int], *, dp_size: int = 2, cp_size: int = 4, bucket_size: int = 4096,
              model: str = "qwen2.5-0.5b") -> PlanningProblem:
        return make_problem(sequence_lengths=list(lengths), dp_size=dp_size, cp_size=cp_size, model=model,
                            bucket_size=bucket_size, profile=ADDITIVE_PROFILE)

    return build


@pytest.fixture(scope="session")
def live_port() -> Iterator[int]:
    """The service under a real uvicorn on a free loopback port (in a thread), for clients that need a socket."""
    with uvicorn_in_thread(create_app(Settings(cpsat_warmup=False, access_log=False))) as port:
        yield port
