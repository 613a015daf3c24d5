"""The shard-size effect (the paper's Figure 1(b)) against the performance model, and the attention efficiency
per query length derived from it.

The profiler measures one sequence of ``S`` tokens run whole on a rank and zigzag-sharded over ``d`` ranks
(``num_tokens``, ``degree``, ``whole_s``, ``shard_s``). Here those timings meet the model:

* ``shard_effect_rows``: each measurement beside the model's prediction of both times (eq. 2 with no local
  work: a rank holding only its shard, so nothing hides its collectives, ``predicted_shard_s``);
* ``derive_shard_cost``: what a shard costs beyond the model's terms, from the sharded rows too short for their
  attention to matter (``MAX_ATTENTION_SHARE_FOR_COST``): there no efficiency can explain the measured time, and what
  the model leaves over is the sharded path's own fixed cost (its chunks' kernels and merge, the K/V stacking, the
  waits beyond the collectives' tables). The result is the profile's ``compute.alpha_s_per_shard``, read before the
  efficiency; from the rows sharded by Ulysses (``ulysses_degree``), ``compute.alpha_s_per_ulysses_shard`` (heads
  split and joined, rows reordered, the waits beyond the all-to-all's table);
* ``derive_attention_efficiency``: per measured attention call (a whole sequence: query ``S``; a shard: query
  ``S / 2d``, each zigzag chunk) the efficiency ``e`` with ``α·A/(d·e) + other = measured``, ``A`` the attention
  FLOPs and ``other`` the model's remaining terms; per query length the median, relative to the longest query
  measured. The result is the profile's ``compute.attention_efficiency`` curve, or the reason there is none.

Pure: the model in, numbers and verdicts out; the profiler (``trainer_client.profiler.document``) writes them.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from scheduler_service.core.perf_model import PerformanceModel

__all__ = [
    "MAX_ATTENTION_SHARE_FOR_COST",
    "MAX_CANDIDATE_SPREAD",
    "MAX_REFERENCE_DEVIATION",
    "MIN_ATTENTION_SHARE",
    "EfficiencyCandidate",
    "EfficiencyFit",
    "ShardCostFit",
    "derive_attention_efficiency",
    "derive_shard_cost",
    "efficiency_candidate",
    "predicted_shard_s",
    "shard_effect_rows",
]

# An efficiency is solved from the measured time minus the model's other terms: ideal / (measured − other). Where
# attention, priced at efficiency 1, is a share s of the measured time, an error ε of the other terms (1 − s of it)
# moves the efficiency by about ε·(1 − s)/s. The compute fit's residuals reach 15-20 % of a point on a CPU (make
# demo's profiles), which s ≥ 1/4 turns into 45-60 %, about the spread candidates may have (MAX_CANDIDATE_SPREAD),
# and 1/10, as before, into 135-180 %: a 512-token sequence over 2 CPU ranks (attention 7 % of its time, the rest
# mostly the collectives' latency) put 0.14-0.29 at 128-token queries, and the curve priced every mid-sized shard
# of the demo 10-20 % high.
MIN_ATTENTION_SHARE = 0.25
# Candidates at one query length (from different sequence lengths and degrees) measure the same kernel; where they
# disagree by more than this factor, noise or a term the model lacks dominates, not the kernel's efficiency.
MAX_CANDIDATE_SPREAD = 1.5
# The longest query is a whole sequence like the compute sweep's, so against the sweep's fit its efficiency is
# about 1; further off than this, the machine ran differently during the shard runs (load) and nothing is normalised.
MAX_REFERENCE_DEVIATION = 0.25
# A sharded row says what a shard costs beyond the model where attention at efficiency 1 is at most this share of
# its time: even at efficiency 0.5 its attention would move the cost by no more than this share. On the demo's CPU
# profiles a sequence over 2 ranks of 64 tokens: under 1 %; 128: 1-2 %; 512: 7-10 %, near enough to a bound of
# 10 % to be used in one profile and not the next, its excess over the model 5.5-7.8 ms in one demo's profiles
# against 1.8-5.8 at 128 tokens (its attention less efficient than 1, taken for a shard's cost); 2,048: 39 %, an
# efficiency candidate instead.
MAX_ATTENTION_SHARE_FOR_COST = 0.05


def predicted_shard_s(perf: PerformanceModel, num_tokens: int, degree: int, ulysses_degree: int = 1) -> float:
    """The model's time of a rank holding only its shard of one sequence sharded over ``degree`` ranks by the scheme
    of ``ulysses_degree`` (``schemes``): no local attention hides the collectives, so all of them are exposed
    (``costing.scheme_rank_time_s``)."""
    comm = perf.scheme_comm(degree, ulysses_degree)
    assert comm is not None, "a shard row of a scheme the profile cannot price"
    device_s = (perf.device_time_s(float(perf.placement_flops([num_tokens], degree, ulysses_degree)[0]))
                + comm.hidden_forward_s(num_tokens) + comm.hidden_backward_s(num_tokens) + comm.exposed_s(num_tokens))
    return max(perf.compute_floor_s, device_s)


def shard_effect_rows(perf: PerformanceModel, shards: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Measured whole vs shard times beside the model's prediction of both (eq. 2 with no local work)."""
    rows = []
    for shard in shards:
        size, degree, ulysses_degree = shard["num_tokens"], shard["degree"], shard.get("ulysses_degree", 1)
        predicted_s = predicted_shard_s(perf, size, degree, ulysses_degree)
        rows.append({**shard, "query_tokens": size / (2 * degree) if ulysses_degree == 1 else size,
                     "speedup": shard["whole_s"] / shard["shard_s"],
                     "parallel_efficiency": shard["whole_s"] / (degree * shard["shard_s"]),
                     "predicted_whole_s": perf.compute_time_s(float(perf.placement_flops([size], 1)[0])),
                     "predicted_shard_s": predicted_s,
                     "shard_relative_error": abs(predicted_s - shard["shard_s"]) / shard["shard_s"]})
    return rows


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardCostFit:
    """``compute.alpha_s_per_shard`` (or, for Ulysses rows, ``compute.alpha_s_per_ulysses_shard``) derived from the
    shard-effect rows, or why it is 0."""

    alpha_s_per_shard: float  # seconds per sharded sequence and rank; 0 where nothing determines it
    candidates: tuple[dict[str, Any], ...]  # per sharded row: its measured and predicted time, and whether it is used
    result: str
    profile_field: str = "alpha_s_per_shard"  # the profile's ``compute`` field it is

    def to_json(self) -> dict[str, Any]:
        """The derivation as the profile records it (``compute.fit.shard_cost``, ``compute.fit.ulysses_shard_cost``)."""
        return {self.profile_field: self.alpha_s_per_shard, "max_attention_share": MAX_ATTENTION_SHARE_FOR_COST,
                "candidates": list(self.candidates), "result": self.result}


