"""Ranking accuracy: does the performance model order micro-batches, steps and plans as the GPU measured them?

    python -m benchmarks.ranking                                   # every recording in benchmarks/measurements/
    python -m benchmarks.ranking benchmarks/measurements/h200-2026-11-26-gpu-check --out ranking.json
    python -m benchmarks.ranking gpu-check/accuracy.json --min-gap 0.03 --profile my-profile.json

A planner needs the right *order* of two candidates more than the right times. Over what a GPU run recorded, for
every pair of items (never across recordings: two machines' times are not comparable):

- **ordering**: does the model price the measured-faster item lower? A pair it prices equal (both at the
  launch-bound floor) counts half: its choice is a coin flip. The share is also given among the pairs whose measured
  times lie more than ``--min-gap`` apart (5 %): closer pairs are ties within the measurements' noise.
- **regret** of picking by the model: ``measured(chosen) / measured(faster) − 1``, 0 when it picks the faster; for
  a pair priced equal, the mean of the two choices. Its p50 and p95 over all pairs and over the pairs it orders
  wrong.

What is ranked (recordings are found in each folder given; ``logs.tar.gz`` is read too):

- **micro-batches**: the rows of ``benchmarks.accuracy``'s JSON (``accuracy*.json``), each timed on the GPU;
- **steps**: the trainer's steps (``train-*.jsonl``: their micro-batches' time, ``micro_batch_time_s``), every
  scheduler's steps of one run together; the first step is left out (it pays the warm-up, as ``make gpu-check``'s step
  estimates leave it out), and so are ``--compile`` runs (the profiles price eager execution);
- **plans of one batch**: per global batch, the ``skrull`` plan against the ``deepspeed`` plan (a trainer step's
  time, or the sum of the accuracy run's micro-batches of that plan): the choice a planner makes.

Nothing recorded holds the sequences, so each batch is drawn again as the run drew it (``sample_lengths``, the
same seeds) and planned again under the profile that run planned with. A recording is used only where that
reproduces it exactly: every micro-batch's sequences, tokens and recorded estimate (accuracy), every step's tokens,
micro-batches and estimated time (trainer). Then the plans are priced by the code as it is now (``simulate``) under
``--profile`` (default the shipped ``h200-qwen2.5-0.5b``, the launch-bound fit), under the paper's two-coefficient
fit of the same measurements (its ``fit.paper_eq14``, ``α·FLOPs + β``, as ``benchmarks.accuracy`` prices it) and
under its additive fit (``fit.extended``: per token and per sequence too, no floor). Where two recordings timed
the very same micro-batches (``make gpu-check``'s and the second H200's), each one's times also "predict" the
other's: how far a measured order repeats on another run.

The ranking maths (``pair_outcomes``, ``pairwise_ordering``, ``regret_percentiles``, ``choice_regret``) and the
summaries of recorded times (``recorded_sets``, which ``make gpu-check`` uses on the GPU machine's own Python) need
only the standard library and numpy; re-pricing imports the planning core.
"""

from __future__ import annotations

import argparse
import io
import itertools
import json
import math
import sys
import tarfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["Group", "PairOutcomes", "RankedSet", "choice_regret", "main", "pair_outcomes", "pairwise_ordering",
           "paper_profile", "print_table", "rank_set", "recorded_sets", "regret_percentiles", "repriced_sets"]

ROOT = Path(__file__).resolve().parents[1]
MEASUREMENTS = ROOT / "benchmarks" / "measurements"
MIN_GAP = 0.05  # pairs measured closer than this are ties within the noise
TIE_TOLERANCE = 1e-9  # predictions this close (relative) are equal: both at the floor
WARM_UP_STEPS = 1  # a run's first step pays one-off warm-up (allocator growth, first collectives)
SIZE_CLASS_TOKENS = 2048  # as make gpu-check reports: below it launch-bound on a GPU (the floor), above compute-bound
SHIPPED_PROFILE = "h200-qwen2.5-0.5b"
FloatArray = npt.NDArray[np.float64]

MICRO_BATCHES, STEPS, PLANS = "micro-batches", "steps", "plans of one batch"


# ---------------------------------------------------------------------------------------------------- the maths


@dataclass(frozen=True, kw_only=True, slots=True)
class PairOutcomes:
    """Every pair of items of one group (or of each of several groups), and how the model ranks it.

    ``gap``: how far apart the two measured times lie, ``|a − b| / min(a, b)``; ``credit``: 1 when the model prices
    the measured-faster one lower (or the two measured equal), 0 when it prices it higher, 0.5 when it prices them
    equal; ``regret``: ``measured(chosen) / measured(faster) − 1`` of picking the lower-priced one (for a pair priced
    equal, the mean of the two picks); ``classes``: per pair, its two items' labels (empty without labels)."""

    gap: FloatArray
    credit: FloatArray
    regret: FloatArray
    priced_equal: npt.NDArray[np.bool_]
    classes: tuple[str, ...] = ()

    @property
    def wrong(self) -> npt.NDArray[np.bool_]:
        """The pairs the model orders wrong: it prices the measured-slower one strictly lower."""
        return self.credit == 0.0

    def __len__(self) -> int:
        return len(self.gap)


