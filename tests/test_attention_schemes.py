"""The three attention schemes of a collective (all-gather-KV, Ulysses, 2D) equal unsharded attention; packing lays
each out by its rule (``zigzag.shard_positions``).

Gloo ranks at cp 2 and cp 4, one spawn each with every case inside, float32 and float64. Process groups come from
``init_parallel``, as in training.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

import trainer_client.dacp.kernels as kernels
from scheduler_service.core.check import check_plan
from scheduler_service.core.plan import DPRankPlan, MicroBatch, Plan, ShardedGroup
from tests.attention_reference import reference_attention
from trainer_client.config import TrainConfig
from trainer_client.dacp.attention import UlyssesAllToAll, check_ulysses_heads, dacp_attn_varlen_func
from trainer_client.dacp.kernels import AttentionBackend
from trainer_client.dacp.packing import pack_micro_batch
from trainer_client.dacp.zigzag import shard_padded_length, shard_positions, zigzag_positions
from trainer_client.data import IGNORE_INDEX, Sample
from trainer_client.distributed import ParallelContext, ParallelDims, init_parallel, spawn_gloo
from trainer_client.planning.source import PlanDecision, PlanOrigin
from trainer_client.trainer import Trainer

HEAD_DIM = 8
LENGTHS = (5, 17, 64, 33, 1, 100, 2, 9, 40, 3)
DTYPES = (torch.float32, torch.float64)
# Largest error over the tensor's largest entry, against float64 attention of the same inputs. Float32 cannot do
# better absolutely: unsharded float32 attention itself is 4e-6 off in dK (of entries up to 5) for these inputs.
TOLERANCE = {torch.float32: 1e-6, torch.float64: 1e-12}


def _group(cp_ranks: tuple[int, ...], *sequences: int, u: int = 1) -> ShardedGroup:
    return ShardedGroup(cp_ranks=cp_ranks, sequences=sequences, ulysses_degree=u)


# name → (cp_size, query heads, key/value heads, micro-batch). Lengths 1, 2 and 3 are shorter than the block.
CASES: dict[str, tuple[int, int, int, MicroBatch]] = {
    "ulysses_gqa_u_divides_kv_heads": (2, 8, 4, MicroBatch(
        local=((0,), (9,)), distributed=(1, 4, 6), distributed_ulysses_degree=2)),
    "ulysses_gqa_kv_heads_repeated": (2, 8, 1, MicroBatch(
        local=((4,), ()), distributed=(2, 3, 9), distributed_ulysses_degree=2)),
    "ulysses_mha": (2, 4, 4, MicroBatch(local=((), ()), distributed=(5, 7), distributed_ulysses_degree=2)),
    "ulysses_whole_group_kv_heads_repeated": (4, 8, 2, MicroBatch(
        local=((0,), (), (6,), ()), distributed=(1, 4, 7, 3), distributed_ulysses_degree=4)),
    "two_d_u_divides_kv_heads": (4, 8, 4, MicroBatch(
        local=((0,), (1,), (), (5,)), distributed=(2, 4, 6, 9), distributed_ulysses_degree=2)),
    "two_d_kv_heads_repeated": (4, 8, 1, MicroBatch(
        local=((), (), (0,), ()), distributed=(5, 1, 8), distributed_ulysses_degree=2)),
    "two_d_mha": (4, 4, 4, MicroBatch(local=((9,), (), (), ()), distributed=(3, 7), distributed_ulysses_degree=2)),
    # Every scheme in one micro-batch; CP ranks 0 and 1 meet the block (0, 1) twice, by two schemes.
    "schemes_side_by_side": (4, 8, 4, MicroBatch(
        local=((0,), (), (6,), (4,)), distributed=(9,),
        sharded=(_group((0, 1), 5, 2, u=2), _group((2, 3), 3, 1), _group((0, 1), 8, u=1),
                 _group((2, 3), 7, u=2)))),
    "two_d_beside_ulysses_and_all_gather": (4, 8, 2, MicroBatch(
        local=((0,), (6,), (), (4,)), distributed=(2, 9), distributed_ulysses_degree=2,
        sharded=(_group((0, 1), 5, 7, u=2), _group((2, 3), 3, 1, u=1)))),
}
CHECKPOINTED = "two_d_beside_ulysses_and_all_gather"  # also run under activation checkpointing
ORDERING_CASES = {2: "ulysses_gqa_u_divides_kv_heads", 4: "schemes_side_by_side"}  # per cp_size


# ---------------------------------------------------------------------------------------------------- the rule


def _expected_positions(length: int, *, degree: int, u: int, position: int) -> np.ndarray:
    """The layout rule written out: Ulysses a contiguous split of the sequence padded to a multiple of the block,
    2D a zigzag split over the sub-blocks then a contiguous split of each sub-block's tokens."""
    g = degree // u
    if u == degree:
        padded = -(-length // degree) * degree
        share = padded // degree
        return np.arange(position * share, (position + 1) * share)
    multiple = math.lcm(2 * g, degree)
    padded = -(-length // multiple) * multiple
    sub_block, place = divmod(position, u)
    chunk = padded // (2 * g)
    sub_block_tokens = np.concatenate([np.arange(sub_block * chunk, (sub_block + 1) * chunk),
                                       np.arange((2 * g - 1 - sub_block) * chunk, (2 * g - sub_block) * chunk)])
    share = len(sub_block_tokens) // u
    return sub_block_tokens[place * share:(place + 1) * share]


@pytest.mark.parametrize(("degree", "u"), [(2, 2), (4, 4), (4, 2), (8, 2), (8, 4), (6, 3), (6, 2), (3, 3)])
def test_ulysses_and_2d_layouts_follow_the_rule_and_cover_each_position_once(degree: int, u: int) -> None:
    for length in (1, 2, 3, 5, 17, 64, 100):
        padded = shard_padded_length(length, degree=degree, ulysses_degree=u)
        held = [shard_positions(length, degree=degree, ulysses_degree=u, position=p) for p in range(degree)]
        for position, positions in enumerate(held):
            np.testing.assert_array_equal(positions, _expected_positions(length, degree=degree, u=u,
                                                                         position=position))
        assert sorted(np.concatenate(held).tolist()) == list(range(padded))
        assert padded >= length and len({len(positions) for positions in held}) == 1


def test_all_gather_kv_layout_is_the_zigzag_rule() -> None:
    for length in (1, 9, 100):
        np.testing.assert_array_equal(shard_positions(length, degree=4, ulysses_degree=1, position=1),
                                      zigzag_positions(length, cp_size=4, cp_rank=1))


def _samples(seed: int = 0) -> list[Sample]:
    rng = np.random.default_rng(seed)
    samples = []
    for length in LENGTHS:
        input_ids = rng.integers(1, 1000, size=length, dtype=np.int64)
        labels = np.where(rng.random(length) < 0.2, IGNORE_INDEX, input_ids)
        samples.append(Sample(input_ids=input_ids, labels=labels))
    return samples


def _collectives(micro_batch: MicroBatch, cp_rank: int) -> list[tuple[int, int, int, tuple[int, ...]]]:
    """(first rank, degree, Ulysses degree, sequences) of each collective holding ``cp_rank``, in row order."""
    return [(c.first_rank, c.degree, c.ulysses_degree, c.sequences) for c in micro_batch.collectives()
            if c.sequences and c.first_rank <= cp_rank < c.first_rank + c.degree]


def _rows(micro_batch: MicroBatch, cp_rank: int) -> list[tuple[int, int]]:
    """(sequence index, global position) of each packed row, straight from the layout rule of each collective."""
    rows = [(index, position) for index in micro_batch.local[cp_rank] for position in range(LENGTHS[index])]
    for first, degree, u, indices in _collectives(micro_batch, cp_rank):
        for index in indices:
            positions = _expected_positions(LENGTHS[index], degree=degree, u=u, position=cp_rank - first)
            rows += [(index, int(p)) for p in positions]
    return rows


@pytest.mark.parametrize("name", list(CASES))
def test_packed_rows_follow_each_collectives_layout_and_padding_predicts_nothing(name: str) -> None:
    cp_size, _, _, micro_batch = CASES[name]
    samples = _samples()
    num_loss_tokens = 0
    for cp_rank in range(cp_size):
        packed = pack_micro_batch(samples, micro_batch, cp_size=cp_size, cp_rank=cp_rank, pad_token_id=-5)
        rows = _rows(micro_batch, cp_rank)
        assert packed.position_ids_T.tolist() == [position for _, position in rows]
        for row, (index, position) in enumerate(rows):
            sample = samples[index]
            if position < sample.num_tokens:
                assert packed.input_ids_T[row] == sample.input_ids[position]
                assert packed.targets_T[row] == sample.targets[position]
            else:
                assert packed.input_ids_T[row] == -5 and packed.targets_T[row] == IGNORE_INDEX
        specs = packed.metadata.sharded
        assert [(s.cp_ranks[0], s.group_size, s.ulysses_degree) for s in specs] == [
            (first, degree, u) for first, degree, u, _ in _collectives(micro_batch, cp_rank)]
        for spec in specs:
            if spec.ulysses_degree > 1:  # the index reorders every received row once; its inverse undoes it
                assert spec.ulysses_index is not None and spec.ulysses_inverse is not None
                assert sorted(spec.ulysses_index.tolist()) == list(range(spec.ulysses_degree * spec.num_tokens))
                np.testing.assert_array_equal(spec.ulysses_index[spec.ulysses_inverse].numpy(),
                                              np.arange(spec.ulysses_degree * spec.num_tokens))
        num_loss_tokens += packed.num_loss_tokens
    assert num_loss_tokens == sum(samples[i].num_loss_tokens for i in micro_batch.indices())


def test_rejects_a_ulysses_degree_that_does_not_divide_the_collective() -> None:
    micro_batch = MicroBatch(local=((),) * 4, distributed=(1,), distributed_ulysses_degree=3)
    with pytest.raises(ValueError, match="Ulysses degree 3, not a divisor of its 4 ranks"):
        pack_micro_batch(_samples(), micro_batch, cp_size=4, cp_rank=0)


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "u"), [(6, 2, 4), (3, 3, 2), (12, 3, 4), (8, 8, 16)])
def test_refuses_a_ulysses_degree_that_splits_heads_unevenly(num_heads: int, num_kv_heads: int, u: int) -> None:
    message = f"Ulysses degree {u} does not fit {num_heads} query heads and {num_kv_heads} key/value heads"
    with pytest.raises(ValueError, match=message):
        check_ulysses_heads(num_heads, num_kv_heads, u)


