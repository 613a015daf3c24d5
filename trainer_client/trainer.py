"""The training loop: one optimizer step per global batch, planned by Skrull, run with DACP.

Per global batch ``s`` (identical data on every rank, ``data``):

1. rank 0 decides the plan (``PlanSource``: service, else embedded core) and
   broadcasts the *decision* over a gloo group; the plan is checked once on
   every rank with the core's checker. An error decision stops every rank
   cleanly. Planning, packing, the plan prefetch and feedback are the loop
   API's (``loop.SkrullBatches``), which a loop of one's own uses as well.
2. DP rank ``i``, CP rank ``j`` packs each of its micro-batches
   (``plan.dp_ranks[i]``, column ``j``; sequences sharded over the whole CP
   group or over a hybrid group's block of it) and runs forward + backward on
   them in order (gradient accumulation). A background thread packs (and on
   CUDA copies to the device) micro-batch ``m + 1`` while ``m`` computes
   (``dacp/prefetch.py``). Sharded (``--sharding zero2|zero3``,
   FSDP2, ``parallelize.py``): a micro-batch where the rank holds no token and
   is a member of no collective runs as a zero-loss padding micro-batch, and
   ranks add padding micro-batches so that their FSDP collectives match (zero3:
   as many as the plan's longest DP rank; zero2: one where a DP rank has
   none); gradients are reduce-scattered over all ranks in the backward of the
   last one, overlapping it. ``--sharding none``: idle micro-batches are
   skipped, and the gradients of all ranks are summed by one flat all-reduce
   afterwards (``parallelize.reduce_gradients``).
3. Loss normalisation over the *whole* global batch (paper appendix A): every
   micro-batch's summed token loss (``loss.py``: LM head and cross-entropy
   chunked over tokens) is divided by the global batch's number of loss tokens
   (every rank holds the batch; the tokens the ranks packed are all-reduced
   after the micro-batches and checked against it), and gradients are summed
   over all DP × CP ranks. Every scheduler and
   every sharding mode therefore yields the gradients of the unscheduled batch,
   up to floating-point summation order.
4. The gradients are clipped to a global norm, AdamW steps once, the learning
   rate follows ``--lr-scheduler`` (``optim.py``); every ``--checkpoint-every``
   steps all ranks save a DCP checkpoint (``checkpoint.py``; with
   ``--async-checkpoint`` written while training goes on, with ``--keep-last``
   older ones removed once it is complete), from whose newest complete one
   ``--resume`` continues exactly; before it loads one, rank 0 checks that
   it was written by this run (``run_identity.py``) and every rank receives
   the verdict. On SIGINT or SIGTERM to any rank, every rank finishes the
   step, saves it and leaves the loop at its boundary (``stop.py``). With
   ``--output-dir`` the model is written as a Hugging Face folder after the
   last step, and every ``--export-every`` steps (``components.model_export``).
5. With ``feedback`` (opt-in), every rank's measured micro-batch times (and
   peak memory on CUDA, ``step_metrics.MicroBatchTimer``) are gathered on rank 0,
   which reports them to the service (``POST /feedback``) in the background; the
   service refits this job's profile for the next plans. Step 0 is not reported
   (one-off warm-up).

6. With ``--eval-data``, every ``--eval-every`` steps and after the last, the
   held-out set is planned and packed like training batches and run forward
   only (``evaluate``, ``evaluation.py``); its mean token loss is logged beside
   the training loss.

Every rank builds the model empty, shards it, and receives rank 0's weights
(``loading.py``): no rank but rank 0 ever holds the whole model. With
``--lora-rank`` the model gets LoRA adapters before it is sharded and only
they train (``lora.py``). The configuration and its checks are
``config.TrainConfig``; what each step measures is ``step_metrics.StepMetrics``,
which rank 0 writes to ``--metrics-out`` and the trackers of ``--report-to``
(``reporting.py``).

Shape legend: T tokens of one packed row, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import sys
import time
from contextlib import ExitStack, nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from scheduler_service.contract.profiles import profile_or_name
from scheduler_service.core.memory import Sharding, training_profile
from scheduler_service.core.models import ModelShape
from scheduler_service.core.perf_model import PerformanceModel
from scheduler_service.core.plan import make_problem
from scheduler_service.core.profile import DEFAULT_PROFILE, Profile, builtin_profiles, resolve_profile
from trainer_client.components.checkpoint import (
    Checkpointer,
    TrainState,
    latest_checkpoint,
    load_checkpoint,
    saved_run_identity,
    step_dir,
)
from trainer_client.components.model_export import export_model, load_export_tokenizer
from trainer_client.components.optim import build_optimizer, clip_gradients, lr_schedule
from trainer_client.components.reporting import Reports, default_job_id, open_reports
from trainer_client.components.run_identity import ResumeMismatch, RunIdentity, check_resume
from trainer_client.components.step_metrics import MicroBatchTimer, StepMetrics
from trainer_client.components.stop import TrainingStopped, graceful_stops, stop_agreed
from trainer_client.config import TrainConfig
from trainer_client.config_choices import FsdpUnits
from trainer_client.data import (
    DataSource,
    GlobalBatch,
    LengthStats,
    RecordEncoder,
    RecordSource,
    SyntheticSource,
    make_source,
    record_encoder,
)
from trainer_client.data.evaluation import EvalSet
from trainer_client.data.record_check import (
    BAD_RECORDS_FILE,
    BadRecordsError,
    RecordCheck,
    check_records,
    write_bad_records,
)
from trainer_client.distributed import ParallelContext, max_over_ranks
from trainer_client.hub import fetch_on_rank_0_first
from trainer_client.loop import RankBatch, SkrullBatches
from trainer_client.models.loading import ModelLayout, build_training_module, check_weights_present
from trainer_client.models.lora import LoraSettings
from trainer_client.models.loss import micro_batch_loss, run_micro_batch
from trainer_client.models.model import model_folder, model_shape
from trainer_client.models.parallelize import (
    check_compile,
    check_cuda_graphs,
    prepare_micro_batch,
    reduce_gradients,
    reshard,
)
from trainer_client.planning.source import MicroBatchTiming, plan_capacity
from trainer_client.profiler.auto import AUTO_PROFILE, auto_profile, default_profile
from trainer_client.profiler.measure import check_profile_machine, memory_per_rank_bytes

__all__ = ["InjectedFault", "Trainer"]

logger = logging.getLogger("trainer_client.trainer")

DEFAULT_CUDA_GRAPH_BUCKETS = 4  # --cuda-graphs without --token-buckets: BucketSize down to an eighth of it
FP32_BYTES = 4  # FSDP reduces gradients in fp32


class InjectedFault(RuntimeError):
    """Raised by ``--fail-rank``/``--fail-at-step``: one rank failing alone, as a crash or a bad record would."""


class Trainer:
    def __init__(self, config: TrainConfig, parallel: ParallelContext) -> None:
        """Build the run; what it opens (the checkpointer, the planner, rank 0's reports) ``close`` closes, and a
        failure here closes what was opened before it."""
        with ExitStack() as opened:
            self._build(config, parallel, opened)
            self._resources = opened.pop_all()

    def _build(self, config: TrainConfig, parallel: ParallelContext, opened: ExitStack) -> None:
        """Each part of the run, in the order each needs the ones before it."""
        self.config = config
        self.parallel = parallel
        self.device = parallel.device
        self.sharding = config.sharding
        self.lora = LoraSettings.of(config)
        # Hub ids: rank 0 downloads what the cache lacks, then every rank reads rank 0's commits (hub.py).
        fetch_on_rank_0_first(parallel, model=config.model, tokenizer=config.tokenizer, data=config.data,
                              eval_data=config.eval_data)
        shape = model_shape(config.model)
        check_weights_present(config.model)
        if config.cuda_graphs:  # before anything is built
            check_cuda_graphs(self.device, sharding=self.sharding, cp_size=config.cp)
            check_compile(self.device, flag="--cuda-graphs")
        elif config.compile:
            check_compile(self.device)
        self._build_layout(shape)
        self._build_data(shape)
        self._build_model()
        self.optimizer = build_optimizer(self.params, lr=self.config.lr, weight_decay=self.config.weight_decay)
        self._build_checkpointing(opened)
        self.lr_schedule = lr_schedule(self.optimizer, scheduler=self.config.lr_scheduler, lr=self.config.lr,
                                       warmup_steps=self.config.warmup_steps, total_steps=self.config.steps,
                                       min_lr_ratio=self.config.min_lr_ratio, first_step=self.first_step)
        self._build_loop(opened)

    def _build_layout(self, shape: ModelShape) -> None:
        """How the model lies on the device (dtype, sharding, FSDP units, compilation), the profile that prices it,
        and what a rank holds: the BucketSize, the token buckets, the longest sequence."""
        config = self.config
        self.layout = ModelLayout.on(self.device, dtype=config.dtype, sharding=self.sharding,
                                     activation_checkpointing=config.activation_checkpointing,
                                     loss_chunk_tokens=config.loss_chunk_tokens, compiled=config.compile)
        self.autocast_dtype = self.layout.autocast_dtype
        if self.device.type == "cpu" and self.layout.param_dtype == torch.bfloat16 and self.parallel.is_main:
            logger.warning("--dtype bfloat16 on the CPU: the model computes in bfloat16 there, which most CPUs run "
                           "slower than float32 and no CPU test checks; float32 is the CPU's default")
        self.profile = self._profile(config.profile or default_profile(self.device))
        # A file, or a shipped profile by name; another name is the service's, which this process cannot read.
        known = (self.profile if isinstance(self.profile, Profile)
                 else builtin_profiles().get(self.profile or DEFAULT_PROFILE))
        if known is not None:
            check_profile_machine(known, self.device)
        # On CPU the BucketSize is this machine's: a shipped profile's memory is a GPU's (h100-paper: 80 GB), and a
        # CPU profile's the whole host that measured it, which this node's ranks share.
        self.host_memory_bytes = (memory_per_rank_bytes(self.device, world_size=self.parallel.dims.world_size)
                                  if self.device.type == "cpu" else None)
        self.bucket_size = config.bucket_size or self._derived_bucket_size(shape, self.layout.param_dtype)
        fsdp_units = config.fsdp_units or self._default_fsdp_units(shape, known)
        self.layout = dataclasses.replace(self.layout, fsdp_units=fsdp_units, cuda_graphs=config.cuda_graphs)
        self.token_buckets = config.token_buckets if config.token_buckets is not None else (
            DEFAULT_CUDA_GRAPH_BUCKETS if config.cuda_graphs else 0)
        self.max_length = config.max_length or self.bucket_size * config.cp
        # What the planner costs sequences with: a catalogue name, or a checkpoint's shape.
        self.plan_model = shape if model_folder(config.model) is not None else config.model

    def _build_data(self, shape: ModelShape) -> None:
        """The training records (every one checked before the first step, ``_check_data``), the steps ``--epochs``
        makes of them, the eval set, and the run's identity that every checkpoint keeps."""
        config = self.config
        self.source: DataSource = make_source(
            config.data, global_batch_size=config.global_batch, vocab_size=shape.vocab_size,
            max_length=self.max_length, seed=config.seed, shuffle=config.shuffle, **self._encoding(),
        )
        self._check_data()
        if config.epochs is not None:
            assert isinstance(self.source, RecordSource)  # TrainConfig refuses --epochs of synthetic data
            logger.info("%s", self.source.epochs_text(config.epochs))
            self.config = config = config.model_copy(update={"steps": self.source.steps_for_epochs(config.epochs)})
        self.eval_set = (EvalSet.load(config.eval_data, encoder=self._record_encoder(shape),
                                      global_batch_size=config.global_batch)
                         if config.eval_data is not None else None)
        self.identity = RunIdentity.of(config, self.source)  # saved with every checkpoint, checked on resume
        self.lengths = LengthStats()  # of the batches this run trained

    def _build_model(self) -> None:
        """The model as the layout lays it out (LoRA adapters included), its trained parameters, and the tokenizer
        an export saves beside it."""
        config = self.config
        self.export_tokenizer = (load_export_tokenizer(config.tokenizer, chat_template=config.chat_template)
                                 if config.output_dir is not None and config.tokenizer is not None else None)
        self.module = build_training_module(config.model, parallel=self.parallel, layout=self.layout,
                                            seed=config.seed, lora=self.lora)
        self.pad_token_id = int(getattr(self.module.lm.config, "pad_token_id", None) or 0)
        self.params = [p for p in self.module.parameters() if p.requires_grad]

    def _build_checkpointing(self, opened: ExitStack) -> None:
        """The checkpointer of ``--checkpoint-dir``, and under ``--resume`` the state it restores (weights,
        optimizer, data position, the steps done)."""
        config = self.config
        self.first_step = 0
        self.checkpointer = (Checkpointer(config.checkpoint_dir, keep_last=config.keep_last,
                                          async_save=config.async_checkpoint,
                                          timeout=self.parallel.collective_timeout)
                             if config.checkpoint_dir is not None else None)
        if self.checkpointer is not None:
            opened.callback(self.checkpointer.close)
        if config.resume:
            assert config.checkpoint_dir is not None
            self._resume(config.checkpoint_dir)

    def _build_loop(self, opened: ExitStack) -> None:
        """What each step runs through: the plans, packing, plan prefetch and feedback (``SkrullBatches``, the loop
        API a training loop of one's own uses), the micro-batch timer, and rank 0's reports."""
        config, parallel = self.config, self.parallel
        # rank 0's names the service's feedback job and the reported runs (--logging-dir's default runs/JOB_ID)
        job_id = config.job_id or default_job_id(model=config.model, data=config.data,
                                                   checkpoint_dir=config.checkpoint_dir)
        if parallel.is_main and config.report_to:
            logger.info("job %s: reporting to %s", job_id, ", ".join(config.report_to))
        self.batches = SkrullBatches(
            parallel, model=self.plan_model, bucket_size=self.bucket_size,
            scheduler=config.scheduler, scheduler_url=config.scheduler_url or None, profile=self.profile,
            sharding=self.sharding, pad_token_id=self.pad_token_id, plan_timeout_s=config.plan_timeout_s,
            plan_attempts=config.plan_attempts, spanning=config.spanning and not config.cuda_graphs,
            schemes=config.schemes, token_buckets=self.token_buckets,
            job_id=job_id if config.feedback and parallel.is_main else None,
        )
        opened.callback(self.batches.close)
        # On CUDA the timing waits for the device, so only a run that reports it pays for the waits.
        self.timer = MicroBatchTimer(self.device, dp_rank=parallel.dp_rank,
                                     enabled=self.device.type != "cuda" or config.feedback)
        self.micro_batch_timings: list[MicroBatchTiming] = []  # this rank's, of the latest step
        self.num_padding_micro_batches = 0  # of the latest step, summed over all ranks
        self.micro_batch_time_s = 0.0  # of the latest step, the slowest rank's
        self._next_batch: GlobalBatch | None = None  # rank 0: the batch built for the prefetch, trained next step
        self._trained = False  # train() ran to its end: the trackers record the run as finished, else failed
        self.history: list[StepMetrics] = []  # of this launch, each step's as train() trains it
        self.num_steps_done = self.first_step  # the steps the model has taken, resumed ones included
        self.reports = (open_reports(job_id=job_id, steps_done=self.first_step, metrics_out=config.metrics_out,
                                     report_to=config.report_to, logging_dir=config.logging_dir, resume=config.resume)
                        if parallel.is_main else Reports())
        opened.callback(lambda: self.reports.close(failed=not self._trained))

    def _profile(self, choice: str | None) -> str | Profile | None:
        """``auto``: measured here (every rank, or read from the cache); a file is read here: the embedded planner
        plans with it and the service gets it for this run's job; a name is a shipped or a service's profile."""
        if choice == AUTO_PROFILE:
            return auto_profile(self.config.model, parallel=self.parallel, layout=self.layout,
                                attention_backend=self.config.attention_backend, progress=self.config.progress)
        return profile_or_name(choice)

    def _default_fsdp_units(self, shape: ModelShape, profile: Profile | None) -> FsdpUnits:
        """``--fsdp-units`` left out: one unit under zero2 where the whole model's fp32 gradient reduction, at the
        end of the last backward, fits in the activation memory of a BucketSize, which the backward has freed by
        then (``parallelize.py``); else one per layer (also without a profile this process can read)."""
        if self.sharding is not Sharding.ZERO2 or profile is None:
            return FsdpUnits.LAYER
        lora = self.lora
        trained = lora.shape.num_parameters(shape) if lora is not None else shape.num_parameters
        activations = PerformanceModel(model=shape, profile=profile).activation_bytes(self.bucket_size)
        return FsdpUnits.MODEL if FP32_BYTES * trained <= activations else FsdpUnits.LAYER

    def _derived_bucket_size(self, shape: ModelShape, param_dtype: torch.dtype) -> int:
        """BucketSize from the profile, as the planner derives it when a request leaves it out, with the static
        memory of this trainer's sharding mode; on CPU in this host's memory per rank (``host_memory_bytes``)."""
        lora = self.lora
        profile = training_profile(resolve_profile(self.profile), shape, sharding=self.sharding,
                                   compute_bytes=param_dtype.itemsize,
                                   activation_checkpointing=self.config.activation_checkpointing,
                                   lora=lora.shape if lora is not None else None)
        if self.host_memory_bytes is not None:
            # This host's memory per rank, none of it reserved: a CPU has no CUDA context nor allocator cache (a CPU
            # profile measures 0, profiler.sweeps._reserved_bytes), where a GPU profile reserves 4 GiB a rank.
            profile = dataclasses.replace(profile, device_memory_bytes=self.host_memory_bytes,
                                          memory=dataclasses.replace(profile.memory, reserved_bytes=0.0))
        return make_problem(sequence_lengths=[1], dp_size=self.config.dp, cp_size=self.config.cp, model=shape,
                            profile=profile).bucket_size

    def _check_data(self) -> None:
        """Find, before the first step, every training record that cannot train (``record_check``): every rank encodes
        its share of the records and every rank gets the whole verdict. Records that cannot train stop every rank with
        one message listing them, unless ``--skip-bad-records`` leaves them out of every epoch; either way rank 0
        lists them in the run folder. Logs the layout's sizes and, for records, the length distribution of what
        trains."""
        config, parallel = self.config, self.parallel
        capacity = plan_capacity(dp_size=config.dp, cp_size=config.cp, model=self.plan_model,
                                 bucket_size=self.bucket_size, profile=self.profile, spanning=config.spanning)
        holds = self._plan_capacity_text(capacity)
        if parallel.is_main:
            profile = self.profile.name if isinstance(self.profile, Profile) else self.profile or DEFAULT_PROFILE
            bucket_from = ("--bucket-size" if config.bucket_size is not None
                           else f"derived from profile {profile} for --sharding {self.sharding} in "
                                f"{str(self.layout.param_dtype).removeprefix('torch.')}")
            if config.bucket_size is None and self.host_memory_bytes is not None:
                bucket_from += f", from {self.host_memory_bytes / 2**30:.1f} GiB of host memory per rank"
            length_from = "--max-length" if config.max_length is not None else "bucket size × cp"
            logger.info("layout: BucketSize %d tokens per CP rank (%s); max length %d (%s); a plan holds %s",
                        self.bucket_size, bucket_from, self.max_length, length_from, holds)
        if isinstance(self.source, SyntheticSource):
            if capacity is not None and self.max_length > capacity:
                raise ValueError(f"--max-length {self.max_length}: {config.data} draws sequences up to that long, and "
                                 f"a plan of this layout holds at most {holds}; give --max-length {capacity} or less, "
                                 "or a larger --bucket-size")
            return
        records = self.source.records
        world_size = dist.get_world_size()
        share = check_records(records, self.source.encoder, plan_capacity=capacity,
                              indices=np.arange(parallel.global_rank, records.num_records, world_size))
        shares: list[RecordCheck | None] = [None] * world_size
        dist.all_gather_object(shares, share, group=parallel.object_group)
        checked = RecordCheck.merged([share for share in shares if share is not None])
        if checked.bad:
            listed = ""
            if config.checkpoint_dir is not None:
                listed = f" (all listed in {config.checkpoint_dir / BAD_RECORDS_FILE})"
                if parallel.is_main:
                    write_bad_records(config.checkpoint_dir / BAD_RECORDS_FILE, checked.bad)
            report = checked.report(max_length=self.max_length, plan_capacity=holds)
            num_trained = checked.num_records - len(checked.bad)
            if not config.skip_bad_records:
                skip = (f"--skip-bad-records trains the other {num_trained} and leaves these out" if num_trained
                        else "no record can train")
                raise BadRecordsError("\n".join([
                    f"--data {config.data}: {len(checked.bad)} of {checked.num_records} records cannot train"
                    f"{listed}:", *report, "hint: " + "; ".join([*checked.fixes(), skip])]))
            self.source.leave_out(checked.bad_indices)
            if parallel.is_main:
                logger.warning("\n".join([f"--skip-bad-records: leaving out {len(checked.bad)} of "
                                          f"{checked.num_records} records of --data {config.data}{listed}:", *report]))
        if parallel.is_main:
            logger.info("data: %s: %s", config.data, checked.summary())

    def _plan_capacity_text(self, capacity: int | None) -> str:
        """What a plan holds, as the user reads it: ``1024 tokens (bucket size 256 × cp 2 × dp 2)``."""
        if capacity is None:
            return "what the service's profile allows"
        factors = f"bucket size {self.bucket_size} × cp {self.config.cp}"
        if capacity == self.bucket_size * self.config.cp * self.config.dp and self.config.dp > 1:
            factors += f" × dp {self.config.dp}"
        return f"{capacity} tokens ({factors})"

    def _encoding(self) -> dict[str, Any]:
        """How the run's records become samples (``data.record_encoder``'s flags, the layout's aside)."""
        config = self.config
        return {"truncate": config.truncate, "tokenizer": config.tokenizer, "loss_on": config.loss_on,
                "chat_template": config.chat_template, "text_field": config.text_field}

    def _record_encoder(self, shape: ModelShape) -> RecordEncoder:
        """How ``--eval-data`` records become samples: as the training records do."""
        if isinstance(self.source, RecordSource):
            return self.source.encoder
        return record_encoder(max_length=self.max_length, vocab_size=shape.vocab_size, **self._encoding())

    def _resume(self, directory: Path) -> None:
        path = self._checkpoint_to_resume(directory)
        if path is None:
            logger.info("no checkpoint in %s: training from scratch", directory)
            return
        state = load_checkpoint(path, module=self.module, optimizer=self.optimizer)
        self.source.seek(state.data_position)
        self.first_step = state.num_steps_done
        if self.first_step > self.config.steps:
            raise ValueError(f"checkpoint {path} is {self.first_step} steps in; --steps {self.config.steps} ends "
                             "before it")
        logger.info("resumed from %s: %d steps done", path, self.first_step)

    def _checkpoint_to_resume(self, directory: Path) -> Path | None:
        """Rank 0 picks the newest complete checkpoint of ``directory``, checks that it was written by this run and
        logs what it accepts; every rank receives the pick and the verdict and stops on a refusal, all before any
        DCP state is read. One rank picks: on a shared file system another rank could see a marker later, and
        ranks loading different steps would train on silently mixed states."""
        choice: list[str | None] = [None, None]  # the checkpoint, the refusal
        if self.parallel.is_main:
            path = latest_checkpoint(directory)
            if path is not None:
                choice[0] = str(path)
                try:
                    for warning in check_resume(path, saved_run_identity(path), self.identity,
                                                accept_data_change=self.config.resume_accept_data_change):
                        logger.warning(warning)
                except (OSError, ValueError) as error:  # refused, or a record rank 0 cannot read: every rank stops
                    choice[1] = str(error)
        dist.broadcast_object_list(choice, src=0, group=self.parallel.object_group)
        checkpoint, refusal = choice
        if refusal is not None:
            raise ResumeMismatch(refusal)
        return None if checkpoint is None else Path(checkpoint)

    def save_checkpoint(self, num_steps_done: int, batch: GlobalBatch) -> Path:
        """Every rank calls this after optimizer step ``num_steps_done − 1`` on ``batch``."""
        assert self.checkpointer is not None
        state = TrainState(num_steps_done=num_steps_done, data_position=batch.next_position)
        return self.checkpointer.save(module=self.module, optimizer=self.optimizer, state=state,
                                      identity=self.identity)

    def export(self, num_steps_done: int) -> Path:
        """Every rank calls this after optimizer step ``num_steps_done − 1``: the last step's model goes to
        ``--output-dir``, an earlier one (``--export-every``) to its ``step-<n>`` folder there."""
        assert self.config.output_dir is not None
        directory = (self.config.output_dir if num_steps_done == self.config.steps
                     else step_dir(self.config.output_dir, num_steps_done))
        export_model(self.module.lm, directory, tokenizer=self.export_tokenizer, model=self.config.model,
                     lora=self.lora, lora_export=self.config.export_lora)
        if self.parallel.is_main:
            logger.info("exported the model after step %d of %d to %s", num_steps_done, self.config.steps,
                        directory)
        return directory

    def gradients(self) -> dict[str, torch.Tensor]:
        """Every parameter's whole gradient by the model's own names (collective under FSDP: every rank calls)."""
        grads = {}
        for name, param in self.module.lm.named_parameters():
            grad = param.grad
            if grad is not None:
                grads[name] = grad.full_tensor() if isinstance(grad, DTensor) else grad
        return grads

    # ------------------------------------------------------------------------------------------------ compute

    def forward_backward(self, share: RankBatch) -> tuple[float, int]:
        """Accumulate this rank's gradients over its share of a global batch (its micro-batches iterated once, in
        order) and reduce them over all ranks; returns (global loss, loss tokens packed by all ranks).

        Every rank holds the same global batch, so each divides by its loss-token count without a collective first
        (appendix A); what the ranks actually packed is summed afterwards, for the caller to check against it.
        """
        packs, num_loss_tokens = share.micro_batches, share.num_loss_tokens
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        self.timer.start_step()
        num_packed_loss_tokens = num_padding = 0
        loop_started = time.perf_counter()
        for index, pack in enumerate(packs):
            num_packed_loss_tokens += pack.num_loss_tokens
            num_padding += pack.is_padding
            # Replicated: an idle micro-batch (no tokens, no collective) is skipped, no peer waits for this rank.
            # Under FSDP none is idle (padding stands in), so the last one is the last in the list.
            if pack.is_idle:
                continue
            prepare_micro_batch(self.module, sharding=self.sharding, is_last=index == len(packs) - 1)
            with self.timer.micro_batch(index, is_padding=pack.is_padding):
                loss_sum += run_micro_batch(self.module, pack, num_loss_tokens=num_loss_tokens,
                                            autocast_dtype=self.autocast_dtype,
                                            attention_backend=self.config.attention_backend).double()
        self.micro_batch_timings = self.timer.timings
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.micro_batch_time_s = max_over_ranks(time.perf_counter() - loop_started, self.device)
        packed = torch.tensor([num_packed_loss_tokens], dtype=torch.float64, device=self.device)
        dist.all_reduce(packed)
        # The loss and the padding count ride in the gradients' collective: [loss, padding micro-batches].
        totals = torch.cat([loss_sum.float().reshape(1), torch.tensor([float(num_padding)], device=self.device)])
        reduced = reduce_gradients(self.params, totals, sharding=self.sharding)
        self.num_padding_micro_batches = int(reduced[1].item())
        global_loss = float(reduced[0].item()) / max(num_loss_tokens, 1)
        return global_loss, int(packed.item())

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean token loss of ``--eval-data`` (``evaluation.py``): each batch planned and packed as a training
        batch, forward only; every rank calls this and gets the same figure."""
        assert self.eval_set is not None
        self.module.eval()
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        for batch in self.eval_set.batches:
            with self.batches.plan(batch) as share:
                for pack in share.micro_batches:
                    if not pack.is_idle:
                        loss_sum += micro_batch_loss(self.module, pack, autocast_dtype=self.autocast_dtype,
                                                     attention_backend=self.config.attention_backend).double()
        reshard(self.module)  # zero2 keeps gathered weights after a forward; the next step gathers afresh
        self.module.train()
        dist.all_reduce(loss_sum)
        return float(loss_sum.item()) / self.eval_set.num_loss_tokens

    # ------------------------------------------------------------------------------------------------ loop

    def train_step(self, step: int, batch: GlobalBatch) -> StepMetrics:
        """Train global batch ``step`` (0-based: the batch's index), which makes step number ``step + 1``
        (``StepMetrics.step``)."""
        started = time.perf_counter()
        next_batch = None  # rank 0 asks for its plan while this one trains
        if self.parallel.is_main and step + 1 < self.config.steps:
            next_batch = self._next_batch = self.source.batch(step + 1)
        with self.batches.plan(batch, prefetch=next_batch) as share:
            loss, num_loss_tokens = self.forward_backward(share)
        decision = share.decision
        assert num_loss_tokens == batch.num_loss_tokens, "packing lost or repeated loss tokens"
        grad_norm = clip_gradients(self.params, max_norm=self.config.max_grad_norm)
        lr = float(self.lr_schedule.get_last_lr()[0])
        self.optimizer.step()
        self.lr_schedule.step()
        step_time_s = time.perf_counter() - started
        peak, memory_kind = self.timer.step_peak_memory()
        assert decision.plan is not None
        if self.config.feedback:
            self.batches.report(batch, decision, self.micro_batch_timings)
        return StepMetrics(
            step=step + 1, loss=loss, tokens=batch.num_tokens, loss_tokens=num_loss_tokens, step_time_s=step_time_s,
            tokens_per_s=batch.num_tokens / step_time_s, plan_source=decision.origin.value,
            scheduler=decision.scheduler, estimated_time_ms=decision.estimated_time_ms,
            num_micro_batches=decision.plan.num_micro_batches, micro_batch_time_s=self.micro_batch_time_s,
            num_padding_micro_batches=self.num_padding_micro_batches,
            plan_fallbacks=self.batches.num_fallbacks, lr=lr, grad_norm=grad_norm,
            peak_memory_bytes=peak, memory_kind=memory_kind,
            epoch=self.source.epochs_done(batch.next_position) if isinstance(self.source, RecordSource) else None,
        )

    def batch(self, step: int) -> GlobalBatch:
        """Global batch ``step``, built once: rank 0 reuses the one it built for the prefetch."""
        cached, self._next_batch = self._next_batch, None
        if cached is not None and cached.step == step:
            return cached
        return self.source.batch(step)

    def train(self) -> list[StepMetrics]:
        """Train the steps from the first (0, or the resumed checkpoint's) to the last; every rank calls it. Steps
        are numbered as the checkpoints count them: step ``n`` is the ``n``-th optimizer step (1-based), after which
        ``n`` steps are done, in the logs, the metrics file, the trackers and ``step-<n>`` folders alike
        (``StepMetrics.step``)."""
        history = self.history
        config, is_main = self.config, self.parallel.is_main
        # A bar only where someone watches it: in a log file its carriage-return updates pile up.
        show_bar = is_main and config.progress and sys.stderr.isatty()
        # --logging-steps N: a line every N steps; by default every step where no bar shows them, none beside it.
        every_line = config.logging_steps if config.logging_steps is not None else (0 if show_bar else 1)
        bar = tqdm(total=config.steps, initial=self.first_step, desc=f"train {config.scheduler}", unit="step",
                   disable=not show_bar)
        every = config.checkpoint_every
        with bar, logging_redirect_tqdm() if show_bar else nullcontext(), graceful_stops():
            for index in range(self.first_step, config.steps):
                step = index + 1
                if (step, self.parallel.global_rank) == (config.fail_at_step, config.fail_rank):
                    raise InjectedFault(f"injected fault at step {step} (--fail-rank {config.fail_rank} "
                                        f"--fail-at-step {step})")
                batch = self.batch(index)
                metrics = self.train_step(index, batch)
                if self.eval_set is not None and ((config.eval_every and step % config.eval_every == 0)
                                                  or step == config.steps):
                    metrics = dataclasses.replace(metrics, eval_loss=self.evaluate())
                    if is_main:
                        logger.info("step %d: eval loss %.6f (train loss %.6f)", step, metrics.eval_loss,
                                    metrics.loss)
                self.lengths.add(batch)
                history.append(metrics)
                self.reports.write(metrics)
                if is_main and every_line and (step % every_line == 0 or step == config.steps):
                    logger.info("%s", self._step_line(metrics))
                saves = config.checkpoint_dir is not None and ((every and step % every == 0) or step == config.steps)
                if saves:
                    self.save_checkpoint(step, batch)
                if config.export_every and step % config.export_every == 0 and step < config.steps:
                    self.export(step)
                bar.set_postfix(loss=f"{metrics.loss:.4f}", tok_s=f"{metrics.tokens_per_s:.0f}",
                                plan=metrics.plan_source)
                bar.update()
                self.num_steps_done = step
                # A signal during the last step lets the run end as it would have.
                if step < config.steps and (signum := stop_agreed(self.parallel.object_group)) is not None:
                    raise self._stopped(signum, step, batch, saved=saves)
        if self.checkpointer is not None:
            self.checkpointer.wait()  # the last save, async, is complete when training is
        if self.config.output_dir is not None:
            self.export(self.config.steps)
        if self.parallel.is_main:
            logger.info("trained: %s", self.lengths.summary())
        self._trained = True
        return history

    def _stopped(self, signum: signal.Signals, step: int, batch: GlobalBatch, *, saved: bool) -> TrainingStopped:
        """Every rank at the boundary after step ``step``, where a rank got ``signum``: that step's checkpoint saved
        (``saved``: already) and complete, where the run saves any."""
        checkpoint = None
        if self.checkpointer is not None:
            checkpoint = step_dir(self.checkpointer.directory, step) if saved else self.save_checkpoint(step, batch)
            self.checkpointer.wait()  # an async save is complete before the run exits
        return TrainingStopped(signum, checkpoint=checkpoint)

    def _step_line(self, metrics: StepMetrics) -> str:
        """A step as ``--logging-steps`` logs it: ``step 10/100: loss 2.345678, lr 2.00e-05, 1234 tokens/s, plan
        service, epoch 0.25``."""
        fields = [f"loss {metrics.loss:.6f}", f"lr {metrics.lr:.2e}", f"{metrics.tokens_per_s:.0f} tokens/s",
                  f"plan {metrics.plan_source}"]
        if metrics.epoch is not None:
            fields.append(f"epoch {metrics.epoch:.2f}")
        if metrics.eval_loss is not None:
            fields.append(f"eval loss {metrics.eval_loss:.6f}")
        return f"step {metrics.step}/{self.config.steps}: {', '.join(fields)}"

    def close(self) -> None:
        """Close what the trainer opened, newest first and each once, also when closing one raises (its error is
        raised once the others are closed): the reports, which record the run as failed unless ``train`` ran to
        its end, the planner, the checkpointer."""
        self._resources.close()

