"""The settings of TRL's ``SFTConfig``, transformers' ``TrainingArguments`` and axolotl, as Skrull reads them.

A config file written for another trainer uses its names: ``learning_rate``, ``num_train_epochs``,
``gradient_accumulation_steps``, ``sequence_len``. Each name ``FOREIGN_KEYS`` knows is one of:

- **an alias**: the Skrull key of the same meaning, its value converted where the two spell it otherwise
  (``bf16: true`` is ``dtype: bfloat16``);
- **a value Skrull holds anyway**: a setting whose value means what Skrull does without being told
  (``packing: true``: Skrull always packs), accepted and left out;
- **a refusal**: Skrull has no such setting, and the message says why and which setting replaces it, from the file's
  other values where it can (``per_device_train_batch_size 4 × gradient_accumulation_steps 8 × dp 4 = 128
  sequences: give global_batch: 128``).

``translate`` applies the table to a file's keys (``config_file.load_config``); the aliases that need no conversion are
flags too (``--learning-rate`` is ``--lr``, ``flags.flag_aliases``). A name the table does not know stays unknown.
docs/guides/from-trl.md lists the table; a test holds the two equal. Nothing here imports torch: the configuration
reads it (``config_choices``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from scheduler_service.core.memory import LORA_TARGETS

__all__ = ["FOREIGN_KEYS", "ForeignKey", "translate"]

Values = Mapping[str, object]


@dataclass(frozen=True, kw_only=True, slots=True)
class ForeignKey:
    """Another trainer's setting: ``key``, the Skrull key it is (``value`` converts its value); ``accepts``, the
    values that mean what Skrull does anyway; otherwise ``refusal``, given the file's values: why Skrull has no such
    setting, and what replaces it."""

    tools: str  # whose name it is, as the docs list it
    key: str | None = None
    value: Callable[[Any], object] | None = None
    accepts: Callable[[Any], bool] | None = None
    refusal: str | Callable[[Values], str] = ""

    def refused(self, values: Values) -> str:
        return self.refusal(values) if callable(self.refusal) else self.refusal


def _global_batch(values: Values) -> str:
    """Skrull's global batch, from the per-device batch, the accumulation and dp where the file gives them."""
    why = ("Skrull plans every global batch's micro-batches itself, how many and which sequences each holds, by "
           "tokens (bucket_size per CP rank, derived from the memory unless given): give global_batch, the sequences "
           "per optimizer step")
    name = next((key for key in ("per_device_train_batch_size", "micro_batch_size") if key in values),
                "per_device_train_batch_size")
    per_device, accumulation, dp = values.get(name), values.get("gradient_accumulation_steps", 1), values.get("dp")
    if not (isinstance(per_device, int) and isinstance(accumulation, int) and isinstance(dp, int)):
        return f"{why}: {name} × gradient_accumulation_steps × dp"
    return (f"{why}: here {name} {per_device} × gradient_accumulation_steps {accumulation} × dp {dp} = "
            f"{per_device * accumulation * dp}")


def _warmup_steps(values: Values) -> str:
    why = "give warmup_steps, the steps of linear warmup"
    ratio, steps = values.get("warmup_ratio"), values.get("steps", values.get("max_steps"))
    if isinstance(ratio, int | float) and isinstance(steps, int):
        return f"{why}: here warmup_ratio {ratio} × steps {steps} = {math.ceil(ratio * steps)}"
    return f"{why} (warmup_ratio × steps; with epochs, the start-up log names the steps)"


def _either(true: object, false: object) -> Callable[[Any], object]:
    return lambda flag: true if flag is True else false if flag is False else flag


_PACKS = ("Skrull always packs: each micro-batch holds whole sequences (and shards of long ones) up to bucket_size "
          "tokens per CP rank, and attention stays within each sequence")
_IN_STEPS = "Skrull counts in steps: eval_every, checkpoint_every, logging_steps"
_ADAMW = ("Skrull trains with AdamW (torch's, its betas and epsilon the defaults); lr, weight_decay, lr_scheduler, "
          "warmup_steps and min_lr_ratio set it")
_SHARDING = "sharding: zero2, zero3 or none (FSDP2 over every dp × cp rank) shards the model"
_TRL = "TRL / transformers"
_AXOLOTL = "axolotl"
_BOTH = "TRL / transformers, axolotl"

