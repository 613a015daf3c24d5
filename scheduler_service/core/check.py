"""The plan checker: one solver-agnostic validator for every scheduler's output.

A valid plan schedules every index exactly once, has ``dp_size`` DP entries and
``cp_size`` local lists per micro-batch, and for every micro-batch and CP rank
``r``: ``sum(len of local[r]) + sum(len of distributed) / cp_size <= bucket_size``
(eq. 7). The bound is checked in exact integers (multiplied through by cp_size).
"""

from __future__ import annotations

from collections.abc import Sequence

from scheduler_service.core.errors import PlanCheckError
from scheduler_service.core.plan import Plan

__all__ = ["check_plan", "find_violations"]


def find_violations(
    plan: Plan, *, sequence_lengths: Sequence[int], dp_size: int, cp_size: int, bucket_size: int
) -> list[str]:
    """Every way ``plan`` breaks the contract, as readable sentences (empty when valid)."""
    violations: list[str] = []
    num_sequences = len(sequence_lengths)
    if len(plan.dp_ranks) != dp_size:
        violations.append(f"plan has {len(plan.dp_ranks)} DP entries; dp_size is {dp_size}")
    seen: dict[int, str] = {}
    for dp_rank, dp_plan in enumerate(plan.dp_ranks):
        for micro_batch_index, micro_batch in enumerate(dp_plan.micro_batches):
            where = f"dp_ranks[{dp_rank}].micro_batches[{micro_batch_index}]"
            if len(micro_batch.local) != cp_size:
                violations.append(f"{where} has {len(micro_batch.local)} local lists; cp_size is {cp_size}")
            if not micro_batch.indices():
                violations.append(f"{where} is empty")
            for index in micro_batch.indices():
                if not 0 <= index < num_sequences:
                    violations.append(f"{where} names index {index}; the batch has {num_sequences} sequences")
                elif index in seen:
                    violations.append(f"sequence {index} is scheduled twice: in {seen[index]} and {where}")
                else:
                    seen[index] = where
            distributed_tokens = sum(sequence_lengths[i] for i in micro_batch.distributed if 0 <= i < num_sequences)
            for cp_rank, rank_local in enumerate(micro_batch.local):
                local_tokens = sum(sequence_lengths[i] for i in rank_local if 0 <= i < num_sequences)
                if local_tokens * cp_size + distributed_tokens > bucket_size * cp_size:
                    violations.append(
                        f"{where} CP rank {cp_rank} holds {local_tokens} local + {distributed_tokens}/{cp_size} "
                        f"distributed tokens > bucket_size {bucket_size}"
                    )
    missing = [index for index in range(num_sequences) if index not in seen]
    if missing:
        shown = ", ".join(map(str, missing[:10])) + (" …" if len(missing) > 10 else "")
        violations.append(f"{len(missing)} sequences are not scheduled: {shown}")
    return violations


def check_plan(
    plan: Plan, *, sequence_lengths: Sequence[int], dp_size: int, cp_size: int, bucket_size: int
) -> None:
    """Raise ``PlanCheckError`` listing every violation; return quietly for a valid plan."""
    violations = find_violations(
        plan, sequence_lengths=sequence_lengths, dp_size=dp_size, cp_size=cp_size, bucket_size=bucket_size
    )
    if violations:
        raise PlanCheckError(violations)
