"""The training loop: one optimizer step per global batch, planned by Skrull, run with DACP.

Per global batch ``s`` (identical data on every rank, ``data.py``):

1. rank 0 decides the plan (``PlanSource``: service, else embedded core) and
   broadcasts the *decision* over a gloo group; every rank checks the plan
   with the core's checker. An error decision stops every rank cleanly.
2. DP rank ``i``, CP rank ``j`` packs each of its micro-batches
   (``plan.dp_ranks[i]``, column ``j``; sequences sharded over the whole CP
   group or over a hybrid group's block of it) and runs forward + backward on
   them in order (gradient accumulation). It skips only a micro-batch where it
   holds no token and is a member of no collective; a rank with nothing to run
   still joins every collective below.
3. Loss normalisation over the *whole* global batch (paper appendix A): the
   number of loss tokens is all-reduced, every micro-batch's summed token loss
   is divided by it, and gradients are summed over all DP × CP ranks. Every
   scheduler therefore yields the gradients of the unscheduled batch, up to
   floating-point summation order.
4. AdamW steps once.
5. With ``feedback`` (opt-in), every rank's measured micro-batch times (and
   peak memory on CUDA) are gathered on rank 0, which reports them to the
   service (``POST /feedback``) in the background; the service refits this
   job's profile for the next plans. Step 0 is not reported (one-off warm-up).

Gradients are all-reduced by hand in one flat buffer after the last
micro-batch instead of by DDP: DDP fires its all-reduce in the backward of a
micro-batch and so needs the same number of micro-batches on every DP rank,
which Skrull's plans do not give (a DP rank may even have none).

Shape legend: T tokens of one packed row, V vocabulary.
"""

from __future__ import annotations

import json
import logging
import resource
import time
import uuid
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import torch
import torch.distributed as dist
import torch.nn.functional as F
from pydantic import TypeAdapter, ValidationError
from skrull_proto.models import JobId
from tqdm import tqdm

from scheduler_service.core.check import check_plan
from scheduler_service.core.models import ModelShape
from scheduler_service.core.plan import SchedulerName, make_problem
from scheduler_service.core.profile import Profile, load_profile
from trainer_client.attention import AttentionBackend
from trainer_client.data import IGNORE_INDEX, GlobalBatch, JsonlSource, SyntheticSource, make_source
from trainer_client.distributed import ParallelContext, ParallelDims
from trainer_client.model import build_model, model_shape
from trainer_client.packing import PackedMicroBatch, pack_micro_batch
from trainer_client.plan_client import MicroBatchTiming, PlanClient, PlanDecision, PlanOrigin, PlanSource

__all__ = ["PlanningFailed", "StepMetrics", "TrainConfig", "Trainer", "run_micro_batch"]

logger = logging.getLogger("trainer_client.trainer")

_JOB_ID: TypeAdapter[str] = TypeAdapter(JobId)


