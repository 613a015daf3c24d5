"""Exact joint GDS + DACP scheduling with CP-SAT (paper eqs. 1–11): the yardstick for the heuristics.

Formulation. Sequence ``k`` (``S_k`` tokens, ``F_k`` FLOPs) goes to exactly one
place (eq. 9): a micro-batch of a DP rank ``i`` and, inside it, either whole on
one CP rank ``j`` (``local``, the paper's ``P_kj``), sharded over all ``N`` CP
ranks (``dist``, the paper's ``D_k``), or, in the hybrid space
(``solve(hybrid=True)``, what the ``cpsat`` scheduler searches), sharded over
an aligned block ``b`` of ``s`` CP ranks (``group``; docs/design.md,
"Wire contract"). The binary space (``hybrid=False``) leaves the blocks out. The cost of
a micro-batch is the simulator's (``simulate.py``): on CP rank ``j``, with
``W`` the FLOP-equivalents at each sequence's placement, ``A_j`` its local
attention time, and the all-gathers (AG) and reduce-scatters (RS) of every
group the rank is in (the whole CP group's distributed tokens, and each block
containing ``j``),

    time_j = max(F, α·(W_local,j + W_dist / N + Σ_b∋j W_b / s_b) + β
                    + max(0, ΣAG − A_j/3) + max(0, ΣRS − 2·A_j/3))

whose fixed parts only non-empty groups pay (indicator booleans), and the two
exposures are linearised by non-negative variables bounded below by their
argument (the objective pushes them down), under the memory bound
``N·(local tokens on j) + dist tokens + Σ_b∋j (N/s_b)·(tokens of b) <= C·N``
for every ``j`` (eqs. 7, 10); the objective is ``min max_i sum over i's
micro-batches of time`` (eq. 8). ``F`` is the profile's launch-bound floor (0 in
additive profiles): a micro-batch's time is bounded below by it once it is
open, and by each rank's device time, and minimised, so it is their maximum.
Every term is linear in the booleans, so this is a MILP that CP-SAT attacks
with its LP relaxation, clause learning and LNS.

Symmetry breaking. DP ranks, the micro-batches of a DP rank (gradient
accumulation sums them in any order) and, in the binary space, the CP ranks of
a micro-batch are interchangeable. Each micro-batch is named after its
smallest sequence index (its representative), so there is at most one per (DP
rank, representative) and no plan is lost; DP ranks are ordered by their
smallest index, binary CP ranks partly (see the comments at the constraints).
A block pins its CP ranks, so the hybrid space keeps their positions: it has
about twice the placement booleans and a weaker relaxation, and proves
optimality on smaller batches.

Quantisation. Seconds become integer nanoseconds in ``_quantise`` only, every
cost rounded *down* (and the attention that hides communication *up*), so the
model's time of any plan is at most its ``simulate()`` time: ``bound_s`` is a true lower bound on every plan, and the
plan the model calls optimal is within about a nanosecond per sequence of the
true optimum. ``objective_s`` is always ``simulate()`` of the returned plan.

Determinism. One request gives one plan (docs/design.md, "Wire contract"), also when the search stops at
FEASIBLE: the stop is a *deterministic* time limit (CP-SAT's work count, ``DETERMINISTIC_TIME_PER_SECOND`` units
per second of the requested limit) with a fixed seed and one worker (several workers search interleaved, which is
deterministic too). The wall-clock limit is only a safety net, ``WALL_CLOCK_SAFETY`` times the request's, that a
solve stops at only on a machine several times slower than the calibration. Measured on 6 batches of 10–14
sequences (dp=2 cp=4, bucket 4096, 2 cores) at about 2 s each: one deterministic worker found the same or a better
plan than two interleaved ones on all 6, and matched two free-running (non-deterministic) workers on 3 of 6, within
1–50 % on the others (free-running search proved 3 optimal, the deterministic one 2).

Search. The model is warm-started from the hint (without one, every sequence
alone and distributed) relabelled as the model names things, every variable
hinted; the hint comes back whenever the search finds nothing better. Presolve
runs only on models of at most ``MAX_PRESOLVE_BOOLEANS`` placement booleans
(beyond, it eats the time limit); larger than ``MAX_PLACEMENT_BOOLEANS`` is
refused.

What it costs, and how close the heuristics come to it: docs/benchmarks.md, "Against CP-SAT".

The hybrid space, on the same 12-sequence batches the benchmark uses (dp=2
cp=4, 5 s limit, warm-started from ``skrull``): 968–1,008 placement booleans
against 565–590 for the binary one; optimal on the LMSys batch, a 5 % gap on
the ChatQA2 one; a tiny batch of 4–5 sequences is optimal in well under 0.1 s.

The hard case is many sequences of similar cost on few CP ranks: the best plan
is usually found within seconds, but proving it is a partition problem about
which the LP bound (perfect balance over CP ranks) says little. Building the
model takes ~0.15 s for 32 sequences on dp=4 cp=8 and ~3 s / 300 MB for 128;
it grows as dp·cp·K²/2 booleans. Far too slow for online planning, which is
why the paper schedules with heuristics; this module measures their gap.

One module of about 570 lines, for one model: its variables, constraints,
hint and read-back name the same indices and are read together, top to bottom.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from ortools.sat.python import cp_model

from scheduler_service.core.check import check_plan
from scheduler_service.core.errors import InvalidRequestError
from scheduler_service.core.gds_search import min_micro_batches
from scheduler_service.core.perf_model import ATTENTION_FORWARD_SHARE
from scheduler_service.core.plan import (
    DPRankPlan,
    MicroBatch,
    Place,
    Plan,
    PlanningProblem,
    SolverReport,
    block_degrees,
)
from scheduler_service.core.simulate import simulate

__all__ = ["DETERMINISTIC_TIME_PER_SECOND", "MAX_PLACEMENT_BOOLEANS", "TICKS_PER_SECOND", "CpSatSolution", "solve"]

TICKS_PER_SECOND = 1_000_000_000  # the model's time unit is 1 ns; iterations of minutes stay below 2^40 ticks
# Measured on 2 cores: presolve takes 0.7 s at 3k placement booleans, 2 s at 8k and 6.5 s at 15k, so beyond
# this it eats the time limit before the search starts; below it, it pays for itself.
MAX_PRESOLVE_BOOLEANS = 10_000
# About 128 sequences on dp=4 cp=8 in the binary space (~3 s and ~300 MB to build), about 96 in the hybrid one;
# 256 take 12 s and 1 GB before any search.
MAX_PLACEMENT_BOOLEANS = 300_000
# CP-SAT's deterministic time advanced 0.1–0.3 units per wall second with one worker on the 2-core development
# machine; 0.15 makes a request's time_limit_s last about that long there, and makes the stop depend on the work
# done, not the clock.
DETERMINISTIC_TIME_PER_SECOND = 0.15
WALL_CLOCK_SAFETY = 10.0
SEED = 0


@dataclass(frozen=True, kw_only=True, slots=True)
class CpSatSolution:
    plan: Plan
    report: SolverReport


@dataclass(frozen=True, kw_only=True, slots=True)
class _BlockCosts:
    """Sharding over an aligned block of ``degree`` ranks (hybrid space), in ticks, rounded down."""

    compute: list[int]  # α·W_k(degree): each rank of the block's share of sequence k
    all_gather: list[int]  # the block's all-gather of k's K/V, all layers
    reduce_scatter: list[int]
    all_gather_fixed: int  # once per micro-batch where the block has a sequence
    reduce_scatter_fixed: int


@dataclass(frozen=True, kw_only=True, slots=True)
class _Costs:
    """The performance model in integer ticks, every term rounded down (never above the float model)."""

    local: list[int]  # α·W_k: sequence k computed whole on one CP rank
    distributed: list[int]  # α·W_k(N): each CP rank's share of sharded sequence k
    attention_forward: list[int]  # forward local attention of k when whole (hides the all-gather), rounded up
    attention_backward: list[int]  # its backward (hides the reduce-scatter), rounded up
    all_gather: list[int]  # a·S_k of the all-gather of k's K/V, all layers
    reduce_scatter: list[int]  # and of the reduce-scatter of dK/dV
    compute_fixed: int  # β of eq. 14: once per CP rank of a non-empty micro-batch
    compute_floor: int  # the launch-bound floor: no non-empty micro-batch takes less (0: the additive form)
    all_gather_fixed: int  # T_fixed of eq. 16: once per micro-batch with distributed tokens
    reduce_scatter_fixed: int
    blocks: dict[int, _BlockCosts]  # by block degree; empty in the binary space


def _quantise(problem: PlanningProblem, *, hybrid: bool) -> _Costs:
    """The one place seconds become integers."""
    alpha, collective = problem.alpha_s_per_flop, problem.perf.collective_cost(problem.cp_size)
    tokens = problem.lengths.astype(np.float64)
    attention_s = alpha * problem.tables.local_attention_flops

    def ticks(seconds: npt.ArrayLike, rounding: Callable[[npt.ArrayLike], npt.NDArray[np.float64]] = np.floor,
              ) -> list[int]:
        return [int(t) for t in rounding(np.atleast_1d(np.asarray(seconds, dtype=np.float64)) * TICKS_PER_SECOND)]

    def block_costs(degree: int) -> _BlockCosts:
        cost = problem.perf.collective_cost(degree)
        return _BlockCosts(compute=ticks(alpha * problem.rank_flops_at(degree)),
                           all_gather=ticks(cost.all_gather_s_per_token * tokens),
                           reduce_scatter=ticks(cost.reduce_scatter_s_per_token * tokens),
                           all_gather_fixed=ticks(cost.all_gather_fixed_s)[0],
                           reduce_scatter_fixed=ticks(cost.reduce_scatter_fixed_s)[0])

    return _Costs(
        local=ticks(alpha * problem.rank_flops_at(1)),
        distributed=ticks(alpha * problem.rank_flops_at(problem.cp_size)),
        attention_forward=ticks(attention_s * ATTENTION_FORWARD_SHARE, np.ceil),
        attention_backward=ticks(attention_s * (1 - ATTENTION_FORWARD_SHARE), np.ceil),
        all_gather=ticks(collective.all_gather_s_per_token * tokens),
        reduce_scatter=ticks(collective.reduce_scatter_s_per_token * tokens),
        compute_fixed=ticks(problem.beta_s)[0],
        compute_floor=ticks(problem.floor_s)[0],
        all_gather_fixed=ticks(collective.all_gather_fixed_s)[0],
        reduce_scatter_fixed=ticks(collective.reduce_scatter_fixed_s)[0],
        blocks={degree: block_costs(degree) for degree in block_degrees(problem.cp_size)} if hybrid else {},
    )


def _num_placement_booleans(problem: PlanningProblem, *, hybrid: bool) -> int:
    """How many ``local``, ``group`` and ``dist`` booleans ``_JointModel`` creates for ``problem``."""
    num_sequences, bucket_size, cp_size = problem.num_sequences, problem.bucket_size, problem.cp_size
    degrees = block_degrees(cp_size) if hybrid else ()
    fits_after = np.cumsum((problem.lengths <= bucket_size)[::-1])[::-1]  # [s]: sequences >= s that fit whole
    blocks_fitting = np.zeros(num_sequences, dtype=np.int64)  # each sequence: the blocks it fits in
    for degree in degrees:
        blocks_fitting += (cp_size // degree) * (problem.lengths <= degree * bucket_size)
    blocks_after = np.cumsum(blocks_fitting[::-1])[::-1]
    count = 0
    for i in range(min(problem.dp_size, num_sequences)):
        for r in range(i, num_sequences):
            count += num_sequences - r
            if degrees:  # every CP rank may hold any sequence >= r whole (see _JointModel.members)
                count += cp_size * int(fits_after[r]) + int(blocks_after[r])
            else:
                count += sum(int(fits_after[s]) for s in range(r, min(r + cp_size, num_sequences)))
    return count


# A plan as the model labels it: DP ranks → micro-batches, each list sorted by smallest index, nothing empty.
_CanonicalPlan = list[list[MicroBatch]]


def _canonical(plan: Plan, *, ordered_cp_ranks: bool) -> _CanonicalPlan:
    """The plan relabelled as the model names things. With ``ordered_cp_ranks`` (the binary space) a micro-batch's
    CP ranks are renumbered by their smallest local index too; a hybrid block pins its ranks, so there they stay."""
    def first(micro_batch: MicroBatch) -> int:
        return min(micro_batch.indices())

    def relabelled(micro_batch: MicroBatch) -> MicroBatch:
        if not ordered_cp_ranks:
            return micro_batch
        local = sorted((sorted(group) for group in micro_batch.local if group), key=min)
        return MicroBatch(local=tuple(map(tuple, local)) + ((),) * (len(micro_batch.local) - len(local)),
                          distributed=tuple(sorted(micro_batch.distributed)))

    dp_ranks = [sorted((relabelled(mb) for mb in dp_plan.micro_batches if mb.indices()), key=first)
                for dp_plan in plan.dp_ranks]
    return sorted((micro_batches for micro_batches in dp_ranks if micro_batches),
                  key=lambda micro_batches: first(micro_batches[0]))


def _one_sequence_per_micro_batch(problem: PlanningProblem) -> Plan:
    """Every sequence alone and distributed, dealt round-robin over DP ranks: valid whenever every
    ``S_k <= C·N``, which ``make_problem`` guarantees. The hint of last resort."""
    empty_local = ((),) * problem.cp_size
    return Plan(dp_ranks=tuple(
        DPRankPlan(micro_batches=tuple(
            MicroBatch(local=empty_local, distributed=(k,))
            for k in range(dp_rank, problem.num_sequences, problem.dp_size)
        ))
        for dp_rank in range(problem.dp_size)
    ))


class _JointModel:
    """The CP-SAT model of one problem (paper eqs. 1–11), its warm start and its read-back; in the hybrid space also
    every aligned block of CP ranks as a place (docs/design.md, "Wire contract")."""

    def __init__(self, problem: PlanningProblem, *, hybrid: bool) -> None:
        self.problem = problem
        self.costs = costs = _quantise(problem, hybrid=hybrid)
        self.model = cp_model.CpModel()
        num_sequences, cp_size, bucket_size = problem.num_sequences, problem.cp_size, problem.bucket_size
        self.lengths = lengths = [int(length) for length in problem.lengths]
        self.capacity = bucket_size * cp_size  # tokens per micro-batch over the CP group (eq. 10's C·N)
        # The aligned blocks a sequence may be sharded over, (first CP rank, degree): none in the binary space.
        self.blocks = blocks = [(first, degree) for degree in costs.blocks for first in range(0, cp_size, degree)]
        # Without blocks the CP ranks of a micro-batch are interchangeable and are numbered (below); a block pins
        # its ranks, so in the hybrid space they keep their positions.
        self.ordered_cp_ranks = ordered = not blocks
        # No plan is slower than running every sequence alone, one after another, paying every fixed cost of
        # every place.
        self.horizon = sum(costs.local) + sum(costs.distributed) + sum(costs.all_gather) + sum(costs.reduce_scatter) \
            + num_sequences * (costs.compute_fixed + costs.compute_floor + costs.all_gather_fixed
                               + costs.reduce_scatter_fixed) \
            + sum(
                sum(block.compute) + sum(block.all_gather) + sum(block.reduce_scatter)
                + num_sequences * (block.all_gather_fixed + block.reduce_scatter_fixed)
                for block in costs.blocks.values())

        # Micro-batch slots (i, r): the micro-batch of DP rank i whose smallest sequence index (representative)
        # is r. Every micro-batch of every plan has exactly one such name. Numbering DP ranks by their smallest
        # index (below) makes DP rank i start at an index >= i, so r >= i.
        self.num_dp_ranks = min(problem.dp_size, num_sequences)  # the others stay empty
        self.slots = slots = [(i, r) for i in range(self.num_dp_ranks) for r in range(i, num_sequences)]
        # In the binary space, CP ranks of a micro-batch numbered by their smallest local index make CP rank j
        # start at an index >= r + j. A sequence longer than C never fits whole on one rank (eq. 7). CP ranks that
        # no sequence can use are left out of the binary model (they form a suffix); the hybrid one keeps every
        # rank, since blocks may put work on it.
        self.fits_whole = fits_whole = [length <= bucket_size for length in lengths]
        self.members = {(i, r, j): [k for k in range(r + j if ordered else r, num_sequences) if fits_whole[k]]
                        for i, r in slots for j in range(cp_size)}
        self.cp_ranks = {(i, r): [j for j in range(cp_size) if self.members[i, r, j]] for i, r in slots}
        self.distributable = {(i, r): range(r, num_sequences) for i, r in slots}
        self.shardable = {(i, r, b): [k for k in range(r, num_sequences) if lengths[k] <= degree * bucket_size]
                          for i, r in slots for b, (_, degree) in enumerate(blocks)}
        self.modelled_ranks = {(i, r): self.cp_ranks[i, r] if ordered else range(cp_size) for i, r in slots}

        self._declare_variables()
        self._each_sequence_once()
        for i, r in slots:
            in_blocks = [b for b in range(len(blocks)) if self.shardable[i, r, b]]
            self._open_and_indicators(i, r, in_blocks)
            self._symmetry_breaking(i, r)
            self._memory_bound(i, r, in_blocks)
            self._micro_batch_time(i, r, in_blocks)
        self._redundant_counts()
        self._iteration_time()

    def _declare_variables(self) -> None:
        """Placement booleans: ``local[k, i, r, j]`` keeps sequence k whole on CP rank j of micro-batch (i, r)
        (P_kj); ``dist[k, i, r]`` shards it over the CP group (D_k); ``group[k, i, r, b]`` over block b.

        Indicator booleans, each true exactly when its group is non-empty: ``opens[i, r]`` (the micro-batch),
        ``busy[i, r, j]`` (CP rank j has local work), ``sharded[i, r]`` (distributed work; it pays T_fixed and every
        CP rank pays β), ``used[i, r, b]`` (block b has a sequence; it pays its T_fixed and its ranks β),
        ``working[i, r, j]`` (any of these on CP rank j: it pays β). Micro-batch times and the iteration time, in
        ticks."""
        model, slots, num_blocks = self.model, self.slots, len(self.blocks)
        self.local = {
            (k, i, r, j): model.new_bool_var(f"local[{k},{i},{r},{j}]")
            for i, r in slots for j in self.cp_ranks[i, r] for k in self.members[i, r, j]
        }
        self.dist = {
            (k, i, r): model.new_bool_var(f"dist[{k},{i},{r}]") for i, r in slots for k in self.distributable[i, r]
        }
        self.group = {
            (k, i, r, b): model.new_bool_var(f"group[{k},{i},{r},{b}]")
            for i, r in slots for b in range(num_blocks) for k in self.shardable[i, r, b]
        }
        self.opens = {(i, r): model.new_bool_var(f"opens[{i},{r}]") for i, r in slots}
        self.busy = {(i, r, j): model.new_bool_var(f"busy[{i},{r},{j}]") for i, r in slots for j in self.cp_ranks[i, r]}
        self.sharded = {(i, r): model.new_bool_var(f"sharded[{i},{r}]") for i, r in slots}
        self.used = {(i, r, b): model.new_bool_var(f"used[{i},{r},{b}]")
                     for i, r in slots for b in range(num_blocks) if self.shardable[i, r, b]}
        self.working = {(i, r, j): model.new_bool_var(f"working[{i},{r},{j}]")
                        for i, r in slots for j in self.modelled_ranks[i, r]}
        self.mb_time = {(i, r): model.new_int_var(0, self.horizon, f"time[{i},{r}]") for i, r in slots}
        self.iteration_time = model.new_int_var(0, self.horizon, "iteration_time")

    def _each_sequence_once(self) -> None:
        """Each sequence is scheduled exactly once (eq. 9)."""
        places: list[list[cp_model.IntVar]] = [[] for _ in range(self.problem.num_sequences)]
        for (k, *_), variable in [*self.dist.items(), *self.local.items(), *self.group.items()]:
            places[k].append(variable)
        for variables in places:
            self.model.add_exactly_one(variables)

    def _open_and_indicators(self, i: int, r: int, in_blocks: list[int]) -> None:
        """Representatives: micro-batch (i, r) is open exactly when sequence r is in it (if local in the binary
        space, on CP rank 0, the rank of the smallest local index), and every member needs it open. The indicators
        tied both ways to their groups."""
        model, dist, local, group = self.model, self.dist, self.local, self.group
        distributable, cp_ranks = self.distributable[i, r], self.cp_ranks[i, r]
        in_micro_batch = [dist[k, i, r] for k in distributable] + [
            local[k, i, r, j] for j in cp_ranks for k in self.members[i, r, j]] + [
            group[k, i, r, b] for b in in_blocks for k in self.shardable[i, r, b]]
        representative = [dist[r, i, r]] + [group[r, i, r, b] for b in in_blocks if r in self.shardable[i, r, b]]
        if self.fits_whole[r]:
            representative += [local[r, i, r, j] for j in ([0] if self.ordered_cp_ranks else cp_ranks)]
        model.add(self.opens[i, r] == sum(representative))
        for variable in in_micro_batch:
            model.add_implication(variable, self.opens[i, r])
        model.add_max_equality(self.sharded[i, r], [dist[k, i, r] for k in distributable])
        for j in cp_ranks:
            model.add_max_equality(self.busy[i, r, j], [local[k, i, r, j] for k in self.members[i, r, j]])
        for b in in_blocks:
            model.add_max_equality(self.used[i, r, b], [group[k, i, r, b] for k in self.shardable[i, r, b]])

    def _symmetry_breaking(self, i: int, r: int) -> None:
        """Binary space, CP ranks in order: CP rank j has local work only if CP rank j - 1 has. DP ranks in order
        of their smallest index: micro-batch r opens on DP rank i > 0 only if DP rank i - 1 has a micro-batch with
        a smaller representative."""
        model = self.model
        if self.ordered_cp_ranks:
            for j in self.cp_ranks[i, r][1:]:
                model.add_implication(self.busy[i, r, j], self.busy[i, r, j - 1])
        if i > 0:
            model.add(self.opens[i, r] <= sum(self.opens[i - 1, earlier] for earlier in range(i - 1, r)))

    def _memory_bound(self, i: int, r: int, in_blocks: list[int]) -> None:
        """Memory bound per CP rank, in integer tokens × N (eqs. 7, 10): its local tokens × N, the distributed
        tokens, and N / s of the tokens of each block of s ranks it is in. Each side is also bounded by its
        indicator times the capacity, which changes no integer solution and tightens the LP relaxation."""
        model, lengths, blocks = self.model, self.lengths, self.blocks
        cp_size, bucket_size = self.problem.cp_size, self.problem.bucket_size
        dist_tokens = sum(lengths[k] * self.dist[k, i, r] for k in self.distributable[i, r])
        model.add(dist_tokens <= self.capacity * self.sharded[i, r])
        block_tokens = {b: sum(lengths[k] * self.group[k, i, r, b] for k in self.shardable[i, r, b]) for b in in_blocks}
        for b in in_blocks:
            model.add(block_tokens[b] <= blocks[b][1] * bucket_size * self.used[i, r, b])
        for j in self.modelled_ranks[i, r]:
            local_tokens = sum(lengths[k] * self.local[k, i, r, j] for k in self.members[i, r, j])
            model.add(cp_size * local_tokens + dist_tokens + sum(
                cp_size // blocks[b][1] * block_tokens[b] for b in in_blocks if _holds(blocks[b], j))
                <= self.capacity * self.opens[i, r])
            if j in self.cp_ranks[i, r]:
                model.add(local_tokens <= bucket_size * self.busy[i, r, j])

    def _micro_batch_time(self, i: int, r: int, in_blocks: list[int]) -> None:
        """Micro-batch time, per CP rank: its compute, one β, and the communication its local attention does not
        hide (the forward all-gathers, the backward reduce-scatters of every group it is in), each exposure >= 0
        and >= its argument; and at least the launch-bound floor once open (every CP rank with work takes at
        least it), so that it is max(floor, its slowest rank's device time)."""
        model, costs, blocks, horizon = self.model, self.costs, self.blocks, self.horizon
        dist, group, local, used, sharded = self.dist, self.group, self.local, self.used, self.sharded
        beta, distributable, mb_time = costs.compute_fixed, self.distributable[i, r], self.mb_time
        dist_compute = sum(costs.distributed[k] * dist[k, i, r] for k in distributable)
        all_gather = sum(costs.all_gather[k] * dist[k, i, r] for k in distributable) \
            + costs.all_gather_fixed * sharded[i, r]
        reduce_scatter = sum(costs.reduce_scatter[k] * dist[k, i, r] for k in distributable) \
            + costs.reduce_scatter_fixed * sharded[i, r]
        block_compute, block_all_gather, block_reduce_scatter = {}, {}, {}
        for b in in_blocks:
            block_costs, members = costs.blocks[blocks[b][1]], self.shardable[i, r, b]
            block_compute[b] = sum(block_costs.compute[k] * group[k, i, r, b] for k in members)
            block_all_gather[b] = sum(block_costs.all_gather[k] * group[k, i, r, b] for k in members) \
                + block_costs.all_gather_fixed * used[i, r, b]
            block_reduce_scatter[b] = sum(block_costs.reduce_scatter[k] * group[k, i, r, b] for k in members) \
                + block_costs.reduce_scatter_fixed * used[i, r, b]
        if self.ordered_cp_ranks:  # a CP rank that can hold nothing whole: distributed work only, nothing hides
            model.add(mb_time[i, r] >= dist_compute + beta * sharded[i, r] + all_gather + reduce_scatter)
        cp_ranks = self.cp_ranks[i, r]
        for j in self.modelled_ranks[i, r]:
            members = self.members[i, r, j]
            rank_blocks = [b for b in in_blocks if _holds(blocks[b], j)]
            model.add_max_equality(self.working[i, r, j], [*([self.busy[i, r, j]] if j in cp_ranks else []),
                                                           sharded[i, r], *(used[i, r, b] for b in rank_blocks)])
            exposed_forward = model.new_int_var(0, horizon, f"exposed_forward[{i},{r},{j}]")
            exposed_backward = model.new_int_var(0, horizon, f"exposed_backward[{i},{r},{j}]")
            model.add(exposed_forward >= all_gather + sum(block_all_gather[b] for b in rank_blocks) - sum(
                costs.attention_forward[k] * local[k, i, r, j] for k in members))
            model.add(exposed_backward >= reduce_scatter + sum(block_reduce_scatter[b] for b in rank_blocks)
                      - sum(costs.attention_backward[k] * local[k, i, r, j] for k in members))
            local_compute = sum(costs.local[k] * local[k, i, r, j] for k in members)
            model.add(mb_time[i, r] >= local_compute + dist_compute + sum(block_compute[b] for b in rank_blocks)
                      + beta * self.working[i, r, j] + exposed_forward + exposed_backward)
        model.add(mb_time[i, r] >= beta * self.opens[i, r])
        if costs.compute_floor:
            model.add(mb_time[i, r] >= costs.compute_floor * self.opens[i, r])

    def _redundant_counts(self) -> None:
        """For the bound: the memory bound summed over micro-batches needs at least this many micro-batches, and
        (binary space, where a sequence longer than C can only be distributed) at least this many with
        distributed work."""
        lengths = self.problem.lengths
        self.model.add(sum(self.opens.values()) >= min_micro_batches(lengths, self.capacity))
        if self.ordered_cp_ranks:
            self.model.add(sum(self.sharded.values()) >= min_micro_batches(lengths[lengths > self.problem.bucket_size],
                                                                           self.capacity))

    def _iteration_time(self) -> None:
        """The objective: the slowest DP rank's sum over its micro-batches (eq. 8)."""
        for i in range(self.num_dp_ranks):
            self.model.add(self.iteration_time >= sum(self.mb_time[i, r] for r in range(i, self.problem.num_sequences)))
        self.model.minimize(self.iteration_time)

    def add_hint(self, plan: Plan) -> None:
        """Warm start from a valid plan of the model's space: the placement, the indicators and the times in model
        ticks (the solver completes the rest)."""
        costs, beta, blocks = self.costs, self.costs.compute_fixed, self.blocks
        values: dict[cp_model.IntVar, int] = dict.fromkeys(
            [*self.local.values(), *self.dist.values(), *self.group.values(), *self.opens.values(),
             *self.busy.values(), *self.sharded.values(), *self.used.values(), *self.working.values(),
             *self.mb_time.values()], 0)
        block_index = {block: b for b, block in enumerate(blocks)}
        dp_times = []
        for i, micro_batches in enumerate(_canonical(plan, ordered_cp_ranks=self.ordered_cp_ranks)):
            dp_times.append(0)
            for micro_batch in micro_batches:
                r = min(micro_batch.indices())
                values[self.opens[i, r]] = 1
                distributed = micro_batch.distributed
                all_gather = reduce_scatter = dist_compute = 0
                if distributed:
                    values[self.sharded[i, r]] = 1
                    all_gather = sum(costs.all_gather[k] for k in distributed) + costs.all_gather_fixed
                    reduce_scatter = sum(costs.reduce_scatter[k] for k in distributed) + costs.reduce_scatter_fixed
                    dist_compute = sum(costs.distributed[k] for k in distributed)
                for k in distributed:
                    values[self.dist[k, i, r]] = 1
                # per CP rank, what its hybrid groups add: compute, all-gather, reduce-scatter, how many groups
                from_blocks = [[0, 0, 0, 0] for _ in range(self.problem.cp_size)]
                for sharded_group in micro_batch.sharded:
                    b = block_index[sharded_group.cp_ranks[0], sharded_group.degree]
                    block_costs = costs.blocks[sharded_group.degree]
                    values[self.used[i, r, b]] = 1
                    for k in sharded_group.sequences:
                        values[self.group[k, i, r, b]] = 1
                    added = (sum(block_costs.compute[k] for k in sharded_group.sequences),
                             sum(block_costs.all_gather[k] for k in sharded_group.sequences)
                             + block_costs.all_gather_fixed,
                             sum(block_costs.reduce_scatter[k] for k in sharded_group.sequences)
                             + block_costs.reduce_scatter_fixed, 1)
                    for j in sharded_group.cp_ranks:
                        from_blocks[j] = [total + part for total, part in zip(from_blocks[j], added, strict=True)]
                rank_times = [dist_compute + beta * bool(distributed) + all_gather + reduce_scatter] \
                    if self.ordered_cp_ranks else []
                for j in self.modelled_ranks[i, r]:
                    local = micro_batch.local[j]
                    compute, gathered, scattered, num_groups = from_blocks[j]
                    if j in self.cp_ranks[i, r]:
                        values[self.busy[i, r, j]] = int(bool(local))
                    values[self.working[i, r, j]] = int(bool(local) or bool(distributed) or num_groups > 0)
                    for k in local:
                        values[self.local[k, i, r, j]] = 1
                    exposed = max(0, all_gather + gathered - sum(costs.attention_forward[k] for k in local)) + max(
                        0, reduce_scatter + scattered - sum(costs.attention_backward[k] for k in local))
                    rank_times.append(sum(costs.local[k] for k in local) + dist_compute + compute
                                      + beta * values[self.working[i, r, j]] + exposed)
                values[self.mb_time[i, r]] = max([*rank_times, beta])
                dp_times[-1] += values[self.mb_time[i, r]]
        values[self.iteration_time] = max(dp_times)
        for variable, value in values.items():
            self.model.add_hint(variable, value)

    def plan(self, solver: cp_model.CpSolver) -> Plan:
        """The solver's current solution as a plan; empty micro-batch slots are dropped."""
        problem, cp_size = self.problem, self.problem.cp_size
        places: dict[tuple[int, int], list[Place]] = {slot: [] for slot in self.slots}  # per slot (i, r)
        for (k, i, r, j), variable in self.local.items():
            if solver.boolean_value(variable):
                places[i, r].append((k, 1, j))
        for (k, i, r), variable in self.dist.items():
            if solver.boolean_value(variable):
                places[i, r].append((k, cp_size, 0))
        for (k, i, r, b), variable in self.group.items():
            if solver.boolean_value(variable):
                first, degree = self.blocks[b]
                places[i, r].append((k, degree, first))
        dp_ranks: list[list[MicroBatch]] = [[] for _ in range(problem.dp_size)]
        for (i, _), slot_places in places.items():
            if slot_places:
                dp_ranks[i].append(MicroBatch.from_places(slot_places, cp_size))
        return Plan(dp_ranks=tuple(DPRankPlan(micro_batches=tuple(micro_batches)) for micro_batches in dp_ranks))


def _holds(block: tuple[int, int], cp_rank: int) -> bool:
    """Whether the block (first CP rank, degree) contains ``cp_rank``."""
    first, degree = block
    return first <= cp_rank < first + degree


def solve(
    problem: PlanningProblem, *, time_limit_s: float, hint: Plan | None = None, num_workers: int = 1,
    hybrid: bool = False,
) -> CpSatSolution:
    """The best plan CP-SAT finds within ``time_limit_s``, warm-started from ``hint`` (a valid plan).

    ``hybrid`` searches hybrid DACP's space too (a sequence may also be sharded over any aligned block of CP ranks),
    and ``hint`` may then carry groups; without it the space is binary. The hybrid model has more placement
    booleans and cannot number a micro-batch's CP ranks, so it proves optimality on smaller batches only.

    Deterministic: the same problem and hint give the same plan (the module docstring says how);
    ``time_limit_s`` is converted to CP-SAT's deterministic time.

    Never worse than the hint under ``simulate()``: when the search finds nothing better, or nothing at all,
    the hint comes back, and ``report.status`` says what the solver proved. Without a hint, every sequence in
    its own distributed micro-batch stands in for it. ``wall_time_s`` includes building the model.
    """
    if problem.token_buckets:
        raise InvalidRequestError("cpsat does not model token buckets (the padding of rows to a bucket): plan with "
                                  "token_buckets 0", field="token_buckets")
    if not time_limit_s >= 0:
        raise ValueError(f"time_limit_s must be non-negative, got {time_limit_s}")
    if num_workers < 1:
        raise ValueError(f"num_workers must be at least 1, got {num_workers}")
    if hint is not None:
        check_plan(hint, sequence_lengths=problem.sequence_lengths, dp_size=problem.dp_size,
                   cp_size=problem.cp_size, bucket_size=problem.bucket_size)
        if hint.spanning:
            raise ValueError("the hint has spanning micro-batches, which the model (plans within CP groups) has no "
                             "place for: hint a plan within CP groups (gds.skrull)")
        if not hybrid and any(mb.sharded for dp_rank in hint.dp_ranks for mb in dp_rank.micro_batches):
            raise ValueError("the hint has hybrid groups, which the binary space has no place for: solve with "
                             "hybrid=True or hint a binary plan")
    num_booleans = _num_placement_booleans(problem, hybrid=hybrid)
    if num_booleans > MAX_PLACEMENT_BOOLEANS:
        raise InvalidRequestError(
            f"the exact cpsat scheduler would need {num_booleans} placement booleans for {problem.num_sequences} "
            f"sequences on dp_size {problem.dp_size} × cp_size {problem.cp_size}; at most {MAX_PLACEMENT_BOOLEANS} "
            "are allowed: schedule a smaller batch or use a heuristic scheduler",
            field="scheduler",
        )
    fallback = hint if hint is not None else _one_sequence_per_micro_batch(problem)
    started = time.perf_counter()

    joint = _JointModel(problem, hybrid=hybrid)
    joint.add_hint(fallback)
    solver = cp_model.CpSolver()
    solver.parameters.max_deterministic_time = time_limit_s * DETERMINISTIC_TIME_PER_SECOND
    solver.parameters.max_time_in_seconds = time_limit_s * WALL_CLOCK_SAFETY
    solver.parameters.num_workers = num_workers
    solver.parameters.interleave_search = num_workers > 1
    solver.parameters.random_seed = SEED
    solver.parameters.cp_model_presolve = num_booleans <= MAX_PRESOLVE_BOOLEANS
    status = solver.solve(joint.model)

    plan = fallback
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        solved = joint.plan(solver)
        # Rounding down can rank a plan a few ns ahead of the hint in the model and behind it in simulate().
        if simulate(problem, solved).iteration_time_s <= simulate(problem, fallback).iteration_time_s:
            plan = solved
    bound_s = None
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE, cp_model.UNKNOWN) and math.isfinite(
            solver.best_objective_bound):
        bound_s = max(solver.best_objective_bound, 0.0) / TICKS_PER_SECOND
    report = SolverReport(
        status=solver.status_name(status),
        objective_s=simulate(problem, plan).iteration_time_s,
        bound_s=bound_s,
        wall_time_s=time.perf_counter() - started,
    )
    return CpSatSolution(plan=plan, report=report)
