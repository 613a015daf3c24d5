"""The profiler (``python -m trainer_client.profile``): a short sweep on this machine gives a profile file with
provenance that the service and the CLI accept; under gloo ranks it adds collectives (over the world and over
every hybrid block size) and the shard effect per degree, from which the attention efficiency is derived."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from fastapi.testclient import TestClient
from skrull_proto import PlanResponse, ProfileDocument

from scheduler_service import cli
from scheduler_service.contract.profiles import load_profile, profile_from_document
from scheduler_service.core.check import find_violations
from scheduler_service.core.fitting import ComputeFit
from scheduler_service.core.memory import ActivationCheckpointing, Sharding, training_profile
from scheduler_service.core.models import MODEL_CATALOGUE
from scheduler_service.core.perf_model import PerformanceModel, eq13_flops, fit_line
from scheduler_service.core.plan import DPRankPlan, MicroBatch, Plan, ShardedGroup, make_problem
from scheduler_service.core.planner import make_plan
from scheduler_service.core.profile import builtin_profiles, parse_profile
from scheduler_service.core.shard_effect import efficiency_candidate, predicted_shard_s
from scheduler_service.runtime.settings import Settings
from scheduler_service.web.app import create_app
from tests.shard_effect_cases import TRUE_CURVE, flat_and_true_models, rows_timed_by
from trainer_client.distributed import ParallelDims, init_parallel, spawn_gloo
from trainer_client.models.loading import ModelLayout, build_training_module
from trainer_client.models.loss import run_micro_batch
from trainer_client.planning.source import PlanSource
from trainer_client.profiler import command as profiler
from trainer_client.profiler import sweeps as profile_sweeps
from trainer_client.profiler.document import compute_section, document_json, with_shard_effect
from trainer_client.profiler.measure import check_profile_machine, local_pack, peak_bytes
from trainer_client.profiler.sweeps import (
    ProfileOptions,
    collective_lead_s,
    compute_cases,
    shard_degrees,
    shard_micro_batch,
)

# Small and quick: a few seconds on 2 cores. The numbers are whatever this machine measures; tests check shape.
QUICK = ["--model", "tiny", "--sizes", "32,64,128", "--short-length", "16", "--memory-sizes", "32,96",
         "--repeats", "1", "--warmup", "0", "--threads", "1", "--no-progress"]


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("profile") / "cpu-tiny-test.json"
    assert profiler.main([*QUICK, "--out", str(out), "--name", "cpu-tiny-test"]) == 0
    return out


def test_profiler_writes_a_profile_with_fits_and_provenance(measured: Path) -> None:
    document = json.loads(measured.read_text())
    profile = load_profile(measured)
    assert (profile.name, profile.model) == ("cpu-tiny-test", "tiny")
    assert profile.compute.alpha_s_per_flop > 0 and profile.memory.activation_fixed_bytes_per_token > 0
    fits = document["compute"]["fit"]
    assert set(fits) == {"extended", "paper_eq14", "form"} and fits["form"] == "extended"  # a CPU adds its costs
    assert fits["extended"]["median_relative_error"] >= 0
    assert len(document["compute"]["points"]) == len(compute_cases((32, 64, 128), 16))
    provenance = document["provenance"]
    assert provenance["model"]["hidden_size"] == MODEL_CATALOGUE["tiny"].hidden_size
    assert provenance["software"]["torch"] and provenance["hardware"]["cpu_count"] >= 1
    assert provenance["date"].startswith("20") and provenance["world_size"] == 1
    assert document["communication"]["tables"] == {}  # one process measures no collective
    inter_node = document["communication"]["inter_node"]  # nor any across nodes, and says so
    assert inter_node["tables"] == {} and inter_node["source"].startswith("none: measured on one node")
    # one replica's static memory is measured tensor by tensor: fp32 weights + gradients + two AdamW states
    num_parameters = MODEL_CATALOGUE["tiny"].num_parameters
    assert sum(document["memory"]["static_bytes"].values()) == pytest.approx(16 * num_parameters, rel=0.01)
    # the per-parameter terms are the trainer's default sharding (zero2, fp32): unsharded weights + gradients
    assert document["memory"]["static_bytes_per_parameter"] == {"replicated": 8, "sharded": 16}
    assert document["memory"]["activation_checkpointing"] == "none"
    perf = PerformanceModel(model=MODEL_CATALOGUE["tiny"], profile=profile)
    assert perf.bucket_size(1) > 0


def test_measured_profile_is_accepted_by_the_service_and_the_cli(
    measured: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "profiles"
    folder.mkdir()
    shutil.copy(measured, folder / measured.name)
    request = {"sequence_lengths": [300, 1200, 80, 40, 700], "dp_size": 1, "cp_size": 1, "model": "tiny",
               "profile": "cpu-tiny-test"}
    settings = Settings(cpsat_warmup=False, warmup=False, access_log=False, profile_dir=folder)
    with TestClient(create_app(settings)) as client:
        assert "cpu-tiny-test" in [p["name"] for p in client.get("/models").json()["profiles"]]
        response = client.post("/plan", json=request)
    assert response.status_code == 200, response.text
    served = PlanResponse.model_validate_json(response.content)
    assert served.profile == "cpu-tiny-test" and served.bucket_size > 1200  # derived from the measured memory

    request_file = tmp_path / "request.json"
    request_file.write_text(json.dumps({key: value for key, value in request.items() if key != "profile"}))
    assert cli.main(["plan", str(request_file), "--profile-file", str(measured)]) == 0
    planned = PlanResponse.model_validate_json(capsys.readouterr().out)
    assert planned.profile == "cpu-tiny-test"
    assert planned.estimated_iteration_time_ms == pytest.approx(served.estimated_iteration_time_ms)


def test_compute_sweep_mixes_long_short_tiny_and_mixed_sequences() -> None:
    cases = dict(compute_cases((64, 512), 128))
    assert cases["long-512"] == (512,)
    assert cases["short-512"] == (128,) * 4
    assert cases["tiny-512"] == (32,) * 16
    assert cases["mixed-512"] == (256, 128, 128)
    assert cases["short-64"] == (32, 32)
    assert all(sum(lengths) <= int(name.split("-")[1]) for name, lengths in cases.items())


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        pytest.param(["--sizes", "64"], "at least 2 sizes", id="one-size"),
        pytest.param(["--sizes", "0,64"], "must be positive", id="zero-size"),
        pytest.param(["--repeats", "0"], "--repeats", id="no-repeats"),
        pytest.param(["--threads", "0"], "--threads", id="no-threads"),
        pytest.param(["--model", "gpt-17"], "gpt-17", id="unknown-model"),
    ],
)
def test_profiler_rejects_bad_options_with_exit_2(
    arguments: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert profiler.main([*QUICK, "--out", str(tmp_path / "p.json"), *arguments]) == profiler.EXIT_USER_ERROR
    assert message in capsys.readouterr().err
    assert not (tmp_path / "p.json").exists()


def _profile_ranks(out_path: Path) -> None:
    options = ProfileOptions(model="tiny", sizes=(32, 64), short_length=16, memory_sizes=(32, 64),
                                      comm_sizes=(1024, 8192), shard_sizes=(64,), repeats=1, warmup=0,
                                      progress=False)
    document = profiler.measure_profile(options)
    if dist.get_rank() == 0:
        assert document is not None
        out_path.write_text(json.dumps(document))
    else:
        assert document is None


@pytest.mark.slow
def test_two_ranks_measure_collectives_and_the_shard_effect(tmp_path: Path) -> None:
    out_path = tmp_path / "two-ranks.json"
    spawn_gloo(_profile_ranks, 2, out_path)
    document: dict[str, Any] = json.loads(out_path.read_text())
    tables = document["communication"]["tables"]
    assert set(tables) == {"all_gather", "reduce_scatter", "all_to_all"}
    assert all(len(table) == 2 and all(latency > 0 for _, latency in table) for table in tables.values())
    assert document["communication"]["world_size"] == 2 and document["communication"]["fit"] == "relative"
    assert document["communication"]["tables_by_group_size"] == {}  # no block size between 2 and 2
    shard, ulysses = document["compute"]["shard_effect"]  # zigzag, then Ulysses: tiny's 4 and 2 heads split over 2
    assert shard["num_tokens"] == 64 and shard["degree"] == 2 and shard["query_tokens"] == 16
    assert shard["whole_s"] > 0 and shard["shard_s"] > 0 and shard["predicted_shard_s"] > 0
    assert ulysses["ulysses_degree"] == 2 and ulysses["query_tokens"] == 64 and ulysses["shard_s"] > 0
    assert document["compute"]["fit"]["ulysses_shard_cost"]["candidates"][0]["num_tokens"] == 64
    perf = PerformanceModel(model=MODEL_CATALOGUE["tiny"], profile=parse_profile(document))
    assert perf.comm_time_s(64) > 0  # distributed sequences now pay for their collectives


@pytest.mark.slow
def test_four_ranks_measure_every_degree_and_the_tables_of_blocks_of_two(tmp_path: Path) -> None:
    out_path = tmp_path / "four-ranks.json"
    spawn_gloo(_profile_ranks, 4, out_path)
    document: dict[str, Any] = json.loads(out_path.read_text())
    compute, communication = document["compute"], document["communication"]
    assert [(row["num_tokens"], row["degree"], row.get("ulysses_degree", 1)) for row in compute["shard_effect"]] == [
        (64, 2, 1), (64, 2, 2), (64, 4, 1), (64, 4, 4)]
    assert all(row["shard_s"] > 0 and row["predicted_shard_s"] > 0 for row in compute["shard_effect"])
    assert communication["world_size"] == 4 and set(communication["tables_by_group_size"]) == {"2"}
    pair_tables = communication["tables_by_group_size"]["2"]
    assert set(pair_tables) == {"all_gather", "reduce_scatter"}
    assert all([size for size, _ in table] == [1024, 8192] and all(latency > 0 for _, latency in table)
               for table in pair_tables.values())
    # Efficiency is written only with its derivation beside it, and the note says which way it went.
    derivation = compute["fit"]["attention_efficiency"]
    assert ("attention_efficiency" in compute) == derivation["result"].startswith("written")
    assert derivation["result"] in compute["shard_effect_note"]

    profile = parse_profile(document)
    perf = PerformanceModel(model=MODEL_CATALOGUE["tiny"], profile=profile)
    cost = perf.collective_cost(2)
    all_gather = fit_line(profile.communication.tables_by_group_size[2]["all_gather"], relative=True)
    reduce_scatter = fit_line(profile.communication.tables_by_group_size[2]["reduce_scatter"], relative=True)
    layers, bytes_per_token = MODEL_CATALOGUE["tiny"].num_layers, perf.comm_bytes_per_layer(1.0)
    assert cost.all_gather_fixed_s == pytest.approx(layers * all_gather.intercept)
    assert cost.all_gather_s_per_token == pytest.approx(layers * all_gather.slope * bytes_per_token)
    assert cost.reduce_scatter_fixed_s == pytest.approx(layers * reduce_scatter.intercept)
    assert cost.reduce_scatter_s_per_token == pytest.approx(layers * reduce_scatter.slope * bytes_per_token)

    table = profiler.summary(document).splitlines()
    assert any(line.split()[:2] == ["64", "2"] for line in table) and any(
        line.split()[:2] == ["64", "4"] for line in table)
    assert any(line.startswith("communication over 2 ranks: all_gather") for line in table)


@pytest.mark.parametrize("group_size", [2, 4])
def test_collective_lead_is_a_static_cp_micro_batchs_compute_per_collective(group_size: int) -> None:
    """A collective is timed after the compute that precedes it in training: the micro-batch's per-rank time
    under the model (one sequence zigzag-sharded over the group) over its 2 · num_layers collectives."""
    shape = MODEL_CATALOGUE["tiny"]
    profile = builtin_profiles()["cpu-tiny"]
    perf = PerformanceModel(model=shape, profile=profile)
    compute = profile.compute
    fit = ComputeFit(alpha_s_per_flop=compute.alpha_s_per_flop, alpha_s_per_token=compute.alpha_s_per_token,
                     alpha_s_per_sequence=compute.alpha_s_per_sequence, beta_s_per_layer=compute.beta_s_per_layer,
                     median_relative_error=0.0, max_relative_error=0.0, num_points=0)
    num_tokens = 1024
    num_bytes = perf.comm_bytes_per_layer(num_tokens)
    per_rank_s = perf.compute_time_s(float(perf.placement_flops([num_tokens], group_size)[0]))
    assert collective_lead_s(fit, shape, num_bytes, group_size, 4) == pytest.approx(
        per_rank_s / (2 * shape.num_layers))


def test_shard_micro_batch_puts_one_sequence_on_every_aligned_block() -> None:
    assert shard_degrees(1) == () and shard_degrees(2) == (2,)
    assert shard_degrees(8) == (2, 4, 8)
    assert shard_micro_batch(4, 2) == MicroBatch(
        local=((),) * 4, distributed=(),
        sharded=(ShardedGroup(cp_ranks=(0, 1), sequences=(0,)), ShardedGroup(cp_ranks=(2, 3), sequences=(1,))))
    assert shard_micro_batch(4, 4) == MicroBatch(local=((),) * 4, distributed=(0,))
    for degree in shard_degrees(8):  # each is a plan the trainer would accept
        micro_batch = shard_micro_batch(8, degree)
        lengths = [512] * len(micro_batch.indices())
        assert find_violations(Plan(dp_ranks=(DPRankPlan(micro_batches=(micro_batch,)),)), sequence_lengths=lengths,
                               dp_size=1, cp_size=8, bucket_size=512) == []


# ---- the shard effect and the attention efficiency in the document (synthetic rows, no processes) --------------


def test_written_efficiency_makes_the_model_reproduce_the_measured_shard_times() -> None:
    document, _, true = flat_and_true_models()
    rows = rows_timed_by(true, [1024, 4096], [2, 4])
    options = ProfileOptions(model="tiny", shard_sizes=(1024, 4096))
    written = document_json(with_shard_effect(ProfileDocument.model_validate(document), MODEL_CATALOGUE["tiny"],
                                              rows, options))
    assert written["compute"]["attention_efficiency"]["source"].startswith("derived from compute.shard_effect")
    derived = PerformanceModel(model=MODEL_CATALOGUE["tiny"], profile=parse_profile(written))
    for row in rows:
        assert predicted_shard_s(derived, row["num_tokens"], row["degree"]) == pytest.approx(row["shard_s"])
    assert [row["predicted_shard_s"] < row["shard_s"] for row in written["compute"]["shard_effect"]] == [True] * 4
    assert "attention efficiency (relative throughput" in profiler.summary(written)


def test_written_shard_cost_and_efficiency_together_reproduce_the_measured_shard_times() -> None:
    """A machine whose shards each cost 2 ms beyond the model and whose kernel follows TRUE_CURVE: the profile
    gets both, the cost from the 64-token rows and the curve from the rest read with that cost, and its model then
    times every row as measured."""
    document, _, _ = flat_and_true_models()
    true_document = json.loads(json.dumps(document))
    true_document["compute"] |= {"alpha_s_per_shard": 2e-3,
                                 "attention_efficiency": {"points": TRUE_CURVE, "source": "test"}}
    rows = rows_timed_by(PerformanceModel(model=MODEL_CATALOGUE["tiny"], profile=parse_profile(true_document)),
                         [64, 1024, 4096], [2, 4])
    written = document_json(with_shard_effect(ProfileDocument.model_validate(document), MODEL_CATALOGUE["tiny"],
                                              rows, ProfileOptions(model="tiny", shard_sizes=(64, 1024, 4096))))
    compute = written["compute"]
    # within 5 %: the cost takes in the 64-token rows' attention at its true efficiency, 1-3 % of their time
    assert compute["alpha_s_per_shard"] == pytest.approx(2e-3, rel=0.05)
    assert "ms: the median of 2 sharded row(s)" in compute["fit"]["shard_cost"]["result"]
    assert compute["attention_efficiency"]["source"].startswith("derived from compute.shard_effect")
    derived = PerformanceModel(model=MODEL_CATALOGUE["tiny"], profile=parse_profile(written))
    shortest_on_curve = compute["attention_efficiency"]["points"][0][0]
    for row in compute["shard_effect"]:  # a shorter query is priced at the curve's first point
        tolerance = 0.01 if row["query_tokens"] >= shortest_on_curve else 0.1
        assert predicted_shard_s(derived, row["num_tokens"], row["degree"]) == pytest.approx(row["shard_s"],
                                                                                             rel=tolerance)
    assert "ms per sharded sequence and rank beyond the model's terms" in profiler.summary(written)


def test_an_undetermined_efficiency_is_left_out_and_the_note_says_why() -> None:
    document, flat, true = flat_and_true_models()
    rows = rows_timed_by(true, [2048], [2, 4])
    for row in rows:  # shards faster than the model's non-attention terms alone: noise, not attention
        row["shard_s"] = 0.5 * efficiency_candidate(flat, row["num_tokens"], row["degree"], row["shard_s"]).other_s
    options = ProfileOptions(model="tiny", shard_sizes=(2048,))
    written = document_json(with_shard_effect(ProfileDocument.model_validate(document), MODEL_CATALOGUE["tiny"],
                                              rows, options))
    assert "attention_efficiency" not in written["compute"]
    assert "attention_efficiency: omitted: 1 usable" in written["compute"]["shard_effect_note"]
    profile_from_document(written)


def test_trainer_plans_with_a_profile_file_and_asks_the_service_for_it_by_name(measured: Path) -> None:
    profile = load_profile(measured)
    source = PlanSource(scheduler="skrull", dp_size=1, cp_size=1, model="tiny", bucket_size=1024, profile=profile)
    lengths = [300, 1000, 80, 40, 700]
    decision = source.decide(0, lengths)
    expected = make_plan(make_problem(sequence_lengths=lengths, dp_size=1, cp_size=1, model="tiny",
                                      bucket_size=1024, profile=profile), "skrull")
    assert decision.plan == expected.plan
    assert decision.estimated_time_ms == pytest.approx(expected.estimate.iteration_time_s * 1e3)
    assert source._request(lengths).profile == "cpu-tiny-test"
    source.close()


def test_the_activations_and_the_memory_models_static_bytes_add_up_to_each_measured_peak(measured: Path) -> None:
    """Which bytes live where. The memory model (``scheduler_service.core.memory``) counts a layout's weights,
    gradients and AdamW states; the profile holds the rest of each measured peak as activations. In the layout the
    profile was measured in (zero2, float32, one rank) the two add up to every peak: nothing is counted in both,
    nothing in neither, and the trainer's memory model adds back exactly what the profiler took out."""
    memory = json.loads(measured.read_text())["memory"]
    shape = MODEL_CATALOGUE["tiny"]
    layout = training_profile(load_profile(measured), shape, sharding=Sharding.ZERO2, compute_bytes=4,
                              activation_checkpointing=ActivationCheckpointing.NONE)
    static = PerformanceModel(model=shape, profile=layout).static_bytes(num_state_shards=1)
    assert memory["static_bytes_counted"] == pytest.approx(static)
    assert static >= sum(memory["static_bytes"].values())  # at least the tensors the rank holds between steps
    for (tokens, activations), (peak_tokens, peak) in zip(memory["points"], memory["peaks"], strict=True):
        assert tokens == peak_tokens
        assert activations + static == pytest.approx(peak, abs=1)
        assert 0 < activations < peak


