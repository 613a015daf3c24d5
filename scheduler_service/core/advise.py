"""The layout advisor (issue 27): from a length sample, a model, a profile and a GPU count to the DP × CP layout,
sharding mode and activation checkpointing that train the sample fastest under the performance model.

1. Enumerate the layouts ``dp × cp = GPUs`` for every allowed CP degree, sharding mode and activation
   checkpointing mode, each with the BucketSize the trainer derives (``memory.training_profile``, then
   ``PerformanceModel.bucket_size`` over ``dp × cp`` state shards, as ``plan.make_problem`` does). A layout that
   leaves no bucket, or has CP blocks across nodes the profile has no inter-node table for, is excluded with its
   reason. A layout's longest trainable sequence is the world's capacity, ``bucket_size × cp_size × dp_size``,
   where its plans may span DP replicas (``make_problem``'s own rule: more than one replica, and a profile that
   prices a block of the whole world), else one CP group's, ``bucket_size × cp_size``.
2. Hold the sample as each layout trains it: a sequence longer than the layout's limit (its longest trainable
   sequence, or ``max_length`` when smaller) is left out or, with ``truncate``, cut to the limit, as the trainer's
   ``--max-length`` and ``--truncate`` treat records. The layouts that leave out (or cut) the fewest sequences are
   priced, and the others excluded, each with how many sequences and what share of the tokens it would lose and
   the CP degree that holds more. So an outlier that no layout holds does not stop the advice, and no layout wins
   by dropping what another trains: the priced layouts hold the same sequences.
3. Draw ``num_batches`` global batches from the sample as a layout holds it, seeded, with replacement: the priced
   layouts hold the same sequences, so they are priced on the same batches (with ``truncate``, the same draws cut
   at each one's limit). A batch is ``GlobalBatchSize.num_sequences`` sequences, or sequences drawn in order while
   their tokens stay within ``GlobalBatchSize.num_tokens`` (at least one).
4. Price every kept layout by planning each batch with ``make_plan`` under ``skrull``, which runs a sequence longer
   than one CP group in a micro-batch spanning DP replicas and spans others where the model finds it faster; its
   answer carries the static-CP (``deepspeed``) time of the same batch on the same layout. The performance model
   knows the topology (``gpus_per_node``): a CP block larger than a node pays the profile's inter-node collectives.
5. Rank by tokens per second per GPU over all batches (total tokens over total step time: the rate a run
   sees), best first.

Step times are reported as the median over the batches, with their spread (min, p10, p90, max: how far one
step's time strays from it); the winner's lead is also counted batch by batch (the batches are the same for every
priced layout). Skrull is not built to beat static CP on every batch (its search does not start from the static
plan), but under the model it has been on every sample the tests draw.

Work: one ``make_plan`` per kept layout and batch; ``advise_cost`` bounds it from the problem's shape, before any
of it is done. Measured on the 2-core development machine with the kernels loaded (``planner.warm_up``, 0.3 s
from the JIT cache): qwen2.5-7b on 32 H100s, a ``chatqa2`` sample of 10,000, 8 batches of 64 sequences, 18
layouts of which 12 are priced (spanning DP replicas holds the sample's 95k-token sequences on every zero2 and
zero3 layout): 0.7 s (1.1 s with 128 sequences per batch), about half of it the spanning candidates Skrull costs
on unbalanced batches.

This module searches only: what the advice says in words, as a document and as the trainer's command lines is
written once at the edge (``scheduler_service.contract.advice``), for the service and the CLI alike.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import TypeVar

import numpy as np
import numpy.typing as npt

from scheduler_service.core.errors import InvalidRequestError
from scheduler_service.core.memory import ActivationCheckpointing, Sharding, training_profile
from scheduler_service.core.models import ModelShape
from scheduler_service.core.perf_model import PerformanceModel
from scheduler_service.core.plan import DEFAULT_LIMITS, PlanLimits, SchedulerName, make_problem
from scheduler_service.core.planner import PlanResult, make_plan
from scheduler_service.core.profile import Profile
from scheduler_service.core.spanning import MAX_CHOSEN

__all__ = [
    "Advice",
    "AdviseCost",
    "AdviseLimits",
    "ExcludedLayout",
    "Exclusion",
    "GlobalBatchSize",
    "Layout",
    "LayoutProblem",
    "PricedLayout",
    "StepTimeSpread",
    "advise",
    "advise_cost",
    "draw_batches",
]

IntArray = npt.NDArray[np.int64]
Mode = TypeVar("Mode", bound=StrEnum)
GIB = float(1 << 30)


@dataclass(frozen=True, kw_only=True, slots=True)
class GlobalBatchSize:
    """How much one optimizer step trains: ``num_sequences`` sequences, or sequences up to ``num_tokens`` tokens
    (the size of a global batch; ``trainer_client.data.GlobalBatch`` is the batch itself)."""

    num_sequences: int | None = None
    num_tokens: int | None = None

    def __post_init__(self) -> None:
        if (self.num_sequences is None) == (self.num_tokens is None):
            raise InvalidRequestError("global_batch needs exactly one of a number of sequences or of tokens",
                                      field="global_batch")
        value = self.num_sequences if self.num_sequences is not None else self.num_tokens
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidRequestError(f"global_batch must be a positive integer, got {value!r}", field="global_batch")


@dataclass(frozen=True, kw_only=True, slots=True)
class AdviseLimits:
    """Bounds on one problem: the planner's own (``plan``), the sample and the batches drawn from it."""

    plan: PlanLimits = DEFAULT_LIMITS
    max_sample_sequences: int = 1 << 22
    max_batches: int = 256


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class LayoutProblem:
    """Which layout of ``num_gpus`` GPUs trains this sample fastest: a sample of sequence lengths, what trains it,
    and the layouts allowed (the advisor's twin of the planner's ``PlanningProblem``). Empty
    ``activation_checkpointing``: the mode the profile measured its activations with (none when it does not say);
    empty ``cp_sizes``: every power of two that divides ``num_gpus``. The model's KV heads do not bound the CP
    degree: DACP gathers whole K/V heads and splits tokens only. ``max_length`` and ``truncate`` are the trainer's
    ``--max-length`` and ``--truncate``: the longest sequence trained whole (None: each layout's longest trainable
    sequence), and whether a longer one is cut to it rather than left out."""

    sequence_lengths: Sequence[int] | IntArray
    model: ModelShape
    profile: Profile
    num_gpus: int
    global_batch: GlobalBatchSize
    gpus_per_node: int = 8
    shardings: tuple[Sharding, ...] = tuple(Sharding)  # names are taken too: the members are made from them
    activation_checkpointing: tuple[ActivationCheckpointing, ...] = ()
    cp_sizes: tuple[int, ...] = ()
    num_batches: int = 8
    seed: int = 0
    compute_bytes: int = 2  # bytes of the dtype weights compute in: 2 bf16 (the trainer on CUDA), 4 float32
    max_length: int | None = None
    truncate: bool = False
    limits: AdviseLimits = field(default_factory=AdviseLimits)
    lengths: IntArray = field(init=False, repr=False)
    checkpointing_modes: tuple[ActivationCheckpointing, ...] = field(init=False)
    cp_options: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        set_field = object.__setattr__
        set_field(self, "lengths", _validated_lengths(self.sequence_lengths, self.limits))
        plan_limits = self.limits.plan
        _check_int(self.num_gpus, "gpus", 1, plan_limits.max_dp_size)
        _check_int(self.gpus_per_node, "gpus_per_node", 1, plan_limits.max_dp_size)
        if self.gpus_per_node & (self.gpus_per_node - 1):
            raise InvalidRequestError(f"gpus_per_node must be a power of two, got {self.gpus_per_node}",
                                      field="gpus_per_node")
        if self.num_gpus > self.gpus_per_node and self.num_gpus % self.gpus_per_node:
            raise InvalidRequestError(f"gpus {self.num_gpus} is not a whole number of nodes of gpus_per_node "
                                      f"{self.gpus_per_node}", field="gpus")
        if self.global_batch.num_sequences is not None and self.global_batch.num_sequences > plan_limits.max_sequences:
            raise InvalidRequestError(f"global_batch of {self.global_batch.num_sequences} sequences; at most "
                                      f"{plan_limits.max_sequences} are planned per step", field="global_batch")
        _check_int(self.num_batches, "num_batches", 1, self.limits.max_batches)
        if self.compute_bytes not in (2, 4):
            raise InvalidRequestError(f"compute_bytes must be 2 (bfloat16) or 4 (float32), got {self.compute_bytes}",
                                      field="compute_bytes")
        set_field(self, "shardings", _modes(self.shardings, Sharding, "shardings"))
        measured_with = self.profile.raw.get("memory", {}).get("activation_checkpointing")
        set_field(self, "checkpointing_modes", _modes(self.activation_checkpointing or (measured_with or "none",),
                                                      ActivationCheckpointing, "activation_checkpointing"))
        set_field(self, "cp_options", self._cp_options())
        self._check_length_limit()

    def _check_length_limit(self) -> None:
        """``max_length`` within the planner's limit, and leaving something to train."""
        if not isinstance(self.truncate, bool):
            raise InvalidRequestError(f"truncate must be true or false, got {self.truncate!r}", field="truncate")
        if self.max_length is None:
            return
        _check_int(self.max_length, "max_length", 1, self.limits.plan.max_sequence_length)
        shortest = int(self.lengths.min())
        if not self.truncate and shortest > self.max_length:
            raise InvalidRequestError(f"every sequence of the sample is longer than max_length {self.max_length} "
                                      f"(the shortest has {shortest} tokens), so all would be left out: raise "
                                      "max_length, or truncate to cut them to it", field="max_length")

    def _cp_options(self) -> tuple[int, ...]:
        max_cp = min(self.num_gpus, self.limits.plan.max_cp_size)
        if not self.cp_sizes:
            return tuple(1 << k for k in range(max_cp.bit_length()) if self.num_gpus % (1 << k) == 0)
        for cp_size in self.cp_sizes:
            if (isinstance(cp_size, bool) or not isinstance(cp_size, int) or cp_size < 1 or cp_size & (cp_size - 1)
                    or self.num_gpus % cp_size or cp_size > max_cp):
                raise InvalidRequestError(
                    f"cp_sizes must be powers of two that divide gpus {self.num_gpus} (at most {max_cp}), got "
                    f"{cp_size!r}", field="cp_sizes")
        return tuple(sorted(set(self.cp_sizes)))

    @property
    def num_layouts(self) -> int:
        """Layouts enumerated, before any is excluded."""
        return len(self.cp_options) * len(self.shardings) * len(self.checkpointing_modes)

    def sequence_limit(self, layout: Layout) -> int:
        """The longest sequence ``layout`` trains whole: its longest trainable sequence, or ``max_length`` when
        smaller (a larger one cannot make the layout hold more)."""
        capacity = layout.longest_trainable_sequence
        return capacity if self.max_length is None else min(self.max_length, capacity)

    def held(self, limit: int | None = None) -> IntArray:
        """The sample as a layout that trains sequences of up to ``limit`` tokens whole holds it (None:
        ``max_length``, or no limit): longer ones cut to the limit with ``truncate``, left out without."""
        limit = self.max_length if limit is None else limit
        if limit is None:
            return self.lengths
        if self.truncate:
            return np.minimum(self.lengths, limit)
        return self.lengths[self.lengths <= limit]

    def too_long(self, limit: int) -> tuple[int, float]:
        """How many of the sample's sequences are longer than ``limit``, and the share of its tokens that a layout
        with this limit does not train: theirs whole when they are left out, the part past the limit when cut."""
        over = self.lengths[self.lengths > limit]
        lost = int(over.sum()) - (limit * over.size if self.truncate else 0)
        return int(over.size), lost / int(self.lengths.sum())