def pair_outcomes(measured: Sequence[float], predicted: Sequence[float], *, groups: Sequence[Any] | None = None,
                  labels: Sequence[str] | None = None, tolerance: float = TIE_TOLERANCE) -> PairOutcomes:
    """The outcome of every pair ``i < j`` of items with the same group (every pair, without ``groups``).

    ``measured`` and ``predicted`` are positive times. Two predictions within ``tolerance`` (relative) of each other
    are equal: the model has no preference, a pick between them is a coin flip. ``labels``, one per item, give each
    pair a class: the two labels, sorted, joined by ``" / "``."""
    m, p = np.asarray(measured, dtype=np.float64), np.asarray(predicted, dtype=np.float64)
    if m.shape != p.shape or m.ndim != 1:
        raise ValueError(f"one measured and one predicted time per item: {m.shape} and {p.shape}")
    if not (np.all(m > 0) and np.all(p > 0)):
        raise ValueError("times must be positive")
    first, second = np.triu_indices(len(m), k=1)
    if groups is not None:
        index: dict[Any, int] = {}
        keys = np.asarray([index.setdefault(group, len(index)) for group in groups])
        same = keys[first] == keys[second]
        first, second = first[same], second[same]
    ma, mb, pa, pb = m[first], m[second], p[first], p[second]
    faster, slower = np.minimum(ma, mb), np.maximum(ma, mb)
    gap = slower / faster - 1.0
    priced_equal = np.abs(pa - pb) <= tolerance * np.maximum(pa, pb)
    agree = np.sign(ma - mb) == np.sign(pa - pb)
    measured_equal = ma == mb
    credit = np.where(measured_equal, 1.0, np.where(priced_equal, 0.5, np.where(agree, 1.0, 0.0)))
    regret = np.where(measured_equal, 0.0, np.where(priced_equal, gap / 2, np.where(agree, 0.0, gap)))
    classes: tuple[str, ...] = ()
    if labels is not None:
        classes = tuple(" / ".join(sorted((labels[i], labels[j])))
                        for i, j in zip(first.tolist(), second.tolist(), strict=True))
    return PairOutcomes(gap=gap, credit=credit, regret=regret, priced_equal=priced_equal & ~measured_equal,
                        classes=classes)


def pairwise_ordering(outcomes: PairOutcomes, *, min_gap: float = MIN_GAP) -> dict[str, Any]:
    """The share of pairs ordered correctly (a pair priced equal counts half), over all pairs, over the pairs the
    model does not price equal (``decided``), and over the pairs measured more than ``min_gap`` apart; how many
    pairs each, how many the model priced equal or ordered wrong, and how far apart the pairs were measured (median
    and closest). Shares are None where there is no pair."""
    separated = outcomes.gap > min_gap

    def share(mask: npt.NDArray[np.bool_]) -> float | None:
        return float(outcomes.credit[mask].mean()) if mask.any() else None

    everything = np.ones(len(outcomes), dtype=bool)
    decided = ~outcomes.priced_equal
    return {"pairs": len(outcomes), "priced_equal": int(outcomes.priced_equal.sum()), "ordered": share(everything),
            "decided_pairs": int(decided.sum()), "decided_ordered": share(decided),
            "min_gap": min_gap, "separated_pairs": int(separated.sum()), "separated_ordered": share(separated),
            "separated_priced_equal": int((outcomes.priced_equal & separated).sum()),
            "separated_decided_ordered": share(separated & decided),
            "wrong_pairs": int(outcomes.wrong.sum()),
            "measured_gap": {"p50": float(np.median(outcomes.gap)) if len(outcomes) else None,
                             "min": float(outcomes.gap.min()) if len(outcomes) else None}}


def regret_percentiles(regrets: Sequence[float] | FloatArray,
                       percentiles: Sequence[float] = (50, 95)) -> dict[str, float | None]:
    """``{"p50": …, "p95": …, "max": …}`` of the regrets (numpy's linear interpolation); None for none."""
    values = np.asarray(regrets, dtype=np.float64)
    if values.size == 0:
        return {**{f"p{q:g}": None for q in percentiles}, "max": None}
    return {**{f"p{q:g}": float(np.percentile(values, q)) for q in percentiles}, "max": float(values.max())}


def choice_regret(measured: Sequence[float], predicted: Sequence[float], *, tolerance: float = TIE_TOLERANCE) -> float:
    """The regret of picking the item the model prices lowest out of one group: ``measured(chosen) /
    min(measured) − 1``, the mean over the items priced equal to the lowest (a coin flip among them)."""
    m, p = np.asarray(measured, dtype=np.float64), np.asarray(predicted, dtype=np.float64)
    if m.size == 0 or m.shape != p.shape:
        raise ValueError("one measured and one predicted time per item, at least one item")
    chosen = p <= p.min() * (1 + tolerance)
    return float(m[chosen].mean() / m.min() - 1.0)


# ---------------------------------------------------------------------------------------------------- what is ranked


