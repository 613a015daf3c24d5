"""The closed sets and caps a planning request names, in a module that imports nothing: the schedulers and the
number of token buckets. ``core.plan`` validates requests with them; the trainer's configuration declares its flags
with them without loading numpy, numba and the schedulers (its ``--help`` answers in a fraction of a second).
"""

from __future__ import annotations

from enum import StrEnum

__all__ = ["MAX_TOKEN_BUCKETS", "CollectiveScheme", "SchedulerName"]

MAX_TOKEN_BUCKETS = 8  # BucketSize down to 1/128 of it: more buckets capture more graphs for little padding saved


class SchedulerName(StrEnum):
    SKRULL = "skrull"
    SKRULL_BINARY = "skrull_binary"
    SKRULL_PAPER = "skrull_paper"
    DEEPSPEED = "deepspeed"
    SORTED = "sorted"
    ROUND_ROBIN = "round_robin"
    BALANCED = "balanced"
    CPSAT = "cpsat"
    DYNAMIC_CP = "dynamic_cp"  # Megatron-Core's dynamic CP, for comparison (``dynamic_cp``)
    GROUP_BY_LENGTH = "group_by_length"  # the HF Trainer's length-grouped sampler (``baselines``)
    BATCH_REBALANCE = "batch_rebalance"  # the HF Trainer's batch-rebalance sampler (``baselines``)
    ULYSSES = "ulysses"  # XTuner / SWIFT's static Ulysses SP over the CP group (``static_sp``)
    USP = "usp"  # long-context-attention's static 2D SP over the CP group (``static_sp``)


class CollectiveScheme(StrEnum):
    """How one collective (sequences sharded over one block of ``s`` ranks) moves its attention's data; a plan
    names it by the collective's Ulysses degree ``u``, a divisor of ``s`` (docs/concepts/schemes.md)."""

    ALL_GATHER_KV = "all_gather_kv"  # u = 1: zigzag shards, K/V all-gathered over the block (DACP, Llama 3)
    ULYSSES = "ulysses"  # u = s: contiguous shards, all-to-all over heads (DeepSpeed Ulysses)
    TWO_D = "2d"  # 1 < u < s: Ulysses over u consecutive ranks, K/V all-gathered across the s/u sub-blocks (USP)

    @classmethod
    def of(cls, degree: int, ulysses_degree: int) -> CollectiveScheme:
        if ulysses_degree <= 1:
            return cls.ALL_GATHER_KV
        return cls.ULYSSES if ulysses_degree >= degree else cls.TWO_D
