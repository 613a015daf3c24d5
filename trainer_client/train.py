"""``torchrun --nproc-per-node DP×CP -m trainer_client.train …``: parse → build → train → close.

Example (4 CPU processes, plans from a local scheduler service):

    torchrun --nproc-per-node 4 -m trainer_client.train --dp 2 --cp 2 --model tiny \\
      --data synthetic:lmsys --global-batch 16 --steps 20 --scheduler skrull \\
      --scheduler-url http://127.0.0.1:8000 --bucket-size 4096 --seed 0 --metrics-out metrics.jsonl

Exit status 2 with one message on stderr for a user error (a torch older than
the supported range, bad flags, world size ≠ dp × cp, a record too long, a batch no planner can plan, ``--resume``
of a checkpoint another run wrote). Any other failure of a rank is recorded for
torchrun (``@record``): the agent stops the other ranks at once and names the
failing rank and its traceback; with
``--max-restarts N --resume`` the job restarts from the latest checkpoint. The
first rank to fail reports its reason (``distributed.report_failure``), and every
other rank stops with ``PeerFailed`` naming that rank and reason rather than with
the broken collective it was left in.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from scheduler_service.core.plan import SchedulerName
from trainer_client.config import TrainConfig
from trainer_client.dacp.attention import AttentionBackend
from trainer_client.distributed import DEFAULT_COLLECTIVE_TIMEOUT_S, PeerFailed, init_parallel, report_failure
from trainer_client.lora import LORA_TARGETS, LoraExport
from trainer_client.loss import DEFAULT_CHUNK_TOKENS
from trainer_client.parallelize import ActivationCheckpointing, Sharding
from trainer_client.plan_client import DEFAULT_PLAN_ATTEMPTS, DEFAULT_PLAN_TIMEOUT_S
from trainer_client.torch_compat import check_torch_version
from trainer_client.trainer import Trainer

__all__ = ["build_parser", "main"]

EXIT_USER_ERROR = 2
# Before there is a process group, rank 0 reports a user error; the others wait this long for it (torchrun stops every
# rank as soon as one exits, and rank 0 could be stopped before it prints), and report it themselves if not stopped.
REPORT_GRACE_S = 30.0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m trainer_client.train", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--dp", type=int, required=True, help="data-parallel degree")
    parser.add_argument("--cp", type=int, required=True, help="context-parallel degree")
    parser.add_argument("--model", default="tiny", help="a built-in model name or a local HF checkpoint directory")
    parser.add_argument("--data", default="synthetic:lmsys",
                        help="synthetic:{wikipedia,lmsys,chatqa2}, a JSONL file or a local datasets directory of "
                             "input_ids, messages (chat) or text records")
    parser.add_argument("--tokenizer", help="a local tokenizer directory (for messages and text records)")
    parser.add_argument("--global-batch", type=int, default=16, help="sequences per global batch")
    length = parser.add_mutually_exclusive_group()
    length.add_argument("--steps", type=int, default=20, help="optimizer steps (one per global batch)")
    length.add_argument("--epochs", type=int,
                        help="train every record this many times (a JSONL file or datasets directory): the steps "
                             "are epochs × records / --global-batch, rounded up")
    parser.add_argument("--no-shuffle", action="store_true",
                        help="train records in file order; by default each epoch is a permutation seeded by --seed "
                             "and the epoch, the same on every rank and kept across --resume")
    parser.add_argument("--scheduler", default="skrull", choices=[s.value for s in SchedulerName])
    parser.add_argument("--scheduler-url", help="the scheduler service; absent: plan with the embedded core")
    parser.add_argument("--bucket-size", type=int, help="tokens per CP rank per micro-batch (default: from profile)")
    parser.add_argument("--profile", help="hardware profile for the performance model: auto (measured by every rank "
                                          "before the first step, cached per machine and layout), a name, or a "
                                          "profile file from python -m trainer_client.profile (default: auto on "
                                          "CUDA, the planner's on CPU)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--weight-decay", type=float, default=0.0)
    parser.add_argument("--warmup-steps", type=int, default=0, help="linear warmup steps before the cosine decay")
    parser.add_argument("--min-lr-ratio", type=float, default=0.1, help="the cosine ends at lr × this")
    parser.add_argument("--max-grad-norm", type=float, default=1.0, help="clip the global gradient norm; 0: off")
    parser.add_argument("--sharding", default=Sharding.ZERO2.value, choices=[s.value for s in Sharding],
                        help="FSDP2 over all DP × CP ranks: zero2 keeps parameters unsharded for the step, zero3 "
                             "reshards after every forward; none: replicated, one all-reduce")
    parser.add_argument("--activation-checkpointing", default=ActivationCheckpointing.NONE.value,
                        choices=[a.value for a in ActivationCheckpointing],
                        help="per decoder layer: selective recomputes the MLP, full the whole layer")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile each decoder layer (dynamic shapes; attention stays eager): fewer, "
                             "fused kernels, so a GPU's launch-bound micro-batches run faster; the first steps "
                             "pay the compilation")
    parser.add_argument("--loss-chunk-tokens", type=int, default=DEFAULT_CHUNK_TOKENS,
                        help="tokens per chunk of the LM head + cross-entropy (bounds the fp32 logits held)")
    parser.add_argument("--checkpoint-dir", type=Path, help="save DCP checkpoints here")
    parser.add_argument("--checkpoint-every", type=int, default=0,
                        help="steps between checkpoints (0: after the last step only)")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the latest checkpoint in --checkpoint-dir when there is one; it must "
                             "have been written with the same --model, --dp × --cp, --global-batch and --data "
                             "(another schedule is accepted)")
    parser.add_argument("--resume-accept-data-change", action="store_true",
                        help="with --resume: accept a checkpoint trained on other --data (another source, or the "
                             "same one changed) and continue from its saved data position")
    parser.add_argument("--output-dir", type=Path,
                        help="after the last step, write the trained model here as a Hugging Face folder "
                             "(safetensors weights, config, generation config, and the --tokenizer if given), "
                             "ready for AutoModelForCausalLM.from_pretrained; its parent directory must exist")
    parser.add_argument("--export-every", type=int,
                        help="also export every N steps before the last, into OUTPUT_DIR/step-N (the step number "
                             "zero-padded to 8 digits, as checkpoints are); needs --output-dir")
    parser.add_argument("--export-lora", default=LoraExport.MERGED.value, choices=[e.value for e in LoraExport],
                        help="after a LoRA run, --output-dir holds the model with the adapters merged into its "
                             "weights, or the adapter alone (for a --model checkpoint folder, its base)")
    evaluation = parser.add_argument_group("evaluation", "mean token loss on held-out records, planned and sharded "
                                                         "like training, no optimizer step")
    evaluation.add_argument("--eval-data", help="a JSONL file or a local datasets directory of held-out records "
                                                "(the formats --data takes); none may be longer than --max-length")
    evaluation.add_argument("--eval-every", type=int, default=0,
                            help="steps between evaluations (0: after the last step only)")
    lora = parser.add_argument_group("LoRA", "train low-rank adapters (peft) on a frozen model: only the adapters "
                                             "carry gradients and optimizer state, so the BucketSize grows")
    lora.add_argument("--lora-rank", type=int, help="the adapters' rank; absent: full fine-tuning")
    lora.add_argument("--lora-alpha", type=int, help="scale the adapters by alpha / rank (default: 2 × rank)")
    lora.add_argument("--lora-targets", default=",".join(LORA_TARGETS),
                      help="comma-separated projections of each decoder layer to adapt")
    parser.add_argument("--tensorboard-dir", type=Path,
                        help="also write the step metrics (loss, eval loss, learning rate, gradient norm, tokens/s, "
                             "plan source, predicted and measured step time) as TensorBoard scalars here")
    parser.add_argument("--collective-timeout", type=float, default=DEFAULT_COLLECTIVE_TIMEOUT_S,
                        help="seconds any collective of any process group may wait for a peer")
    parser.add_argument("--max-length", type=int, help="longest record accepted (default: bucket_size × cp)")
    parser.add_argument("--truncate", action="store_true", help="cut records longer than --max-length")
    parser.add_argument("--metrics-out", type=Path, help="write one JSON line of metrics per step here")
    parser.add_argument("--plan-timeout", type=float, default=DEFAULT_PLAN_TIMEOUT_S,
                        help="seconds per POST /plan attempt")
    parser.add_argument("--plan-attempts", type=int, default=DEFAULT_PLAN_ATTEMPTS,
                        help="POST /plan attempts before falling back")
    parser.add_argument("--attention-backend", default="auto", choices=[b.value for b in AttentionBackend])
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], help="default: float32 on CPU, bfloat16 on CUDA")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--feedback", action="store_true",
                        help="report measured micro-batch times (and peak memory on CUDA) to the service, which "
                             "refits this job's profile (POST /feedback; needs --scheduler-url)")
    parser.add_argument("--job-id", help="the job name the service keys feedback by: 1-128 letters, digits, "
                                         ". _ : -, starting with a letter or digit (default: random)")
    fault = parser.add_argument_group("fault injection", "for tests of failure handling; never in real runs")
    fault.add_argument("--fail-rank", type=int, help="the global rank that raises InjectedFault")
    fault.add_argument("--fail-at-step", type=int, help="the step at whose start it raises")
    return parser


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(
        dp=args.dp, cp=args.cp, model=args.model, data=args.data, global_batch=args.global_batch, steps=args.steps,
        epochs=args.epochs, shuffle=not args.no_shuffle,
        scheduler=args.scheduler, scheduler_url=args.scheduler_url, bucket_size=args.bucket_size,
        profile=args.profile, seed=args.seed, lr=args.lr, weight_decay=args.weight_decay,
        warmup_steps=args.warmup_steps, min_lr_ratio=args.min_lr_ratio, max_grad_norm=args.max_grad_norm,
        sharding=args.sharding, activation_checkpointing=args.activation_checkpointing,
        loss_chunk_tokens=args.loss_chunk_tokens, compile=args.compile, checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every, resume=args.resume,
        resume_accept_data_change=args.resume_accept_data_change, output_dir=args.output_dir,
        export_every=args.export_every, eval_data=args.eval_data, eval_every=args.eval_every,
        lora_rank=args.lora_rank, lora_alpha=args.lora_alpha,
        lora_targets=tuple(target.strip() for target in args.lora_targets.split(",") if target.strip()),
        export_lora=args.export_lora, tensorboard_dir=args.tensorboard_dir,
        collective_timeout_s=args.collective_timeout,
        max_length=args.max_length, truncate=args.truncate, tokenizer=args.tokenizer, metrics_out=args.metrics_out,
        plan_timeout_s=args.plan_timeout, plan_attempts=args.plan_attempts,
        attention_backend=args.attention_backend, dtype=args.dtype, progress=not args.no_progress,
        feedback=args.feedback, job_id=args.job_id, fail_rank=args.fail_rank, fail_at_step=args.fail_at_step,
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    is_main = int(os.environ.get("RANK", "0")) == 0
    logging.basicConfig(level=logging.INFO if is_main else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    trainer = None
    try:
        if (warning := check_torch_version()) is not None and is_main:
            logging.getLogger("trainer_client.train").warning(warning)
        config = config_from_args(args)
        config.dims.check_world_size(int(os.environ.get("WORLD_SIZE", "1")))  # before any process group work
        parallel = init_parallel(config.dims, timeout_s=config.collective_timeout_s)
        trainer = Trainer(config, parallel)
        history = trainer.train()
        if is_main:
            for metrics in history:
                evaluated = f" eval {metrics.eval_loss:.6f}" if metrics.eval_loss is not None else ""
                print(f"step {metrics.step:>4} loss {metrics.loss:.6f}{evaluated} plan {metrics.plan_source}",
                      flush=True)
    except Exception as error:
        first = report_failure(error)
        if first is not None and first.global_rank != dist.get_rank():
            if isinstance(error, ValueError) and first.reason == f"{type(error).__name__}: {error}":
                return EXIT_USER_ERROR  # the same user error on every rank: the first reports it
            raise PeerFailed(first) from error
        if not isinstance(error, ValueError):
            raise
        # A user error: the first rank to fail reports it (rank 0 before there is a process group to tell).
        if first is None and not is_main:
            time.sleep(REPORT_GRACE_S)  # rank 0 has the same error, reports it and exits: torchrun stops us here
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USER_ERROR
    finally:
        if trainer is not None:
            trainer.close()
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    # Recorded for torchrun's error summary only here: tests call main() in a process whose stderr has no fileno.
    sys.exit(record(main)())
