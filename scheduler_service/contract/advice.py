"""The layout advisor at its edges: the wire request (``skrull_proto.advise.AdviseRequest``) to the core's
``LayoutProblem``, and the core's ``Advice`` to what a reader gets: the sentence on why the winner wins, each
layout's trainer settings (``trainer_settings``: its torchrun command line, or the config file
``skrull-advise --emit-config`` writes), and the document ``POST /advise`` answers and ``skrull-advise --json``
writes.

The core (``core.advise``) only searches; the service (``runtime.advising``) and the CLI
(``trainer_client.advise``) both say what it found through this module, so the two never drift apart: the same
defaults (``DEFAULT_GLOBAL_BATCH``, ``DTYPE_BYTES``), the same words and the same commands.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from skrull_proto.advise import ADVICE_SCHEMA_VERSION
from skrull_proto.advise import AdviseRequest as AdviseRequestModel

from scheduler_service.core.advise import (
    Advice,
    AdviseLimits,
    ExcludedLayout,
    GlobalBatchSize,
    Layout,
    LayoutProblem,
    PricedLayout,
)
from scheduler_service.core.memory import ActivationCheckpointing, Sharding
from scheduler_service.core.models import ModelShape, resolve_model
from scheduler_service.core.plan import SchedulerName
from scheduler_service.core.profile import Profile, resolve_profile

__all__ = [
    "DEFAULT_GLOBAL_BATCH",
    "DTYPE_BYTES",
    "MASTER_PORT",
    "TrainerSources",
    "advice_document",
    "global_batch_size",
    "layout_problem",
    "shell_command",
    "trainer_argv",
    "trainer_launcher",
    "trainer_settings",
    "why",
]

DEFAULT_GLOBAL_BATCH = 64  # sequences per step when a request names neither a batch nor a token budget
# The dtypes the trainer computes in (its --dtype), by the bytes of a weight the memory model counts.
DTYPE_BYTES: dict[str, int] = {"bfloat16": 2, "float32": 4}
MASTER_PORT = 29500
# Words a shell expands in a printed command (the head node's address, this node's rank): left unquoted.
_SHELL_VARIABLE = re.compile(r"\$[A-Z_]+")


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainerSources:
    """How the trainer's ``--data``, ``--tokenizer``, ``--model`` and ``--profile`` name what was advised on (a data
    file, the tokenizer that measured its ``messages`` or ``text`` records, a checkpoint folder, a profile file), as
    the CLI was given them. None: no ``--data`` (the service has only a sample), no tokenizer, and the model and
    profile by their names, which the trainer finds among the built-in ones."""

    data: str | None = None
    tokenizer: str | None = None
    model: str | None = None
    profile: str | None = None


# ---- in: the core's problem ---------------------------------------------------------------------------------------


def global_batch_size(*, sequences: int | None, tokens: int | None) -> GlobalBatchSize:
    """A token budget when one is given, else ``sequences`` (``DEFAULT_GLOBAL_BATCH`` when absent): the rule of
    the wire's ``global_batch``/``tokens_per_step`` and the CLI's ``--global-batch``/``--tokens-per-step``."""
    if tokens is not None:
        return GlobalBatchSize(num_tokens=tokens)
    return GlobalBatchSize(num_sequences=sequences or DEFAULT_GLOBAL_BATCH)


def layout_problem(request: AdviseRequestModel, *, limits: AdviseLimits,
                   extra_profiles: dict[str, Profile] | None = None) -> LayoutProblem:
    """The core's problem for a wire request, validated by the core (which names the offending field). A histogram
    is expanded here: bound its size first (``runtime.advising.check_sample_size``)."""
    if request.sequence_lengths is not None:
        lengths = np.asarray(request.sequence_lengths, dtype=np.int64)
    else:
        assert request.histogram is not None  # the wire model requires one of the two
        lengths = np.repeat(np.asarray([bar.length for bar in request.histogram], dtype=np.int64),
                            [bar.count for bar in request.histogram])
    model = request.model if isinstance(request.model, str) else ModelShape(**request.model.model_dump())
    return LayoutProblem(
        sequence_lengths=lengths, model=resolve_model(model), profile=resolve_profile(request.profile, extra_profiles),
        num_gpus=request.gpus, gpus_per_node=request.gpus_per_node,
        global_batch=global_batch_size(sequences=request.global_batch, tokens=request.tokens_per_step),
        shardings=tuple(Sharding(mode.value) for mode in request.shardings or Sharding),
        activation_checkpointing=tuple(ActivationCheckpointing(mode.value)
                                       for mode in request.activation_checkpointing or ()),
        cp_sizes=tuple(request.cp_sizes or ()), num_batches=request.num_batches, seed=request.seed,
        compute_bytes=DTYPE_BYTES[request.dtype], max_length=request.max_length, truncate=request.truncate,
        limits=limits,
    )


# ---- out: the trainer's command ---------------------------------------------------------------------------------


def trainer_settings(advice: Advice, layout: Layout, sources: TrainerSources) -> dict[str, str | int | bool]:
    """The trainer's settings for ``layout``, keyed by the field names of its config
    (``trainer_client.config.TrainConfig``): what ``skrull-advise --emit-config`` writes as a config file, and
    ``trainer_argv`` as flags. The trainer's global batch is a number of sequences: a token budget's is the mean
    drawn per step. The tokenizer goes with the data: the trainer encodes ``messages`` and ``text`` records with the
    one the lengths were measured with. ``max_length`` is the layout's limit (``LayoutProblem.sequence_limit``)
    when one was asked for, or when the sample holds sequences longer than one CP group, which the trainer's
    default (bucket_size × cp) would refuse though spanning trains them; ``truncate`` as asked."""
    problem = advice.problem
    data: dict[str, str | int | bool] = {"data": sources.data} if sources.data is not None else {}
    if sources.tokenizer is not None:
        data["tokenizer"] = sources.tokenizer
    global_batch = problem.global_batch.num_sequences or max(round(advice.mean_sequences_per_batch), 1)
    dtype = next(name for name, num_bytes in DTYPE_BYTES.items() if num_bytes == problem.compute_bytes)
    lengths: dict[str, int | bool] = {}
    if problem.max_length is not None or int(problem.lengths.max()) > layout.cp_group_capacity:
        lengths["max_length"] = problem.sequence_limit(layout)
    if problem.truncate:
        lengths["truncate"] = True
    return {"dp": layout.dp_size, "cp": layout.cp_size, "model": sources.model or problem.model.name, **data,
            "global_batch": global_batch, "sharding": layout.sharding.value,
            "activation_checkpointing": layout.activation_checkpointing.value, "bucket_size": layout.bucket_size,
            **lengths, "profile": sources.profile or problem.profile.name, "dtype": dtype,
            "scheduler": SchedulerName.SKRULL.value}


def trainer_launcher(problem: LayoutProblem) -> tuple[str, ...]:
    """``torchrun … -m trainer_client.train`` for ``problem``'s GPUs: one node's ``--nproc-per-node``, or
    ``--nnodes`` nodes of ``gpus_per_node`` meeting at ``$MASTER_ADDR``, each started with its ``$NODE_RANK``
    (static rendezvous: node ``n`` holds global ranks ``n·gpus_per_node`` on, the contiguous placement the topology
    model assumes)."""
    num_nodes = max(problem.num_gpus // problem.gpus_per_node, 1)
    launcher = (("torchrun", "--nproc-per-node", str(problem.num_gpus)) if num_nodes == 1 else
                ("torchrun", "--nnodes", str(num_nodes), "--nproc-per-node", str(problem.gpus_per_node),
                 "--node-rank", "$NODE_RANK", "--master-addr", "$MASTER_ADDR", "--master-port", str(MASTER_PORT)))
    return (*launcher, "-m", "trainer_client.train")


def trainer_argv(advice: Advice, layout: Layout, sources: TrainerSources) -> tuple[str, ...]:
    """``trainer_launcher`` with ``layout``'s settings as flags (``trainer_client.train.build_parser``): each field
    ``name`` is the flag ``--name`` with ``-`` for ``_``, followed by its value; a true one (``truncate``) is the
    flag alone, as the trainer's switches take it."""
    settings = trainer_settings(advice, layout, sources)
    flags = (word for name, value in settings.items()
             for word in (("--" + name.replace("_", "-"),) if value is True
                          else ("--" + name.replace("_", "-"), str(value))))
    return (*trainer_launcher(advice.problem), *flags)


