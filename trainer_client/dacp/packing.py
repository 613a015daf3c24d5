"""Packing: the tokens CP rank j feeds the model for one micro-batch of a plan.

For micro-batch ``m`` of DP rank ``i`` and CP rank ``j`` the packed row is

    [ local[j][0] | local[j][1] | … | shards of distributed | shards of sharded[g] | shards of sharded[g'] | … ]
      whole sequences, positions 0..L−1  over all N ranks        over each hybrid group g ∋ j, plan order

A run of shards is one *collective*: the sequences sharded over one aligned
block of ``s`` CP ranks (all ``N`` for ``distributed``, a hybrid group's
``cp_ranks`` otherwise; docs/design.md, "Wire contract"), laid out by the
collective's **Ulysses degree** ``u`` (``MicroBatch.collectives()``; the rule is
``zigzag.shard_positions``, position ``p = j − first rank of the block``):

- ``u = 1``, all-gather-KV: each sequence padded to a multiple of ``2s`` and
  cut into ``2s`` chunks; position ``p`` holds chunks ``p`` and ``2s − 1 − p``
  (``zigzag.py`` with ``cp_size = s``, ``cp_rank = p``);
- ``u = s``, Ulysses: padded to a multiple of ``s``; position ``p`` holds the
  contiguous ``p``-th ``1/s`` of each sequence;
- ``1 < u < s``, 2D: ``p = i·u + j'``; zigzag over the ``g = s/u`` sub-blocks,
  then the contiguous ``j'``-th ``1/u`` of sub-block ``i``'s tokens.

The whole CP group is just the block of all ranks: one code path packs both.

Local sequences keep their own positions; shards carry the *global* positions
of their tokens (RoPE and the causal mask need them), padding rows positions
past the sequence's end and ``IGNORE_INDEX`` targets (they predict nothing).
Targets are shifted before sharding, so the token at the end of one rank's
shard still predicts the first token of the next rank's.

``DacpMetadata`` is what attention needs, named as flash-attn names it:
``cu_seqlens_local``/``max_seqlen_local`` for the local sequences, and one
``ShardedSpec`` per collective (the whole CP group first when there are
distributed sequences, then every hybrid group holding ``j``, in plan order).
Its query segments (``cu_seqlens_q``) are the rows attention runs for this rank:

- all-gather-KV: each of the rank's two chunks per sequence is a segment whose
  keys are the sequence's *prefix* up to the end of that chunk
  (``cu_seqlens_k``), read from the block's all-gathered K/V through
  ``kv_index``. With causal attention aligned bottom-right (query ``i`` of a
  chunk of ``c`` tokens sees ``len(prefix) − c + i + 1`` keys) this is exactly
  the unsharded causal attention of the sequence;
- Ulysses: after the all-to-all over the block, the rank holds every whole
  (padded) sequence for ``H/u`` heads: one segment per sequence, its own keys
  (``kv_index`` None). ``ulysses_index`` reorders the all-to-all's received rows
  (source-major: each source's part of every sequence in turn) into whole
  sequences, ``ulysses_inverse`` puts the output rows back in source order;
- 2D: after the all-to-all over the ``u`` ranks of the sub-block
  (``ulysses_group``), the rank holds its sub-block's zigzag shard of every
  sequence for ``H/u`` heads (``ulysses_index``); from there it is the
  all-gather-KV case over the ``g`` ranks with the same ``j'`` (``stride_group``,
  ``ParallelContext.cp_stride_groups``) at ``cp_size = g``, ``cp_rank = i``.

**Token buckets** (``pad_to_bucket``, ``pack_micro_batch(token_buckets=...)``): a
trainer that replays CUDA graphs captured per bucket pads each row to the
smallest bucket that holds it. The padding goes after the local sequences (the
shards' rows stay where the collectives expect them) as extra local segments that
predict nothing, cut evenly so that their attention stays small; the local
segments are always ``bucket_segments(bucket)`` (real ones, then padding ones,
empty where there is too little padding), and ``max_seqlen_local`` is the bucket,
so that a bucket's rows differ in values only, never in shape. Only a row of more
than one sequence per ``MIN_SEGMENT_TOKENS`` tokens of its bucket has a shape of
its own (more segments: another graph).

Shape legend: T tokens this rank holds in the micro-batch; K gathered-prefix
tokens (all chunks of this rank in one collective); U the Ulysses degree.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch
import torch.distributed as dist

from scheduler_service.core.plan import Collective, MicroBatch, cp_blocks
from trainer_client.dacp.zigzag import padded_length, shard_padded_length, shard_positions, zigzag_positions
from trainer_client.data import IGNORE_INDEX, Sample

__all__ = [
    "MIN_SEGMENT_TOKENS",
    "DacpMetadata",
    "PackedMicroBatch",
    "ShardedSpec",
    "bucket_segments",
    "distributed_kv_index",
    "pack_micro_batch",
    "pad_to_bucket",
    "padding_micro_batch",
]

MIN_SEGMENT_TOKENS = 16  # a bucket's local segments: one per this many tokens, and one more


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardedSpec:
    """One collective of a CP rank: the sequences sharded over one aligned block of CP ranks, by the scheme of its
    Ulysses degree (module docstring)."""

    cp_ranks: tuple[int, ...]  # the block, consecutive CP ranks; all of them for the micro-batch's distributed part
    group: dist.ProcessGroup | None  # the block's process group; None only where nothing is sent (size 1, tests)
    group_rank: int  # this rank's position in the block: cp_rank − cp_ranks[0]
    num_tokens: int  # this rank's shard tokens; the same on every rank of the block
    cu_seqlens_q: torch.Tensor  # int32: the query segments attention runs (after the all-to-all where u > 1)
    cu_seqlens_k: torch.Tensor  # int32, as many: the keys each segment attends to
    max_seqlen_q: int
    max_seqlen_k: int
    # int64 [K]: rows of the all-gathered [kv_group_size · rows] K/V, rank-major; None (Ulysses): the queries' own
    kv_index: torch.Tensor | None
    ulysses_degree: int = 1  # u, a divisor of the block's size: its scheme (CollectiveScheme.of)
    ulysses_group: dist.ProcessGroup | None = None  # u > 1: the u consecutive ranks of this rank's sub-block
    stride_group: dist.ProcessGroup | None = None  # 2D: the s/u ranks at this rank's place in their sub-blocks
    ulysses_index: torch.Tensor | None = None  # int64 [u · num_tokens]: received rows → attention order
    ulysses_inverse: torch.Tensor | None = None  # int64 [u · num_tokens]: attention rows → the all-to-all's order

    @property
    def group_size(self) -> int:
        return len(self.cp_ranks)

    @property
    def kv_group_size(self) -> int:
        """Ranks the K/V are all-gathered over: the block (all-gather-KV), 1 (Ulysses), the sub-blocks (2D)."""
        return self.group_size // self.ulysses_degree

    @property
    def kv_group(self) -> dist.ProcessGroup | None:
        return self.group if self.ulysses_degree == 1 else self.stride_group

    def map_tensors(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> ShardedSpec:
        def maybe(tensor: torch.Tensor | None) -> torch.Tensor | None:
            return None if tensor is None else fn(tensor)

        return dataclasses.replace(self, cu_seqlens_q=fn(self.cu_seqlens_q), cu_seqlens_k=fn(self.cu_seqlens_k),
                                   kv_index=maybe(self.kv_index), ulysses_index=maybe(self.ulysses_index),
                                   ulysses_inverse=maybe(self.ulysses_inverse))


@dataclass(frozen=True, kw_only=True, slots=True)
class DacpMetadata:
    """How one CP rank's packed tokens split into local attention and one attention per collective."""

    cp_size: int
    cp_rank: int
    num_local_tokens: int
    cu_seqlens_local: torch.Tensor  # int32 [num local sequences + 1]
    max_seqlen_local: int
    sharded: tuple[ShardedSpec, ...]  # in row order, after the local tokens

    @property
    def num_sharded_tokens(self) -> int:
        return sum(spec.num_tokens for spec in self.sharded)

    @property
    def num_tokens(self) -> int:
        return self.num_local_tokens + self.num_sharded_tokens

    def map_tensors(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> DacpMetadata:
        return dataclasses.replace(self, cu_seqlens_local=fn(self.cu_seqlens_local),
                                   sharded=tuple(spec.map_tensors(fn) for spec in self.sharded))


@dataclass(frozen=True, kw_only=True, slots=True)
class PackedMicroBatch:
    input_ids_T: torch.Tensor  # int64
    position_ids_T: torch.Tensor  # int64: per local sequence from 0; global positions for shards
    targets_T: torch.Tensor  # int64: next-token targets, IGNORE_INDEX for no loss and padding
    metadata: DacpMetadata
    # Counted on the host while packing: read from the targets once they are on a GPU, it would stall the step
    # at every micro-batch until the device caught up.
    num_loss_tokens: int
    is_padding: bool = False  # a zero-loss stand-in run only to match peers' collectives (padding_micro_batch)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids_T.numel())

    @property
    def is_idle(self) -> bool:
        """No tokens and no collective: the rank may skip this micro-batch without leaving any peer waiting."""
        return self.num_tokens == 0 and not self.metadata.sharded

    def map_tensors(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> PackedMicroBatch:
        """The same micro-batch with ``fn`` applied to every tensor, the metadata's included."""
        return dataclasses.replace(self, input_ids_T=fn(self.input_ids_T), position_ids_T=fn(self.position_ids_T),
                                   targets_T=fn(self.targets_T), metadata=self.metadata.map_tensors(fn))

    def to(self, device: torch.device, *, non_blocking: bool = False) -> PackedMicroBatch:
        return self.map_tensors(lambda tensor: tensor.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> PackedMicroBatch:
        """In page-locked host memory, so that a ``non_blocking`` copy to CUDA is asynchronous."""
        return self.map_tensors(torch.Tensor.pin_memory)

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        """Mark every (CUDA) tensor as used by ``stream`` (``torch.Tensor.record_stream``)."""

        def record(tensor: torch.Tensor) -> torch.Tensor:
            tensor.record_stream(stream)
            return tensor

        self.map_tensors(record)


def _cu_seqlens(lengths: Sequence[int]) -> torch.Tensor:
    return torch.tensor([0, *np.cumsum(lengths, dtype=np.int64).tolist()], dtype=torch.int32)


def _cat(parts: list[npt.NDArray[np.int64]]) -> torch.Tensor:
    return torch.from_numpy(np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64))


def distributed_kv_index(
    lengths: Sequence[int], *, cp_size: int
) -> tuple[list[npt.NDArray[np.int64]], int]:
    """Where each global position of each sharded sequence lies in the all-gathered shards.

    ``cp_size`` is the size of the block the sequences are sharded over. Returns one array per sequence (indexed
    by global position in the padded sequence, values are rows of the gathered ``[cp_size · shard_tokens]``
    buffer, rank-major) and ``shard_tokens`` (tokens per rank).
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


@dataclass(slots=True)
class _Row:
    """The packed row under construction: parallel lists of input ids, positions and targets."""

    input_ids: list[npt.NDArray[np.int64]]
    positions: list[npt.NDArray[np.int64]]
    targets: list[npt.NDArray[np.int64]]


def _append_shard(row: _Row, sample: Sample, positions: npt.NDArray[np.int64], pad_token_id: int) -> None:
    """Append the tokens of ``sample`` at global ``positions`` to ``row``; positions past its end are padding rows
    that predict nothing."""
    is_real = positions < sample.num_tokens
    real_positions = np.minimum(positions, sample.num_tokens - 1)
    row.input_ids.append(np.where(is_real, sample.input_ids[real_positions], pad_token_id))
    row.targets.append(np.where(is_real, sample.targets[real_positions], IGNORE_INDEX))
    row.positions.append(positions)


@dataclass(slots=True)
class _PrefixSegments:
    """Query segments of zigzag chunks and the gathered rows of their causal prefixes (module docstring)."""

    lengths_q: list[int]
    lengths_k: list[int]
    kv_index: list[npt.NDArray[np.int64]]

    def add(self, positions: npt.NDArray[np.int64], location: npt.NDArray[np.int64]) -> None:
        """The two chunks at zigzag ``positions`` of one sequence whose rows in the gathered K/V are ``location``."""
        chunk_tokens = len(positions) // 2
        for chunk_first in (positions[0], positions[chunk_tokens]):
            prefix_end = int(chunk_first) + chunk_tokens
            self.lengths_q.append(chunk_tokens)
            self.lengths_k.append(prefix_end)
            self.kv_index.append(location[:prefix_end])


def _pack_shards(
    row: _Row, samples: Sequence[Sample], indices: Sequence[int], *, cp_ranks: tuple[int, ...], cp_rank: int,
    group: dist.ProcessGroup | None, pad_token_id: int,
) -> ShardedSpec:
    """Append this rank's zigzag shards of ``indices`` (sharded over ``cp_ranks``) to ``row``; their spec."""
    group_size, group_rank = len(cp_ranks), cp_rank - cp_ranks[0]
    locations, shard_tokens = distributed_kv_index([samples[i].num_tokens for i in indices], cp_size=group_size)
    segments = _PrefixSegments(lengths_q=[], lengths_k=[], kv_index=[])
    for index, location in zip(indices, locations, strict=True):
        sample = samples[index]
        positions = zigzag_positions(sample.num_tokens, cp_size=group_size, cp_rank=group_rank)
        _append_shard(row, sample, positions, pad_token_id)
        segments.add(positions, location)
    return ShardedSpec(
        cp_ranks=cp_ranks, group=group, group_rank=group_rank, num_tokens=shard_tokens,
        cu_seqlens_q=_cu_seqlens(segments.lengths_q), cu_seqlens_k=_cu_seqlens(segments.lengths_k),
        max_seqlen_q=max(segments.lengths_q, default=0), max_seqlen_k=max(segments.lengths_k, default=0),
        kv_index=_cat(segments.kv_index),
    )


def _pack_ulysses_shards(
    row: _Row, samples: Sequence[Sample], indices: Sequence[int], *, cp_ranks: tuple[int, ...], cp_rank: int,
    ulysses_degree: int, group: dist.ProcessGroup | None, ulysses_group: dist.ProcessGroup | None,
    stride_group: dist.ProcessGroup | None, pad_token_id: int,
) -> ShardedSpec:
    """Append this rank's Ulysses (``ulysses_degree`` = the block's size) or 2D shards of ``indices`` to ``row``;
    their spec, whose segments are those of the rows the all-to-all gives this rank (module docstring)."""
    degree, group_rank = len(cp_ranks), cp_rank - cp_ranks[0]
    num_sub_blocks, sub_block = degree // ulysses_degree, group_rank // ulysses_degree
    padded = [shard_padded_length(samples[i].num_tokens, degree=degree, ulysses_degree=ulysses_degree)
              for i in indices]
    for index in indices:
        positions = shard_positions(samples[index].num_tokens, degree=degree, ulysses_degree=ulysses_degree,
                                    position=group_rank)
        _append_shard(row, samples[index], positions, pad_token_id)
    shard_lengths = [length // degree for length in padded]
    num_tokens = sum(shard_lengths)
    # The all-to-all receives [u sources, num_tokens] rows, source-major; source j holds the j-th 1/u of each
    # sequence's (sub-block's) tokens, so a sequence is its rows from every source in turn.
    offsets = np.cumsum([0, *shard_lengths[:-1]], dtype=np.int64)
    ulysses_index = np.concatenate([
        source * num_tokens + offset + np.arange(length, dtype=np.int64)
        for offset, length in zip(offsets.tolist(), shard_lengths, strict=True) for source in range(ulysses_degree)])
    ulysses_inverse = np.empty_like(ulysses_index)
    ulysses_inverse[ulysses_index] = np.arange(len(ulysses_index), dtype=np.int64)
    if num_sub_blocks == 1:  # Ulysses: whole sequences, each attending to itself
        cu_seqlens, cu_seqlens_k, kv_index = _cu_seqlens(padded), _cu_seqlens(padded), None
        max_seqlen = max_seqlen_k = max(padded)
    else:  # 2D: the sub-block's zigzag shards (padded is a multiple of 2g), K/V gathered across the sub-blocks
        locations, _ = distributed_kv_index(padded, cp_size=num_sub_blocks)
        segments = _PrefixSegments(lengths_q=[], lengths_k=[], kv_index=[])
        for length, location in zip(padded, locations, strict=True):
            segments.add(zigzag_positions(length, cp_size=num_sub_blocks, cp_rank=sub_block), location)
        cu_seqlens, cu_seqlens_k = _cu_seqlens(segments.lengths_q), _cu_seqlens(segments.lengths_k)
        max_seqlen, max_seqlen_k = max(segments.lengths_q), max(segments.lengths_k)
        kv_index = _cat(segments.kv_index)
    return ShardedSpec(
        cp_ranks=cp_ranks, group=group, group_rank=group_rank, num_tokens=num_tokens, cu_seqlens_q=cu_seqlens,
        cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen_k, kv_index=kv_index,
        ulysses_degree=ulysses_degree, ulysses_group=ulysses_group, stride_group=stride_group,
        ulysses_index=torch.from_numpy(ulysses_index), ulysses_inverse=torch.from_numpy(ulysses_inverse),
    )


def pack_micro_batch(
    samples: Sequence[Sample],
    micro_batch: MicroBatch,
    *,
    cp_size: int,
    cp_rank: int,
    cp_group: dist.ProcessGroup | None = None,
    cp_block_groups: Mapping[tuple[int, int], dist.ProcessGroup] | None = None,
    cp_stride_groups: Mapping[tuple[int, int, int], dist.ProcessGroup] | None = None,
    pad_token_id: int = 0,
    token_buckets: Sequence[int] = (),
) -> PackedMicroBatch:
    """The packed row CP rank ``cp_rank`` runs for ``micro_batch`` (indices into ``samples``).

    ``cp_group`` is the whole CP group, ``cp_block_groups`` maps ``(first CP rank, size)`` of each aligned block
    holding this rank to its process group (``ParallelContext.cp_block_groups``; a 2D collective's Ulysses groups
    are among them), ``cp_stride_groups`` maps ``(first CP rank, size, stride)`` of each strided group holding this
    rank to its group (``ParallelContext.cp_stride_groups``; 2D collectives only). A collective whose group is
    missing packs, and fails in attention if it needs to communicate. ``token_buckets``: the row padded to the
    smallest of them that holds it (``pad_to_bucket``), unless it is idle (the planner prices an idle rank at 0).
    """
    if len(micro_batch.local) != cp_size:
        raise ValueError(f"micro-batch has {len(micro_batch.local)} local lists; cp_size is {cp_size}")
    for sharded_group in micro_batch.sharded:
        cp_ranks, degree = sharded_group.cp_ranks, sharded_group.degree
        if not degree or cp_size % degree or cp_ranks not in cp_blocks(cp_size, degree):
            raise ValueError(f"sharded group over CP ranks {list(cp_ranks)} is not an aligned block of "
                             f"cp_size {cp_size}")
    row = _Row(input_ids=[], positions=[], targets=[])

    local_lengths = []
    for index in micro_batch.local[cp_rank]:
        sample = samples[index]
        row.input_ids.append(sample.input_ids)
        row.positions.append(np.arange(sample.num_tokens, dtype=np.int64))
        row.targets.append(sample.targets)
        local_lengths.append(sample.num_tokens)

    # One collective per block, in row order: the whole CP group, then the hybrid groups holding this rank.
    block_groups = dict(cp_block_groups or {})
    block_groups[(0, cp_size)] = cp_group  # type: ignore[assignment]
    sharded = tuple(
        _pack_collective(row, samples, collective, cp_rank=cp_rank, block_groups=block_groups,
                         stride_groups=cp_stride_groups or {}, pad_token_id=pad_token_id)
        for collective in micro_batch.collectives()
        if collective.sequences and collective.first_rank <= cp_rank < collective.first_rank + collective.degree)

    metadata = DacpMetadata(
        cp_size=cp_size,
        cp_rank=cp_rank,
        num_local_tokens=sum(local_lengths),
        cu_seqlens_local=_cu_seqlens(local_lengths),
        max_seqlen_local=max(local_lengths, default=0),
        sharded=sharded,
    )
    targets_T = _cat(row.targets)
    pack = PackedMicroBatch(input_ids_T=_cat(row.input_ids), position_ids_T=_cat(row.positions), targets_T=targets_T,
                            metadata=metadata, num_loss_tokens=int((targets_T != IGNORE_INDEX).sum()))
    if not token_buckets or pack.is_idle:  # an idle row is skipped, or replaced by a padding micro-batch
        return pack
    return pad_to_bucket(pack, token_buckets, pad_token_id=pad_token_id)


def _pack_collective(
    row: _Row, samples: Sequence[Sample], collective: Collective, *, cp_rank: int,
    block_groups: Mapping[tuple[int, int], dist.ProcessGroup | None],
    stride_groups: Mapping[tuple[int, int, int], dist.ProcessGroup], pad_token_id: int,
) -> ShardedSpec:
    """Append this rank's shards of one collective to ``row`` in its scheme's layout; its spec."""
    first, degree, ulysses_degree = collective.first_rank, collective.degree, collective.ulysses_degree
    cp_ranks = tuple(range(first, first + degree))
    if ulysses_degree < 1 or degree % ulysses_degree:
        raise ValueError(f"the collective over CP ranks {list(cp_ranks)} has Ulysses degree {ulysses_degree}, not "
                         f"a divisor of its {degree} ranks")
    group = block_groups.get((first, degree))
    if ulysses_degree == 1:
        return _pack_shards(row, samples, collective.sequences, cp_ranks=cp_ranks, cp_rank=cp_rank, group=group,
                            pad_token_id=pad_token_id)
    # Position p = i·u + j: the Ulysses group is sub-block i's u consecutive ranks, the strided group the g ranks
    # at place j of every sub-block (ParallelContext.cp_stride_groups).
    sub_block, in_group = divmod(cp_rank - first, ulysses_degree)
    ulysses_group = block_groups.get((first + sub_block * ulysses_degree, ulysses_degree))
    stride_group = (stride_groups.get((first + in_group, degree // ulysses_degree, ulysses_degree))
                    if ulysses_degree < degree else None)
    return _pack_ulysses_shards(row, samples, collective.sequences, cp_ranks=cp_ranks, cp_rank=cp_rank,
                                ulysses_degree=ulysses_degree, group=group, ulysses_group=ulysses_group,
                                stride_group=stride_group, pad_token_id=pad_token_id)


def padding_micro_batch(*, cp_size: int, cp_rank: int, pad_token_id: int = 0,
                        token_buckets: Sequence[int] = ()) -> PackedMicroBatch:
    """One pad token that predicts nothing: a zero-loss micro-batch that runs every layer (and so every FSDP
    collective) and joins no CP collective. Sharded training runs it where a rank must match its peers'
    collectives without tokens of its own (``parallelize.py``). ``token_buckets``: padded as every row is."""
    metadata = DacpMetadata(cp_size=cp_size, cp_rank=cp_rank, num_local_tokens=1, cu_seqlens_local=_cu_seqlens([1]),
                            max_seqlen_local=1, sharded=())
    pack = PackedMicroBatch(input_ids_T=torch.tensor([pad_token_id]), position_ids_T=torch.zeros(1, dtype=torch.int64),
                            targets_T=torch.tensor([IGNORE_INDEX]), metadata=metadata, num_loss_tokens=0,
                            is_padding=True)
    return pad_to_bucket(pack, token_buckets, pad_token_id=pad_token_id) if token_buckets else pack


def bucket_segments(bucket_tokens: int) -> int:
    """The local segments of every row padded to a bucket of ``bucket_tokens``: a fixed number, so that the
    bucket's rows have one shape (module docstring)."""
    return bucket_tokens // MIN_SEGMENT_TOKENS + 1


def pad_to_bucket(pack: PackedMicroBatch, token_buckets: Sequence[int], *, pad_token_id: int = 0) -> PackedMicroBatch:
    """``pack`` padded to the smallest of ``token_buckets`` that holds its tokens and, where one does, its local
    sequences (module docstring); a row of more sequences than even the largest bucket's segments gets as many
    segments as it needs (a shape of its own). A row longer than the largest bucket: as packed where it holds
    shards (the zigzag split rounds each sharded sequence up to whole chunks, a few tokens past the memory bound's
    exact share, and a row with collectives is captured in no graph anyway), else ``ValueError`` naming it (the
    plan exceeds the BucketSize it was checked against)."""
    metadata, num_tokens = pack.metadata, pack.num_tokens
    num_real = metadata.cu_seqlens_local.numel() - 1
    holding = [size for size in sorted(token_buckets) if size >= num_tokens]
    if not holding:
        if metadata.sharded:
            return pack
        raise ValueError(f"a micro-batch row of {num_tokens} tokens (CP rank {metadata.cp_rank}) is longer than the "
                         f"largest token bucket, {max(token_buckets)}: the plan exceeds the BucketSize it was made for")
    bucket = next((size for size in holding if num_real + (size > num_tokens) <= bucket_segments(size)), holding[0])
    num_padding = bucket - num_tokens
    segments = max(bucket_segments(bucket), num_real + (num_padding > 0))
    pad_lengths = np.diff(np.linspace(0, num_padding, segments - num_real + 1).astype(np.int64)).tolist()
    local_lengths = metadata.cu_seqlens_local.diff().tolist()
    local, rest = slice(0, metadata.num_local_tokens), slice(metadata.num_local_tokens, None)
    pad_positions = torch.from_numpy(np.concatenate(
        [np.arange(length, dtype=np.int64) for length in pad_lengths] or [np.zeros(0, dtype=np.int64)]))

    def inserted(tensor_T: torch.Tensor, padding_T: torch.Tensor) -> torch.Tensor:
        return torch.cat([tensor_T[local], padding_T, tensor_T[rest]])

    padded_metadata = dataclasses.replace(
        metadata, num_local_tokens=metadata.num_local_tokens + num_padding,
        cu_seqlens_local=_cu_seqlens([*local_lengths, *pad_lengths]), max_seqlen_local=bucket)
    return dataclasses.replace(
        pack, input_ids_T=inserted(pack.input_ids_T, torch.full((num_padding,), pad_token_id, dtype=torch.int64)),
        position_ids_T=inserted(pack.position_ids_T, pad_positions),
        targets_T=inserted(pack.targets_T, torch.full((num_padding,), IGNORE_INDEX, dtype=torch.int64)),
        metadata=padded_metadata)
