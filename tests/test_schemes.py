"""Collective schemes in the planning core: priced by the model, chosen per collective, checked, on the wire.

The trainer's side (each scheme's forward and gradients equal unsharded attention) is tests/test_attention_schemes.py.
"""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from skrull_proto import SCHEMES_SCHEMA_VERSION, SPANNING_SCHEMA_VERSION, MicroBatchModel, PlanRequest

from scheduler_service.contract.wire import request_to_problem, response_to_plan, result_to_response
from scheduler_service.core import gds
from scheduler_service.core.check import check_plan, find_violations
from scheduler_service.core.choices import CollectiveScheme
from scheduler_service.core.errors import BaselineCannotPlanError, InvalidRequestError, PlanCheckError
from scheduler_service.core.models import MODEL_CATALOGUE
from scheduler_service.core.perf_model import PerformanceModel
from scheduler_service.core.plan import DPRankPlan, MicroBatch, Plan, ShardedGroup, make_problem
from scheduler_service.core.planner import make_plan
from scheduler_service.core.profile import builtin_profiles, parse_profile
from scheduler_service.core.samplers import sample_lengths
from scheduler_service.core.schemes import choose_for_places, choose_schemes, schemes_note
from scheduler_service.core.simulate import (
    estimate_places,
    iteration_lower_bound_s,
    micro_batch_time_s,
    simulate,
)
from scheduler_service.core.static_sp import static_layout_problem, ulysses, usp

PROFILE = "h100-paper"


def _perf(model: str, profile: str = PROFILE) -> PerformanceModel:
    return PerformanceModel(model=MODEL_CATALOGUE[model], profile=builtin_profiles()[profile])


def _long_heavy(model: str, seed: int = 0, *, dp_size: int = 4, cp_size: int = 8, profile: str = PROFILE):  # type: ignore[no-untyped-def]
    lengths = sample_lengths("chatqa2", 96, np.random.default_rng(seed), max_length=cp_size * 8000).tolist()
    return make_problem(sequence_lengths=lengths, dp_size=dp_size, cp_size=cp_size, model=model, profile=profile,
                        bucket_size=8000)


def _profile_without_all_to_all(name: str = PROFILE):  # type: ignore[no-untyped-def]
    raw = builtin_profiles()[name].raw
    communication = dict(raw["communication"], tables={key: value for key, value in
                                                       raw["communication"]["tables"].items() if key != "all_to_all"})
    return parse_profile({**raw, "name": f"{name}-no-all-to-all", "communication": communication})


# ---- the model ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("model", "degree", "expected"), [
    ("qwen2.5-7b", 8, (2, 4)),  # 28 query heads: 8 does not divide them
    ("qwen2.5-0.5b", 8, (2,)),  # 14/2: 4 and 8 do not divide 14
    ("llama-3-8b", 8, (2, 4, 8)),  # 32/8
    ("llama-2-7b", 8, (2, 4, 8)),  # no GQA
    ("tiny", 4, (2, 4)),  # 4/2: u = 4 repeats each K/V head twice
])
def test_ulysses_degrees_are_the_divisors_the_heads_split_evenly_over(model: str, degree: int,
                                                                      expected: tuple[int, ...]) -> None:
    assert _perf(model).ulysses_degrees(degree) == expected


def test_all_gather_kv_is_priced_as_the_searches_price_it() -> None:
    perf = _perf("qwen2.5-7b")
    lengths = np.array([1000, 30000])
    for degree in (2, 4, 8):
        comm = perf.scheme_comm(degree, 1)
        assert comm is not None
        cost = perf.collective_cost(degree)
        assert comm.hidden_forward_s(31000) == pytest.approx(cost.all_gather_s(31000))
        assert comm.hidden_backward_s(31000) == pytest.approx(cost.reduce_scatter_s(31000))
        assert comm.exposed_s(31000) == 0.0
        np.testing.assert_array_equal(perf.placement_flops(lengths, degree, 1), perf.placement_flops(lengths, degree))