def shell_command(argv: Sequence[str]) -> str:
    """``argv`` as one line a shell runs: quoted where needed, ``$VARIABLE`` words left for the shell."""
    return " ".join(word if _SHELL_VARIABLE.fullmatch(word) else shlex.quote(word) for word in argv)


# ---- out: why the winner wins -------------------------------------------------------------------------------------


def why(advice: Advice) -> str:
    """A sentence on why the winner wins, against the runner-up (a near tie is called one); then, where they apply,
    one on what micro-batches spanning DP replicas do for it and one on the sequences it leaves out or cuts."""
    return " ".join([_verdict(advice), *_spanning(advice), *_too_long(advice)])


def _verdict(advice: Advice) -> str:
    best = advice.layouts[0]
    if len(advice.layouts) == 1:
        held = "as much of the sample" if best.num_sequences_too_long else "the sample"
        return f"{best.layout.label} is the only layout that holds {held}."
    runner_up = advice.layouts[1]
    num_batches = advice.problem.num_batches
    lead = best.tokens_per_s_per_gpu / runner_up.tokens_per_s_per_gpu - 1
    verdict = (f"{best.layout.label} trains fastest: {best.tokens_per_s_per_gpu:,.0f} tokens/s per GPU, "
               f"{lead:.1%} more than {runner_up.layout.label}, with {_advantages(best, runner_up)}; it is "
               f"faster on {advice.winner_batches_won} of {num_batches} sampled batches.")
    if 2 * advice.winner_batches_won <= num_batches:
        verdict += (" A near tie: the runner-up is as good a choice, within what these batches can tell apart "
                    "(more --num-batches would).")
    return verdict


