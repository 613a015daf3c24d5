"""Synthetic shard-effect measurements: what the profiler would measure on a machine that runs exactly as a given
performance model says, for the attention-efficiency derivation's tests (no processes)."""

from __future__ import annotations

import copy
from typing import Any

from scheduler_service.core.models import MODEL_CATALOGUE
from scheduler_service.core.perf_model import PerformanceModel
from scheduler_service.core.profile import builtin_profiles, parse_profile
from scheduler_service.core.shard_effect import predicted_shard_s

TRUE_CURVE = [[32, 0.4], [2048, 1.0]]  # relative throughput by query tokens, log-interpolated


def flat_and_true_models(
    curve: list[list[float]] = TRUE_CURVE,
) -> tuple[dict[str, Any], PerformanceModel, PerformanceModel]:
    """The shipped CPU profile without an efficiency curve (its document and its model), and with ``curve``."""
    document = copy.deepcopy(builtin_profiles()["cpu-tiny"].raw)
    document["compute"].pop("attention_efficiency", None)
    curved = copy.deepcopy(document)
    curved["compute"]["attention_efficiency"] = {"points": curve, "source": "test"}
    tiny = MODEL_CATALOGUE["tiny"]
    return (document, PerformanceModel(model=tiny, profile=parse_profile(document)),
            PerformanceModel(model=tiny, profile=parse_profile(curved)))


def rows_timed_by(perf: PerformanceModel, sizes: list[int], degrees: list[int]) -> list[dict[str, Any]]:
    """What the profiler would measure on a machine that behaves exactly as ``perf`` says."""
    return [{"num_tokens": size, "degree": degree,
             "whole_s": perf.compute_time_s(float(perf.placement_flops([size], 1)[0])),
             "shard_s": predicted_shard_s(perf, size, degree)}
            for size in sizes for degree in degrees]