def test_ulysses_attends_whole_sequences_in_one_call_and_2d_in_two_chunks_of_its_sub_blocks() -> None:
    perf = _perf("llama-3-8b", "h100-eager")  # a measured attention efficiency: short chunks cost more
    lengths = np.array([4096.0])
    zigzag_8, ulysses_8, two_d = (float(perf.placement_flops(lengths, 8, u)[0]) for u in (1, 8, 2))
    whole_over_8 = float(perf.placement_flops(lengths, 1)[0]) / 8  # one rank's eighth at the whole length's efficiency
    assert ulysses_8 <= two_d <= zigzag_8
    assert ulysses_8 == pytest.approx(whole_over_8, rel=0.05)  # the shard's own cost aside


def test_ulysses_hides_its_inbound_all_to_all_and_exposes_the_outbound_one() -> None:
    perf = _perf("llama-2-7b")
    tokens = 64000
    ulysses_comm, two_d_comm = perf.scheme_comm(8, 8), perf.scheme_comm(8, 2)
    assert ulysses_comm is not None and two_d_comm is not None
    # Q, K and V in (H + 2G heads), the output back (H heads): no GQA, so in is three times out, per direction
    inbound = ulysses_comm.hidden_forward_s(tokens) - perf.model.num_layers * perf._all_to_all_fit(8).intercept  # type: ignore[union-attr]
    outbound = ulysses_comm.exposed_s(tokens) / 2 - perf.model.num_layers * perf._all_to_all_fit(8).intercept  # type: ignore[union-attr]
    assert inbound == pytest.approx(3 * outbound)
    # 2D gathers K/V over its 4 sub-blocks after the all-to-all: exposed too
    assert two_d_comm.exposed_s(tokens) > perf.scheme_comm(2, 2).exposed_s(tokens)  # type: ignore[union-attr]


def test_a_profile_without_all_to_all_prices_no_scheme_but_all_gather_kv() -> None:
    perf = PerformanceModel(model=MODEL_CATALOGUE["llama-2-7b"], profile=_profile_without_all_to_all())
    assert perf.ulysses_degrees(8) == ()
    assert perf.scheme_comm(8, 8) is None and perf.scheme_comm(8, 1) is not None


# ---- the choice -------------------------------------------------------------------------------------------------

@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), model=st.sampled_from(["llama-2-7b", "llama-3-8b", "qwen2.5-7b", "tiny"]),
       cp_size=st.sampled_from([2, 4, 8]))
def test_the_choice_never_makes_a_plan_slower_passes_the_checker_and_stays_above_the_bound(
        seed: int, model: str, cp_size: int) -> None:
    problem = _long_heavy(model, seed, dp_size=2, cp_size=cp_size)
    without = make_plan(problem, schemes=False)
    chosen = make_plan(problem)
    assert chosen.estimate.iteration_time_s <= without.estimate.iteration_time_s * (1 + 1e-12)
    check_plan(chosen.plan, sequence_lengths=problem.sequence_lengths, dp_size=problem.dp_size,
               cp_size=problem.cp_size, bucket_size=problem.bucket_size, heads=problem.perf.model.heads)
    assert chosen.lower_bound_s <= chosen.estimate.iteration_time_s * (1 + 1e-9)
    # the estimate from the choice's own changes is the simulator's of the plan
    assert simulate(problem, chosen.plan).iteration_time_s == pytest.approx(chosen.estimate.iteration_time_s,
                                                                            rel=1e-12)
    # the choice changes schemes, never where a sequence runs
    places, before = chosen.plan.places(problem.num_sequences), without.plan.places(problem.num_sequences)
    for field in ("micro_batch", "degree", "first_rank", "dp_rank"):
        np.testing.assert_array_equal(getattr(places, field), getattr(before, field))


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), model=st.sampled_from(["llama-2-7b", "qwen2.5-7b", "tiny"]),
       cp_size=st.sampled_from([4, 8]))
