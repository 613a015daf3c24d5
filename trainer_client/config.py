"""The trainer's configuration, declared once: ``TrainConfig``, a frozen pydantic model of one training run, from
which the command line (``flags.py``) and the config file (``config_file.py``) both come.

- **Checks.** A field's own rule is declared on the field (``Annotated[int, Positive]``); the rules across fields
  are ``TrainConfig._check_combination``. Both run on construction, so a bad run fails before any process group
  or model is built. A closed set of values is a ``StrEnum`` field: a string given for it is converted, or refused
  with the values it takes.
- **Flags.** A field's flag is ``--field-name`` unless the field's ``Flag`` spells it otherwise (``plan_timeout_s``
  is ``--plan-timeout``); the spellings are here (``FLAGS``), since the errors name them, and ``flags.py`` makes
  the parser of them.

Errors are ``ConfigError`` (a ``ValueError``), one line naming each wrong value where it was given: by its flag
(``--lora-rank must be positive, got 0``), or by its key in the file (``run.yaml: lora_rank: must be positive,
got 0``); an unknown key is named with the closest known one. A rule across fields names the flags, and the keys
the file gave them.

The configuration is plain values: it imports no torch, transformers or implementation module at import
(``config_choices`` holds the closed sets it names), so ``--help`` and config checks answer at once. The layers above
build their objects of it (``ParallelDims.of``, ``LoraSettings.of``); the one check an implementation module makes
(``--compile``'s layout) imports it when the value is given.
"""

from __future__ import annotations

import difflib
import functools
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, TypeVar, Union, get_args, get_origin

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    model_validator,
)
from pydantic_core import ErrorDetails

from scheduler_service.core.choices import MAX_TOKEN_BUCKETS, SchedulerName
from scheduler_service.core.memory import LORA_TARGETS, ActivationCheckpointing, Sharding
from scheduler_service.core.models import MODEL_CATALOGUE
from trainer_client.config_choices import (
    CHAT_TEMPLATES,
    DEFAULT_CHUNK_TOKENS,
    DEFAULT_COLLECTIVE_TIMEOUT_S,
    DEFAULT_PLAN_ATTEMPTS,
    DEFAULT_PLAN_TIMEOUT_S,
    SYNTHETIC_PREFIX,
    AttentionBackend,
    FsdpUnits,
    LoraExport,
    LossOn,
    LRSchedulerName,
    Tracker,
    chat_template_of,
    check_installed,
)
from trainer_client.foreign_keys import FOREIGN_KEYS

__all__ = ["FLAGS", "ConfigError", "Flag", "Origin", "TrainConfig", "check_lora_projections", "check_output_dir"]

DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True, kw_only=True, slots=True)
class Flag:
    """How a field appears on the command line, where it is not ``--field-name`` taking a value."""

    name: str | None = None  # the flag's spelling: --plan-timeout for plan_timeout_s
    exclusive: str | None = None  # fields sharing this name are given at most one at a time (--steps, --epochs)
    metavar: str | None = None
    choices: tuple[str, ...] | None = None  # a str field's values (an enum field offers its own)


# ---- a field's own rules: messages follow the flag or the file's key that names the value ----------------------------

Number = TypeVar("Number", int, float)
Choice = TypeVar("Choice", bound=StrEnum)


def _positive(value: Number) -> Number:
    if value <= 0:
        raise ValueError(f"must be positive, got {value}")
    return value


def _non_negative(value: Number) -> Number:
    if value < 0:
        raise ValueError(f"must not be negative, got {value}")
    return value


def _fraction(value: float) -> float:
    if not 0 <= value <= 1:
        raise ValueError(f"must lie in [0, 1], got {value}")
    return value


def _member(enum: type[Choice], value: object) -> Choice:
    try:
        return enum(value if isinstance(value, str) else repr(value))  # a StrEnum member is its str value
    except ValueError:
        raise ValueError(f"{value!r} is unknown; known: {', '.join(enum)}") from None


def _one_of(enum: type[StrEnum]) -> BeforeValidator:
    """The value of a closed set, refused naming the values it takes."""
    return BeforeValidator(lambda value: _member(enum, value))


def _listed(value: object) -> object:
    """A list given as one string: its comma-separated items (``report_to: tensorboard``, ``lora_targets:
    q_proj,v_proj``)."""
    return tuple(item.strip() for item in value.split(",") if item.strip()) if isinstance(value, str) else value


