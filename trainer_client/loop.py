"""Skrull in a training loop of your own: per global batch, this rank's packed micro-batches and the loss normaliser.

A loop that is not ``Trainer`` (torchtitan-style, nanotron-style, its own) needs three things per global batch,
which ``SkrullBatches.plan`` returns as a ``RankBatch``:

1. the plan: rank 0 asks ``PlanSource`` (the scheduler service, else the embedded planner, which plans the
   same) and broadcasts the decision; every rank checks it against its own copy of the batch (``decide_plan``);
2. this rank's micro-batches of it, in plan order (the spanning micro-batches its DP rank is part of first), packed
   for DACP (``pack_micro_batch``: input ids,
   next-token targets, positions and the attention metadata); under FSDP with the zero-loss padding
   micro-batches that keep every rank's collectives matched (``micro_batch_packers``);
3. the loss normaliser, the loss-token count of the *whole* global batch. Each micro-batch's summed token
   loss divided by it, and gradients summed over all DP × CP ranks, give the loss and gradients of unsharded
   training (docs/design.md, "Training equivalence"); a per-micro-batch or per-rank mean would not.

The model sees each micro-batch through one attention function: ``register_dacp_attention`` (``build_model``
calls it) makes ``attn_implementation="dacp"`` available to transformers, and ``model_inputs(pack)`` hands
the metadata to it. ``examples/custom_loop.py`` is a whole loop; docs/guides/custom-loop.md walks through it.

``Trainer`` is such a loop too, on the same entry point: ``plan`` (with ``prefetch=``, the next batch, whose plan
is asked for while a step trains), then ``report`` of what the step measured (feedback). The micro-batches come
packed one ahead of the loop by a background thread (``dacp/prefetch.py``); a plan made elsewhere is packed by
``share`` (``decide`` is ``plan``'s first half).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType

import torch
import torch.distributed as dist

from scheduler_service.core.check import check_plan
from scheduler_service.core.choices import CollectiveScheme
from scheduler_service.core.costing import place_degrees, token_bucket_sizes
from scheduler_service.core.models import ModelShape, resolve_model
from scheduler_service.core.plan import MicroBatch, Plan, SchedulerName, SpanningMicroBatch
from scheduler_service.core.profile import Profile
from scheduler_service.core.static_sp import static_layout_problem
from trainer_client.config_choices import DEFAULT_PLAN_ATTEMPTS, DEFAULT_PLAN_TIMEOUT_S
from trainer_client.dacp.packing import PackedMicroBatch, pack_micro_batch, padding_micro_batch
from trainer_client.dacp.prefetch import PrefetchedMicroBatches
from trainer_client.data import GlobalBatch, Sample
from trainer_client.distributed import ParallelContext
from trainer_client.models.parallelize import Sharding, num_padding_micro_batches
from trainer_client.planning.client import PlanClient
from trainer_client.planning.source import MicroBatchTiming, PlanDecision, PlanOrigin, PlanSource

__all__ = ["PlanningFailed", "RankBatch", "SkrullBatches", "decide_plan", "micro_batch_packers", "run_order"]


@dataclass(frozen=True, kw_only=True, slots=True)
class RankBatch:
    """One rank's share of a global batch: what it runs, in order, and what every micro-batch's loss is divided by.
    Use it in ``with`` (or iterate its micro-batches to the end): leaving the block stops the thread that packs them.
    """

    decision: PlanDecision  # the plan every rank received, where it came from and its estimated time
    # Run in order, once, accumulating gradients: each packed (and on CUDA copied to the device) by a background
    # thread one ahead of the one the loop runs. Replicated training only may have idle ones (``is_idle``: this rank
    # holds no token of it, and no peer waits for it), which the loop skips; under FSDP padding stands in.
    micro_batches: PrefetchedMicroBatches
    num_loss_tokens: int  # of the whole global batch, the same on every rank: the loss normaliser

    def __enter__(self) -> RankBatch:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.micro_batches.close()


class SkrullBatches:
    """Plans each global batch on rank 0 and gives every rank its packed share (every rank holds the same batch).

    ``model``: a catalogue name, or the shape of a checkpoint (``model_shape``), which the planner costs
    sequences with. ``bucket_size``: the tokens one CP rank may hold in a micro-batch, what its memory allows.
    ``scheduler_url``: the scheduler service; absent, the embedded planner plans alone. ``plan_timeout_s`` and
    ``plan_attempts``: how long one request to it may take and how often it is tried before the embedded planner
    plans the batch instead. ``job_id``: the service's job the plans and ``report`` name, which it refits its
    profile for from what the steps measured (feedback); None reports nothing. ``sharding``: how the loop shards
    its model (``NONE`` replicated, ``ZERO2``/``ZERO3`` FSDP2 keeping parameters gathered for the step or
    resharding them after every forward), which decides the padding micro-batches. ``spanning``: plans may hold
    micro-batches over several DP replicas (False: every micro-batch within one replica's CP group). ``schemes``:
    the planner gives each collective its fastest scheme (False: all-gather-KV everywhere, and a static Ulysses or
    2D scheduler is refused at start).
    ``token_buckets``: every row padded to the smallest of that many token buckets (``packing.pad_to_bucket``),
    which the planner prices (the CUDA graphs of ``--cuda-graphs`` are captured per bucket). Rank 0
    compiles the planner's kernels on construction (or loads them from the JIT cache), so that no plan waits for
    them.
    """

    def __init__(
        self,
        parallel: ParallelContext,
        *,
        model: str | ModelShape,
        bucket_size: int,
        scheduler: str = SchedulerName.SKRULL.value,
        scheduler_url: str | None = None,
        profile: str | Profile | None = None,
        sharding: Sharding = Sharding.NONE,
        pad_token_id: int = 0,
        plan_timeout_s: float = DEFAULT_PLAN_TIMEOUT_S,
        plan_attempts: int = DEFAULT_PLAN_ATTEMPTS,
        job_id: str | None = None,
        spanning: bool = True,
        schemes: bool = True,
        token_buckets: int = 0,
    ) -> None:
        self.parallel = parallel
        self.sharding = sharding
        self.pad_token_id = pad_token_id
        self.token_buckets = token_buckets
        self.plans: PlanSource | None = None  # rank 0's alone: it decides, the others receive
        # the model's heads, which every Ulysses or 2D collective of a plan must split evenly (checked per plan)
        self.heads = resolve_model(model).heads
        # Every rank refuses a static layout the heads cannot run, at start and alike: none waits in a collective.
        layout_problem = static_layout_problem(str(scheduler), self.heads, parallel.dims.cp_size, schemes=schemes)
        if layout_problem is not None:
            raise ValueError(layout_problem)
        if parallel.is_main:
            client = (PlanClient(scheduler_url, timeout_s=plan_timeout_s, max_attempts=plan_attempts)
                      if scheduler_url is not None else None)
            self.plans = PlanSource(scheduler=scheduler, dp_size=parallel.dims.dp_size, cp_size=parallel.dims.cp_size,
                                    model=model, bucket_size=bucket_size, profile=profile, client=client,
                                    job_id=job_id, spanning=spanning, schemes=schemes,
                                    token_buckets=token_buckets)
            self.plans.check_service()
            self.plans.warm_up()

    def plan(self, batch: GlobalBatch, *, prefetch: GlobalBatch | None = None) -> RankBatch:
        """This rank's share of ``batch``: its plan, its micro-batches and the loss normaliser (``RankBatch``).

        ``prefetch``: the next global batch, whose plan rank 0 asks the service for while this one trains (only
        rank 0's is read; without a service nothing is asked ahead). Collective: every rank calls it with the same
        batch. Raises ``PlanningFailed`` on every rank when rank 0 cannot plan the batch (a sequence longer than
        the world holds, ``bucket_size × cp_size × dp_size``).
        """
        decision = self.decide(batch)
        if prefetch is not None and self.plans is not None:
            self.plans.prefetch(prefetch.step, prefetch.sequence_lengths)
        return self.share(batch, decision)

    def decide(self, batch: GlobalBatch) -> PlanDecision:
        """``batch``'s plan on every rank, checked (``decide_plan``): the first half of ``plan``. Collective."""
        return decide_plan(self.plans, batch, parallel=self.parallel, heads=self.heads)

    def share(self, batch: GlobalBatch, decision: PlanDecision) -> RankBatch:
        """This rank's share of ``batch`` under ``decision``: the second half of ``plan``, also for a plan made
        elsewhere (the tests' hand-built ones). Not collective."""
        return RankBatch(decision=decision,
                         micro_batches=PrefetchedMicroBatches(self.packers(batch, decision), self.parallel.device),
                         num_loss_tokens=batch.num_loss_tokens)

    def packers(self, batch: GlobalBatch, decision: PlanDecision) -> list[Callable[[], PackedMicroBatch]]:
        """This rank's micro-batches of ``decision`` in plan order, each packed when called
        (``micro_batch_packers``)."""
        assert decision.plan is not None
        return micro_batch_packers(batch.samples, decision.plan, parallel=self.parallel, sharding=self.sharding,
                                   pad_token_id=self.pad_token_id,
                                   token_buckets=token_bucket_sizes(decision.bucket_size, self.token_buckets))

    def report(self, batch: GlobalBatch, decision: PlanDecision, timings: Sequence[MicroBatchTiming]) -> None:
        """Report what this rank measured of ``batch``'s micro-batches to the service (feedback), in the
        background. Collective: every rank's timings are gathered on rank 0, which posts them when there is a job
        id and a service. Step 0 is not reported: it pays the one-off warm-up (kernels, allocator, caches)."""
        parallel = self.parallel
        gathered: list[list[MicroBatchTiming]] | None = ([[] for _ in range(dist.get_world_size())]
                                                         if parallel.is_main else None)
        dist.gather_object(list(timings), gathered, dst=0, group=parallel.object_group)
        if self.plans is None or gathered is None or batch.step == 0:
            return
        assert decision.plan is not None
        device = parallel.device
        memory_budget = (float(torch.cuda.get_device_properties(device).total_memory)
                         if device.type == "cuda" else None)
        self.plans.report(batch.step, decision.plan, batch.sequence_lengths,
                          [timing for rank_timings in gathered for timing in rank_timings],
                          memory_budget_bytes=memory_budget)

    @property
    def num_fallbacks(self) -> int:
        """Batches rank 0 planned with the embedded core because the service failed (0 on the other ranks)."""
        return self.plans.num_fallbacks if self.plans is not None else 0

    def close(self) -> None:
        if self.plans is not None:
            self.plans.close()

    def __enter__(self) -> SkrullBatches:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()


class PlanningFailed(ValueError):
    """Rank 0 could not plan a global batch; every rank raises this with rank 0's message."""


def decide_plan(plans: PlanSource | None, batch: GlobalBatch, *, parallel: ParallelContext,
                heads: tuple[int, int] | None = None) -> PlanDecision:
    """Rank 0 decides with ``plans``; every rank receives the decision. Each plan is checked once per rank: rank 0's
    ``PlanSource`` gives only checked plans (the embedded planner checks its own; a service plan that fails the
    checker is replaced by the embedded one), every other rank checks the plan against its own copy of the batch,
    and its schemes against the model's ``heads`` (query, K/V).
    A failure to plan reaches every rank as ``PlanningFailed``, so none is left in a collective."""
    decision: list[PlanDecision | None] = [None]
    if parallel.is_main:
        assert plans is not None
        try:
            decision[0] = plans.decide(batch.step, batch.sequence_lengths)
        except Exception as error:  # any failure must still reach the other ranks, as a decision
            decision[0] = PlanDecision(step=batch.step, scheduler=plans.scheduler, origin=PlanOrigin.EMBEDDED,
                                       error=f"rank 0 failed to plan global batch {batch.step}: {error!r}")
    dist.broadcast_object_list(decision, src=0, group=parallel.object_group)
    received = decision[0]
    assert received is not None and received.step == batch.step
    if received.error is not None:
        raise PlanningFailed(received.error)
    assert received.plan is not None
    if not parallel.is_main:
        check_plan(received.plan, sequence_lengths=batch.sequence_lengths, dp_size=parallel.dims.dp_size,
                   cp_size=parallel.dims.cp_size, bucket_size=received.bucket_size, heads=heads)
    return received


def micro_batch_packers(
    samples: Sequence[Sample], plan: Plan, *, parallel: ParallelContext, sharding: Sharding, pad_token_id: int,
    token_buckets: Sequence[int] = (),
) -> list[Callable[[], PackedMicroBatch]]:
    """This rank's micro-batches of ``plan`` in plan order, each packed when called (a prefetch thread may pack
    ahead, ``dacp/prefetch.py``): the spanning micro-batches its DP rank is part of, in the plan's order, then its
    DP rank's own. Under FSDP the idle ones are padding, and padding follows them where the sharding needs as many
    micro-batches as another DP rank runs (``num_padding_micro_batches``). ``token_buckets``: the sizes every row
    is padded to (``packing.pad_to_bucket``)."""
    dp_rank, cp_size = parallel.dp_rank, parallel.dims.cp_size
    padding = padding_micro_batch(cp_size=cp_size, cp_rank=parallel.cp_rank, pad_token_id=pad_token_id,
                                  token_buckets=token_buckets)

    def pack(micro_batch: MicroBatch) -> PackedMicroBatch:
        packed = pack_micro_batch(samples, micro_batch, cp_size=cp_size, cp_rank=parallel.cp_rank,
                                  cp_group=parallel.cp_group, cp_block_groups=parallel.cp_block_groups,
                                  cp_stride_groups=parallel.cp_stride_groups, pad_token_id=pad_token_id,
                                  token_buckets=token_buckets)
        return padding if packed.is_idle and sharding is not Sharding.NONE else packed

    def pack_spanning(spanning: SpanningMicroBatch) -> PackedMicroBatch:
        """This rank's row of a spanning micro-batch: a micro-batch of the block's ranks, this rank at its position
        there, each block it shards over found among the world's groups. Its collectives run all-gather-KV or
        Ulysses: 2D would need strided groups of world ranks, which ``init_parallel`` does not make."""
        world_ranks = spanning.world_ranks(cp_size)
        for collective in spanning.micro_batch.collectives():
            if CollectiveScheme.of(collective.degree, collective.ulysses_degree) is CollectiveScheme.TWO_D:
                raise ValueError(f"a spanning micro-batch over world ranks {world_ranks[0]}-{world_ranks[-1]} has a "
                                 f"collective of {collective.degree} ranks with Ulysses degree "
                                 f"{collective.ulysses_degree} (2D); spanning micro-batches run Ulysses degree 1 "
                                 f"or the collective's size only")
        position = parallel.global_rank - world_ranks[0]
        block_groups = {(first, degree): parallel.world_block_group(world_ranks[0] + first, degree)
                        for degree in place_degrees(len(world_ranks))[1:-1]
                        for first in range(0, len(world_ranks), degree) if first <= position < first + degree}
        packed = pack_micro_batch(samples, spanning.micro_batch, cp_size=len(world_ranks), cp_rank=position,
                                  cp_group=parallel.world_block_group(world_ranks[0], len(world_ranks)),
                                  cp_block_groups=block_groups, pad_token_id=pad_token_id,
                                  token_buckets=token_buckets)
        return padding if packed.is_idle and sharding is not Sharding.NONE else packed

    packers: list[Callable[[], PackedMicroBatch]] = [
        (lambda: padding) if entry is None
        else functools.partial(pack_spanning, entry) if isinstance(entry, SpanningMicroBatch)
        else functools.partial(pack, entry)
        for entry in run_order(plan, dp_rank, lockstep=sharding is not Sharding.NONE)]
    if plan.spanning and sharding is not Sharding.NONE:
        return packers  # in lockstep: every rank runs as many
    max_planned = max(plan.micro_batches_of(rank) for rank in range(len(plan.dp_ranks)))
    num_padding = num_padding_micro_batches(sharding, num_planned=plan.micro_batches_of(dp_rank),
                                            max_planned=max_planned)
    return packers + [lambda: padding] * num_padding


def run_order(plan: Plan, dp_rank: int, *, lockstep: bool) -> list[MicroBatch | SpanningMicroBatch | None]:
    """What DP rank ``dp_rank`` runs, in order: the spanning micro-batches it is part of, in the plan's order, then
    its own (docs/design.md, "Blocks that span DP replicas"); None is a padding micro-batch.

    ``lockstep``: under FSDP every micro-batch of every rank takes part in world collectives (parameter gathers,
    gradient reduce-scatters) between its layers' attention collectives, so a spanning micro-batch must run at the
    same position on each of its replicas and every rank must run as many: a replica that reaches a spanning
    micro-batch early runs padding until its peers are there, and every list is padded to the longest. Without
    FSDP, the plan's order alone keeps every group's collectives in one order on all its ranks."""
    own: list[MicroBatch | SpanningMicroBatch | None] = list(plan.dp_ranks[dp_rank].micro_batches)
    if not lockstep or not plan.spanning:
        return [spanning for spanning in plan.spanning if dp_rank in spanning.dp_ranks] + own
    orders: list[list[MicroBatch | SpanningMicroBatch | None]] = [[] for _ in plan.dp_ranks]
    for spanning in plan.spanning:
        slot = max(len(orders[rank]) for rank in spanning.dp_ranks)
        for rank in spanning.dp_ranks:
            orders[rank] += [None] * (slot - len(orders[rank])) + [spanning]
    for rank, dp_plan in enumerate(plan.dp_ranks):
        orders[rank] += dp_plan.micro_batches
    longest = max(map(len, orders))
    return orders[dp_rank] + [None] * (longest - len(orders[dp_rank]))
