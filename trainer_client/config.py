"""The trainer's configuration (``TrainConfig``), checked on construction: every flag of ``train.py`` with the
rule it must satisfy, so that a bad combination fails before any process group or model is built. A flag with a
closed set of values holds its enum (a string given for it is converted, or refused naming the flag and the
values it takes)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import TypeVar

from pydantic import TypeAdapter, ValidationError
from skrull_proto.models import JobId

from scheduler_service.core.plan import SchedulerName
from trainer_client.dacp.attention import AttentionBackend
from trainer_client.data import SYNTHETIC_PREFIX
from trainer_client.distributed import DEFAULT_COLLECTIVE_TIMEOUT_S, ParallelDims
from trainer_client.lora import LORA_TARGETS, LoraExport, LoraSettings
from trainer_client.loss import DEFAULT_CHUNK_TOKENS
from trainer_client.parallelize import ActivationCheckpointing, Sharding, check_compile_layout
from trainer_client.plan_client import DEFAULT_PLAN_ATTEMPTS, DEFAULT_PLAN_TIMEOUT_S

__all__ = ["TrainConfig", "check_output_dir"]

_JOB_ID: TypeAdapter[str] = TypeAdapter(JobId)


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    """One training run: a field per ``train.py`` flag (``--plan-timeout`` → ``plan_timeout_s``)."""

    dp: int
    cp: int
    model: str = "tiny"
    data: str = "synthetic:lmsys"
    global_batch: int = 16
    steps: int = 20
    epochs: int | None = None  # train every record this many times (a record source): sets ``steps``
    shuffle: bool = True  # a record source's epochs in a seeded order, another each epoch
    scheduler: SchedulerName = SchedulerName.SKRULL
    scheduler_url: str | None = None
    bucket_size: int | None = None
    profile: str | None = None  # auto, a profile name, or a profile file; None: auto on CUDA, the planner's on CPU
    seed: int = 0
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1  # the cosine ends at lr × this at the last step
    max_grad_norm: float = 1.0  # 0: no clipping (the norm is still reported)
    sharding: Sharding = Sharding.ZERO2
    activation_checkpointing: ActivationCheckpointing = ActivationCheckpointing.NONE
    loss_chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    compile: bool = False  # torch.compile each decoder layer (parallelize.apply_compile)
    checkpoint_dir: Path | None = None
    checkpoint_every: int = 0  # steps between checkpoints; 0: only after the last step (with --checkpoint-dir)
    resume: bool = False  # continue from the latest checkpoint in checkpoint_dir, if there is one
    resume_accept_data_change: bool = False  # resume although --data differs from the checkpoint's
    output_dir: Path | None = None  # the trained model as a Hugging Face folder, after the last step (export.py)
    export_every: int | None = None  # steps between earlier exports, into output_dir/step-<n>
    eval_data: str | None = None  # a held-out JSONL file or datasets directory, evaluated as training is planned
    eval_every: int = 0  # steps between evaluations; 0: after the last step only (with eval_data)
    lora_rank: int | None = None  # train LoRA adapters of this rank on a frozen model (lora.py)
    lora_alpha: int | None = None  # adapters scaled by alpha / rank; default 2 × rank
    lora_targets: tuple[str, ...] = LORA_TARGETS
    export_lora: LoraExport = LoraExport.MERGED  # what --output-dir holds after a LoRA run
    tensorboard_dir: Path | None = None  # the step metrics as TensorBoard scalars, written by rank 0
    collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S
    max_length: int | None = None
    truncate: bool = False
    tokenizer: str | None = None  # a local tokenizer directory, for text and chat records
    metrics_out: Path | None = None
    plan_timeout_s: float = DEFAULT_PLAN_TIMEOUT_S
    plan_attempts: int = DEFAULT_PLAN_ATTEMPTS
    attention_backend: AttentionBackend = AttentionBackend.AUTO
    dtype: str | None = None  # float32 | bfloat16; default float32 on CPU, bfloat16 autocast on CUDA
    progress: bool = True
    feedback: bool = False  # report measured micro-batch times and peak memory to the service
    job_id: str | None = None  # names this run for the service's feedback; random when absent
    # Fault injection (tests of failure handling): this global rank raises InjectedFault at the start of this step.
    fail_rank: int | None = None
    fail_at_step: int | None = None

    def __post_init__(self) -> None:
        for name, enum, flag in _CHOICES:
            object.__setattr__(self, name, _choice(enum, getattr(self, name), flag))
        ParallelDims(dp_size=self.dp, cp_size=self.cp)
        if self.global_batch < 1:
            raise ValueError(f"--global-batch must be positive, got {self.global_batch}")
        if self.steps < 1:
            raise ValueError(f"--steps must be positive, got {self.steps}")
        if self.epochs is not None and self.epochs < 1:
            raise ValueError(f"--epochs must be positive, got {self.epochs}")
        if self.epochs is not None and self.data.startswith(SYNTHETIC_PREFIX):
            raise ValueError(f"--epochs needs a JSONL file or a datasets directory; --data {self.data} has no end: "
                             "give --steps")
        if self.bucket_size is not None and self.bucket_size < 1:
            raise ValueError(f"--bucket-size must be positive, got {self.bucket_size}")
        if self.max_length is not None and self.max_length < 1:
            raise ValueError(f"--max-length must be positive, got {self.max_length}")
        if self.scheduler_url is not None and not self.scheduler_url.startswith(("http://", "https://")):
            raise ValueError(f"--scheduler-url {self.scheduler_url!r} must start with http:// or https://")
        if self.lr <= 0:
            raise ValueError(f"--lr must be positive, got {self.lr}")
        if self.warmup_steps < 0:
            raise ValueError(f"--warmup-steps must not be negative, got {self.warmup_steps}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"--min-lr-ratio must lie in [0, 1], got {self.min_lr_ratio}")
        if self.max_grad_norm < 0:
            raise ValueError(f"--max-grad-norm must not be negative, got {self.max_grad_norm}")
        if self.compile:
            check_compile_layout(self.activation_checkpointing)
        if self.loss_chunk_tokens < 1:
            raise ValueError(f"--loss-chunk-tokens must be positive, got {self.loss_chunk_tokens}")
        if self.checkpoint_every < 0:
            raise ValueError(f"--checkpoint-every must not be negative, got {self.checkpoint_every}")
        if (self.checkpoint_every or self.resume) and self.checkpoint_dir is None:
            raise ValueError("--checkpoint-every and --resume need --checkpoint-dir")
        if self.resume_accept_data_change and not self.resume:
            raise ValueError("--resume-accept-data-change goes with --resume")
        if self.export_every is not None:
            if self.output_dir is None:
                raise ValueError("--export-every needs --output-dir")
            if self.export_every < 1:
                raise ValueError(f"--export-every must be positive, got {self.export_every}")
        if self.output_dir is not None:
            check_output_dir(self.output_dir, flag="--output-dir")
            if self.checkpoint_dir is not None and self.output_dir.resolve() == self.checkpoint_dir.resolve():
                raise ValueError(f"--output-dir and --checkpoint-dir are both {self.output_dir}: both write "
                                 "step-<n> folders, so give each its own")
        if self.eval_data is not None and self.eval_data.startswith(SYNTHETIC_PREFIX):
            raise ValueError(f"--eval-data {self.eval_data} is synthetic; evaluation needs held-out records: a JSONL "
                             "file or a datasets directory")
        if self.eval_every < 0:
            raise ValueError(f"--eval-every must not be negative, got {self.eval_every}")
        if self.eval_every and self.eval_data is None:
            raise ValueError("--eval-every needs --eval-data")
        lora = self.lora  # LoraSettings checks --lora-rank, --lora-alpha and --lora-targets
        if lora is None and (self.lora_alpha is not None or self.lora_targets != LORA_TARGETS):
            raise ValueError("--lora-alpha and --lora-targets go with --lora-rank")
        if self.export_lora is LoraExport.ADAPTER:
            if lora is None or self.output_dir is None:
                raise ValueError("--export-lora adapter needs --lora-rank and --output-dir")
            if not Path(self.model).is_dir():
                raise ValueError(f"--export-lora adapter writes an adapter for the base model folder it was trained "
                                 f"on, and --model {self.model} is a built-in random-init model: give --model a "
                                 "local checkpoint folder, or export the merged model")
        if self.collective_timeout_s <= 0:
            raise ValueError(f"--collective-timeout must be positive, got {self.collective_timeout_s}")
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
        if (self.fail_rank is None) != (self.fail_at_step is None):
            raise ValueError("--fail-rank and --fail-at-step go together")
        if self.fail_rank is not None and not 0 <= self.fail_rank < self.dp * self.cp:
            raise ValueError(f"--fail-rank {self.fail_rank} is not a global rank of dp {self.dp} × cp {self.cp}")

    @property
    def lora(self) -> LoraSettings | None:
        if self.lora_rank is None:
            return None
        alpha = self.lora_alpha if self.lora_alpha is not None else 2 * self.lora_rank
        return LoraSettings(rank=self.lora_rank, alpha=alpha, targets=self.lora_targets)

    @property
    def dims(self) -> ParallelDims:
        return ParallelDims(dp_size=self.dp, cp_size=self.cp)


Choice = TypeVar("Choice", bound=StrEnum)
_CHOICES: tuple[tuple[str, type[StrEnum], str], ...] = (
    ("scheduler", SchedulerName, "--scheduler"), ("sharding", Sharding, "--sharding"),
    ("activation_checkpointing", ActivationCheckpointing, "--activation-checkpointing"),
    ("export_lora", LoraExport, "--export-lora"), ("attention_backend", AttentionBackend, "--attention-backend"),
)


def _choice(enum: type[Choice], value: str, flag: str) -> Choice:
    try:
        return enum(value)
    except ValueError:
        raise ValueError(f"{flag} {value!r} is unknown; known: {', '.join(enum)}") from None


def check_output_dir(path: Path, *, flag: str) -> None:
    """Raise ``ValueError`` naming ``flag`` unless ``path`` is a writable folder or can be made one in a writable
    folder: checked before any work, so that a run does not train for hours to fail writing its result."""
    if path.exists():
        if not path.is_dir():
            raise ValueError(f"{flag} {path} is not a directory")
        target = path
    else:
        target = path.parent
        if not target.is_dir():
            raise ValueError(f"{flag} {path}: its parent directory {target} does not exist")
    if not os.access(target, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path}: {target} is not writable")