def _advantages(best: PricedLayout, runner_up: PricedLayout) -> str:
    """What the winner has that the runner-up lacks, as phrases."""
    a, b = best.layout, runner_up.layout
    phrases = []
    if a.bucket_size > b.bucket_size:
        phrases.append(f"a larger bucket ({a.bucket_size} vs {b.bucket_size} tokens per CP rank)")
    if best.micro_batches_per_step < runner_up.micro_batches_per_step:
        phrases.append(f"fewer micro-batches ({best.micro_batches_per_step:.1f} vs "
                       f"{runner_up.micro_batches_per_step:.1f} per step)")
    if best.sharded_share < runner_up.sharded_share:
        phrases.append(f"fewer sequences sharded ({best.sharded_share:.1%} vs {runner_up.sharded_share:.1%})")
    if b.spans_nodes and not a.spans_nodes:
        phrases.append("no collectives across nodes (the runner-up's CP blocks span nodes)")
    if a.dp_size > b.dp_size:
        phrases.append(f"more DP ranks to balance over ({a.dp_size} vs {b.dp_size})")
    if best.num_batches_spanning and not runner_up.num_batches_spanning:
        phrases.append("micro-batches spanning DP replicas (the runner-up's plans have none)")
    return ", ".join(phrases) or "a better-balanced plan for the same work"


def _spanning(advice: Advice) -> list[str]:
    """What micro-batches spanning DP replicas do for the winner: on how many batches its plans run some, and why
    (sequences too long for one CP group, or a plan faster under the model), and the sequences of the sample that
    only they hold."""
    best = advice.layouts[0]
    layout, problem = best.layout, advice.problem
    parts = []
    if best.num_batches_spanning:
        spanned, needed = best.num_sequences_spanned, best.num_sequences_needing_span
        cause = ("where the model finds that faster" if not needed else
                 "each too long for one CP group" if needed == spanned else
                 f"{needed} too long for one CP group, the others where the model finds that faster")
        parts.append(f"on {best.num_batches_spanning} of {problem.num_batches} sampled batches its plans run {spanned} "
                     f"sequence(s) in micro-batches over several replicas ({cause})")
    longest_held = int(problem.held(problem.sequence_limit(layout)).max())
    if longest_held > layout.cp_group_capacity:
        parts.append(f"only such micro-batches hold the sample's sequences longer than one CP group's "
                     f"{layout.cp_group_capacity:,} tokens (bucket_size × cp_size; the longest it holds has "
                     f"{longest_held:,})")
    return [f"Spanning DP replicas is part of why it wins: {'; '.join(parts)}."] if parts else []


def _too_long(advice: Advice) -> list[str]:
    """The sample's sequences the winner leaves out or cuts, what limits it, and the tokens they cost."""
    best = advice.layouts[0]
    if not best.num_sequences_too_long:
        return []
    problem = advice.problem
    limit = problem.sequence_limit(best.layout)
    cause = ("max_length" if limit == problem.max_length else
             f"its longest trainable sequence: no layout of {problem.num_gpus} GPUs holds more of the sample")
    fate = "cuts" if problem.truncate else "leaves out"
    return [f"It {fate} the sample's {best.num_sequences_too_long} sequence(s) longer than {limit:,} tokens "
            f"({cause}){' to that length' if problem.truncate else ''}: {best.too_long_token_share:.2%} of its "
            "tokens are not trained."]


