"""Packing: the tokens CP rank j feeds the model for one micro-batch of a plan.

For micro-batch ``m`` of DP rank ``i`` and CP rank ``j`` the packed row is

    [ local[j][0] | local[j][1] | … | shard of dist[0] | shard of dist[1] | … ]
      whole sequences, positions 0..L−1   zigzag chunks j and 2N−1−j (``zigzag.py``)

Local sequences keep their own positions; shards carry the *global* positions
of their tokens (RoPE and the causal mask need them). Targets are shifted
before sharding, so the token at the end of chunk ``j`` still predicts the first
token of chunk ``j + 1`` on another rank.

``DacpMetadata`` is what attention needs, named as flash-attn names it:
``cu_seqlens_local``/``max_seqlen_local`` for the local sequences; for the
distributed ones, each rank's two chunks per sequence are separate queries
(``cu_seqlens_q_dist``) whose keys are the sequence's *prefix* up to the end of
that chunk, read from the all-gathered K/V through ``kv_index_dist``
(``cu_seqlens_k_dist``). With causal attention aligned bottom-right (query
``i`` of a chunk of ``c`` tokens sees ``len(prefix) − c + i + 1`` keys) this is
exactly the unsharded causal attention of the sequence.

Shape legend: T tokens this rank holds in the micro-batch; K gathered-prefix
tokens (all distributed chunks of this rank).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch
import torch.distributed as dist

from scheduler_service.core.plan import MicroBatch
from trainer_client.data import IGNORE_INDEX, Sample
from trainer_client.zigzag import padded_length, zigzag_positions

__all__ = ["DacpMetadata", "PackedMicroBatch", "distributed_kv_index", "pack_micro_batch"]


@dataclass(frozen=True, kw_only=True, slots=True)
class DacpMetadata:
    """How one CP rank's packed tokens split into local and distributed attention."""

    cp_size: int
    cp_rank: int
    cp_group: dist.ProcessGroup | None  # None only when cp_size == 1 or there are no distributed sequences
    num_local_tokens: int
    cu_seqlens_local: torch.Tensor  # int32 [num local sequences + 1]
    max_seqlen_local: int
    num_distributed_tokens: int  # this rank's shard tokens; the same on every CP rank of the micro-batch
    cu_seqlens_q_dist: torch.Tensor  # int32 [2 · num distributed + 1]: one query segment per chunk
    cu_seqlens_k_dist: torch.Tensor  # int32 [2 · num distributed + 1]: the prefix each chunk attends to
    max_seqlen_q_dist: int
    max_seqlen_k_dist: int
    kv_index_dist: torch.Tensor  # int64 [K]: rows of the gathered [cp_size · num_distributed_tokens] K/V

    @property
    def has_distributed(self) -> bool:
        return self.num_distributed_tokens > 0

    def to(self, device: torch.device) -> DacpMetadata:
        return DacpMetadata(
            cp_size=self.cp_size, cp_rank=self.cp_rank, cp_group=self.cp_group,
            num_local_tokens=self.num_local_tokens,
            cu_seqlens_local=self.cu_seqlens_local.to(device), max_seqlen_local=self.max_seqlen_local,
            num_distributed_tokens=self.num_distributed_tokens,
            cu_seqlens_q_dist=self.cu_seqlens_q_dist.to(device), cu_seqlens_k_dist=self.cu_seqlens_k_dist.to(device),
            max_seqlen_q_dist=self.max_seqlen_q_dist, max_seqlen_k_dist=self.max_seqlen_k_dist,
            kv_index_dist=self.kv_index_dist.to(device),
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class PackedMicroBatch:
    input_ids_T: torch.Tensor  # int64
    position_ids_T: torch.Tensor  # int64: per local sequence from 0; global positions for shards
    targets_T: torch.Tensor  # int64: next-token targets, IGNORE_INDEX for no loss and padding
    metadata: DacpMetadata

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids_T.numel())

    @property
    def num_loss_tokens(self) -> int:
        return int((self.targets_T != IGNORE_INDEX).sum())

    def to(self, device: torch.device) -> PackedMicroBatch:
        return PackedMicroBatch(input_ids_T=self.input_ids_T.to(device), position_ids_T=self.position_ids_T.to(device),
                                targets_T=self.targets_T.to(device), metadata=self.metadata.to(device))


def _cu_seqlens(lengths: Sequence[int]) -> torch.Tensor:
    return torch.tensor([0, *np.cumsum(lengths, dtype=np.int64).tolist()], dtype=torch.int32)