def test_a_layout_whose_states_cannot_fit_is_refused_before_any_model_is_built(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("a model was built")

    monkeypatch.setattr(profile_sweeps, "build_training_module", never)
    num_parameters = MODEL_CATALOGUE["tiny"].num_parameters  # zero2 keeps 24 B each in float32, zero3 16
    out = str(tmp_path / "p.json")
    assert profiler.main([*QUICK, "--out", out, "--memory-budget-bytes", str(20 * num_parameters)]) == 2
    error = capsys.readouterr().err
    assert "tiny (0.000158B parameters) under --sharding zero2 keeps 0.00354 GiB per rank" in error
    assert "--sharding zero3 keeps 0.00236 GiB per rank" in error
    assert profiler.main([*QUICK, "--out", out, "--memory-budget-bytes", str(6 * num_parameters)]) == 2
    assert "even --sharding zero3 keeps 0.00236 GiB per rank: profile under torchrun over 3 ranks" \
        in capsys.readouterr().err


def test_a_gpu_run_refuses_a_profile_of_another_machine_naming_the_difference(
    monkeypatch: pytest.MonkeyPatch, measured: Path
) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(name="NVIDIA H100"))
    gpu = torch.device("cuda", 0)
    on_cpu = load_profile(measured)
    with pytest.raises(ValueError, match=r"measured on the CPU \(.*\), this run trains on NVIDIA H100"):
        check_profile_machine(on_cpu, gpu)
    check_profile_machine(on_cpu, torch.device("cpu"))  # a CPU run plans with any profile
    document = json.loads(measured.read_text())
    document["provenance"]["hardware"]["gpu"] = "NVIDIA H200"
    document["provenance"]["software"]["torch"] = "2.11.0+cu130"
    with pytest.raises(ValueError, match=r"measured on NVIDIA H200, this run trains on NVIDIA H100; it was "
                                         r"measured with torch 2\.11\.0\+cu130, this run has torch 2\.13"):
        check_profile_machine(parse_profile(document), gpu)
    document["provenance"]["hardware"]["gpu"] = "NVIDIA H100"
    document["provenance"]["software"]["torch"] = "2.13.1+cu128"  # another build of the same release
    check_profile_machine(parse_profile(document), gpu)
    for unmeasured in ("h100-paper", "h100-eager"):  # assumed, or rebased from a measurement: nothing to compare
        check_profile_machine(builtin_profiles()[unmeasured], gpu)