# ---- out: the document --------------------------------------------------------------------------------------------


def advice_document(advice: Advice, sources: TrainerSources) -> dict[str, Any]:
    """The advice as the document ``skrull_proto.advise.AdviceDocument`` describes, as plain JSON values in the
    order the CLI writes them (each ranked layout's ``rank`` first); the service answers it in the model's own
    order. Not validated here: each edge validates it with ``AdviceDocument`` before it leaves."""
    problem = advice.problem
    batch = problem.global_batch
    return {
        "schema_version": ADVICE_SCHEMA_VERSION,
        "model": problem.model.name,
        "profile": problem.profile.name,
        "gpus": problem.num_gpus,
        "gpus_per_node": problem.gpus_per_node,
        "global_batch": ({"sequences": batch.num_sequences} if batch.num_sequences is not None
                         else {"tokens": batch.num_tokens}),
        "num_batches": problem.num_batches,
        "seed": problem.seed,
        "data": sources.data,
        "max_length": problem.max_length,
        "truncate": problem.truncate,
        "sample": {"num_sequences": int(problem.lengths.size), "longest": int(problem.lengths.max()),
                   "mean_length": float(problem.lengths.mean())},
        "mean_sequences_per_batch": advice.mean_sequences_per_batch,
        "mean_tokens_per_batch": advice.mean_tokens_per_batch,
        "why": why(advice),
        "layouts": [{"rank": rank, **_priced_layout(advice, priced, sources)}
                    for rank, priced in enumerate(advice.layouts, start=1)],
        "excluded": [_excluded_layout(item) for item in advice.excluded],
    }


def _layout(layout: Layout, *, num_sequences_too_long: int, too_long_token_share: float) -> dict[str, Any]:
    return {"dp_size": layout.dp_size, "cp_size": layout.cp_size, "bucket_size": layout.bucket_size,
            "sharding": layout.sharding.value, "activation_checkpointing": layout.activation_checkpointing.value,
            "longest_trainable_sequence": layout.longest_trainable_sequence, "spans_nodes": layout.spans_nodes,
            "spanning": layout.spanning, "num_sequences_too_long": num_sequences_too_long,
            "too_long_token_share": too_long_token_share}


def _priced_layout(advice: Advice, priced: PricedLayout, sources: TrainerSources) -> dict[str, Any]:
    spread = priced.step_time_spread
    return {
        **_layout(priced.layout, num_sequences_too_long=priced.num_sequences_too_long,
                  too_long_token_share=priced.too_long_token_share),
        "predicted_step_time_ms": priced.predicted_step_time_s * 1e3,
        "tokens_per_s_per_gpu": priced.tokens_per_s_per_gpu,
        "speedup_vs_static_cp": priced.speedup_vs_static_cp,
        "static_cp_step_time_ms": priced.static_cp_step_time_s * 1e3,
        "memory_headroom_bytes": priced.memory_headroom_bytes,
        "memory_headroom_fraction": priced.memory_headroom_fraction,
        "sharded_share": priced.sharded_share,
        "sharded_by_degree": [{"degree": degree, "share": share} for degree, share in priced.sharded_by_degree],
        "micro_batches_per_step": priced.micro_batches_per_step,
        "num_batches_spanning": priced.num_batches_spanning,
        "num_sequences_spanned": priced.num_sequences_spanned,
        "num_sequences_needing_span": priced.num_sequences_needing_span,
        # the wire's name for the spread: how far one step's time strays from the median
        "confidence": {"step_time_ms_min": spread.min_s * 1e3, "step_time_ms_p10": spread.p10_s * 1e3,
                       "step_time_ms_p90": spread.p90_s * 1e3, "step_time_ms_max": spread.max_s * 1e3,
                       "relative_spread": spread.relative_spread},
        "trainer_command": shell_command(trainer_argv(advice, priced.layout, sources)),
    }


def _excluded_layout(item: ExcludedLayout) -> dict[str, Any]:
    return {**_layout(item.layout, num_sequences_too_long=item.num_sequences_too_long,
                      too_long_token_share=item.too_long_token_share),
            "exclusion": item.exclusion.value, "reason": item.reason, "cp_size_needed": item.cp_size_needed}
