"""The planning problem and the plan: the value objects every scheduler shares.

A ``Plan`` mirrors the wire contract (docs/design.md, "Wire contract"): per DP rank an ordered list
of micro-batches; per micro-batch ``cp_size`` lists of sequence indices kept
whole on that CP rank ("local"), one list sharded over the whole CP group
("distributed"), and hybrid DACP's ``sharded`` groups: sequences sharded over an
aligned block of CP ranks (``cp_blocks``). Indices point into
``PlanningProblem.sequence_lengths``.

A plan may also hold **spanning micro-batches** (``Plan.spanning``): one micro-batch run as one synchronised step by
an aligned block of DP replicas, over all their CP ranks, world ranks ``dp_rank × cp_size + cp_rank`` in order. It
is a ``MicroBatch`` over a group of ``num_dp_ranks × cp_size`` ranks, its places relative to the block's first world
rank; ``PlanningProblem.span_problem`` prices it. Every DP replica of the block runs its spanning micro-batches
first, in the order of ``Plan.spanning``, then its own (docs/design.md, "Blocks that span DP replicas").

The kernels read a plan as ``Places``: per sequence its micro-batch and its place, a degree and a first CP rank
(``costing``). ``MicroBatch.from_places`` and ``MicroBatch.places`` convert one micro-batch, ``Plan.from_places``
and ``Plan.places`` a whole plan; nothing else converts between the two forms.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import cast

import numpy as np
import numpy.typing as npt

from scheduler_service.core.choices import MAX_TOKEN_BUCKETS, SchedulerName
from scheduler_service.core.costing import CostTables, block_degrees, cost_tables, place_degrees
from scheduler_service.core.errors import BadSequenceLengthError, InvalidRequestError, SequenceTooLongError
from scheduler_service.core.models import ModelShape, resolve_model
from scheduler_service.core.perf_model import PerformanceModel
from scheduler_service.core.profile import Profile, resolve_profile

__all__ = [
    "DEFAULT_LIMITS",
    "MAX_TOKEN_BUCKETS",
    "Collective",
    "DPRankPlan",
    "MicroBatch",
    "Place",
    "Places",
    "Plan",
    "PlanLimits",
    "PlanningProblem",
    "SchedulerName",
    "ShardedGroup",
    "SolverReport",
    "SpanningMicroBatch",
    "block_degrees",
    "check_sequence_count",
    "cp_blocks",
    "find_bad_length",
    "make_problem",
]

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanLimits:
    """Bounds that keep one request from exhausting the planner; the service makes them configurable."""

    max_sequences: int = 65536
    max_sequence_length: int = 1 << 24
    max_dp_size: int = 4096
    max_cp_size: int = 1024
    max_search_budget: int = 1 << 16


DEFAULT_LIMITS = PlanLimits()


def cp_blocks(cp_size: int, degree: int) -> tuple[tuple[int, ...], ...]:
    """The aligned blocks of ``degree`` CP ranks: ``[0..s)``, ``[s..2s)``, … (docs/design.md, "Wire contract")."""
    return tuple(tuple(range(start, start + degree)) for start in range(0, cp_size, degree))


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardedGroup:
    """Sequences sharded over ``cp_ranks``, an aligned block of the CP group (the checker verifies it), by the scheme
    of ``ulysses_degree`` (``CollectiveScheme.of``: 1 all-gather-KV, the degree Ulysses, between them 2D)."""

    cp_ranks: tuple[int, ...]
    sequences: tuple[int, ...]
    ulysses_degree: int = 1

    @property
    def degree(self) -> int:
        return len(self.cp_ranks)


Place = tuple[int, int, int]  # (sequence index, degree, first CP rank): see ``costing``


@dataclass(frozen=True, kw_only=True, slots=True)
class MicroBatch:
    local: tuple[tuple[int, ...], ...]  # one tuple per CP rank: indices kept whole there
    distributed: tuple[int, ...]  # indices sharded over the whole CP group
    sharded: tuple[ShardedGroup, ...] = ()  # hybrid DACP: indices sharded over part of the CP group
    distributed_ulysses_degree: int = 1  # the scheme of ``distributed`` (``ShardedGroup.ulysses_degree``)

    @classmethod
    def from_places(cls, places: Sequence[Place], cp_size: int,
                    ulysses_degrees: Mapping[tuple[int, int], int] | None = None) -> MicroBatch:
        """The micro-batch of these (index, degree, first CP rank) places; each list in index order, groups by
        first rank, then degree. ``ulysses_degrees``: the scheme of the collective over each (first rank, degree)
        block that is not all-gather-KV."""
        blocks: dict[tuple[int, int], list[int]] = {}
        for index, degree, first_rank in sorted(places):
            blocks.setdefault((first_rank, degree), []).append(index)
        return cls._of_blocks(sorted(blocks.items()), cp_size, ulysses_degrees)

    @classmethod
    def _of_blocks(cls, blocks: Iterable[tuple[tuple[int, int], Sequence[int]]], cp_size: int,
                   ulysses_degrees: Mapping[tuple[int, int], int] | None) -> MicroBatch:
        """The micro-batch of ``blocks``: ((first CP rank, degree), its indices in index order), by first rank,
        then degree (``from_places``)."""
        local: list[tuple[int, ...]] = [()] * cp_size
        distributed: tuple[int, ...] = ()
        sharded = []
        schemes = ulysses_degrees or {}
        for (first_rank, degree), members in blocks:
            if degree == 1:
                local[first_rank] += tuple(members)
            elif degree == cp_size:
                distributed += tuple(members)
            else:
                sharded.append(ShardedGroup(cp_ranks=tuple(range(first_rank, first_rank + degree)),
                                            sequences=tuple(members),
                                            ulysses_degree=schemes.get((first_rank, degree), 1)))
        return cls(local=tuple(local), distributed=distributed, sharded=tuple(sharded),
                   distributed_ulysses_degree=schemes.get((0, cp_size), 1) if distributed else 1)

    def places(self) -> Iterator[Place]:
        """(index, degree, first CP rank) of every sequence: local ones, distributed ones, then each group's."""
        for cp_rank, rank_local in enumerate(self.local):
            for index in rank_local:
                yield index, 1, cp_rank
        for index in self.distributed:
            yield index, len(self.local), 0
        for group in self.sharded:
            for index in group.sequences:
                yield index, group.degree, group.cp_ranks[0]

    def indices(self) -> list[int]:
        return [index for index, _, _ in self.places()]

    def collectives(self) -> Iterator[Collective]:
        """Every collective, in the trainer's row order: ``distributed`` (when it has sequences), then the groups."""
        if self.distributed:
            yield Collective(first_rank=0, degree=len(self.local), sequences=self.distributed,
                             ulysses_degree=self.distributed_ulysses_degree)
        for group in self.sharded:
            yield Collective(first_rank=group.cp_ranks[0], degree=group.degree, sequences=group.sequences,
                             ulysses_degree=group.ulysses_degree)

    def with_ulysses_degrees(self, ulysses_degrees: Sequence[int]) -> MicroBatch:
        """The same micro-batch with each collective's Ulysses degree replaced, in ``collectives()``'s order."""
        collectives = list(self.collectives())
        if len(ulysses_degrees) != len(collectives):
            raise ValueError(f"{len(ulysses_degrees)} Ulysses degrees for {len(collectives)} collectives")
        by_group = list(ulysses_degrees[1:] if self.distributed else ulysses_degrees)
        return MicroBatch(
            local=self.local, distributed=self.distributed,
            distributed_ulysses_degree=ulysses_degrees[0] if self.distributed else 1,
            sharded=tuple(ShardedGroup(cp_ranks=group.cp_ranks, sequences=group.sequences, ulysses_degree=degree)
                          for group, degree in zip(self.sharded, by_group, strict=True)))


