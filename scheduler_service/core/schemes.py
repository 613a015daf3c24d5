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
adds what nothing hides: a row of ``BlockChanges``, which ``apply_changes`` adds to a plan's per-rank sums, so the
simulator prices every scheme with the one ``T_r`` (``costing.scheme_rank_time_s``).

``choose_for_places`` gives each collective of a plan's places the scheme under which its micro-batch is fastest,
before the plan is built from them (``Plan.from_places``; ``choose_schemes`` chooses for a plan made otherwise),
collective by collective (the largest saving of work first), keeping a change only where it makes the micro-batch
faster: a plan never gets slower. The searches place sequences as all-gather-KV prices them; the choice follows. It
prices every collective of a plan at once from the places (sums by collective), and times a micro-batch only for a
scheme that might gain (``options``: a bound on what any rank of the block can gain), so most collectives cost a
few steps of one compiled pass (``make bench``'s latency table has its cost). A degree whose heads do not split
evenly, and one whose all-to-all the profile did not measure, is never chosen (``PerformanceModel.ulysses_degrees``);
a profile without an ``all_to_all`` table chooses nothing and says why (``schemes_note``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
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
from scheduler_service.core.jit import BOOL_1D, FLOAT_2D, INT_1D, kernel
from scheduler_service.core.perf_model import PerformanceModel
from scheduler_service.core.plan import (
    Collective,
    DPRankPlan,
    MicroBatch,
    Places,
    Plan,
    PlanningProblem,
    SpanningMicroBatch,
)

__all__ = ["CHANGES", "NO_CHANGES", "OPTIONS", "BlockChanges", "ChosenSchemes", "Options", "apply_change",
           "apply_changes", "choose", "choose_for_places", "choose_schemes", "options", "scheme_changes",
           "schemes_note"]

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

# A change of scheme is kept only where it saves more than this share of the micro-batch: below it the model cannot
# tell them apart, and all-gather-KV, the scheme the searches placed by, stays.
MIN_GAIN = 1e-9


class BlockChanges(NamedTuple):
    """What collectives' schemes cost each rank of their block beyond all-gather-KV's price of the same sequences:
    one row per block of a micro-batch, added to a plan's sums by ``apply_changes``."""

    micro_batch: IntArray  # (K,) the row of the sums it changes
    first_rank: IntArray  # (K,)
    degree: IntArray  # (K,)
    work_flops: FloatArray  # (K,) added to ``RankSums.work_flops``
    hidden_forward_s: FloatArray  # (K,) added to ``RankSums.all_gather_s``
    hidden_backward_s: FloatArray  # (K,) added to ``RankSums.reduce_scatter_s``
    exposed_s: FloatArray  # (K,) added to ``RankSums.exposed_s``


def _block_changes(rows: Sequence[tuple[int, int, int, float, float, float, float]]) -> BlockChanges:
    """The changes of ``rows``, each a ``BlockChanges`` row's fields in order."""
    columns: list[Sequence[float]] = list(zip(*rows, strict=True)) if rows else [()] * len(BlockChanges._fields)
    micro_batch, first_rank, degree = (np.array(column, dtype=np.int64) for column in columns[:3])
    work, hidden_forward, hidden_backward, exposed = (np.array(column, dtype=np.float64) for column in columns[3:])
    return BlockChanges(micro_batch, first_rank, degree, work, hidden_forward, hidden_backward, exposed)


NO_CHANGES = _block_changes([])
CHANGES = numba.typeof(NO_CHANGES)


@kernel(types.void(SUMS, CHANGES, types.int64), inline=True)
def apply_change(sums: RankSums, changes: BlockChanges, k: int) -> None:
    """Add row ``k`` of ``changes`` to every rank of its block."""
    m = changes.micro_batch[k]
    for r in range(changes.first_rank[k], changes.first_rank[k] + changes.degree[k]):
        sums.work_flops[m, r] += changes.work_flops[k]
        sums.all_gather_s[m, r] += changes.hidden_forward_s[k]
        sums.reduce_scatter_s[m, r] += changes.hidden_backward_s[k]
        sums.exposed_s[m, r] += changes.exposed_s[k]


@kernel(types.void(SUMS, CHANGES))
def apply_changes(sums: RankSums, changes: BlockChanges) -> None:
    """Add every row of ``changes`` to ``sums``."""
    for k in range(changes.micro_batch.shape[0]):
        apply_change(sums, changes, k)


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


def _block_change(problem: PlanningProblem, degree: int,
                  collectives: Sequence[tuple[Sequence[int], int]]) -> tuple[float, float, float, float]:
    price = _block_price(problem, degree, collectives)
    base = _block_price(problem, degree, [([k for sequences, _ in collectives for k in sequences], 1)])
    work, hidden_forward, hidden_backward, exposed = (new - old for new, old in zip(price, base, strict=True))
    return work, hidden_forward, hidden_backward, exposed


def scheme_changes(problem: PlanningProblem, micro_batches: Sequence[MicroBatch],
                   rows: Sequence[int] | None = None) -> BlockChanges:
    """What the collectives' own schemes change in ``micro_batches`` (micro-batch ``i`` in row ``rows[i]`` of the
    sums, default ``i``), beyond all-gather-KV: a row for each block with a collective that is not all-gather-KV."""
    found = []
    for i, micro_batch in enumerate(micro_batches):
        by_block: dict[tuple[int, int], list[Collective]] = {}
        for collective in micro_batch.collectives():
            by_block.setdefault((collective.first_rank, collective.degree), []).append(collective)
        found += [(i if rows is None else rows[i], first_rank, degree,
                   *_block_change(problem, degree, [(c.sequences, c.ulysses_degree) for c in collectives]))
                  for (first_rank, degree), collectives in by_block.items()
                  if any(c.ulysses_degree != 1 for c in collectives)]
    return _block_changes(found)


class Options(NamedTuple):
    """The schemes a plan's collectives might take (``options``), one row each, rows of one collective together,
    the collectives of a micro-batch together, in the order the choice tries them; ``changes``: what each changes
    on each rank of its block."""

    collective: IntArray  # (O,) an id shared by the rows of one collective
    ulysses_degree: IntArray  # (O,)
    changes: BlockChanges  # (O,)

    def only(self, kept: npt.NDArray[np.bool_]) -> Options:
        """The rows ``kept``."""
        return Options(self.collective[kept], self.ulysses_degree[kept],
                       BlockChanges._make(field[kept] for field in self.changes))


OPTIONS = numba.typeof(Options(collective=NO_CHANGES.micro_batch, ulysses_degree=NO_CHANGES.micro_batch,
                               changes=NO_CHANGES))
# A candidate scheme's communication, one row per (block degree, Ulysses degree): slope and intercept of all-gather-
# KV's hidden forward and backward over the block, then of the scheme's hidden forward, hidden backward and exposed
_GATHER_FORWARD, _GATHER_BACKWARD, _FORWARD, _BACKWARD, _EXPOSED = 0, 2, 4, 6, 8


def options(problem: PlanningProblem, places: Places, sums: RankSums, *, allow_2d: bool) -> Options:
    """The schemes the collectives of ``places`` (``sums`` their per-rank sums) might take to make their micro-batch
    faster (``_options``), over every degree a block of theirs has; each scheme's work is priced here for the
    sequences it concerns (a batch shards few of its sequences over each degree)."""
    perf, lengths = problem.perf, problem.lengths
    sharded = np.flatnonzero((places.micro_batch >= 0) & (places.degree > 1))
    candidates = [(degree, u) for degree in np.unique(places.degree[sharded]).tolist()
                  for u in _scheme_degrees(perf, degree, allow_2d=allow_2d)]
    scheme_flops = np.zeros((len(candidates), len(lengths)))
    comm = np.zeros((len(candidates), 10))
    for k, (degree, ulysses_degree) in enumerate(candidates):
        members = sharded[places.degree[sharded] == degree]
        scheme_flops[k, members] = perf.placement_flops(lengths[members], degree, ulysses_degree)
        gathered, scheme = perf.scheme_comm(degree, 1), perf.scheme_comm(degree, ulysses_degree)
        assert gathered is not None and scheme is not None
        comm[k] = [coefficient for fit in (gathered.hidden_forward, gathered.hidden_backward, scheme.hidden_forward,
                                           scheme.hidden_backward, scheme.exposed)
                   for coefficient in (fit.slope, fit.intercept)]
    return _options(problem.tables, sums, places.micro_batch, places.degree, places.first_rank,
                    np.array([degree for degree, _ in candidates], dtype=np.int64),
                    np.array([u for _, u in candidates], dtype=np.int64), scheme_flops, comm)


def _scheme_degrees(perf: PerformanceModel, degree: int, *, allow_2d: bool) -> tuple[int, ...]:
    """The Ulysses degrees a collective over ``degree`` ranks may take (``PerformanceModel.ulysses_degrees``), those
    of Ulysses over the whole block alone where 2D is not allowed."""
    return tuple(u for u in perf.ulysses_degrees(degree) if allow_2d or u == degree)


@kernel(OPTIONS(TABLES, SUMS, INT_1D, INT_1D, INT_1D, INT_1D, INT_1D, FLOAT_2D, FLOAT_2D))
def _options(tables: CostTables, sums: RankSums, micro_batch: IntArray, degree: IntArray, first_rank: IntArray,
             candidate_degree: IntArray, candidate_ulysses_degree: IntArray, scheme_flops: FloatArray,
             comm: FloatArray) -> Options:
    """Every collective's candidate schemes (``candidate_*[k]``: its work per sequence ``scheme_flops[k]``, its
    communication ``comm[k]``), kept only where they might gain: on rank ``r`` of the block, each ``max(0, ·)`` of
    ``T_r`` falls by at most what leaves it and by at most what it was, so ``T_r`` falls by at most ``min(AG,
    exposed forward_r) + min(RS, exposed backward_r)`` of the collective's all-gather-KV communication, less what the
    scheme adds, ``α·Δwork + exposed``; where that is not positive on any rank, none gets faster. The collectives are
    numbered by (micro-batch, first rank, degree); a micro-batch's are tried the one that saves most work first,
    each one's schemes by Ulysses degree."""
    alpha, forward_share = tables.alpha_s_per_flop, tables.attention_forward_share
    # read once: a named tuple's array fields read in a loop cost reference counting on every pass
    lengths, rank_flops, degree_row = tables.lengths, tables.rank_flops, tables.degree_row
    attention_flops, all_gather_s, reduce_scatter_s = sums.attention_flops, sums.all_gather_s, sums.reduce_scatter_s
    size = tables.cp_size + 1  # a collective's key: (micro-batch, first rank, degree) as one number
    keys = np.full(micro_batch.shape[0], -1, dtype=np.int64)
    for i in range(micro_batch.shape[0]):
        if micro_batch[i] >= 0 and degree[i] > 1:
            keys[i] = (micro_batch[i] * size + first_rank[i]) * size + degree[i]
    order = np.argsort(keys, kind="mergesort")  # by collective, then sequence index
    most = keys.shape[0] * candidate_degree.shape[0]
    collective, ulysses = np.zeros(most, dtype=np.int64), np.zeros(most, dtype=np.int64)
    row_micro_batch, row_first_rank = np.zeros(most, dtype=np.int64), np.zeros(most, dtype=np.int64)
    row_degree = np.zeros(most, dtype=np.int64)
    work_flops, hidden_forward_s, hidden_backward_s, exposed_s = (np.zeros(most), np.zeros(most), np.zeros(most),
                                                                  np.zeros(most))
    saving = np.zeros(most)  # of each row's collective: the most work its schemes save (most negative first)
    count = 0
    c = -1
    start = 0
    while start < order.shape[0]:
        if keys[order[start]] < 0:
            start += 1
            continue
        c += 1
        end = start
        while end < order.shape[0] and keys[order[end]] == keys[order[start]]:
            end += 1
        first = order[start]
        m, block_first, block_degree = micro_batch[first], first_rank[first], degree[first]
        tokens = base_work = 0.0
        for j in range(start, end):
            tokens += lengths[order[j]]
            base_work += rank_flops[degree_row[block_degree], order[j]]
        exposed_forward = exposed_backward = 0.0  # the most of any rank of the block
        for r in range(block_first, block_first + block_degree):
            attention_s = alpha * attention_flops[m, r]
            exposed_forward = max(exposed_forward, all_gather_s[m, r] - forward_share * attention_s)
            exposed_backward = max(exposed_backward, reduce_scatter_s[m, r] - (1 - forward_share) * attention_s)
        collective_rows = count
        for k in range(candidate_degree.shape[0]):
            if candidate_degree[k] != block_degree:
                continue
            forward = comm[k, _GATHER_FORWARD] * tokens + comm[k, _GATHER_FORWARD + 1]
            backward = comm[k, _GATHER_BACKWARD] * tokens + comm[k, _GATHER_BACKWARD + 1]
            can_leave = min(forward, exposed_forward) + min(backward, exposed_backward)
            work = 0.0
            for j in range(start, end):
                work += scheme_flops[k, order[j]]
            work -= base_work
            exposed = comm[k, _EXPOSED] * tokens + comm[k, _EXPOSED + 1]
            if not alpha * work + exposed < can_leave:
                continue  # no rank of the block gets faster
            collective[count], ulysses[count] = c, candidate_ulysses_degree[k]
            row_micro_batch[count], row_first_rank[count], row_degree[count] = m, block_first, block_degree
            work_flops[count] = work
            hidden_forward_s[count] = comm[k, _FORWARD] * tokens + comm[k, _FORWARD + 1] - forward
            hidden_backward_s[count] = comm[k, _BACKWARD] * tokens + comm[k, _BACKWARD + 1] - backward
            exposed_s[count] = exposed
            count += 1
        for row in range(collective_rows, count):
            saving[row] = work_flops[collective_rows:count].min()
        start = end
    by_saving = np.argsort(saving[:count], kind="mergesort")
    kept = by_saving[np.argsort(row_micro_batch[:count][by_saving], kind="mergesort")]
    return Options(collective[kept], ulysses[kept],
                   BlockChanges(row_micro_batch[kept], row_first_rank[kept], row_degree[kept], work_flops[kept],
                                hidden_forward_s[kept], hidden_backward_s[kept], exposed_s[kept]))


@kernel(types.void(TABLES, SUMS, OPTIONS, BOOL_1D))
def choose(tables: CostTables, sums: RankSums, options: Options, chosen: npt.NDArray[np.bool_]) -> None:
    """Greedy, per micro-batch, in the options' order: each collective takes its option under which the micro-batch
    is fastest, where that is faster than it is (by more than ``MIN_GAIN`` of it), and ``sums`` takes its change; a
    collective whose block holds none of the micro-batch's slowest ranks is passed over (nothing it changes can make
    the micro-batch faster). ``chosen`` marks the options taken."""
    changes = options.changes
    num_options = options.collective.shape[0]
    i = 0
    while i < num_options:
        m = changes.micro_batch[i]
        best_s = micro_batch_time_s(tables, sums, m)
        while i < num_options and changes.micro_batch[i] == m:
            first_rank, degree, collective = changes.first_rank[i], changes.degree[i], options.collective[i]
            block_s = 0.0
            for r in range(first_rank, first_rank + degree):
                block_s = max(block_s, sum_rank_time_s(tables, sums, m, r))
            best = -1
            while i < num_options and options.collective[i] == collective:
                if block_s >= best_s:
                    time_s = changed_micro_batch_time_s(tables, sums, m, first_rank, degree, changes.work_flops[i],
                                                        changes.hidden_forward_s[i], changes.hidden_backward_s[i],
                                                        changes.exposed_s[i])
                    if time_s < best_s * (1.0 - MIN_GAIN):
                        best_s, best = time_s, i
                i += 1
            if best >= 0:
                chosen[best] = True
                apply_change(sums, changes, best)


class ChosenSchemes(NamedTuple):
    """The collectives of a plan's places that are not all-gather-KV, and what their schemes change."""

    # (micro-batch number, first rank, degree) of each such collective: its Ulysses degree (``Plan.from_places``)
    ulysses_degrees: dict[tuple[int, int, int], int]
    changes: BlockChanges  # by micro-batch number (``simulate.estimate_places``)


def choose_for_places(problem: PlanningProblem, places: Places, *, allow_2d: bool = True,
                      passed_over: Sequence[int] = ()) -> ChosenSchemes:
    """Each collective of ``places`` (by micro-batch, first rank and degree: the collectives ``Plan.from_places``
    makes) with its fastest scheme (module docstring). ``passed_over``: micro-batches that keep all-gather-KV."""
    if not problem.perf.has_all_to_all() or not (places.degree[places.micro_batch >= 0] > 1).any():
        return ChosenSchemes({}, NO_CHANGES)  # nothing any scheme could change
    sums = empty_sums(problem.tables, places.num_micro_batches)
    sums_of_places(problem.tables, sums, places.micro_batch, places.degree, places.first_rank)
    found = options(problem, places, sums, allow_2d=allow_2d)
    if len(passed_over):
        found = found.only(~np.isin(found.changes.micro_batch, passed_over))
    chosen = np.zeros(len(found.collective), dtype=np.bool_)
    choose(problem.tables, sums, found, chosen)
    taken = found.only(chosen)
    keys = zip(taken.changes.micro_batch.tolist(), taken.changes.first_rank.tolist(), taken.changes.degree.tolist(),
               strict=True)
    return ChosenSchemes(dict(zip(keys, taken.ulysses_degree.tolist(), strict=True)), taken.changes)


def _with_degrees(micro_batch: MicroBatch, m: int, chosen: dict[tuple[int, int, int], int]) -> MicroBatch:
    degrees = [chosen.get((m, c.first_rank, c.degree), 1) for c in micro_batch.collectives()]
    return micro_batch if degrees == [1] * len(degrees) else micro_batch.with_ulysses_degrees(degrees)


def _shares_a_block(micro_batch: MicroBatch) -> bool:
    """Whether two of its collectives share one block: they share one fixed cost, which a per-collective change
    does not price, so it keeps all-gather-KV."""
    blocks = [(c.first_rank, c.degree) for c in micro_batch.collectives()]
    return len(set(blocks)) < len(blocks)


def _choose_in(problem: PlanningProblem, micro_batches: Sequence[MicroBatch], *,
               allow_2d: bool) -> tuple[list[MicroBatch], BlockChanges]:
    """``micro_batches`` (all-gather-KV, the micro-batches of ``problem``'s group in order) with their schemes
    chosen, and the changes made (by position)."""
    degrees = {collective.degree for micro_batch in micro_batches for collective in micro_batch.collectives()}
    if not any(_scheme_degrees(problem.perf, degree, allow_2d=allow_2d) for degree in degrees):
        return list(micro_batches), NO_CHANGES  # no block of theirs has a scheme but all-gather-KV
    places = Plan(dp_ranks=(DPRankPlan(micro_batches=tuple(micro_batches)),)).places(problem.num_sequences)
    chosen = choose_for_places(problem, places, allow_2d=allow_2d,
                               passed_over=[m for m, mb in enumerate(micro_batches) if _shares_a_block(mb)])
    if not chosen.ulysses_degrees:
        return list(micro_batches), chosen.changes
    return [_with_degrees(mb, m, chosen.ulysses_degrees) for m, mb in enumerate(micro_batches)], chosen.changes


def choose_schemes(problem: PlanningProblem, plan: Plan) -> tuple[Plan, BlockChanges]:
    """``plan`` with each collective's fastest scheme (module docstring), ``plan`` itself where none changes, and
    the changes its own micro-batches took, by their position in the plan (``estimate_plan``'s ``changes``). A plan
    made from places is cheaper to choose for before it is built (``choose_for_places``)."""
    if not problem.perf.has_all_to_all() or not _has_collectives(plan):
        return plan, NO_CHANGES
    own = [micro_batch for dp_plan in plan.dp_ranks for micro_batch in dp_plan.micro_batches]
    chosen_own, changes = _choose_in(problem, own, allow_2d=True)
    chosen = iter(chosen_own)
    dp_ranks = tuple(DPRankPlan(micro_batches=tuple(next(chosen) for _ in dp_plan.micro_batches))
                     for dp_plan in plan.dp_ranks)
    spanning = []
    for spanning_micro_batch in plan.spanning:
        span = problem.span_problem(spanning_micro_batch.num_dp_ranks)
        # 2D needs strided groups of world ranks, which the trainer makes only within a CP group
        [micro_batch], _ = _choose_in(span, [spanning_micro_batch.micro_batch], allow_2d=False)
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