def distributed_kv_index(
    lengths: Sequence[int], *, cp_size: int
) -> tuple[list[npt.NDArray[np.int64]], int]:
    """Where each global position of each distributed sequence lies in the all-gathered shards.

    Returns one array per sequence (indexed by global position in the padded sequence, values are rows of the
    gathered ``[cp_size · shard_tokens]`` buffer, rank-major) and ``shard_tokens`` (tokens per rank).
    """
    shard_lengths = [padded_length(length, cp_size) // cp_size for length in lengths]
    shard_tokens = sum(shard_lengths)
    locations = []
    shard_offset = 0
    for length, shard_length in zip(lengths, shard_lengths, strict=True):
        location = np.empty(shard_length * cp_size, dtype=np.int64)
        for cp_rank in range(cp_size):
            location[zigzag_positions(length, cp_size=cp_size, cp_rank=cp_rank)] = (
                cp_rank * shard_tokens + shard_offset + np.arange(shard_length)
            )
        locations.append(location)
        shard_offset += shard_length
    return locations, shard_tokens


def pack_micro_batch(
    samples: Sequence[Sample],
    micro_batch: MicroBatch,
    *,
    cp_size: int,
    cp_rank: int,
    cp_group: dist.ProcessGroup | None = None,
    pad_token_id: int = 0,
) -> PackedMicroBatch:
    """The packed row CP rank ``cp_rank`` runs for ``micro_batch`` (indices into ``samples``)."""
    if len(micro_batch.local) != cp_size:
        raise ValueError(f"micro-batch has {len(micro_batch.local)} local lists; cp_size is {cp_size}")
    input_ids: list[npt.NDArray[np.int64]] = []
    positions: list[npt.NDArray[np.int64]] = []
    targets: list[npt.NDArray[np.int64]] = []

    local_lengths = []
    for index in micro_batch.local[cp_rank]:
        sample = samples[index]
        input_ids.append(sample.input_ids)
        positions.append(np.arange(sample.num_tokens, dtype=np.int64))
        targets.append(sample.targets)
        local_lengths.append(sample.num_tokens)

    dist_lengths = [samples[index].num_tokens for index in micro_batch.distributed]
    locations, shard_tokens = distributed_kv_index(dist_lengths, cp_size=cp_size)
    chunk_lengths_q: list[int] = []
    chunk_lengths_k: list[int] = []
    kv_index: list[npt.NDArray[np.int64]] = []
    for index, location in zip(micro_batch.distributed, locations, strict=True):
        sample = samples[index]
        shard_positions = zigzag_positions(sample.num_tokens, cp_size=cp_size, cp_rank=cp_rank)
        is_real = shard_positions < sample.num_tokens
        real_positions = np.minimum(shard_positions, sample.num_tokens - 1)
        input_ids.append(np.where(is_real, sample.input_ids[real_positions], pad_token_id))
        targets.append(np.where(is_real, sample.targets[real_positions], IGNORE_INDEX))
        positions.append(shard_positions)
        chunk_tokens = len(shard_positions) // 2
        for chunk_first in (shard_positions[0], shard_positions[chunk_tokens]):
            prefix_end = int(chunk_first) + chunk_tokens
            chunk_lengths_q.append(chunk_tokens)
            chunk_lengths_k.append(prefix_end)
            kv_index.append(location[:prefix_end])

    def cat(parts: list[npt.NDArray[np.int64]]) -> torch.Tensor:
        return torch.from_numpy(np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64))

    num_local_tokens = sum(local_lengths)
    metadata = DacpMetadata(
        cp_size=cp_size,
        cp_rank=cp_rank,
        cp_group=cp_group,
        num_local_tokens=num_local_tokens,
        cu_seqlens_local=_cu_seqlens(local_lengths),
        max_seqlen_local=max(local_lengths, default=0),
        num_distributed_tokens=shard_tokens,
        cu_seqlens_q_dist=_cu_seqlens(chunk_lengths_q),
        cu_seqlens_k_dist=_cu_seqlens(chunk_lengths_k),
        max_seqlen_q_dist=max(chunk_lengths_q, default=0),
        max_seqlen_k_dist=max(chunk_lengths_k, default=0),
        kv_index_dist=cat(kv_index),
    )
    return PackedMicroBatch(input_ids_T=cat(input_ids), position_ids_T=cat(positions), targets_T=cat(targets),
                            metadata=metadata)
