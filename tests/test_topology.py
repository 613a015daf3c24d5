"""Topology: a CP block larger than a node pays the profile's inter-node collectives, one within a node the
intra-node ones; without ``gpus_per_node`` every plan is what it was; a profile without inter-node tables refuses
blocks that span nodes; the profiler files the collectives of groups that span nodes as inter-node tables."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from skrull_proto import ProfileDocument

from scheduler_service.core.baselines import deepspeed
from scheduler_service.core.errors import InvalidRequestError
from scheduler_service.core.models import MODEL_CATALOGUE
from scheduler_service.core.perf_model import PerformanceModel, fit_line
from scheduler_service.core.plan import make_problem
from scheduler_service.core.planner import make_plan
from scheduler_service.core.profile import builtin_profiles, parse_profile
from scheduler_service.core.simulate import simulate
from trainer_client.distributed import spawn_gloo
from trainer_client.profiler import command as profiler
from trainer_client.profiler.document import split_by_node
from trainer_client.profiler.sweeps import ProfileOptions

H100 = builtin_profiles()["h100-paper"]
QWEN_7B = MODEL_CATALOGUE["qwen2.5-7b"]


def _costs(perf: PerformanceModel, group_size: int) -> tuple[float, float, float, float]:
    cost = perf.collective_cost(group_size)
    return (cost.all_gather_s_per_token, cost.all_gather_fixed_s, cost.reduce_scatter_s_per_token,
            cost.reduce_scatter_fixed_s)


def test_blocks_larger_than_a_node_read_the_inter_node_tables() -> None:
    one_node = PerformanceModel(model=QWEN_7B, profile=H100)
    nodes_of_8 = PerformanceModel(model=QWEN_7B, profile=H100, gpus_per_node=8)
    for group_size in (2, 4, 8):  # within a node: the intra-node tables, exactly as without nodes
        assert not nodes_of_8.crosses_nodes(group_size)
        assert _costs(nodes_of_8, group_size) == _costs(one_node, group_size)
    for group_size in (16, 32):  # across nodes: every coefficient costs more than within one
        assert nodes_of_8.crosses_nodes(group_size)
        assert all(inter > intra for inter, intra in zip(_costs(nodes_of_8, group_size),
                                                         _costs(one_node, group_size), strict=True))


def test_a_plan_whose_cp_group_spans_nodes_costs_more_communication() -> None:
    lengths = [60000, 45000, 30000, 20000, 9000, 3000, 800]
    problems = {gpus_per_node: make_problem(sequence_lengths=lengths, dp_size=1, cp_size=16, model=QWEN_7B,
                                            bucket_size=8192, gpus_per_node=gpus_per_node) for gpus_per_node in (8, 16)}
    plan = deepspeed(problems[8])  # every sequence over the whole CP group: every collective crosses nodes with 8

    def comm_s(gpus_per_node: int) -> float:
        estimate = simulate(problems[gpus_per_node], plan)
        return sum(rank.comm_s for dp_rank in estimate.dp_ranks for micro_batch in dp_rank.micro_batches
                   for rank in micro_batch.cp_ranks)

    assert comm_s(8) > comm_s(16) > 0
    assert simulate(problems[8], plan).iteration_time_s > simulate(problems[16], plan).iteration_time_s


def test_a_spanning_block_larger_than_a_node_is_priced_with_the_inter_node_tables() -> None:
    lengths = [100000, 3000, 800]  # 100000 > one CP group's 8 x 8192: it spans both replicas, 16 GPUs
    problems = {gpus_per_node: make_problem(sequence_lengths=lengths, dp_size=2, cp_size=8, model=QWEN_7B,
                                            bucket_size=8192, gpus_per_node=gpus_per_node) for gpus_per_node in (8, 16)}
    plan = make_plan(problems[16]).plan
    assert plan.spanning

    def comm_s(gpus_per_node: int) -> float:
        return sum(rank.comm_s for micro_batch in simulate(problems[gpus_per_node], plan).spanning
                   for rank in micro_batch.cp_ranks)

    assert comm_s(8) > comm_s(16) > 0


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cp_size=st.sampled_from([1, 2, 4, 8]), dp_size=st.integers(1, 3), data=st.data())
def test_without_blocks_across_nodes_every_plan_is_what_it_was(cp_size: int, dp_size: int,
                                                               data: st.DataObject) -> None:
    bucket_size = data.draw(st.integers(256, 4096))
    lengths = data.draw(st.lists(st.integers(1, bucket_size * cp_size), min_size=1, max_size=30))
    gpus_per_node = data.draw(st.sampled_from([cp_size, 2 * cp_size, 64]))
    # spanning=False: a block over several DP replicas crosses nodes whenever a CP group fills one
    plans = [make_plan(make_problem(sequence_lengths=lengths, dp_size=dp_size, cp_size=cp_size, model="qwen2.5-0.5b",
                                    bucket_size=bucket_size, gpus_per_node=nodes, spanning=False), "skrull")
             for nodes in (None, gpus_per_node)]
    assert plans[0].plan == plans[1].plan
    assert plans[0].estimate.iteration_time_s == plans[1].estimate.iteration_time_s
    assert plans[0].baseline_time_s == plans[1].baseline_time_s


def test_a_profile_without_inter_node_tables_refuses_blocks_that_span_nodes() -> None:
    cpu_tiny = builtin_profiles()["cpu-tiny"]
    assert cpu_tiny.communication.inter_node is None  # profiles written before the field stay valid
    make_problem(sequence_lengths=[300, 40], dp_size=1, cp_size=4, model="tiny", profile=cpu_tiny, bucket_size=128,
                 gpus_per_node=4)  # one node: fine
    with pytest.raises(InvalidRequestError, match=r"cpu-tiny has no inter-node .*communication\.inter_node") as error:
        make_problem(sequence_lengths=[300, 40], dp_size=1, cp_size=4, model="tiny", profile=cpu_tiny,
                     bucket_size=128, gpus_per_node=2)
    assert error.value.field == "profile"


@pytest.mark.parametrize(("cp_size", "gpus_per_node", "field"), [(12, 8, "cp_size"), (6, 4, "cp_size"),
                                                                  (8, 6, "gpus_per_node"), (8, 0, "gpus_per_node")])
def test_nodes_must_split_the_cp_group_into_aligned_blocks(cp_size: int, gpus_per_node: int, field: str) -> None:
    with pytest.raises(InvalidRequestError) as error:
        make_problem(sequence_lengths=[100], dp_size=1, cp_size=cp_size, model="tiny", bucket_size=64,
                     gpus_per_node=gpus_per_node)
    assert error.value.field == field


def test_shipped_h100_profile_carries_inter_node_tables_with_their_sources() -> None:
    inter_node = H100.communication.inter_node
    assert inter_node is not None and (inter_node.world_size, inter_node.num_nodes) == (32, 4)
    for collective in ("all_gather", "reduce_scatter"):
        within, across = H100.communication.tables[collective], inter_node.tables[collective]
        assert [size for size, _ in within] == [size for size, _ in across]
        assert all(inter > intra for (_, intra), (_, inter) in zip(within, across, strict=True))
    source = H100.raw["communication"]["inter_node"]["source"]
    assert "vpbenchmarking" in source and "together-nccl-tests" in source
    ProfileDocument.model_validate(H100.raw)


def test_an_inter_node_table_is_checked_like_the_intra_node_ones() -> None:
    document = json.loads(json.dumps(H100.raw))
    document["communication"]["inter_node"]["tables"]["all_gather"] = [[1024, 1e-5]]
    with pytest.raises(InvalidRequestError, match=r"communication\.inter_node\.tables\.all_gather"):
        parse_profile(document)


def test_the_profiler_files_groups_that_span_nodes_as_inter_node_tables() -> None:
    world = {"all_gather": [[1024.0, 2e-4], [8192.0, 4e-4]], "reduce_scatter": [[1024.0, 3e-4], [8192.0, 5e-4]]}
    blocks = {str(size): {"all_gather": [[1024.0, size * 1e-5], [8192.0, size * 2e-5]],
                          "reduce_scatter": [[1024.0, size * 1e-5], [8192.0, size * 3e-5]]} for size in (2, 4, 8)}
    within, across = split_by_node(world, blocks, world_size=16, local_world_size=4)
    assert (within.tables, within.world_size, set(within.tables_by_group_size)) == (blocks["4"], 4, {"2"})
    assert (across.tables, across.world_size, set(across.tables_by_group_size)) == (world, 16, {"8"})
    one_node, none = split_by_node(world, blocks, world_size=16, local_world_size=16)
    assert (one_node.tables, one_node.world_size, one_node.tables_by_group_size) == (world, 16, blocks)
    assert (none.tables, none.tables_by_group_size) == ({}, {})


def _profile_two_nodes(out_path: Path) -> None:
    options = ProfileOptions(model="tiny", sizes=(32, 64), short_length=16, memory_sizes=(32, 64),
                             comm_sizes=(1024, 8192), shard_sizes=(64,), repeats=1, warmup=0, progress=False)
    document = profiler.measure_profile(options)
    if dist.get_rank() == 0:
        assert document is not None
        out_path.write_text(json.dumps(document))


@pytest.mark.slow
def test_four_ranks_on_two_nodes_measure_inter_node_tables(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # what torchrun --nnodes 2 --nproc-per-node 2 sets
    out_path = tmp_path / "two-nodes.json"
    spawn_gloo(_profile_two_nodes, 4, out_path)
    document: dict[str, Any] = json.loads(out_path.read_text())
    communication = document["communication"]
    assert communication["world_size"] == 2 and set(communication["tables"]) == {"all_gather", "reduce_scatter"}
    inter_node = communication["inter_node"]
    assert (inter_node["world_size"], inter_node["num_nodes"]) == (4, 2)
    assert set(inter_node["tables"]) == {"all_gather", "reduce_scatter", "all_to_all"}
    assert document["provenance"]["local_world_size"] == 2
    profile = parse_profile(document)
    perf = PerformanceModel(model=MODEL_CATALOGUE["tiny"], profile=profile, gpus_per_node=2)
    assert profile.communication.inter_node is not None
    inter_fit = fit_line(profile.communication.inter_node.tables["all_gather"], relative=True)
    cost = perf.collective_cost(4)  # priced from the inter-node table, measured over these 4 ranks
    assert cost.all_gather_fixed_s == pytest.approx(MODEL_CATALOGUE["tiny"].num_layers * inter_fit.intercept)
    assert cost.all_gather_s_per_token == pytest.approx(
        MODEL_CATALOGUE["tiny"].num_layers * inter_fit.slope * perf.comm_bytes_per_layer(1.0))
    within = dataclasses.replace(profile, communication=dataclasses.replace(profile.communication, inter_node=None))
    with pytest.raises(InvalidRequestError):
        PerformanceModel(model=MODEL_CATALOGUE["tiny"], profile=within, gpus_per_node=2).collective_cost(4)