def _trackers(names: object) -> object:
    """Each tracker once, in the order first named; one name alone is a list of it, and ``none`` (transformers'
    ``report_to``) no tracker."""
    names = _listed(names)
    if not isinstance(names, Iterable):
        return names  # not a sequence: refused as the field's type
    if list(names) == ["none"]:
        return ()
    return tuple(dict.fromkeys(_member(Tracker, name) for name in names))


def _projections(targets: object) -> object:
    """``lora_targets`` as a list; peft's ``all-linear`` is every projection of a decoder layer."""
    return LORA_TARGETS if targets == "all-linear" else _listed(targets)


def _http_url(url: str) -> str:
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"{url!r} must start with http:// or https://")
    return url


def _held_out(source: str) -> str:
    if source.startswith(SYNTHETIC_PREFIX):
        raise ValueError(f"{source} is synthetic; evaluation needs held-out records: a data file, a dataset folder "
                         "or a Hub data set")
    return source


def _chat_template(spec: str) -> str:
    chat_template_of(spec)  # a known name, or a file that exists
    return spec


def _dtype(name: str) -> str:
    if name not in DTYPES:
        raise ValueError(f"must be {' or '.join(DTYPES)}, got {name!r}")
    return name


@functools.cache
def _job_id_rule() -> TypeAdapter[str]:
    """The wire contract's job id, imported at the first one checked: the contract's models take 0.2 s to build,
    which ``--help`` and a run without ``--job-id`` need not pay."""
    from skrull_proto.models import JobId

    return TypeAdapter(JobId)


def _job_id(job_id: str) -> str:
    try:
        return _job_id_rule().validate_python(job_id)
    except ValidationError:
        raise ValueError(f"{job_id!r} is not a valid job id: 1 to 128 characters, letters, digits and . _ : - only, "
                         "starting with a letter or digit") from None


Positive = AfterValidator(_positive)
NonNegative = AfterValidator(_non_negative)


