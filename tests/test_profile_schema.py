"""Profile files: the optional measured terms, provenance, folders of profiles, and the fitting helpers."""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from skrull_proto import ProfileDocument

from scheduler_service.contract.profiles import load_profile, load_profile_dir, profile_from_document
from scheduler_service.core.errors import InvalidRequestError
from scheduler_service.core.fitting import ComputePoint, fit_compute, fit_memory
from scheduler_service.core.models import MODEL_CATALOGUE
from scheduler_service.core.perf_model import PerformanceModel, eq13_flops, fit_line
from scheduler_service.core.plan import make_problem
from scheduler_service.core.profile import builtin_profiles, parse_profile

TINY = MODEL_CATALOGUE["tiny"]


def paper_document() -> dict[str, Any]:
    return copy.deepcopy(builtin_profiles()["h100-paper"].raw)


def measured_document(**compute: float) -> dict[str, Any]:
    """A tiny-model profile shaped like the profiler's output (numbers made up, not measured)."""
    document = paper_document()
    document.update(name="test-tiny", model="tiny", provenance={"date": "2025-01-01T00:00:00+00:00"})
    document["compute"] = {"alpha_s_per_flop": 5e-11, "beta_s_per_layer": 5e-4, "alpha_s_per_token": 2e-5,
                           "alpha_s_per_sequence": 1e-4, **compute}
    document["memory"]["activation_bytes_per_token"] = {"fixed": 28000.0, "per_layer_hidden": 0.0, "per_vocab": 0.0}
    document["communication"] = {"kv_bytes_per_element": 4, "tables": {}}
    return document


def test_shipped_profiles_load_and_the_paper_profile_keeps_eq13_flops() -> None:
    profiles = builtin_profiles()
    assert "h100-paper" in profiles
    perf = PerformanceModel(model=TINY, profile=profiles["h100-paper"])
    assert perf.flops(1000) == pytest.approx(float(eq13_flops(TINY, [1000])[0]))
    for profile in profiles.values():  # every shipped profile plans for its model (or any model)
        model = profile.model or "qwen2.5-0.5b"
        assert make_problem(sequence_lengths=[100, 200], dp_size=1, cp_size=1, model=model,
                            bucket_size=1024, profile=profile).perf.profile is profile


def test_shipped_profiles_are_valid_profile_documents() -> None:
    for name, profile in builtin_profiles().items():
        assert ProfileDocument.model_validate(profile.raw).name == name
        assert profile_from_document(profile.raw) == profile


def test_per_token_and_per_sequence_costs_enter_as_flop_equivalents() -> None:
    perf = PerformanceModel(model=TINY, profile=parse_profile(measured_document()))
    alpha, beta = 5e-11, 5e-4 * TINY.num_layers
    lengths = [100, 30, 7]
    expected = alpha * float(eq13_flops(TINY, lengths).sum()) + 2e-5 * sum(lengths) + 1e-4 * len(lengths) + beta
    assert perf.compute_time_s(float(perf.flops_array(lengths).sum())) == pytest.approx(expected, rel=1e-9)
    assert perf.flops_array([0])[0] == 0.0  # an empty sequence costs nothing


def test_profile_without_collective_tables_counts_communication_as_free() -> None:
    perf = PerformanceModel(model=TINY, profile=parse_profile(measured_document()))
    assert perf.comm_time_s(4096) == 0.0


def test_relative_communication_fit_follows_small_messages() -> None:
    table = ((4096.0, 1e-4), (65536.0, 2e-4), (1 << 20, 2e-3), (1 << 24, 3e-2))
    absolute, relative = fit_line(table), fit_line(table, relative=True)
    assert abs(relative(4096) - 1e-4) / 1e-4 < abs(absolute(4096) - 1e-4) / 1e-4
    assert relative(4096) == pytest.approx(1e-4, rel=0.5)


