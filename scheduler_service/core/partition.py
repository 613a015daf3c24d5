"""Number partitioning: split weighted items into parts of near-equal total weight.

* ``lpt_parts`` (a kernel; ``lpt_partition`` as lists) — longest processing
  time first: heaviest item onto the lightest part; O(n log n + n log k),
  within 4/3 of optimal. The lightest part comes from a binary heap of
  (load, part) kept in two arrays (``replace_lightest``), which GDS's spread
  of a share over micro-batches uses too.
* ``karmarkar_karp`` — k-way largest differencing (KK): usually much closer to
  optimal than LPT, but it keeps k subsets per item, O(n·k) memory, so it
  hands over to LPT when n·k is large.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
from numba import types

from scheduler_service.core.jit import FLOAT_1D, INT_1D, kernel

__all__ = ["MAX_KARMARKAR_KARP_CELLS", "karmarkar_karp", "lpt_partition", "lpt_parts", "replace_lightest"]

MAX_KARMARKAR_KARP_CELLS = 1 << 18  # items × parts above which KK's memory and time are not worth it

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]


@kernel(types.boolean(FLOAT_1D, INT_1D, types.int64, types.int64))
def _lighter(loads: FloatArray, parts: IntArray, i: int, j: int) -> bool:
    """Whether heap entry ``i`` comes before entry ``j``: a lighter load, or an equal one and a smaller part."""
    return loads[i] < loads[j] or (loads[i] == loads[j] and parts[i] < parts[j])


@kernel(types.void(FLOAT_1D, INT_1D, types.float64))
def replace_lightest(loads: FloatArray, parts: IntArray, load: float) -> None:
    """Give the lightest part (the heap's root, ``parts[0]``) the new ``load`` and sift it down to its place. The
    heap orders (load, part) pairs, which are all distinct, so the lightest part is the same whatever the heap's
    shape: zero loads and ascending parts are a heap to start from."""
    loads[0] = load
    i = 0
    while 2 * i + 1 < loads.shape[0]:
        child = 2 * i + 1
        if child + 1 < loads.shape[0] and _lighter(loads, parts, child + 1, child):
            child += 1
        if not _lighter(loads, parts, child, i):
            break
        loads[i], loads[child] = loads[child], loads[i]
        parts[i], parts[child] = parts[child], parts[i]
        i = child


@kernel(INT_1D(FLOAT_1D, types.int64))
def lpt_parts(weights: FloatArray, num_parts: int) -> IntArray:
    """The part of each item: heaviest first (ties by position) onto the lightest part (ties by part number)."""
    part_of = np.empty(weights.shape[0], dtype=np.int64)
    loads, parts = np.zeros(num_parts), np.arange(num_parts)  # a heap of (load, part), lightest first
    for item in np.argsort(-weights, kind="mergesort"):
        part_of[item] = parts[0]
        replace_lightest(loads, parts, loads[0] + weights[item])
    return part_of


def lpt_partition(indices: Sequence[int], weights: Sequence[float], num_parts: int) -> list[list[int]]:
    """``lpt_parts`` of ``indices`` (weighted by ``weights[index]``, ties by index), each part's indices ascending."""
    items = np.sort(np.asarray(indices, dtype=np.int64))
    part_of = lpt_parts(np.ascontiguousarray(np.asarray(weights, dtype=np.float64)[items]), num_parts)
    by_part = items[np.argsort(part_of, kind="stable")]
    return [part.tolist() for part in np.split(by_part, np.cumsum(np.bincount(part_of, minlength=num_parts))[:-1])]


def karmarkar_karp(indices: Sequence[int], weights: Sequence[int], num_parts: int) -> list[list[int]]:
    """Repeatedly merge the two partial partitions with the largest spread, pairing the heaviest subset of
    one with the lightest of the other; LPT when ``len(indices) × num_parts`` exceeds the memory cap."""
    if len(indices) * num_parts > MAX_KARMARKAR_KARP_CELLS:
        return lpt_partition(indices, weights, num_parts)
    if not indices:
        return [[] for _ in range(num_parts)]
    heap: list[tuple[int, int, list[tuple[int, list[int]]]]] = []
    for counter, index in enumerate(indices):
        subsets = [(int(weights[index]), [index])] + [(0, []) for _ in range(num_parts - 1)]
        heapq.heappush(heap, (-int(weights[index]), counter, subsets))
    counter = len(indices)
    while len(heap) > 1:
        _, _, first = heapq.heappop(heap)
        _, _, second = heapq.heappop(heap)
        first.sort(key=lambda subset: -subset[0])
        second.sort(key=lambda subset: subset[0])
        merged = [(a[0] + b[0], a[1] + b[1]) for a, b in zip(first, second, strict=True)]
        spread = max(s for s, _ in merged) - min(s for s, _ in merged)
        counter += 1
        heapq.heappush(heap, (-spread, counter, merged))
    return [sorted(members) for _, members in heap[0][2]]