class TrainConfig(BaseModel):
    """One training run: a field per ``train.py`` flag, and a key per field in a ``--config`` file."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    dp: Annotated[int, Positive] = Field(description="data-parallel degree (required, here or in --config)")
    cp: Annotated[int, Positive] = Field(description="context-parallel degree (required, here or in --config)")
    model: str = Field("tiny", description="a built-in model name, a Hugging Face model folder, or a Hub id "
                                           "ORG/NAME[@REVISION]")
    data: str = Field("synthetic:lmsys", description="records of input_ids, messages, conversations, "
                                                     "prompt/completion or text; default synthetic:lmsys")
    tokenizer: str | None = Field(None, description="for chats, prompt/completion and text: a folder or Hub id "
                                                    "(skrull-tokenizer DIR makes one offline)")
    loss_on: Annotated[LossOn, _one_of(LossOn)] = Field(
        LossOn.ASSISTANT, description="which tokens train: assistant (every answer), completion (the last) or all")
    chat_template: Annotated[str, AfterValidator(_chat_template)] | None = Field(
        None, description=f"render chats with this template instead of the tokenizer's: a name "
                          f"({', '.join(CHAT_TEMPLATES)}) or a file of Jinja")
    text_field: str = Field("text", description="the key of a plain-text record")
    global_batch: Annotated[int, Positive] = Field(16, description="sequences per global batch")
    steps: Annotated[int, Positive, Flag(exclusive="length")] = Field(
        20, description="optimizer steps (one per global batch)")
    epochs: Annotated[float, Positive, Flag(exclusive="length")] | None = Field(
        None, description="train every record this many times instead of --steps (records, not synthetic data)")
    shuffle: bool = Field(True, description="train each epoch's records in a permutation seeded by --seed (the "
                                            "default); --no-shuffle: in file order")
    scheduler: Annotated[SchedulerName, _one_of(SchedulerName)] = Field(
        SchedulerName.SKRULL, description="the planner of each global batch")
    scheduler_url: Annotated[str, AfterValidator(_http_url)] | None = Field(
        None, description="the scheduler service's URL; absent: plan with the embedded planner")
    spanning: bool = Field(True, description="plans may run a micro-batch over several DP replicas (the default); "
                                             "--no-spanning: within one")
    schemes: bool = Field(True, description="each collective's scheme the fastest (the default); --no-schemes: "
                                            "all-gather-KV everywhere")
    bucket_size: Annotated[int, Positive] | None = Field(
        None, description="tokens per CP rank per micro-batch (default: from profile)")
    profile: str | None = Field(None, description="hardware profile: auto (measured at start), a name or a file; "
                                                  "default: auto on CUDA, the planner's on CPU")
    seed: int = Field(0, description="seeds the model's initialisation, synthetic data and the records' order")
    lr: Annotated[float, Positive] = Field(1e-3, description="the peak learning rate (AdamW)")
    weight_decay: float = Field(0.0, description="AdamW's weight decay")
    lr_scheduler: Annotated[LRSchedulerName, _one_of(LRSchedulerName)] = Field(
        LRSchedulerName.WARMUP_COSINE,
        description="warmup_cosine (the default): after warmup, a cosine to lr × --min-lr-ratio; others: "
                    "transformers'")
    warmup_steps: Annotated[int, NonNegative] = Field(0, description="steps of linear warmup at the start")
    min_lr_ratio: Annotated[float, AfterValidator(_fraction)] = Field(
        0.1, description="warmup_cosine, cosine_with_min_lr and warmup_stable_decay end at lr × this")
    max_grad_norm: Annotated[float, NonNegative] = Field(1.0, description="clip the global gradient norm; 0: off "
                                                                          "(the norm is still reported)")
    sharding: Annotated[Sharding, _one_of(Sharding)] = Field(
        Sharding.ZERO2, description="FSDP2 over all ranks: zero2, zero3 (reshards after each forward) or none "
                                    "(replicated)")
    activation_checkpointing: Annotated[ActivationCheckpointing, _one_of(ActivationCheckpointing)] = Field(
        ActivationCheckpointing.NONE, description="per decoder layer: selective recomputes the MLP, full the whole "
                                                  "layer")
    compile: bool = Field(False, description="torch.compile each decoder layer: fewer, fused kernels; the first "
                                             "steps pay the compilation")
    cuda_graphs: bool = Field(False, description="replay each layer as CUDA graphs per token bucket; needs CUDA, "
                                                 "--cp 1 and --sharding none")
    token_buckets: Annotated[int, NonNegative] | None = Field(
        None, description="pad rows to the smallest of N buckets (BucketSize and its halves); default: 4 with "
                          "--cuda-graphs, else 0")
    fsdp_units: Annotated[FsdpUnits, _one_of(FsdpUnits)] | None = Field(
        None, description="what FSDP2 shards as one unit: each layer, or the model (zero2 only); default: model "
                          "where it fits")
    loss_chunk_tokens: Annotated[int, Positive] = Field(
        DEFAULT_CHUNK_TOKENS, description="tokens per chunk of the LM head and loss (bounds the fp32 logits held)")
    checkpoint_dir: Path | None = Field(None, description="save DCP checkpoints here")
    checkpoint_every: Annotated[int, NonNegative] = Field(
        0, description="steps between checkpoints (0: after the last step only)")
    keep_last: Annotated[int, Positive] | None = Field(
        None, description="keep the N newest complete checkpoints (default: keep all)")
    async_checkpoint: bool = Field(False, description="write checkpoints in the background (dcp.async_save)")
    resume: bool = Field(False, description="continue from the newest complete checkpoint in --checkpoint-dir (same "
                                            "model, layout, data and seed)")
    resume_accept_data_change: bool = Field(
        False, description="with --resume: continue a checkpoint trained on other --data from its data position")
    output_dir: Path | None = Field(None, description="after the last step, write the model here as a Hugging Face "
                                                      "folder (with the --tokenizer)")
    export_every: Annotated[int, Positive] | None = Field(
        None, description="also export every N steps, into OUTPUT_DIR/step-N; needs --output-dir")
    export_lora: Annotated[LoraExport, _one_of(LoraExport)] = Field(
        LoraExport.MERGED, description="after a LoRA run: the model with the adapters merged, or the adapter alone")
    eval_data: Annotated[str, AfterValidator(_held_out)] | None = Field(
        None, description="held-out records, as --data takes them but synthetic (ORG/NAME:test: a Hub set's split)")
    eval_every: Annotated[int, NonNegative] = Field(
        0, description="steps between evaluations (0: after the last step only)")
    lora_rank: Annotated[int, Positive] | None = Field(
        None, description="the adapters' rank; absent: full fine-tuning")
    lora_alpha: Annotated[int, Positive] | None = Field(
        None, description="scale the adapters by alpha / rank (default: 2 × rank)")
    lora_targets: Annotated[tuple[str, ...], BeforeValidator(_projections)] = Field(
        LORA_TARGETS, description="comma-separated projections of each layer to adapt (default: all-linear, every "
                                  "one)")
    report_to: Annotated[tuple[Tracker, ...], BeforeValidator(_trackers),
                         Flag(metavar="TRACKER[,TRACKER...]")] = Field(
        (), description=f"comma-separated: {', '.join(Tracker)}; each needs its extra (pip install "
                        "'skrull[wandb]')")
    logging_dir: Path | None = Field(
        None, description="TensorBoard's and W&B's folder (default: runs/JOB_ID, the job id as --job-id says)")
    collective_timeout_s: Annotated[float, Positive, Flag(name="--collective-timeout")] = Field(
        DEFAULT_COLLECTIVE_TIMEOUT_S, description="seconds a collective may wait for a peer")
    max_length: Annotated[int, Positive] | None = Field(
        None, description="longest record accepted (default: bucket_size × cp)")
    truncate: bool = Field(False, description="cut records longer than --max-length")
    skip_bad_records: bool = Field(
        False, description="leave out the records that cannot train, listed in --checkpoint-dir, instead of stopping")
    metrics_out: Path | None = Field(None, description="write one JSON line of metrics per step here")
    plan_timeout_s: Annotated[float, Positive, Flag(name="--plan-timeout")] = Field(
        DEFAULT_PLAN_TIMEOUT_S, description="seconds per POST /plan attempt")
    plan_attempts: Annotated[int, Positive] = Field(DEFAULT_PLAN_ATTEMPTS,
                                                    description="POST /plan attempts before the embedded planner "
                                                                "plans")
    attention_backend: Annotated[AttentionBackend, _one_of(AttentionBackend)] = Field(
        AttentionBackend.AUTO, description="auto: flash-attn or torch's varlen on CUDA in bf16 or fp16, else SDPA")
    dtype: Annotated[str, AfterValidator(_dtype), Flag(choices=DTYPES)] | None = Field(
        None, description="default: float32 on CPU, bfloat16 on CUDA")
    progress: bool = Field(True, description="a progress bar on rank 0 where stderr is a terminal (the default); "
                                             "--no-progress: none")
    logging_steps: Annotated[int, NonNegative] | None = Field(
        None, description="log a line every N steps on rank 0; 0: none (default: every step where no bar shows)")
    debug: bool = Field(False, description="print a user error's traceback, and every rank's log (by default rank "
                                           "0's alone)")
    feedback: bool = Field(False, description="report measured micro-batch times to the service, which refits the "
                                              "job's profile")
    job_id: Annotated[str, AfterValidator(_job_id)] | None = Field(
        None, description="the runs' name (default: --checkpoint-dir's name, else the model's and the data's, "
                          "and the start time)")
    fail_rank: int | None = Field(
        None, description="the global rank that raises InjectedFault")
    fail_at_step: int | None = Field(
        None, description="the step (1-based, as checkpoints count them) at whose start it raises")

    def __init__(self, **values: Any) -> None:
        """Validate ``values``; a refusal is a ``ConfigError`` naming each wrong value by its flag (pydantic's own
        message would name the field, in several lines)."""
        try:
            super().__init__(**values)
        except ValidationError as error:
            raise ConfigError(error.errors()) from None

    @model_validator(mode="after")
    def _check_combination(self) -> TrainConfig:
        """The rules across fields, each message naming the flags it concerns; run once every field is valid."""
        for tracker in self.report_to:
            check_installed(tracker)  # on every rank, before any process group: all stop with the same error
        if self.logging_dir is not None and not self.report_to:
            raise ValueError("--logging-dir goes with --report-to")
        if self.logging_dir is not None and not {Tracker.TENSORBOARD, Tracker.WANDB} & set(self.report_to):
            raise ValueError("--logging-dir is TensorBoard's and W&B's folder, and --report-to mlflow has neither: "
                             "MLflow writes to its tracking URI (MLFLOW_TRACKING_URI), so leave --logging-dir out")
        if self.epochs is not None and "steps" in self.model_fields_set:
            raise ValueError("--steps and --epochs exclude each other: give one")
        if self.epochs is not None and self.data.startswith(SYNTHETIC_PREFIX):
            raise ValueError(f"--epochs needs records (a data file, a dataset folder or a Hub data set); --data "
                             f"{self.data} has no end: give --steps")
        if "min_lr_ratio" in self.model_fields_set and not self.lr_scheduler.reads_min_lr_ratio:
            readers = [str(name) for name in LRSchedulerName if name.reads_min_lr_ratio]
            raise ValueError(f"--lr-scheduler {self.lr_scheduler} does not read --min-lr-ratio (only "
                             f"{', '.join(readers)} do): leave it out, or choose one of those")
        if self.compile or self.cuda_graphs:
            from trainer_client.models.parallelize import check_compile_layout

            check_compile_layout(self.activation_checkpointing)
        if self.token_buckets is not None and self.token_buckets > MAX_TOKEN_BUCKETS:
            raise ValueError(f"--token-buckets is at most {MAX_TOKEN_BUCKETS} (BucketSize down to 1/"
                             f"{2 ** (MAX_TOKEN_BUCKETS - 1)} of it), got {self.token_buckets}")
        if self.cuda_graphs and self.token_buckets == 0:
            raise ValueError("--cuda-graphs captures graphs per token bucket: give --token-buckets 1 or more (or "
                             "leave it out: 4)")
        if self.fsdp_units is FsdpUnits.MODEL and self.sharding is not Sharding.ZERO2:
            raise ValueError(f"--fsdp-units model is for --sharding zero2 (one unit keeps every parameter gathered "
                             f"through the forward), not {self.sharding}")
        if (self.checkpoint_every or self.resume) and self.checkpoint_dir is None:
            raise ValueError("--checkpoint-every and --resume need --checkpoint-dir")
        if (self.keep_last is not None or self.async_checkpoint) and self.checkpoint_dir is None:
            raise ValueError("--keep-last and --async-checkpoint need --checkpoint-dir")
        if self.resume_accept_data_change and not self.resume:
            raise ValueError("--resume-accept-data-change goes with --resume")
        if self.export_every is not None and self.output_dir is None:
            raise ValueError("--export-every needs --output-dir")
        if self.output_dir is not None:
            check_output_dir(self.output_dir, flag="--output-dir")
            if self.checkpoint_dir is not None and self.output_dir.resolve() == self.checkpoint_dir.resolve():
                raise ValueError(f"--output-dir and --checkpoint-dir are both {self.output_dir}: both write "
                                 "step-<n> folders, so give each its own")
        if self.eval_every and self.eval_data is None:
            raise ValueError("--eval-every needs --eval-data")
        if self.lora_rank is not None:
            check_lora_projections(self.lora_targets)
        elif self.lora_alpha is not None or self.lora_targets != LORA_TARGETS:
            raise ValueError("--lora-alpha and --lora-targets go with --lora-rank")
        if self.export_lora is LoraExport.ADAPTER:
            if self.lora_rank is None or self.output_dir is None:
                raise ValueError("--export-lora adapter needs --lora-rank and --output-dir")
            if self.model.lower() in MODEL_CATALOGUE:
                raise ValueError(f"--export-lora adapter writes an adapter for the base model folder it was trained "
                                 f"on, and --model {self.model} is a built-in random-init model: give --model a "
                                 "local checkpoint folder or a Hugging Face Hub id, or export the merged model")
        if self.feedback and self.scheduler_url is None:
            raise ValueError("--feedback reports to the scheduler service: give --scheduler-url too")
        if (self.fail_rank is None) != (self.fail_at_step is None):
            raise ValueError("--fail-rank and --fail-at-step go together")
        if self.fail_rank is not None and not 0 <= self.fail_rank < self.dp * self.cp:
            raise ValueError(f"--fail-rank {self.fail_rank} is not a global rank of dp {self.dp} × cp {self.cp}")
        return self


def check_lora_projections(targets: tuple[str, ...]) -> None:
    """Raise ``ValueError`` naming ``--lora-targets`` unless ``targets`` are projections of a decoder layer
    (``LORA_TARGETS``), at least one: checked when the run is configured, and by ``LoraSettings`` (``models/lora.py``)
    on construction, from a config or a checkpoint's record."""
    unknown = [target for target in targets if target not in LORA_TARGETS]
    if not targets or unknown:
        raise ValueError(f"--lora-targets {','.join(targets) or '(empty)'}: {', '.join(unknown) or 'none'} names no "
                         f"projection of a decoder layer; choose from {','.join(LORA_TARGETS)}")


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


