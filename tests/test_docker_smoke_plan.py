"""``make docker-smoke``'s checks of a /plan answer (``check_plan`` in deploy/docker_smoke.py), without Docker.

The smoke test plans its batch through the scheduler container's port and checks the answer as a user would: every
sequence scheduled exactly once (in the DP ranks' own micro-batches or the spanning ones), one entry per DP rank, no
slower than deepspeed. Here the same checks run on the in-process service's answer to the same batch, so a change of
the plan's shape that the smoke test would trip over fails ``make test`` first; and on answers with a sequence left
out or scheduled twice, so that they cannot pass whatever they are given.
"""

from __future__ import annotations

import copy
import importlib.util
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from fastapi.testclient import TestClient
from skrull_proto.models import (
    DPRankPlanModel,
    MicroBatchModel,
    PlanResponse,
    SchedulerName,
    ShardedGroupModel,
    SpanningGroupModel,
    SpanningMicroBatchModel,
)

from scheduler_service.runtime.settings import Settings
from scheduler_service.web.app import create_app

SMOKE_SCRIPT = Path(__file__).resolve().parents[1] / "deploy" / "docker_smoke.py"


def _load_smoke_script() -> ModuleType:
    """deploy/docker_smoke.py is a script, not a package module: load it by path."""
    spec = importlib.util.spec_from_file_location("docker_smoke", SMOKE_SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


smoke = _load_smoke_script()


@pytest.fixture(scope="module")
def service() -> Iterator[TestClient]:
    with TestClient(create_app(Settings(cpsat_warmup=False, access_log=False))) as client:
        yield client


@pytest.fixture(scope="module")
def smoke_answer(service: TestClient) -> dict[str, Any]:
    """The service's answer to the smoke test's batch, as JSON."""
    response = service.post("/plan", json=smoke.BATCH)
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


def _index_lists(node: object) -> Iterator[list[int]]:
    """Every list of sequence indices in a plan's JSON, wherever it sits: ``local``'s inner lists, ``distributed``
    and ``sequences``, found by walking the whole document (not by the checker's own route through it)."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "local":
                yield from value
            elif key in ("distributed", "sequences"):
                yield value
            else:
                yield from _index_lists(value)
    elif isinstance(node, list):
        for item in node:
            yield from _index_lists(item)


def test_the_services_answer_to_the_smoke_batch_passes_the_smoke_checks(smoke_answer: dict[str, Any]) -> None:
    scheduled = smoke.check_plan(smoke_answer, smoke.BATCH)

    assert scheduled == list(range(len(smoke.BATCH["sequence_lengths"])))
    assert sorted(i for indices in _index_lists(smoke_answer) for i in indices) == scheduled


def test_the_smoke_checks_name_a_sequence_the_services_answer_leaves_out(smoke_answer: dict[str, Any]) -> None:
    answer = copy.deepcopy(smoke_answer)
    holder = next(indices for indices in _index_lists(answer) if indices)
    left_out = holder.pop()

    with pytest.raises(AssertionError, match=rf"missing indices \[{left_out}\]"):
        smoke.check_plan(answer, smoke.BATCH)


def test_the_smoke_checks_name_a_sequence_the_services_answer_schedules_twice(smoke_answer: dict[str, Any]) -> None:
    answer = copy.deepcopy(smoke_answer)
    holder = next(indices for indices in _index_lists(answer) if indices)
    holder.append(holder[0])

    with pytest.raises(AssertionError, match=rf"duplicated indices \{{{holder[0]}: 2\}}"):
        smoke.check_plan(answer, smoke.BATCH)


# A plan with a sequence in each place the wire contract has for one, built from its models: in a DP rank's own
# micro-batch (kept whole on a CP rank, sharded over the CP group, sharded over an aligned block of it), and in a
# spanning micro-batch over both DP replicas (kept whole on a world rank, sharded over all eight, over a block).
BATCH = {"sequence_lengths": [100] * 8, "dp_size": 2, "cp_size": 4, "scheduler": "skrull"}
PLACES = ["dp local", "dp local", "dp distributed", "dp sharded", "spanning local", "spanning local",
          "spanning distributed", "spanning sharded"]


def every_place_plan() -> dict[str, Any]:
    own = MicroBatchModel(local=[[0], [], [1], []], distributed=[2],
                          sharded=[ShardedGroupModel(cp_ranks=[2, 3], sequences=[3])], estimated_time_ms=1.0)
    spanning = SpanningMicroBatchModel(dp_ranks=[0, 1], local=[[4], [], [], [], [], [], [5], []], distributed=[6],
                                       sharded=[SpanningGroupModel(ranks=[4, 5, 6, 7], sequences=[7])],
                                       estimated_time_ms=2.0)
    plan = PlanResponse(
        schema_version=2, scheduler=SchedulerName("skrull"), model="qwen2.5-0.5b", profile="h100-eager",
        bucket_size=4096, dp_ranks=[DPRankPlanModel(micro_batches=[own], estimated_time_ms=3.0),
                                    DPRankPlanModel(micro_batches=[], estimated_time_ms=2.0)],
        spanning=[spanning], estimated_iteration_time_ms=3.0, solve_time_ms=0.1,
        deepspeed_estimated_iteration_time_ms=6.0, speedup_vs_deepspeed=2.0, lower_bound_ms=2.5)
    answer: dict[str, Any] = plan.model_dump(mode="json")
    return answer


def test_a_plan_with_a_sequence_in_every_place_passes() -> None:
    assert smoke.check_plan(every_place_plan(), BATCH) == list(range(8))


def _holder(answer: dict[str, Any], index: int) -> list[int]:
    [holder] = [indices for indices in _index_lists(answer) if index in indices]
    return holder


@pytest.mark.parametrize("index", range(8), ids=[f"{i}-{place}" for i, place in enumerate(PLACES)])
def test_a_sequence_left_out_of_any_place_is_named(index: int) -> None:
    answer = every_place_plan()
    _holder(answer, index).remove(index)

    with pytest.raises(AssertionError, match=rf"missing indices \[{index}\]"):
        smoke.check_plan(answer, BATCH)


@pytest.mark.parametrize("index", range(8), ids=[f"{i}-{place}" for i, place in enumerate(PLACES)])
def test_a_sequence_scheduled_twice_in_any_place_is_named(index: int) -> None:
    answer = every_place_plan()
    _holder(answer, index).append(index)

    with pytest.raises(AssertionError, match=rf"duplicated indices \{{{index}: 2\}}"):
        smoke.check_plan(answer, BATCH)


def test_a_sequence_the_batch_does_not_have_is_named() -> None:
    answer = every_place_plan()
    _holder(answer, 7).append(8)

    with pytest.raises(AssertionError, match=r"indices not in the batch \[8\]"):
        smoke.check_plan(answer, BATCH)


def test_a_wrong_number_of_dp_ranks_or_a_slowdown_fails() -> None:
    with pytest.raises(AssertionError, match="the plan has 2 DP ranks, the batch asked for 4"):
        smoke.check_plan(every_place_plan(), {**BATCH, "dp_size": 4})
    slower = {**every_place_plan(), "speedup_vs_deepspeed": 0.9}
    with pytest.raises(AssertionError, match="slower than deepspeed"):
        smoke.check_plan(slower, BATCH)
