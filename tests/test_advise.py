"""The layout advisor: every dp × cp layout is ranked or excluded with its reason; a layout whose plans span DP
replicas trains sequences up to the world's capacity, and the reason the winner gives says when spanning is part of
its win; long samples exclude the layouts that hold less of them, naming the sequences and the CP degree that holds
more; outliers no layout holds are left out (or cut) rather than stopping the advice, with what each layout loses;
the ranking is by throughput, layouts across nodes are priced with the inter-node tables, each layout's trainer
command (``contract.advice``) is one the trainer accepts, the document is the one the service's model describes,
and every bad input names its field."""

from __future__ import annotations

import dataclasses
import importlib
import itertools
import json
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from skrull_proto.advise import AdviceDocument

from scheduler_service.contract.advice import TrainerSources, advice_document, shell_command, trainer_argv, why
from scheduler_service.core.advise import (
    Advice,
    AdviseLimits,
    Exclusion,
    GlobalBatchSize,
    Layout,
    LayoutProblem,
    advise,
    advise_cost,
    draw_batches,
)
from scheduler_service.core.errors import InvalidRequestError
from scheduler_service.core.memory import ActivationCheckpointing, Sharding
from scheduler_service.core.models import MODEL_CATALOGUE, ModelShape
from scheduler_service.core.plan import PlanLimits
from scheduler_service.core.profile import builtin_profiles
from scheduler_service.core.samplers import sample_lengths
from scheduler_service.core.spanning import MAX_CHOSEN
from trainer_client.flags import config_from_args
from trainer_client.train import build_parser

# The module, not the function ``scheduler_service.core.advise`` the package exports under its name.
advise_module = importlib.import_module("scheduler_service.core.advise")
H100 = builtin_profiles()["h100-paper"]
QWEN_7B = MODEL_CATALOGUE["qwen2.5-7b"]
CHATQA2 = sample_lengths("chatqa2", 2048, np.random.default_rng(7))
SOURCES = TrainerSources(data="synthetic:chatqa2")


def _problem(**overrides: Any) -> LayoutProblem:
    fields: dict[str, Any] = {"sequence_lengths": CHATQA2, "model": QWEN_7B, "profile": H100, "num_gpus": 32,
                              "global_batch": GlobalBatchSize(num_sequences=32), "num_batches": 3}
    return LayoutProblem(**(fields | overrides))


@pytest.fixture(scope="module")
def chatqa2_advice() -> Advice:
    return advise(_problem())


def _key(layout: Layout) -> tuple[int, int, Sharding, ActivationCheckpointing]:
    return layout.dp_size, layout.cp_size, layout.sharding, layout.activation_checkpointing