# ---- errors: each wrong value named where it was given ---------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class Origin:
    """Where a ``TrainConfig``'s values came from (``config_file.load_config`` says): the config file's keys that
    no flag overrode, else flags (or keyword arguments, which are named as the flags are). ``spelled``: the file's own
    name of a field it gave under another trainer's name (``learning_rate`` for ``lr``, ``foreign_keys.py``)."""

    path: Path | None = None
    keys: frozenset[str] = frozenset()
    spelled: Mapping[str, str] = field(default_factory=dict)

    def key(self, field_name: str) -> str:
        """The file's key of a field the file gave."""
        return self.spelled.get(field_name, field_name)


class ConfigError(ValueError):
    """``TrainConfig`` refused its values: one line naming each wrong value by its flag, or by its key in the
    config file where the file gave it. ``errors`` are pydantic's."""

    def __init__(self, errors: list[ErrorDetails], origin: Origin | None = None) -> None:
        self.errors = errors
        self.lines = [_describe(error, origin or Origin()) for error in errors]
        super().__init__("; ".join(self.lines))

    def given_in(self, origin: Origin) -> ConfigError:
        """The same errors, named where ``origin`` says each value was given."""
        return ConfigError(self.errors, origin)


_FLAG_IN_MESSAGE = re.compile(r"--[a-z][a-z-]*")