def test_attention_refuses_an_uneven_head_split_before_communicating() -> None:
    packed = pack_micro_batch(_samples(), MicroBatch(local=((), ()), distributed=(1,), distributed_ulysses_degree=2),
                              cp_size=2, cp_rank=0)  # no process group: a collective would fail on it instead
    q_THD = torch.zeros(packed.num_tokens, 3, HEAD_DIM)
    with pytest.raises(ValueError, match="Ulysses degree 2 does not fit 3 query heads and 3 key/value heads"):
        dacp_attn_varlen_func(q_THD, q_THD, q_THD, packed.metadata, backend=AttentionBackend.SDPA)


def test_strided_groups_of_every_block_and_ulysses_degree() -> None:
    ranks = [members for row, members in ParallelDims(dp_size=2, cp_size=8).cp_stride_ranks() if row == 1]
    assert ranks == [(0, 2), (1, 3), (4, 6), (5, 7), (0, 2, 4, 6), (1, 3, 5, 7), (0, 4), (1, 5), (2, 6), (3, 7)]
    assert ParallelDims(dp_size=1, cp_size=2).cp_stride_ranks() == ()


# ---------------------------------------------------------------------------------------------------- attention


def _sequence_tensors(num_heads: int, num_kv_heads: int, dtype: torch.dtype) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(num_heads * 10 + num_kv_heads)
    shapes = {"q": num_heads, "k": num_kv_heads, "v": num_kv_heads, "grad_out": num_heads}
    return [{name: torch.randn(length, heads, HEAD_DIM, generator=generator, dtype=torch.float64).to(dtype)
             for name, heads in shapes.items()} for length in LENGTHS]


