"""Skrull in a training loop of your own: a transformers model, AdamW and a gradient all-reduce, no ``Trainer``.

    torchrun --nproc-per-node 4 examples/custom_loop.py   # dp 2 × cp 2, the tiny Qwen2-style model, synthetic data

Every rank builds the same global batch; ``SkrullBatches.plan`` gives this rank its micro-batches, packed for
DACP, and the global batch's loss-token count. The loop runs the micro-batches, sums gradients over every rank
and steps; rank 0 prints each step's loss and gradient norm. docs/guides/custom-loop.md walks through it.

Shape legend: T tokens of this rank's packed row, V vocabulary.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F

from trainer_client import ParallelDims, SkrullBatches, build_model, init_parallel, model_inputs
from trainer_client.data import IGNORE_INDEX, make_source


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--dp", type=int, default=2, help="data-parallel degree")
    parser.add_argument("--cp", type=int, default=2, help="context-parallel degree")
    parser.add_argument("--model", default="tiny", help="a built-in model shape, random init (no download)")
    parser.add_argument("--data", default="synthetic:lmsys", help="synthetic:NAME, or records: a JSONL, parquet, CSV "
                                                                  "or JSON file, a datasets folder or a Hub data set")
    parser.add_argument("--tokenizer", help="a tokenizer folder or a Hub id, for chats, prompt-completion and text "
                                            "records (whose chat template renders the chats)")
    parser.add_argument("--global-batch", type=int, default=16, help="sequences per global batch")
    parser.add_argument("--bucket-size", type=int, default=1024, help="tokens per CP rank per micro-batch")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--scheduler-url", help="the scheduler service; absent: Skrull's embedded planner")
    return parser.parse_args()


def all_reduce_gradients(model: torch.nn.Module) -> None:
    """Sum every gradient over all DP × CP ranks. CP ranks hold other tokens of the same batch, so for the
    optimizer they are data-parallel ranks too. A sum, not a mean: each loss is already divided by the global
    batch's loss tokens. A rank that ran no micro-batch adds zeros."""
    for param in model.parameters():
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        dist.all_reduce(param.grad)


def main() -> None:
    args = parse_args()
    # The ("dp", "cp") mesh over torchrun's processes, and the groups of the CP blocks hybrid DACP shards over.
    parallel = init_parallel(ParallelDims(dp_size=args.dp, cp_size=args.cp))
    # Seeded: every rank starts with the same weights. build_model registers DACP attention and selects it.
    model = build_model(args.model, seed=args.seed, device=parallel.device)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    # Global batch s depends on (seed, s) alone: every rank builds the same one, Skrull plans it whole.
    source = make_source(args.data, global_batch_size=args.global_batch, vocab_size=model.config.vocab_size,
                         max_length=args.bucket_size * args.cp, seed=args.seed, tokenizer=args.tokenizer)

    with SkrullBatches(parallel, model=args.model, bucket_size=args.bucket_size,
                       scheduler_url=args.scheduler_url) as batches:
        for step in range(args.steps):
            optimizer.zero_grad(set_to_none=True)
            loss_sum = torch.zeros((), dtype=torch.float64, device=parallel.device)
            # This rank's micro-batches, packed one ahead of the loop by a background thread (stopped at the end).
            with batches.plan(source.batch(step)) as share:
                for pack in share.micro_batches:
                    if pack.is_idle:  # this rank holds no token of it (replicated training): no peer waits
                        continue
                    logits_TV = model(**model_inputs(pack)).logits[0]
                    token_loss_sum = F.cross_entropy(logits_TV.float(), pack.targets_T, ignore_index=IGNORE_INDEX,
                                                     reduction="sum")
                    # Divided by the whole global batch's loss tokens, not this micro-batch's: every token weighs
                    # the same.
                    (token_loss_sum / share.num_loss_tokens).backward()
                    loss_sum += token_loss_sum.detach().double()
            all_reduce_gradients(model)
            dist.all_reduce(loss_sum)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            optimizer.step()
            if parallel.is_main:
                print(f"step {step + 1:>4} loss {loss_sum.item() / share.num_loss_tokens:.6f} "
                      f"grad_norm {grad_norm.item():.6e}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
