"""``skrull-train …`` or ``torchrun --nproc-per-node DP×CP -m trainer_client.train …``: parse → build → train → close.

Example (4 CPU processes, plans from a local scheduler service):

    skrull-train --dp 2 --cp 2 --model tiny \\
      --data synthetic:lmsys --global-batch 16 --steps 20 --scheduler skrull \\
      --scheduler-url http://127.0.0.1:8000 --bucket-size 4096 --seed 0 --metrics-out metrics.jsonl

or the same settings in a file, keyed by field name (``examples/sft.yaml``), flags given over it:

    torchrun --nproc-per-node 4 -m trainer_client.train --config run.yaml --steps 40

The flags and the file's keys are ``config.TrainConfig``'s fields, declared once there. ``--help`` and the
configuration's checks import no torch (``config.py``).

**Launching.** Under a launcher (torchrun sets ``LOCAL_RANK``), this process is one rank. Started without one
(``skrull-train``, ``python -m trainer_client.train``), it checks the configuration and then, for dp × cp > 1, runs
torchrun's own launcher in this process (``torchrun --standalone --nproc-per-node DP×CP``: one node) with this
command line, and ends with the workers' status: 2 after a user error, which a worker printed, without torchrun's
summary of a failed worker (about 30 lines that a user error does not need); 128 + the signal after a stop, without
the agent's log and traceback of the signal. Several nodes, and restarts (``--max-restarts``), take torchrun.

**Stopping.** SIGINT (Ctrl-C) or SIGTERM (a cluster's preemption) to the launcher or to any rank stops every rank at
the end of the step in flight, which saves its checkpoint there (with ``--checkpoint-dir``; an async one is
complete before the exit) and exits with 128 + the signal (130, 143); rank 0 prints what was saved and the command
that resumes it, ``stopped by SIGINT after step 2 of 6: saved ck/step-00000002; resume with: skrull-train …
--resume``. A second Ctrl-C abandons the step, a save in progress with it, and the line names the complete
checkpoint ``--resume`` takes instead (``components/stop.py``). torchrun's own agent prints its traceback of the
signal and exits with status 1; ``skrull-train`` does not.

**Errors.** A user error (a ``ValueError``: bad flags or keys, world size ≠ dp × cp, records that cannot train, a
``--resume`` of another run's checkpoint, a model folder without weights, …) ends the job with exit status 2 and
one message on stderr, ``error: …`` (and a ``hint:`` where there is one), printed once: by the first rank to fail
(``distributed.report_failure``), where every rank has the same error by rank 0; the other ranks exit quietly with
status 2, also those whose collective the failure cut short, and a usage error of argparse is printed by rank 0
alone. Its traceback is printed too with ``--debug``. Any other failure of a rank is recorded for torchrun
(``@record``): the agent stops the other ranks at once and names the failing rank and its traceback; with
``--max-restarts N --resume`` the job restarts from the newest complete checkpoint. Every other rank stops with
``PeerFailed`` naming that rank and reason rather than with the broken collective it was left in. torchrun stops
the ranks still running with SIGTERM, which ``main`` turns into ``SystemExit`` (exit status 128 + 15) at once, not a
stop at the step boundary, for it finds the failure reported: the trainer is closed as on any other failure, so the
trackers record the run as failed instead of leaving it running.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import signal
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from trainer_client.flags import add_flags, config_from_args, flag_aliases, foreign_flag_refusal

if TYPE_CHECKING:
    from trainer_client.components.stop import TrainingStopped
    from trainer_client.trainer import Trainer

__all__ = ["build_parser", "main"]

EXIT_USER_ERROR = 2
_STOPPED = (128 + signal.SIGINT, 128 + signal.SIGTERM)  # the exit status of a rank a signal stopped
# Before there is a process group, rank 0 reports a user error; the others wait this long for it (torchrun stops every
# rank as soon as one exits, and rank 0 could be stopped before it prints), and report it themselves if not stopped.
REPORT_GRACE_S = 30.0
_LAUNCHED = ("LOCAL_RANK", "RANK")  # set for every rank by torchrun (and by spawn_gloo in tests)
_MODULE = "trainer_client.train"
_COMMAND = "SKRULL_TRAIN_COMMAND"  # set by skrull-train's launcher for its ranks: how the user started the job


def _global_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _program() -> str:
    """How the user started this process, for the usage line, its hints and the resume command to name."""
    return "skrull-train" if Path(sys.argv[0]).name == "skrull-train" else f"python -m {_MODULE}"


class _Parser(argparse.ArgumentParser):
    """argparse's parser, which also reads another trainer's spelling of a flag Skrull has (``--learning-rate`` is
    ``--lr``, ``flags.flag_aliases``), and whose usage error is one line, ``error: …``, and a hint (why Skrull has
    no ``--gradient-accumulation-steps``, and what replaces it), printed by global rank 0 alone: under torchrun
    every rank parses the same command line, and argparse would print its usage (some 60 lines) on each."""

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None,
    ) -> tuple[argparse.Namespace, list[str]]:
        aliases = flag_aliases()
        spelled: list[str] = []
        for token in sys.argv[1:] if args is None else args:
            flag, equals, value = token.partition("=")
            if spelled and self._takes_a_value(spelled[-1]) and _is_number(token):
                spelled[-1] += "=" + token  # --lr -1e-4: argparse reads a negative number as a flag of its own
                continue
            spelled.append(aliases.get(flag, flag) + equals + value if flag.startswith("--") else token)
        return super().parse_known_args(spelled, namespace)

    def _takes_a_value(self, token: str) -> bool:
        action = self._option_string_actions.get(token)
        return action is not None and action.nargs is None

    def error(self, message: str) -> NoReturn:
        if _global_rank() != 0:
            time.sleep(REPORT_GRACE_S)  # rank 0 prints it and exits, and torchrun stops this rank meanwhile
            self.exit(EXIT_USER_ERROR)
        refusals = [refusal for token in message.split() if (refusal := foreign_flag_refusal(token)) is not None]
        hints = refusals or [f"{self.prog} --help lists the flags"]
        self.exit(EXIT_USER_ERROR, f"error: {message}\n" + "".join(f"hint: {hint}\n" for hint in hints))


def _is_number(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return True


def build_parser() -> argparse.ArgumentParser:
    """The trainer's flags, generated from ``TrainConfig`` (``flags.add_flags``), with ``--config``; the usage
    line names the required flags alone (argparse's own lists all 60, in some 55 lines)."""
    parser = _Parser(prog=_program(), usage="%(prog)s --dp DP --cp CP [--config FILE] [FLAG ...]",
                     description="Train a model on Skrull's plans: dp × cp ranks on this machine, or one rank under "
                                 "torchrun. Each flag is also a key of a --config file.")
    add_flags(parser)
    return parser


def main(argv: Sequence[str] | None = None, *, recorded: bool = False) -> int:
    """Train as the command line ``argv`` says (module docstring, "Launching"); the exit status. ``recorded``: a
    failure that is not the user's is recorded for torchrun's summary (``@record``)."""
    command = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if not any(name in os.environ for name in _LAUNCHED):
        try:
            config = config_from_args(args)
        except ValueError as error:
            return _user_error(error, debug=bool(getattr(args, "debug", False)))
        if config.dp * config.cp > 1:
            return _launch(command, config.dp * config.cp)
    run: Callable[[argparse.Namespace, list[str]], int | None] = _run
    if recorded:
        from torch.distributed.elastic.multiprocessing.errors import record

        run = record(_run)
    from trainer_client.components.stop import stop_signals

    # SIGINT and SIGTERM stop the training loop at a step boundary, and elsewhere raise SystemExit: the trainer and
    # its trackers close, also where torchrun stops the ranks a failure left (components/stop.py).
    with stop_signals():
        return run(args, command) or 0


def _user_error(error: BaseException, *, debug: bool) -> int:
    """Print a user error as ``error: …`` (its traceback before it with ``--debug``); the exit status."""
    if debug:
        traceback.print_exception(error)
    print(f"error: {error}", file=sys.stderr)
    return EXIT_USER_ERROR


def _launch(argv: list[str], num_processes: int) -> int:
    """``torchrun --standalone --nproc-per-node NUM_PROCESSES -m trainer_client.train ARGV`` in this process; the
    workers' exit status. A worker prints its own error, so a user error (status 2) ends here without torchrun's
    summary, and another failure with the summary alone (the failing worker printed its traceback)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    os.environ.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default for several processes, without its warning
    # The ranks' stop line names the command that resumes the job (train.py's own name, under torchrun).
    os.environ[_COMMAND] = _program()
    logging.disable(logging.ERROR)  # the agent's own log of a failed worker: the worker said what went wrong
    launch = get_args_parser().parse_args(["--standalone", "--nproc-per-node", str(num_processes), "-m", _MODULE,
                                           *argv])
    try:
        run(launch)
    except ChildFailedError as error:
        _, first = error.get_first_failure()
        if first.exitcode in (EXIT_USER_ERROR, *_STOPPED):  # a worker printed the error, or rank 0 the stop
            return first.exitcode
        print(error, file=sys.stderr)
        return 1
    except SignalException as error:  # the agent got it, sent it to the workers and waited for them (stop.py)
        return 128 + int(error.sigval)
    except KeyboardInterrupt:  # before the agent handles SIGINT: no worker started yet
        return 128 + signal.SIGINT
    return 0


def _run(args: argparse.Namespace, command: list[str]) -> int:
    """Train as one rank of the job started by ``command`` (its flags); a user error's or a stop's exit status
    (module docstring, "Errors", "Stopping")."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.api import CheckpointException

    from trainer_client.components.stop import TrainingStopped, abandoned
    from trainer_client.distributed import ParallelDims, PeerFailed, init_parallel, report_failure
    from trainer_client.distributed.torch_compat import check_torch_version
    from trainer_client.trainer import Trainer

    is_main = _global_rank() == 0
    debug = bool(getattr(args, "debug", False))
    logging.basicConfig(level=logging.INFO if is_main or debug else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    trainer = None
    stopped: TrainingStopped | None = None
    try:
        if (warning := check_torch_version()) is not None and is_main:
            logging.getLogger("trainer_client.train").warning(warning)
        config = config_from_args(args)
        debug = config.debug
        dims = ParallelDims.of(config)
        dims.check_world_size(int(os.environ.get("WORLD_SIZE", "1")))  # before any process group work
        parallel = init_parallel(dims, timeout_s=config.collective_timeout_s)
        trainer = Trainer(config, parallel)
        trainer.train()
    except TrainingStopped as stop:  # every rank left the loop at a step boundary, or gave its step up
        stopped = stop
    except CheckpointException:  # a BaseException: DCP gathers what broke a save, a second signal's stop too
        stopped = abandoned()
        if stopped is None:
            raise
    except Exception as error:
        stopped = abandoned()  # this rank gave its step up on a signal, which reached its peers too
        if stopped is not None:  # and this collective broke as a peer gave up its own
            if debug:
                traceback.print_exception(error)
        else:
            user_error = isinstance(error, ValueError)
            first = report_failure(error, user_error=user_error)
            if first is not None and first.global_rank != dist.get_rank():
                if first.user_error:
                    return EXIT_USER_ERROR  # the first rank to fail reports it; this rank's error followed from it
                raise PeerFailed(first) from error
            if not user_error:
                raise
            # A user error: the first rank to fail reports it (rank 0 before there is a process group to tell).
            if first is None and not is_main:
                time.sleep(REPORT_GRACE_S)  # rank 0 has the same error, reports it and exits: torchrun stops us here
            return _user_error(error, debug=debug)
    finally:
        if trainer is not None:
            trainer.close()
        if dist.is_initialized():
            dist.destroy_process_group()
    if is_main and trainer is not None:
        for metrics in trainer.history:  # this launch's steps, also where a signal stopped it
            evaluated = f" eval {metrics.eval_loss:.6f}" if metrics.eval_loss is not None else ""
            print(f"step {metrics.step:>4} loss {metrics.loss:.6f}{evaluated} plan {metrics.plan_source}", flush=True)
    if stopped is None:
        return 0
    if is_main:
        print(_stop_line(stopped, trainer, command), file=sys.stderr, flush=True)
    return stopped.exit_status


def _stop_line(stopped: TrainingStopped, trainer: Trainer | None, command: list[str]) -> str:
    """Rank 0's one line on a stop: at which step, what was saved, and the command that resumes the job
    (``stopped by SIGINT after step 2 of 6: saved ck/step-00000002; resume with: skrull-train … --resume``)."""
    from trainer_client.components.checkpoint import cut_short, latest_checkpoint

    if trainer is None:
        return f"stopped by {stopped.how()} before training: nothing trained"
    done, steps, directory = trainer.num_steps_done, trainer.config.steps, trainer.config.checkpoint_dir
    where = f"during step {done + 1} of {steps}" if stopped.abandoned else f"after step {done} of {steps}"
    if directory is None:
        return f"stopped by {stopped.how()} {where}: nothing saved (the run has no --checkpoint-dir)"
    if stopped.checkpoint is not None:
        saved = f"saved {stopped.checkpoint}"
    else:
        newest = latest_checkpoint(directory)
        unfinished = cut_short(directory)
        said = ["the step was abandoned"]
        if unfinished:
            said.append(f"the save of {unfinished[-1]} was cut short (it has no complete marker)")
        if newest is None:
            return f"stopped by {stopped.how()} {where}: {'; '.join(said)}; no complete checkpoint to resume from"
        said.append(f"--resume takes {newest}")
        saved = "; ".join(said)
    return f"stopped by {stopped.how()} {where}: {saved}; resume with: {_resume_command(command)}"


def _resume_command(command: list[str]) -> str:
    """The command that resumes the job: the one that started it (``command``: its flags), with ``--resume``."""
    flags = [flag for flag in command if flag != "--no-resume"]
    if "--resume" not in flags:
        flags.append("--resume")
    launcher = os.environ.get(_COMMAND)
    if launcher is None and "TORCHELASTIC_RUN_ID" in os.environ:  # torchrun's rank
        per_node, world_size = int(os.environ["LOCAL_WORLD_SIZE"]), int(os.environ["WORLD_SIZE"])
        nodes = "--standalone" if per_node == world_size else f"--nnodes {world_size // per_node} …"
        launcher = f"torchrun {nodes} --nproc-per-node {per_node} -m {_MODULE}"
    return f"{launcher or f'python -m {_MODULE}'} {shlex.join(flags)}"


if __name__ == "__main__":
    # Recorded for torchrun's error summary only here: tests call main() in a process whose stderr has no fileno.
    sys.exit(main(recorded=True))
