"""Blocks that span DP replicas: when Skrull plans a micro-batch over several DP replicas' CP groups at once.

Skrull confines a sequence to one DP replica's CP group, so one group's capacity (``bucket_size × cp_size``)
bounds the longest sequence, and a few long sequences, each owned by one replica, leave the others idle. A
**spanning micro-batch** (``plan.SpanningMicroBatch``) runs over an aligned block of ``w`` replicas, ``w × cp_size``
ranks, as one synchronised step: the block is one CP group of that size to DACP, the cost model and the checker
(``PlanningProblem.span_problem``). Block widths are powers of two, and the whole world
(``check.spanning_widths``).

* **Needed.** A sequence longer than one group holds runs in a spanning micro-batch of the narrowest width that
  holds it (``needed_width``).
* **Chosen.** A long sequence that fits one group may still be better spanned: spread over ``w`` replicas its
  attention is ``w`` times shorter per rank, so replicas whose shares are light are not left idle while one
  replica runs it. Skrull's plan without spanning is the baseline; where its slowest replica is more than 2 % above
  the mean (or a sequence needs spanning), ``spanned_if_faster`` tries spanning the costliest sequences
  (``_CANDIDATE_COUNTS`` of them, at each width), costing each candidate with the baseline's own micro-batches less
  the spanned sequences (as arrays, no plan built), and keeps the best one only when, with the rest planned afresh,
  the simulator says it is faster (so spanning never makes a plan slower under the model).
* **Filled.** A spanning micro-batch has room beside its long sequences; the best candidate is also costed with
  that room given to the other sequences, longest first (``_filled``): fewer, fuller micro-batches, as Megatron's
  rounds are.
* **Beyond the groups.** Where one costly sequence sets the bound within CP groups and the world's blocks lower
  it well below (``simulate.LowerBounds``, ``_BEYOND_GROUPS_RATIO``), the candidates are first costed against GDS's
  plan before ``plan_refine`` refines it (``spanned_beyond_groups``). A spanning plan found faster than the bound
  within groups (which counts the costliest sequence's own communication, ``simulate``) is the plan: no refinement
  could make a plan within groups as fast, so none is run. Otherwise the plan within groups is refined and the
  candidates costed against it, as above. On every ``make bench`` case, and on 1,900 drawn batches, the plans are
  those costing against the refined plan alone finds.

In either case a width's sequences are split over its blocks by LPT on their cheapest cost there, each block's
share is cut longest first into the fewest micro-batches that spread (``gds_search.fewest_that_spread``), and each
micro-batch is decided by hybrid DACP over the block (``dacp.decide``). The rest of the batch is planned by the
scheduler asked for, and its DP shares are given to the replicas so that the heaviest share goes to the replica
whose spanning micro-batches end first (``join``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from scheduler_service.core.check import spanning_widths
from scheduler_service.core.dacp import decide
from scheduler_service.core.dacp_search import HYBRID
from scheduler_service.core.gds_search import fewest_that_spread
from scheduler_service.core.partition import lpt_parts
from scheduler_service.core.plan import DPRankPlan, Places, Plan, PlanningProblem, SpanningMicroBatch
from scheduler_service.core.simulate import (
    LowerBounds,
    PlanEstimate,
    dp_rank_times_s,
    estimate_places,
    estimate_plan,
    simulate,
    spanning_ready_s,
)

__all__ = [
    "MAX_CHOSEN",
    "join",
    "needed_width",
    "plan_with_spanning",
    "spanned_beyond_groups",
    "spanned_if_faster",
    "spanning_micro_batches",
    "with_needed_spanning",
]

Timed = list[tuple[SpanningMicroBatch, float]]  # spanning micro-batches and their times under the cost model


def needed_width(problem: PlanningProblem, length: int) -> int:
    """The narrowest block width whose ranks hold a sequence of ``length`` tokens (``length`` at most the world's
    capacity, which ``make_problem`` checks)."""
    fitting = [w for w in spanning_widths(problem.dp_size) if length <= w * problem.micro_batch_capacity]
    return fitting[0] if fitting else problem.dp_size


def spanning_micro_batches(problem: PlanningProblem, indices: Sequence[int], width: int) -> Timed:
    """The sequences ``indices`` in spanning micro-batches over the blocks of ``width`` replicas (module
    docstring), each with its time."""
    span = problem.span_problem(width)
    members = np.asarray(indices, dtype=np.int64)
    num_blocks = problem.dp_size // width
    block_of = lpt_parts(np.ascontiguousarray(span.area[members]), num_blocks)
    timed: Timed = []
    for block in range(num_blocks):
        share = members[block_of == block]
        if not len(share):
            continue
        longest_first = np.ascontiguousarray(share[np.lexsort((share, -span.lengths[share]))])
        group_of = np.empty(len(longest_first), dtype=np.int64)
        count = fewest_that_spread(span.lengths, longest_first, span.micro_batch_capacity, group_of)
        assert count, "every sequence given fits one block of this width"
        for group in range(count):
            decided = decide(span, longest_first[group_of == group].tolist(), HYBRID)
            assert decided is not None, "a spread micro-batch's tokens fit its block"
            micro_batch, time_s = decided
            timed.append((SpanningMicroBatch(first_dp_rank=block * width, num_dp_ranks=width,
                                             micro_batch=micro_batch), time_s))
    return timed


def _free_first_pairing(ready_s: Sequence[float], share_s: Sequence[float]) -> dict[int, int]:
    """Replica → DP share: the heaviest share to the replica that is free first (ties by number)."""
    free_first = sorted(range(len(ready_s)), key=lambda dp_rank: (ready_s[dp_rank], dp_rank))
    heaviest_first = sorted(range(len(share_s)), key=lambda share: (-share_s[share], share))
    return dict(zip(free_first, heaviest_first, strict=True))


def join(problem: PlanningProblem, timed: Timed, rest_plan: Plan) -> Plan:
    """One plan of the spanning micro-batches and the DP replicas' own micro-batches of ``rest_plan`` (its spanning
    ones, if any, left out), each replica given a share by ``_free_first_pairing``."""
    spanning = tuple(micro_batch for micro_batch, _ in timed)
    ready_s = spanning_ready_s(spanning, [time_s for _, time_s in timed], problem.dp_size)
    own = Plan(dp_ranks=rest_plan.dp_ranks)
    share_of = _free_first_pairing(ready_s, [rank.time_s for rank in simulate(problem, own).dp_ranks])
    return Plan(dp_ranks=tuple(own.dp_ranks[share_of[dp_rank]] for dp_rank in range(problem.dp_size)),
                spanning=spanning)


def _rest_share_times_s(problem: PlanningProblem, places: Places, spanned: np.ndarray) -> list[float]:
    """Each DP share's time in the plan ``places`` less the sequences ``spanned`` (a boolean mask): removing a
    sequence only frees room, so what is left is a valid plan, and its shares' times are estimated without building
    it."""
    rest = Places(np.where(spanned, -1, places.micro_batch), places.degree, places.first_rank, places.dp_rank)
    return dp_rank_times_s(problem, rest).tolist()


def _joined_time_s(problem: PlanningProblem, timed: Timed, share_s: Sequence[float]) -> float:
    """The iteration time of ``join`` of the spanning micro-batches ``timed`` and DP shares of times ``share_s``."""
    ready_s = spanning_ready_s([micro_batch for micro_batch, _ in timed], [time_s for _, time_s in timed],
                               problem.dp_size)
    share_of = _free_first_pairing(ready_s, share_s)
    return max(ready_s[dp_rank] + share_s[share_of[dp_rank]] for dp_rank in range(problem.dp_size))


def _plan_of(problem: PlanningProblem, indices: list[int], schedule: Callable[[PlanningProblem], Plan]) -> Plan:
    """``schedule``'s plan of the sequences ``indices`` alone, in the batch's numbering."""
    if not indices:
        return Plan(dp_ranks=(DPRankPlan(micro_batches=()),) * problem.dp_size)
    return schedule(problem.sub_problem(indices)).renumbered(indices)


def _needed_micro_batches(problem: PlanningProblem, widths: dict[int, int],
                          made: dict[tuple[int, tuple[int, ...]], Timed] | None = None) -> Timed:
    """Spanning micro-batches for the sequences of ``widths``, each over blocks of its width; ``made`` keeps those of
    each (width, sequences) once made, for candidates that share them."""
    made = {} if made is None else made
    timed: Timed = []
    for width in sorted(set(widths.values())):
        members = tuple(sorted(index for index in widths if widths[index] == width))
        if (width, members) not in made:
            made[width, members] = spanning_micro_batches(problem, members, width)
        timed += made[width, members]
    return timed


def with_needed_spanning(problem: PlanningProblem, schedule: Callable[[PlanningProblem], Plan]) -> Plan:
    """``schedule``'s plan of the sequences one CP group holds, and spanning micro-batches for those it does not:
    how every scheduler plans a batch that needs them."""
    needed = problem.too_long_for_a_replica()
    if not needed:
        return schedule(problem)
    widths = {index: needed_width(problem, problem.sequence_lengths[index]) for index in needed}
    rest = [index for index in range(problem.num_sequences) if index not in widths]
    return join(problem, _needed_micro_batches(problem, widths), _plan_of(problem, rest, schedule))


_CANDIDATE_COUNTS = (1, 2, 4, 8)  # how many of the costliest sequences a candidate spans
MAX_CHOSEN = max(_CANDIDATE_COUNTS)  # the most sequences spanned beyond those that need it
_MIN_IMBALANCE = 0.02  # the slowest replica's excess over the mean below which no candidate is tried


def plan_with_spanning(problem: PlanningProblem, schedule: Callable[[PlanningProblem], Plan]) -> Plan:
    """``with_needed_spanning(problem, schedule)``, or a plan that spans the costliest sequences where the simulator
    finds one faster (``spanned_if_faster``)."""
    plan = with_needed_spanning(problem, schedule)
    if not problem.spanning:
        return plan
    places = plan.places(problem.num_sequences)
    spanned = spanned_if_faster(problem, places, estimate_plan(problem, plan, places), schedule)
    return plan if spanned is None else spanned[0]


def spanned_if_faster(problem: PlanningProblem, places: Places, estimate: PlanEstimate,
                      schedule: Callable[[PlanningProblem], Plan]) -> tuple[Plan, PlanEstimate] | None:
    """A plan that spans the costliest sequences and is faster than the plan of ``estimate`` (its own micro-batches'
    ``places``), with its estimate, or None (module docstring, "Chosen"). Each candidate is costed with those
    micro-batches less the spanned sequences (``_joined_time_s``); the best one is costed again with its spanning
    micro-batches filled (``_filled``), and where the better of the two beats the plan, its other sequences are
    planned afresh by ``schedule`` and the result kept if the simulator still finds it faster. A plan whose replicas
    are balanced and that needs no spanning costs nothing more here."""
    best_s = estimate.iteration_time_s
    mean_s = sum(rank.time_s for rank in estimate.dp_ranks) / problem.dp_size
    needed = set(problem.too_long_for_a_replica())
    if not problem.spanning or (not needed and best_s <= (1 + _MIN_IMBALANCE) * mean_s):
        return None  # the replicas are balanced: spreading the costliest sequences wider cannot gain much
    costliest = [int(k) for k in np.argsort(-problem.area, kind="stable") if k not in needed][:MAX_CHOSEN]
    widths = {index: needed_width(problem, problem.sequence_lengths[index]) for index in needed}
    made: dict[tuple[int, tuple[int, ...]], Timed] = {}  # spanning micro-batches the candidates share

    def candidate(count: int, width: int, fill: bool) -> tuple[Timed, list[int]]:
        """The spanning micro-batches of a candidate, and the sequences left to the replicas."""
        spanned = {**widths, **{index: max(width, widths.get(index, 0)) for index in costliest[:count]}}
        timed = _needed_micro_batches(problem, spanned, made)
        rest = [index for index in range(problem.num_sequences) if index not in spanned]
        return _filled(problem, timed, rest) if fill else (timed, rest)

    share_times_s: dict[tuple[int, ...], list[float]] = {}  # by the sequences left: candidates of every width share

    def time_s(timed: Timed, rest: list[int]) -> float:
        if tuple(rest) not in share_times_s:
            spanned = np.ones(problem.num_sequences, dtype=bool)
            spanned[rest] = False
            share_times_s[tuple(rest)] = _rest_share_times_s(problem, places, spanned)
        return _joined_time_s(problem, timed, share_times_s[tuple(rest)])

    counts = ((0,) if needed else ()) + tuple(count for count in _CANDIDATE_COUNTS if count <= len(costliest))
    costed = [(time_s(*candidate(count, width, False)), count, width)
              for width in spanning_widths(problem.dp_size) for count in counts]
    if not costed:
        return None
    unfilled_s, count, width = min(costed)
    filled = candidate(count, width, True)
    filled_s = time_s(*filled)
    if min(unfilled_s, filled_s) >= best_s:
        return None
    timed, rest = filled if filled_s < unfilled_s else candidate(count, width, False)
    spanned_plan = join(problem, timed, _plan_of(problem, rest, schedule))
    spanned_estimate = simulate(problem, spanned_plan)
    return (spanned_plan, spanned_estimate) if spanned_estimate.iteration_time_s < best_s else None


# The bound within CP groups over the bound over every plan from which the candidates are first costed against the
# plan before its refinement. On make bench's batches (20 per Figure 3 and long-heavy case, both shipped profiles) a
# spanning plan beat the bound within groups on all 15 whose ratio was 1.5 or more; of the 5 between 1.3 and 1.5, 3
# planned within groups, where the candidates would then be costed twice (256 LMSys-like sequences, h100-paper:
# 10.6 ms against 7.8 for such a batch).
_BEYOND_GROUPS_RATIO = 1.5


def spanned_beyond_groups(problem: PlanningProblem, unrefined: Places, bounds: LowerBounds,
                          schedule: Callable[[PlanningProblem], Plan]) -> tuple[Plan, PlanEstimate] | None:
    """A spanning plan faster than any plan within CP groups can be (``bounds.within_groups_s``), found by
    ``spanned_if_faster`` against the plan ``unrefined`` (GDS's, before ``plan_refine``), with its estimate; or None
    (module docstring, "Beyond the groups"). Tried only where no sequence needs spanning and the bound within groups
    is well above the bound over every plan (``_BEYOND_GROUPS_RATIO``)."""
    if (not problem.spanning or math.isinf(bounds.within_groups_s)
            or bounds.within_groups_s < _BEYOND_GROUPS_RATIO * bounds.any_plan_s):
        return None
    found = spanned_if_faster(problem, unrefined, estimate_places(problem, unrefined), schedule)
    return found if found is not None and found[1].iteration_time_s < bounds.within_groups_s else None


def _filled(problem: PlanningProblem, timed: Timed, rest: Sequence[int]) -> tuple[Timed, list[int]]:
    """The spanning micro-batches with sequences of ``rest`` added where their block has room, and what is left:
    fewer, fuller micro-batches, as Megatron's rounds are. Longest first, each while its tokens fit the block; a
    micro-batch that DACP cannot then decide gives its longest additions back until it can."""
    lengths = problem.sequence_lengths
    left = sorted(rest, key=lambda k: (-lengths[k], k))
    filled: Timed = []
    for spanning, time_s in timed:
        span = problem.span_problem(spanning.num_dp_ranks)
        members = spanning.micro_batch.indices()
        room = span.micro_batch_capacity - sum(lengths[k] for k in members)
        added = []
        for index in left:
            if lengths[index] <= room:
                added.append(index)
                room -= lengths[index]
        while added:
            decided = decide(span, members + added, HYBRID)
            if decided is not None:
                spanning = SpanningMicroBatch(first_dp_rank=spanning.first_dp_rank,
                                              num_dp_ranks=spanning.num_dp_ranks, micro_batch=decided[0])
                time_s = decided[1]
                break
            added.pop(0)
        taken = set(added)
        left = [index for index in left if index not in taken]
        filled.append((spanning, time_s))
    return filled, sorted(left)
