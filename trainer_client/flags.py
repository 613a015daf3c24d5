"""The trainer's command line, generated from ``TrainConfig``: a flag per field (``add_flags``), and the run the
parsed flags describe (``config_from_args``).

Each field's flag is ``--field-name`` unless the field's ``Flag`` spells it otherwise (``plan_timeout_s`` is
``--plan-timeout``), in the argument group of ``--help`` that ``GROUPS`` gives it; its help is the field's
description, one or two lines of plain text (the guides explain), with the default shown once; a bool has both forms
(``--resume``/``--no-resume``, ``--shuffle``/``--no-shuffle``), so a flag can turn a file's value either way; a tuple
is comma-separated; an enum offers its values. Another trainer's flag whose value Skrull reads as it is, is taken too
(``--learning-rate`` is ``--lr``, ``flag_aliases``); one Skrull has not is refused with why (``foreign_flag_refusal``).

The flags are generated here, from each field's type, description and ``Flag``, rather than by pydantic-settings'
CLI: that keeps every flag's spelling and meaning (``--plan-timeout`` for ``plan_timeout_s``,
comma-separated lists, the ``--steps``/``--epochs`` exclusion, argument groups), keeps ``train.build_parser`` a
plain argparse parser for the reference page (``cli_reference``), and adds no dependency to the trainer (GPU
machines often lack pydantic-settings).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from types import NoneType, UnionType
from typing import Annotated, Any, Union, get_args, get_origin

from trainer_client.config import FLAGS, TrainConfig
from trainer_client.config_choices import SYNTHETIC_DATASETS
from trainer_client.config_file import load_config
from trainer_client.foreign_keys import FOREIGN_KEYS

__all__ = ["GROUPS", "FlagGroup", "add_flags", "config_from_args", "flag_aliases", "foreign_flag_refusal"]


@dataclass(frozen=True, kw_only=True, slots=True)
class FlagGroup:
    """An argument group of ``--help``: what its flags are about, and the fields whose flags it holds."""

    description: str
    fields: tuple[str, ...]


# The argument groups of --help, in their order, each with its flags in theirs; every field's flag is in one (--help
# and --config come first).
GROUPS: dict[str, FlagGroup] = {
    "data": FlagGroup(
        description="--data and --eval-data read records from a JSONL, parquet, CSV or JSON file, a dataset folder "
                    "(DIR[:SPLIT]) or a Hugging Face Hub data set ORG/NAME[@REVISION][:SPLIT]; --data synthetic:NAME "
                    f"({', '.join(SYNTHETIC_DATASETS)}) draws lengths like that data set's, with random tokens",
        fields=("data", "tokenizer", "chat_template", "loss_on", "text_field", "shuffle", "max_length", "truncate",
                "skip_bad_records")),
    "model": FlagGroup(
        description="the model and how its layers compute",
        fields=("model", "dtype", "attention_backend", "activation_checkpointing", "compile", "cuda_graphs",
                "loss_chunk_tokens")),
    "parallelism and plans": FlagGroup(
        description="the layout of the ranks, and the plan of each global batch",
        fields=("dp", "cp", "sharding", "fsdp_units", "scheduler", "spanning", "schemes", "bucket_size",
                "token_buckets", "profile", "collective_timeout_s")),
    "optimisation": FlagGroup(
        description="how long to train, and how each step updates the weights (AdamW)",
        fields=("global_batch", "steps", "epochs", "seed", "lr", "weight_decay", "lr_scheduler", "warmup_steps",
                "min_lr_ratio", "max_grad_norm")),
    "LoRA": FlagGroup(
        description="train low-rank adapters (peft) on a frozen model: only the adapters carry gradients and "
                    "optimizer state, so the BucketSize grows",
        fields=("lora_rank", "lora_alpha", "lora_targets")),
    "evaluation": FlagGroup(
        description="mean token loss on held-out records, planned and sharded like training, no optimizer step",
        fields=("eval_data", "eval_every")),
    "checkpoints and export": FlagGroup(
        description="DCP checkpoints to resume from, and the trained model as a Hugging Face folder",
        fields=("checkpoint_dir", "checkpoint_every", "keep_last", "async_checkpoint", "resume",
                "resume_accept_data_change", "output_dir", "export_every", "export_lora")),
    "logging": FlagGroup(
        description="the step metrics, from rank 0: log lines, a JSON lines file and experiment trackers (W&B reads "
                    "WANDB_PROJECT and WANDB_MODE, MLflow MLFLOW_TRACKING_URI and MLFLOW_EXPERIMENT_NAME)",
        fields=("metrics_out", "logging_steps", "progress", "debug", "report_to", "logging_dir", "job_id")),
    "service": FlagGroup(
        description="the scheduler service, which plans each global batch; without one, the embedded planner does",
        fields=("scheduler_url", "plan_timeout_s", "plan_attempts", "feedback")),
    "fault injection": FlagGroup(
        description="for tests of failure handling; never in real runs",
        fields=("fail_rank", "fail_at_step")),
}

_GROUP_OF: dict[str, str] = {name: title for title, group in GROUPS.items() for name in group.fields}


def _value_type(annotation: Any) -> Any:
    """The type a flag's text converts to: the annotation without ``None`` and without its validators."""
    if get_origin(annotation) in (Union, UnionType):
        (annotation,) = (member for member in get_args(annotation) if member is not NoneType)
    return get_args(annotation)[0] if get_origin(annotation) is Annotated else annotation


