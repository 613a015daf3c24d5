"""What a request will cost, estimated from its shape before any of the work is done.

A plan's work and its answer grow with its *cells*: every micro-batch carries
``cp_size`` local lists that are built, checked, simulated and serialized, and
every sequence is placed once. The deepspeed baseline every answer is compared
with has one micro-batch per sequence, so every plan costs at least
``sequences × cp_size`` cells of simulation; the plan itself adds its own
micro-batches × ``cp_size``: for the packing schedulers at most twice the
bin-packing bound plus one per DP rank (measured); for the paper-style GDS,
which measured up to 4x that bound, one per sequence. On the 2-core
development machine one cell costs 4–15 µs of planning and about 3 bytes of JSON (a 1024-sequence
``cp_size`` 1024 batch with ``bucket_size`` 1 is 2.1 M cells: 33 s and 3.2 MB);
with ``breakdown`` every plan cell also carries its CP rank's estimate, about
180 bytes more (measured 177). A spanning micro-batch carries one local list per
rank of its block, at most ``dp_size × cp_size``: ``dynamic_cp`` plans only
those (at most one per sequence), the others one per sequence no CP group holds,
and ``skrull`` up to ``spanning.MAX_CHOSEN`` more.

A feedback report's work grows with the same cells, its micro-batches ×
``cp_size`` local lists plus its lengths; it is estimated from the raw body
before parsing (parsing a 4 MB report alone takes seconds), by counting its
JSON arrays and list separators, an upper bound on those lists and lengths.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from scheduler_service.core.plan import PlanningProblem, SchedulerName
from scheduler_service.core.spanning import MAX_CHOSEN

__all__ = ["PlanCost", "baseline_cells", "feedback_cells", "plan_cost", "search_seconds"]

# Micro-batch JSON beside its local lists ('{"local":[…],"distributed":[…],"estimated_time_ms":12.345678},').
_MICRO_BATCH_JSON_BYTES = 64
# A CP rank's estimate in a breakdown ('{"tokens":…,"local_tokens":…,"local_ms":…, … "time_ms":…},').
_BREAKDOWN_JSON_BYTES = 180
# Schedulers whose micro-batch count only the sequences bound: deepspeed's one per sequence, the paper-style GDS,
# measured at up to 4x the bin-packing bound, and the HF samplers, which take accumulation steps until every
# micro-batch fits (up to one sequence each).
_UNPACKED = frozenset({SchedulerName.DEEPSPEED, SchedulerName.SKRULL_PAPER, SchedulerName.ROUND_ROBIN,
                       SchedulerName.GROUP_BY_LENGTH, SchedulerName.BATCH_REBALANCE})


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanCost:
    """A plan's estimated size: ``cells`` measures its work and its memory, ``answer_bytes`` its JSON."""

    num_micro_batches: int
    cells: int
    answer_bytes: int


def baseline_cells(num_sequences: int, cp_size: int) -> int:
    """Cells every plan costs at least: the deepspeed baseline's one micro-batch of ``cp_size`` local lists per
    sequence, and the sequences. Known from the request's shape alone, before validating it."""
    return num_sequences * (cp_size + 1)


def plan_cost(problem: PlanningProblem, scheduler: SchedulerName, *, breakdown: bool = False) -> PlanCost:
    """The estimate for ``problem`` planned by ``scheduler``: an upper bound on its micro-batches (for the packing
    schedulers a measured one, not a proven one: ``tests/test_cost.py``); ``breakdown``: the answer carries
    every CP rank's estimate of every micro-batch."""
    num_sequences, cp_size = problem.num_sequences, problem.cp_size
    world_size = problem.dp_size * cp_size
    index_bytes = len(str(num_sequences)) + 1
    per_list_bytes = 3 + (_BREAKDOWN_JSON_BYTES if breakdown else 0)
    if scheduler is SchedulerName.DYNAMIC_CP:  # every micro-batch over the whole world
        cells = baseline_cells(num_sequences, cp_size) + num_sequences * world_size
        answer_bytes = num_sequences * (per_list_bytes * world_size + _MICRO_BATCH_JSON_BYTES + index_bytes)
        return PlanCost(num_micro_batches=num_sequences, cells=cells, answer_bytes=answer_bytes)
    num_spanning = (len(problem.too_long_for_a_replica())
                    + (MAX_CHOSEN if scheduler is SchedulerName.SKRULL and problem.spanning else 0))
    if scheduler in _UNPACKED:
        num_micro_batches = num_sequences
        # deepspeed's plan is the baseline itself
        plan_cells = 0 if scheduler is SchedulerName.DEEPSPEED else num_micro_batches * cp_size
    else:
        by_tokens = math.ceil(sum(problem.sequence_lengths) / problem.micro_batch_capacity)
        num_micro_batches = min(num_sequences, 2 * by_tokens + problem.dp_size)
        plan_cells = num_micro_batches * cp_size
    cells = baseline_cells(num_sequences, cp_size) + plan_cells + num_spanning * world_size
    per_micro_batch = per_list_bytes * cp_size + _MICRO_BATCH_JSON_BYTES
    answer_bytes = (num_micro_batches * per_micro_batch + num_sequences * index_bytes
                    + num_spanning * (per_list_bytes * world_size + _MICRO_BATCH_JSON_BYTES))
    return PlanCost(num_micro_batches=num_micro_batches + num_spanning, cells=cells, answer_bytes=answer_bytes)


def search_seconds(search_budget: int, cells: int) -> float:
    """An upper estimate of the time ``search_budget`` units of search take on a batch of ``cells`` (each unit
    costs one sequence's move; measured 4-14 µs at 576-2304 cells and about 100 µs at 135 K on 2 cores, which
    √cells µs bounds)."""
    return search_budget * 1e-6 * math.sqrt(cells)


def feedback_cells(body: bytes) -> int:
    """Lists and lengths a raw /feedback body can hold at most: every list opens with ``[`` and every further
    item follows a ``,`` (C-speed counting, no parsing)."""
    return body.count(b"[") + body.count(b",")
