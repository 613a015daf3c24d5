"""The online refit (core.feedback): convergence, robustness, bounded memory, the BucketSize cap, purity."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_service.contract.profiles import profile_from_document
from scheduler_service.core.errors import InvalidRequestError
from scheduler_service.core.feedback import (
    FeedbackConfig,
    JobFeedback,
    MicroBatchMeasurement,
    effective_bucket_size,
    observe,
    start_job,
)
from scheduler_service.core.models import MODEL_CATALOGUE
from scheduler_service.core.perf_model import PerformanceModel
from scheduler_service.core.profile import Profile, builtin_profiles, parse_profile
from scheduler_service.core.samplers import sample_lengths

TINY = MODEL_CATALOGUE["tiny"]
PAPER = builtin_profiles()["h100-paper"]
# What a CPU "really" costs for the tiny model (made up): about a thousand times the H100 profile's estimate.
TRUTH = dataclasses.replace(PAPER, compute=dataclasses.replace(PAPER.compute, alpha_s_per_flop=5e-11,
                                                              beta_s_per_layer=1.5e-3))


def true_time_s(profile: Profile, lengths: list[int]) -> float:
    """One CP rank running ``lengths`` whole, as the model prices it."""
    perf = PerformanceModel(model=TINY, profile=profile)
    return perf.compute_time_s(float(perf.placement_flops(lengths, 1).sum()))


def measured(lengths: list[int], time_s: float, peak: float | None = None) -> MicroBatchMeasurement:
    return MicroBatchMeasurement(local_lengths=(tuple(lengths),), distributed_lengths=(), time_s=time_s,
                                 peak_memory_bytes=peak)


def step_reports(rng: np.random.Generator, num_steps: int, *, noise: float = 0.03,
                 outlier_rate: float = 0.0) -> list[list[MicroBatchMeasurement]]:
    reports = []
    for _ in range(num_steps):
        report = []
        for _ in range(4):
            lengths = [int(n) for n in sample_lengths("lmsys", int(rng.integers(1, 9)), rng, max_length=2048)]
            time_s = true_time_s(TRUTH, lengths) * rng.lognormal(0, noise)
            if rng.random() < outlier_rate:
                time_s *= 8  # another process stole the core
            report.append(measured(lengths, time_s))
        reports.append(report)
    return reports


def prediction_error(job: JobFeedback, rng: np.random.Generator) -> float:
    errors = []
    for _ in range(50):
        lengths = [int(n) for n in sample_lengths("wikipedia", int(rng.integers(1, 9)), rng, max_length=2048)]
        truth = true_time_s(TRUTH, lengths)
        errors.append(abs(true_time_s(job.profile, lengths) - truth) / truth)
    return float(np.median(errors))


def tiny_job(**overrides: object) -> JobFeedback:
    arguments: dict[str, object] = {"base": PAPER, "model": TINY, "dp_size": 1, "cp_size": 1, **overrides}
    return start_job("job", **arguments)  # type: ignore[arg-type]


def test_wrong_start_converges_to_the_measured_costs_within_a_few_steps() -> None:
    rng = np.random.default_rng(0)
    job = tiny_job()
    assert prediction_error(job, rng) > 0.9  # the H100 profile is three orders of magnitude off on a CPU
    for report in step_reports(rng, 5):
        job = observe(job, report)
    assert prediction_error(job, rng) < 0.05
    assert job.profile.compute.beta_s_per_layer == pytest.approx(1.5e-3, rel=0.25)
    assert job.profile.name == "h100-paper+feedback" and job.num_observations == 20


def test_a_launch_bound_job_refits_its_device_work_from_the_micro_batches_above_the_floor() -> None:
    """Under a profile with a launch-bound floor, the micro-batches measured at the floor were set by the host's
    dispatch: they are left out, and the compute-bound ones alone refit the device's coefficients (the floor
    stays the profile's)."""
    floor_s = 0.03  # binds the short micro-batches of step_reports' sampler on the true costs, not the long ones
    floored_truth = dataclasses.replace(TRUTH, compute=dataclasses.replace(
        TRUTH.compute, floor_s_per_layer=floor_s / TINY.num_layers))
    base = dataclasses.replace(PAPER, compute=dataclasses.replace(
        PAPER.compute, floor_s_per_layer=floor_s / TINY.num_layers))
    rng = np.random.default_rng(4)
    job = tiny_job(base=base)
    at_floor = 0
    for _ in range(8):
        report = []
        for _ in range(4):
            lengths = [int(n) for n in sample_lengths("lmsys", int(rng.integers(1, 9)), rng, max_length=2048)]
            time_s = true_time_s(floored_truth, lengths) * rng.lognormal(0, 0.03)
            at_floor += time_s < 1.15 * floor_s
            report.append(measured(lengths, time_s))
        job = observe(job, report)
    assert 0 < at_floor < 32 and len(job.compute_window) == 32 - at_floor
    assert job.profile.compute.floor_s_per_layer == base.compute.floor_s_per_layer
    assert job.profile.compute.beta_s_per_layer == pytest.approx(1.5e-3, rel=0.25)
    assert job.compute_scale * PAPER.compute.alpha_s_per_flop == pytest.approx(5e-11, rel=0.1)