def derive_shard_cost(perf: PerformanceModel, shards: Sequence[Mapping[str, Any]], *,
                      ulysses: bool = False) -> ShardCostFit:
    """What a sequence sharded over ``d`` ranks costs each of them beyond the model's terms: the median, over the
    sharded rows whose attention at efficiency 1 is at most ``MAX_ATTENTION_SHARE_FOR_COST`` of their measured time,
    of that time minus the model's (``predicted_shard_s``), at least 0; 0 without such a row. ``ulysses``: of the
    rows sharded by Ulysses (``ulysses_degree`` above 1), for ``alpha_s_per_ulysses_shard``; else of the zigzag
    ones.

    The model prices a shard as its share of the work, two attention calls and its collectives as their tables
    measured them alone. The sharded path pays more than those on a CPU: its chunks' kernels and their merge, the
    K/V stacked and gathered, each wait beyond a table's: ``make demo``'s sequences under 150 tokens over 2 ranks
    ran 1.2-1.4x their price, about 2.5 ms each, while whole sequences of the same micro-batches met theirs."""
    profile_field = "alpha_s_per_ulysses_shard" if ulysses else "alpha_s_per_shard"
    if getattr(perf.profile.compute, profile_field):
        raise ValueError(f"profile {perf.profile.name} already has a shard cost ({profile_field}); it is derived "
                         f"against the model without one")
    candidates = []
    residuals = []
    for row in shards:
        size, degree, time_s = row["num_tokens"], row["degree"], row["shard_s"]
        ulysses_degree = row.get("ulysses_degree", 1)
        if (ulysses_degree > 1) != ulysses:
            continue
        predicted_s = predicted_shard_s(perf, size, degree, ulysses_degree)
        attention_share = efficiency_candidate(perf, size, degree, time_s).ideal_attention_s / time_s
        used = attention_share <= MAX_ATTENTION_SHARE_FOR_COST
        candidates.append({"num_tokens": size, "degree": degree, "shard_s": time_s, "predicted_s": predicted_s,
                           "attention_share": attention_share, "used": used})
        if used:
            residuals.append(time_s - predicted_s)
    if not residuals:
        return ShardCostFit(alpha_s_per_shard=0.0, candidates=tuple(candidates), profile_field=profile_field,
                            result=f"0: no {'Ulysses ' if ulysses else ''}sharded row whose attention is at most "
                                   f"{MAX_ATTENTION_SHARE_FOR_COST:.0%} of its time (measure a short sequence, "
                                   f"--shard-sizes)")
    median_s = statistics.median(residuals)
    return ShardCostFit(alpha_s_per_shard=max(median_s, 0.0), candidates=tuple(candidates), profile_field=profile_field,
                        result=f"{max(median_s, 0.0) * 1e3:.3g} ms: the median of {len(residuals)} sharded row(s)' "
                               f"time beyond the model's" + (f" ({median_s * 1e3:.3g} ms, clamped at 0)"
                                                            if median_s < 0 else ""))


