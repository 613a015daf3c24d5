"""Collective schemes: how each collective of a plan moves its attention's data, priced and chosen per collective.

A **collective** is the set of sequences one micro-batch shards over one aligned block of ``s`` ranks (``plan.
Collective``). Its scheme is named by its **Ulysses degree** ``u``, a divisor of ``s`` (``CollectiveScheme.of``):

* ``u = 1``, all-gather-KV (DACP's, after Llama 3): zigzag shards, K/V all-gathered over the block, hidden behind
  local attention; what every search prices (``costing``);
* ``u = s``, Ulysses (DeepSpeed Ulysses, as XTuner and SWIFT run it): contiguous shards, all-to-all over heads; each
  rank attends whole sequences for ``H/u`` heads, one call per sequence at the whole length's efficiency;
* ``1 < u < s``, 2D (USP's layout): Ulysses over ``u`` consecutive ranks, all-gather-KV across the ``s/u``
  sub-blocks.

The price of a scheme (``PerformanceModel.placement_flops`` with ``ulysses_degree``, ``PerformanceModel.
scheme_comm``) changes a block's ranks' work, the communication local attention hides (forward and backward) and
adds what nothing hides; ``scheme_sums`` adds that change to a plan's per-rank sums, so the simulator prices every
scheme with the one ``T_r`` (``costing.scheme_rank_time_s``).

``choose_schemes`` gives each collective of a plan the scheme under which its micro-batch is fastest, collective by
collective (the largest saving of work first), keeping a change only where it makes the micro-batch faster: a plan
never gets slower. The searches place sequences as all-gather-KV prices them; the choice follows. It prices every
collective of a plan at once from the places (sums by collective), and times a micro-batch only for a scheme that
might gain (``_options``: a bound on what any rank of the block can gain), so most collectives cost a few array
operations (``make bench``'s latency table has its cost). A degree whose heads do not split
evenly, and one whose all-to-all the profile did not measure, is never chosen (``PerformanceModel.
ulysses_degrees``); a profile without an ``all_to_all`` table chooses nothing and says why (``schemes_note``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from scheduler_service.core.costing import (
    RankSums,
    changed_micro_batch_time_s,
    empty_sums,
    rank_times_s,
    sum_rank_time_s,
    sums_of_places,
)
from scheduler_service.core.plan import (
    Collective,
    DPRankPlan,
    MicroBatch,
    Places,
    Plan,
    PlanningProblem,
    SpanningMicroBatch,
)

__all__ = ["BlockChange", "block_changes", "choose_schemes", "scheme_sums", "schemes_note"]

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

# A change of scheme is kept only where it saves more than this share of the micro-batch: below it the model cannot
# tell them apart, and all-gather-KV, the scheme the searches placed by, stays.
MIN_GAIN = 1e-9


@dataclass(frozen=True, slots=True)
class BlockChange:
    """What a block's collectives cost each of its ranks beyond all-gather-KV's price of the same sequences."""

    first_rank: int
    degree: int
    work_flops: float
    hidden_forward_s: float  # added to ``RankSums.all_gather_s``
    hidden_backward_s: float  # added to ``RankSums.reduce_scatter_s``
    exposed_s: float  # added to ``RankSums.exposed_s``

    @property
    def ranks(self) -> range:
        return range(self.first_rank, self.first_rank + self.degree)


def _block_price(problem: PlanningProblem, degree: int,
                 collectives: Iterable[tuple[Sequence[int], int]]) -> tuple[float, float, float, float]:
    """(work, hidden forward, hidden backward, exposed) per rank of a block holding ``collectives`` (sequences,
    Ulysses degree). The all-gather-KV ones are priced together, their fixed cost once, as the searches price a
    block; every other collective pays its own."""
    perf, lengths = problem.perf, problem.lengths
    work = hidden_forward = hidden_backward = exposed = 0.0
    gathered_tokens = 0
    for sequences, ulysses_degree in collectives:
        work += float(problem.scheme_rank_flops(degree, ulysses_degree)[list(sequences)].sum())
        tokens = int(lengths[list(sequences)].sum())
        if ulysses_degree == 1:
            gathered_tokens += tokens
            continue
        comm = perf.scheme_comm(degree, ulysses_degree)
        if comm is None:
            raise ValueError(f"a collective of Ulysses degree {ulysses_degree} over {degree} ranks cannot be priced: "
                             f"profile {perf.profile.name} has no all_to_all table for it")
        hidden_forward += comm.hidden_forward_s(tokens)
        hidden_backward += comm.hidden_backward_s(tokens)
        exposed += comm.exposed_s(tokens)
    gather = perf.scheme_comm(degree, 1)
    assert gather is not None
    return (work, hidden_forward + gather.hidden_forward_s(gathered_tokens),
            hidden_backward + gather.hidden_backward_s(gathered_tokens), exposed)


def _block_change(problem: PlanningProblem, first_rank: int, degree: int,
                  collectives: Sequence[tuple[Sequence[int], int]]) -> BlockChange:
    price = _block_price(problem, degree, collectives)
    base = _block_price(problem, degree, [([k for sequences, _ in collectives for k in sequences], 1)])
    return BlockChange(first_rank, degree, *(new - old for new, old in zip(price, base, strict=True)))


def block_changes(problem: PlanningProblem, micro_batch: MicroBatch) -> list[BlockChange]:
    """The changes of every block of ``micro_batch`` with a collective that is not all-gather-KV."""
    by_block: dict[tuple[int, int], list[Collective]] = {}
    for collective in micro_batch.collectives():
        by_block.setdefault((collective.first_rank, collective.degree), []).append(collective)
    return [_block_change(problem, first_rank, degree, [(c.sequences, c.ulysses_degree) for c in collectives])
            for (first_rank, degree), collectives in by_block.items()
            if any(c.ulysses_degree != 1 for c in collectives)]


def _apply(sums: RankSums, m: int, change: BlockChange, sign: float = 1.0) -> None:
    ranks = slice(change.first_rank, change.first_rank + change.degree)
    sums.work_flops[m, ranks] += sign * change.work_flops
    sums.all_gather_s[m, ranks] += sign * change.hidden_forward_s
    sums.reduce_scatter_s[m, ranks] += sign * change.hidden_backward_s
    sums.exposed_s[m, ranks] += sign * change.exposed_s


def scheme_sums(problem: PlanningProblem, sums: RankSums, micro_batches: Sequence[MicroBatch],
                rows: Sequence[int] | None = None) -> list[tuple[int, BlockChange]]:
    """Add to ``sums`` (row ``rows[i]``, default ``i``, holding ``micro_batches[i]`` as the kernels price it,
    all-gather-KV) what each collective's own scheme changes; the changes made, by row."""
    changes = []
    for i, micro_batch in enumerate(micro_batches):
        m = i if rows is None else rows[i]
        for change in block_changes(problem, micro_batch):
            _apply(sums, m, change)
            changes.append((m, change))
    return changes