@dataclass(frozen=True, kw_only=True, slots=True)
class Collective:
    """One collective of a micro-batch: ``sequences`` sharded over the aligned block of ``degree`` ranks from
    ``first_rank``, by the scheme of ``ulysses_degree`` (``CollectiveScheme.of``)."""

    first_rank: int
    degree: int
    sequences: tuple[int, ...]
    ulysses_degree: int = 1


@dataclass(frozen=True, kw_only=True, slots=True)
class DPRankPlan:
    micro_batches: tuple[MicroBatch, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class SpanningMicroBatch:
    """A micro-batch over the DP replicas ``first_dp_rank .. first_dp_rank + num_dp_ranks − 1`` (an aligned block:
    ``num_dp_ranks >= 2`` dividing ``first_dp_rank``; the checker verifies it), run by each of them as one
    synchronised step. ``micro_batch`` has one local list per rank of the block (``num_dp_ranks × cp_size``), and
    its places count from the block's first world rank ``first_dp_rank × cp_size``."""

    first_dp_rank: int
    num_dp_ranks: int
    micro_batch: MicroBatch

    @property
    def dp_ranks(self) -> range:
        return range(self.first_dp_rank, self.first_dp_rank + self.num_dp_ranks)

    def world_ranks(self, cp_size: int) -> range:
        """The world ranks of the block (DP-major: ``dp_rank × cp_size + cp_rank``)."""
        return range(self.first_dp_rank * cp_size, (self.first_dp_rank + self.num_dp_ranks) * cp_size)


@dataclass(frozen=True, slots=True)
class Places:
    """A plan as arrays (axes: N sequences, M micro-batches, numbered DP rank by DP rank in their order)."""

    micro_batch: IntArray  # (N,) the micro-batch of each sequence; -1 where it is in none
    degree: IntArray  # (N,) its place: the degree ...
    first_rank: IntArray  # (N,) ... and the first CP rank
    dp_rank: IntArray  # (M,) the DP rank each micro-batch belongs to

    @property
    def num_micro_batches(self) -> int:
        return len(self.dp_rank)

    def plan_order(self) -> list[int]:
        """The micro-batch numbers in the order ``Plan.from_places`` lists them: DP rank by DP rank, by number,
        the empty ones left out (the identity for the places of a plan without an empty micro-batch,
        ``Plan.places``)."""
        held = np.bincount(self.micro_batch[self.micro_batch >= 0], minlength=self.num_micro_batches) > 0
        numbers = np.flatnonzero(held)
        return numbers[np.argsort(self.dp_rank[numbers], kind="stable")].tolist()


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    dp_ranks: tuple[DPRankPlan, ...]
    spanning: tuple[SpanningMicroBatch, ...] = ()  # run first, in this order, by every DP replica each spans

    @property
    def num_micro_batches(self) -> int:
        return sum(len(dp_rank.micro_batches) for dp_rank in self.dp_ranks) + len(self.spanning)

    def micro_batches_of(self, dp_rank: int) -> int:
        """How many micro-batches DP replica ``dp_rank`` runs: the spanning ones it is part of, then its own."""
        return sum(dp_rank in spanning.dp_ranks for spanning in self.spanning) + \
            len(self.dp_ranks[dp_rank].micro_batches)

    def renumbered(self, indices: Sequence[int]) -> Plan:
        """This plan of a sub-batch with its sequence ``i`` renamed ``indices[i]``: how a plan of part of a batch
        (``PlanningProblem.sub_problem``) joins the plan of the whole."""

        def rename(micro_batch: MicroBatch) -> MicroBatch:
            return MicroBatch(
                local=tuple(tuple(indices[i] for i in rank_local) for rank_local in micro_batch.local),
                distributed=tuple(indices[i] for i in micro_batch.distributed),
                distributed_ulysses_degree=micro_batch.distributed_ulysses_degree,
                sharded=tuple(ShardedGroup(cp_ranks=group.cp_ranks,
                                           sequences=tuple(indices[i] for i in group.sequences),
                                           ulysses_degree=group.ulysses_degree)
                              for group in micro_batch.sharded))

        return Plan(dp_ranks=tuple(DPRankPlan(micro_batches=tuple(map(rename, dp_plan.micro_batches)))
                                   for dp_plan in self.dp_ranks),
                    spanning=tuple(SpanningMicroBatch(first_dp_rank=spanning.first_dp_rank,
                                                      num_dp_ranks=spanning.num_dp_ranks,
                                                      micro_batch=rename(spanning.micro_batch))
                                   for spanning in self.spanning))

    @classmethod
    def from_places(cls, places: Places, *, dp_size: int, cp_size: int,
                    ulysses_degrees: Mapping[tuple[int, int, int], int] | None = None) -> Plan:
        """The plan of ``places``: each DP rank's micro-batches in the order of their numbers, empty ones left out.
        ``ulysses_degrees``: the scheme of each collective, by (micro-batch number, first rank, degree), that is not
        all-gather-KV (``schemes.choose_for_places``)."""
        schemes: dict[int, dict[tuple[int, int], int]] = {}
        for (m, first_rank, degree), ulysses_degree in (ulysses_degrees or {}).items():
            schemes.setdefault(m, {})[first_rank, degree] = ulysses_degree
        # every block of every micro-batch as one run of indices, in the order ``MicroBatch.from_places`` lists them
        scheduled = np.flatnonzero((places.micro_batch >= 0) & (places.micro_batch < places.num_micro_batches))
        order = np.lexsort((scheduled, places.degree[scheduled], places.first_rank[scheduled],
                            places.micro_batch[scheduled]))
        scheduled = scheduled[order]
        numbers, degrees, first_ranks = (column[scheduled] for column in (places.micro_batch, places.degree,
                                                                           places.first_rank))
        starts = np.flatnonzero(np.diff(numbers, prepend=-1) | np.diff(first_ranks, prepend=-1)
                                | np.diff(degrees, prepend=-1))
        bounds, indices = [*starts.tolist(), len(scheduled)], scheduled.tolist()
        blocks: list[list[tuple[tuple[int, int], list[int]]]] = [[] for _ in range(places.num_micro_batches)]
        for run, (m, first_rank, degree) in enumerate(zip(numbers[starts].tolist(), first_ranks[starts].tolist(),
                                                          degrees[starts].tolist(), strict=True)):
            blocks[m].append(((first_rank, degree), indices[bounds[run]:bounds[run + 1]]))
        dp_ranks: list[list[MicroBatch]] = [[] for _ in range(dp_size)]
        for m, dp_rank in enumerate(places.dp_rank.tolist()):
            if blocks[m]:
                dp_ranks[dp_rank].append(MicroBatch._of_blocks(blocks[m], cp_size, schemes.get(m)))
        return cls(dp_ranks=tuple(DPRankPlan(micro_batches=tuple(micro_batches)) for micro_batches in dp_ranks))

    def places(self, num_sequences: int) -> Places:
        """Every sequence's micro-batch and place (a sequence named twice keeps its last place: the checker counts
        them); the sequences of spanning micro-batches are in none (-1)."""
        scheduled: list[int] = []
        micro_batches: list[int] = []
        degrees: list[int] = []
        first_ranks: list[int] = []
        dp_ranks: list[int] = []
        for dp_rank, dp_plan in enumerate(self.dp_ranks):
            for micro_batch in dp_plan.micro_batches:
                for index, degree, first_rank in micro_batch.places():
                    scheduled.append(index)
                    micro_batches.append(len(dp_ranks))
                    degrees.append(degree)
                    first_ranks.append(first_rank)
                dp_ranks.append(dp_rank)
        micro_batch_of = np.full(num_sequences, -1, dtype=np.int64)
        degree_of = np.zeros(num_sequences, dtype=np.int64)
        first_rank_of = np.zeros(num_sequences, dtype=np.int64)
        micro_batch_of[scheduled] = micro_batches
        degree_of[scheduled] = degrees
        first_rank_of[scheduled] = first_ranks
        return Places(micro_batch_of, degree_of, first_rank_of, np.array(dp_ranks, dtype=np.int64))


@dataclass(frozen=True, kw_only=True, slots=True)
class SolverReport:
    """What an exact solver proved about its answer."""

    status: str  # OPTIMAL | FEASIBLE | UNKNOWN | INFEASIBLE | MODEL_INVALID
    objective_s: float | None
    bound_s: float | None
    wall_time_s: float


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanningProblem:
    """One global batch to schedule, already validated, with the per-sequence costs every scheduler reads (axes as
    in ``costing``: N sequences, D degrees)."""

    sequence_lengths: tuple[int, ...]
    dp_size: int
    cp_size: int
    bucket_size: int  # C: tokens per CP rank per micro-batch
    perf: PerformanceModel
    spanning: bool = True  # whether a plan may hold spanning micro-batches (``SpanningMicroBatch``)
    schemes: bool = True  # whether a collective may be Ulysses or 2D (``schemes``); False: all-gather-KV only
    token_buckets: int = 0  # rows padded to this many token buckets (``costing.token_bucket_sizes``); 0: none
    lengths: IntArray = field(init=False, repr=False)  # (N,)
    flops: FloatArray = field(init=False, repr=False)  # (N,) eq. 13 with the profile's measured terms
    degrees: tuple[int, ...] = field(init=False, repr=False)  # (D,) 1, each hybrid block size, cp_size
    # (D, N) FLOP-equivalents each rank of its block computes for a sequence at each degree (costing.CostTables)
    rank_flops: FloatArray = field(init=False, repr=False)
    area: FloatArray = field(init=False, repr=False)  # (N,) its cheapest place's cost over its ranks (CostTables)
    tables: CostTables = field(init=False, repr=False)  # what the kernels read
    # the problems of blocks of several DP replicas, by their number of replicas (``span_problem``)
    _span_problems: dict[int, PlanningProblem] = field(init=False, repr=False, compare=False)
    # (N,) rank FLOP-equivalents by (degree, Ulysses degree > 1), filled on demand (``scheme_rank_flops``)
    _scheme_flops: dict[tuple[int, int], FloatArray] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        lengths = np.asarray(self.sequence_lengths, dtype=np.int64)
        set_field = functools.partial(object.__setattr__, self)
        tables = cost_tables(self.perf, lengths, self.cp_size, self.bucket_size, self.token_buckets)
        set_field("tables", tables)
        set_field("lengths", tables.lengths)
        set_field("flops", self.perf.flops_array(lengths))
        set_field("degrees", tuple(tables.degrees.tolist()))
        set_field("rank_flops", tables.rank_flops)
        set_field("area", tables.area)
        set_field("_span_problems", {})
        set_field("_scheme_flops", {})

    @property
    def num_sequences(self) -> int:
        return len(self.sequence_lengths)

    @property
    def world_capacity(self) -> int:
        """Tokens one spanning micro-batch over every DP replica may hold: the longest sequence a plan can hold."""
        return self.micro_batch_capacity * self.dp_size

    def span_problem(self, num_dp_ranks: int) -> PlanningProblem:
        """The same batch on one group of ``num_dp_ranks × cp_size`` ranks: what prices and places the spanning
        micro-batches over blocks of ``num_dp_ranks`` replicas (1: this problem)."""
        if num_dp_ranks == 1:
            return self
        if num_dp_ranks not in self._span_problems:
            self._span_problems[num_dp_ranks] = PlanningProblem(
                sequence_lengths=self.sequence_lengths, dp_size=1, cp_size=num_dp_ranks * self.cp_size,
                bucket_size=self.bucket_size, perf=self.perf, spanning=False, schemes=self.schemes,
                token_buckets=self.token_buckets)
        return self._span_problems[num_dp_ranks]

    def sub_problem(self, indices: Sequence[int]) -> PlanningProblem:
        """The batch of the sequences ``indices`` alone, on the same ranks (``Plan.renumbered`` names them back)."""
        return PlanningProblem(sequence_lengths=tuple(self.sequence_lengths[i] for i in indices),
                               dp_size=self.dp_size, cp_size=self.cp_size, bucket_size=self.bucket_size,
                               perf=self.perf, spanning=self.spanning, schemes=self.schemes,
                               token_buckets=self.token_buckets)

    def too_long_for_a_replica(self) -> list[int]:
        """The sequences no CP group holds (longer than ``bucket_size × cp_size``): only spanning blocks can."""
        return np.flatnonzero(self.lengths > self.micro_batch_capacity).tolist()

    @property
    def micro_batch_capacity(self) -> int:
        """Tokens one micro-batch may hold over the whole CP group (eq. 10's C × N)."""
        return self.bucket_size * self.cp_size

    @property
    def alpha_s_per_flop(self) -> float:
        return self.tables.alpha_s_per_flop

    @property
    def beta_s(self) -> float:
        """β·L, paid once per micro-batch by each CP rank with work."""
        return self.tables.beta_s

    @property
    def floor_s(self) -> float:
        """The launch-bound floor: no CP rank with work takes less (0 in additive profiles)."""
        return self.tables.floor_s

    def rank_flops_at(self, degree: int) -> FloatArray:
        """(N,) what each rank of a block of ``degree`` ranks computes for each sequence sharded over it."""
        return self.rank_flops[self.degrees.index(degree)]

    def scheme_rank_flops(self, degree: int, ulysses_degree: int) -> FloatArray:
        """(N,) ``rank_flops_at(degree)`` for collectives of Ulysses degree ``ulysses_degree`` (``schemes``)."""
        if ulysses_degree == 1:
            return self.rank_flops_at(degree)
        key = (degree, ulysses_degree)
        if key not in self._scheme_flops:
            self._scheme_flops[key] = self.perf.placement_flops(self.lengths, degree, ulysses_degree)
        return self._scheme_flops[key]

    def cheapest_rank_flops(self) -> FloatArray:
        """(D, N) the least each rank of a block of each degree computes for a sequence there, over every scheme
        the block may use: what a lower bound on any plan reads (``simulate.iteration_lower_bound_s``)."""
        return np.stack([np.minimum.reduce([self.rank_flops[d], *(self.scheme_rank_flops(degree, u)
                                                                   for u in self.perf.ulysses_degrees(degree))])
                         for d, degree in enumerate(self.degrees)])


def _validate_int(value: object, name: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise InvalidRequestError(f"{name} must be an integer, got {value!r}", field=name)
    if not low <= value <= high:
        raise InvalidRequestError(f"{name} must be between {low} and {high}, got {value}", field=name)
    return int(value)


def check_sequence_count(count: int, limits: PlanLimits) -> None:
    """A global batch holds 1 to ``limits.max_sequences`` sequences. The service checks a body's count with it
    before validating the lengths themselves, so that a huge body of bad items costs nothing to describe."""
    if count == 0:
        raise InvalidRequestError("sequence_lengths is empty: a global batch needs at least one sequence",
                                  field="sequence_lengths")
    if count > limits.max_sequences:
        raise InvalidRequestError(f"sequence_lengths has {count} sequences; at most {limits.max_sequences} are "
                                  "accepted", field="sequence_lengths", limit=limits.max_sequences)


def _validate_lengths(sequence_lengths: Sequence[int], limits: PlanLimits) -> tuple[int, ...]:
    """Every length a positive integer within ``limits.max_sequence_length``: the one place these are checked (the
    wire model types them as integers and documents the bounds)."""
    check_sequence_count(len(sequence_lengths), limits)
    problem = find_bad_length(sequence_lengths, limits)
    if problem is not None:
        raise problem
    return tuple(sequence_lengths) if set(map(type, sequence_lengths)) == {int} else tuple(map(int, sequence_lengths))


def find_bad_length(sequence_lengths: Sequence[object], limits: PlanLimits) -> BadSequenceLengthError | None:
    """The error of the first bad length, named by its index with how many others are bad (a batch of a million
    bad lengths costs one error to describe), or None when every one is a positive integer within
    ``limits.max_sequence_length``. The service's parser also asks it when other fields are bad, so that one
    answer names every bad field."""
    types = set(map(type, sequence_lengths))  # the common case checked at C speed (a plan of 4096 waits for it)
    if all(kind is not bool and issubclass(kind, int | np.integer) for kind in types):
        integers = cast("Sequence[int]", sequence_lengths)
        if min(integers, default=1) >= 1 and max(integers, default=1) <= limits.max_sequence_length:
            return None
    problems = ((index, _length_problem(index, length, limits)) for index, length in enumerate(sequence_lengths))
    bad = [(index, problem) for index, problem in problems if problem is not None]
    (index, (message, limit)), more = bad[0], len(bad) - 1
    return BadSequenceLengthError(message + (f" (and {more} more bad lengths)" if more else ""), index=index,
                                  limit=limit)


def _length_problem(index: int, length: object, limits: PlanLimits) -> tuple[str, int | None] | None:
    """What is wrong with sequence ``index``'s length and the bound it broke (None: no bound); None: nothing."""
    if isinstance(length, bool) or not isinstance(length, int | np.integer):
        return f"sequence {index} length must be an integer, got {length!r}", None
    if length <= 0:
        return f"sequence {index} length must be positive, got {length}", 1
    if length > limits.max_sequence_length:
        return (f"sequence {index} has {length} tokens; the service accepts at most {limits.max_sequence_length}",
                limits.max_sequence_length)
    return None


def _validate_node_alignment(cp_size: int, gpus_per_node: int) -> None:
    """Every block of the CP group lies within one node or covers whole nodes, so that a block crosses nodes iff
    it is larger than one (the rule the performance model prices by)."""
    for degree in place_degrees(cp_size):
        if degree % gpus_per_node and gpus_per_node % degree:
            raise InvalidRequestError(
                f"cp_size {cp_size} has blocks of {degree} CP ranks, which straddle nodes of gpus_per_node "
                f"{gpus_per_node} GPUs: with nodes, use a power-of-two cp_size", field="cp_size")


def _prices_the_world(perf: PerformanceModel, world_size: int) -> bool:
    """Whether the profile prices a block of the whole world: one across nodes needs its inter-node tables, and
    without them no plan spans DP replicas."""
    try:
        perf.collective_cost(world_size)
    except InvalidRequestError:
        return False
    return True


def make_problem(
    *,
    sequence_lengths: Sequence[int],
    dp_size: int,
    cp_size: int,
    model: str | ModelShape,
    bucket_size: int | None = None,
    profile: str | Profile | None = None,
    limits: PlanLimits = DEFAULT_LIMITS,
    extra_profiles: dict[str, Profile] | None = None,
    gpus_per_node: int | None = None,
    spanning: bool = True,
    token_buckets: int = 0,
    schemes: bool = True,
) -> PlanningProblem:
    """Validate a request and derive what it leaves out (BucketSize from the profile). ``gpus_per_node``: the
    collectives of blocks larger than a node are priced with the profile's inter-node tables (``perf_model``,
    "Topology"); None: every block lies on one node. ``spanning``: a sequence may be longer than one CP group
    holds, up to the world's capacity (blocks that span DP replicas hold it); False: one CP group's capacity is the
    limit, for a client that cannot run spanning micro-batches. ``token_buckets``: the client pads each rank's row
    to the smallest of that many token buckets (``costing.token_bucket_sizes``: BucketSize and its halves), and the
    padding is priced; 0: rows run as packed. ``schemes``: a collective may be Ulysses or 2D where that is faster
    (``schemes``); False: all-gather-KV only, for a client that cannot run them."""
    lengths = _validate_lengths(sequence_lengths, limits)
    dp_size = _validate_int(dp_size, "dp_size", 1, limits.max_dp_size)
    cp_size = _validate_int(cp_size, "cp_size", 1, limits.max_cp_size)
    perf = PerformanceModel(model=resolve_model(model), profile=resolve_profile(profile, extra_profiles),
                            gpus_per_node=gpus_per_node)
    if gpus_per_node is not None:
        _validate_node_alignment(cp_size, gpus_per_node)
    if bucket_size is None:
        # ZeRO-2 shards gradients and optimizer states over every rank holding a replica: DP × CP.
        bucket_size = perf.bucket_size(num_state_shards=dp_size * cp_size, cp_size=cp_size)
        if bucket_size <= 0:
            raise InvalidRequestError(
                f"model {perf.model.name} leaves no activation memory on {perf.profile.device} with "
                f"dp_size {dp_size} × cp_size {cp_size}; give bucket_size explicitly or use more ranks",
                field="bucket_size",
            )
    bucket_size = _validate_int(bucket_size, "bucket_size", 1, limits.max_sequence_length)
    spanning = spanning and dp_size > 1 and _prices_the_world(perf, dp_size * cp_size)
    for index, length in enumerate(lengths):
        if length > bucket_size * cp_size * (dp_size if spanning else 1):
            raise SequenceTooLongError(index=index, num_tokens=length, bucket_size=bucket_size, cp_size=cp_size,
                                       dp_size=dp_size if spanning else None)
    token_buckets = _validate_int(token_buckets, "token_buckets", 0, MAX_TOKEN_BUCKETS)
    return PlanningProblem(sequence_lengths=lengths, dp_size=dp_size, cp_size=cp_size, bucket_size=bucket_size,
                           perf=perf, spanning=spanning, schemes=schemes, token_buckets=token_buckets)