def _take(rows: list[tuple[int, int]], key: str, source: list[dict[str, torch.Tensor]]) -> torch.Tensor:
    """The packed rows of one tensor; padding rows get an arbitrary value (they must influence nothing)."""
    sample = source[0][key]
    if not rows:
        return sample.new_zeros(0, *sample.shape[1:])
    return torch.stack([source[i][key][p] if p < LENGTHS[i] else torch.full_like(sample[0], 7.0) for i, p in rows])


class _Marker(torch.autograd.Function):
    """Identity that records ``event`` when its backward runs."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, events: list[tuple[str, int]], event: str) -> torch.Tensor:
        ctx.events, ctx.event = events, event
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        ctx.events.append((ctx.event, 0))
        return grad, None, None


def _recording(events: list[tuple[str, int]]) -> tuple[list[Any], kernels.VarlenKernel]:
    """Patches that log each all-to-all's start and its gradient's launch and wait (by object), and a kernel that
    marks local attention forward and the start and end of its backward."""
    start, launch, wait = (UlyssesAllToAll.start, UlyssesAllToAll._launch_backward,
                           UlyssesAllToAll._wait_backward)
    varlen = kernels.resolve_kernel(AttentionBackend.SDPA, device=torch.device("cpu"), dtype=torch.float64)

    def logged_start(self: UlyssesAllToAll, send: torch.Tensor) -> None:
        events.append(("started", id(self)))
        start(self, send)

    def logged_launch(self: UlyssesAllToAll, grad: torch.Tensor) -> None:
        events.append(("grad_launched", id(self)))
        launch(self, grad)

    def logged_wait(self: UlyssesAllToAll) -> torch.Tensor:
        events.append(("grad_waited", id(self)))
        return wait(self)

    def marked_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                      cu_seqlens_k: torch.Tensor, *args: Any) -> torch.Tensor:
        if cu_seqlens_q is not cu_seqlens_k:  # a collective's attention; local attention passes one cu_seqlens
            return varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *args)
        events.append(("local_forward", 0))
        q, k, v = (_Marker.apply(x, events, "local_backward_ended") for x in (q, k, v))
        out = varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *args)
        return _Marker.apply(out, events, "local_backward_started")

    return ([mock.patch.object(UlyssesAllToAll, "start", logged_start),
             mock.patch.object(UlyssesAllToAll, "_launch_backward", logged_launch),
             mock.patch.object(UlyssesAllToAll, "_wait_backward", logged_wait)], marked_varlen)


def _run_case(name: str, dtype: torch.dtype, cp_rank: int, parallel: Any, *, checkpointed: bool = False,
              events: list[tuple[str, int]] | None = None) -> dict[str, Any]:
    _, num_heads, num_kv_heads, micro_batch = CASES[name]
    samples = [Sample(input_ids=np.zeros(n, dtype=np.int64), labels=np.zeros(n, dtype=np.int64)) for n in LENGTHS]
    packed = pack_micro_batch(samples, micro_batch, cp_size=parallel.dims.cp_size, cp_rank=cp_rank,
                              cp_group=parallel.cp_group, cp_block_groups=parallel.cp_block_groups,
                              cp_stride_groups=parallel.cp_stride_groups)
    rows = _rows(micro_batch, cp_rank)
    tensors = _sequence_tensors(num_heads, num_kv_heads, dtype)
    q_THD, k_TGD, v_TGD = (_take(rows, key, tensors).requires_grad_() for key in "qkv")
    patches, kernel = _recording(events) if events is not None else ([], None)
    for patch in patches:
        patch.start()
    try:
        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return dacp_attn_varlen_func(q, k, v, packed.metadata, backend=AttentionBackend.SDPA, kernel=kernel)

        out_THD = (checkpoint(attend, q_THD, k_TGD, v_TGD, use_reentrant=False, early_stop=False) if checkpointed
                   else attend(q_THD, k_TGD, v_TGD))
        if not packed.is_idle:  # as the trainer: an idle rank runs nothing
            real = torch.tensor([position < LENGTHS[index] for index, position in rows], dtype=torch.bool)
            # Padding carries no loss: no gradient reaches a padding output.
            (out_THD * _take(rows, "grad_out", tensors) * real[:, None, None]).sum().backward()
    finally:
        for patch in patches:
            patch.stop()
    grads = {key: x.grad if x.grad is not None else torch.zeros_like(x)
             for key, x in (("q", q_THD), ("k", k_TGD), ("v", v_TGD))}
    return {"rows": rows, "out": out_THD.detach(), **grads}


def _run_rank(out_dir: Path, cp_size: int) -> None:
    parallel = init_parallel(ParallelDims(dp_size=1, cp_size=cp_size))
    cp_rank = parallel.cp_rank
    results: dict[Any, Any] = {"stride_groups": {key: dist.get_process_group_ranks(group)
                                                 for key, group in parallel.cp_stride_groups.items()}}
    for name, (case_cp_size, *_) in CASES.items():
        if case_cp_size != cp_size:
            continue
        for dtype in DTYPES:
            results[name, dtype] = _run_case(name, dtype, cp_rank, parallel)
        if name == CHECKPOINTED:
            results[name, "checkpointed"] = _run_case(name, torch.float64, cp_rank, parallel, checkpointed=True)
        if name == ORDERING_CASES[cp_size]:
            events: list[tuple[str, int]] = []
            _run_case(name, torch.float64, cp_rank, parallel, events=events)
            results["events"] = events
    if cp_size == STEP_CP:
        results["steps"] = _train_steps(parallel)
    torch.save(results, out_dir / f"cp_rank_{cp_rank}.pt")


# ---------------------------------------------------------------------------------------------------- training step

STEP_CP, STEP_BUCKET = 4, 1024


def _schemes_plan(lengths: tuple[int, ...]) -> Plan:
    """The tiny model (4 query heads, 2 K/V heads): Ulysses over the CP group (K/V heads repeated) and over a block,
    all-gather-KV over a block, local sequences; then 2D over the CP group."""
    o = sorted(range(len(lengths)), key=lengths.__getitem__)  # indices, shortest first
    first = MicroBatch(local=((o[0],), (o[1],), (), (o[2],)), distributed=(o[7],), distributed_ulysses_degree=4,
                       sharded=(_group((0, 1), o[6], u=2), _group((2, 3), o[5])))
    second = MicroBatch(local=((),) * STEP_CP, distributed=(o[4], o[3]), distributed_ulysses_degree=2)
    return Plan(dp_ranks=(DPRankPlan(micro_batches=(first, second)),))


def _all_gather_plan(lengths: tuple[int, ...]) -> Plan:
    return Plan(dp_ranks=(DPRankPlan(micro_batches=tuple(
        MicroBatch(local=((),) * STEP_CP, distributed=(index,)) for index in range(len(lengths)))),))


def _train_steps(parallel: ParallelContext) -> dict[str, Any]:
    """One training step of the tiny model under full activation checkpointing and FSDP2 (ZeRO-3) on each plan:
    its loss and gradients (the gradients on CP rank 0 only)."""
    config = TrainConfig(dp=1, cp=STEP_CP, model="tiny", data="synthetic:lmsys", global_batch=8, steps=1,
                         scheduler="deepspeed", bucket_size=STEP_BUCKET, max_length=256, seed=0, progress=False,
                         activation_checkpointing="full", sharding="zero3")
    trainer = Trainer(config, parallel)
    batch = trainer.source.batch(0)
    steps = {}
    for name, plan in (("schemes", _schemes_plan(batch.sequence_lengths)),
                       ("all_gather", _all_gather_plan(batch.sequence_lengths))):
        check_plan(plan, sequence_lengths=batch.sequence_lengths, dp_size=1, cp_size=STEP_CP,
                   bucket_size=STEP_BUCKET)
        decision = PlanDecision(step=0, scheduler=name, origin=PlanOrigin.EMBEDDED, plan=plan,
                                bucket_size=STEP_BUCKET)
        with trainer.batches.share(batch, decision) as share:
            loss, num_loss_tokens = trainer.forward_backward(share)
        grads = trainer.gradients()  # collective under FSDP
        steps[name] = {"loss": loss, "num_loss_tokens": num_loss_tokens,
                       "grads": grads if parallel.is_main else None}
    trainer.close()
    dist.barrier()
    return steps


@pytest.fixture(scope="module", params=[2, 4], ids=["cp2", "cp4"])
def rank_results(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
                 ) -> tuple[int, list[dict[Any, Any]]]:
    cp_size: int = request.param
    out_dir = tmp_path_factory.mktemp(f"attention_schemes_cp{cp_size}")
    spawn_gloo(_run_rank, cp_size, out_dir, cp_size)
    return cp_size, [torch.load(out_dir / f"cp_rank_{cp_rank}.pt") for cp_rank in range(cp_size)]


def _reference(name: str, dtype: torch.dtype) -> list[dict[str, torch.Tensor]]:
    """Unsharded attention per sequence, in float64 from the inputs as the ranks had them."""
    _, num_heads, num_kv_heads, _ = CASES[name]
    results = []
    for seq in _sequence_tensors(num_heads, num_kv_heads, dtype):
        q, k, v = (seq[key].double().requires_grad_() for key in "qkv")
        out = reference_attention(q, k, v)
        dq, dk, dv = torch.autograd.grad((out * seq["grad_out"].double()).sum(), (q, k, v))
        results.append({"out": out.detach(), "q": dq, "k": dk, "v": dv})
    return results


def test_each_rank_holds_its_strided_groups(rank_results: tuple[int, list[dict[Any, Any]]]) -> None:
    cp_size, results = rank_results
    if cp_size == 2:
        assert all(result["stride_groups"] == {} for result in results)
    else:
        assert [result["stride_groups"] for result in results] == [
            {(0, 2, 2): [0, 2]}, {(1, 2, 2): [1, 3]}, {(0, 2, 2): [0, 2]}, {(1, 2, 2): [1, 3]}]


def test_every_scheme_matches_unsharded_reference(rank_results: tuple[int, list[dict[Any, Any]]]) -> None:
    cp_size, results = rank_results
    runs: list[tuple[str, torch.dtype | str]] = [
        (name, dtype) for name, (case_cp_size, *_) in CASES.items() if case_cp_size == cp_size for dtype in DTYPES]
    runs += [(CHECKPOINTED, "checkpointed")] if CASES[CHECKPOINTED][0] == cp_size else []
    for name, variant in runs:
        dtype = variant if isinstance(variant, torch.dtype) else torch.float64
        reference = _reference(name, dtype)
        tolerance = TOLERANCE[dtype]
        for cp_rank, rank in enumerate(results):
            result = rank[name, variant]
            rows = result["rows"]
            real = torch.tensor([position < LENGTHS[index] for index, position in rows], dtype=torch.bool)
            for key in ("out", "q", "k", "v"):
                where = f"cp_rank {cp_rank} {name} {variant} {key}"
                got = result[key]
                assert got.dtype == dtype, where
                want = _take(rows, key, reference)[real]
                error = (got[real].double() - want).abs().max().item() / want.abs().max().item()
                assert error <= tolerance, f"{where}: error {error:.2e} of the largest entry > {tolerance}"
                if key != "out":  # padding rows get no gradient
                    torch.testing.assert_close(got[~real], torch.zeros_like(got[~real]), msg=where)


def test_qkv_all_to_all_overlaps_local_attention(rank_results: tuple[int, list[dict[Any, Any]]]) -> None:
    """Forward: every collective's Q/K/V all-to-all starts before local attention; backward: its gradient's
    all-to-all is launched before local attention's backward and waited after it."""
    cp_size, results = rank_results
    micro_batch = CASES[ORDERING_CASES[cp_size]][3]
    num_ulysses = [sum(u > 1 for _, _, u, _ in _collectives(micro_batch, cp_rank)) for cp_rank in range(cp_size)]
    ranks_with_both = [r for r in range(cp_size) if micro_batch.local[r] and num_ulysses[r]]
    assert len(ranks_with_both) >= 2
    for cp_rank in ranks_with_both:
        events = results[cp_rank]["events"]
        local = events.index(("local_forward", 0))
        to_heads = [key for event, key in events[:local] if event == "started"]
        assert len(to_heads) == num_ulysses[cp_rank], f"cp_rank {cp_rank}: {events}"
        local_started = events.index(("local_backward_started", 0))
        local_ended = max(i for i, event in enumerate(events) if event == ("local_backward_ended", 0))
        for key in to_heads:
            assert events.index(("grad_launched", key)) < local_started, f"cp_rank {cp_rank}: {events}"
            assert events.index(("grad_waited", key)) > local_ended, f"cp_rank {cp_rank}: {events}"


def test_training_step_with_every_scheme_equals_all_gather_kv_under_checkpointing_and_fsdp(
    rank_results: tuple[int, list[dict[Any, Any]]]
) -> None:
    cp_size, results = rank_results
    if cp_size != STEP_CP:
        pytest.skip(f"the training step runs in the cp {STEP_CP} spawn")
    steps = results[0]["steps"]
    schemes, all_gather = steps["schemes"], steps["all_gather"]
    assert schemes["num_loss_tokens"] == all_gather["num_loss_tokens"]
    assert schemes["loss"] == pytest.approx(all_gather["loss"], rel=1e-6)
    assert schemes["grads"].keys() == all_gather["grads"].keys()
    for name, grad in all_gather["grads"].items():
        torch.testing.assert_close(schemes["grads"][name], grad, rtol=1e-5, atol=1e-7, msg=name)