def test_a_7b_profile_fits_eight_80gb_gpus_and_one_gpu_is_refused_naming_what_would_fit() -> None:
    """FSDP2 over the profiling ranks, in bf16: a 7B model's states spread over 8 × 80 GB; on one they do not."""
    layout = ModelLayout(sharding=Sharding.ZERO2, activation_checkpointing=ActivationCheckpointing.NONE,
                         param_dtype=torch.bfloat16)
    budget = 80e9
    for model in ("qwen2.5-7b", "llama-3-8b"):
        profile_sweeps.check_states_fit(MODEL_CATALOGUE[model], layout, world_size=8, memory_budget_bytes=budget)
    with pytest.raises(ValueError, match=r"qwen2\.5-7b \(7\.62B parameters\) under --sharding zero2 keeps 156 GiB "
                                         r"per rank .* over 1 rank\(s\), more than the 74\.5 GiB of memory each has: "
                                         r"even --sharding zero3 keeps 113 GiB per rank: profile under torchrun over "
                                         r"2 ranks"):
        profile_sweeps.check_states_fit(MODEL_CATALOGUE["qwen2.5-7b"], layout, world_size=1,
                                        memory_budget_bytes=budget)


def test_reserved_memory_is_taken_with_the_cache_emptied_before_the_sweeps(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """After the sweeps, the allocator's cached blocks would count as memory no tensor can use (74 GB of an H200)."""
    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (calls.append("mem_get_info"), (60e9, 80e9))[1])
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 15e9)
    assert profile_sweeps._reserved_bytes(torch.device("cuda", 0)) == 5e9  # the context and NCCL's buffers
    assert calls == ["empty_cache", "mem_get_info"]

    order: list[str] = []
    reserved, compute = profile_sweeps._reserved_bytes, profile_sweeps._measure_compute
    monkeypatch.setattr(profile_sweeps, "_reserved_bytes", lambda device: order.append("reserved") or reserved(device))
    monkeypatch.setattr(profile_sweeps, "_measure_compute",
                        lambda *args: order.append("compute sweep") or compute(*args))
    assert profiler.main([*QUICK, "--out", str(tmp_path / "p.json")]) == 0
    assert order == ["reserved", "compute sweep"]