def test_choosing_for_the_places_before_the_plan_is_built_gives_the_plan_and_estimate_of_choosing_after(
        seed: int, model: str, cp_size: int) -> None:
    problem = _long_heavy(model, seed, dp_size=2, cp_size=cp_size)
    places = gds.skrull_places(problem)
    choice = choose_for_places(problem, places)
    built = Plan.from_places(places, dp_size=problem.dp_size, cp_size=problem.cp_size,
                             ulysses_degrees=choice.ulysses_degrees)
    chosen, _ = choose_schemes(problem, Plan.from_places(places, dp_size=problem.dp_size, cp_size=problem.cp_size))
    assert built == chosen
    assert estimate_places(problem, places, changes=choice.changes).iteration_time_s == pytest.approx(
        simulate(problem, chosen).iteration_time_s, rel=1e-12)


def test_the_choice_picks_ulysses_where_gathering_every_head_costs_most() -> None:
    problem = _long_heavy("llama-2-7b")
    chosen = make_plan(problem)
    schemes = {CollectiveScheme.of(c.degree, c.ulysses_degree) for dp_plan in chosen.plan.dp_ranks
               for mb in dp_plan.micro_batches for c in mb.collectives()}
    assert CollectiveScheme.ULYSSES in schemes
    assert chosen.estimate.iteration_time_s < make_plan(problem, schemes=False).estimate.iteration_time_s


def test_a_micro_batch_is_priced_by_its_schemes_in_every_breakdown() -> None:
    problem = make_problem(sequence_lengths=[60000, 500, 700], dp_size=1, cp_size=8, model="llama-2-7b",
                           profile=PROFILE, bucket_size=8000)
    gathered = MicroBatch(local=((1,), (2,), (), (), (), (), (), ()), distributed=(0,))
    ulysses_mb = dataclasses.replace(gathered, distributed_ulysses_degree=8)
    plan = Plan(dp_ranks=(DPRankPlan(micro_batches=(ulysses_mb,)),))
    estimate = simulate(problem, plan)
    assert estimate.iteration_time_s == pytest.approx(micro_batch_time_s(problem, ulysses_mb))
    assert micro_batch_time_s(problem, ulysses_mb) != micro_batch_time_s(problem, gathered)
    rank = estimate.dp_ranks[0].micro_batches[0].cp_ranks[3]  # no local work: nothing hides the outbound all-to-all
    assert rank.exposed_comm_s > 0 and rank.comm_s >= rank.exposed_comm_s
    parts = (rank.local_compute_s + rank.distributed_compute_s + rank.sharded_compute_s + rank.fixed_s
             + rank.padding_s + rank.exposed_comm_s + rank.launch_bound_s)
    assert parts == pytest.approx(rank.time_s)


def test_no_all_to_all_table_plans_as_before_and_says_why() -> None:
    lengths = sample_lengths("chatqa2", 64, np.random.default_rng(3), max_length=8 * 8000).tolist()
    problem = make_problem(sequence_lengths=lengths, dp_size=2, cp_size=8, model="llama-2-7b",
                           profile=_profile_without_all_to_all(), bucket_size=8000)
    result = make_plan(problem)
    assert result.plan == make_plan(problem, schemes=False).plan
    note = schemes_note(problem)
    assert note is not None and "no all_to_all table" in note
    assert result_to_response(result).notes == [note]


def test_heads_that_split_over_no_degree_are_named_in_the_note() -> None:
    problem = make_problem(sequence_lengths=[9000, 100], dp_size=1, cp_size=4, model="qwen2.5-0.5b",
                           profile=PROFILE, bucket_size=8000)
    note = schemes_note(problem)
    assert note is None  # 2 divides 14 and 2: a block of 2 may be Ulysses
    problem = make_problem(sequence_lengths=[9000, 100], dp_size=1, cp_size=3, model="qwen2.5-0.5b",
                           profile=PROFILE, bucket_size=8000)
    note = schemes_note(problem)
    assert note is not None and "14 query and 2 K/V heads" in note


def test_a_client_of_an_older_contract_gets_no_scheme() -> None:
    lengths = sample_lengths("chatqa2", 64, np.random.default_rng(1), max_length=8 * 8000).tolist()
    request = PlanRequest(sequence_lengths=lengths, dp_size=2, cp_size=8, model="llama-2-7b", profile=PROFILE,
                          bucket_size=8000, schema_version=SPANNING_SCHEMA_VERSION)
    old = result_to_response(make_plan(request_to_problem(request)))
    assert old.schema_version in (1, 2)
    new = result_to_response(make_plan(request_to_problem(request.model_copy(
        update={"schema_version": SCHEMES_SCHEMA_VERSION}))))
    assert new.schema_version == SCHEMES_SCHEMA_VERSION
    assert new.estimated_iteration_time_ms < old.estimated_iteration_time_ms


