"""A TRL ``SFTTrainer`` script with Skrull's plans: TRL's own SFT script, three lines changed (marked ``# Skrull``).

    torchrun --nproc-per-node 8 examples/trl_sft.py --cp 2     # dp 4 × cp 2

Every rank reads the whole global batch (per_device_train_batch_size × gradient_accumulation_steps × dp
sequences); Skrull plans it over all dp × cp ranks, keeps short chats whole on one rank and shards only the long
ones, over as few CP ranks as they need. TRL still renders the chats, masks everything but the assistant's answers
and cuts each chat at max_length; its own packing stays off (packing=False, its default), since Skrull's plan packs.
The script runs on CPU as it is (gloo). docs/guides/hf-trainer.md walks through it.
"""

from __future__ import annotations

import argparse

import torch
from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import SFTConfig

from trainer_client.hf import SkrullArguments, SkrullSFTTrainer  # Skrull


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", default="Qwen/Qwen2.5-0.5B-Instruct", help="a Hub id or a local folder")
    parser.add_argument("--dataset", default="trl-lib/Capybara",
                        help="chats ({'messages': [...]}): a Hub id or a folder of data files")
    parser.add_argument("--output-dir", default="qwen2.5-0.5b-sft")
    parser.add_argument("--max-length", type=int, default=8192, help="tokens; a longer chat is cut")
    parser.add_argument("--per-device-batch", type=int, default=4)
    parser.add_argument("--gradient-accumulation", type=int, default=8)
    parser.add_argument("--max-steps", type=int, default=-1, help="-1: one epoch")
    parser.add_argument("--cp", type=int, default=2, help="context-parallel degree; dp is the processes / cp")
    parser.add_argument("--bucket-size", type=int, default=8192, help="tokens per CP rank per micro-batch")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    model = AutoModelForCausalLM.from_pretrained(args.model)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    dataset = load_dataset(args.dataset, split="train")
    config = SFTConfig(
        output_dir=args.output_dir,
        per_device_train_batch_size=args.per_device_batch,
        gradient_accumulation_steps=args.gradient_accumulation,
        max_steps=args.max_steps,
        max_length=args.max_length,
        assistant_only_loss=True,
        learning_rate=2e-5,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=not torch.cuda.is_available(),  # without it, accelerate trains torchrun's CPU processes each alone
    )
    trainer = SkrullSFTTrainer(  # Skrull: was SFTTrainer
        model=model,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        skrull=SkrullArguments(bucket_size=args.bucket_size, cp=args.cp),  # Skrull
    )
    trainer.train()
    trainer.save_model()


if __name__ == "__main__":
    main()
