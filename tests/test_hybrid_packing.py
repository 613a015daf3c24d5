"""Hybrid DACP packing: a sequence sharded over a block of CP ranks is zigzag-split among that block only."""

from __future__ import annotations

import numpy as np
import pytest

from scheduler_service.core.plan import MicroBatch, ShardedGroup
from trainer_client.dacp.packing import PackedMicroBatch, pack_micro_batch
from trainer_client.dacp.zigzag import padded_length, zigzag_positions
from trainer_client.data import IGNORE_INDEX, Sample

LENGTHS = (5, 17, 64, 33, 1, 100, 2, 9, 40, 3)


def _samples(seed: int = 0) -> list[Sample]:
    rng = np.random.default_rng(seed)
    samples = []
    for length in LENGTHS:
        input_ids = rng.integers(1, 1000, size=length, dtype=np.int64)
        labels = np.where(rng.random(length) < 0.2, IGNORE_INDEX, input_ids)
        samples.append(Sample(input_ids=input_ids, labels=labels))
    return samples


def _micro_batches(cp_size: int) -> dict[str, MicroBatch]:
    half = cp_size // 2
    local: list[tuple[int, ...]] = [()] * cp_size
    local[0], local[cp_size - 1] = (0, 4), (6,)
    first, second = tuple(range(half)), tuple(range(half, cp_size))
    return {
        "halves": MicroBatch(local=tuple(local), distributed=(2,),
                             sharded=(ShardedGroup(cp_ranks=first, sequences=(1, 3)),
                                      ShardedGroup(cp_ranks=second, sequences=(5,)))),
        # CP ranks 0 and 1 are in three collectives: the whole group, and the block (0, 1) twice.
        "rank_in_several_groups": MicroBatch(local=tuple(local), distributed=(2,),
                                             sharded=(ShardedGroup(cp_ranks=(0, 1), sequences=(1, 8)),
                                                      ShardedGroup(cp_ranks=second, sequences=(5,)),
                                                      ShardedGroup(cp_ranks=(0, 1), sequences=(3, 9)))),
        "groups_only": MicroBatch(local=tuple(local), distributed=(),
                                  sharded=(ShardedGroup(cp_ranks=second, sequences=(1, 2, 3, 5)),)),
    }


