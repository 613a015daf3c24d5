"""The Hugging Face Trainer's length-aware samplers, ported for the baselines ``group_by_length`` and
``batch_rebalance``.

From transformers 5.23.0 (``transformers/trainer_pt_utils.py``), with transformers' names:

* ``get_length_grouped_indices`` — what ``TrainingArguments(train_sampling_strategy="group_by_length")`` (formerly
  ``group_by_length=True``) samples with: the indices randomly permuted, cut into mega-batches of ``mega_batch_mult ×
  batch_size`` (50, or as many as make 4 mega-batches, whichever is smaller), each sorted by length descending, and
  the longest element of all moved to the front. The Trainer builds it with ``batch_size = train_batch_size ×
  gradient_accumulation_steps``. The port takes the permutation as an argument (``indices``) where transformers
  draws it with ``torch.randperm``: the core has no torch, and the planner's batch comes already shuffled.
* ``BatchRebalanceSampler`` (``train_sampling_strategy="batch_rebalance"``, transformers #47340) — per optimizer
  step, the step's ``effective_batch_size`` sequences sorted by length descending and cut into ``K = dp_size ×
  grad_accum`` contiguous groups whose sizes a hill climb moves one sample at a time from the costliest group to the
  cheapest, under the cost ``bs · max_len + 0.001 · bs · max_len²`` of a padded micro-batch; the groups, costliest
  first, are dealt so that slot ``k`` of every rank gets the groups ranked ``[k·dp_size, (k+1)·dp_size)``. The port
  is the class's assignment of one global batch (``_assign`` and what it calls), without its epoch loop.

``tests/test_hf_samplers.py`` holds both to the installed transformers' own functions, output for output.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["BatchRebalanceSampler", "batch_rebalance_groups", "get_length_grouped_indices"]


def get_length_grouped_indices(lengths: Sequence[int], batch_size: int, indices: Sequence[int],
                               mega_batch_mult: int | None = None) -> list[int]:
    """``transformers.trainer_pt_utils.get_length_grouped_indices`` with its random permutation given as
    ``indices``: each slice of ``batch_size`` consecutive indices holds elements of similar lengths, the longest
    element of all first."""
    if mega_batch_mult is None:
        mega_batch_mult = min(len(lengths) // (batch_size * 4), 50)
        if mega_batch_mult == 0:
            mega_batch_mult = 1
    megabatch_size = mega_batch_mult * batch_size
    megabatches = [list(indices[i:i + megabatch_size]) for i in range(0, len(lengths), megabatch_size)]
    megabatches = [sorted(megabatch, key=lambda i: lengths[i], reverse=True) for megabatch in megabatches]
    megabatch_maximums = [lengths[megabatch[0]] for megabatch in megabatches]
    max_idx = megabatch_maximums.index(max(megabatch_maximums))  # torch.argmax: the first of the largest
    megabatches[0][0], megabatches[max_idx][0] = megabatches[max_idx][0], megabatches[0][0]
    return [i for megabatch in megabatches for i in megabatch]


Pair = tuple[int, int]  # (sample index, length)


class BatchRebalanceSampler:
    """``transformers.trainer_pt_utils.BatchRebalanceSampler``'s assignment of one global batch (module docstring);
    ``_assign(indices, lengths)`` gives, per DP rank, its ``grad_accum`` micro-batches of sample indices."""

    QUADRATIC_COST_COEF = 0.001  # weight of the attention's O(L²) term in the cost model

    def __init__(self, *, effective_batch_size: int, dp_size: int, grad_accum: int) -> None:
        if dp_size < 1 or grad_accum < 1 or effective_batch_size < dp_size * grad_accum:
            raise ValueError(f"BatchRebalanceSampler needs dp_size >= 1, grad_accum >= 1 and effective_batch_size "
                             f">= dp_size × grad_accum; got {effective_batch_size}, {dp_size}, {grad_accum}")
        self.effective_batch_size = effective_batch_size
        self.dp_size = dp_size
        self.grad_accum = grad_accum

    def _cost(self, bs: int, max_len: int) -> float:
        return bs * max_len + self.QUADRATIC_COST_COEF * bs * max_len * max_len

    def _group_cost(self, group: Sequence[Pair]) -> float:
        if not group:
            return 0.0
        return self._cost(len(group), group[0][1])

    def _groups_costs_from(self, counts: Sequence[int],
                           sorted_pairs: Sequence[Pair]) -> tuple[list[list[Pair]], list[float]]:
        groups: list[list[Pair]] = []
        idx = 0
        for count in counts:
            groups.append(list(sorted_pairs[idx:idx + count]))
            idx += count
        return groups, [self._group_cost(group) for group in groups]

    def _assign(self, indices: Sequence[int], lengths: Sequence[int]) -> list[list[list[int]]]:
        """Per rank, per accumulation slot, the sample indices of its micro-batch (the snake deal of the balanced
        groups, costliest first)."""
        sorted_pairs = sorted(zip(indices, lengths, strict=True), key=lambda x: x[1], reverse=True)
        all_groups = self._balance_groups(sorted_pairs)
        group_costs = [(i, self._group_cost(group)) for i, group in enumerate(all_groups)]
        group_costs.sort(key=lambda x: x[1], reverse=True)
        rank_mbs: list[list[list[int]]] = [[[] for _ in range(self.grad_accum)] for _ in range(self.dp_size)]
        for slot_idx in range(self.grad_accum):
            slot_start = slot_idx * self.dp_size
            for rank in range(self.dp_size):
                g_idx = group_costs[slot_start + rank][0]
                rank_mbs[rank][slot_idx] = [idx for idx, _ in all_groups[g_idx]]
        return rank_mbs

    def _balance_groups(self, sorted_pairs: Sequence[Pair]) -> list[list[Pair]]:
        """``K`` contiguous groups of ``sorted_pairs`` (longest first) of near-equal cost: each step moves one sample
        from the costliest active group to the cheapest that can take it; a state seen before ends the climb, the
        lowest-spread state seen is kept, and a costliest group down to one sample freezes its slot."""
        n = len(sorted_pairs)
        num_groups = self.dp_size * self.grad_accum
        min_per_group = 1
        if n < num_groups * min_per_group:
            raise ValueError(f"Not enough samples ({n}) to fill {num_groups} groups with at least {min_per_group} "
                             f"sample(s) each. Reduce effective_batch_size or increase the dataset size.")
        base, remainder = divmod(n, num_groups)
        counts = [base + (1 if i < remainder else 0) for i in range(num_groups)]
        frozen: set[int] = set()
        seen: set[tuple[int, ...]] = set()
        best_spread = float("inf")
        best_counts = list(counts)
        for _ in range(max(num_groups * 30, self.effective_batch_size)):
            key = tuple(counts)
            if key in seen:
                break
            seen.add(key)
            _, costs = self._groups_costs_from(counts, sorted_pairs)
            active = [i for i in range(num_groups) if i not in frozen]
            if len(active) <= 1:
                break
            active_costs = [costs[i] for i in active]
            spread = max(active_costs) - min(active_costs)
            if spread < best_spread:
                best_spread = spread
                best_counts = list(counts)
            hi_idx = max(active, key=lambda i: costs[i])
            if costs[hi_idx] == costs[min(active, key=lambda i: costs[i])]:
                break
            transferred = False
            for lo_idx in sorted(active, key=lambda i: costs[i]):
                if lo_idx == hi_idx or costs[lo_idx] == costs[hi_idx]:
                    continue
                if counts[hi_idx] > min_per_group:
                    counts[hi_idx] -= 1
                    counts[lo_idx] += 1
                    transferred = True
                    break
            if not transferred:
                if counts[hi_idx] > min_per_group:
                    break
                slot_members = self._slot_groups(costs, hi_idx)
                self._relieve_and_freeze(counts, slot_members, hi_idx, frozen, sorted_pairs, costs[hi_idx])
        groups, _ = self._groups_costs_from(best_counts, sorted_pairs)
        return groups

    def _slot_groups(self, costs: Sequence[float], pivot_idx: int) -> set[int]:
        """The groups that share ``pivot_idx``'s slot."""
        cost_ranking = sorted(range(len(costs)), key=lambda i: costs[i], reverse=True)
        slot_start = cost_ranking.index(pivot_idx) // self.dp_size * self.dp_size
        return set(cost_ranking[slot_start:min(slot_start + self.dp_size, len(costs))])

    def _relieve_and_freeze(self, counts: list[int], slot_members: set[int], pivot_idx: int, frozen: set[int],
                            sorted_pairs: Sequence[Pair], cap_cost: float) -> None:
        """Top up the slot's other groups from the cheapest outside groups, never above ``cap_cost`` (the slot's
        peak), then freeze the slot."""
        num_groups = len(counts)
        for gi in slot_members:
            if gi in frozen or gi == pivot_idx:
                continue
            while True:
                _, costs_now = self._groups_costs_from(counts, sorted_pairs)
                idx_start = sum(counts[:gi])
                gi_max_len = sorted_pairs[idx_start][1] if counts[gi] > 0 else 0
                if self._cost(counts[gi] + 1, gi_max_len) > cap_cost:
                    break
                donors = [i for i in range(num_groups) if i not in frozen and i not in slot_members and counts[i] > 1]
                if not donors:
                    break
                donor = min(donors, key=lambda i: costs_now[i])
                counts[gi] += 1
                counts[donor] -= 1
        frozen.update(slot_members)


def batch_rebalance_groups(lengths: Sequence[int], *, dp_size: int, grad_accum: int) -> list[list[list[int]]]:
    """``BatchRebalanceSampler``'s assignment of one global batch of ``lengths`` (sample ``i`` has ``lengths[i]``
    tokens): per DP rank, per accumulation slot, the sample indices of its micro-batch."""
    sampler = BatchRebalanceSampler(effective_batch_size=len(lengths), dp_size=dp_size, grad_accum=grad_accum)
    return sampler._assign(range(len(lengths)), lengths)