def test_a_cpu_peak_counts_the_gradients_autograd_made_before_it() -> None:
    """Gradients autograd made for the trainer's replicated model have no Python object until read; on CPU, where
    no allocator keeps a total, the peak counts them through the model, or ``--sharding none`` profiles would hold
    4 B per parameter too few."""
    parallel = init_parallel(ParallelDims(dp_size=1, cp_size=1), device_type="cpu")  # a world of this process
    try:
        layout = ModelLayout(sharding=Sharding.NONE, activation_checkpointing=ActivationCheckpointing.NONE,
                             param_dtype=torch.float32)
        module = build_training_module("tiny", parallel=parallel, layout=layout, seed=0)
        optimizer = torch.optim.AdamW(module.parameters())
        pack = local_pack((64,), vocab_size=MODEL_CATALOGUE["tiny"].vocab_size, device=torch.device("cpu"), seed=0)
        run_micro_batch(module, pack, num_loss_tokens=pack.num_loss_tokens)
        weights_and_gradients = 2 * 4 * MODEL_CATALOGUE["tiny"].num_parameters
        assert peak_bytes(lambda: None, device=torch.device("cpu"), model=module, optimizer=optimizer) \
            >= weights_and_gradients
    finally:
        dist.destroy_process_group()


def test_a_gpu_profile_keeps_the_launch_bound_form_where_it_fits_better_and_a_cpu_profile_adds() -> None:
    """On a GPU the host dispatches while the device computes: the sweep's small micro-batches sit at a floor. The
    profile keeps the form that fits (and says which); on a CPU, where one process does both, times add."""
    shape = MODEL_CATALOGUE["tiny"]
    points = []
    for num_tokens, num_sequences in [(64, 1), (128, 2), (256, 1), (512, 4), (1024, 1), (2048, 8), (4096, 2),
                                      (8192, 16), (16384, 4)]:
        lengths = [num_tokens // num_sequences] * num_sequences
        flops = float(eq13_flops(shape, lengths).sum())
        device_s = 2e-12 * flops + 1e-6 * num_tokens + 1e-4 * num_sequences + 1e-3 * shape.num_layers
        points.append({"case": f"case-{num_tokens}", "num_tokens": num_tokens, "num_sequences": num_sequences,
                       "flops": flops, "time_s": max(0.08, device_s), "spread": 0.0})
    gpu = compute_section(points, num_layers=shape.num_layers, on_gpu=True, timing="synthetic")
    extra = gpu.model_extra or {}
    assert extra["fit"]["form"] == "launch_bound" and gpu.floor_s_per_layer * shape.num_layers == pytest.approx(0.08)
    assert extra["fit"]["launch_bound"]["max_relative_error"] < extra["fit"]["extended"]["max_relative_error"]
    cpu = compute_section(points, num_layers=shape.num_layers, on_gpu=False, timing="synthetic")
    assert (cpu.model_extra or {})["fit"]["form"] == "extended" and cpu.floor_s_per_layer == 0.0


def test_refit_fits_a_profile_again_from_its_own_points_and_records_it(measured: Path, tmp_path: Path) -> None:
    out = tmp_path / "refit.json"
    assert profiler.main(["--refit", str(measured), "--name", "cpu-tiny-refit", "--out", str(out)]) == 0
    original, refit = json.loads(measured.read_text()), json.loads(out.read_text())
    assert refit["name"] == "cpu-tiny-refit" and refit["memory"] == original["memory"]
    assert refit["compute"]["points"] == original["compute"]["points"]
    assert refit["compute"]["alpha_s_per_flop"] == pytest.approx(original["compute"]["alpha_s_per_flop"])
    (record,) = refit["provenance"]["refits"]
    assert record["from"] == "cpu-tiny-test" and "--refit" in record["command"]
    assert refit["provenance"]["date"] == original["provenance"]["date"]  # the measurement's, kept
    load_profile(out)


def test_rebase_puts_a_measured_compute_onto_another_profiles_hardware_memory_and_communication(
    measured: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "rebased.json"
    assert profiler.main(["--rebase", str(measured), "--onto", "h100-paper", "--name", "h100-like",
                          "--out", str(out)]) == 0
    rebased, source, base = json.loads(out.read_text()), json.loads(measured.read_text()), \
        builtin_profiles()["h100-paper"].raw
    assert rebased["name"] == "h100-like" and rebased["model"] is None  # the base's: any model
    for section in ("hardware", "memory", "communication"):
        assert rebased[section] == base[section], section
    for name in ("alpha_s_per_flop", "alpha_s_per_token", "alpha_s_per_sequence", "beta_s_per_layer", "points"):
        assert rebased["compute"][name] == source["compute"][name], name
    # one process shards nothing: what it could not measure stays the base's
    assert rebased["compute"]["attention_efficiency"] == base["compute"]["attention_efficiency"]
    assert "provenance" not in rebased  # not measured as a whole: a GPU run's machine check has nothing to refuse
    derivation = rebased["derivation"]
    assert derivation["base"] == "h100-paper" and derivation["compute_from"]["name"] == "cpu-tiny-test"
    assert "--rebase" in derivation["command"]
    assert load_profile(out).compute.alpha_s_per_flop == source["compute"]["alpha_s_per_flop"]
    assert profiler.main(["--rebase", str(measured), "--out", str(out)]) == 2
    assert "--rebase needs --onto" in capsys.readouterr().err
