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
collective (largest first), keeping a change only where it makes the micro-batch faster: a plan never gets slower.
The searches place sequences as all-gather-KV prices them; the choice follows, so it costs a plan's time only for
micro-batches with collectives (measured in ``make bench``'s latency table). A degree whose heads do not split
evenly, and one whose all-to-all the profile did not measure, is never chosen (``PerformanceModel.
ulysses_degrees``); a profile without an ``all_to_all`` table chooses nothing and says why (``schemes_note``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from scheduler_service.core.costing import RankSums, empty_sums, micro_batch_time_s, sums_of_places
from scheduler_service.core.plan import (
    Collective,
    DPRankPlan,
    MicroBatch,
    Plan,
    PlanningProblem,
    SpanningMicroBatch,
)

__all__ = ["BlockChange", "block_changes", "choose_schemes", "plan_sums", "scheme_sums", "schemes_note"]

FloatArray = npt.NDArray[np.float64]

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


def scheme_sums(problem: PlanningProblem, sums: RankSums, micro_batches: Sequence[MicroBatch]) -> list[
        tuple[int, BlockChange]]:
    """Add to ``sums`` (row ``m`` holding ``micro_batches[m]`` as the kernels price it, all-gather-KV) what each
    collective's own scheme changes; the changes made, by row."""
    changes = []
    for m, micro_batch in enumerate(micro_batches):
        for change in block_changes(problem, micro_batch):
            _apply(sums, m, change)
            changes.append((m, change))
    return changes


def _change_with(problem: PlanningProblem, collectives: Sequence[Collective], chosen: Sequence[int], i: int,
                 ulysses_degree: int) -> BlockChange:
    """The change of collective ``i``'s block with ``ulysses_degree`` for it and ``chosen`` for the block's others."""
    collective = collectives[i]
    block = (collective.first_rank, collective.degree)
    members = [(other.sequences, ulysses_degree if j == i else chosen[j]) for j, other in enumerate(collectives)
               if (other.first_rank, other.degree) == block]
    return _block_change(problem, collective.first_rank, collective.degree, members)


def _chosen(problem: PlanningProblem, sums: RankSums, m: int, micro_batch: MicroBatch, *,
            allow_2d: bool) -> MicroBatch:
    """``micro_batch`` (row ``m`` of ``sums``, all-gather-KV) with each collective's fastest scheme, largest
    collective first; ``sums`` ends holding the choice."""
    collectives = list(micro_batch.collectives())
    if not collectives:
        return micro_batch
    chosen = [1] * len(collectives)
    lengths = problem.lengths
    order = sorted(range(len(collectives)), key=lambda i: -int(lengths[list(collectives[i].sequences)].sum()))
    best_s = micro_batch_time_s(problem.tables, sums, m)
    for i in order:
        degree = collectives[i].degree
        candidates = [u for u in problem.perf.ulysses_degrees(degree) if allow_2d or u == degree]
        if not candidates:
            continue
        current = _change_with(problem, collectives, chosen, i, chosen[i])
        _apply(sums, m, current, -1.0)
        best_u, best_change = chosen[i], current
        for ulysses_degree in candidates:
            change = _change_with(problem, collectives, chosen, i, ulysses_degree)
            _apply(sums, m, change)
            time_s = micro_batch_time_s(problem.tables, sums, m)
            _apply(sums, m, change, -1.0)
            if time_s < best_s * (1.0 - MIN_GAIN):
                best_s, best_u, best_change = time_s, ulysses_degree, change
        _apply(sums, m, best_change)
        chosen[i] = best_u
    return micro_batch if chosen == [1] * len(collectives) else micro_batch.with_ulysses_degrees(chosen)


def choose_schemes(problem: PlanningProblem, plan: Plan, sums: RankSums | None = None) -> Plan:
    """``plan`` with each collective's fastest scheme (module docstring). ``sums``: the plan's own micro-batches'
    per-rank sums in plan order, as the kernels price them, when the caller has them (changed in place)."""
    if not problem.perf.has_all_to_all() or not _has_collectives(plan):
        return plan
    own = [micro_batch for dp_plan in plan.dp_ranks for micro_batch in dp_plan.micro_batches]
    if sums is None:
        sums = plan_sums(problem, plan)
    chosen_own = [_chosen(problem, sums, m, micro_batch, allow_2d=True) for m, micro_batch in enumerate(own)]
    chosen = iter(chosen_own)
    dp_ranks = tuple(DPRankPlan(micro_batches=tuple(next(chosen) for _ in dp_plan.micro_batches))
                     for dp_plan in plan.dp_ranks)
    spanning = []
    for spanning_micro_batch in plan.spanning:
        span = problem.span_problem(spanning_micro_batch.num_dp_ranks)
        span_sums = plan_sums(span, Plan(dp_ranks=(DPRankPlan(micro_batches=(spanning_micro_batch.micro_batch,)),)))
        # 2D needs strided groups of world ranks, which the trainer makes only within a CP group
        spanning.append(SpanningMicroBatch(
            first_dp_rank=spanning_micro_batch.first_dp_rank, num_dp_ranks=spanning_micro_batch.num_dp_ranks,
            micro_batch=_chosen(span, span_sums, 0, spanning_micro_batch.micro_batch, allow_2d=False)))
    unchanged = all(new is old for new, old in zip(chosen_own, own, strict=True)) and all(
        new.micro_batch is old.micro_batch for new, old in zip(spanning, plan.spanning, strict=True))
    return plan if unchanged else Plan(dp_ranks=dp_ranks, spanning=tuple(spanning))


def plan_sums(problem: PlanningProblem, plan: Plan) -> RankSums:
    """The per micro-batch and CP rank sums of the plan's own micro-batches (in plan order) as the kernels price
    them: all-gather-KV for every collective."""
    places = plan.places(problem.num_sequences)
    sums = empty_sums(problem.tables, places.num_micro_batches)
    sums_of_places(problem.tables, sums, places.micro_batch, places.degree, places.first_rank)
    return sums


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
