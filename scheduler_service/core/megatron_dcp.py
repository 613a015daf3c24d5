"""Megatron-LM's dynamic-CP packing scheduler, ported line for line: the baseline ``dynamic_cp`` plans with it.

The original is on Megatron-LM's dev branch at commit ``d48bd6be0a85cc0d6d3cc71e8750cf357cc6bdb1`` (21 August
2026): ``DefaultDynamicCPScheduler.get_groups_and_subsamples`` in ``megatron/core/datasets/data_schedule.py``, which
calls ``next_hdp_group_packing_aware`` and ``dcp_gpus_needed`` in ``megatron/core/datasets/data_schedule_utils.py``
(the packing-aware choice of the CP group size, Megatron-LM #5154). The names are Megatron's; the port leaves out
only the virtual-pipeline alignment (``align_sample_id_groups``, used when ``microbatch_group_size_per_vp_stage >
1``), which plain data and context parallelism never call. ``tests/test_megatron_dcp.py`` holds it, output for
output, to schedules the original code produced (``tests/fixtures/megatron/``, with the script that recorded them).

What the scheduler does, per micro-batch (a "round" over every rank of the DP × CP pool, ``total_gpus`` of them):

1. The sequences still to place, longest first (a stable sort: equal lengths keep their order). The longest opens
   a group of its minimum CP size ``dcp_gpus_needed`` (the next power of two of ``length / max_seq_len_per_rank``,
   at least ``min_cp_size``) on ranks ``0 .. size−1``. Its workload ``length² / size`` per member rank; the round's
   cap is ``1.05 × longest × max_seq_len_per_rank``.
2. Each next sequence tries every size from its minimum, doubling up to the pool: "add" to an open group of that
   size whose per-rank packed length stays within ``max_seq_len_per_rank``, and "new" on the free ranks with the
   least work (the lowest free ranks: free ranks have none). It takes the candidate with the lowest projected
   heaviest rank of the whole pool, if within the cap; ties keep the first found (the smaller size, "add" before
   "new", groups in the order they were opened). What no candidate takes waits for the next round.
3. While ranks are empty, the first of the smallest groups that can grow is doubled (to the next power, at most the
   pool) and the ranks after it pushed back. Where none can, the round is rebuilt as one group of the whole pool:
   the sequences, longest first, that fit ``max_seq_len_per_rank`` per rank, the others waiting.

Its output, as Megatron's: per micro-batch, per DP × CP rank, the sample ids the rank packs (a sequence on a group
of ``s`` ranks appears in each member's list).
"""

from __future__ import annotations

from math import ceil, log2

__all__ = ["dcp_gpus_needed", "get_groups_and_subsamples", "next_hdp_group_packing_aware"]

_DYNAMIC_CP_WORKLOAD_CAP_DELTA = 0.05

SampleSeqlen = tuple[int, int]  # (sample id, sequence length)


def dcp_gpus_needed(seq_len: int, max_seq_len_per_rank: int, min_cp_size: int = 1) -> int:
    """Number of GPUs needed, rounded up to the next power of 2, lower-bounded by ``min_cp_size``."""
    raw = max(1, 2 ** ceil(log2(seq_len / max_seq_len_per_rank)))
    return max(min_cp_size, raw)