@dataclass(frozen=True, kw_only=True, slots=True)
class EfficiencyCandidate:
    """One measured attention call length: the attention time the model leaves unexplained vs its ideal."""

    query_tokens: float  # the sequence when whole; each zigzag chunk, S / 2d, when sharded over d ranks
    measured_as: str
    time_s: float  # measured
    other_s: float  # the model's non-attention terms: linear and per-token work, per-call costs, β, collectives
    ideal_attention_s: float  # α · attention FLOPs per rank: the attention term at efficiency 1

    @property
    def attention_s(self) -> float:
        return self.time_s - self.other_s

    @property
    def is_determined(self) -> bool:
        """Whether the time says something of the kernel: attention at efficiency 1 is at least
        ``MIN_ATTENTION_SHARE`` of it, and the model's other terms leave time for it."""
        return self.ideal_attention_s >= MIN_ATTENTION_SHARE * self.time_s and self.attention_s > 0

    @property
    def efficiency(self) -> float | None:
        """The efficiency that makes the model's time equal the measured one (None where ill-determined)."""
        return self.ideal_attention_s / self.attention_s if self.is_determined else None


@dataclass(frozen=True, kw_only=True, slots=True)
class EfficiencyFit:
    """``compute.attention_efficiency`` derived from the shard-effect rows, or why it is not."""

    points: tuple[tuple[float, float], ...]  # (query tokens, relative throughput); empty: not determined
    reference_query_tokens: float  # the longest query measured: relative throughput 1 there
    candidates: tuple[EfficiencyCandidate, ...]
    verdicts: dict[float, str]  # per query length: usable, or why not
    result: str

    def __post_init__(self) -> None:
        assert set(self.verdicts) == {c.query_tokens for c in self.candidates}, "every query length has a verdict"

    def to_json(self) -> dict[str, Any]:
        """The derivation as the profile records it (``compute.fit.attention_efficiency``): every candidate with
        its verdict, and the thresholds they were judged by."""
        return {
            "reference_query_tokens": self.reference_query_tokens,
            "min_attention_share": MIN_ATTENTION_SHARE,
            "max_candidate_spread": MAX_CANDIDATE_SPREAD,
            "max_reference_deviation": MAX_REFERENCE_DEVIATION,
            "candidates": [{**asdict(c), "attention_s": c.attention_s, "efficiency": c.efficiency,
                            "verdict": self.verdicts[c.query_tokens]} for c in self.candidates],
            "result": self.result,
        }


def efficiency_candidate(perf: PerformanceModel, num_tokens: int, degree: int, time_s: float) -> EfficiencyCandidate:
    """The candidate of one measured time: a sequence of ``num_tokens`` whole (``degree`` 1) or sharded over
    ``degree`` ranks."""
    alpha = perf.profile.compute.alpha_s_per_flop
    ideal_flops = float(perf.local_attention_flops([num_tokens])[0]) / degree
    # placement_flops minus its attention at efficiency 1: what the model says the device does besides attention
    # (β included; a time at the launch-bound floor leaves attention too small a share to be a candidate)
    other_s = perf.device_time_s(float(perf.placement_flops([num_tokens], degree)[0])) - alpha * ideal_flops
    if degree > 1:
        other_s += perf.comm_time_s(num_tokens, group_size=degree)  # no local attention hides it
    return EfficiencyCandidate(
        query_tokens=float(num_tokens) if degree == 1 else num_tokens / (2 * degree),
        measured_as=f"{num_tokens} tokens whole" if degree == 1 else f"{num_tokens} tokens over {degree} ranks",
        time_s=time_s, other_s=other_s, ideal_attention_s=alpha * ideal_flops)


