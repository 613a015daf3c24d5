"""cpsat through the service: the bounded process pool, time limits, 429 with Retry-After, heuristics never blocked."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from skrull_proto import PlanResponse, Problem

from scheduler_service.contract.wire import response_to_plan
from scheduler_service.core.check import check_plan
from scheduler_service.runtime.settings import Settings
from scheduler_service.web.app import create_app

pytestmark = pytest.mark.cpsat

SMALL = [4000, 3000, 2500, 2000, 1000, 900, 500, 200, 64, 8000]
# Enough sequences that CP-SAT cannot prove optimality at once (it searches until its time limit), few enough
# that building the model takes well under a second.
HARD = [((index * 7919) % 9000) + 100 for index in range(40)]


def cpsat_body(lengths: list[int], time_limit_s: float | None = None) -> dict[str, object]:
    body: dict[str, object] = {"sequence_lengths": lengths, "dp_size": 2, "cp_size": 2, "bucket_size": 16384,
                               "scheduler": "cpsat"}
    if time_limit_s is not None:
        body["time_limit_s"] = time_limit_s
    return body


def settings(**overrides: object) -> Settings:
    values: dict[str, object] = {"cpsat_warmup": False, "cpsat_workers": 1, "cpsat_queue": 0,
                                 "cpsat_default_time_limit_s": 0.5, "cpsat_max_time_limit_s": 1.0}
    return Settings(**{**values, **overrides})  # type: ignore[arg-type]


@asynccontextmanager
async def running(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    """The app with its lifespan, reached in-process by concurrent async requests."""
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://skrull") as client:
            yield client


def test_cpsat_plan_reports_status_and_bound() -> None:
    with TestClient(create_app(settings())) as client:
        response = client.post("/plan", json=cpsat_body(SMALL, time_limit_s=0.5))
    assert response.status_code == 200, response.text
    plan = PlanResponse.model_validate_json(response.content)
    assert plan.solver is not None
    assert plan.solver.status in ("OPTIMAL", "FEASIBLE")
    assert plan.solver.bound_ms is not None and plan.solver.objective_ms is not None
    assert plan.solver.bound_ms <= plan.solver.objective_ms + 1e-6
    check_plan(response_to_plan(plan), sequence_lengths=SMALL, dp_size=2, cp_size=2, bucket_size=16384)
    assert plan.speedup_vs_deepspeed > 0


def test_cpsat_time_limit_is_capped_by_settings() -> None:
    with TestClient(create_app(settings(cpsat_default_time_limit_s=0.3, cpsat_max_time_limit_s=0.3))) as client:
        pool = client.app.state.planner.cpsat_pool
        given: list[tuple[float, float]] = []  # (the solver's time limit, the pool's expected time)
        run = pool.run

        async def recording_run(fn: Any, *args: Any, expected_s: float, watch: Any) -> Any:
            given.append((args[0].time_limit_s, expected_s))  # plan_validated(validated)
            return await run(fn, *args, expected_s=expected_s, watch=watch)

        pool.run = recording_run
        response = client.post("/plan", json=cpsat_body(HARD, time_limit_s=600))
    assert response.status_code == 200, response.text
    assert given == [(0.3, 0.3)]  # asked for 600 s, the solver gets the cap
    plan = PlanResponse.model_validate_json(response.content)
    assert plan.solver is not None and plan.solver.objective_ms is not None  # stopped at the cap with a plan


def test_rejects_cpsat_batch_over_its_limit() -> None:
    with TestClient(create_app(settings(cpsat_max_sequences=8))) as client:
        response = client.post("/plan", json=cpsat_body(SMALL))
    assert response.status_code == 422
    problem = Problem.model_validate_json(response.content)
    assert problem.field == "sequence_lengths" and "8" in problem.detail


def test_cpsat_pool_full_answers_429_with_retry_after_and_heuristics_are_not_blocked() -> None:
    async def scenario() -> None:
        app = create_app(settings())
        async with running(app) as client:
            solving = asyncio.create_task(client.post("/plan", json=cpsat_body(HARD, time_limit_s=1.0)))
            while app.state.planner.cpsat_in_flight == 0:  # until it is admitted and holds the only slot
                await asyncio.sleep(0.001)
            rejected, heuristic = await asyncio.gather(
                client.post("/plan", json=cpsat_body(SMALL)),
                client.post("/plan", json={**cpsat_body(HARD), "scheduler": "skrull"}),
            )
            assert rejected.status_code == 429, rejected.text
            assert rejected.headers["content-type"] == "application/problem+json"
            assert int(rejected.headers["retry-after"]) >= 1
            assert Problem.model_validate_json(rejected.content).limit == 1
            assert heuristic.status_code == 200
            assert not solving.done(), "the heuristic plan waited for CP-SAT"
            solved = await solving
            assert solved.status_code == 200, solved.text
            # The slot is free again once the solve has ended.
            again = await client.post("/plan", json=cpsat_body(SMALL, time_limit_s=0.2))
            assert again.status_code == 200, again.text
            metrics = (await client.get("/metrics")).text
            assert "skrull_cpsat_rejected_total 1.0" in metrics
            assert "skrull_cpsat_in_flight 0.0" in metrics

    asyncio.run(scenario())


def test_readyz_reports_cpsat_warm_up() -> None:
    with TestClient(create_app(settings(cpsat_warmup=True))) as client:
        deadline = time.monotonic() + 60
        state = client.get("/readyz").json()["checks"]["cpsat"]
        while state == "warming" and time.monotonic() < deadline:
            time.sleep(0.1)
            state = client.get("/readyz").json()["checks"]["cpsat"]
    assert state == "ready"
