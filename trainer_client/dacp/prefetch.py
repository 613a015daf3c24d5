"""Micro-batches packed (and copied to the device) one ahead of the compute, off the step's critical path.

A step runs its micro-batches in order. ``PrefetchedMicroBatches`` packs micro-batch
``i + 1`` (``packing.py``: numpy indexing and concatenation, the zigzag shards and
the attention metadata) in a background thread while micro-batch ``i`` computes;
on CUDA that thread also pins the packed tensors and copies them host → device on
a side stream (``non_blocking``), and the compute stream waits for that copy only
when it reaches ``i + 1``. The thread first makes the rank's GPU its current device:
that setting is per thread, and a thread left on GPU 0 would put a CUDA context of
every rank there. On CPU there is nothing to copy and nothing is pinned.

Packing holds the GIL for its numpy calls while torch's kernels release it, so the
overlap is real wherever a core is free for the thread (a GPU host: the CPU only
launches kernels); 4 CPU ranks on 2 cores have none to spare. Packing touches no
process group, so running it in a thread changes no collective order.

The micro-batches come out in plan order and are exactly what packing them in the
step itself gives, so numerics do not change; an exception raised while packing
is re-raised by the step where that micro-batch would have run.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import TracebackType

import torch

from trainer_client.dacp.packing import PackedMicroBatch

__all__ = ["PrefetchedMicroBatches"]

_POLL_S = 0.1  # how often a producer waiting for a free slot checks whether the consumer closed


@dataclass(frozen=True, slots=True)
class _Staged:
    pack: PackedMicroBatch
    copied: torch.cuda.Event | None  # recorded on the copy stream after the host → device copy; None on CPU


@dataclass(frozen=True, slots=True)
class _Failed:
    error: Exception


class PrefetchedMicroBatches:
    """The micro-batches ``packers`` make, in order, each made at most ``depth`` ahead of the one being consumed.

    Iterate once, inside ``with`` (or call ``close``): leaving early stops the thread after its current packer.
    """

    def __init__(self, packers: Sequence[Callable[[], PackedMicroBatch]], device: torch.device, *,
                 depth: int = 1) -> None:
        if depth < 1:
            raise ValueError(f"prefetch depth must be at least 1, got {depth}")
        self._num_packers = len(packers)
        self._device = device
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._ready: queue.Queue[_Staged | _Failed] = queue.Queue()
        self._slots = threading.Semaphore(depth)  # a slot per micro-batch made and not yet taken by the consumer
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._produce, args=(packers,), name="prefetch-micro-batches",
                                        daemon=True)
        self._thread.start()

    def __len__(self) -> int:
        return self._num_packers

    def __iter__(self) -> Iterator[PackedMicroBatch]:
        for _ in range(self._num_packers):
            staged = self._ready.get()
            self._slots.release()  # the consumer starts on this one: the thread may make the next
            if isinstance(staged, _Failed):
                raise staged.error
            if staged.copied is not None:
                compute = torch.cuda.current_stream(self._device)
                compute.wait_event(staged.copied)
                # Made on the copy stream, used on the compute stream: keep the allocator from reusing the memory
                # while the compute stream may still read it.
                staged.pack.record_stream(compute)
            yield staged.pack

    def close(self) -> None:
        self._closed.set()
        self._thread.join()

    def __enter__(self) -> PrefetchedMicroBatches:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()

    def _produce(self, packers: Sequence[Callable[[], PackedMicroBatch]]) -> None:
        if self._copy_stream is not None:
            # CUDA's current device is per thread and starts at GPU 0: without this, every rank's copies would
            # make a CUDA context on GPU 0 (about 0.5 GB each) however its own device was chosen.
            torch.cuda.set_device(self._device)
        for packer in packers:
            while not self._slots.acquire(timeout=_POLL_S):
                if self._closed.is_set():
                    return
            if self._closed.is_set():
                return
            try:
                self._ready.put(self._stage(packer()))
            except Exception as error:  # re-raised by the consumer, where this micro-batch would have run
                self._ready.put(_Failed(error))
                return

    def _stage(self, pack: PackedMicroBatch) -> _Staged:
        if self._copy_stream is None:
            return _Staged(pack.to(self._device), None)
        with torch.cuda.stream(self._copy_stream):
            on_device = pack.pin_memory().to(self._device, non_blocking=True)
        return _Staged(on_device, self._copy_stream.record_event())
