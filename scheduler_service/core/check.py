"""The plan checker: one solver-agnostic validator for every scheduler's output.

A valid plan schedules every index exactly once, has ``dp_size`` DP entries and
``cp_size`` local lists per micro-batch, every hybrid group is an aligned block
(size ``s`` with ``2 <= s < cp_size``, ``s`` divides ``cp_size``, first rank a
multiple of ``s``), and for every micro-batch and CP rank ``r``:
``sum(len of local[r]) + sum(len of distributed) / cp_size
+ sum over groups g containing r of sum(len of g) / size(g) <= bucket_size``
(eq. 7, extended to groups). The bound is checked in exact integers
(multiplied through by cp_size, which every group size divides).

A spanning micro-batch (``plan.SpanningMicroBatch``) is checked as a micro-batch of its block's
``num_dp_ranks × cp_size`` ranks, the block an aligned run of DP replicas (``spanning_block_violation``); its
violations name it (``spanning[p]``), its DP replicas and the world ranks involved.

``find_violations`` checks a ``Plan`` as it travels (the service checks what it
answers, the trainer what it receives) and says every violation in a sentence.
``check_places`` checks the arrays a compiled scheduler returns, in a few numpy
operations, before the plan is built from them; where they break the contract it
raises with ``find_violations``'s sentences. Neither shares code with the
schedulers it checks: a bug in the searches' own memory accounting cannot hide
itself here.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from scheduler_service.core.errors import PlanCheckError
from scheduler_service.core.plan import Collective, MicroBatch, Places, Plan, block_degrees, cp_blocks

__all__ = ["block_violation", "check_places", "check_plan", "check_schemes", "find_violations", "scheme_violation",
           "spanning_block_violation", "spanning_widths"]


def block_violation(cp_ranks: tuple[int, ...], cp_size: int) -> str | None:
    """Why ``cp_ranks`` is not a hybrid group's aligned block of a CP group of ``cp_size`` (None when it is): the
    one block rule, for plans and for what a trainer reports of them."""
    degree = len(cp_ranks)
    if not 2 <= degree < cp_size or cp_size % degree:
        return f"has {degree} CP ranks; a group needs 2 <= size < cp_size {cp_size} and a size dividing it"
    if cp_ranks not in cp_blocks(cp_size, degree):
        return f"CP ranks {list(cp_ranks)} are not an aligned block (consecutive, starting at a multiple of {degree})"
    return None


def scheme_violation(collective: Collective, heads: tuple[int, int] | None, *, spanning: bool = False) -> str | None:
    """Why ``collective``'s scheme cannot run (None when it can): its Ulysses degree ``u`` must divide its degree;
    with the model's ``heads`` (query, K/V), ``u`` must divide the query heads and the K/V heads divide ``u`` or
    ``u`` them (docs/concepts/schemes.md: heads are never split unevenly); a spanning micro-batch runs no 2D
    collective (the trainer makes strided groups only within a CP group)."""
    degree, ulysses_degree = collective.degree, collective.ulysses_degree
    if ulysses_degree < 1 or degree % ulysses_degree:
        return (f"asks for Ulysses degree {ulysses_degree} over {degree} ranks; it must divide the block's size "
                f"(1: all-gather-KV, {degree}: Ulysses, a divisor between: 2D)")
    if spanning and 1 < ulysses_degree < degree:
        return (f"asks for 2D (Ulysses degree {ulysses_degree} over {degree} ranks) in a spanning micro-batch; "
                "only all-gather-KV and Ulysses run across DP replicas")
    if heads is None or ulysses_degree == 1:
        return None
    num_heads, num_kv_heads = heads
    if num_heads % ulysses_degree or (num_kv_heads % ulysses_degree and ulysses_degree % num_kv_heads):
        working = [u for u in range(1, degree + 1) if degree % u == 0 and num_heads % u == 0
                   and (num_kv_heads % u == 0 or u % num_kv_heads == 0)]
        return (f"asks for Ulysses degree {ulysses_degree}: the model's {num_heads} query and {num_kv_heads} K/V "
                f"heads do not split evenly over {ulysses_degree} ranks (degrees that would: "
                f"{', '.join(map(str, working))})")
    return None


def spanning_widths(dp_size: int) -> tuple[int, ...]:
    """How many DP replicas a spanning block may have: the powers of two from 2 up to ``dp_size``, and
    ``dp_size`` itself (the whole world). A trainer creates the process groups of every such block up front."""
    powers = [1 << shift for shift in range(1, dp_size.bit_length()) if 1 << shift <= dp_size]
    return tuple(sorted({*powers, dp_size} - {1}))


def spanning_block_violation(first_dp_rank: int, num_dp_ranks: int, dp_size: int) -> str | None:
    """Why DP replicas ``first_dp_rank .. + num_dp_ranks − 1`` are not a spanning block of ``dp_size`` replicas
    (None when they are): a width of ``spanning_widths``, consecutive, starting at a multiple of their number,
    within the world."""
    if num_dp_ranks not in spanning_widths(dp_size):
        return (f"spans {num_dp_ranks} DP replica(s); a spanning block of dp_size {dp_size} spans "
                f"{', '.join(map(str, spanning_widths(dp_size))) or 'nothing: one replica cannot span'}")
    if first_dp_rank < 0 or first_dp_rank % num_dp_ranks or first_dp_rank + num_dp_ranks > dp_size:
        return (f"DP replicas {first_dp_rank}..{first_dp_rank + num_dp_ranks - 1} are not an aligned block of "
                f"dp_size {dp_size} (consecutive, starting at a multiple of {num_dp_ranks})")
    return None


def _memory_violations(
    micro_batch: MicroBatch, sequence_lengths: Sequence[int], cp_size: int, bucket_size: int, where: str,
    first_world_rank: int | None = None,
) -> list[str]:
    """The bound per CP rank in 1/cp_size-token units: local × N, distributed × 1, a group of size s × N/s; the
    sums are spelt out only for the ranks over it. ``first_world_rank``: the micro-batch spans DP replicas, its
    ``cp_size`` ranks are the world's from there (and named so)."""
    num_sequences = len(sequence_lengths)

    def tokens(indices: Sequence[int]) -> int:
        return sum(sequence_lengths[i] for i in indices if 0 <= i < num_sequences)

    distributed = tokens(micro_batch.distributed)
    local = [tokens(rank_local) for rank_local in micro_batch.local]
    units = [rank_tokens * cp_size + distributed for rank_tokens in local]
    group_tokens = [tokens(group.sequences) for group in micro_batch.sharded]
    for group, sharded_tokens in zip(micro_batch.sharded, group_tokens, strict=True):
        for cp_rank in group.cp_ranks:
            units[cp_rank] += sharded_tokens * (cp_size // group.degree)
    violations = []
    for cp_rank in range(cp_size):
        if units[cp_rank] > bucket_size * cp_size:
            terms = [f"{local[cp_rank]} local", f"{distributed}/{cp_size} distributed"] + [
                f"{sharded_tokens}/{group.degree} sharded over {list(group.cp_ranks)}"
                for group, sharded_tokens in zip(micro_batch.sharded, group_tokens, strict=True)
                if cp_rank in group.cp_ranks]
            rank = (f"CP rank {cp_rank}" if first_world_rank is None
                    else f"world rank {first_world_rank + cp_rank} (block rank {cp_rank})")
            violations.append(f"{where} {rank} holds {' + '.join(terms)} tokens > bucket_size {bucket_size}")
    return violations


def find_violations(
    plan: Plan, *, sequence_lengths: Sequence[int], dp_size: int, cp_size: int, bucket_size: int,
    heads: tuple[int, int] | None = None,
) -> list[str]:
    """Every way ``plan`` breaks the contract, as readable sentences (empty when valid). ``heads``: the model's
    query and K/V heads, which every Ulysses or 2D collective must split evenly (``scheme_violation``)."""
    violations: list[str] = []
    num_sequences = len(sequence_lengths)
    if len(plan.dp_ranks) != dp_size:
        violations.append(f"plan has {len(plan.dp_ranks)} DP entries; dp_size is {dp_size}")
    seen: list[str | None] = [None] * num_sequences  # where each sequence was scheduled first

    def check_micro_batch(micro_batch: MicroBatch, where: str, group_size: int,
                          first_world_rank: int | None = None) -> None:
        if len(micro_batch.local) != group_size:
            ranks = f"cp_size is {cp_size}" if first_world_rank is None else f"its block has {group_size} ranks"
            violations.append(f"{where} has {len(micro_batch.local)} local lists; {ranks}")
        indices = micro_batch.indices()
        if not indices:
            violations.append(f"{where} is empty")
        for index in indices:
            if not 0 <= index < num_sequences:
                violations.append(f"{where} names index {index}; the batch has {num_sequences} sequences")
            elif seen[index] is not None:
                violations.append(f"sequence {index} is scheduled twice: in {seen[index]} and {where}")
            else:
                seen[index] = where
        blocks_valid = len(micro_batch.local) == group_size
        for group_index, group in enumerate(micro_batch.sharded):
            problem = block_violation(group.cp_ranks, group_size)
            if problem is not None:
                violations.append(f"{where}.sharded[{group_index}] {problem}")
                blocks_valid = False
            if not group.sequences:
                violations.append(f"{where}.sharded[{group_index}] holds no sequence")
        for collective in micro_batch.collectives():
            if not 0 < collective.degree <= group_size:
                continue  # a bad block, named above
            scheme_problem = scheme_violation(collective, heads, spanning=first_world_rank is not None)
            if scheme_problem is not None:
                block_ranks = list(range(collective.first_rank, collective.first_rank + collective.degree))
                violations.append(f"{where} collective over ranks {block_ranks} {scheme_problem}")
        if blocks_valid:  # the memory bound is only defined over the group's ranks and valid blocks
            violations.extend(_memory_violations(micro_batch, sequence_lengths, group_size, bucket_size, where,
                                                 first_world_rank))

    for position, spanning in enumerate(plan.spanning):
        block_problem = spanning_block_violation(spanning.first_dp_rank, spanning.num_dp_ranks, dp_size)
        if block_problem is not None:
            violations.append(f"spanning[{position}] {block_problem}")
            continue
        world_ranks = spanning.world_ranks(cp_size)
        check_micro_batch(spanning.micro_batch,
                          f"spanning[{position}] (DP replicas {spanning.first_dp_rank}..{spanning.dp_ranks[-1]}, "
                          f"world ranks {world_ranks[0]}..{world_ranks[-1]})",
                          spanning.num_dp_ranks * cp_size, world_ranks[0])
    for dp_rank, dp_plan in enumerate(plan.dp_ranks):
        for micro_batch_index, micro_batch in enumerate(dp_plan.micro_batches):
            check_micro_batch(micro_batch, f"dp_ranks[{dp_rank}].micro_batches[{micro_batch_index}]", cp_size)
    missing = [index for index in range(num_sequences) if seen[index] is None]
    if missing:
        shown = ", ".join(map(str, missing[:10])) + (" …" if len(missing) > 10 else "")
        violations.append(f"{len(missing)} sequences are not scheduled: {shown}")
    return violations


def check_plan(
    plan: Plan, *, sequence_lengths: Sequence[int], dp_size: int, cp_size: int, bucket_size: int,
    heads: tuple[int, int] | None = None,
) -> None:
    """Raise ``PlanCheckError`` listing every violation; return quietly for a valid plan."""
    violations = find_violations(
        plan, sequence_lengths=sequence_lengths, dp_size=dp_size, cp_size=cp_size, bucket_size=bucket_size,
        heads=heads,
    )
    if violations:
        raise PlanCheckError(violations)


def check_schemes(plan: Plan, *, heads: tuple[int, int]) -> None:
    """Raise ``PlanCheckError`` where a collective's scheme cannot run (``scheme_violation``): what a plan checked
    as places (``check_places``, all-gather-KV) needs once its schemes are chosen."""
    violations = []
    for dp_rank, dp_plan in enumerate(plan.dp_ranks):
        for index, micro_batch in enumerate(dp_plan.micro_batches):
            if micro_batch.distributed_ulysses_degree == 1 and all(g.ulysses_degree == 1 for g in micro_batch.sharded):
                continue  # all-gather-KV runs whatever the heads
            violations += [f"dp_ranks[{dp_rank}].micro_batches[{index}] collective over ranks "
                           f"{collective.first_rank}..{collective.first_rank + collective.degree - 1} {problem}"
                           for collective in micro_batch.collectives()
                           if (problem := scheme_violation(collective, heads)) is not None]
    for position, spanning in enumerate(plan.spanning):
        violations += [f"spanning[{position}] collective over block ranks {collective.first_rank}.."
                       f"{collective.first_rank + collective.degree - 1} {problem}"
                       for collective in spanning.micro_batch.collectives()
                       if (problem := scheme_violation(collective, heads, spanning=True)) is not None]
    if violations:
        raise PlanCheckError(violations)


def _places_valid(places: Places, lengths: npt.NDArray[np.int64], cp_size: int, bucket_size: int) -> bool:
    """Every sequence in a micro-batch, at a place (whole on a rank, an aligned block, or the whole group) whose
    ranks all stay within the memory bound."""
    degree, first_rank, micro_batch = places.degree, places.first_rank, places.micro_batch
    if (micro_batch < 0).any() or (micro_batch >= places.num_micro_batches).any():
        return False
    if places.num_micro_batches and np.bincount(micro_batch, minlength=places.num_micro_batches).min() == 0:
        return False  # an empty micro-batch
    if not np.isin(degree, (1, *block_degrees(cp_size), cp_size)).all() or (first_rank % degree).any() \
            or (first_rank < 0).any() or (first_rank + degree > cp_size).any():
        return False
    # every (sequence, rank of its block): S·N/s units there (float64 sums of integers far below 2^53: exact)
    repeated = np.repeat(np.arange(len(degree)), degree)
    offsets = np.arange(len(repeated)) - np.repeat(np.cumsum(degree) - degree, degree)
    ranks = micro_batch[repeated] * cp_size + first_rank[repeated] + offsets
    units = np.bincount(ranks, weights=(lengths * (cp_size // degree))[repeated],
                        minlength=places.num_micro_batches * cp_size)
    return bool(units.max(initial=0) <= bucket_size * cp_size)


def check_places(places: Places, *, sequence_lengths: npt.NDArray[np.int64], dp_size: int, cp_size: int,
                 bucket_size: int) -> None:
    """Raise ``PlanCheckError`` (with ``find_violations``'s sentences) unless ``places`` is a valid plan."""
    if not _places_valid(places, sequence_lengths, cp_size, bucket_size) or \
            (places.dp_rank >= dp_size).any() or (places.dp_rank < 0).any():
        plan = Plan.from_places(places, dp_size=max(dp_size, int(places.dp_rank.max(initial=0)) + 1),
                                cp_size=cp_size)
        raise PlanCheckError(find_violations(plan, sequence_lengths=sequence_lengths.tolist(), dp_size=dp_size,
                                             cp_size=cp_size, bucket_size=bucket_size))
