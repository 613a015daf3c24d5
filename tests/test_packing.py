"""Packing slices tokens as the zigzag rule says and loses or repeats no loss token."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from scheduler_service.core.plan import MicroBatch
from trainer_client.dacp.packing import bucket_segments, pack_micro_batch
from trainer_client.dacp.zigzag import padded_length, zigzag_positions
from trainer_client.data import IGNORE_INDEX, Sample

LENGTHS = (5, 17, 64, 33, 1, 100, 2)


def _samples(lengths: tuple[int, ...] = LENGTHS, seed: int = 0) -> list[Sample]:
    rng = np.random.default_rng(seed)
    samples = []
    for length in lengths:
        input_ids = rng.integers(1, 1000, size=length, dtype=np.int64)
        labels = np.where(rng.random(length) < 0.2, IGNORE_INDEX, input_ids)  # some positions carry no loss
        samples.append(Sample(input_ids=input_ids, labels=labels))
    return samples


def _micro_batch(cp_size: int) -> MicroBatch:
    local = [[] for _ in range(cp_size)]
    for slot, index in enumerate((0, 1, 4, 6)):
        local[slot % cp_size].append(index)
    return MicroBatch(local=tuple(tuple(rank_local) for rank_local in local), distributed=(2, 3, 5))


@pytest.mark.parametrize("cp_size", [1, 2, 3, 4])
def test_each_rank_holds_its_local_sequences_then_its_zigzag_shards(cp_size: int) -> None:
    samples, micro_batch = _samples(), _micro_batch(cp_size)
    for cp_rank in range(cp_size):
        packed = pack_micro_batch(samples, micro_batch, cp_size=cp_size, cp_rank=cp_rank)
        expected_ids, expected_positions, expected_targets = [], [], []
        for index in micro_batch.local[cp_rank]:
            expected_ids.append(samples[index].input_ids)
            expected_positions.append(np.arange(samples[index].num_tokens))
            expected_targets.append(samples[index].targets)
        for index in micro_batch.distributed:
            sample = samples[index]
            positions = zigzag_positions(sample.num_tokens, cp_size=cp_size, cp_rank=cp_rank)
            padded_ids = np.concatenate([sample.input_ids, np.zeros(len(positions) * cp_size, dtype=np.int64)])
            padded_targets = np.concatenate([sample.targets, np.full(len(positions) * cp_size, IGNORE_INDEX)])
            expected_ids.append(padded_ids[positions])
            expected_positions.append(positions)
            expected_targets.append(padded_targets[positions])
        np.testing.assert_array_equal(packed.input_ids_T.numpy(), np.concatenate(expected_ids))
        np.testing.assert_array_equal(packed.position_ids_T.numpy(), np.concatenate(expected_positions))
        np.testing.assert_array_equal(packed.targets_T.numpy(), np.concatenate(expected_targets))
        local_lengths = [samples[i].num_tokens for i in micro_batch.local[cp_rank]]
        assert packed.metadata.num_local_tokens == sum(local_lengths)
        assert packed.metadata.cu_seqlens_local.tolist() == [0, *np.cumsum(local_lengths).tolist()]
        assert packed.metadata.num_sharded_tokens == sum(
            padded_length(samples[i].num_tokens, cp_size) // cp_size for i in micro_batch.distributed
        )


@pytest.mark.parametrize("cp_size", [1, 2, 4])
def test_every_loss_token_is_trained_exactly_once(cp_size: int) -> None:
    samples, micro_batch = _samples(), _micro_batch(cp_size)
    packs = [pack_micro_batch(samples, micro_batch, cp_size=cp_size, cp_rank=r) for r in range(cp_size)]
    assert sum(p.num_loss_tokens for p in packs) == sum(s.num_loss_tokens for s in samples)


def test_loss_tokens_are_counted_on_the_host_while_packing() -> None:
    """Read from targets on a GPU, the count would stall the step at every micro-batch; on the meta device, which
    holds no values, reading it would raise."""
    pack = pack_micro_batch(_samples(), _micro_batch(2), cp_size=2, cp_rank=1)
    expected = int((pack.targets_T != IGNORE_INDEX).sum())
    assert pack.to(torch.device("meta")).num_loss_tokens == expected > 0


@pytest.mark.parametrize("cp_size", [1, 2, 4])
def test_kv_index_reads_each_chunks_causal_prefix_from_the_gathered_shards(cp_size: int) -> None:
    samples, micro_batch = _samples(), _micro_batch(cp_size)
    packs = [pack_micro_batch(samples, micro_batch, cp_size=cp_size, cp_rank=r) for r in range(cp_size)]
    # Tag every distributed token with (sequence slot, global position), gather rank-major as the all-gather does.
    tags = []
    for pack in packs:
        num_local = pack.metadata.num_local_tokens
        slot = np.repeat(np.arange(len(micro_batch.distributed)),
                         [padded_length(samples[i].num_tokens, cp_size) // cp_size for i in micro_batch.distributed])
        tags.append(np.stack([slot, pack.position_ids_T[num_local:].numpy()], axis=1))
    gathered = np.concatenate(tags)
    for pack in packs:
        (spec,) = pack.metadata.sharded
        assert spec.cp_ranks == tuple(range(cp_size)) and spec.group_rank == pack.metadata.cp_rank
        prefix_tags = gathered[spec.kv_index.numpy()]
        cu_k, cu_q = spec.cu_seqlens_k.tolist(), spec.cu_seqlens_q.tolist()
        positions = pack.position_ids_T[pack.metadata.num_local_tokens:].numpy()
        for chunk in range(len(cu_k) - 1):
            slot = chunk // 2
            chunk_tags = prefix_tags[cu_k[chunk]:cu_k[chunk + 1]]
            query_positions = positions[cu_q[chunk]:cu_q[chunk + 1]]
            np.testing.assert_array_equal(chunk_tags[:, 0], slot)
            # The prefix ends with the chunk itself: bottom-right causal alignment gives position p its p + 1 keys.
            np.testing.assert_array_equal(chunk_tags[:, 1], np.arange(query_positions[-1] + 1))


def test_empty_rank_packs_nothing() -> None:
    micro_batch = MicroBatch(local=((0,), ()), distributed=())
    packed = pack_micro_batch(_samples(), micro_batch, cp_size=2, cp_rank=1)
    assert packed.num_tokens == 0 and packed.input_ids_T.dtype == torch.int64
    assert not packed.metadata.sharded and packed.is_idle


BUCKETS = (64, 128, 256)


def test_a_row_is_padded_to_the_smallest_bucket_with_segments_of_the_bucket_s_shape() -> None:
    """Rows of one bucket differ in values only: as many tokens and local segments, the same longest segment."""
    samples = _samples()
    shapes = set()
    for local in ((0, 1), (2,), (4, 6, 1)):  # 22, 64 and 20 tokens: all the 64-token bucket
        packed = pack_micro_batch(samples, MicroBatch(local=(local,), distributed=()), cp_size=1, cp_rank=0)
        padded = pack_micro_batch(samples, MicroBatch(local=(local,), distributed=()), cp_size=1, cp_rank=0,
                                  token_buckets=BUCKETS)
        metadata = padded.metadata
        shapes.add((padded.num_tokens, metadata.cu_seqlens_local.numel(), metadata.max_seqlen_local))
        real = packed.num_tokens  # the sequences first, as packed; the padding predicts nothing
        assert torch.equal(padded.input_ids_T[:real], packed.input_ids_T)
        assert torch.equal(padded.targets_T[:real], packed.targets_T)
        assert (padded.targets_T[real:] == IGNORE_INDEX).all() and padded.num_loss_tokens == packed.num_loss_tokens
        lengths = metadata.cu_seqlens_local.diff().tolist()
        assert lengths[:len(local)] == [samples[i].num_tokens for i in local]
        pad_positions = padded.position_ids_T[real:].tolist()  # each padding segment counts its positions from 0
        assert pad_positions == [p for length in lengths[len(local):] for p in range(length)]
    assert shapes == {(64, bucket_segments(64) + 1, 64)}


def test_a_row_of_more_sequences_than_its_bucket_s_segments_takes_a_larger_bucket() -> None:
    samples = _samples(lengths=(1,) * 8)  # 8 one-token sequences: more than the 5 segments of a 64-token bucket
    padded = pack_micro_batch(samples, MicroBatch(local=(tuple(range(8)),), distributed=()), cp_size=1, cp_rank=0,
                              token_buckets=BUCKETS)
    assert padded.num_tokens == 128 and padded.metadata.cu_seqlens_local.numel() == bucket_segments(128) + 1


def test_a_row_of_more_sequences_than_any_bucket_s_segments_gets_the_segments_it_needs() -> None:
    samples = _samples(lengths=(1,) * 20)
    padded = pack_micro_batch(samples, MicroBatch(local=(tuple(range(20)),), distributed=()), cp_size=1, cp_rank=0,
                              token_buckets=(64,))
    assert padded.num_tokens == 64 and padded.metadata.cu_seqlens_local.numel() == 20 + 1 + 1  # + one of padding


def test_a_row_of_local_sequences_longer_than_the_largest_bucket_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"a micro-batch row of 100 tokens \(CP rank 0\) is longer than the largest "
                                         r"token bucket, 64"):
        pack_micro_batch(_samples(), MicroBatch(local=((5,),), distributed=()), cp_size=1, cp_rank=0,
                         token_buckets=(64,))


def test_a_row_past_the_largest_bucket_by_its_shards_rounding_runs_as_packed() -> None:
    """Zigzag chunks round a sharded sequence up: 17 tokens over CP 2 are 10 per rank, a token past the exact 8.5
    that the memory bound counts. Such a row runs collectives, which no graph holds: it stays as packed."""
    samples = _samples(lengths=(17, 55))
    micro_batch = MicroBatch(local=((1,), ()), distributed=(0,))
    packed = pack_micro_batch(samples, micro_batch, cp_size=2, cp_rank=0)
    padded = pack_micro_batch(samples, micro_batch, cp_size=2, cp_rank=0, token_buckets=(64,))
    assert packed.num_tokens == 65 and torch.equal(padded.input_ids_T, packed.input_ids_T)


def test_an_idle_row_is_not_padded() -> None:
    """The planner prices an idle rank at nothing; padded, it would run a bucket of padding."""
    padded = pack_micro_batch(_samples(), MicroBatch(local=((0,), ()), distributed=()), cp_size=2, cp_rank=1,
                              token_buckets=BUCKETS)
    assert padded.is_idle
