"""The trained model as a Hugging Face folder, from the trainer or from any checkpoint it wrote.

The folder is what ``transformers.AutoModelForCausalLM.from_pretrained`` reads: ``save_pretrained``'s
safetensors weights (a tied LM head saved once), ``config.json`` and ``generation_config.json``, and the
tokenizer's files when one is given. DACP attention is chosen at run time (``model.build_model``), not saved in
the config, so the folder loads with transformers' stock attention.

* From the trainer (``--output-dir``, ``export_model``): every rank takes part in gathering the full state dict
  from the FSDP2 shards, one tensor at a time onto rank 0's CPU alone (``get_model_state_dict`` with
  ``full_state_dict`` and ``cpu_offload``; the other ranks receive nothing and never hold the whole model);
  rank 0 writes the folder, and every rank waits for it at a barrier.
* From a checkpoint (``skrull-export CKPT_DIR OUT_DIR``, ``export_checkpoint``): one process, no torchrun, so a
  crashed run's last checkpoint is still usable. The model's part alone is loaded into a freshly built unsharded
  model (``checkpoint.load_model_weights``), never the optimizer state. The model's config is ``--model``'s
  (a catalogue name, a local HF folder or a Hub id, as for the trainer), by default the catalogue model the checkpoint's
  ``run.json`` names; a given ``--model`` must be the one ``run.json`` records.

Both write the same folder: ``tests/test_export.py`` finds equal weights from both paths of the same step. A LoRA
run (``lora.py``) is written with its adapters merged into the weights, a plain model folder, or as the adapter
alone (``adapter_config.json`` and ``adapter_model.safetensors``, which ``peft.PeftModel.from_pretrained`` loads
onto the base model folder it names).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from scheduler_service.core.models import MODEL_CATALOGUE
from trainer_client.components.checkpoint import load_model_weights, resolve_checkpoint, saved_run_identity
from trainer_client.components.run_identity import model_identity
from trainer_client.config import check_output_dir
from trainer_client.config_choices import LoraExport, chat_template_of
from trainer_client.data import load_tokenizer
from trainer_client.hub import RepoKind, fetch, hub_ref
from trainer_client.models.lora import LoraSettings, apply_lora
from trainer_client.models.loss import CausalLMLoss
from trainer_client.models.model import build_model

__all__ = ["build_parser", "checkpoint_model", "export_checkpoint", "export_model", "load_export_tokenizer", "main",
           "write_model_folder", "write_trained_folder"]

EXIT_USER_ERROR = 2


def load_export_tokenizer(path: str, *, chat_template: str | None = None) -> PreTrainedTokenizerBase:
    """The ``--tokenizer`` folder, read when the run starts so that a bad one stops it before it trains; with the
    ``--chat-template`` the run rendered its chats with (a name or a file), so that the folder renders them alike."""
    tokenizer = load_tokenizer(path)
    assert isinstance(tokenizer, PreTrainedTokenizerBase)  # what AutoTokenizer returns
    if chat_template is not None:
        tokenizer.chat_template = chat_template_of(chat_template)
    return tokenizer


def write_model_folder(
    lm: PreTrainedModel, directory: Path, *, state_dict: Mapping[str, object],
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> None:
    """``lm``'s config and generation config with the whole tensors of ``state_dict`` as its weights, and the
    tokenizer; ``directory`` and missing parents are created, files of the same names replaced."""
    # A full state dict holds a tied parameter under each of its names, gathered as separate tensors; the folder
    # holds it once, under its first name, and transformers ties it again on load.
    aliases = ({name for name, _ in lm.named_parameters(remove_duplicate=False)}
               - {name for name, _ in lm.named_parameters()})
    lm.save_pretrained(directory, state_dict={name: tensor for name, tensor in state_dict.items()
                                              if name not in aliases})
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)


def write_trained_folder(
    lm: PreTrainedModel, directory: Path, *, state_dict: Mapping[str, object], model: str,
    tokenizer: PreTrainedTokenizerBase | None = None, lora: LoraSettings | None = None,
    lora_export: LoraExport = LoraExport.MERGED,
) -> None:
    """The folder of a trained ``lm`` whose whole weights are ``state_dict``. With LoRA, a fresh copy of ``model``
    on this process's CPU takes the weights (merging under FSDP is not supported) and is written with its adapters
    merged into the weights, or as the adapter alone for the base folder ``model``."""
    if lora is None:
        write_model_folder(lm, directory, state_dict=state_dict, tokenizer=tokenizer)
        return
    fresh = build_model(model)
    adapted = apply_lora(fresh, lora)  # in place: ``fresh`` now holds the adapters, under the trained names
    fresh.load_state_dict(state_dict)
    if lora_export is LoraExport.ADAPTER:
        adapter_config, ref = adapted.peft_config["default"], hub_ref(model, RepoKind.MODEL)
        if ref is None:
            adapter_config.base_model_name_or_path = str(Path(model).resolve())
        else:  # the Hub id at the commit trained on, which peft fetches wherever the adapter is loaded
            adapter_config.base_model_name_or_path, adapter_config.revision = ref.repo_id, fetch(ref).commit
        adapted.save_pretrained(str(directory))
        if tokenizer is not None:
            tokenizer.save_pretrained(directory)
        return
    merged = adapted.merge_and_unload()
    assert isinstance(merged, PreTrainedModel)
    write_model_folder(merged, directory, state_dict=merged.state_dict(), tokenizer=tokenizer)


def export_model(
    lm: PreTrainedModel, directory: Path, *, model: str, tokenizer: PreTrainedTokenizerBase | None = None,
    lora: LoraSettings | None = None, lora_export: LoraExport = LoraExport.MERGED,
) -> None:
    """Write ``lm`` (sharded by FSDP2 or replicated; ``model``: the ``--model`` it was built from) as a Hugging
    Face folder (``write_trained_folder``); every rank calls this."""
    state_dict = get_model_state_dict(lm, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        write_trained_folder(lm, directory, state_dict=state_dict, model=model, tokenizer=tokenizer, lora=lora,
                             lora_export=lora_export)
    dist.barrier()  # no rank goes on (or exits) before the folder is whole


def checkpoint_model(checkpoint: Path, model: str | None) -> str:
    """The ``--model`` that trained ``checkpoint``: ``model`` checked against its ``run.json``, else the model the
    record names: a catalogue name, or the folder or Hub id it was read from where that still holds the model
    trained (a record written before sources were recorded holds only a digest of its config)."""
    saved = saved_run_identity(checkpoint)
    if model is None:
        if saved is None:
            raise ValueError(f"checkpoint {checkpoint} has no record of the model that trained it: give --model")
        if saved.model in MODEL_CATALOGUE:
            return saved.model
        source = saved.model_source
        if source is None:
            raise ValueError(f"checkpoint {checkpoint} was trained from a local model folder ({saved.model}): give "
                             "that folder as --model")
        if not (Path(source).is_dir() or hub_ref(source, RepoKind.MODEL) is not None) or (
                model_identity(source) != saved.model):
            raise ValueError(f"checkpoint {checkpoint} was trained from {source}, which no longer holds that model "
                             f"({saved.model}): give the model's folder or Hub id as --model")
        return source
    if saved is not None and model_identity(model) != saved.model:
        raise ValueError(f"--model {model} is not the model checkpoint {checkpoint} was trained from: its run.json "
                         f"records {saved.model}, --model is {model_identity(model)}")
    return model


def export_checkpoint(
    checkpoint_dir: Path, output_dir: Path, *, model: str | None = None, tokenizer: str | None = None,
    lora_export: LoraExport = LoraExport.MERGED,
) -> Path:
    """Write the model of ``checkpoint_dir`` (a ``--checkpoint-dir``, meaning its newest complete checkpoint, or a
    ``step-<n>`` folder) into ``output_dir``, in this one process; returns the checkpoint exported. A LoRA run's
    checkpoint (its ``run.json`` records the adapters) is exported as ``lora_export`` says."""
    checkpoint = resolve_checkpoint(checkpoint_dir)
    model = checkpoint_model(checkpoint, model)
    saved = saved_run_identity(checkpoint)
    lora = saved.lora if saved is not None else None
    if lora is None and lora_export is LoraExport.ADAPTER:
        raise ValueError(f"--lora adapter: checkpoint {checkpoint} was not trained with LoRA adapters")
    if lora_export is LoraExport.ADAPTER and model.lower() in MODEL_CATALOGUE:
        raise ValueError("--lora adapter writes an adapter for a base model folder: give the folder (or Hugging Face "
                         "Hub id) the run was trained from as --model")
    check_output_dir(output_dir, flag="OUT_DIR")
    loaded_tokenizer = load_export_tokenizer(tokenizer) if tokenizer is not None else None
    lm = build_model(model)
    if lora is not None:
        apply_lora(lm, lora)  # the checkpoint's keys are those of the adapted model
    load_model_weights(checkpoint, CausalLMLoss(lm))  # the module the trainer checkpoints: its keys are the saved
    write_trained_folder(lm, output_dir, state_dict=lm.state_dict(), model=model, tokenizer=loaded_tokenizer,
                         lora=lora, lora_export=lora_export)
    return checkpoint


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m trainer_client.export",
        description="Write the model of a trainer checkpoint as a Hugging Face folder (one process, no torchrun).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("checkpoint_dir", metavar="CKPT_DIR", type=Path,
                        help="a --checkpoint-dir of the trainer (its newest complete checkpoint) or one of its step-N "
                             "folders")
    parser.add_argument("output_dir", metavar="OUT_DIR", type=Path,
                        help="the folder to write (safetensors weights, config, generation config, tokenizer); "
                             "its parent must exist")
    parser.add_argument("--model", help="the trainer's --model: a built-in model name, a local HF checkpoint "
                                        "directory or a Hugging Face Hub id (default: the built-in model the "
                                        "checkpoint's run.json names)")
    parser.add_argument("--tokenizer", help="a local tokenizer directory or a Hugging Face Hub id, to save beside "
                                            "the model")
    parser.add_argument("--lora", default=LoraExport.MERGED.value, choices=[e.value for e in LoraExport],
                        help="a LoRA run's checkpoint: write the model with the adapters merged into its weights, "
                             "or the adapter alone (for the base model folder given as --model)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        checkpoint = export_checkpoint(args.checkpoint_dir, args.output_dir, model=args.model,
                                       tokenizer=args.tokenizer, lora_export=LoraExport(args.lora))
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USER_ERROR
    print(f"exported {checkpoint} to {args.output_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
