"""The closed sets and caps a planning request names, in a module that imports nothing: the schedulers and the
number of token buckets. ``core.plan`` validates requests with them; the trainer's configuration declares its flags
with them without loading numpy, numba and the schedulers (its ``--help`` answers in a fraction of a second).
"""

from __future__ import annotations

from enum import StrEnum

__all__ = ["MAX_TOKEN_BUCKETS", "SchedulerName"]

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