class PlanningFailed(ValueError):
    """Rank 0 could not plan a global batch; every rank raises this with rank 0's message."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    dp: int
    cp: int
    model: str = "tiny"
    data: str = "synthetic:lmsys"
    global_batch: int = 16
    steps: int = 20
    scheduler: str = SchedulerName.SKRULL.value
    scheduler_url: str | None = None
    bucket_size: int | None = None
    profile: str | None = None  # a profile name, or a profile file (the profiler's output)
    seed: int = 0
    lr: float = 1e-3
    weight_decay: float = 0.0
    max_length: int | None = None
    truncate: bool = False
    metrics_out: Path | None = None
    plan_timeout_s: float = 5.0
    plan_attempts: int = 3
    attention_backend: str = AttentionBackend.AUTO.value
    dtype: str | None = None  # float32 | bfloat16; default float32 on CPU, bfloat16 autocast on CUDA
    progress: bool = True
    feedback: bool = False  # report measured micro-batch times and peak memory to the service
    job_id: str | None = None  # names this run for the service's feedback; random when absent

    def __post_init__(self) -> None:
        ParallelDims(dp_size=self.dp, cp_size=self.cp)
        if self.global_batch < 1:
            raise ValueError(f"--global-batch must be positive, got {self.global_batch}")
        if self.steps < 1:
            raise ValueError(f"--steps must be positive, got {self.steps}")
        if self.scheduler not in {s.value for s in SchedulerName}:
            raise ValueError(f"--scheduler {self.scheduler!r} is unknown; known: {', '.join(SchedulerName)}")
        if self.bucket_size is not None and self.bucket_size < 1:
            raise ValueError(f"--bucket-size must be positive, got {self.bucket_size}")
        if self.max_length is not None and self.max_length < 1:
            raise ValueError(f"--max-length must be positive, got {self.max_length}")
        if self.scheduler_url is not None and not self.scheduler_url.startswith(("http://", "https://")):
            raise ValueError(f"--scheduler-url {self.scheduler_url!r} must start with http:// or https://")
        if self.lr <= 0:
            raise ValueError(f"--lr must be positive, got {self.lr}")
        AttentionBackend(self.attention_backend)
        if self.dtype not in (None, "float32", "bfloat16"):
            raise ValueError(f"--dtype must be float32 or bfloat16, got {self.dtype!r}")
        if self.feedback and self.scheduler_url is None:
            raise ValueError("--feedback reports to the scheduler service: give --scheduler-url too")
        if self.job_id is not None:
            try:
                _JOB_ID.validate_python(self.job_id)
            except ValidationError:
                raise ValueError(f"--job-id {self.job_id!r} is not a valid job id: 1 to 128 characters, letters, "
                                 "digits and . _ : - only, starting with a letter or digit") from None

    @property
    def dims(self) -> ParallelDims:
        return ParallelDims(dp_size=self.dp, cp_size=self.cp)


@dataclass(frozen=True, kw_only=True, slots=True)
class StepMetrics:
    step: int
    loss: float
    tokens: int
    loss_tokens: int
    step_time_s: float
    tokens_per_s: float
    plan_source: str
    scheduler: str
    estimated_time_ms: float | None
    num_micro_batches: int
    plan_fallbacks: int
    peak_memory_bytes: int | None
    memory_kind: str

    def to_json(self) -> str:
        return json.dumps({name: getattr(self, name) for name in self.__slots__})


def _peak_memory(device: torch.device) -> tuple[int | None, str]:
    if device.type == "cuda":
        peak = int(torch.cuda.max_memory_allocated(device))
        torch.cuda.reset_peak_memory_stats(device)
        return peak, "cuda_max_allocated"
    # ru_maxrss is in KiB on Linux: the process's peak resident set since it started.
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024, "cpu_peak_rss"


def run_micro_batch(
    model: torch.nn.Module, pack: PackedMicroBatch, *, num_loss_tokens: int,
    autocast_dtype: torch.dtype | None = None, attention_backend: str = AttentionBackend.AUTO.value,
) -> torch.Tensor:
    """Forward and backward of one packed micro-batch (gradients accumulate); returns its summed token loss.

    The loss is divided by the global batch's ``num_loss_tokens`` before backward (appendix A). The profiler and
    the accuracy benchmark time exactly this.
    """
    device_type = pack.input_ids_T.device.type
    autocast = (torch.autocast(device_type, dtype=autocast_dtype) if autocast_dtype is not None
                else nullcontext())
    with autocast:
        output = model(
            input_ids=pack.input_ids_T.unsqueeze(0), position_ids=pack.position_ids_T.unsqueeze(0),
            use_cache=False, dacp_metadata=pack.metadata, dacp_backend=attention_backend,
        )
    logits_TV = output.logits[0].float()
    token_loss_sum = F.cross_entropy(logits_TV, pack.targets_T, ignore_index=IGNORE_INDEX, reduction="sum")
    (token_loss_sum / max(num_loss_tokens, 1)).backward()
    return token_loss_sum.detach()


class Trainer:
    def __init__(self, config: TrainConfig, parallel: ParallelContext) -> None:
        self.config = config
        self.parallel = parallel
        self.device = parallel.device
        shape = model_shape(config.model)
        # A file is read here: the embedded planner plans with it, the service is asked for it by name.
        self.profile: str | Profile | None = (load_profile(config.profile) if config.profile is not None
                                              and Path(config.profile).is_file() else config.profile)
        self.bucket_size = config.bucket_size or self._derived_bucket_size(shape)
        self.max_length = config.max_length or self.bucket_size * config.cp
        self.source: SyntheticSource | JsonlSource = make_source(
            config.data, global_batch_size=config.global_batch, vocab_size=shape.vocab_size,
            max_length=self.max_length, seed=config.seed, truncate=config.truncate,
        )
        self.model = build_model(config.model, seed=config.seed, device=self.device)
        self.model.train()
        self._broadcast_parameters()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=config.lr, weight_decay=config.weight_decay)
        dtype = config.dtype or ("bfloat16" if self.device.type == "cuda" else "float32")
        self.autocast_dtype = torch.bfloat16 if dtype == "bfloat16" else None
        self.pad_token_id = int(getattr(self.model.config, "pad_token_id", None) or 0)
        self.plans: PlanSource | None = None
        if parallel.is_main:
            client = None
            if config.scheduler_url:
                client = PlanClient(config.scheduler_url, timeout_s=config.plan_timeout_s,
                                    max_attempts=config.plan_attempts)
            self.plans = PlanSource(scheduler=config.scheduler, dp_size=config.dp, cp_size=config.cp,
                                    model=shape if Path(config.model).is_dir() else config.model,
                                    bucket_size=self.bucket_size, profile=self.profile, client=client,
                                    job_id=(config.job_id or uuid.uuid4().hex) if config.feedback else None)
            self.plans.check_service()
        self.micro_batch_timings: list[MicroBatchTiming] = []  # this rank's, of the latest step
        self._step_peak_bytes = 0  # CUDA: the largest per-micro-batch peak of the step (feedback resets them)
        self._next_batch: GlobalBatch | None = None  # rank 0: the batch built for the prefetch, trained next step
        self._metrics_file: IO[str] | None = None
        if parallel.is_main and config.metrics_out is not None:
            config.metrics_out.parent.mkdir(parents=True, exist_ok=True)
            self._metrics_file = config.metrics_out.open("w")

    def _derived_bucket_size(self, shape: ModelShape) -> int:
        """BucketSize from the profile, as the planner derives it when a request leaves it out."""
        return make_problem(sequence_lengths=[1], dp_size=self.config.dp, cp_size=self.config.cp, model=shape,
                            profile=self.profile).bucket_size

    @torch.no_grad()
    def _broadcast_parameters(self) -> None:
        """Seeded init already makes replicas; the broadcast guarantees it (checkpoints, nondeterministic init)."""
        for tensor in self.model.state_dict().values():
            dist.broadcast(tensor, src=0)

    # ------------------------------------------------------------------------------------------------ planning

    def decide(self, step: int, batch: GlobalBatch) -> PlanDecision:
        """Rank 0 decides; every rank receives the decision and checks the plan against its own copy of the batch."""
        decision: list[PlanDecision | None] = [None]
        if self.parallel.is_main:
            assert self.plans is not None
            try:
                decision[0] = self.plans.decide(step, batch.sequence_lengths)
            except Exception as error:  # any failure must still reach the other ranks, as a decision
                decision[0] = PlanDecision(step=step, scheduler=self.config.scheduler, origin=PlanOrigin.EMBEDDED,
                                           error=f"rank 0 failed to plan global batch {step}: {error!r}")
        dist.broadcast_object_list(decision, src=0, group=self.parallel.object_group)
        received = decision[0]
        assert received is not None and received.step == step
        if received.error is not None:
            raise PlanningFailed(received.error)
        assert received.plan is not None
        check_plan(received.plan, sequence_lengths=batch.sequence_lengths, dp_size=self.config.dp,
                   cp_size=self.config.cp, bucket_size=received.bucket_size)
        return received

    # ------------------------------------------------------------------------------------------------ compute

    def pack(self, batch: GlobalBatch, decision: PlanDecision) -> list[PackedMicroBatch]:
        assert decision.plan is not None
        micro_batches = decision.plan.dp_ranks[self.parallel.dp_rank].micro_batches
        return [
            pack_micro_batch(batch.samples, micro_batch, cp_size=self.config.cp, cp_rank=self.parallel.cp_rank,
                             cp_group=self.parallel.cp_group, cp_block_groups=self.parallel.cp_block_groups,
                             pad_token_id=self.pad_token_id).to(self.device)
            for micro_batch in micro_batches
        ]

    def forward_backward(self, packs: list[PackedMicroBatch]) -> tuple[float, int]:
        """Accumulate this rank's gradients and reduce them over all ranks; returns (global loss, loss tokens)."""
        world = dist.group.WORLD
        counts = torch.tensor([sum(p.num_loss_tokens for p in packs)], dtype=torch.float64, device=self.device)
        dist.all_reduce(counts, group=world)
        num_loss_tokens = int(counts.item())
        for param in self.params:
            param.grad = None
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        self.micro_batch_timings = []
        # On CUDA the timing waits for the device, so only a run that reports it pays for the waits.
        timed = self.device.type != "cuda" or self.config.feedback
        for index, pack in enumerate(packs):
            if pack.is_idle:
                continue  # no tokens here and a member of no collective: no peer waits for this rank
            if timed and self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
                torch.cuda.reset_peak_memory_stats(self.device)
            started = time.perf_counter()
            loss_sum += run_micro_batch(self.model, pack, num_loss_tokens=num_loss_tokens,
                                        autocast_dtype=self.autocast_dtype,
                                        attention_backend=self.config.attention_backend).double()
            if timed:
                peak = None
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                    peak = int(torch.cuda.max_memory_allocated(self.device))
                    self._step_peak_bytes = max(self._step_peak_bytes, peak)
                self.micro_batch_timings.append(MicroBatchTiming(
                    dp_rank=self.parallel.dp_rank, index=index, time_s=time.perf_counter() - started,
                    peak_memory_bytes=peak))
        # One collective for every gradient and the loss; ranks that ran nothing contribute zeros.
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = torch.cat([g.reshape(-1).float() for g in grads] + [loss_sum.float().reshape(1)])
        dist.all_reduce(flat, group=world)
        offset = 0
        for param, grad in zip(self.params, grads, strict=True):
            param.grad = flat[offset:offset + grad.numel()].view_as(param).to(param.dtype)
            offset += grad.numel()
        global_loss = float(flat[offset].item()) / max(num_loss_tokens, 1)
        return global_loss, num_loss_tokens

    # ------------------------------------------------------------------------------------------------ loop

    def train_step(self, step: int, batch: GlobalBatch) -> StepMetrics:
        started = time.perf_counter()
        decision = self.decide(step, batch)
        if self.plans is not None and step + 1 < self.config.steps:
            self._next_batch = self.source.batch(step + 1)
            self.plans.prefetch(step + 1, self._next_batch.sequence_lengths)
        packs = self.pack(batch, decision)
        loss, num_loss_tokens = self.forward_backward(packs)
        assert num_loss_tokens == batch.num_loss_tokens, "packing lost or repeated loss tokens"
        self.optimizer.step()
        step_time_s = time.perf_counter() - started
        peak, memory_kind = _peak_memory(self.device)
        if peak is not None and self.device.type == "cuda":
            peak = max(peak, self._step_peak_bytes)
            self._step_peak_bytes = 0
        assert decision.plan is not None
        if self.config.feedback:
            self.report_feedback(step, batch, decision)
        return StepMetrics(
            step=step, loss=loss, tokens=batch.num_tokens, loss_tokens=num_loss_tokens, step_time_s=step_time_s,
            tokens_per_s=batch.num_tokens / step_time_s, plan_source=decision.origin.value,
            scheduler=decision.scheduler, estimated_time_ms=decision.estimated_time_ms,
            num_micro_batches=decision.plan.num_micro_batches,
            plan_fallbacks=self.plans.num_fallbacks if self.plans is not None else 0,
            peak_memory_bytes=peak, memory_kind=memory_kind,
        )

    def report_feedback(self, step: int, batch: GlobalBatch, decision: PlanDecision) -> None:
        """Gather every rank's micro-batch timings on rank 0, which reports them (every rank must call this)."""
        gathered: list[list[MicroBatchTiming]] | None = [[] for _ in range(dist.get_world_size())] \
            if self.parallel.is_main else None
        dist.gather_object(self.micro_batch_timings, gathered, dst=0, group=self.parallel.object_group)
        if self.plans is not None and gathered is not None and step > 0:  # step 0 pays one-off warm-up
            assert decision.plan is not None
            timings = [timing for rank_timings in gathered for timing in rank_timings]
            memory_budget = (float(torch.cuda.get_device_properties(self.device).total_memory)
                             if self.device.type == "cuda" else None)
            self.plans.report(step, decision.plan, batch.sequence_lengths, timings,
                              memory_budget_bytes=memory_budget)

    def batch(self, step: int) -> GlobalBatch:
        """Global batch ``step``, built once: rank 0 reuses the one it built for the prefetch."""
        cached, self._next_batch = self._next_batch, None
        if cached is not None and cached.step == step:
            return cached
        return self.source.batch(step)

    def train(self) -> list[StepMetrics]:
        history = []
        bar = tqdm(total=self.config.steps, desc=f"train {self.config.scheduler}", unit="step",
                   disable=not (self.parallel.is_main and self.config.progress))
        with bar:
            for step in range(self.config.steps):
                metrics = self.train_step(step, self.batch(step))
                history.append(metrics)
                if self._metrics_file is not None:
                    self._metrics_file.write(metrics.to_json() + "\n")
                    self._metrics_file.flush()
                bar.set_postfix(loss=f"{metrics.loss:.4f}", tok_s=f"{metrics.tokens_per_s:.0f}",
                                plan=metrics.plan_source)
                bar.update()
        return history

    def close(self) -> None:
        if self.plans is not None:
            self.plans.close()
        if self._metrics_file is not None:
            self._metrics_file.close()