def _describe(error: ErrorDetails, origin: Origin) -> str:
    # a ValueError of a validator here says what is wrong and nothing more; pydantic's own messages are sentences
    message = str(error["ctx"]["error"]) if error["type"] == "value_error" else error["msg"]
    if not error["loc"]:  # a rule across fields: its message names the flags; add the keys the file gave them
        keys = [origin.key(name) for flag in _FLAG_IN_MESSAGE.findall(message)
                if (name := _FIELD_OF_FLAG.get(flag)) is not None and name in origin.keys]
        return f"{message} ({origin.path}: {', '.join(dict.fromkeys(keys))})" if keys else message
    name, *inside = (str(part) for part in error["loc"])
    if error["type"] == "extra_forbidden":
        return (f"{origin.path}: {name}: {_unknown(name)}" if name in origin.keys
                else f"{name!r} is not a setting of the run: {_unknown(name)}")
    if error["type"] == "missing":
        where = f" (or {name} in {origin.path})" if origin.path is not None else ""
        return f"{FLAGS[name].name} is required{where}"
    if error["type"] != "value_error":
        message = f"{message}, got {error['input']!r}"
    if name in origin.keys:
        return f"{origin.path}: {origin.key(name)}{''.join(f'[{part}]' for part in inside)}: {message}"
    return f"{FLAGS[name].name} {message}" if error["type"] == "value_error" else f"{FLAGS[name].name}: {message}"