def test_outliers_are_down_weighted_not_followed() -> None:
    rng = np.random.default_rng(1)
    clean, noisy = tiny_job(), tiny_job()
    for report in step_reports(rng, 20):
        clean = observe(clean, report)
    for report in step_reports(np.random.default_rng(1), 20, outlier_rate=0.15):
        noisy = observe(noisy, report)
    assert noisy.num_downweighted > 0
    assert prediction_error(noisy, rng) < 0.06
    assert noisy.compute_scale == pytest.approx(clean.compute_scale, rel=0.1)


def test_each_job_keeps_a_bounded_window_of_observations() -> None:
    job = tiny_job(config=FeedbackConfig(window=16))
    for report in step_reports(np.random.default_rng(2), 10):
        job = observe(job, report)
    assert job.num_observations == 40
    assert len(job.compute_window) == 16


def test_refit_follows_a_machine_that_slows_down() -> None:
    job = tiny_job(config=FeedbackConfig(window=32))
    rng = np.random.default_rng(3)
    for report in step_reports(rng, 10):
        job = observe(job, report)
    before = job.compute_scale
    for report in step_reports(rng, 10):  # every later micro-batch takes twice as long
        job = observe(job, [dataclasses.replace(m, time_s=2 * m.time_s) for m in report])
    assert job.compute_scale == pytest.approx(2 * before, rel=0.15)


def test_exposed_communication_is_not_mistaken_for_compute() -> None:
    base = parse_profile({**PAPER.raw, "name": "slow-network"})
    job = start_job("job", base=base, model=TINY, dp_size=1, cp_size=2)
    perf = PerformanceModel(model=TINY, profile=base)
    # One tiny distributed sequence: the model says its time is nearly all communication.
    comm_s = perf.comm_time_s(64)
    dist_s = perf.compute_time_s(perf.flops(64) / 2)
    report = [MicroBatchMeasurement(local_lengths=((), ()), distributed_lengths=(64,), time_s=comm_s + 3 * dist_s)]
    job = observe(job, report)
    assert job.compute_scale == pytest.approx(3.0, rel=0.05)  # only the compute part was three times slower


def test_memory_near_the_budget_caps_the_bucket_before_an_overrun() -> None:
    perf = PerformanceModel(model=TINY, profile=TRUTH)
    budget = perf.peak_bytes(20_000, 1) / 0.9  # 20K tokens per rank fill 90% of it
    optimistic = dataclasses.replace(PAPER, memory=dataclasses.replace(
        PAPER.memory, activation_per_layer_hidden=PAPER.memory.activation_per_layer_hidden / 4))
    job = start_job("job", base=optimistic, model=TINY, dp_size=1, cp_size=1, memory_budget_bytes=budget)
    assert job.bucket_cap is None and effective_bucket_size(job, 32_000, 100) == 32_000
    rng = np.random.default_rng(4)
    for _ in range(6):
        report = []
        for _ in range(4):
            tokens = int(rng.integers(4_000, 16_000))
            report.append(measured([tokens], 0.1, peak=perf.peak_bytes(tokens, 1)))
        job = observe(job, report)
    assert job.bucket_cap is not None
    assert job.bucket_cap == pytest.approx(20_000, rel=0.02)
    assert perf.peak_bytes(effective_bucket_size(job, 32_000, 100), 1) <= 0.9 * budget * 1.01


def test_one_measured_peak_over_the_headroom_shrinks_the_bucket_at_once() -> None:
    job = tiny_job(memory_budget_bytes=1e9)
    job = observe(job, [measured([8000], 0.1, peak=0.99e9)])
    assert job.bucket_cap is not None and job.bucket_cap < 8000


def test_cap_never_goes_below_what_the_longest_sequence_needs() -> None:
    job = dataclasses.replace(tiny_job(cp_size=4), bucket_cap=100)
    assert effective_bucket_size(job, 4096, longest_sequence=1000) == 250
    assert effective_bucket_size(job, 4096, longest_sequence=10) == 100
    assert effective_bucket_size(job, 50, longest_sequence=10) == 50  # never raised above the request