def derive_attention_efficiency(perf: PerformanceModel, rows: Sequence[Mapping[str, Any]]) -> EfficiencyFit:
    """Attention throughput per query length from shard-effect rows (``num_tokens``, ``degree``, ``whole_s``,
    ``shard_s``), against ``perf`` with efficiency 1 everywhere.

    Per whole sequence (query ``S``) and per shard (query ``S / 2d``): the efficiency ``e`` with
    ``α·A/(d·e) + other = measured`` (``A`` the attention FLOPs, ``other`` the model's remaining terms), where
    attention at efficiency 1 is at least ``MIN_ATTENTION_SHARE`` of the measured time; per query length the
    median, where its candidates agree within ``MAX_CANDIDATE_SPREAD``, divided by the value at the longest query
    measured (a whole sequence, about 1 against the compute fit: within ``MAX_REFERENCE_DEVIATION`` of it). Points
    in (0, 1] are kept; fewer than 2, or a curve that falls by more than ``MAX_CANDIDATE_SPREAD`` towards longer
    queries, is no curve.
    """
    if perf.profile.compute.attention_efficiency:
        raise ValueError(f"profile {perf.profile.name} already has an attention efficiency curve; the efficiency is "
                         f"solved against the model with efficiency 1 everywhere")
    rows = [row for row in rows if row.get("ulysses_degree", 1) == 1]  # Ulysses rows price its cost alone
    whole_s = {row["num_tokens"]: row["whole_s"] for row in rows}
    candidates = tuple(
        [efficiency_candidate(perf, size, 1, time_s) for size, time_s in sorted(whole_s.items())]
        + [efficiency_candidate(perf, row["num_tokens"], row["degree"], row["shard_s"]) for row in rows])
    by_query: dict[float, list[float]] = {}
    for candidate in candidates:
        by_query.setdefault(candidate.query_tokens, []).extend(
            [candidate.efficiency] if candidate.efficiency is not None else [])
    verdicts: dict[float, str] = {}
    determined: dict[float, float] = {}  # query tokens -> efficiency, ascending
    for query, values in sorted(by_query.items()):
        if not values:
            verdicts[query] = (f"ill-determined: attention at efficiency 1 is under {MIN_ATTENTION_SHARE:.0%} of the "
                               f"measured time, or the model's other terms exceed it")
        elif max(values) > MAX_CANDIDATE_SPREAD * min(values):
            verdicts[query] = (f"ill-determined: its candidates disagree ({min(values):.3f} .. {max(values):.3f}, "
                               f"more than {MAX_CANDIDATE_SPREAD}x apart)")
        else:
            determined[query] = statistics.median(values)
            verdicts[query] = f"not used: efficiency {determined[query]:.3f}, but no curve is written"
    reference = max(by_query)

    def fit(points: Sequence[tuple[float, float]], result: str) -> EfficiencyFit:
        return EfficiencyFit(points=tuple(points), reference_query_tokens=reference, candidates=candidates,
                             verdicts=verdicts, result=result)

    if reference not in determined:
        return fit((), f"omitted: the longest query measured ({reference:g} tokens), the reference, is "
                       f"{verdicts[reference]}")
    if abs(determined[reference] - 1) > MAX_REFERENCE_DEVIATION:
        return fit((), f"omitted: not sensible, the longest query ({reference:g} tokens whole) has efficiency "
                       f"{determined[reference]:.3f} against the compute fit, more than {MAX_REFERENCE_DEVIATION:.0%} "
                       f"from 1: the machine ran differently than during the compute sweep")
    points = []
    for query, efficiency in determined.items():
        relative = efficiency / determined[reference]
        if 0 < relative <= 1:
            points.append((query, relative))
            verdicts[query] = f"usable: relative throughput {relative:.3f}"
        else:
            verdicts[query] = f"dropped: relative throughput {relative:.3f} is outside (0, 1]"
    if len(points) < 2:
        return fit((), f"omitted: {len(points)} usable query length(s), a curve needs 2")
    # Figure 1(b): throughput does not fall as queries lengthen; a curve that falls by more than the noise the
    # candidates are allowed measures the machine's load, not the kernel.
    for (short, short_relative), (long, long_relative) in itertools.combinations(points, 2):
        if short_relative > MAX_CANDIDATE_SPREAD * long_relative:
            return fit((), f"omitted: not sensible, the relative throughput falls from {short_relative:.3f} at "
                           f"{short:g} to {long_relative:.3f} at {long:g} query tokens")
    return fit(points, f"written: {len(points)} points")