def test_measured_profile_refuses_to_plan_another_model() -> None:
    profile = parse_profile(measured_document())
    with pytest.raises(InvalidRequestError, match="measured for model tiny") as caught:
        make_problem(sequence_lengths=[10], dp_size=1, cp_size=1, model="qwen2.5-0.5b", bucket_size=64,
                     profile=profile)
    assert caught.value.field == "profile"


def test_provenance_is_carried() -> None:
    assert parse_profile(measured_document()).provenance["date"].startswith("2025")
    assert builtin_profiles()["h100-paper"].provenance == {}


@pytest.mark.parametrize(
    ("mutate", "message", "field"),
    [
        pytest.param(lambda d: d["compute"].update(alpha_s_per_flop=float("nan")), "finite",
                     "compute.alpha_s_per_flop", id="nan-alpha"),
        pytest.param(lambda d: d["compute"].update(alpha_s_per_token=-1.0), "alpha_s_per_token",
                     "compute.alpha_s_per_token", id="negative"),
        pytest.param(lambda d: d["compute"].update(beta_s_per_layer="fast"), "beta_s_per_layer",
                     "compute.beta_s_per_layer", id="not-a-number"),
        pytest.param(lambda d: d["communication"].update(tables={"all_gather": [[1, 1e-5]]}), "at least 2",
                     "communication.tables.all_gather", id="one-point-table"),
        pytest.param(lambda d: d["communication"].update(fit="cubic"), "communication.fit", "communication.fit",
                     id="unknown-fit"),
        # a section that is not a JSON object is a named 4xx, not an AttributeError (500)
        pytest.param(lambda d: d.update(hardware=[]), "hardware: must be a JSON object", "hardware",
                     id="hardware-list"),
        pytest.param(lambda d: d.update(compute=3), "compute: must be a JSON object", "compute", id="compute-number"),
        pytest.param(lambda d: d.update(memory="big"), "memory: must be a JSON object", "memory", id="memory-string"),
        pytest.param(lambda d: d.update(communication=None), "communication: must be a JSON object", "communication",
                     id="communication-null"),
        pytest.param(lambda d: d["communication"].update(tables=[]), "communication.tables: must be a JSON object",
                     "communication.tables", id="tables-list"),
        pytest.param(lambda d: d["memory"].update(activation_bytes_per_token=[1, 2]),
                     "memory.activation_bytes_per_token: must be a JSON object",
                     "memory.activation_bytes_per_token", id="activation-list"),
        pytest.param(lambda d: d["communication"].update(tables={"all_gather": 5}), "tables.all_gather",
                     "communication.tables.all_gather", id="table-not-a-list"),
        pytest.param(lambda d: d["communication"].update(tables={"all_gather": [[1, 2, 3]]}), "tables.all_gather",
                     "communication.tables.all_gather[0]", id="table-triple"),
        # duplicated sizes leave one distinct point: the line fit would be degenerate (np.polyfit RankWarning)
        pytest.param(lambda d: d["communication"].update(tables={
            "all_gather": [[4096, 1e-5], [4096, 2e-5]], "reduce_scatter": [[4096, 1e-5], [8192, 2e-5]]}),
            "all_gather needs .* 2 distinct sizes", "communication.tables.all_gather", id="duplicate-sizes"),
        # beyond any device: planning with it would overflow
        pytest.param(lambda d: d["compute"].update(beta_s_per_layer=1e308), "less than or equal to 3600",
                     "compute.beta_s_per_layer", id="absurd-seconds"),
        pytest.param(lambda d: d["hardware"].update(device_memory_bytes=1e300), "less than or equal to",
                     "hardware.device_memory_bytes", id="absurd-bytes"),
        pytest.param(lambda d: d["compute"].update(alpha_s_per_flop=5e-324), "at least 1e-24",
                     "compute.alpha_s_per_flop", id="denormal-alpha"),
        pytest.param(lambda d: d.update(model=17), "model", "model", id="model-not-a-name"),
        pytest.param(lambda d: d.update(schema_version=2), "schema_version", "schema_version", id="other-version"),
    ],
)
def test_bad_profile_fields_are_named(mutate: Any, message: str, field: str) -> None:
    """Shape errors (the format's model) and range errors (the core's ``Profile``) alike name the field."""
    document = measured_document()
    mutate(document)
    with pytest.raises(InvalidRequestError, match=message) as caught:
        profile_from_document(document)
    assert caught.value.field == f"profile.{field}"