def _collectives(micro_batch: MicroBatch, cp_size: int, cp_rank: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(block, sequences) of every collective ``cp_rank`` is in, in row order: whole CP group, then plan order."""
    blocks = [(tuple(range(cp_size)), micro_batch.distributed)] if micro_batch.distributed else []
    return blocks + [(g.cp_ranks, g.sequences) for g in micro_batch.sharded if cp_rank in g.cp_ranks]


def _packs(micro_batch: MicroBatch, cp_size: int) -> list[PackedMicroBatch]:
    return [pack_micro_batch(_samples(), micro_batch, cp_size=cp_size, cp_rank=r) for r in range(cp_size)]


CASES = [(cp_size, name) for cp_size in (4, 8) for name in ("halves", "rank_in_several_groups", "groups_only")]


@pytest.mark.parametrize(("cp_size", "name"), CASES)
def test_row_is_local_then_each_collectives_zigzag_shards_in_plan_order(cp_size: int, name: str) -> None:
    samples, micro_batch = _samples(), _micro_batches(cp_size)[name]
    for cp_rank, packed in enumerate(_packs(micro_batch, cp_size)):
        expected_ids, expected_positions, expected_targets = [], [], []
        for index in micro_batch.local[cp_rank]:
            expected_ids.append(samples[index].input_ids)
            expected_positions.append(np.arange(samples[index].num_tokens))
            expected_targets.append(samples[index].targets)
        collectives = _collectives(micro_batch, cp_size, cp_rank)
        for block, indices in collectives:
            for index in indices:
                sample = samples[index]
                positions = zigzag_positions(sample.num_tokens, cp_size=len(block), cp_rank=cp_rank - block[0])
                padding = padded_length(sample.num_tokens, len(block)) - sample.num_tokens
                expected_ids.append(np.concatenate([sample.input_ids, np.zeros(padding, np.int64)])[positions])
                expected_targets.append(np.concatenate([sample.targets, np.full(padding, IGNORE_INDEX)])[positions])
                expected_positions.append(positions)
        for got, expected in ((packed.input_ids_T, expected_ids), (packed.position_ids_T, expected_positions),
                              (packed.targets_T, expected_targets)):
            np.testing.assert_array_equal(got.numpy(), np.concatenate([np.zeros(0, np.int64), *expected]))
        specs = packed.metadata.sharded
        assert [spec.cp_ranks for spec in specs] == [block for block, _ in collectives]
        for spec, (block, indices) in zip(specs, collectives, strict=True):
            assert spec.group_size == len(block) and spec.group_rank == cp_rank - block[0]
            assert spec.num_tokens == sum(padded_length(samples[i].num_tokens, len(block)) // len(block)
                                          for i in indices)
        assert packed.num_tokens == packed.metadata.num_tokens


def _runs(pack: PackedMicroBatch, micro_batch: MicroBatch, cp_size: int, cp_rank: int) -> list[tuple[int, int, slice]]:
    """(collective slot, sequence index, rows) of every shard run in ``pack``, walking the expected row layout."""
    runs, row = [], pack.metadata.num_local_tokens
    for slot, (block, indices) in enumerate(_collectives(micro_batch, cp_size, cp_rank)):
        for index in indices:
            shard = padded_length(LENGTHS[index], len(block)) // len(block)
            runs.append((slot, index, slice(row, row + shard)))
            row += shard
    assert row == pack.num_tokens
    return runs


@pytest.mark.parametrize(("cp_size", "name"), CASES)
def test_block_sharded_sequence_is_covered_exactly_once_by_its_block(cp_size: int, name: str) -> None:
    micro_batch = _micro_batches(cp_size)[name]
    packs = _packs(micro_batch, cp_size)
    positions_of: dict[int, list[np.ndarray]] = {}
    for cp_rank, pack in enumerate(packs):
        blocks = [block for block, _ in _collectives(micro_batch, cp_size, cp_rank)]
        for slot, index, rows in _runs(pack, micro_batch, cp_size, cp_rank):
            block = blocks[slot]
            positions = pack.position_ids_T.numpy()[rows]
            np.testing.assert_array_equal(
                positions, zigzag_positions(LENGTHS[index], cp_size=len(block), cp_rank=cp_rank - block[0]))
            positions_of.setdefault(index, []).append(positions)
    for group in micro_batch.sharded:
        for index in group.sequences:
            assert len(positions_of[index]) == group.degree  # no rank outside the block holds any of it
            np.testing.assert_array_equal(np.sort(np.concatenate(positions_of[index])),
                                          np.arange(padded_length(LENGTHS[index], group.degree)))


@pytest.mark.parametrize(("cp_size", "name"), CASES)
def test_kv_index_reads_each_chunks_causal_prefix_from_its_blocks_gathered_shards(cp_size: int, name: str) -> None:
    micro_batch = _micro_batches(cp_size)[name]
    packs = _packs(micro_batch, cp_size)
    # The k-th collective of a block on one member is the k-th on every member (plan order).
    tags: dict[tuple[int, tuple[int, ...], int], np.ndarray] = {}  # (cp_rank, block, k) → (index, position) rows
    for cp_rank, pack in enumerate(packs):
        blocks = [block for block, _ in _collectives(micro_batch, cp_size, cp_rank)]
        keys = [(cp_rank, block, blocks[:slot].count(block)) for slot, block in enumerate(blocks)]
        for slot, index, rows in _runs(pack, micro_batch, cp_size, cp_rank):
            run = np.stack([np.full(rows.stop - rows.start, index), pack.position_ids_T.numpy()[rows]], axis=1)
            tags[keys[slot]] = np.concatenate([tags.get(keys[slot], np.zeros((0, 2), np.int64)), run])
    for cp_rank, pack in enumerate(packs):
        row = pack.metadata.num_local_tokens
        blocks = [block for block, _ in _collectives(micro_batch, cp_size, cp_rank)]
        for slot, (spec, (block, indices)) in enumerate(zip(pack.metadata.sharded,
                                                            _collectives(micro_batch, cp_size, cp_rank), strict=True)):
            # The all-gather stacks the block members' rows in block order (rank-major).
            gathered = np.concatenate([tags[(member, block, blocks[:slot].count(block))] for member in block])
            prefix_tags = gathered[spec.kv_index.numpy()]
            cu_k, cu_q = spec.cu_seqlens_k.tolist(), spec.cu_seqlens_q.tolist()
            positions = pack.position_ids_T.numpy()[row:row + spec.num_tokens]
            assert len(cu_q) == len(cu_k) == 2 * len(indices) + 1
            for chunk in range(2 * len(indices)):
                chunk_tags = prefix_tags[cu_k[chunk]:cu_k[chunk + 1]]
                query_positions = positions[cu_q[chunk]:cu_q[chunk + 1]]
                np.testing.assert_array_equal(chunk_tags[:, 0], indices[chunk // 2])
                # The prefix ends with the chunk itself: bottom-right causal alignment gives position p its p + 1 keys.
                np.testing.assert_array_equal(chunk_tags[:, 1], np.arange(query_positions[-1] + 1))
            row += spec.num_tokens


@pytest.mark.parametrize(("cp_size", "name"), CASES)
def test_every_loss_token_is_trained_exactly_once(cp_size: int, name: str) -> None:
    micro_batch = _micro_batches(cp_size)[name]
    trained = sum(p.num_loss_tokens for p in _packs(micro_batch, cp_size))
    assert trained == sum(_samples()[i].num_loss_tokens for i in micro_batch.indices())


def test_rank_outside_every_collective_packs_only_its_local_sequences() -> None:
    micro_batch = _micro_batches(4)["groups_only"]
    packed = pack_micro_batch(_samples(), micro_batch, cp_size=4, cp_rank=0)
    assert packed.metadata.sharded == () and packed.num_tokens == sum(LENGTHS[i] for i in (0, 4))
    idle = pack_micro_batch(_samples(), micro_batch, cp_size=4, cp_rank=1)
    assert idle.is_idle
    member = pack_micro_batch(_samples(), MicroBatch(local=((0,), (), (), ()), distributed=(),
                                                     sharded=(ShardedGroup(cp_ranks=(2, 3), sequences=(4,)),)),
                              cp_size=4, cp_rank=3)
    assert not member.is_idle and member.metadata.num_local_tokens == 0  # one token still gives both ranks a shard


def test_block_groups_are_looked_up_by_first_cp_rank_and_size() -> None:
    groups = {(0, 2): "block 0-1", (0, 4): "block 0-3"}  # stand-ins: packing only passes them through
    micro_batch = MicroBatch(local=((),) * 8, distributed=(0,),
                             sharded=(ShardedGroup(cp_ranks=(0, 1, 2, 3), sequences=(1,)),
                                      ShardedGroup(cp_ranks=(0, 1), sequences=(2,))))
    packed = pack_micro_batch(_samples(), micro_batch, cp_size=8, cp_rank=1, cp_group="whole",  # type: ignore[arg-type]
                              cp_block_groups=groups)  # type: ignore[arg-type]
    assert [spec.group for spec in packed.metadata.sharded] == ["whole", "block 0-3", "block 0-1"]


@pytest.mark.parametrize("cp_ranks", [(1, 2), (0, 2), (0, 1, 2), (4, 5)])
def test_rejects_a_group_that_is_not_an_aligned_block(cp_ranks: tuple[int, ...]) -> None:
    micro_batch = MicroBatch(local=((),) * 4, distributed=(),
                             sharded=(ShardedGroup(cp_ranks=cp_ranks, sequences=(0,)),))
    with pytest.raises(ValueError, match="not an aligned block"):
        pack_micro_batch(_samples(), micro_batch, cp_size=4, cp_rank=0)
