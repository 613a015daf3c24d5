"""Number partitioning: split weighted items into parts of near-equal total weight.

* ``lpt_partition`` — longest processing time first: heaviest item onto the
  lightest part; O(n log n + n log k), within 4/3 of optimal.
* ``karmarkar_karp`` — k-way largest differencing (KK): usually much closer to
  optimal than LPT, but it keeps k subsets per item, O(n·k) memory, so it
  hands over to LPT when n·k is large.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

__all__ = ["MAX_KARMARKAR_KARP_CELLS", "karmarkar_karp", "lpt_partition"]

MAX_KARMARKAR_KARP_CELLS = 1 << 18  # items × parts above which KK's memory and time are not worth it


def lpt_partition(indices: Sequence[int], weights: Sequence[float], num_parts: int) -> list[list[int]]:
    """Heaviest item onto the lightest part (ties by part index); parts keep that order of arrival."""
    parts: list[list[int]] = [[] for _ in range(num_parts)]
    heap = [(0.0, part) for part in range(num_parts)]
    items = np.asarray(indices, dtype=np.int64)
    for index in items[np.lexsort((items, -np.asarray(weights, dtype=np.float64)[items]))].tolist():
        load, part = heap[0]
        parts[part].append(index)
        heapq.heapreplace(heap, (load + weights[index], part))
    return parts


def karmarkar_karp(indices: Sequence[int], weights: Sequence[int], num_parts: int) -> list[list[int]]:
    """Repeatedly merge the two partial partitions with the largest spread, pairing the heaviest subset of
    one with the lightest of the other; LPT when ``len(indices) × num_parts`` exceeds the memory cap."""
    if len(indices) * num_parts > MAX_KARMARKAR_KARP_CELLS:
        return [sorted(part) for part in lpt_partition(indices, weights, num_parts)]
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
