"""Skrull inside the Hugging Face Trainer and TRL's SFTTrainer (docs/guides/hf-trainer.md).

* ``arguments``: ``SkrullArguments``, the settings a Trainer's own arguments have no name for;
* ``layout``: what the Trainer's arguments become under Skrull (the DP × CP split, the global batch) and the ones
  refused;
* ``versions``: the transformers, accelerate and TRL releases the integration is tested with;
* ``attention_interface``: the model's attention checked replaceable, and switched to DACP while Skrull runs it;
* ``collator``: each example collated alone into one sequence, and collators that pack by themselves refused;
* ``skrull_trainer``: ``SkrullTrainer`` (``transformers.Trainer``) and its ``SkrullTrainerMixin``;
* ``sft``: ``SkrullSFTTrainer`` (TRL's ``SFTTrainer``; needs ``pip install 'skrull[trl]'``).

Public names resolve lazily, so that ``SkrullTrainer`` does not import TRL.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["SkrullArguments", "SkrullSFTTrainer", "SkrullTrainer", "SkrullTrainerMixin"]

_MODULE_OF = {
    "SkrullArguments": "arguments",
    "SkrullSFTTrainer": "sft",
    "SkrullTrainer": "skrull_trainer",
    "SkrullTrainerMixin": "skrull_trainer",
}


def __getattr__(name: str) -> Any:
    if name not in _MODULE_OF:
        raise AttributeError(f"module 'trainer_client.hf' has no attribute {name!r}")
    return getattr(importlib.import_module(f"trainer_client.hf.{_MODULE_OF[name]}"), name)
