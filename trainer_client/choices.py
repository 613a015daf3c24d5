"""The closed sets and defaults the trainer's configuration names, without torch: ``config.TrainConfig`` declares its
fields with them, so that ``--help`` and a config's checks answer without importing torch or transformers (the
configuration is the bottom of the trainer; the modules that implement a choice read it from here).

``AttentionBackend``, ``LoraExport`` and ``DEFAULT_CHUNK_TOKENS`` are also defined by the modules that implement them
(``dacp.attention``, ``lora``, ``loss``), until those read them from here; ``tests/test_train_config.py`` holds the two
definitions equal.
"""

from __future__ import annotations

from enum import StrEnum

__all__ = ["DEFAULT_CHUNK_TOKENS", "DEFAULT_COLLECTIVE_TIMEOUT_S", "AttentionBackend", "FsdpUnits", "LRSchedulerName",
           "LoraExport", "LossOn"]

DEFAULT_COLLECTIVE_TIMEOUT_S = 600.0  # of every process group (distributed.py)
DEFAULT_CHUNK_TOKENS = 4096  # tokens per chunk of the LM head and cross-entropy (loss.py)


class AttentionBackend(StrEnum):
    """``--attention-backend``: the kernel of local attention (``dacp.attention``)."""

    AUTO = "auto"
    FLASH_ATTN = "flash_attn"
    TORCH_VARLEN = "torch_varlen"
    SDPA = "sdpa"


class FsdpUnits(StrEnum):
    """``--fsdp-units``: what FSDP2 shards as one unit (``parallelize.py``)."""

    LAYER = "layer"  # each decoder layer, and the root
    MODEL = "model"  # the whole model (zero2 only: its parameters stay gathered for the step anyway)


class LoraExport(StrEnum):
    """What ``--output-dir`` holds after a LoRA run: the merged model, or the adapter for its base model."""

    MERGED = "merged"
    ADAPTER = "adapter"


class LRSchedulerName(StrEnum):
    """``--lr-scheduler``: the default, then names of transformers' ``SchedulerType`` (written out: importing
    transformers' scheduler module imports its trainer's, and peft with it, a second of every process's start)."""

    WARMUP_COSINE = "warmup_cosine"
    LINEAR = "linear"
    COSINE = "cosine"
    COSINE_WITH_MIN_LR = "cosine_with_min_lr"
    CONSTANT_WITH_WARMUP = "constant_with_warmup"
    WARMUP_STABLE_DECAY = "warmup_stable_decay"

    @property
    def reads_min_lr_ratio(self) -> bool:
        """Whether ``--min-lr-ratio`` is this schedule's ``m``; ``linear`` and ``cosine`` end at 0 and
        ``constant_with_warmup`` holds ``lr``, whatever it is."""
        return self in (LRSchedulerName.WARMUP_COSINE, LRSchedulerName.COSINE_WITH_MIN_LR,
                        LRSchedulerName.WARMUP_STABLE_DECAY)


class LossOn(StrEnum):
    """``--loss-on``: which tokens of the records the trainer renders carry loss (``data.RecordEncoder``); TRL's
    ``assistant_only_loss`` is ``assistant``, its ``completion_only_loss`` ``completion``, neither ``all``."""

    ASSISTANT = "assistant"  # a chat's assistant turns; a prompt–completion record's completion
    COMPLETION = "completion"  # a chat's last assistant turn; a prompt–completion record's completion
    ALL = "all"  # every token, the template's markup and the prompts included