@pytest.mark.parametrize(
    ("bad", "field"),
    [
        pytest.param({"time_s": -0.1}, "time_ms", id="negative-time"),
        pytest.param({"time_s": math.inf}, "time_ms", id="infinite-time"),
        pytest.param({"peak_memory_bytes": 0.0}, "peak_memory_bytes", id="zero-memory"),
        pytest.param({"local_lengths": ((0,),)}, "local_lengths", id="empty-sequence"),
        pytest.param({"local_lengths": ((),)}, "local_lengths", id="no-sequence"),
    ],
)
def test_invalid_measurements_are_refused(bad: dict[str, object], field: str) -> None:
    arguments: dict[str, object] = {"local_lengths": ((100,),), "distributed_lengths": (), "time_s": 0.1,
                                    "peak_memory_bytes": None, **bad}
    with pytest.raises(InvalidRequestError) as caught:
        MicroBatchMeasurement(**arguments)  # type: ignore[arg-type]
    assert caught.value.field == field


def test_a_refused_report_leaves_the_job_exactly_as_it_was() -> None:
    job = observe(tiny_job(), [measured([100, 200], 0.05)])
    snapshot = dataclasses.replace(job)
    wrong_cp = MicroBatchMeasurement(local_lengths=((100,), (50,)), distributed_lengths=(), time_s=0.1)
    with pytest.raises(InvalidRequestError, match="cp_size 1") as caught:
        observe(job, [measured([300], 0.05), wrong_cp])
    assert caught.value.field == "micro_batches[1].local_lengths"
    assert job == snapshot


def test_refit_profile_is_itself_a_valid_profile_document() -> None:
    job = tiny_job(memory_budget_bytes=5e9)
    for report in step_reports(np.random.default_rng(5), 3):
        job = observe(job, [dataclasses.replace(m, peak_memory_bytes=1e8 + 3e4 * sum(m.local_lengths[0]))
                            for m in report])
    reparsed = profile_from_document(job.profile.raw)
    assert reparsed.compute == job.profile.compute
    assert reparsed.memory.activation_fixed_bytes_per_token == pytest.approx(job.memory_slope)
    assert reparsed.model == "tiny"


def test_refit_scales_a_shard_cost_with_the_other_measured_costs() -> None:
    """A shard's cost is host work like a sequence's: a machine measured slower by u pays u times it too."""
    base = dataclasses.replace(PAPER, compute=dataclasses.replace(PAPER.compute, alpha_s_per_shard=2e-3))
    job = tiny_job(base=base)
    for report in step_reports(np.random.default_rng(7), 3):
        job = observe(job, report)
    compute = job.profile.compute
    assert job.compute_scale != pytest.approx(1.0)
    assert compute.alpha_s_per_shard == pytest.approx(2e-3 * job.compute_scale)
    assert compute.alpha_s_per_flop == pytest.approx(PAPER.compute.alpha_s_per_flop * job.compute_scale)
    assert profile_from_document(job.profile.raw).compute == compute


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(1, 4096), min_size=1, max_size=8),
                          st.floats(1e-5, 1e3, allow_nan=False, allow_infinity=False),
                          st.one_of(st.none(), st.floats(1e3, 1e12, allow_nan=False, allow_infinity=False))),
                min_size=1, max_size=30))
def test_any_valid_report_keeps_the_refit_profile_valid(
    items: list[tuple[list[int], float, float | None]],
) -> None:
    job = tiny_job()
    job = observe(job, [measured(lengths, time_s, peak) for lengths, time_s, peak in items])
    compute = job.profile.compute
    assert compute.alpha_s_per_flop > 0 and compute.beta_s_per_layer >= 0
    assert job.bucket_cap is None or job.bucket_cap >= 1
    profile_from_document(job.profile.raw)


def test_extreme_measurements_never_make_a_coefficient_non_finite_or_non_positive() -> None:
    """Each value is valid alone; alternating the tiniest and the largest drove the refit to NaN and an overflow."""
    job = tiny_job()
    for step in range(20):
        tiny, huge = step % 2 == 0, step % 3 == 0
        report = [measured([1000 + 37 * step, 64], 1e-300 if tiny else 3600.0, 1e-300 if huge else float(1 << 50))
                  for _ in range(4)]
        job = observe(job, report)
        assert math.isfinite(job.compute_scale) and job.compute_scale > 0
        assert math.isfinite(job.fixed_s) and job.fixed_s >= 0
        assert job.memory_slope is not None and math.isfinite(job.memory_slope) and job.memory_slope > 0
        assert job.memory_intercept is not None and math.isfinite(job.memory_intercept)
        assert job.bucket_cap is None or job.bucket_cap >= 1
        profile_from_document(job.profile.raw)