# Every name another trainer's config file may hold that Skrull reads or refuses (module docstring).
FOREIGN_KEYS: dict[str, ForeignKey] = {
    # the model and the data
    "model_name_or_path": ForeignKey(tools=_TRL, key="model"),
    "base_model": ForeignKey(tools=_AXOLOTL, key="model"),
    "tokenizer_name_or_path": ForeignKey(tools=_TRL, key="tokenizer"),
    "tokenizer_config": ForeignKey(tools=_AXOLOTL, key="tokenizer"),
    "dataset_name": ForeignKey(tools=_TRL, key="data"),
    "dataset_train_split": ForeignKey(tools=_TRL, refusal="data: ORG/NAME:SPLIT names the split (train by default)"),
    "dataset_test_split": ForeignKey(tools=_TRL, refusal="eval_data: ORG/NAME:SPLIT, the held-out split"),
    "datasets": ForeignKey(tools=_AXOLOTL, refusal="give data: one data file, a dataset folder or a Hub data set "
                                                    "ORG/NAME[:SPLIT]; its records' keys say how it is read"),
    "val_set_size": ForeignKey(tools=_AXOLOTL, refusal="give eval_data: held-out records (a file, a folder, or the "
                                                        "Hub data set's other split, ORG/NAME:test)"),
    "dataset_text_field": ForeignKey(tools=_TRL, key="text_field"),
    "max_seq_length": ForeignKey(tools=_TRL, key="max_length"),
    "sequence_len": ForeignKey(tools=_AXOLOTL, key="max_length"),
    "chat_template_path": ForeignKey(tools=_TRL, key="chat_template"),
    "assistant_only_loss": ForeignKey(tools=_TRL, key="loss_on", value=_either("assistant", "all")),
    "completion_only_loss": ForeignKey(tools=_TRL, key="loss_on", value=_either("completion", "all")),
    "train_on_inputs": ForeignKey(tools=_AXOLOTL, key="loss_on", value=_either("all", "assistant")),
    # the batch
    "per_device_train_batch_size": ForeignKey(tools=_TRL, refusal=_global_batch),
    "micro_batch_size": ForeignKey(tools=_AXOLOTL, refusal=_global_batch),
    "gradient_accumulation_steps": ForeignKey(tools=_BOTH, refusal=_global_batch),
    "per_device_eval_batch_size": ForeignKey(tools=_TRL, refusal="evaluation batches are planned as training's: "
                                                                 "global_batch records each"),
    "auto_find_batch_size": ForeignKey(tools=_TRL, refusal="bucket_size bounds the tokens a CP rank holds in a "
                                                           "micro-batch; without it the profile's memory derives it"),
    "packing": ForeignKey(tools=_TRL, accepts=lambda on: on is True, refusal=_PACKS),
    "sample_packing": ForeignKey(tools=_AXOLOTL, accepts=lambda on: on is True, refusal=_PACKS),
    "padding_free": ForeignKey(tools=_TRL, accepts=lambda on: on is True, refusal=_PACKS),
    "pad_to_sequence_len": ForeignKey(tools=_AXOLOTL, accepts=lambda on: on is False, refusal=_PACKS),
    "group_by_length": ForeignKey(tools=_TRL, accepts=lambda on: on is False,
                                  refusal="the scheduler balances the lengths of every global batch; scheduler: "
                                          "group_by_length plans as transformers' sampler does, to compare"),
    # how long, the optimizer and its schedule
    "num_train_epochs": ForeignKey(tools=_TRL, key="epochs"),
    "num_epochs": ForeignKey(tools=_AXOLOTL, key="epochs"),
    "max_steps": ForeignKey(tools=_TRL, key="steps"),
    "learning_rate": ForeignKey(tools=_BOTH, key="lr"),
    "lr_scheduler_type": ForeignKey(tools=_TRL, key="lr_scheduler"),
    "warmup_ratio": ForeignKey(tools=_BOTH, refusal=_warmup_steps),
    "optim": ForeignKey(tools=_TRL, accepts=lambda name: str(name).startswith("adamw_torch"), refusal=_ADAMW),
    "optimizer": ForeignKey(tools=_AXOLOTL, accepts=lambda name: str(name).startswith("adamw_torch"),
                            refusal=_ADAMW),
    "adam_beta1": ForeignKey(tools=_TRL, accepts=lambda beta: beta == 0.9, refusal=_ADAMW),
    "adam_beta2": ForeignKey(tools=_TRL, accepts=lambda beta: beta == 0.999, refusal=_ADAMW),
    "adam_epsilon": ForeignKey(tools=_TRL, accepts=lambda epsilon: epsilon == 1e-8, refusal=_ADAMW),
    "lr_scheduler_kwargs": ForeignKey(tools=_TRL, refusal="min_lr_ratio is the only argument of a schedule here"),
    # precision, memory, sharding
    "bf16": ForeignKey(tools=_BOTH, key="dtype", value=_either("bfloat16", "float32")),
    "fp16": ForeignKey(tools=_BOTH, accepts=lambda on: on is False,
                       refusal="dtype: bfloat16 (the default on CUDA) or float32; float16 is not supported"),
    "gradient_checkpointing": ForeignKey(tools=_BOTH, key="activation_checkpointing", value=_either("full", "none")),
    "torch_compile": ForeignKey(tools=_BOTH, key="compile"),
    "flash_attention": ForeignKey(tools=_AXOLOTL, key="attention_backend", value=_either("flash_attn", "auto")),
    "deepspeed": ForeignKey(tools=_BOTH, refusal=_SHARDING),
    "fsdp": ForeignKey(tools=_BOTH, refusal=_SHARDING),
    "fsdp_config": ForeignKey(tools=_BOTH, refusal=_SHARDING),
    "dataloader_num_workers": ForeignKey(tools=_TRL, refusal="every rank reads its records a record at a time, and "
                                                             "a background thread packs the next micro-batch"),
    # LoRA
    "lora_r": ForeignKey(tools=_AXOLOTL, key="lora_rank"),
    "lora_target_modules": ForeignKey(tools=_AXOLOTL, key="lora_targets"),
    "lora_target_linear": ForeignKey(tools=_AXOLOTL, key="lora_targets", value=_either(LORA_TARGETS, ())),
    "adapter": ForeignKey(tools=_AXOLOTL, accepts=lambda kind: kind == "lora",
                          refusal="lora_rank trains LoRA adapters; QLoRA's 4-bit base weights are not supported"),
    "lora_dropout": ForeignKey(tools=_BOTH, accepts=lambda p: p == 0,
                               refusal="Skrull's adapters have no dropout, so that a micro-batch's loss depends on "
                                       "its tokens alone and every scheduler trains the same model"),
    # evaluation, checkpoints, logs
    "eval_steps": ForeignKey(tools=_TRL, key="eval_every"),
    "save_steps": ForeignKey(tools=_TRL, key="checkpoint_every"),
    "save_total_limit": ForeignKey(tools=_TRL, key="keep_last"),
    "eval_strategy": ForeignKey(tools=_TRL, accepts=lambda kind: kind == "steps", refusal=_IN_STEPS),
    "save_strategy": ForeignKey(tools=_TRL, accepts=lambda kind: kind == "steps", refusal=_IN_STEPS),
    "logging_strategy": ForeignKey(tools=_TRL, accepts=lambda kind: kind == "steps", refusal=_IN_STEPS),
    "evals_per_epoch": ForeignKey(tools=_AXOLOTL, refusal=_IN_STEPS),
    "saves_per_epoch": ForeignKey(tools=_AXOLOTL, refusal=_IN_STEPS),
    "resume_from_checkpoint": ForeignKey(tools=_BOTH, refusal="resume: true continues from the newest complete "
                                                              "checkpoint of checkpoint_dir"),
    "run_name": ForeignKey(tools=_TRL, key="job_id"),
    "wandb_project": ForeignKey(tools=_AXOLOTL, refusal="W&B reads WANDB_PROJECT (and WANDB_ENTITY) from the "
                                                        "environment; report_to: wandb, and job_id names the run"),
    "push_to_hub": ForeignKey(tools=_TRL, accepts=lambda on: on is False,
                              refusal="output_dir holds the trained model; `hf upload` pushes it"),
}


