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
might gain (``options``: a bound on what any rank of the block can gain), so most collectives cost a few array
operations (``make bench``'s latency table has its cost). A degree whose heads do not split
evenly, and one whose all-to-all the profile did not measure, is never chosen (``PerformanceModel.
ulysses_degrees``); a profile without an ``all_to_all`` table chooses nothing and says why (``schemes_note``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numba
import numpy as np
import numpy.typing as npt
from numba import types

from scheduler_service.core.costing import (
    SUMS,
    TABLES,
    CostTables,
    RankSums,
    changed_micro_batch_time_s,
    empty_sums,
    micro_batch_time_s,
    sum_rank_time_s,
    sums_of_places,
)
from scheduler_service.core.errors import InvalidRequestError
from scheduler_service.core.jit import BOOL_1D, kernel
from scheduler_service.core.plan import (
    Collective,
    DPRankPlan,
    MicroBatch,
    Places,
    Plan,
    PlanningProblem,
    SpanningMicroBatch,
)

__all__ = ["OPTIONS", "BlockChange", "Options", "apply_change", "block_changes", "choose", "choose_schemes", "options",
           "scheme_sums", "schemes_note"]

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
            raise InvalidRequestError(f"a collective of Ulysses degree {ulysses_degree} over {degree} ranks cannot be "
                                      f"priced: profile {perf.profile.name} has no all_to_all table for it",
                                      field="profile")
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


def apply_change(sums: RankSums, m: int, change: BlockChange) -> None:
    """Add ``change`` to every rank of its block in row ``m`` of ``sums``."""
    ranks = slice(change.first_rank, change.first_rank + change.degree)
    sums.work_flops[m, ranks] += change.work_flops
    sums.all_gather_s[m, ranks] += change.hidden_forward_s
    sums.reduce_scatter_s[m, ranks] += change.hidden_backward_s
    sums.exposed_s[m, ranks] += change.exposed_s


def scheme_sums(problem: PlanningProblem, sums: RankSums, micro_batches: Sequence[MicroBatch],
                rows: Sequence[int] | None = None) -> list[tuple[int, BlockChange]]:
    """Add to ``sums`` (row ``rows[i]``, default ``i``, holding ``micro_batches[i]`` as the kernels price it,
    all-gather-KV) what each collective's own scheme changes; the changes made, by row."""
    changes = []
    for i, micro_batch in enumerate(micro_batches):
        m = i if rows is None else rows[i]
        for change in block_changes(problem, micro_batch):
            apply_change(sums, m, change)
            changes.append((m, change))
    return changes


class Options(NamedTuple):
    """The schemes a plan's collectives might take (``options``), one row each, rows of one collective together,
    the collectives of a micro-batch together, in the order the choice tries them; what each changes on each rank
    of its block is a ``BlockChange``'s fields."""

    micro_batch: IntArray  # (O,)
    collective: IntArray  # (O,) an id shared by the rows of one collective
    first_rank: IntArray  # (O,)
    degree: IntArray  # (O,)
    ulysses_degree: IntArray  # (O,)
    work_flops: FloatArray  # (O,)
    hidden_forward_s: FloatArray  # (O,)
    hidden_backward_s: FloatArray  # (O,)
    exposed_s: FloatArray  # (O,)

    def change(self, row: int) -> BlockChange:
        return BlockChange(int(self.first_rank[row]), int(self.degree[row]), float(self.work_flops[row]),
                           float(self.hidden_forward_s[row]), float(self.hidden_backward_s[row]),
                           float(self.exposed_s[row]))


def options(problem: PlanningProblem, places: Places, sums: RankSums, *, allow_2d: bool) -> Options:
    """The schemes the collectives of ``places`` (``sums`` their per-rank sums) might take to make their micro-batch
    faster. All collectives are priced at once (sums by collective, ``np.bincount``), and a scheme is kept only where
    it might gain: on rank ``r`` of the block, each ``max(0, ·)`` of ``T_r`` falls by at most what leaves it and by
    at most what it was, so ``T_r`` falls by at most ``min(AG, exposed forward_r) + min(RS, exposed backward_r)`` of
    the collective's all-gather-KV communication, less what the scheme adds, ``α·Δwork + exposed``; where that is not
    positive on any rank, none gets faster. A micro-batch's collectives are tried the one that saves most work first."""
    perf, lengths, alpha, tables = problem.perf, problem.lengths, problem.alpha_s_per_flop, problem.tables
    attention_s = alpha * sums.attention_flops
    exposed_forward = np.maximum(0.0, sums.all_gather_s - tables.attention_forward_share * attention_s)
    exposed_backward = np.maximum(0.0, sums.reduce_scatter_s - (1 - tables.attention_forward_share) * attention_s)
    sharded = np.flatnonzero((places.micro_batch >= 0) & (places.degree > 1))
    degree, first_rank = places.degree[sharded], places.first_rank[sharded]
    size = tables.cp_size + 1  # a collective's key: (micro-batch, first rank, degree) as one number
    keys, inverse = np.unique((places.micro_batch[sharded] * size + first_rank) * size + degree, return_inverse=True)
    collectives = np.stack([keys // size // size, keys // size % size, keys % size], axis=1)
    tokens = np.bincount(inverse, weights=lengths[sharded], minlength=len(collectives))
    parts: list[tuple[npt.NDArray[np.generic], ...]] = []  # (collective, u, Δwork, Δforward, Δbackward, exposed)
    for block_degree in np.unique(collectives[:, 2]).tolist():
        candidates = [u for u in perf.ulysses_degrees(block_degree) if allow_2d or u == block_degree]
        if not candidates:
            continue
        members = degree == block_degree
        ids, indices = inverse[members], sharded[members]
        gathered = perf.scheme_comm(block_degree, 1)
        assert gathered is not None
        base_work = np.bincount(ids, weights=problem.rank_flops_at(block_degree)[indices], minlength=len(collectives))
        block_lengths = lengths[indices]
        held = np.unique(ids)  # the collectives over blocks of this degree
        held_tokens = tokens[held]
        forward = gathered.hidden_forward.slope * held_tokens + gathered.hidden_forward.intercept
        backward = gathered.hidden_backward.slope * held_tokens + gathered.hidden_backward.intercept
        rows, blocks = collectives[held, 0], collectives[held, 1] // block_degree
        can_leave = (np.minimum(forward, _block_most(exposed_forward, rows, blocks, block_degree))
                     + np.minimum(backward, _block_most(exposed_backward, rows, blocks, block_degree)))
        for ulysses_degree in candidates:
            comm = perf.scheme_comm(block_degree, ulysses_degree)
            assert comm is not None
            # priced here for the sequences it concerns (a batch shards few of its sequences over each degree)
            scheme_flops = perf.placement_flops(block_lengths, block_degree, ulysses_degree)
            delta_work = (np.bincount(ids, weights=scheme_flops, minlength=len(collectives)) - base_work)[held]
            exposed = comm.exposed.slope * held_tokens + comm.exposed.intercept
            kept = np.flatnonzero(alpha * delta_work + exposed < can_leave)  # else no rank of the block gets faster
            kept_tokens = held_tokens[kept]
            parts.append((held[kept], np.full(len(kept), ulysses_degree), delta_work[kept],
                          comm.hidden_forward.slope * kept_tokens + comm.hidden_forward.intercept - forward[kept],
                          comm.hidden_backward.slope * kept_tokens + comm.hidden_backward.intercept - backward[kept],
                          exposed[kept]))
    merged: list[npt.NDArray[np.generic]] = [np.concatenate([part[field] for part in parts]) if parts
                                              else np.zeros(0) for field in range(6)]
    collective, scheme_degree = merged[0].astype(np.int64), merged[1].astype(np.int64)
    work, more_forward, more_backward, exposed = (field.astype(np.float64) for field in merged[2:])
    saving = np.full(len(collectives), np.inf)
    np.minimum.at(saving, collective, work)  # the most work a collective's schemes save (most negative first)
    order = np.lexsort((scheme_degree, collective, saving[collective], collectives[collective, 0]))
    return Options(micro_batch=np.ascontiguousarray(collectives[collective[order], 0]),
                   collective=np.ascontiguousarray(collective[order]),
                   first_rank=np.ascontiguousarray(collectives[collective[order], 1]),
                   degree=np.ascontiguousarray(collectives[collective[order], 2]),
                   ulysses_degree=scheme_degree[order], work_flops=work[order],
                   hidden_forward_s=more_forward[order], hidden_backward_s=more_backward[order],
                   exposed_s=exposed[order])


def _block_most(values: FloatArray, rows: IntArray, blocks: IntArray, degree: int) -> FloatArray:
    """The largest of ``values`` (M, C) over each aligned block of ``degree`` ranks ``blocks`` of rows ``rows``."""
    return values.reshape(len(values), -1, degree).max(axis=2)[rows, blocks]


_NO_ROWS, _NO_TIMES = np.zeros(1, dtype=np.int64), np.zeros(1)
OPTIONS = numba.typeof(Options(micro_batch=_NO_ROWS, collective=_NO_ROWS, first_rank=_NO_ROWS, degree=_NO_ROWS,
                               ulysses_degree=_NO_ROWS, work_flops=_NO_TIMES, hidden_forward_s=_NO_TIMES,
                               hidden_backward_s=_NO_TIMES, exposed_s=_NO_TIMES))


@kernel(types.void(TABLES, SUMS, OPTIONS, BOOL_1D))
def choose(tables: CostTables, sums: RankSums, options: Options, chosen: npt.NDArray[np.bool_]) -> None:
    """Greedy, per micro-batch, in the options' order: each collective takes its option under which the micro-batch
    is fastest, where that is faster than it is (by more than ``MIN_GAIN`` of it), and ``sums`` takes its change; a
    collective whose block holds none of the micro-batch's slowest ranks is passed over (nothing it changes can make
    the micro-batch faster). ``chosen`` marks the options taken."""
    num_options = options.micro_batch.shape[0]
    i = 0
    while i < num_options:
        m = options.micro_batch[i]
        best_s = micro_batch_time_s(tables, sums, m)
        while i < num_options and options.micro_batch[i] == m:
            first_rank, degree, collective = options.first_rank[i], options.degree[i], options.collective[i]
            block_s = 0.0
            for r in range(first_rank, first_rank + degree):
                block_s = max(block_s, sum_rank_time_s(tables, sums, m, r))
            best = -1
            while i < num_options and options.collective[i] == collective:
                if block_s >= best_s:
                    time_s = changed_micro_batch_time_s(tables, sums, m, first_rank, degree, options.work_flops[i],
                                                        options.hidden_forward_s[i], options.hidden_backward_s[i],
                                                        options.exposed_s[i])
                    if time_s < best_s * (1.0 - MIN_GAIN):
                        best_s, best = time_s, i
                i += 1
            if best >= 0:
                chosen[best] = True
                for r in range(first_rank, first_rank + degree):
                    sums.work_flops[m, r] += options.work_flops[best]
                    sums.all_gather_s[m, r] += options.hidden_forward_s[best]
                    sums.reduce_scatter_s[m, r] += options.hidden_backward_s[best]
                    sums.exposed_s[m, r] += options.exposed_s[best]


def _with_degrees(micro_batch: MicroBatch, m: int, chosen: dict[tuple[int, int, int], int]) -> MicroBatch:
    degrees = [chosen.get((m, c.first_rank, c.degree), 1) for c in micro_batch.collectives()]
    return micro_batch if degrees == [1] * len(degrees) else micro_batch.with_ulysses_degrees(degrees)


def _choose_in(problem: PlanningProblem, micro_batches: Sequence[MicroBatch], places: Places, *,
               allow_2d: bool, joined: bool) -> tuple[list[MicroBatch], list[tuple[int, BlockChange]]]:
    """``micro_batches`` (all-gather-KV) with their schemes chosen, and the changes made (by micro-batch number of
    ``places``, ``scheme_sums``'s). A micro-batch with two collectives over one block keeps all-gather-KV: its
    collectives share one fixed cost, which a per-collective change does not price. ``joined``: the micro-batches
    were made from ``places`` (``Plan.from_places``: ordered as ``Places.plan_order`` says, the collectives of a
    block joined, so none is looked for); else ``places`` are theirs (``Plan.places``: one number each, in order)."""
    sums = empty_sums(problem.tables, places.num_micro_batches)
    sums_of_places(problem.tables, sums, places.micro_batch, places.degree, places.first_rank)
    found = options(problem, places, sums, allow_2d=allow_2d)
    if not len(found.micro_batch):
        return list(micro_batches), []
    order = places.plan_order() if joined else list(range(len(micro_batches)))  # micro_batches[i]'s number
    if not joined:
        position = {m: i for i, m in enumerate(order)}

        def shares_a_block(m: int) -> bool:
            blocks = [(c.first_rank, c.degree) for c in micro_batches[position[m]].collectives()]
            return len(set(blocks)) < len(blocks)

        shared = [m for m in np.unique(found.micro_batch).tolist() if shares_a_block(m)]
        found = Options._make(field[~np.isin(found.micro_batch, shared)] for field in found)
    chosen = np.zeros(len(found.micro_batch), dtype=np.bool_)
    choose(problem.tables, sums, found, chosen)
    rows = np.flatnonzero(chosen).tolist()
    degrees = {(int(found.micro_batch[row]), int(found.first_rank[row]), int(found.degree[row])):
               int(found.ulysses_degree[row]) for row in rows}
    changes = [(int(found.micro_batch[row]), found.change(row)) for row in rows]
    changed = {m for m, _, _ in degrees}
    return ([_with_degrees(mb, order[i], degrees) if order[i] in changed else mb for i, mb in enumerate(micro_batches)],
            changes)


def choose_schemes(problem: PlanningProblem, plan: Plan, places: Places | None = None) -> tuple[
        Plan, list[tuple[int, BlockChange]]]:
    """``plan`` with each collective's fastest scheme (module docstring), ``plan`` itself where none changes, and
    the changes its own micro-batches took, by micro-batch number of ``places`` (``estimate_plan``'s ``changes``).
    ``places``: the places ``plan``'s own micro-batches were made from (``Plan.from_places``), when the caller has
    them; else the plan's (``Plan.places``)."""
    if not problem.perf.has_all_to_all() or not _has_collectives(plan):
        return plan, []
    own = [micro_batch for dp_plan in plan.dp_ranks for micro_batch in dp_plan.micro_batches]
    chosen_own, changes = _choose_in(problem, own, plan.places(problem.num_sequences) if places is None else places,
                                     allow_2d=True, joined=places is not None)
    chosen = iter(chosen_own)
    dp_ranks = tuple(DPRankPlan(micro_batches=tuple(next(chosen) for _ in dp_plan.micro_batches))
                     for dp_plan in plan.dp_ranks)
    spanning = []
    for spanning_micro_batch in plan.spanning:
        span = problem.span_problem(spanning_micro_batch.num_dp_ranks)
        block_plan = Plan(dp_ranks=(DPRankPlan(micro_batches=(spanning_micro_batch.micro_batch,)),))
        # 2D needs strided groups of world ranks, which the trainer makes only within a CP group
        [micro_batch], _ = _choose_in(span, [spanning_micro_batch.micro_batch],
                                      block_plan.places(problem.num_sequences), allow_2d=False, joined=False)
        spanning.append(SpanningMicroBatch(first_dp_rank=spanning_micro_batch.first_dp_rank,
                                           num_dp_ranks=spanning_micro_batch.num_dp_ranks, micro_batch=micro_batch))
    unchanged = all(new is old for new, old in zip(chosen_own, own, strict=True)) and all(
        new.micro_batch is old.micro_batch for new, old in zip(spanning, plan.spanning, strict=True))
    return (plan if unchanged else Plan(dp_ranks=dp_ranks, spanning=tuple(spanning))), changes


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
    if not degrees or any(perf.ulysses_degrees(degree) for degree in degrees):
        return None
    model = perf.model
    if not any(degree % u == 0 and perf.heads_allow(u) for degree in degrees for u in range(2, degree + 1)):
        return (f"every collective uses all-gather-KV: no block size of cp_size {problem.cp_size} "
                f"({', '.join(map(str, sorted(degrees)))}) has a divisor above 1 that splits {model.name}'s "
                f"{model.num_attention_heads} query and {model.num_key_value_heads} K/V heads evenly")
    return (f"every collective uses all-gather-KV: profile {perf.profile.name} cannot price the all-to-all of the "
            f"Ulysses degrees {model.name}'s heads allow (their groups cross nodes, and the profile has no "
            "inter-node all_to_all table)")