def next_hdp_group_packing_aware(
    sample_seqlens: list[SampleSeqlen],
    total_gpus: int,
    max_seq_len_per_rank: int,
    min_cp_size: int = 1,
) -> tuple[list[list[int]], list[SampleSeqlen], list[float], list[list[int]]]:
    """One micro-batch (module docstring, steps 1–3): per rank its sequence lengths, the sequences left for later
    rounds, per rank its workload, and per rank its sample ids."""
    if not sample_seqlens:
        return [[] for _ in range(total_gpus)], [], [0.0] * total_gpus, [[] for _ in range(total_gpus)]

    def cp_min_fn(seq_len: int) -> int:
        return dcp_gpus_needed(seq_len, max_seq_len_per_rank, min_cp_size)

    def workload(seq_len: int, cp_size: int) -> float:
        return (seq_len * seq_len) / cp_size

    sample_seqlens = sorted(sample_seqlens, key=lambda x: x[1], reverse=True)
    local_tall = sample_seqlens[0][1]
    cap = float(local_tall) * float(max_seq_len_per_rank) * (1.0 + _DYNAMIC_CP_WORKLOAD_CAP_DELTA)

    micro_batches: list[list[int]] = [[] for _ in range(total_gpus)]
    exec_times: list[float] = [0.0] * total_gpus
    sample_ids_per_gpu: list[list[int]] = [[] for _ in range(total_gpus)]
    packing_sequence_len: dict[int, float] = {}
    gpu_group_id: list[int | None] = [None] * total_gpus
    group_members: dict[int, list[int]] = {}
    group_size: dict[int, int] = {}
    next_gid = 0

    def place(group_id: int, members: list[int], sample_id: int, seq_len: int, cp_size: int) -> None:
        per_gpu_cost = workload(seq_len, cp_size)
        for rank in members:
            gpu_group_id[rank] = group_id
            micro_batches[rank].append(seq_len)
            exec_times[rank] += per_gpu_cost
            sample_ids_per_gpu[rank].append(sample_id)

    # step 1: the longest sequence opens a group of its minimum size on the first ranks
    sample_id, seq_len = sample_seqlens[0]
    cp_size = cp_min_fn(seq_len)
    if cp_size > total_gpus:
        raise ValueError(f"Sequence length {seq_len} requires CP size {cp_size}, "
                         f"but only {total_gpus} DPxCP ranks are available.")
    group_members[next_gid] = list(range(cp_size))
    group_size[next_gid] = cp_size
    packing_sequence_len[next_gid] = seq_len / cp_size
    place(next_gid, group_members[next_gid], sample_id, seq_len, cp_size)
    next_gid += 1

    # step 2: each next sequence at the size and group that keep the heaviest rank lightest, within the cap
    leftovers: list[SampleSeqlen] = []
    for sample_id, seq_len in sample_seqlens[1:]:
        best: tuple[float, int, str, int | None, list[int] | None] | None = None
        cp_size = cp_min_fn(seq_len)
        while cp_size <= total_gpus:
            per_gpu_cost = workload(seq_len, cp_size)
            for group_id, size in list(group_size.items()):
                if size != cp_size:
                    continue
                if packing_sequence_len.get(group_id, 0) + seq_len / cp_size > max_seq_len_per_rank:
                    continue
                member_set = set(group_members[group_id])
                projected_max = max(time + per_gpu_cost if rank in member_set else time
                                    for rank, time in enumerate(exec_times))
                if projected_max <= cap and (best is None or projected_max < best[0]):
                    best = (projected_max, cp_size, "add", group_id, None)
            free_ranks = [rank for rank, assigned in enumerate(gpu_group_id) if assigned is None]
            if len(free_ranks) >= cp_size:
                chosen_members = sorted(free_ranks, key=lambda rank: exec_times[rank])[:cp_size]
                chosen_set = set(chosen_members)
                projected_max = max(time + per_gpu_cost if rank in chosen_set else time
                                    for rank, time in enumerate(exec_times))
                if projected_max <= cap and (best is None or projected_max < best[0]):
                    best = (projected_max, cp_size, "new", None, chosen_members)
            cp_size *= 2
        if best is None:
            leftovers.append((sample_id, seq_len))
            continue
        _, selected_cp_size, action, chosen_group, new_members = best
        if action == "add":
            assert chosen_group is not None
            packing_sequence_len[chosen_group] += seq_len / selected_cp_size
            place(chosen_group, group_members[chosen_group], sample_id, seq_len, selected_cp_size)
        else:
            assert new_members is not None
            group_members[next_gid] = new_members
            group_size[next_gid] = selected_cp_size
            packing_sequence_len[next_gid] = seq_len / selected_cp_size
            place(next_gid, new_members, sample_id, seq_len, selected_cp_size)
            next_gid += 1

    # step 3: fill empty ranks by doubling the smallest groups, else one group of the whole pool
    def fill_empty_gpus_once() -> bool:
        nonlocal micro_batches, exec_times, sample_ids_per_gpu
        empty_ranks = [rank for rank, micro_batch in enumerate(micro_batches) if not micro_batch]
        if not empty_ranks:
            return False
        assert all(not micro_batches[rank] for rank in range(empty_ranks[0], total_gpus)), \
            "fill_empty_gpus_once assumes empty ranks are contiguous at the tail"
        if not group_size:
            return False
        min_group_size = min(group_size.values())
        next_power = min(min_group_size * 2, total_gpus)
        for group_id, size in list(group_size.items()):
            if size != min_group_size:
                continue
            members = group_members[group_id]
            needed_count = next_power - min_group_size
            group_start_rank, group_end_rank = members[0], members[-1]
            empty_rank = empty_ranks[0]
            if group_end_rank + 1 > empty_rank or group_end_rank + needed_count >= total_gpus:
                continue
            pushed = range(group_end_rank + 1, empty_rank)
            new_micro_batches: list[list[int]] = [[] for _ in range(total_gpus)]
            new_exec_times: list[float] = [0.0] * total_gpus
            new_sample_ids_per_gpu: list[list[int]] = [[] for _ in range(total_gpus)]
            for rank in range(group_start_rank):
                new_micro_batches[rank] = micro_batches[rank]
                new_exec_times[rank] = exec_times[rank]
                new_sample_ids_per_gpu[rank] = sample_ids_per_gpu[rank]
            for rank in range(group_start_rank, group_end_rank + needed_count + 1):
                new_micro_batches[rank] = list(micro_batches[group_end_rank])
                new_exec_times[rank] = sum(workload(length, next_power) for length in micro_batches[group_end_rank])
                new_sample_ids_per_gpu[rank] = list(sample_ids_per_gpu[group_end_rank])
            for offset, rank in enumerate(pushed):
                target_rank = group_end_rank + needed_count + 1 + offset
                new_micro_batches[target_rank] = micro_batches[rank]
                new_exec_times[target_rank] = exec_times[rank]
                new_sample_ids_per_gpu[target_rank] = sample_ids_per_gpu[rank]
            group_size[group_id] = next_power
            group_members[group_id] = list(range(group_start_rank, group_end_rank + needed_count + 1))
            for other_group_id in list(group_size):
                if other_group_id != group_id and min(group_members[other_group_id]) > group_end_rank:
                    group_members[other_group_id] = [rank + needed_count for rank in group_members[other_group_id]]
            micro_batches, exec_times, sample_ids_per_gpu = new_micro_batches, new_exec_times, new_sample_ids_per_gpu
            return True
        return False

    def fill_with_full_dpxcp_group() -> None:
        nonlocal micro_batches, exec_times, sample_ids_per_gpu, leftovers
        selected: list[SampleSeqlen] = []
        next_leftovers: list[SampleSeqlen] = []
        packed_sequence_len = 0.0
        for sample_id, seq_len in sample_seqlens:
            per_rank_len = seq_len / total_gpus
            if packed_sequence_len + per_rank_len <= max_seq_len_per_rank:
                selected.append((sample_id, seq_len))
                packed_sequence_len += per_rank_len
            else:
                next_leftovers.append((sample_id, seq_len))
        if not selected:
            raise ValueError("At least one sequence should fit in the full DPxCP group; "
                             "try to increase 'max-seqlen-per-dp-cp-rank'.")
        per_rank_work = sum(workload(seq_len, total_gpus) for _, seq_len in selected)
        micro_batches = [[seq_len for _, seq_len in selected] for _ in range(total_gpus)]
        exec_times = [per_rank_work] * total_gpus
        sample_ids_per_gpu = [[sample_id for sample_id, _ in selected] for _ in range(total_gpus)]
        leftovers = next_leftovers

    while any(not micro_batch for micro_batch in micro_batches):
        if not fill_empty_gpus_once():
            fill_with_full_dpxcp_group()
            break

    return micro_batches, leftovers, exec_times, sample_ids_per_gpu


def get_groups_and_subsamples(sample_id_seqlens: list[SampleSeqlen], total_hdp_gpus: int, max_seq_len_per_rank: int,
                              min_cp_size: int = 1) -> list[list[list[int]]]:
    """``DefaultDynamicCPScheduler.get_groups_and_subsamples``: micro-batches until every sequence is placed, each
    per DP × CP rank the sample ids it packs."""
    sample_id_groups: list[list[list[int]]] = []
    sample_id_seqlens = sorted(sample_id_seqlens, key=lambda x: x[1], reverse=True)
    while sample_id_seqlens:
        _, sample_id_seqlens, _, sample_ids = next_hdp_group_packing_aware(
            sample_id_seqlens, total_hdp_gpus, max_seq_len_per_rank=max_seq_len_per_rank, min_cp_size=min_cp_size)
        sample_id_groups.append(sample_ids)
    return sample_id_groups
