"""The performance model follows the paper's appendix C formulas."""

import dataclasses
import math

import pytest

from scheduler_service.core.models import MODEL_CATALOGUE
from scheduler_service.core.perf_model import PerformanceModel, fit_line
from scheduler_service.core.profile import builtin_profiles
from tests.problem_builders import LAUNCH_BOUND_FLOOR_S_PER_LAYER, with_floor


@pytest.fixture
def qwen_half() -> PerformanceModel:
    return PerformanceModel(model=MODEL_CATALOGUE["qwen2.5-0.5b"], profile=builtin_profiles()["h100-paper"])


def test_flops_follow_eq13_summed_over_layers(qwen_half: PerformanceModel) -> None:
    h, h_kv, s = 896, 2 * 64, 4096
    per_layer = 20 * h * h * s + 4 * h * h_kv * s + 4 * h * s * s
    assert qwen_half.flops(s) == pytest.approx(24 * per_layer)
    assert qwen_half.flops_array([s])[0] == pytest.approx(qwen_half.flops(s))


def test_quadratic_term_dominates_past_a_few_thousand_tokens_for_qwen_half(qwen_half: PerformanceModel) -> None:
    # Appendix C.2: for Qwen2.5-0.5B the quadratic term takes over around 4K tokens. The model's FLOPs are
    # a·S + b·S²: two evaluations give a and b, and the crossover S = a / b.
    s = 1000.0
    quadratic = (qwen_half.flops(2 * s) - 2 * qwen_half.flops(s)) / (2 * s * s)
    linear = qwen_half.flops(s) / s - quadratic * s
    assert 4000 < linear / quadratic < 5000
    # "when S = 32K the workload is about 30x that of S = 4K while memory grows 4x" (order of magnitude)
    assert 20 < qwen_half.flops(32 * 1024) / qwen_half.flops(4 * 1024) < 40


def test_a_launch_bound_profile_prices_a_group_at_its_floor_or_its_device_time(qwen_half: PerformanceModel) -> None:
    floored = PerformanceModel(model=qwen_half.model, profile=with_floor(LAUNCH_BOUND_FLOOR_S_PER_LAYER))
    assert floored.compute_floor_s == pytest.approx(LAUNCH_BOUND_FLOOR_S_PER_LAYER * 24)
    small, large = qwen_half.flops(256), qwen_half.flops(32_768)
    assert qwen_half.compute_time_s(small) < floored.compute_floor_s  # what the floor hides
    assert floored.compute_time_s(small) == floored.compute_floor_s  # max, not sum
    assert floored.compute_time_s(large) == qwen_half.compute_time_s(large) == floored.device_time_s(large)
    assert floored.compute_time_s(0.0) == 0.0


def test_nothing_to_compute_or_send_costs_nothing(qwen_half: PerformanceModel) -> None:
    assert qwen_half.compute_time_s(0.0) == 0.0
    assert qwen_half.comm_time_s(0) == 0.0
    assert qwen_half.compute_time_s(1.0) >= qwen_half.compute_beta_s


def test_comm_time_is_linear_plus_fixed_fitted_to_the_latency_table(qwen_half: PerformanceModel) -> None:
    table = builtin_profiles()["h100-paper"].communication.tables["all_gather"]
    fit = fit_line(table)
    assert fit.intercept > 0 and fit.slope > 0
    # the fit stays within 30% of every measured point above 8 MiB
    for size, latency in table:
        if size >= 8 * 2**20:
            assert fit(size) == pytest.approx(latency, rel=0.3)
    one_token = qwen_half.comm_time_s(1)
    assert one_token == pytest.approx(24 * (qwen_half.all_gather.intercept + qwen_half.reduce_scatter.intercept),
                                      rel=1e-3)


def test_bucket_size_grows_with_more_state_shards_and_device_memory(qwen_half: PerformanceModel) -> None:
    assert qwen_half.bucket_size(32) > qwen_half.bucket_size(1)
    assert qwen_half.bucket_size(8, device_memory_bytes=40 * 2**30) < qwen_half.bucket_size(8)
    static = qwen_half.static_bytes(8)
    free = 80 * 2**30 - 4 * 2**30 - static
    assert qwen_half.bucket_size(8) == math.floor(free / qwen_half.activation_bytes_per_token)


def test_model_parameter_counts_match_published_sizes() -> None:
    assert MODEL_CATALOGUE["qwen2.5-0.5b"].num_parameters == pytest.approx(494e6, rel=0.02)
    assert MODEL_CATALOGUE["qwen2.5-7b"].num_parameters == pytest.approx(7.62e9, rel=0.02)
    assert MODEL_CATALOGUE["llama-3-8b"].num_parameters == pytest.approx(8.03e9, rel=0.02)


def test_a_sharded_sequence_costs_each_rank_the_profiles_shard_cost_and_a_whole_one_does_not() -> None:
    profile = builtin_profiles()["cpu-tiny"]
    costly = dataclasses.replace(profile, compute=dataclasses.replace(profile.compute, alpha_s_per_shard=3e-3))
    plain = PerformanceModel(model=MODEL_CATALOGUE["tiny"], profile=profile)
    with_cost = PerformanceModel(model=MODEL_CATALOGUE["tiny"], profile=costly)
    lengths = [0, 64, 4096]
    assert with_cost.placement_flops(lengths, 1).tolist() == plain.placement_flops(lengths, 1).tolist()
    for degree in (2, 4):
        extra_flops = with_cost.placement_flops(lengths, degree) - plain.placement_flops(lengths, degree)
        assert (extra_flops * profile.compute.alpha_s_per_flop).tolist() == pytest.approx([0.0, 3e-3, 3e-3])
