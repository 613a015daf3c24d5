"""The closed sets and defaults the trainer's configuration names, without torch: ``config.TrainConfig`` declares its
fields with them, so that ``--help`` and a config's checks answer without importing torch or transformers (the
configuration is the bottom of the trainer; the modules that implement a choice read it from here).

The defaults of the plan client and the data's names (``DEFAULT_PLAN_*``, ``SYNTHETIC_PREFIX``, ``CHAT_TEMPLATES``)
and the trackers (``Tracker``) live here, and their modules read them from here.
``AttentionBackend``, ``LoraExport`` and ``DEFAULT_CHUNK_TOKENS`` are also defined by the modules that implement them
(``dacp.attention``, ``lora``, ``loss``), until those read them from here; ``tests/test_train_config.py`` holds the two
definitions equal.
"""

from __future__ import annotations

import importlib.util
from enum import StrEnum
from pathlib import Path

__all__ = ["CHAT_TEMPLATES", "DEFAULT_CHUNK_TOKENS", "DEFAULT_COLLECTIVE_TIMEOUT_S", "DEFAULT_PLAN_ATTEMPTS",
           "DEFAULT_PLAN_TIMEOUT_S", "SYNTHETIC_DATASETS", "SYNTHETIC_PREFIX", "AttentionBackend", "FsdpUnits",
           "LRSchedulerName", "LoraExport", "LossOn", "Tracker", "chat_template_of", "check_installed"]

DEFAULT_COLLECTIVE_TIMEOUT_S = 600.0  # of every process group (distributed/)
DEFAULT_CHUNK_TOKENS = 4096  # tokens per chunk of the LM head and cross-entropy (loss.py)
DEFAULT_PLAN_TIMEOUT_S = 5.0  # per POST /plan attempt (planning/client.py)
DEFAULT_PLAN_ATTEMPTS = 3  # before the embedded planner plans the batch (planning/source.py)
SYNTHETIC_PREFIX = "synthetic:"  # --data synthetic:DATASET: lengths drawn from a built-in sampler (data/sources.py)
# The samplers' names (``scheduler_service.core.samplers.DATASETS``, which loads numpy), for ``--help`` to list without
# loading it; a test holds the two equal.
SYNTHETIC_DATASETS = ("wikipedia", "lmsys", "chatqa2", "longtail64k", "docmix")

# --chat-template NAME: templates known by name (a file's Jinja otherwise). ChatML, as Qwen's and many others' chats
# are written; its markers are tokens of their tokenizers, and plain text of any other.
CHAT_TEMPLATES = {
    "chatml": ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] "
               "+ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
               "{% endif %}"),
}


def chat_template_of(spec: str) -> str:
    """``--chat-template``: a template known by name (``CHAT_TEMPLATES``), or the Jinja text of a file."""
    if spec in CHAT_TEMPLATES:
        return CHAT_TEMPLATES[spec]
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"--chat-template {spec!r} is neither a file of Jinja nor a template known by name "
                         f"({', '.join(CHAT_TEMPLATES)})")
    return path.read_text()


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


class Tracker(StrEnum):
    """An experiment tracker ``--report-to`` can name (``reporting.py``). Its value is also the module it imports
    and the extra that installs it (the ``mlflow`` extra installs mlflow-skinny, whose module is ``mlflow``)."""

    TENSORBOARD = "tensorboard"
    WANDB = "wandb"
    MLFLOW = "mlflow"


def check_installed(tracker: Tracker) -> None:
    """Raise ``ValueError`` naming the extra to install unless ``tracker``'s package can be imported; it looks the
    package up without importing it, so a config check costs nothing."""
    if importlib.util.find_spec(tracker.value) is None:
        raise ValueError(f"--report-to {tracker} needs the {tracker} package, which is not installed: "
                         f"pip install 'skrull[{tracker}]'")