def test_every_layout_is_ranked_or_excluded(chatqa2_advice: Advice) -> None:
    ranked = [_key(item.layout) for item in chatqa2_advice.layouts]
    excluded = [_key(item.layout) for item in chatqa2_advice.excluded]
    expected = {(32 // cp_size, cp_size, sharding, ActivationCheckpointing.NONE)
                for cp_size, sharding in itertools.product((1, 2, 4, 8, 16, 32), Sharding)}
    assert len(ranked) + len(excluded) == len(expected) and set(ranked) | set(excluded) == expected
    assert all(dp_size * cp_size == 32 for dp_size, cp_size, _, _ in ranked + excluded)


def test_layouts_are_ranked_by_throughput_and_the_winner_is_explained(chatqa2_advice: Advice) -> None:
    throughputs = [item.tokens_per_s_per_gpu for item in chatqa2_advice.layouts]
    assert throughputs == sorted(throughputs, reverse=True) and len(throughputs) >= 2
    best, runner_up = chatqa2_advice.layouts[:2]
    assert why(chatqa2_advice).startswith(f"{best.layout.label} trains fastest")
    assert runner_up.layout.label in why(chatqa2_advice)
    assert 0 <= chatqa2_advice.winner_batches_won <= 3


def test_skrull_is_never_slower_than_static_cp_on_the_same_layout(chatqa2_advice: Advice) -> None:
    for item in chatqa2_advice.layouts:
        assert all(skrull <= static * (1 + 1e-9) for skrull, static
                   in zip(item.step_times_s, item.static_cp_step_times_s, strict=True))
        assert item.speedup_vs_static_cp >= 1.0


def test_each_layout_reports_memory_sharding_spread_and_span(chatqa2_advice: Advice) -> None:
    for item in chatqa2_advice.layouts:
        layout = item.layout
        assert layout.longest_trainable_sequence >= int(CHATQA2.max())
        assert (item.num_sequences_too_long, item.too_long_token_share) == (0, 0.0)
        assert layout.spans_nodes == (layout.cp_size > 8)
        assert 0 <= item.memory_headroom_fraction < 1 and item.memory_headroom_bytes >= 0  # plans honour the bucket
        assert 0 <= item.sharded_share <= 1
        assert sum(share for _, share in item.sharded_by_degree) == pytest.approx(item.sharded_share)
        # a sequence of a micro-batch spanning DP replicas may be sharded over ranks of several of them
        widest = layout.cp_size * (layout.dp_size if layout.spanning else 1)
        assert all(1 < degree <= widest for degree, _ in item.sharded_by_degree)
        assert item.num_sequences_needing_span <= item.num_sequences_spanned
        assert (item.num_batches_spanning == 0) == (item.num_sequences_spanned == 0) and item.num_batches_spanning <= 3
        assert layout.spanning or item.num_sequences_spanned == 0
        spread = item.step_time_spread
        assert spread.min_s <= spread.p10_s <= item.predicted_step_time_s <= spread.p90_s <= spread.max_s
        assert spread.relative_spread >= 0


def test_the_why_mentions_spanning_exactly_when_the_winner_spans_dp_replicas(chatqa2_advice: Advice) -> None:
    best = chatqa2_advice.layouts[0]
    needs_it = int(CHATQA2.max()) > best.layout.cp_group_capacity
    assert ("Spanning DP replicas is part of why it wins" in why(chatqa2_advice)) == bool(
        best.num_batches_spanning or needs_it)


def test_the_static_memory_of_unsharded_states_excludes_a_7b_model(chatqa2_advice: Advice) -> None:
    unsharded = [item for item in chatqa2_advice.excluded if item.layout.sharding is Sharding.NONE]
    assert len(unsharded) == 6
    assert all(item.exclusion is Exclusion.NO_MEMORY and "does not fit with sharding none" in item.reason
               for item in unsharded)


def test_a_layout_whose_plans_span_dp_replicas_trains_up_to_the_worlds_capacity() -> None:
    """bucket_size × cp_size × dp_size: one micro-batch over every DP replica; with one replica, one CP group's."""
    advice = advise(_problem(sequence_lengths=[900] * 40, num_gpus=16, shardings=(Sharding.ZERO3,)))
    assert len(advice.layouts) == 5
    for item in advice.layouts:
        layout = item.layout
        assert layout.spanning == (layout.dp_size > 1)
        assert layout.cp_group_capacity == layout.bucket_size * layout.cp_size
        assert layout.longest_trainable_sequence == layout.bucket_size * layout.cp_size * layout.dp_size


def test_a_profile_that_cannot_price_the_world_keeps_sequences_within_one_cp_group() -> None:
    """Without inter-node tables no block may cover the 4 GPUs of 2 nodes, so no plan spans DP replicas."""
    advice = advise(_problem(sequence_lengths=[300, 120, 40, 900], model=MODEL_CATALOGUE["tiny"],
                             profile=builtin_profiles()["cpu-tiny"], num_gpus=4, gpus_per_node=2,
                             shardings=(Sharding.ZERO2,), global_batch=GlobalBatchSize(num_sequences=8),
                             compute_bytes=4))
    for item in advice.layouts:
        assert not item.layout.spanning and item.num_sequences_spanned == 0
        assert item.layout.longest_trainable_sequence == item.layout.bucket_size * item.layout.cp_size


def test_sequences_longer_than_a_cp_group_are_held_by_spanning_and_the_why_says_so() -> None:
    """dp 16 × cp 1 holds about 16k tokens per CP group; a 60k-token sequence trains in a micro-batch over
    several DP replicas, and the reason the advice gives says so."""
    lengths = [60000, 58000, *([900] * 20)]
    advice = advise(_problem(sequence_lengths=lengths, num_gpus=16, cp_sizes=(1,), shardings=(Sharding.ZERO3,)))
    (best,) = advice.layouts
    assert best.layout.cp_group_capacity < 58000 < 60000 <= best.layout.longest_trainable_sequence
    batches = draw_batches(advice.problem)
    assert best.num_sequences_needing_span == sum(int((batch >= 58000).sum()) for batch in batches) > 0
    assert best.num_sequences_spanned >= best.num_sequences_needing_span
    assert best.num_batches_spanning == sum(bool((batch >= 58000).any()) for batch in batches)
    reason = why(advice)
    assert f"on {best.num_batches_spanning} of 3 sampled batches its plans run {best.num_sequences_spanned} " \
           "sequence(s) in micro-batches over several replicas" in reason
    assert "too long for one CP group" in reason
    assert (f"only such micro-batches hold the sample's sequences longer than one CP group's "
            f"{best.layout.cp_group_capacity:,} tokens") in reason
    # the trainer's default --max-length is one CP group's: the command lets the longer ones through
    command = trainer_argv(advice, best.layout, SOURCES)
    config = config_from_args(build_parser().parse_args(list(command[command.index("trainer_client.train") + 1:])))
    assert (config.max_length, config.truncate) == (best.layout.longest_trainable_sequence, False)


def test_long_sequences_exclude_the_layouts_that_hold_less_naming_them_and_the_cp_that_holds_them() -> None:
    """On 16 GPUs with zero3 the world's capacity falls from about 256k tokens at cp 1 to 213k at cp 16 (each CP
    degree gathers more K/V): a 240k-token sequence fits the small CP degrees only."""
    lengths = [240_000, *([900] * 40)]
    advice = advise(_problem(sequence_lengths=lengths, num_gpus=16, shardings=(Sharding.ZERO3,)))
    too_long = {item.layout.cp_size: item for item in advice.excluded if item.exclusion is Exclusion.TOO_LONG}
    kept = {item.layout.cp_size: item for item in advice.layouts}
    assert set(too_long) == {8, 16} and set(kept) == {1, 2, 4}
    assert all(item.num_sequences_too_long == 0 for item in kept.values())
    for cp_size, item in too_long.items():
        layout = item.layout
        capacity = layout.longest_trainable_sequence
        assert capacity < 240_000 and (item.num_sequences_too_long, item.cp_size_needed) == (1, 1)
        assert item.too_long_token_share == pytest.approx(240_000 / sum(lengths))
        assert "1 sequence(s) of the sample (the longest 240000 tokens) exceed bucket_size" in item.reason
        assert f"× cp_size {cp_size}{f' × dp_size {layout.dp_size}' if layout.spanning else ''} = {capacity} " \
               "tokens" in item.reason
        assert "cp_size 1 would hold them" in item.reason


OUTLIERS = [300_000, 240_000, *([900] * 40)]  # on 16 GPUs with zero3 no layout holds 300k; cp 1, 2 and 4 hold 240k


def test_outliers_no_layout_holds_are_left_out_and_the_layouts_ranked_with_what_each_loses() -> None:
    advice = advise(_problem(sequence_lengths=OUTLIERS, num_gpus=16, shardings=(Sharding.ZERO3,)))
    total = sum(OUTLIERS)
    assert {item.layout.cp_size for item in advice.layouts} == {1, 2, 4}
    for item in advice.layouts:
        assert item.layout.longest_trainable_sequence < 300_000
        assert (item.num_sequences_too_long, item.too_long_token_share) == (1, pytest.approx(300_000 / total))
        limit = advice.problem.sequence_limit(item.layout)
        assert all(int(batch.max()) <= limit for batch in draw_batches(advice.problem, limit))
    excluded = {item.layout.cp_size: item for item in advice.excluded}
    assert set(excluded) == {8, 16}
    for item in excluded.values():
        assert (item.exclusion, item.num_sequences_too_long, item.cp_size_needed) == (Exclusion.TOO_LONG, 2, 1)
        assert item.too_long_token_share == pytest.approx(540_000 / total)
        assert "left out" in item.reason and "cp_size 1 would hold all but the 1 that no layout holds" in item.reason
    winner_limit = advice.problem.sequence_limit(advice.layouts[0].layout)
    assert (f"It leaves out the sample's 1 sequence(s) longer than {winner_limit:,} tokens (its longest trainable "
            f"sequence: no layout of 16 GPUs holds more of the sample): {300_000 / total:.2%}") in why(advice)


def test_truncate_cuts_what_a_layout_cannot_hold_to_its_limit() -> None:
    advice = advise(_problem(sequence_lengths=OUTLIERS, num_gpus=16, shardings=(Sharding.ZERO3,), truncate=True))
    total = sum(OUTLIERS)
    assert {item.layout.cp_size for item in advice.layouts} == {1, 2, 4}
    for item in advice.layouts:
        limit = item.layout.longest_trainable_sequence
        assert advice.problem.sequence_limit(item.layout) == limit
        assert (item.num_sequences_too_long, item.too_long_token_share) == (1, pytest.approx((300_000 - limit) / total))
        held = advice.problem.held(limit)
        assert held.size == len(OUTLIERS) and int(held.max()) == limit  # cut, not left out
    for item in advice.excluded:
        limit = item.layout.longest_trainable_sequence
        assert item.num_sequences_too_long == 2 and "cut to fit" in item.reason
        assert item.too_long_token_share == pytest.approx((540_000 - 2 * limit) / total)
    assert " to that length: " in why(advice) and "It cuts the sample's 1 sequence(s)" in why(advice)


@pytest.mark.parametrize("truncate", [False, True])
def test_max_length_limits_every_layout_as_the_trainers_does(truncate: bool) -> None:
    """Sequences over max_length are left out (or cut) by every layout alike, so all five are ranked, each losing
    the same; each layout's command passes the limit (and --truncate) on to the trainer."""
    advice = advise(_problem(sequence_lengths=OUTLIERS, num_gpus=16, shardings=(Sharding.ZERO3,), max_length=1000,
                             truncate=truncate))
    total = sum(OUTLIERS)
    lost = 538_000 if truncate else 540_000
    assert len(advice.layouts) == 5 and not advice.excluded
    for item in advice.layouts:
        assert advice.problem.sequence_limit(item.layout) == 1000
        assert (item.num_sequences_too_long, item.too_long_token_share) == (2, pytest.approx(lost / total))
        command = trainer_argv(advice, item.layout, SOURCES)
        config = config_from_args(build_parser().parse_args(list(command[command.index("trainer_client.train") + 1:])))
        assert (config.max_length, config.truncate) == (1000, truncate)
    assert "longer than 1,000 tokens (max_length)" in why(advice)
    document = advice_document(advice, SOURCES)
    assert (document["max_length"], document["truncate"]) == (1000, truncate)
    AdviceDocument.model_validate(document)


def test_cp_groups_across_nodes_are_priced_with_the_inter_node_tables() -> None:
    """The static-CP time (every sequence over the whole CP group) is fixed by the layout: with nodes of 8 the
    CP group of 16 crosses nodes and pays more than on one node of 16."""
    priced = {}
    for gpus_per_node in (8, 16):
        advice = advise(_problem(num_gpus=16, cp_sizes=(16,), shardings=(Sharding.ZERO3,),
                                 gpus_per_node=gpus_per_node))
        (priced[gpus_per_node],) = advice.layouts
    assert priced[8].layout.spans_nodes and not priced[16].layout.spans_nodes
    assert priced[8].layout.bucket_size == priced[16].layout.bucket_size
    assert all(across > within for across, within in zip(priced[8].static_cp_step_times_s,
                                                          priced[16].static_cp_step_times_s, strict=True))


def test_a_profile_without_inter_node_tables_excludes_the_layouts_across_nodes() -> None:
    advice = advise(_problem(sequence_lengths=[300, 120, 40, 900], model=MODEL_CATALOGUE["tiny"],
                             profile=builtin_profiles()["cpu-tiny"], num_gpus=4, gpus_per_node=2,
                             shardings=(Sharding.ZERO2,), global_batch=GlobalBatchSize(num_sequences=8),
                             compute_bytes=4))
    (across,) = advice.excluded
    assert across.layout.cp_size == 4 and across.exclusion is Exclusion.NO_INTER_NODE_TABLE
    assert "communication.inter_node" in across.reason
    assert sorted(item.layout.cp_size for item in advice.layouts) == [1, 2]


@pytest.mark.parametrize("num_gpus", [4, 16])
def test_each_layouts_command_is_one_the_trainer_accepts(num_gpus: int) -> None:
    advice = advise(_problem(num_gpus=num_gpus, model=MODEL_CATALOGUE["qwen2.5-0.5b"],
                             sequence_lengths=[2000, 300, 9000, 120]))
    for item in advice.layouts:
        command = trainer_argv(advice, item.layout, SOURCES)
        split = command.index("trainer_client.train") + 1
        launcher, flags = command[:split], command[split:]
        args = build_parser().parse_args(list(flags))
        layout = item.layout
        assert (args.dp, args.cp, args.bucket_size) == (layout.dp_size, layout.cp_size, layout.bucket_size)
        assert (args.sharding, args.activation_checkpointing) == (layout.sharding, layout.activation_checkpointing)
        assert (args.model, args.global_batch, args.profile, args.data, args.dtype) == (
            "qwen2.5-0.5b", 32, "h100-paper", "synthetic:chatqa2", "bfloat16")
        if num_gpus > 8:
            assert launcher[:5] == ("torchrun", "--nnodes", str(num_gpus // 8), "--nproc-per-node", "8")
            assert "--node-rank $NODE_RANK --master-addr $MASTER_ADDR" in shell_command(command)
        else:
            assert launcher[:3] == ("torchrun", "--nproc-per-node", str(num_gpus))


def test_the_document_has_the_interface_fields_and_is_json(chatqa2_advice: Advice) -> None:
    document = json.loads(json.dumps(advice_document(chatqa2_advice, SOURCES)))
    AdviceDocument.model_validate(document)
    assert (document["model"], document["profile"], document["gpus"], document["gpus_per_node"]) == (
        "qwen2.5-7b", "h100-paper", 32, 8)
    assert document["global_batch"] == {"sequences": 32} and (document["num_batches"], document["seed"]) == (3, 0)
    interface = {"dp_size", "cp_size", "bucket_size", "sharding", "activation_checkpointing",
                 "predicted_step_time_ms", "tokens_per_s_per_gpu", "speedup_vs_static_cp",
                 "longest_trainable_sequence", "spans_nodes", "confidence", "trainer_command"}
    assert [layout["rank"] for layout in document["layouts"]] == list(range(1, len(document["layouts"]) + 1))
    assert all(interface <= set(layout) for layout in document["layouts"])
    assert all({"reason", "exclusion", "dp_size", "cp_size"} <= set(item) for item in document["excluded"])


def test_progress_is_reported_after_each_priced_layout() -> None:
    calls: list[tuple[int, int]] = []
    advice = advise(_problem(num_gpus=8, shardings=(Sharding.ZERO3,)), progress=lambda done, total: calls.append(
        (done, total)))
    assert calls == [(done, len(advice.layouts)) for done in range(1, len(advice.layouts) + 1)]


def test_the_cost_is_known_before_any_planning(monkeypatch: pytest.MonkeyPatch) -> None:
    problem = _problem(num_gpus=16)
    planned: list[int] = []
    make_plan = advise_module.make_plan
    monkeypatch.setattr(advise_module, "make_plan", lambda *args, **kwargs: planned.append(1) or make_plan(
        *args, **kwargs))
    cost = advise_cost(problem)
    assert planned == []
    assert cost.num_layouts == 5 * 3 and cost.num_plans == 15 * 3 and cost.sequences_per_batch == 32
    # the baseline and the plan of each batch, and on more than one DP replica the spanning micro-batches Skrull tries
    assert cost.cells == 3 * 3 * sum(32 * (2 * cp_size + 1) + (MAX_CHOSEN * 16 if cp_size < 16 else 0)
                                     for cp_size in (1, 2, 4, 8, 16))
    advise(problem)
    assert 0 < len(planned) <= cost.num_plans


def test_a_token_budget_draws_batches_within_it_and_the_command_takes_their_mean() -> None:
    problem = _problem(global_batch=GlobalBatchSize(num_tokens=200_000), num_gpus=16, shardings=(Sharding.ZERO3,))
    batches = draw_batches(problem)
    assert all(int(batch.sum()) <= 200_000 or len(batch) == 1 for batch in batches)
    assert [batch.tolist() for batch in batches] == [batch.tolist() for batch in draw_batches(problem)]  # seeded
    advice = advise(problem)
    mean = round(np.mean([len(batch) for batch in batches]))
    command = trainer_argv(advice, advice.layouts[0].layout, SOURCES)
    assert command[command.index("--global-batch") + 1] == str(mean)
    assert advice_document(advice, SOURCES)["global_batch"] == {"tokens": 200_000}


@settings(max_examples=50, deadline=None)
@given(lengths=st.lists(st.integers(1, 5000), min_size=1, max_size=60), budget=st.integers(1, 40_000),
       seed=st.integers(0, 2**16))
def test_token_budget_batches_never_exceed_it_unless_one_sequence_does(lengths: list[int], budget: int,
                                                                       seed: int) -> None:
    problem = _problem(sequence_lengths=lengths, global_batch=GlobalBatchSize(num_tokens=budget), seed=seed,
                       num_batches=4)
    for batch in draw_batches(problem):
        assert len(batch) >= 1 and (int(batch.sum()) <= budget or len(batch) == 1)
        assert set(batch.tolist()) <= set(lengths)


HUGE = ModelShape(name="huge", hidden_size=1 << 16, num_layers=1 << 10, num_attention_heads=64,
                  num_key_value_heads=8, head_dim=128, intermediate_size=1 << 18, vocab_size=1 << 17)


@pytest.mark.parametrize(("overrides", "field"), [
    ({"sequence_lengths": []}, "sequence_lengths"),
    ({"sequence_lengths": [100, 0, 30]}, "sequence_lengths[1]"),
    ({"sequence_lengths": [1 << 25]}, "sequence_lengths[0]"),
    ({"sequence_lengths": [1.5, 2.0]}, "sequence_lengths"),
    ({"sequence_lengths": [100] * 11, "limits": AdviseLimits(max_sample_sequences=10)}, "sequence_lengths"),
    ({"num_gpus": 0}, "gpus"),
    ({"num_gpus": 12}, "gpus"),
    ({"gpus_per_node": 6}, "gpus_per_node"),
    ({"cp_sizes": (3,)}, "cp_sizes"),
    ({"cp_sizes": (64,)}, "cp_sizes"),
    ({"num_batches": 0}, "num_batches"),
    ({"num_batches": 300}, "num_batches"),
    ({"global_batch": GlobalBatchSize(num_sequences=100), "limits": AdviseLimits(plan=PlanLimits(max_sequences=64))},
     "global_batch"),
    ({"global_batch": GlobalBatchSize(num_tokens=10_000_000),
      "limits": AdviseLimits(plan=PlanLimits(max_sequences=64))},
     "global_batch"),
    ({"compute_bytes": 3}, "compute_bytes"),
    ({"shardings": ()}, "shardings"),
    ({"shardings": ("zero4",)}, "shardings"),
    ({"activation_checkpointing": ("none", "none")}, "activation_checkpointing"),
    ({"model": HUGE}, "model"),
    ({"sequence_lengths": [4_000_000], "num_gpus": 2}, "sequence_lengths"),  # no layout holds any of the sample
    ({"max_length": 0}, "max_length"),
    ({"max_length": 1 << 25}, "max_length"),
    ({"sequence_lengths": [5000, 6000], "max_length": 100}, "max_length"),  # all would be left out
    ({"truncate": "yes"}, "truncate"),
])
def test_bad_input_names_its_field(overrides: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidRequestError) as error:
        advise(_problem(**overrides))
    assert error.value.field == field


def test_a_sample_no_layout_holds_any_of_names_the_longest_that_fits() -> None:
    with pytest.raises(InvalidRequestError) as error:
        advise(_problem(sequence_lengths=[4_000_000, 3_000_000], num_gpus=2))
    assert error.value.message.startswith("no layout of 2 GPUs holds any sequence of the sample: the shortest has "
                                          "3000000 tokens, and at most 8934 fit (dp 2 × cp 1 (zero3, activation "
                                          "checkpointing none): bucket_size 4467 × cp_size 1 × dp_size 2 = 8934 "
                                          "tokens (a micro-batch spanning every DP replica)); truncate")


@pytest.mark.parametrize("batch", [{}, {"num_sequences": 4, "num_tokens": 100}, {"num_sequences": 0},
                                   {"num_tokens": -5}])
def test_a_global_batch_is_a_positive_count_of_sequences_or_tokens(batch: dict[str, int]) -> None:
    with pytest.raises(InvalidRequestError) as error:
        GlobalBatchSize(**batch)
    assert error.value.field == "global_batch"


def test_modes_are_taken_by_name_as_the_wire_and_the_cli_give_them() -> None:
    problem = _problem(num_gpus=8, shardings=("zero3",), activation_checkpointing=("none",))
    assert problem.shardings == (Sharding.ZERO3,) and problem.checkpointing_modes == (ActivationCheckpointing.NONE,)
    assert {item.layout.sharding for item in advise(problem).layouts} == {Sharding.ZERO3}


def test_a_profile_measured_with_other_checkpointing_refuses_that_mode() -> None:
    raw = json.loads(json.dumps(H100.raw))
    raw["memory"]["activation_checkpointing"] = "selective"
    measured = dataclasses.replace(H100, raw=raw)
    advice = advise(_problem(profile=measured, num_gpus=8, shardings=(Sharding.ZERO3,)))
    assert {item.layout.activation_checkpointing for item in advice.layouts} == {ActivationCheckpointing.SELECTIVE}
    with pytest.raises(InvalidRequestError) as error:
        advise(_problem(profile=measured, num_gpus=8, activation_checkpointing=(ActivationCheckpointing.FULL,)))
    assert error.value.field == "activation_checkpointing"
