"""The shard-size effect against the performance model, and the attention efficiency derived from it
(``scheduler_service.core.shard_effect``), on synthetic measurements from a model with a known curve."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from scheduler_service.core.models import MODEL_CATALOGUE
from scheduler_service.core.perf_model import PerformanceModel
from scheduler_service.core.profile import parse_profile
from scheduler_service.core.shard_effect import (
    derive_attention_efficiency,
    derive_shard_cost,
    efficiency_candidate,
    predicted_shard_s,
    shard_effect_rows,
)
from tests.shard_effect_cases import flat_and_true_models, rows_timed_by


def test_shard_effect_rows_put_the_models_prediction_beside_each_measurement() -> None:
    _, flat, _ = flat_and_true_models()
    (row,) = shard_effect_rows(flat, [{"num_tokens": 2048, "degree": 4, "whole_s": 0.8, "shard_s": 0.4}])
    assert row["query_tokens"] == 256 and row["speedup"] == 2.0 and row["parallel_efficiency"] == 0.5
    assert row["predicted_shard_s"] == predicted_shard_s(flat, 2048, 4)
    assert row["predicted_whole_s"] == pytest.approx(flat.compute_time_s(flat.flops(2048)))
    assert row["shard_relative_error"] == pytest.approx(abs(row["predicted_shard_s"] - 0.4) / 0.4)


def with_shard_cost(document: dict[str, Any], cost_s: float) -> PerformanceModel:
    """The model of ``document`` whose shards each cost ``cost_s`` more on every rank."""
    costly = copy.deepcopy(document)
    costly["compute"]["alpha_s_per_shard"] = cost_s
    return PerformanceModel(model=MODEL_CATALOGUE["tiny"], profile=parse_profile(costly))


def test_shard_cost_is_what_short_sharded_rows_take_beyond_the_model() -> None:
    """A machine whose shards each cost 2.5 ms more than the model says: the cost is read from the rows whose
    attention is at most 5 % of their time (64 and 128 tokens), not from those where attention's efficiency could
    explain the difference (512 tokens and more)."""
    document, flat, _ = flat_and_true_models()
    rows = rows_timed_by(with_shard_cost(document, 2.5e-3), [64, 128, 512, 2048], [2, 4])
    fit = derive_shard_cost(flat, rows)
    assert fit.alpha_s_per_shard == pytest.approx(2.5e-3)
    assert [(c["num_tokens"], c["degree"]) for c in fit.candidates if c["used"]] == [(64, 2), (64, 4), (128, 2),
                                                                                      (128, 4)]
    assert fit.result.startswith("2.5 ms: the median of 4 sharded row(s)")
    rows[0]["shard_s"] += 1.0  # one row's outlier moves a median of four by half the gap between its middle two
    assert derive_shard_cost(flat, rows).alpha_s_per_shard == pytest.approx(2.5e-3, rel=0.2)


def test_shard_cost_is_zero_without_a_short_row_or_where_shards_beat_the_model() -> None:
    document, flat, _ = flat_and_true_models()
    fit = derive_shard_cost(flat, rows_timed_by(with_shard_cost(document, 2.5e-3), [2048], [2, 4]))
    assert fit.alpha_s_per_shard == 0 and fit.result.startswith("0: no sharded row whose attention is at most 5%")
    faster = rows_timed_by(flat, [64, 128], [2])
    for row in faster:
        row["shard_s"] *= 0.9
    fit = derive_shard_cost(flat, faster)
    assert fit.alpha_s_per_shard == 0 and "clamped at 0" in fit.result
    with pytest.raises(ValueError, match="already has a shard cost"):
        derive_shard_cost(with_shard_cost(document, 1e-3), faster)


def test_ulysses_shard_cost_is_read_from_the_ulysses_rows_alone() -> None:
    """Zigzag shards cost 2.5 ms more than the model says and Ulysses shards 0.8 ms: each cost is read from its own
    short rows, and the Ulysses rows say nothing of the efficiency (their query is the whole sequence)."""
    document, flat, _ = flat_and_true_models()
    costly = copy.deepcopy(document)
    costly["compute"].update(alpha_s_per_shard=2.5e-3, alpha_s_per_ulysses_shard=0.8e-3)
    truth = PerformanceModel(model=MODEL_CATALOGUE["tiny"], profile=parse_profile(costly))
    zigzag = rows_timed_by(truth, [64, 128, 512, 2048], [2, 4])
    ulysses = [{"num_tokens": size, "degree": degree, "ulysses_degree": degree, "whole_s": 0.0,
                "shard_s": predicted_shard_s(truth, size, degree, degree)} for size in (64, 128) for degree in (2, 4)]
    assert derive_shard_cost(flat, zigzag + ulysses).alpha_s_per_shard == pytest.approx(2.5e-3)
    fit = derive_shard_cost(flat, zigzag + ulysses, ulysses=True)
    assert fit.alpha_s_per_shard == pytest.approx(0.8e-3) and fit.profile_field == "alpha_s_per_ulysses_shard"
    assert fit.to_json()["alpha_s_per_ulysses_shard"] == fit.alpha_s_per_shard
    assert len(fit.candidates) == 4
    # the model prices a Ulysses shard with its own cost, a zigzag one with the other
    assert truth.placement_flops([64], 4, 4)[0] - flat.placement_flops([64], 4, 4)[0] == pytest.approx(
        0.8e-3 / truth.profile.compute.alpha_s_per_flop)
    rows = shard_effect_rows(flat, zigzag + ulysses)
    assert [row["query_tokens"] for row in rows[-4:]] == [64, 64, 128, 128]
    assert derive_attention_efficiency(flat, rows).to_json() == derive_attention_efficiency(
        flat, shard_effect_rows(flat, zigzag)).to_json()


def test_efficiency_derivation_recovers_the_curve_the_times_came_from() -> None:
    _, flat, true = flat_and_true_models()
    rows = rows_timed_by(true, [1024, 4096], [2, 4])
    fit = derive_attention_efficiency(flat, rows)
    assert fit.result == "written: 5 points" and fit.reference_query_tokens == 4096
    queries = [query for query, _ in fit.points]
    assert queries == [128, 256, 512, 1024, 4096]  # 1024 whole and 4096 over 2 ranks both query 1024 tokens
    assert [relative for _, relative in fit.points] == pytest.approx(true.attention_efficiency(queries).tolist())


def test_efficiency_leaves_out_times_where_attention_is_a_small_share() -> None:
    """512 tokens over 2 or 4 ranks: attention at efficiency 1 is under a quarter of the time, the rest the model's
    other terms, whose error would be most of the efficiency solved from it."""
    _, flat, true = flat_and_true_models()
    fit = derive_attention_efficiency(flat, rows_timed_by(true, [512, 2048], [2, 4]))
    assert fit.verdicts[64].startswith("ill-determined: attention at efficiency 1 is under 25%")
    assert fit.verdicts[128].startswith("ill-determined: attention at efficiency 1 is under 25%")
    assert [query for query, _ in fit.points] == [256, 512, 2048]


def test_efficiency_is_omitted_when_fewer_than_two_lengths_are_determined() -> None:
    _, flat, true = flat_and_true_models()
    rows = rows_timed_by(true, [2048], [2, 4])
    for row in rows:  # shards faster than the model's non-attention terms alone: noise, not attention
        row["shard_s"] = 0.5 * efficiency_candidate(flat, row["num_tokens"], row["degree"], row["shard_s"]).other_s
    fit = derive_attention_efficiency(flat, rows)
    assert fit.points == () and fit.result == "omitted: 1 usable query length(s), a curve needs 2"
    assert fit.verdicts[256].startswith("ill-determined") and fit.verdicts[2048].startswith("usable")


def test_efficiency_drops_lengths_whose_candidates_disagree_or_beat_the_reference() -> None:
    _, flat, true = flat_and_true_models()
    rows = rows_timed_by(true, [1024, 2048, 4096], [2, 4])
    by_case = {(row["num_tokens"], row["degree"]): row for row in rows}
    by_case[(2048, 4)]["shard_s"] *= 1.6  # query 256 twice (1024 over 2, 2048 over 4): now far apart
    for row in rows:
        if row["num_tokens"] == 2048:
            row["whole_s"] *= 0.5  # 2048 tokens whole faster than the model allows at efficiency 1
    fit = derive_attention_efficiency(flat, rows)
    assert fit.verdicts[256].startswith("ill-determined: its candidates disagree")
    assert fit.verdicts[2048].startswith("ill-determined") or fit.verdicts[2048].startswith("dropped")
    assert 256 not in dict(fit.points) and 2048 not in dict(fit.points)
    assert all(0 < relative <= 1 for _, relative in fit.points) and dict(fit.points)[4096] == 1.0


def test_efficiency_is_omitted_when_it_falls_as_queries_lengthen() -> None:
    _, flat, true = flat_and_true_models([[128, 0.9], [512, 0.5], [2048, 1.0]])  # a machine whose load varied
    fit = derive_attention_efficiency(flat, rows_timed_by(true, [1024, 4096], [2, 4]))
    assert fit.points == ()
    assert fit.result.startswith("omitted: not sensible, the relative throughput falls from")


def test_efficiency_is_omitted_when_the_longest_sequence_disagrees_with_the_compute_fit() -> None:
    _, flat, true = flat_and_true_models()
    rows = rows_timed_by(true, [512, 2048], [2, 4])
    for row in rows:
        if row["num_tokens"] == 2048:
            row["whole_s"] *= 0.7  # the machine was quieter during the shard runs than during the compute sweep
    fit = derive_attention_efficiency(flat, rows)
    assert fit.points == ()
    assert fit.result.startswith("omitted: not sensible, the longest query (2048 tokens whole) has efficiency")


def test_efficiency_is_derived_only_against_the_model_without_a_curve() -> None:
    _, _, true = flat_and_true_models()
    with pytest.raises(ValueError, match="already has an attention efficiency curve"):
        derive_attention_efficiency(true, rows_timed_by(true, [512], [2]))


def test_efficiency_is_omitted_when_the_longest_query_is_not_determined() -> None:
    _, flat, true = flat_and_true_models()
    rows = rows_timed_by(true, [512, 2048], [2])
    for row in rows:
        if row["num_tokens"] == 2048:
            row["whole_s"] = 0.01  # less than the model's linear work alone
    fit = derive_attention_efficiency(flat, rows)
    assert fit.points == () and fit.result.startswith("omitted: the longest query measured (2048 tokens)")
    verdicts = {c["query_tokens"]: c["verdict"] for c in fit.to_json()["candidates"]}
    assert verdicts[512].startswith("not used") and verdicts[2048].startswith("ill-determined")