@dataclass(frozen=True, slots=True)
class _Option:
    """One scheme a collective may take, with what it changes on each rank of its block (``BlockChange``)."""

    ulysses_degree: int
    change: BlockChange


def _options(problem: PlanningProblem, places: Places, sums: RankSums, *,
             allow_2d: bool) -> dict[tuple[int, int, int], list[_Option]]:
    """Per collective of ``places`` (micro-batch, first rank, degree; ``sums`` their per-rank sums), the schemes
    that might make its micro-batch faster, each with its change. All collectives are priced at once (sums by
    collective, ``np.bincount``), and a scheme is kept only where it might gain: on rank ``r`` of the block, each
    ``max(0, ·)`` of ``T_r`` falls by at most what leaves it and by at most what it was, so ``T_r`` falls by at most
    ``min(AG, exposed forward_r) + min(RS, exposed backward_r)`` of the collective's all-gather-KV communication, less
    what the scheme adds, ``α·Δwork + exposed``; where that is not positive on any rank, none gets faster."""
    perf, lengths, alpha, tables = problem.perf, problem.lengths, problem.alpha_s_per_flop, problem.tables
    attention_s = alpha * sums.attention_flops
    exposed_forward = np.maximum(0.0, sums.all_gather_s - tables.attention_forward_share * attention_s)
    exposed_backward = np.maximum(0.0, sums.reduce_scatter_s - (1 - tables.attention_forward_share) * attention_s)
    sharded = np.flatnonzero((places.micro_batch >= 0) & (places.degree > 1))
    if not sharded.size:
        return {}
    degree, first_rank = places.degree[sharded], places.first_rank[sharded]
    size = tables.cp_size + 1  # a collective's key: (micro-batch, first rank, degree) as one number
    keys, inverse = np.unique((places.micro_batch[sharded] * size + first_rank) * size + degree, return_inverse=True)
    collectives = np.stack([keys // size // size, keys // size % size, keys % size], axis=1)
    tokens = np.bincount(inverse, weights=lengths[sharded], minlength=len(collectives))
    options: dict[tuple[int, int, int], list[_Option]] = {}
    for block_degree in np.unique(collectives[:, 2]).tolist():
        candidates = [u for u in perf.ulysses_degrees(block_degree) if allow_2d or u == block_degree]
        if not candidates:
            continue
        members = degree == block_degree
        ids, indices = inverse[members], sharded[members]
        gathered = perf.scheme_comm(block_degree, 1)
        assert gathered is not None
        base_work = np.bincount(ids, weights=problem.rank_flops_at(block_degree)[indices], minlength=len(collectives))
        held = np.unique(ids)  # the collectives over blocks of this degree
        held_tokens = tokens[held]
        forward = gathered.hidden_forward.slope * held_tokens + gathered.hidden_forward.intercept
        backward = gathered.hidden_backward.slope * held_tokens + gathered.hidden_backward.intercept
        micro_batch, block = collectives[held, 0], collectives[held, 1] // block_degree

        def block_most(values: FloatArray, micro_batch: IntArray = micro_batch, block: IntArray = block,
                       block_degree: int = block_degree) -> FloatArray:
            return values.reshape(len(values), -1, block_degree).max(axis=2)[micro_batch, block]

        can_leave = (np.minimum(forward, block_most(exposed_forward))
                     + np.minimum(backward, block_most(exposed_backward)))
        for ulysses_degree in candidates:
            comm = perf.scheme_comm(block_degree, ulysses_degree)
            assert comm is not None
            delta_work = (np.bincount(ids, weights=problem.scheme_rank_flops(block_degree, ulysses_degree)[indices],
                                      minlength=len(collectives)) - base_work)[held]
            exposed = comm.exposed.slope * held_tokens + comm.exposed.intercept
            kept = np.flatnonzero(alpha * delta_work + exposed < can_leave)  # else no rank of the block gets faster
            if not kept.size:
                continue
            more_forward = comm.hidden_forward.slope * held_tokens[kept] + comm.hidden_forward.intercept - forward[kept]
            more_backward = (comm.hidden_backward.slope * held_tokens[kept] + comm.hidden_backward.intercept
                             - backward[kept])
            for (m, first, _), work_flops, forward_s, backward_s, exposed_s in zip(
                    collectives[held[kept]].tolist(), delta_work[kept].tolist(), more_forward.tolist(),
                    more_backward.tolist(), exposed[kept].tolist(), strict=True):
                options.setdefault((m, first, block_degree), []).append(_Option(ulysses_degree, BlockChange(
                    first, block_degree, work_flops, forward_s, backward_s, exposed_s)))
    return options


def _choose(problem: PlanningProblem, sums: RankSums, options: dict[tuple[int, int, int], list[_Option]]
            ) -> dict[tuple[int, int, int], int]:
    """The Ulysses degree of each collective with options (keyed as ``_options``): per micro-batch, the largest
    saving of work first, the option under which the micro-batch is fastest, kept only where it is faster; ``sums``
    ends holding the choice. A collective whose block holds none of the micro-batch's slowest ranks is passed over:
    nothing it changes can make the micro-batch faster."""
    tables = problem.tables
    times_s = np.zeros((len(sums.work_flops), tables.cp_size))
    rank_times_s(tables, sums, times_s)
    by_micro_batch: dict[int, list[tuple[int, int, int]]] = {}
    for key in options:
        by_micro_batch.setdefault(key[0], []).append(key)
    chosen: dict[tuple[int, int, int], int] = {}
    for m, keys in by_micro_batch.items():
        row_s = times_s[m].tolist()
        best_s = max(row_s)
        for key in sorted(keys, key=lambda key: min(option.change.work_flops for option in options[key])):
            _, first_rank, degree = key
            if max(row_s[first_rank:first_rank + degree]) < best_s:
                continue
            best: _Option | None = None
            for option in options[key]:
                change = option.change
                time_s = changed_micro_batch_time_s(tables, sums, m, first_rank, degree, change.work_flops,
                                                    change.hidden_forward_s, change.hidden_backward_s,
                                                    change.exposed_s)
                if time_s < best_s * (1.0 - MIN_GAIN):
                    best_s, best = time_s, option
            if best is not None:
                _apply(sums, m, best.change)
                for r in best.change.ranks:
                    row_s[r] = sum_rank_time_s(tables, sums, m, r)
                chosen[key] = best.ulysses_degree
    return chosen


def _with_degrees(micro_batch: MicroBatch, m: int, chosen: dict[tuple[int, int, int], int]) -> MicroBatch:
    degrees = [chosen.get((m, c.first_rank, c.degree), 1) for c in micro_batch.collectives()]
    return micro_batch if degrees == [1] * len(degrees) else micro_batch.with_ulysses_degrees(degrees)


def _choose_in(problem: PlanningProblem, micro_batches: Sequence[MicroBatch], places: Places, *,
               allow_2d: bool, joined: bool) -> list[MicroBatch]:
    """``micro_batches`` (the micro-batches of ``places``, in its order, all-gather-KV) with their schemes chosen.
    A micro-batch with two collectives over one block keeps all-gather-KV: its collectives share one fixed cost,
    which a per-collective change does not price. ``joined``: none has two (``MicroBatch.from_places`` joins them,
    so no search's plan has), and none is looked for."""
    sums = empty_sums(problem.tables, places.num_micro_batches)
    sums_of_places(problem.tables, sums, places.micro_batch, places.degree, places.first_rank)
    options = _options(problem, places, sums, allow_2d=allow_2d)
    if not options:
        return list(micro_batches)
    order = places.plan_order()  # the micro-batch number of micro_batches[i]
    position = {m: i for i, m in enumerate(order)}

    def shares_a_block(m: int) -> bool:
        blocks = [(c.first_rank, c.degree) for c in micro_batches[position[m]].collectives()]
        return len(set(blocks)) < len(blocks)

    if not joined:
        shared = {m for m in {key[0] for key in options} if shares_a_block(m)}
        options = {key: value for key, value in options.items() if key[0] not in shared}
    chosen = _choose(problem, sums, options)
    changed = {key[0] for key in chosen}
    return [_with_degrees(mb, order[i], chosen) if order[i] in changed else mb for i, mb in enumerate(micro_batches)]


def choose_schemes(problem: PlanningProblem, plan: Plan, places: Places | None = None) -> Plan:
    """``plan`` with each collective's fastest scheme (module docstring); ``plan`` itself where none changes.
    ``places``: the places ``plan``'s own micro-batches were made from (``Plan.from_places``), when the caller has
    them."""
    if not problem.perf.has_all_to_all() or not _has_collectives(plan):
        return plan
    own = [micro_batch for dp_plan in plan.dp_ranks for micro_batch in dp_plan.micro_batches]
    chosen_own = _choose_in(problem, own, plan.places(problem.num_sequences) if places is None else places,
                            allow_2d=True, joined=places is not None)
    chosen = iter(chosen_own)
    dp_ranks = tuple(DPRankPlan(micro_batches=tuple(next(chosen) for _ in dp_plan.micro_batches))
                     for dp_plan in plan.dp_ranks)
    spanning = []
    for spanning_micro_batch in plan.spanning:
        span = problem.span_problem(spanning_micro_batch.num_dp_ranks)
        block_plan = Plan(dp_ranks=(DPRankPlan(micro_batches=(spanning_micro_batch.micro_batch,)),))
        # 2D needs strided groups of world ranks, which the trainer makes only within a CP group
        [micro_batch] = _choose_in(span, [spanning_micro_batch.micro_batch],
                                   block_plan.places(problem.num_sequences), allow_2d=False, joined=False)
        spanning.append(SpanningMicroBatch(first_dp_rank=spanning_micro_batch.first_dp_rank,
                                           num_dp_ranks=spanning_micro_batch.num_dp_ranks, micro_batch=micro_batch))
    unchanged = all(new is old for new, old in zip(chosen_own, own, strict=True)) and all(
        new.micro_batch is old.micro_batch for new, old in zip(spanning, plan.spanning, strict=True))
    return plan if unchanged else Plan(dp_ranks=dp_ranks, spanning=tuple(spanning))


def _has_collectives(plan: Plan) -> bool:
    micro_batches = [mb for dp_plan in plan.dp_ranks for mb in dp_plan.micro_batches]
    micro_batches += [spanning.micro_batch for spanning in plan.spanning]
    return any(mb.distributed or mb.sharded for mb in micro_batches)


def schemes_note(problem: PlanningProblem) -> str | None:
    """Why no collective of the problem's plans can be anything but all-gather-KV, or None where some can."""
    perf = problem.perf
    if problem.cp_size == 1 and not problem.spanning:
        return None  # nothing is ever sharded: nothing to say
    if not perf.has_all_to_all():
        return (f"every collective uses all-gather-KV: profile {perf.profile.name} has no all_to_all table "
                "(communication.tables.all_to_all), so Ulysses and 2D cannot be priced; measure one with "
                "skrull-profile or --profile auto")
    degrees = {degree for degree in problem.degrees if degree > 1}
    if degrees and not any(perf.ulysses_degrees(degree) for degree in degrees):
        model = perf.model
        return (f"every collective uses all-gather-KV: no block size of cp_size {problem.cp_size} "
                f"({', '.join(map(str, sorted(degrees)))}) has a divisor above 1 that splits {model.name}'s "
                f"{model.num_attention_heads} query and {model.num_key_value_heads} K/V heads evenly")
    return None