def test_profile_folder_is_read_whole_or_not_at_all(tmp_path: Path) -> None:
    (tmp_path / "a.json").write_text(json.dumps(measured_document()))
    (tmp_path / "notes.txt").write_text("not a profile")
    assert list(load_profile_dir(tmp_path)) == ["test-tiny"]
    (tmp_path / "b.json").write_text(json.dumps(measured_document()))
    with pytest.raises(InvalidRequestError, match=r"a\.json and .*b\.json are both named 'test-tiny'"):
        load_profile_dir(tmp_path)
    (tmp_path / "b.json").write_text("{not json")
    with pytest.raises(InvalidRequestError, match=r"b\.json"):
        load_profile_dir(tmp_path)
    with pytest.raises(InvalidRequestError, match="does not exist") as caught:
        load_profile_dir(tmp_path / "missing")
    assert caught.value.field == "profile_dir"


def test_loading_a_file_names_it_in_the_error(tmp_path: Path) -> None:
    path = tmp_path / "broken.json"
    document = measured_document()
    del document["memory"]
    path.write_text(json.dumps(document))
    with pytest.raises(InvalidRequestError, match=r"broken\.json.*memory"):
        load_profile(path)


def test_fit_compute_recovers_known_coefficients_and_reports_its_error() -> None:
    rng = np.random.default_rng(0)
    truth = {"alpha": 4e-11, "token": 2e-5, "sequence": 1.5e-4, "beta": 8e-4}
    points = []
    for _ in range(30):
        lengths = rng.integers(16, 2048, size=int(rng.integers(1, 20)))
        flops = float(eq13_flops(TINY, lengths).sum())
        time_s = (truth["alpha"] * flops + truth["token"] * lengths.sum() + truth["sequence"] * len(lengths)
                  + truth["beta"] * TINY.num_layers)
        points.append(ComputePoint(flops=flops, num_tokens=int(lengths.sum()), num_sequences=len(lengths),
                                   time_s=time_s))
    fit = fit_compute(points, num_layers=TINY.num_layers)
    assert fit.alpha_s_per_flop == pytest.approx(truth["alpha"], rel=1e-6)
    assert fit.alpha_s_per_token == pytest.approx(truth["token"], rel=1e-6)
    assert fit.alpha_s_per_sequence == pytest.approx(truth["sequence"], rel=1e-6)
    assert fit.beta_s_per_layer == pytest.approx(truth["beta"], rel=1e-6)
    assert fit.max_relative_error < 1e-9
    paper = fit_compute(points, num_layers=TINY.num_layers, extended=False)
    assert paper.alpha_s_per_token == paper.alpha_s_per_sequence == 0.0
    assert paper.median_relative_error > fit.median_relative_error  # eq. 14 alone cannot express the extra costs


def _launch_bound_points(floor_s: float, rng: np.random.Generator) -> list[ComputePoint]:
    """Micro-batches of 16 to 4,000 tokens timed max(floor, device time): the small ones at the floor."""
    points = []
    for _ in range(40):
        lengths = rng.integers(16, 400, size=int(rng.integers(1, 10)))
        flops = float(eq13_flops(TINY, lengths).sum())
        device_s = 4e-11 * flops + 2e-5 * lengths.sum() + 1.5e-4 * len(lengths) + 8e-4 * TINY.num_layers
        points.append(ComputePoint(flops=flops, num_tokens=int(lengths.sum()), num_sequences=len(lengths),
                                   time_s=max(floor_s, device_s)))
    return points