def translate(values: Values, *, context: Values | None = None) -> tuple[dict[str, object], dict[str, str], list[str]]:
    """``values`` (a config file's keys) with every alias of ``FOREIGN_KEYS`` under its Skrull key and every value
    Skrull holds anyway left out; the file's key of each translated Skrull key; and the refusals, a line each,
    ``key: why``, whose advice reads ``context`` (the run's values; by default ``values``). Two keys that set the same
    Skrull key are refused too."""
    kept: dict[str, object] = {}
    spelled: dict[str, str] = {}
    refused: dict[str, list[str]] = {}  # why, and the keys refused for it: one line for the keys of one reason
    set_by = {key: key for key in values if key not in FOREIGN_KEYS}  # each Skrull key given, by the key giving it
    for key, value in values.items():
        foreign = FOREIGN_KEYS.get(key)
        if foreign is None:
            kept[key] = value  # a Skrull key, or one TrainConfig names as unknown
        elif foreign.key is None:
            if foreign.accepts is None or not foreign.accepts(value):
                refused.setdefault(foreign.refused(context or values), []).append(key)
        elif foreign.key in set_by:
            refused.setdefault(f"{set_by[foreign.key]} sets {foreign.key} too; give one", []).append(key)
        else:
            set_by[foreign.key] = spelled[foreign.key] = key
            kept[foreign.key] = foreign.value(value) if foreign.value is not None else value
    refusals = [f"{', '.join(keys)}: {why}" if why.endswith("give one") else
                f"{', '.join(keys)}: {'not a setting' if len(keys) == 1 else 'not settings'} of Skrull: {why}"
                for why, keys in refused.items()]
    return kept, spelled, refusals
