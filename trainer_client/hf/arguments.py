"""Skrull's settings for a Hugging Face Trainer: the few a Trainer's own arguments have no name for.

Everything else comes from the Trainer's ``TrainingArguments`` (or TRL's ``SFTConfig``): the learning rate, the
schedule, checkpoints, logging, ``report_to``, FSDP. Three of its fields change meaning under Skrull, and
``layout.trainer_layout`` says how at start: ``per_device_train_batch_size × gradient_accumulation_steps × dp`` is
the global batch (× dp × cp with ``batch_per_process``; unless ``global_batch`` here gives it), a micro-batch holds
``bucket_size`` tokens per CP rank rather than a number of sequences, and the plan, not the sampler, balances lengths.
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler_service.core.choices import SchedulerName
from trainer_client.config_choices import DEFAULT_PLAN_ATTEMPTS, DEFAULT_PLAN_TIMEOUT_S, AttentionBackend

__all__ = ["SkrullArguments"]


@dataclass(frozen=True, kw_only=True, slots=True)
class SkrullArguments:
    """How the processes split into DP × CP, what one micro-batch holds, and who plans.

    ``bucket_size``: the tokens one CP rank may hold in a micro-batch, what its memory allows (the Trainer's
    ``per_device_train_batch_size`` counted sequences; Skrull counts tokens). ``cp``: the context-parallel degree;
    the world of ``torchrun``'s processes is ``dp × cp``, so ``cp`` must divide it. ``global_batch``: the sequences of
    one optimizer step, whichever ranks train them; None takes the Trainer's own total,
    ``per_device_train_batch_size × gradient_accumulation_steps × dp``, so that a script keeps its optimizer steps.
    ``batch_per_process``: count ``per_device_train_batch_size`` per process rather than per DP rank, so that the
    global batch, ``per_device_train_batch_size × gradient_accumulation_steps × dp × cp``, stays the same when only
    ``cp`` changes (by default a CP group's ``cp`` processes share one DP rank's count, as transformers counts under
    its own context parallelism, and the same settings train half the sequences at twice the ``cp``).
    ``scheduler``: the planner (``skrull``, or a baseline to compare with). ``scheduler_url``: the scheduler service,
    asked over HTTP with ``plan_timeout_s`` per request and ``plan_attempts`` tries; without it, or whenever it fails,
    the embedded planner plans the same plans. ``profile``: the hardware profile the planner costs sequences with (a
    shipped name or a file; None: the default). ``spanning``: plans may run a micro-batch over several DP replicas.
    ``schemes``: the planner gives each collective all-gather-KV, Ulysses or 2D, whichever it prices faster (False:
    all-gather-KV everywhere, the trainer's ``--no-schemes``).
    ``attention_backend``: DACP's local kernel (``auto`` picks flash-attn or torch's varlen kernel on CUDA, SDPA on
    CPU).
    """

    bucket_size: int
    cp: int = 1
    global_batch: int | None = None
    batch_per_process: bool = False
    scheduler: str = SchedulerName.SKRULL.value
    scheduler_url: str | None = None
    profile: str | None = None
    spanning: bool = True
    schemes: bool = True
    attention_backend: str = AttentionBackend.AUTO.value
    plan_timeout_s: float = DEFAULT_PLAN_TIMEOUT_S
    plan_attempts: int = DEFAULT_PLAN_ATTEMPTS

    def __post_init__(self) -> None:
        for name in ("bucket_size", "cp", "plan_attempts"):
            if getattr(self, name) < 1:
                raise ValueError(f"SkrullArguments.{name} must be at least 1, got {getattr(self, name)}")
        if self.global_batch is not None and self.global_batch < 1:
            raise ValueError(f"SkrullArguments.global_batch must be at least 1, got {self.global_batch}")
        if self.plan_timeout_s <= 0:
            raise ValueError(f"SkrullArguments.plan_timeout_s must be positive, got {self.plan_timeout_s}")
        for name, choices in (("scheduler", SchedulerName), ("attention_backend", AttentionBackend)):
            value = getattr(self, name)
            if value not in set(choices):
                raise ValueError(f"SkrullArguments.{name} {value!r} is unknown; known: "
                                 f"{', '.join(choice.value for choice in choices)}")