def test_the_floor_fit_recovers_a_launch_bound_floor_and_the_device_coefficients() -> None:
    points = _launch_bound_points(0.05, np.random.default_rng(0))
    assert sum(point.time_s == 0.05 for point in points) >= 10  # the floor binds, and not everywhere
    fit = fit_compute(points, num_layers=TINY.num_layers, floor=True)
    assert fit.floor_s_per_layer * TINY.num_layers == pytest.approx(0.05, rel=1e-9)
    assert fit.alpha_s_per_flop == pytest.approx(4e-11, rel=1e-6)
    assert fit.beta_s_per_layer == pytest.approx(8e-4, rel=1e-6)
    assert fit.max_relative_error < 1e-9
    additive = fit_compute(points, num_layers=TINY.num_layers)
    assert additive.floor_s_per_layer == 0.0 and additive.max_relative_error > 0.1  # a sum cannot bend


def test_the_floor_fit_puts_a_jittering_floor_at_the_centre_of_its_spread() -> None:
    """The host's dispatch time jitters: floor-bound times of any work scatter around it. The floor is the value
    equally far, relatively, from the fastest and the slowest of them, the smallest worst error one floor can
    have; least squares on relative error would lean to the fastest."""
    points = _launch_bound_points(0.05, np.random.default_rng(0))
    jitter = np.random.default_rng(1).uniform(0.9, 1.15, size=len(points))
    jittered = [replace(point, time_s=point.time_s * factor) if point.time_s == 0.05 else point
                for point, factor in zip(points, jitter, strict=True)]
    held = np.array([point.time_s for point, old in zip(jittered, points, strict=True) if old.time_s == 0.05])
    fit = fit_compute(jittered, num_layers=TINY.num_layers, floor=True)
    floor_s = fit.floor_s_per_layer * TINY.num_layers
    assert floor_s == pytest.approx(2 * held.min() * held.max() / (held.min() + held.max()), rel=1e-9)
    assert floor_s / held.min() - 1 == pytest.approx(1 - floor_s / held.max(), rel=1e-9)
    assert fit.max_relative_error == pytest.approx((held.max() - held.min()) / (held.max() + held.min()), rel=1e-6)
    assert fit.alpha_s_per_flop == pytest.approx(4e-11, rel=1e-6)  # the work above the floor fits as before


def test_the_floor_fit_finds_no_floor_where_times_add() -> None:
    points = _launch_bound_points(0.0, np.random.default_rng(1))
    fit = fit_compute(points, num_layers=TINY.num_layers, floor=True)
    assert fit.floor_s_per_layer == 0.0 and fit.max_relative_error < 1e-9


def test_fit_compute_keeps_coefficients_non_negative() -> None:
    # Times that fall with the number of sequences would want a negative per-sequence cost.
    points = [ComputePoint(flops=1e9 * n, num_tokens=100 * n, num_sequences=s, time_s=0.01 * n - 0.0001 * s)
              for n, s in [(1, 1), (2, 10), (4, 3), (8, 40), (3, 30), (5, 2)]]
    fit = fit_compute(points, num_layers=2)
    assert min(fit.alpha_s_per_token, fit.alpha_s_per_sequence, fit.beta_s_per_layer) >= 0
    assert fit.alpha_s_per_flop > 0


def test_fit_memory_recovers_a_line_and_refuses_one_size() -> None:
    fit = fit_memory([(256, 256 * 28000 + 5000), (1024, 1024 * 28000 + 5000), (2048, 2048 * 28000 + 5000)])
    assert fit.bytes_per_token == pytest.approx(28000)
    assert fit.beta_bytes == pytest.approx(5000, abs=1)
    with pytest.raises(InvalidRequestError, match="2 distinct"):
        fit_memory([(256, 1e6), (256, 1.1e6)])