def _comma_separated(text: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in text.split(",") if item.strip())


def _shown(default: object) -> str:
    if isinstance(default, tuple):
        return ",".join(map(str, default))
    return str(default)


def add_flags(parser: argparse.ArgumentParser) -> None:
    """``--config FILE`` and a flag per ``TrainConfig`` field, in the field's group (``GROUPS``). A flag not given
    is absent from the parsed namespace (its default is the model's), so that ``config_from_args`` can tell it from
    a config file's value."""
    parser.add_argument("--config", type=Path, metavar="FILE",
                        help="a YAML, TOML or JSON file of settings, keyed by flag name with _ for -; a flag given "
                             "overrides its key")
    assert sorted(_GROUP_OF) == sorted(TrainConfig.model_fields), "GROUPS gives every field's flag one group"
    exclusive: dict[str, argparse._MutuallyExclusiveGroup] = {}
    for title, group in GROUPS.items():
        argument_group = parser.add_argument_group(title, group.description)
        for name in group.fields:
            _add_flag(argument_group, name, exclusive)


def _add_flag(container: argparse._ActionsContainer, name: str,
              exclusive: dict[str, argparse._MutuallyExclusiveGroup]) -> None:
    """The flag of field ``name`` in ``container``, or in the group of flags it excludes (``Flag.exclusive``)."""
    info = TrainConfig.model_fields[name]
    flag = FLAGS[name]
    assert flag.name is not None  # _flag_of spells every flag
    if flag.exclusive is not None:
        if flag.exclusive not in exclusive:
            exclusive[flag.exclusive] = container.add_mutually_exclusive_group()
        container = exclusive[flag.exclusive]
    kind = _value_type(info.annotation)
    help_text = info.description or ""
    # A bool's description says what its default does: "(default: False)" would not say which form it is.
    if not (info.is_required() or info.default is None or kind is bool or info.default == ()
            or "default" in help_text):
        help_text += f" (default: {_shown(info.default)})"
    if flag.name != "--" + name.replace("_", "-"):
        help_text += f" [config key {name}]"
    common: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS, "help": help_text.replace("%", "%%")}
    if kind is bool:  # --resume and --no-resume: either overrides the file's key
        container.add_argument(flag.name, action=argparse.BooleanOptionalAction, **common)
    elif get_origin(kind) is tuple:
        container.add_argument(flag.name, type=_comma_separated, metavar=flag.metavar, **common)
    elif isinstance(kind, type) and issubclass(kind, StrEnum):
        container.add_argument(flag.name, choices=[member.value for member in kind], **common)
    else:
        container.add_argument(flag.name, type=kind, choices=flag.choices,
                               metavar=None if flag.choices else flag.metavar, **common)



def flag_aliases() -> dict[str, str]:
    """Another trainer's flag for each alias whose value Skrull reads as it is, and Skrull's own
    (``--learning-rate`` is ``--lr``): the command line takes them too."""
    return {"--" + key.replace("_", "-"): flag_name for key, foreign in FOREIGN_KEYS.items()
            if foreign.key is not None and foreign.value is None and (flag_name := FLAGS[foreign.key].name)}


def foreign_flag_refusal(flag: str) -> str | None:
    """Why Skrull has no such flag, where it is another trainer's setting (``--gradient-accumulation-steps``), and
    what replaces it."""
    foreign = FOREIGN_KEYS.get(flag.removeprefix("--").replace("-", "_"))
    if foreign is None:
        return None
    if foreign.key is not None:
        return f"{flag} is {FLAGS[foreign.key].name} here, as a config key"
    return f"{flag} is not a setting of Skrull: {foreign.refused({})}"


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The run that flags parsed by a parser ``add_flags`` built describe: the ``--config`` file's settings, the
    flags given over them."""
    flags = vars(args).copy()
    config_file: Path | None = flags.pop("config")
    return load_config(flags, config_file=config_file)