@dataclass(frozen=True, kw_only=True, slots=True)
class Group:
    """Items whose times are comparable (one recording, one run, one global batch): pairs are formed within it."""

    label: str
    measured_s: tuple[float, ...]
    predicted_s: tuple[float, ...]
    classes: tuple[str, ...] = ()  # per item, e.g. its size class; empty: none


@dataclass(frozen=True, kw_only=True, slots=True)
class RankedSet:
    """One kind of item (``MICRO_BATCHES``, ``STEPS``, ``PLANS``) priced by one fit, in groups."""

    fit: str
    ranked: str
    groups: list[Group] = field(default_factory=list)


def rank_set(ranked: RankedSet, *, min_gap: float = MIN_GAP) -> dict[str, Any]:
    """The ordering and regret figures of one set: its pairs within groups, the regret of picking by the model
    over all of them and over those it orders wrong, the regret of choosing the lowest-priced item of each group,
    (plans of one batch only: the choice a planner makes), and, where items carry classes, the ordering per pair of
    classes."""
    measured = [t for group in ranked.groups for t in group.measured_s]
    predicted = [t for group in ranked.groups for t in group.predicted_s]
    keys = [index for index, group in enumerate(ranked.groups) for _ in group.measured_s]
    labelled = all(len(group.classes) == len(group.measured_s) for group in ranked.groups)
    labels = [label for group in ranked.groups for label in group.classes] if labelled else None
    outcomes = pair_outcomes(measured, predicted, groups=keys, labels=labels) if measured else None
    if outcomes is None or len(outcomes) == 0:
        return {"fit": ranked.fit, "ranked": ranked.ranked, "groups": len(ranked.groups), "items": len(measured),
                "pairs": 0}
    summary: dict[str, Any] = {
        "fit": ranked.fit, "ranked": ranked.ranked, "groups": len(ranked.groups), "items": len(measured),
        "group_labels": [group.label for group in ranked.groups], **pairwise_ordering(outcomes, min_gap=min_gap),
        "regret": regret_percentiles(outcomes.regret),
        "wrong_regret": regret_percentiles(outcomes.regret[outcomes.wrong]),
    }
    if ranked.ranked == PLANS:
        summary["choice_regret"] = regret_percentiles([choice_regret(group.measured_s, group.predicted_s)
                                                       for group in ranked.groups if len(group.measured_s) > 1])
    if labels is not None:
        by_class = {}
        for label in sorted(set(outcomes.classes)):
            mask = np.array([c == label for c in outcomes.classes])
            part = PairOutcomes(gap=outcomes.gap[mask], credit=outcomes.credit[mask], regret=outcomes.regret[mask],
                                priced_equal=outcomes.priced_equal[mask])
            by_class[label] = {**pairwise_ordering(part, min_gap=min_gap), "regret": regret_percentiles(part.regret),
                               "wrong_regret": regret_percentiles(part.regret[part.wrong])}
        summary["by_class"] = by_class
    return summary


def _size_class(tokens_per_rank: float) -> str:
    return f"< {SIZE_CLASS_TOKENS}" if tokens_per_rank < SIZE_CLASS_TOKENS else f">= {SIZE_CLASS_TOKENS}"