# ---- the wire and the checker -----------------------------------------------------------------------------------

def test_every_scheme_round_trips_the_wire_and_all_gather_kv_is_left_out() -> None:
    problem = _long_heavy("llama-3-8b")
    result = make_plan(problem)
    response = result_to_response(result)
    assert response_to_plan(response) == result.plan
    data = response.model_dump(mode="json")
    micro_batches = [mb for dp_rank in data["dp_ranks"] for mb in dp_rank["micro_batches"]]
    groups = [group for mb in micro_batches for group in mb.get("sharded", [])]
    assert all(group.get("scheme") != "all_gather_kv" for group in groups)  # the default is omitted
    assert any(group.get("scheme") == "2d" and group["ulysses_degree"] > 1 for group in groups) or any(
        mb.get("distributed_scheme") == "ulysses" for mb in micro_batches)


@pytest.mark.parametrize(("fields", "message"), [
    ({"distributed_scheme": "2d"}, "distributed_scheme 2d needs distributed_ulysses_degree"),
    ({"distributed_scheme": "2d", "distributed_ulysses_degree": 4}, "strictly between 1 and 4"),
    ({"distributed_scheme": "ulysses", "distributed_ulysses_degree": 2}, "is for scheme 2d only"),
])
def test_the_contract_refuses_a_2d_degree_it_cannot_run(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MicroBatchModel.model_validate({"local": [[], [], [], []], "distributed": [0], "estimated_time_ms": 1.0,
                                        **fields})


def test_the_checker_refuses_a_degree_the_heads_do_not_split_naming_heads_and_degree() -> None:
    plan = Plan(dp_ranks=(DPRankPlan(micro_batches=(MicroBatch(
        local=((), (), (), ()), distributed=(0,), distributed_ulysses_degree=4,
        sharded=(ShardedGroup(cp_ranks=(0, 1), sequences=(1,), ulysses_degree=2),)),)),))
    kwargs = {"sequence_lengths": [4000, 1000], "dp_size": 1, "cp_size": 4, "bucket_size": 4000}
    assert find_violations(plan, **kwargs) == []  # without heads: structurally sound
    violations = find_violations(plan, **kwargs, heads=MODEL_CATALOGUE["qwen2.5-0.5b"].heads)
    assert violations == ["dp_ranks[0].micro_batches[0] collective over ranks [0, 1, 2, 3] asks for Ulysses degree 4: "
                          "the model's 14 query and 2 K/V heads do not split evenly over 4 ranks (degrees that would: "
                          "1, 2)"]
    with pytest.raises(PlanCheckError):
        check_plan(plan, **kwargs, heads=(14, 2))
    bad_degree = Plan(dp_ranks=(DPRankPlan(micro_batches=(MicroBatch(
        local=((), (), (), ()), distributed=(0, 1), distributed_ulysses_degree=3),)),))
    assert "it must divide the block's size" in find_violations(bad_degree, **kwargs)[0]


# ---- the seed systems' static SP -------------------------------------------------------------------------------

def test_static_ulysses_and_usp_shard_every_sequence_over_the_group_with_one_scheme() -> None:
    problem = _long_heavy("llama-3-8b")
    for scheduler, ulysses_degree in ((ulysses, 8), (usp, 4)):
        plan = scheduler(problem)
        collectives = [c for dp_plan in plan.dp_ranks for mb in dp_plan.micro_batches for c in mb.collectives()]
        assert {(c.degree, c.ulysses_degree) for c in collectives} == {(8, ulysses_degree)}
        assert not any(index for dp_plan in plan.dp_ranks for mb in dp_plan.micro_batches for rank in mb.local
                       for index in rank)
        check_plan(plan, sequence_lengths=problem.sequence_lengths, dp_size=4, cp_size=8,
                   bucket_size=problem.bucket_size, heads=problem.perf.model.heads)


def test_static_sp_refuses_a_client_of_an_older_contract() -> None:
    """A v2 client cannot run a Ulysses collective: the static schedulers say so rather than answer one."""
    lengths = sample_lengths("chatqa2", 32, np.random.default_rng(2), max_length=8 * 8000).tolist()
    request = PlanRequest(sequence_lengths=lengths, dp_size=1, cp_size=8, model="llama-2-7b", profile=PROFILE,
                          bucket_size=8000, schema_version=SPANNING_SCHEMA_VERSION, scheduler="ulysses")
    with pytest.raises(BaselineCannotPlanError, match="ask with schema_version 3"):
        make_plan(request_to_problem(request), "ulysses")


def test_a_plan_with_an_empty_micro_batch_is_still_priced_by_its_own_schemes() -> None:
    """An unchecked plan's places number an empty micro-batch too: its schemes stay on their own rows."""
    problem = make_problem(sequence_lengths=[60000, 500], dp_size=1, cp_size=8, model="llama-2-7b", profile=PROFILE,
                           bucket_size=8000)
    empty = MicroBatch(local=((),) * 8, distributed=())
    ulysses_mb = MicroBatch(local=((1,),) + ((),) * 7, distributed=(0,), distributed_ulysses_degree=8)
    plan = Plan(dp_ranks=(DPRankPlan(micro_batches=(empty, ulysses_mb)),))
    (_, priced) = simulate(problem, plan).dp_ranks[0].micro_batches
    assert priced.time_s == pytest.approx(micro_batch_time_s(problem, ulysses_mb))


def test_a_profile_with_a_one_size_all_to_all_table_is_refused() -> None:
    raw = copy.deepcopy(builtin_profiles()[PROFILE].raw)
    raw["communication"]["tables"]["all_to_all"] = raw["communication"]["tables"]["all_to_all"][:1]
    with pytest.raises(InvalidRequestError, match="all_to_all needs"):
        parse_profile(raw)


def test_a_trainer_with_schemes_off_refuses_a_static_ulysses_or_2d_scheduler_at_start() -> None:
    """Every collective of theirs is Ulysses or 2D, which a trainer keeping all-gather-KV never runs: refused before
    any batch, where the heads alone would allow them."""
    for scheduler, scheme in (("ulysses", "Ulysses"), ("usp", "2D")):
        assert static_layout_problem(scheduler, (32, 8), 8) is None
        assert static_layout_problem(scheduler, (32, 8), 8, schemes=False) == (
            f"scheduler {scheduler} runs every collective as {scheme}, and schemes are off (every collective "
            "all-gather-KV): keep them on, or choose another scheduler")
    assert static_layout_problem("skrull", (32, 8), 8, schemes=False) is None


def test_static_ulysses_refuses_heads_it_cannot_split_naming_them_and_the_degrees_that_would() -> None:
    problem = _long_heavy("qwen2.5-7b")
    with pytest.raises(BaselineCannotPlanError, match=r"28 query and 4 K/V heads do not split evenly over Ulysses "
                                                       r"degree 8 \(cp_size 8\); Ulysses degrees that would: 2, 4, 28"):
        ulysses(problem)
    assert {c.ulysses_degree for dp_plan in usp(problem).dp_ranks for mb in dp_plan.micro_batches
            for c in mb.collectives()} == {4}


def test_the_bound_prices_every_scheme_a_block_may_use() -> None:
    problem = _long_heavy("llama-2-7b")
    assert iteration_lower_bound_s(problem) <= make_plan(problem).estimate.iteration_time_s
    assert (problem.cheapest_rank_flops() <= problem.rank_flops).all()
    assert (problem.cheapest_rank_flops() < problem.rank_flops).any()


def test_choose_schemes_leaves_a_plan_without_collectives_as_it_is() -> None:
    problem = make_problem(sequence_lengths=[100, 200, 300], dp_size=1, cp_size=2, model="tiny", profile=PROFILE,
                           bucket_size=1000)
    plan = make_plan(problem, schemes=False).plan
    chosen, changes = choose_schemes(problem, plan)
    assert chosen is plan and len(changes.micro_batch) == 0