def _unknown(key: str) -> str:
    """What to say of a key that is no field: the Skrull key another trainer's name means, or why Skrull has none
    (``foreign_keys.py``); else the closest field, or where the fields are listed."""
    foreign = FOREIGN_KEYS.get(key)
    if foreign is not None and foreign.key is not None:
        return f"Skrull calls it {foreign.key}"
    if foreign is not None:
        return f"not a setting of Skrull: {foreign.refused({})}"
    close = difflib.get_close_matches(key, TrainConfig.model_fields, n=1)
    if close:
        return f"unknown key; did you mean {close[0]}?"
    return ("unknown key; `python -m trainer_client.train --help` lists the settings (a key is the flag's name with _ "
            "for -)")


# ---- each field's flag, which the errors name and flags.py adds to the parser ---------------------------------------


def _flag_of(name: str, annotation: Any, metadata: list[Any]) -> Flag:
    """The field's ``Flag``, on the field or on its non-None type, with its spelling filled in."""
    found = [item for item in metadata if isinstance(item, Flag)]
    for member in get_args(annotation) if _is_union(annotation) else ():
        if get_origin(member) is Annotated:
            found += [item for item in member.__metadata__ if isinstance(item, Flag)]
    flag = found[0] if found else Flag()
    spelled = flag.name or "--" + name.replace("_", "-")
    return Flag(name=spelled, exclusive=flag.exclusive,
                metavar=flag.metavar or spelled.removeprefix("--").replace("-", "_").upper(), choices=flag.choices)


def _is_union(annotation: Any) -> bool:
    return get_origin(annotation) in (Union, UnionType)


# Each field's flag, spelled: the errors name a value by it, and flags.py adds it to the parser.
FLAGS: dict[str, Flag] = {name: _flag_of(name, info.annotation, info.metadata)
                          for name, info in TrainConfig.model_fields.items()}
_FIELD_OF_FLAG: dict[str, str] = {flag.name: name for name, flag in FLAGS.items() if flag.name is not None}
