"""Prefetched micro-batches are the packed ones, in order; a packing error reaches the step; closing stops it."""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from unittest import mock

import numpy as np
import pytest
import torch

from scheduler_service.core.plan import MicroBatch, ShardedGroup
from trainer_client.dacp.packing import PackedMicroBatch, pack_micro_batch, padding_micro_batch
from trainer_client.dacp.prefetch import PrefetchedMicroBatches
from trainer_client.data import IGNORE_INDEX, Sample

CP_SIZE = 4
LENGTHS = (5, 17, 64, 33, 1, 100, 2, 48)
MICRO_BATCHES = (
    MicroBatch(local=((0,), (1, 4), (), (6,)), distributed=(5,)),
    MicroBatch(local=((),) * CP_SIZE, distributed=(2, 3)),
    MicroBatch(local=((7,), (), (), ()), distributed=(),
               sharded=(ShardedGroup(cp_ranks=(0, 1), sequences=(3,)), ShardedGroup(cp_ranks=(2, 3), sequences=(2,)))),
)


def _samples() -> list[Sample]:
    rng = np.random.default_rng(0)
    samples = []
    for length in LENGTHS:
        input_ids = rng.integers(1, 1000, size=length, dtype=np.int64)
        samples.append(Sample(input_ids=input_ids, labels=np.where(rng.random(length) < 0.2, IGNORE_INDEX, input_ids)))
    return samples


def _packers(cp_rank: int) -> list[Callable[[], PackedMicroBatch]]:
    samples = _samples()
    padding = padding_micro_batch(cp_size=CP_SIZE, cp_rank=cp_rank)
    return [functools.partial(pack_micro_batch, samples, micro_batch, cp_size=CP_SIZE, cp_rank=cp_rank)
            for micro_batch in MICRO_BATCHES] + [lambda: padding]


def _tensors(pack: PackedMicroBatch) -> list[torch.Tensor]:
    tensors: list[torch.Tensor] = []
    pack.map_tensors(lambda tensor: tensors.append(tensor) or tensor)
    return tensors


@pytest.mark.parametrize("cp_rank", range(CP_SIZE))
@pytest.mark.parametrize("depth", [1, 3])
def test_prefetched_micro_batches_equal_the_packed_ones_in_order(cp_rank: int, depth: int) -> None:
    plain = [packer() for packer in _packers(cp_rank)]
    with PrefetchedMicroBatches(_packers(cp_rank), torch.device("cpu"), depth=depth) as prefetched:
        assert len(prefetched) == len(plain)
        got = list(prefetched)
    assert len(got) == len(plain)
    for a, b in zip(got, plain, strict=True):
        assert (a.is_padding, a.num_tokens, a.num_loss_tokens) == (b.is_padding, b.num_tokens, b.num_loss_tokens)
        assert (a.metadata.num_local_tokens, a.metadata.max_seqlen_local) == (b.metadata.num_local_tokens,
                                                                            b.metadata.max_seqlen_local)
        assert [(s.cp_ranks, s.num_tokens, s.max_seqlen_q, s.max_seqlen_k) for s in a.metadata.sharded] == [
            (s.cp_ranks, s.num_tokens, s.max_seqlen_q, s.max_seqlen_k) for s in b.metadata.sharded]
        tensors_a, tensors_b = _tensors(a), _tensors(b)
        assert len(tensors_a) == len(tensors_b)
        for x, y in zip(tensors_a, tensors_b, strict=True):
            assert x.dtype == y.dtype and torch.equal(x, y)


def test_packs_at_most_depth_ahead_of_the_consumer() -> None:
    made: list[int] = []
    packers = [functools.partial(lambda index: made.append(index) or padding_micro_batch(cp_size=1, cp_rank=0), i)
               for i in range(6)]
    with PrefetchedMicroBatches(packers, torch.device("cpu"), depth=2) as prefetched:
        for consumed, _ in enumerate(prefetched, start=1):
            assert len(made) <= consumed + 2
    assert made == list(range(6))


def test_a_packing_error_is_raised_where_its_micro_batch_would_run() -> None:
    def broken() -> PackedMicroBatch:
        raise ValueError("record data.jsonl:7 is broken")

    packers = [*_packers(0)[:2], broken, *_packers(0)[2:]]
    consumed = 0
    with pytest.raises(ValueError, match=r"record data\.jsonl:7 is broken"), \
            PrefetchedMicroBatches(packers, torch.device("cpu")) as prefetched:
        for _ in prefetched:
            consumed += 1
    assert consumed == 2


def test_leaving_early_stops_the_thread() -> None:
    made: list[int] = []
    packers = [functools.partial(lambda index: made.append(index) or padding_micro_batch(cp_size=1, cp_rank=0), i)
               for i in range(50)]
    threads_before = threading.active_count()
    with PrefetchedMicroBatches(packers, torch.device("cpu")) as prefetched:
        next(iter(prefetched))
    assert threading.active_count() == threads_before
    assert len(made) <= 2  # the one consumed and at most one ahead


class _FakeCuda:
    """torch.cuda as the prefetch thread uses it, recording which device each thread has made current when it
    enters a stream: CUDA's current device is per thread, and starts at GPU 0."""

    def __init__(self) -> None:
        self.current = threading.local()
        self.stream_entered_on: list[int | None] = []

    def set_device(self, device: torch.device) -> None:
        self.current.index = device.index

    @contextlib.contextmanager
    def stream(self, stream: object) -> Iterator[None]:
        self.stream_entered_on.append(getattr(self.current, "index", None))
        yield


class _Staged:
    """A packed micro-batch's stand-in: what staging calls on it, and nothing else."""

    def pin_memory(self) -> _Staged:
        return self

    def to(self, device: torch.device, *, non_blocking: bool = False) -> _Staged:
        return self

    def record_stream(self, stream: object) -> None:
        pass


def test_the_copy_thread_makes_the_ranks_gpu_its_current_device(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _FakeCuda()
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: mock.Mock(record_event=mock.Mock()))
    monkeypatch.setattr(torch.cuda, "stream", fake.stream)
    monkeypatch.setattr(torch.cuda, "set_device", fake.set_device)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: mock.Mock())
    packers = [_Staged] * 3
    with PrefetchedMicroBatches(packers, torch.device("cuda", 3)) as prefetched:  # type: ignore[arg-type]
        assert len(list(prefetched)) == 3
    assert fake.stream_entered_on == [3, 3, 3]  # not GPU 0, where a context of every rank would pile up