def _modes(values: Sequence[str], modes: type[Mode], name: str) -> tuple[Mode, ...]:
    """``values`` as members of ``modes`` (the wire and the CLI give names), each once, at least one."""
    known = [mode.value for mode in modes]
    if not values or len(set(values)) < len(values) or any(value not in known for value in values):
        raise InvalidRequestError(f"{name} must name each of {', '.join(known)} at most once, at least one, got "
                                  f"{list(values)}", field=name)
    return tuple(modes(value) for value in values)


def _check_int(value: object, name: str, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise InvalidRequestError(f"{name} must be an integer between {low} and {high}, got {value!r}", field=name)


def _validated_lengths(sequence_lengths: Sequence[int] | IntArray, limits: AdviseLimits) -> IntArray:
    """The sample as int64, checked at C speed: a sample may hold millions of lengths."""
    if len(sequence_lengths) == 0:
        raise InvalidRequestError("sequence_lengths is empty: the advice needs a sample of at least one length",
                                  field="sequence_lengths")
    if len(sequence_lengths) > limits.max_sample_sequences:
        raise InvalidRequestError(f"sequence_lengths holds {len(sequence_lengths)} lengths; at most "
                                  f"{limits.max_sample_sequences} are accepted (sample them)",
                                  field="sequence_lengths")
    lengths = np.asarray(sequence_lengths)
    if lengths.ndim != 1 or lengths.dtype.kind not in "iu":
        raise InvalidRequestError("sequence_lengths must be a list of integers", field="sequence_lengths")
    high = limits.plan.max_sequence_length
    bad = np.flatnonzero((lengths < 1) | (lengths > high))
    if bad.size:
        index = int(bad[0])
        raise InvalidRequestError(f"sequence {index} has {int(lengths[index])} tokens; lengths must be between 1 "
                                  f"and {high}", field=f"sequence_lengths[{index}]")
    return np.ascontiguousarray(lengths, dtype=np.int64)


# ---- batches and cost ------------------------------------------------------------------------------------------


def draw_batches(problem: LayoutProblem, limit: int | None = None) -> list[IntArray]:
    """The problem's global batches, drawn with replacement from its sample as a layout that trains sequences of up
    to ``limit`` tokens whole holds it (``LayoutProblem.held``), seeded: the same for every layout that holds the
    same sequences."""
    rng = np.random.default_rng(problem.seed)
    lengths, batch = problem.held(limit), problem.global_batch
    if batch.num_sequences is not None:
        return [rng.choice(lengths, size=batch.num_sequences) for _ in range(problem.num_batches)]
    budget = batch.num_tokens or 0
    max_sequences = problem.limits.plan.max_sequences
    draw_size = min(max_sequences + 1, math.ceil(budget / lengths.min()) + 1)
    batches = []
    for _ in range(problem.num_batches):
        drawn = rng.choice(lengths, size=draw_size)
        count = max(int(np.searchsorted(np.cumsum(drawn), budget, side="right")), 1)
        if count > max_sequences:
            raise InvalidRequestError(f"global_batch of {budget} tokens holds more than {max_sequences} sequences "
                                      f"of this sample; at most {max_sequences} are planned per step",
                                      field="global_batch")
        batches.append(drawn[:count])
    return batches


@dataclass(frozen=True, kw_only=True, slots=True)
class AdviseCost:
    """A problem's work, from its shape alone: ``cells`` in ``runtime.cost``'s unit (one cell: 4-15 µs of
    planning on the development machine)."""

    num_layouts: int  # enumerated, before exclusions
    num_plans: int  # at most: layouts × batches
    sequences_per_batch: int  # a token budget's: from the sample's mean length
    cells: int


def advise_cost(problem: LayoutProblem) -> AdviseCost:
    """An upper estimate of ``advise(problem)``'s work: every layout priced on every batch, each plan costing its
    static-CP baseline (a micro-batch of ``cp_size`` local lists per sequence) plus at most as many cells again,
    and, where several DP replicas may share a micro-batch, ``MAX_CHOSEN`` spanning micro-batches over the whole
    world (``runtime.cost.plan_cost``'s allowance for those Skrull chooses; those a sequence needs are as rare as
    the sample's outliers). A token budget's sequences per batch are estimated from the mean of the sample as
    ``max_length`` holds it."""
    batch = problem.global_batch
    sequences = (batch.num_sequences if batch.num_sequences is not None
                 else math.ceil((batch.num_tokens or 0) / float(problem.held().mean())) + 1)
    per_cp = len(problem.shardings) * len(problem.checkpointing_modes) * problem.num_batches
    cells = sum(per_cp * (sequences * (2 * cp_size + 1) + (MAX_CHOSEN * problem.num_gpus if cp_size < problem.num_gpus
                                                           else 0))
                for cp_size in problem.cp_options)
    return AdviseCost(num_layouts=problem.num_layouts, num_plans=problem.num_layouts * problem.num_batches,
                      sequences_per_batch=sequences, cells=cells)


# ---- layouts -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class Layout:
    """One way to train on the GPUs: DP × CP ranks, a sharding mode and checkpointing, and its BucketSize."""

    dp_size: int
    cp_size: int
    sharding: Sharding
    activation_checkpointing: ActivationCheckpointing
    bucket_size: int
    spans_nodes: bool  # a CP block can cross nodes: cp_size > gpus_per_node
    spanning: bool  # its plans may hold micro-batches over several DP replicas (``make_problem``'s rule)

    @property
    def cp_group_capacity(self) -> int:
        """Tokens one CP group holds: the longest sequence a micro-batch within one DP replica trains."""
        return self.bucket_size * self.cp_size

    @property
    def longest_trainable_sequence(self) -> int:
        """The world's capacity where plans may span DP replicas (one micro-batch over all of them), else one CP
        group's."""
        return self.cp_group_capacity * (self.dp_size if self.spanning else 1)

    @property
    def label(self) -> str:
        return (f"dp {self.dp_size} × cp {self.cp_size} ({self.sharding}, activation checkpointing "
                f"{self.activation_checkpointing})")


class Exclusion(StrEnum):
    """Why a layout is not priced."""

    NO_MEMORY = "no_memory"  # the static memory leaves no bucket
    TOO_LONG = "too_long"  # it leaves out more of the sample's sequences than other layouts: they exceed its limit
    NO_INTER_NODE_TABLE = "no_inter_node_table"  # CP blocks cross nodes; the profile cannot price them


@dataclass(frozen=True, kw_only=True, slots=True)
class ExcludedLayout:
    layout: Layout
    exclusion: Exclusion
    reason: str
    num_sequences_too_long: int = 0  # of the sample: longer than the layout trains whole, left out or cut
    too_long_token_share: float = 0.0  # of the sample's tokens: those it would not train
    # the smallest allowed CP degree (same modes) of a priced layout, which holds more; None: none of these modes
    cp_size_needed: int | None = None


@dataclass(frozen=True, slots=True)
class _Candidate:
    """A layout whose memory holds a bucket, with the profile and performance model it is planned with."""

    layout: Layout
    profile: Profile
    perf: PerformanceModel


def _candidates(problem: LayoutProblem) -> tuple[list[_Candidate], list[ExcludedLayout]]:
    """Every layout with its BucketSize and whether its plans may span DP replicas; those that leave no bucket, or
    cross nodes the profile cannot price, apart."""
    candidates, excluded = [], []
    for cp_size in problem.cp_options:
        dp_size = problem.num_gpus // cp_size
        for sharding in problem.shardings:
            for checkpointing in problem.checkpointing_modes:
                profile = training_profile(problem.profile, problem.model, sharding=sharding,
                                           compute_bytes=problem.compute_bytes,
                                           activation_checkpointing=checkpointing)
                perf = PerformanceModel(model=problem.model, profile=profile, gpus_per_node=problem.gpus_per_node)
                bucket_size = min(perf.bucket_size(num_state_shards=dp_size * cp_size, cp_size=cp_size),
                                  problem.limits.plan.max_sequence_length)
                layout = Layout(dp_size=dp_size, cp_size=cp_size, sharding=sharding,
                                activation_checkpointing=checkpointing, bucket_size=bucket_size,
                                spans_nodes=perf.crosses_nodes(cp_size), spanning=False)  # asked below, if kept
                if bucket_size == 0:
                    excluded.append(ExcludedLayout(layout=layout, exclusion=Exclusion.NO_MEMORY,
                                                   reason=_no_memory_reason(problem, layout, perf)))
                    continue
                try:
                    perf.collective_cost(cp_size)  # the widest block: refused when the profile cannot price it
                except InvalidRequestError as error:
                    excluded.append(ExcludedLayout(layout=layout, exclusion=Exclusion.NO_INTER_NODE_TABLE,
                                                   reason=error.message))
                    continue
                layout = replace(layout, spanning=_plans_span(problem, layout, profile))
                candidates.append(_Candidate(layout, profile, perf))
    return candidates, excluded


def _plans_span(problem: LayoutProblem, layout: Layout, profile: Profile) -> bool:
    """Whether the planner lets ``layout``'s plans span DP replicas: ``make_problem``'s own rule, asked of a
    one-token batch, so that the advice never promises a length that the planner then refuses."""
    return make_problem(sequence_lengths=[1], dp_size=layout.dp_size, cp_size=layout.cp_size, model=problem.model,
                        bucket_size=layout.bucket_size, profile=profile, limits=problem.limits.plan,
                        gpus_per_node=problem.gpus_per_node).spanning


def _no_memory_reason(problem: LayoutProblem, layout: Layout, perf: PerformanceModel) -> str:
    num_ranks = layout.dp_size * layout.cp_size
    static_gib = perf.static_bytes(num_ranks) / GIB
    free_gib = (problem.profile.device_memory_bytes - perf.bucket_bytes(0, num_ranks, layout.cp_size)) / GIB
    return (f"model {problem.model.name} does not fit with sharding {layout.sharding}: its weights, gradients and "
            f"optimizer states take {static_gib:.1f} GiB per rank over dp_size {layout.dp_size} × cp_size "
            f"{layout.cp_size} = {num_ranks} ranks, leaving {max(free_gib, 0.0):.2f} GiB of the "
            f"{problem.profile.device_memory_bytes / GIB:.1f} GiB of {problem.profile.device} for activations, "
            f"not enough for one token")


def _hold_the_most(problem: LayoutProblem, candidates: list[_Candidate]) -> tuple[list[_Candidate],
                                                                                   list[ExcludedLayout]]:
    """The candidates that leave out (or cut) the fewest of the sample's sequences, and the others apart, each with
    what it would lose and the smallest CP degree (same sharding and checkpointing) of a kept layout. When some
    layout holds the whole sample, those that do not are excluded; when none does, the outliers do not stop the
    advice: the layouts that lose the fewest are kept, and hold the same sequences."""
    counted = [(candidate, *problem.too_long(problem.sequence_limit(candidate.layout))) for candidate in candidates]
    fewest = min(num_too_long for _, num_too_long, _ in counted)
    if fewest == problem.lengths.size and not problem.truncate:
        raise _nothing_held_error(problem, candidates)
    kept = [candidate for candidate, num_too_long, _ in counted if num_too_long == fewest]
    excluded = []
    for candidate, num_too_long, token_share in counted:
        if num_too_long == fewest:
            continue
        layout = candidate.layout
        needed = min((other.layout.cp_size for other in kept
                      if (other.layout.sharding, other.layout.activation_checkpointing)
                      == (layout.sharding, layout.activation_checkpointing)), default=None)
        more = "them" if fewest == 0 else f"all but the {fewest} that no layout holds"
        remedy = (f"cp_size {needed} would hold {more}" if needed is not None else
                  f"no allowed cp_size holds {more} with sharding {layout.sharding}")
        fate = "cut to fit" if problem.truncate else "left out"
        excluded.append(ExcludedLayout(
            layout=layout, exclusion=Exclusion.TOO_LONG, num_sequences_too_long=num_too_long,
            too_long_token_share=token_share, cp_size_needed=needed,
            reason=f"{num_too_long} sequence(s) of the sample (the longest {int(problem.lengths.max())} tokens) "
                   f"exceed {_capacity_words(layout)}: {fate}, {token_share:.2%} of its tokens would not train; "
                   f"{remedy}"))
    return kept, excluded


def _capacity_words(layout: Layout) -> str:
    """The layout's longest trainable sequence, as the product it is."""
    if layout.spanning:
        return (f"bucket_size {layout.bucket_size} × cp_size {layout.cp_size} × dp_size {layout.dp_size} = "
                f"{layout.longest_trainable_sequence} tokens (a micro-batch spanning every DP replica)")
    return f"bucket_size {layout.bucket_size} × cp_size {layout.cp_size} = {layout.longest_trainable_sequence} tokens"


def _nothing_held_error(problem: LayoutProblem, candidates: list[_Candidate]) -> InvalidRequestError:
    """Every sequence of the sample is longer than any layout trains: without ``truncate`` nothing is left."""
    widest = max((candidate.layout for candidate in candidates), key=lambda layout: layout.longest_trainable_sequence)
    return InvalidRequestError(
        f"no layout of {problem.num_gpus} GPUs holds any sequence of the sample: the shortest has "
        f"{int(problem.lengths.min())} tokens, and at most {widest.longest_trainable_sequence} fit ({widest.label}: "
        f"{_capacity_words(widest)}); truncate would cut them to fit", field="sequence_lengths")


def _no_layout_error(problem: LayoutProblem, excluded: list[ExcludedLayout]) -> InvalidRequestError:
    """Why no layout can be priced, naming the field to change and the limit it met."""
    if all(item.exclusion is Exclusion.NO_MEMORY for item in excluded):
        return InvalidRequestError(f"model {problem.model.name} fits in no layout of {problem.num_gpus} GPUs: "
                                   f"{excluded[-1].reason}", field="model")
    first = next(item for item in excluded if item.exclusion is Exclusion.NO_INTER_NODE_TABLE)
    return InvalidRequestError(f"no layout of {problem.num_gpus} GPUs can be priced: {first.reason}", field="profile")


# ---- pricing -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class StepTimeSpread:
    """How much the step time varies over the sampled batches: how far one step's time strays from the median."""

    min_s: float
    p10_s: float
    p90_s: float
    max_s: float
    relative_spread: float  # (p90 − p10) / median


@dataclass(frozen=True, kw_only=True, slots=True)
class PricedLayout:
    """A layout's predicted training speed over the sampled batches."""

    layout: Layout
    step_times_s: tuple[float, ...]  # Skrull's, per batch (the batches are every priced layout's)
    static_cp_step_times_s: tuple[float, ...]  # static CP (deepspeed) on the same layout, per batch
    num_sequences: int  # over all batches
    num_tokens: int  # over all batches
    num_gpus: int
    num_sequences_too_long: int  # of the sample: longer than the layout trains whole, left out or cut
    too_long_token_share: float  # of the sample's tokens: those it does not train
    memory_headroom_bytes: float  # at the fullest CP rank of any micro-batch, as the BucketSize counts memory
    memory_headroom_fraction: float  # of the device's memory
    # of the batches' sequences, sharded over more than one rank (of one CP group, or of a block of DP replicas)
    sharded_share: float
    sharded_by_degree: tuple[tuple[int, float], ...]  # (degree, share of the sequences), ascending
    micro_batches_per_step: float  # mean over batches, all DP ranks together
    num_batches_spanning: int  # batches whose plan holds micro-batches spanning DP replicas
    num_sequences_spanned: int  # over all batches: in micro-batches spanning DP replicas
    num_sequences_needing_span: int  # over all batches: longer than one CP group holds, so spanned of need

    @property
    def predicted_step_time_s(self) -> float:
        return float(np.median(self.step_times_s))

    @property
    def static_cp_step_time_s(self) -> float:
        return float(np.median(self.static_cp_step_times_s))

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.num_tokens / sum(self.step_times_s) / self.num_gpus

    @property
    def speedup_vs_static_cp(self) -> float:
        return sum(self.static_cp_step_times_s) / sum(self.step_times_s)

    @property
    def step_time_spread(self) -> StepTimeSpread:
        """How far the batches' step times stray from the median this layout is ranked by."""
        times = np.asarray(self.step_times_s)
        p10, median, p90 = np.percentile(times, [10, 50, 90])
        return StepTimeSpread(min_s=float(times.min()), p10_s=float(p10), p90_s=float(p90), max_s=float(times.max()),
                              relative_spread=float((p90 - p10) / median))


def _price(problem: LayoutProblem, candidate: _Candidate, batches: list[IntArray]) -> PricedLayout:
    """Plan every batch on the layout (Skrull, with the static-CP time of the same batch) and sum up. A sequence of a
    spanning micro-batch counts at its degree over the block's ranks, which may exceed ``cp_size``."""
    layout = candidate.layout
    results: list[PlanResult] = []
    degree_counts: Counter[int] = Counter()
    num_spanned = num_needing_span = 0
    for batch in batches:
        planning = make_problem(sequence_lengths=batch.tolist(), dp_size=layout.dp_size, cp_size=layout.cp_size,
                                model=problem.model, bucket_size=layout.bucket_size, profile=candidate.profile,
                                limits=problem.limits.plan, gpus_per_node=problem.gpus_per_node)
        result = make_plan(planning, SchedulerName.SKRULL)
        degree_counts.update(degree for dp_plan in result.plan.dp_ranks for micro_batch in dp_plan.micro_batches
                             for _, degree, _ in micro_batch.places())
        spanned = [degree for spanning in result.plan.spanning for _, degree, _ in spanning.micro_batch.places()]
        degree_counts.update(spanned)
        num_spanned += len(spanned)
        num_needing_span += len(planning.too_long_for_a_replica())
        results.append(result)
    num_sequences = sum(len(batch) for batch in batches)
    peak_tokens = max(result.estimate.peak_rank_tokens for result in results)
    headroom = (problem.profile.device_memory_bytes
                - candidate.perf.bucket_bytes(peak_tokens, layout.dp_size * layout.cp_size, layout.cp_size))
    num_too_long, too_long_token_share = problem.too_long(problem.sequence_limit(layout))
    return PricedLayout(
        layout=layout,
        step_times_s=tuple(result.estimate.iteration_time_s for result in results),
        static_cp_step_times_s=tuple(result.baseline_time_s for result in results),
        num_sequences=num_sequences, num_tokens=int(sum(int(batch.sum()) for batch in batches)),
        num_gpus=problem.num_gpus, num_sequences_too_long=num_too_long, too_long_token_share=too_long_token_share,
        memory_headroom_bytes=headroom, memory_headroom_fraction=headroom / problem.profile.device_memory_bytes,
        sharded_share=sum(count for degree, count in degree_counts.items() if degree > 1) / num_sequences,
        sharded_by_degree=tuple((degree, count / num_sequences) for degree, count in sorted(degree_counts.items())
                                if degree > 1),
        micro_batches_per_step=float(np.mean([result.plan.num_micro_batches for result in results])),
        num_batches_spanning=sum(bool(result.plan.spanning) for result in results),
        num_sequences_spanned=num_spanned, num_sequences_needing_span=num_needing_span,
    )


# ---- the advice ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class Advice:
    """The layouts of a problem, priced and ranked, and those left out with their reasons."""

    problem: LayoutProblem
    layouts: tuple[PricedLayout, ...]  # best first
    excluded: tuple[ExcludedLayout, ...]

    @property
    def mean_sequences_per_batch(self) -> float:
        """Of the winner's batches (with ``truncate`` and a token budget, each layout's may differ)."""
        return self.layouts[0].num_sequences / self.problem.num_batches

    @property
    def mean_tokens_per_batch(self) -> float:
        return self.layouts[0].num_tokens / self.problem.num_batches

    @property
    def winner_batches_won(self) -> int:
        """Batches on which the winner's step is faster than the runner-up's (all of them with one layout)."""
        if len(self.layouts) < 2:
            return self.problem.num_batches
        best, runner_up = self.layouts[0], self.layouts[1]
        return sum(a < b for a, b in zip(best.step_times_s, runner_up.step_times_s, strict=True))


def advise(problem: LayoutProblem, *, progress: Callable[[int, int], None] | None = None) -> Advice:
    """Rank every layout of ``problem`` that holds the most of its sample by predicted throughput (module
    docstring). ``progress(done, total)`` is called after each layout is priced. Raises ``InvalidRequestError``
    when no layout can be priced, or none holds any sequence of the sample."""
    candidates, excluded = _candidates(problem)
    if not candidates:
        raise _no_layout_error(problem, excluded)
    candidates, too_long = _hold_the_most(problem, candidates)
    excluded += too_long
    priced = []
    for done, candidate in enumerate(candidates, start=1):
        batches = draw_batches(problem, problem.sequence_limit(candidate.layout))
        priced.append(_price(problem, candidate, batches))
        if progress is not None:
            progress(done, len(candidates))
    sharding_order = list(Sharding)
    checkpointing_order = list(ActivationCheckpointing)
    priced.sort(key=lambda item: (-item.tokens_per_s_per_gpu, item.layout.cp_size,
                                  sharding_order.index(item.layout.sharding),
                                  checkpointing_order.index(item.layout.activation_checkpointing)))
    return Advice(problem=problem, layouts=tuple(priced), excluded=tuple(excluded))
