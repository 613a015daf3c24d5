"""Shared fixtures: small planning problems built from the core's own validation path, and a live service."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence

import pytest
import uvicorn

from scheduler_service.app import create_app
from scheduler_service.core.plan import PlanningProblem, make_problem
from scheduler_service.settings import Settings

ProblemFactory = Callable[..., PlanningProblem]


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
    config = uvicorn.Config(create_app(Settings(cpsat_warmup=False, access_log=False)), host="127.0.0.1", port=0,
                            log_config=None, access_log=False)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline
        time.sleep(0.01)
    try:
        yield server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(timeout=30)
