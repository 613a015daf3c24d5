"""``torchrun --nproc-per-node DP×CP -m trainer_client.train …``: parse → build → train → close.

Example (4 CPU processes, plans from a local scheduler service):

    torchrun --nproc-per-node 4 -m trainer_client.train --dp 2 --cp 2 --model tiny \\
      --data synthetic:lmsys --global-batch 16 --steps 20 --scheduler skrull \\
      --scheduler-url http://127.0.0.1:8000 --bucket-size 4096 --seed 0 --metrics-out metrics.jsonl

or the same settings in a file, keyed by field name (``examples/sft.yaml``), flags given over it:

    torchrun --nproc-per-node 4 -m trainer_client.train --config run.yaml --steps 40

The flags and the file's keys are ``config.TrainConfig``'s fields, declared once there.

Exit status 2 with one message on stderr for a user error (a torch older than
the supported range, bad flags, world size ≠ dp × cp, a record too long, a batch no planner can plan, ``--resume``
of a checkpoint another run wrote). Any other failure of a rank is recorded for
torchrun (``@record``): the agent stops the other ranks at once and names the
failing rank and its traceback; with
``--max-restarts N --resume`` the job restarts from the newest complete checkpoint. The
first rank to fail reports its reason (``distributed.report_failure``), and every
other rank stops with ``PeerFailed`` naming that rank and reason rather than with
the broken collective it was left in. torchrun stops the ranks still running with
SIGTERM, which ``main`` turns into ``SystemExit`` (exit status 128 + 15): the
trainer is closed as on any other failure, so the trackers record the run as
failed instead of leaving it running.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from types import FrameType

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from trainer_client.config import add_flags, config_from_args
from trainer_client.distributed import PeerFailed, init_parallel, report_failure
from trainer_client.torch_compat import check_torch_version
from trainer_client.trainer import Trainer

__all__ = ["build_parser", "main", "sigterm_exits"]

EXIT_USER_ERROR = 2
# Before there is a process group, rank 0 reports a user error; the others wait this long for it (torchrun stops every
# rank as soon as one exits, and rank 0 could be stopped before it prints), and report it themselves if not stopped.
REPORT_GRACE_S = 30.0


def build_parser() -> argparse.ArgumentParser:
    """The trainer's flags, generated from ``TrainConfig`` (``config.add_flags``), with ``--config``."""
    parser = argparse.ArgumentParser(prog="python -m trainer_client.train", description=__doc__.splitlines()[0])
    add_flags(parser)
    return parser


@contextmanager
def sigterm_exits() -> Iterator[None]:
    """Within: SIGTERM raises ``SystemExit(128 + SIGTERM)`` in the main thread, so that ``finally`` blocks run
    (Python's default action ends the process at once); after it, the previous handler again."""

    def exit_on_sigterm(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, exit_on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    with sigterm_exits():  # torchrun stops a rank with SIGTERM: the trainer and its trackers close as on a failure
        return _run(args)


def _run(args: argparse.Namespace) -> int:
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