def _numbered(records: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """A trainer's metrics lines, each ``step`` 1-based as the trainer numbers steps now (``StepMetrics.step``).
    A run recorded before it did (the 2026-11-26 recordings, kept as they came back) wrote its global batch's
    index, one less, and so holds a step 0."""
    if all(record["step"] > 0 for record in records):
        return list(records)
    return [{**record, "step": record["step"] + 1} for record in records]


def _warm_steps(records: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return [record for record in _numbered(records) if record["step"] > WARM_UP_STEPS
            and record["micro_batch_time_s"] > 0 and record.get("estimated_time_ms") is not None]


def _plan_groups(by_batch: Mapping[str, Mapping[str, tuple[float, float]]]) -> list[Group]:
    """Per global batch, its plans (scheduler → (measured, predicted)), where it has two or more."""
    return [Group(label=batch, measured_s=tuple(measured for measured, _ in plans.values()),
                  predicted_s=tuple(predicted for _, predicted in plans.values()))
            for batch, plans in by_batch.items() if len(plans) > 1]


def recorded_sets(accuracy: Mapping[str, Any] | None, runs: Mapping[str, Sequence[Mapping[str, Any]]], *,
                  source: str = "") -> list[RankedSet]:
    """The sets as a run recorded them, priced as it priced them: ``benchmarks.accuracy``'s JSON (each
    micro-batch's ``predicted_s`` under the run's profile, ``paper_predicted_s`` under its two-coefficient fit) and
    the trainer's metrics of the runs planned with that profile (name → step records; each step's
    ``estimated_time_ms``). Runs named ``train-<scheduler>-<layout>`` with the same layout rank together, and
    their steps of one global batch are the plans of that batch. Standard library and numpy only: ``make
    gpu-check`` calls it on the GPU machine."""
    fits = {"the run's profile": "predicted_s", "paper α·FLOPs + β (the run's fit)": "paper_predicted_s"}
    own = next(iter(fits))  # the steps' estimates are the run's profile's only
    sets = {(fit, ranked): RankedSet(fit=fit, ranked=ranked) for fit in fits
            for ranked in (MICRO_BATCHES, STEPS, PLANS) if ranked != STEPS or fit == own}
    for case in (accuracy or {}).get("cases", []):
        rows = case["rows"]
        for fit, key in fits.items():
            sets[fit, MICRO_BATCHES].groups.append(Group(
                label=f"{source}cp{case['cp_size']}", measured_s=tuple(row["measured_s"] for row in rows),
                predicted_s=tuple(row[key] for row in rows),
                classes=tuple(_size_class(row["tokens_per_rank"]) for row in rows)))
            by_batch: dict[str, dict[str, tuple[float, float]]] = {}
            for row in rows:
                batch = f"{source}cp{case['cp_size']}-{row['dataset']}-{row['batch']}"
                measured, predicted = by_batch.setdefault(batch, {}).get(row["scheduler"], (0.0, 0.0))
                by_batch[batch][row["scheduler"]] = (measured + row["measured_s"], predicted + row[key])
            sets[fit, PLANS].groups.extend(_plan_groups(by_batch))
    by_layout: dict[str, list[tuple[str, Mapping[str, Any]]]] = {}
    for name, records in runs.items():
        scheduler, _, layout = name.removeprefix("train-").partition("-")
        for record in _warm_steps(records):
            by_layout.setdefault(layout, []).append((scheduler, record))
    for layout, steps in by_layout.items():
        sets[own, STEPS].groups.append(Group(
            label=f"{source}{layout}", measured_s=tuple(record["micro_batch_time_s"] for _, record in steps),
            predicted_s=tuple(record["estimated_time_ms"] / 1e3 for _, record in steps)))
        batches: dict[str, dict[str, tuple[float, float]]] = {}
        for scheduler, record in steps:
            batches.setdefault(f"{source}{layout}-step{record['step']}", {})[scheduler] = (
                record["micro_batch_time_s"], record["estimated_time_ms"] / 1e3)
        sets[own, PLANS].groups.extend(_plan_groups(batches))
    return [ranked for ranked in sets.values() if ranked.groups]


# ---------------------------------------------------------------------------------------------------- re-pricing


class NotReproduced(Exception):
    """A recording the current code cannot re-plan exactly: it is not used."""


@dataclass(frozen=True, kw_only=True, slots=True)
class _Fit:
    name: str
    profile: Any  # scheduler_service.core.profile.Profile


def _fits(profile_spec: str) -> list[_Fit]:
    """The profile to price with, its paper fit (``fit.paper_eq14``: α·FLOPs + β, as ``benchmarks.accuracy``'s
    ``_paper_profile`` builds it) and its additive fit (``fit.extended``), where the document has them."""
    from dataclasses import replace

    from scheduler_service.core.profile import ComputeProfile, builtin_profiles, parse_profile

    builtin = builtin_profiles()
    profile = builtin[profile_spec] if profile_spec in builtin else parse_profile(json.loads(Path(profile_spec)
                                                                                             .read_text()))
    fit_document = profile.raw.get("compute", {}).get("fit", {})
    form = "launch-bound" if profile.compute.floor_s_per_layer > 0 else "additive"
    fits = [_Fit(name=f"{profile.name} ({form}, as shipped)" if profile_spec in builtin else profile.name,
                 profile=profile)]
    paper = fit_document.get("paper_eq14")
    if paper is not None:
        fits.append(_Fit(name="paper α·FLOPs + β (its fit.paper_eq14)", profile=paper_profile(profile)))
    extended = fit_document.get("extended")
    if extended is not None and profile.compute.floor_s_per_layer > 0:
        compute = ComputeProfile(alpha_s_per_flop=extended["alpha_s_per_flop"],
                                 beta_s_per_layer=extended["beta_s_per_layer"],
                                 alpha_s_per_token=extended["alpha_s_per_token"],
                                 alpha_s_per_sequence=extended["alpha_s_per_sequence"],
                                 attention_efficiency=profile.compute.attention_efficiency)
        fits.append(_Fit(name="additive, no floor (its fit.extended)",
                         profile=replace(profile, name=f"{profile.name}-extended", compute=compute)))
    return fits


def paper_profile(profile: Any) -> Any:
    """The profile's measurements fitted with eq. 14 alone (α·FLOPs + β): ``benchmarks.accuracy._paper_profile``,
    which imports torch, built the same way (``tests/test_ranking.py`` checks the two agree)."""
    from dataclasses import replace

    from scheduler_service.core.profile import ComputeProfile

    paper = profile.raw["compute"]["fit"]["paper_eq14"]
    compute = ComputeProfile(alpha_s_per_flop=paper["alpha_s_per_flop"], beta_s_per_layer=paper["beta_s_per_layer"])
    return replace(profile, name=f"{profile.name}-eq14", compute=compute)


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-12)


def _plan(lengths: Sequence[int], *, scheduler: str, profile: Any, model: str, dp: int, cp: int,
          bucket_size: int) -> tuple[Any, Any]:
    from scheduler_service.core.plan import make_problem
    from scheduler_service.core.planner import make_plan

    problem = make_problem(sequence_lengths=lengths, dp_size=dp, cp_size=cp, model=model, bucket_size=bucket_size,
                           profile=profile)
    return problem, make_plan(problem, scheduler)


def _estimate(plan: Any, lengths: Sequence[int], *, profile: Any, model: str, dp: int, cp: int,
              bucket_size: int) -> Any:
    from scheduler_service.core.plan import make_problem
    from scheduler_service.core.simulate import simulate

    problem = make_problem(sequence_lengths=lengths, dp_size=dp, cp_size=cp, model=model, bucket_size=bucket_size,
                           profile=profile)
    return simulate(problem, plan)


@dataclass(frozen=True, kw_only=True, slots=True)
class _Replanned:
    """One recorded plan drawn and planned again: its lengths and plan, and what was measured of it."""

    batch: str
    scheduler: str
    lengths: tuple[int, ...]
    plan: Any
    measured_s: tuple[float, ...]  # per micro-batch (accuracy) or the step's (trainer)
    tokens_per_rank: tuple[float, ...] = ()


def _replan_accuracy(case: Mapping[str, Any]) -> tuple[list[_Replanned], dict[str, Any]]:
    """The plans of one ``benchmarks.accuracy`` case, drawn and planned again as it did (seed 0, DP 1); the global
    batch is the sequences of each plan, the BucketSize the first of the usual ones that reproduces every row."""
    from scheduler_service.core.profile import parse_profile
    from scheduler_service.core.samplers import sample_lengths

    document, rows, cp = case["profile"], case["rows"], case["cp_size"]
    model, profile = document["model"], parse_profile(document)
    order = list(dict.fromkeys((row["dataset"], row["batch"], row["scheduler"]) for row in rows))
    plans = {key: [row for row in rows if (row["dataset"], row["batch"], row["scheduler"]) == key] for key in order}
    global_batch = sum(row["num_sequences"] for row in plans[order[0]])
    datasets = list(dict.fromkeys(row["dataset"] for row in rows))
    batches = 1 + max(row["batch"] for row in rows)
    schedulers = list(dict.fromkeys(row["scheduler"] for row in rows))
    for bucket_size in dict.fromkeys((16384, 2048 // cp, 512)):
        rng = np.random.default_rng(0)
        replanned, ok = [], True
        for dataset in datasets:
            for batch in range(batches):
                lengths = sample_lengths(dataset, global_batch, rng, max_length=bucket_size * cp).tolist()
                for scheduler in schedulers:
                    recorded = plans.get((dataset, batch, scheduler), [])
                    _, result = _plan(lengths, scheduler=scheduler, profile=profile, model=model, dp=1, cp=cp,
                                      bucket_size=bucket_size)
                    micro_batches = result.plan.dp_ranks[0].micro_batches
                    estimates = result.estimate.dp_ranks[0].micro_batches
                    ok = ok and len(micro_batches) == len(recorded) and all(
                        len(micro_batch.indices()) == row["num_sequences"]
                        and len(micro_batch.distributed) == row["num_distributed"]
                        and _close(estimate.time_s, row["predicted_s"])
                        and _close(max(rank.tokens for rank in estimate.cp_ranks), row["tokens_per_rank"])
                        for micro_batch, estimate, row in zip(micro_batches, estimates, recorded, strict=False))
                    replanned.append(_Replanned(
                        batch=f"{dataset}-{batch}", scheduler=scheduler, lengths=tuple(lengths), plan=result.plan,
                        measured_s=tuple(row["measured_s"] for row in recorded),
                        tokens_per_rank=tuple(row["tokens_per_rank"] for row in recorded)))
        if ok:
            return replanned, {"model": model, "dp": 1, "cp": cp, "bucket_size": bucket_size}
    raise NotReproduced(f"CP {cp}: planning the drawn batches again under the recorded profile does not give the "
                        "recorded micro-batches")


@dataclass(frozen=True, kw_only=True, slots=True)
class _TrainSettings:
    dataset: str = "chatqa2"
    global_batch: int = 32
    bucket_size: int = 16384
    dp: int = 1
    cp: int = 1
    seed: int = 0
    model: str | None = None  # None: the profile's


def _train_settings(command: Sequence[str]) -> _TrainSettings:
    """A trainer's settings from its command line (``make gpu-check``'s summary), the GPU check's otherwise."""
    options = {flag: value for flag, value in itertools.pairwise(command) if flag.startswith("--")}
    defaults = _TrainSettings()
    data = options.get("--data", f"synthetic:{defaults.dataset}")
    if not data.startswith("synthetic:"):
        raise NotReproduced(f"--data {data}: only synthetic data can be drawn again")
    return _TrainSettings(dataset=data.removeprefix("synthetic:"),
                          global_batch=int(options.get("--global-batch", defaults.global_batch)),
                          bucket_size=int(options.get("--bucket-size", defaults.bucket_size)),
                          dp=int(options.get("--dp", defaults.dp)), cp=int(options.get("--cp", defaults.cp)),
                          seed=int(options.get("--seed", defaults.seed)), model=options.get("--model"))


def _replan_steps(records: Sequence[Mapping[str, Any]], settings: _TrainSettings,
                  profiles: Mapping[str, dict[str, Any]]) -> tuple[list[_Replanned], dict[str, Any]]:
    """The warm steps of one trainer run, drawn again as ``SyntheticSource`` draws them (seed ``[seed, s]`` for
    global batch ``s``, which step ``s + 1`` trains) and planned under the first of ``profiles`` that reproduces
    every step's tokens, micro-batches and estimate."""
    from scheduler_service.core.profile import parse_profile
    from scheduler_service.core.samplers import sample_lengths

    steps = _warm_steps(records)
    if not steps:
        raise NotReproduced("no warm step with an estimate")
    max_length = settings.bucket_size * settings.cp
    drawn = {record["step"]: sample_lengths(settings.dataset, settings.global_batch,
                                            np.random.default_rng([settings.seed, record["step"] - 1]),
                                            max_length=max_length).tolist() for record in steps}
    if any(sum(drawn[record["step"]]) != record["tokens"] for record in steps):
        raise NotReproduced(f"synthetic:{settings.dataset} drawn again does not give the recorded tokens")
    for name, document in profiles.items():
        profile = parse_profile(document)
        model = settings.model or document.get("model")
        if model is None:
            continue
        replanned = []
        for record in steps:
            lengths = drawn[record["step"]]
            _, result = _plan(lengths, scheduler=record["scheduler"], profile=profile, model=model, dp=settings.dp,
                              cp=settings.cp, bucket_size=settings.bucket_size)
            if not (result.plan.num_micro_batches == record["num_micro_batches"]
                    and _close(result.estimate.iteration_time_s * 1e3, record["estimated_time_ms"])):
                break
            replanned.append(_Replanned(batch=f"step{record['step']}", scheduler=record["scheduler"],
                                        lengths=tuple(lengths), plan=result.plan,
                                        measured_s=(record["micro_batch_time_s"],)))
        else:
            return replanned, {"model": model, "dp": settings.dp, "cp": settings.cp,
                               "bucket_size": settings.bucket_size, "profile": name}
    raise NotReproduced(f"no profile of the recording ({', '.join(profiles) or 'none'}) reproduces its estimates")


@dataclass(kw_only=True, slots=True)
class _Recording:
    """What one folder (or one accuracy file) holds: accuracy cases, trainer runs, profile documents."""

    name: str
    accuracy: list[tuple[str, dict[str, Any]]] = field(default_factory=list)  # (file, case)
    runs: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # train-*.jsonl name → records
    commands: dict[str, list[str]] = field(default_factory=dict)  # run name → its command (a gpu-check summary)
    profiles: dict[str, dict[str, Any]] = field(default_factory=dict)  # file → profile document


def _jsonl(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _read_recording(path: Path) -> _Recording:
    if path.is_file():
        document = json.loads(path.read_text())
        return _Recording(name=str(path), accuracy=[(path.name, case) for case in document["cases"]])
    recording = _Recording(name=str(path))
    texts: dict[str, str] = {}
    for file in sorted(path.iterdir()):
        if file.is_file() and file.suffix in (".json", ".jsonl"):
            texts[file.name] = file.read_text()
    archive = path / "logs.tar.gz"
    if archive.is_file():
        with tarfile.open(archive) as tar:
            for member in tar.getmembers():
                name = Path(member.name).name
                if member.isfile() and name.endswith((".json", ".jsonl")) and name not in texts:
                    extracted = tar.extractfile(member)
                    if extracted is not None:
                        texts[name] = io.TextIOWrapper(extracted, encoding="utf-8").read()
    for name, text in texts.items():
        if name.startswith("train-") and name.endswith(".jsonl"):
            recording.runs[name.removesuffix(".jsonl")] = _jsonl(text)
            continue
        if not name.endswith(".json"):
            continue
        document = json.loads(text)
        if name.startswith("accuracy") and "cases" in document:
            recording.accuracy.extend((name, case) for case in document["cases"])
        elif name == "summary.json" and "steps" in document:
            recording.commands = {step["name"]: step["command"] for step in document["steps"]}
        elif isinstance(document, dict) and {"compute", "model", "name"} <= document.keys():
            recording.profiles[name] = document
    return recording


def _is_recording(folder: Path) -> bool:
    return any(folder.glob("accuracy*.json")) or any(folder.glob("train-*.jsonl")) or (folder / "logs.tar.gz").is_file()


def _recordings(paths: Sequence[Path]) -> Iterator[_Recording]:
    """A file, a folder holding a recording, or a folder of such folders (``benchmarks/measurements/``)."""
    for path in paths:
        if path.is_dir() and not _is_recording(path):
            yield from _recordings(sorted(child for child in path.iterdir() if child.is_dir()))
        else:
            yield _read_recording(path)


def repriced_sets(paths: Sequence[Path], profile_spec: str = SHIPPED_PROFILE) -> tuple[list[RankedSet],
                                                                                      list[dict[str, Any]]]:
    """Every recording under ``paths`` drawn and planned again, checked against what it recorded, and priced by
    the current code under ``profile_spec`` and its fits; with what was used and what was left out, and why."""
    fits = _fits(profile_spec)
    sets = {(fit.name, ranked): RankedSet(fit=fit.name, ranked=ranked) for fit in fits
            for ranked in (MICRO_BATCHES, STEPS, PLANS)}
    notes: list[dict[str, Any]] = []
    timed: dict[str, list[_Replanned]] = {}  # accuracy recording → its plans, for another run of the same ones
    for recording in _recordings(paths):
        source = Path(recording.name).name
        for file, case in recording.accuracy:
            where = f"{source}/{file}" if file != source else source
            try:
                replanned, settings = _replan_accuracy(case)
            except NotReproduced as error:
                notes.append({"recording": where, "used": False, "why": str(error)})
                continue
            notes.append({"recording": where, "used": True, "what": MICRO_BATCHES,
                          "micro_batches": sum(len(plan.measured_s) for plan in replanned), **settings})
            settings.pop("dp")
            timed[where] = replanned
            for fit in fits:
                measured: list[float] = []
                predicted: list[float] = []
                classes: list[str] = []
                by_batch: dict[str, dict[str, tuple[float, float]]] = {}
                for plan in replanned:
                    estimate = _estimate(plan.plan, plan.lengths, profile=fit.profile, dp=1, **settings)
                    times = [micro_batch.time_s for micro_batch in estimate.dp_ranks[0].micro_batches]
                    measured += plan.measured_s
                    predicted += times
                    classes += [_size_class(tokens) for tokens in plan.tokens_per_rank]
                    by_batch.setdefault(f"{where}-{plan.batch}", {})[plan.scheduler] = (sum(plan.measured_s),
                                                                                         sum(times))
                sets[fit.name, MICRO_BATCHES].groups.append(Group(
                    label=where, measured_s=tuple(measured), predicted_s=tuple(predicted), classes=tuple(classes)))
                sets[fit.name, PLANS].groups.extend(_plan_groups(by_batch))
        by_layout: dict[str, list[tuple[dict[str, Any], _Replanned]]] = {}
        for run, records in recording.runs.items():
            where = f"{source}/{run}"
            if "compiled" in run:
                notes.append({"recording": where, "used": False,
                              "why": "--compile: the profiles price eager execution"})
                continue
            try:
                train_settings = _train_settings(recording.commands.get(run, []))
                steps, used = _replan_steps(records, train_settings, recording.profiles)
            except NotReproduced as error:
                notes.append({"recording": where, "used": False, "why": str(error)})
                continue
            notes.append({"recording": where, "used": True, "what": STEPS, "steps": len(steps), **used})
            layout = f"{source}/dp{used['dp']}-cp{used['cp']}"
            by_layout.setdefault(layout, []).extend((used, plan) for plan in steps)
        for layout, plans in by_layout.items():
            for fit in fits:
                measured, predicted, by_batch = [], [], {}
                for used, plan in plans:
                    estimate = _estimate(plan.plan, plan.lengths, profile=fit.profile, model=used["model"],
                                         dp=used["dp"], cp=used["cp"], bucket_size=used["bucket_size"])
                    measured.append(plan.measured_s[0])
                    predicted.append(estimate.iteration_time_s)
                    by_batch.setdefault(f"{layout}-{plan.batch}", {})[plan.scheduler] = (plan.measured_s[0],
                                                                                         estimate.iteration_time_s)
                sets[fit.name, STEPS].groups.append(Group(label=layout, measured_s=tuple(measured),
                                                          predicted_s=tuple(predicted)))
                sets[fit.name, PLANS].groups.extend(_plan_groups(by_batch))
    for ranked in _remeasured(timed):
        sets[ranked.fit, ranked.ranked] = ranked
    return [ranked for ranked in sets.values() if ranked.groups], notes


REMEASURED = "another run's measurement (repeatability)"


def _remeasured(timed: Mapping[str, Sequence[_Replanned]]) -> list[RankedSet]:
    """Where two accuracy recordings timed the very same micro-batches (the same plans of the same batches), each
    one's measured times as the "prediction" of the other's: how far the measured order repeats. Not a ceiling: a
    second measurement carries its own noise, which a model of the expected time does not; it tells which measured
    orders are noise (where it is near a coin flip)."""
    sets = [RankedSet(fit=REMEASURED, ranked=MICRO_BATCHES), RankedSet(fit=REMEASURED, ranked=PLANS)]
    for one, other in ((a, b) for a in timed for b in timed if a != b):
        if [(plan.batch, plan.scheduler, plan.lengths, plan.plan) for plan in timed[one]] != \
                [(plan.batch, plan.scheduler, plan.lengths, plan.plan) for plan in timed[other]]:
            continue
        pairs = list(zip(timed[one], timed[other], strict=True))
        sets[0].groups.append(Group(
            label=f"{one} by {other}", measured_s=tuple(t for plan, _ in pairs for t in plan.measured_s),
            predicted_s=tuple(t for _, plan in pairs for t in plan.measured_s),
            classes=tuple(_size_class(tokens) for plan, _ in pairs for tokens in plan.tokens_per_rank)))
        by_batch: dict[str, dict[str, tuple[float, float]]] = {}
        for plan, again in pairs:
            by_batch.setdefault(f"{one}-{plan.batch}", {})[plan.scheduler] = (sum(plan.measured_s),
                                                                               sum(again.measured_s))
        sets[1].groups.extend(_plan_groups(by_batch))
    return [ranked for ranked in sets if ranked.groups]


# ---------------------------------------------------------------------------------------------------- reporting


def _percent(value: float | None) -> str:
    return "–" if value is None else f"{value * 100:.1f} %"


def print_table(summaries: Sequence[Mapping[str, Any]], *, file: Any = None) -> None:
    """The markdown table: per fit and what is ranked, its pairs, the share ordered correctly (all, and among
    pairs measured more than the gap apart), the regret of picking by the model (all pairs, the wrong ones)."""
    gap = next((summary["min_gap"] for summary in summaries if "min_gap" in summary), MIN_GAP)
    print("| fit | ranked | pairs | ordered | priced equal | ordered, the rest | "
          f"pairs > {gap * 100:g} % apart | ordered | regret p50 | p95 | max | wrong | their regret p50 | p95 |",
          file=file)
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|", file=file)
    for s in summaries:
        if not s["pairs"]:
            continue
        regret, wrong = s["regret"], s["wrong_regret"]
        print(f"| {s['fit']} | {s['ranked']} | {s['pairs']} | {_percent(s['ordered'])} | {s['priced_equal']} | "
              f"{_percent(s['decided_ordered'])} | {s['separated_pairs']} | {_percent(s['separated_ordered'])} | "
              f"{_percent(regret['p50'])} | {_percent(regret['p95'])} | {_percent(regret['max'])} | "
              f"{s['wrong_pairs']} | {_percent(wrong['p50'])} | {_percent(wrong['p95'])} |", file=file)


def _print_classes(summaries: Sequence[Mapping[str, Any]]) -> None:
    rows = [(s, label, part) for s in summaries if s["pairs"] for label, part in s.get("by_class", {}).items()]
    if not rows:
        return
    print("\nMicro-batch pairs by the tokens per rank of their two micro-batches:\n")
    gap = rows[0][2]["min_gap"]
    print("| fit | tokens per rank | pairs | ordered | priced equal | ordered, the rest | "
          f"pairs > {gap * 100:g} % apart | ordered | regret p95 | wrong | their regret p50 | p95 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for s, label, part in rows:
        print(f"| {s['fit']} | {label} | {part['pairs']} | {_percent(part['ordered'])} | {part['priced_equal']} | "
              f"{_percent(part['decided_ordered'])} | {part['separated_pairs']} | "
              f"{_percent(part['separated_ordered'])} | "
              f"{_percent(part['regret']['p95'])} | {part['wrong_pairs']} | "
              f"{_percent(part['wrong_regret']['p50'])} | {_percent(part['wrong_regret']['p95'])} |")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ranking", description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", type=Path, default=[MEASUREMENTS],
                        help="measurement folders or accuracy JSON files (default: every folder of "
                             "benchmarks/measurements/)")
    parser.add_argument("--profile", default=SHIPPED_PROFILE,
                        help="a shipped profile's name or a profile file to price with (default: %(default)s)")
    parser.add_argument("--min-gap", type=float, default=MIN_GAP,
                        help="pairs measured closer than this (relative) are ties within noise (default: 0.05)")
    parser.add_argument("--out", type=Path, help="write the summaries and what was used as JSON here")
    args = parser.parse_args(argv)

    sets, notes = repriced_sets(args.paths, args.profile)
    summaries = [rank_set(ranked, min_gap=args.min_gap) for ranked in sets]
    print("# Ranking accuracy: the model's order against the measured order\n")
    for note in notes:
        if note["used"]:
            count = f"{note['micro_batches']} micro-batches" if note["what"] == MICRO_BATCHES else \
                f"{note['steps']} warm steps (planned under {note['profile']})"
            print(f"- {note['recording']}: {count}, re-planned exactly")
        else:
            print(f"- {note['recording']}: left out ({note['why']})")
    print()
    print_table(summaries)
    _print_classes(summaries)
    choices = [s for s in summaries if s["ranked"] == PLANS and s["pairs"]]
    if choices:
        print("\nChoosing the faster plan of one batch (skrull or deepspeed) by the model:")
        for s in choices:
            print(f"- {s['fit']}: {s['groups']} batches, right on {_percent(s['ordered'])}; regret p50 "
                  f"{_percent(s['choice_regret']['p50'])}, p95 {_percent(s['choice_regret']['p95'])}, max "
                  f"{_percent(s['choice_regret']['max'])}; the plans' measured times "
                  f"{_percent(s['measured_gap']['min'])} apart at the closest, {_percent(s['measured_gap']['p50'])} "
                  "the median")
    if args.out is not None:
        args.out.write_text(json.dumps({"profile": args.profile, "min_gap": args.min_gap, "recordings": notes,
                                        "summaries": summaries}, indent=2) + "\n")
        print(f"\nwrote {args.out}")
    return 0 if summaries else 1


if __name__ == "__main__":
    sys.exit(main())
