"""Processes and their groups, which know no model (the model's sharding and compiled blocks are
``models/parallelize.py``'s). The package's modules:

- ``mesh``: the DP × CP layout (``ParallelDims``), this rank's place in it and every process group it takes part in
  (``ParallelContext``, made by ``init_parallel``), the block and strided groups of DACP's collectives;
- ``failures``: the first rank to fail tells its peers, which stop with its reason (``PeerFailed``);
- ``launch``: ranks on this machine without torchrun, for tests and tools (``spawn_gloo``, ``spawn_ranks``);
- ``torch_compat`` (the torch calls that differ between the supported releases) and ``host_memory`` (a CPU rank
  keeps the memory its micro-batches free, as a GPU's caching allocator does: ``init_parallel`` sets it).

The public names of the first three are importable from here.
"""

from __future__ import annotations

from trainer_client.config_choices import DEFAULT_COLLECTIVE_TIMEOUT_S
from trainer_client.distributed.failures import FirstFailure, PeerFailed, report_failure, reported_failure
from trainer_client.distributed.launch import free_port, spawn_gloo, spawn_ranks
from trainer_client.distributed.mesh import (
    ParallelContext,
    ParallelDims,
    destroy_groups,
    init_parallel,
    max_over_ranks,
)

__all__ = ["DEFAULT_COLLECTIVE_TIMEOUT_S", "FirstFailure", "ParallelContext", "ParallelDims", "PeerFailed",
           "destroy_groups", "free_port", "init_parallel", "max_over_ranks", "report_failure", "reported_failure",
           "spawn_gloo", "spawn_ranks"]
