"""The cost estimate (``scheduler_service.runtime.cost``) against the plans and answers it estimates."""

from __future__ import annotations

import json

import numpy as np
import pytest
from skrull_proto import PlanRequest

from scheduler_service.contract.wire import request_to_problem
from scheduler_service.core.plan import SchedulerName
from scheduler_service.core.samplers import sample_lengths
from scheduler_service.core.static_sp import static_layout_problem
from scheduler_service.runtime.cost import baseline_cells, feedback_cells, plan_cost
from scheduler_service.runtime.work import plan_request

# Schedulers the estimate bounds by one micro-batch per sequence: their answer may be far smaller than estimated.
UNPACKED = {SchedulerName.DEEPSPEED, SchedulerName.SKRULL_PAPER, SchedulerName.ROUND_ROBIN, SchedulerName.DYNAMIC_CP,
            SchedulerName.GROUP_BY_LENGTH, SchedulerName.BATCH_REBALANCE}


def _requests() -> list[PlanRequest]:
    rng = np.random.default_rng(3)
    requests = []
    for dataset, num_sequences, dp_size, cp_size, bucket_size in [
        ("lmsys", 256, 4, 8, None), ("chatqa2", 96, 2, 16, 2048), ("wikipedia", 160, 4, 2, 2048),
        ("lmsys", 48, 1, 64, 64), ("chatqa2", 32, 2, 4, 4096),
    ]:
        longest = cp_size * (bucket_size or 8192)
        lengths = [int(n) for n in sample_lengths(dataset, num_sequences, rng, max_length=longest)]
        requests.append(PlanRequest(sequence_lengths=lengths, dp_size=dp_size, cp_size=cp_size,
                                    bucket_size=bucket_size))
    return requests


@pytest.mark.parametrize("scheduler", [s for s in SchedulerName if s is not SchedulerName.CPSAT])
def test_estimate_bounds_the_plan_and_sizes_its_answer(scheduler: SchedulerName) -> None:
    static_sp = scheduler in (SchedulerName.ULYSSES, SchedulerName.USP)
    for request in _requests():
        # the static SP schedulers on a model without GQA, whose 32 heads split over every cp_size here but 64
        request = request.model_copy(update={"scheduler": scheduler.value,
                                             **({"model": "llama-2-7b"} if static_sp else {})})
        if static_sp and static_layout_problem(scheduler.value, (32, 32), request.cp_size) is not None:
            continue
        problem = request_to_problem(request)
        cost = plan_cost(problem, scheduler)
        body = plan_request(request).answer(job_state=None)
        answer = json.loads(body)
        num_micro_batches = (sum(len(dp_rank["micro_batches"]) for dp_rank in answer["dp_ranks"])
                             + len(answer.get("spanning", [])))
        assert num_micro_batches <= cost.num_micro_batches
        assert cost.cells >= baseline_cells(problem.num_sequences, problem.cp_size)
        assert len(body) / 3 <= cost.answer_bytes
        if scheduler not in UNPACKED:
            assert cost.answer_bytes <= 3 * len(body)


def test_breakdown_answers_are_estimated_with_their_per_rank_estimates() -> None:
    request = PlanRequest(sequence_lengths=[1000] * 32, dp_size=1, cp_size=64, bucket_size=16, breakdown=True)
    cost = plan_cost(request_to_problem(request), SchedulerName.SKRULL, breakdown=True)
    body = plan_request(request).answer(job_state=None)
    assert len(body) / 2 <= cost.answer_bytes <= 2 * len(body)


def test_feedback_cells_count_every_list_and_length() -> None:
    report = {"job_id": "j", "micro_batches": [{"local_lengths": [[3, 4], [], [5]], "distributed_lengths": [9],
                                                "time_ms": 1.0}] * 2}
    lists_and_lengths = 2 * (1 + 3 + 1 + 4) + 1  # per micro-batch: local, its 3 lists, distributed; 4 lengths
    assert feedback_cells(json.dumps(report).encode()) >= lists_and_lengths
