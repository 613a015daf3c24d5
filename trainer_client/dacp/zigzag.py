"""The zigzag rule: which tokens of a distributed sequence a CP rank owns.

A sequence sharded over ``cp_size = N`` ranks is padded to a multiple of ``2N``
tokens and cut into ``2N`` equal chunks; CP rank ``r`` owns chunks ``r`` and
``2N − 1 − r`` (docs/design.md, "Sharded sequences in attention"). Under causal
attention chunk ``a`` attends to ``a + 1`` chunks, so every rank does
``(r + 1) + (2N − r) = 2N + 1`` chunk-pairs of work: the load is even.

Padding tokens sit at the end of the sequence (global positions
``>= num_tokens``); causal attention never lets a real token see them and the
loss ignores them, so they change no number that matters.

Hybrid DACP shards a sequence over an aligned *block* of ``s`` CP ranks
instead of the whole group (docs/design.md, "Wire contract"): the same rule applies
with ``cp_size = s`` and ``cp_rank`` the rank's position in the block
(``cp_rank − first rank of the block``); the whole CP group is the block of all
ranks.

A collective may instead run Ulysses (all-to-all over heads) over all or part
of its block: its **Ulysses degree** ``u`` divides ``s`` and picks the layout
(``shard_positions``; ``dacp.attention`` says why each layout fits its scheme):

- ``u = 1``, all-gather-KV: the zigzag rule above over the block of ``s``;
- ``u = s``, Ulysses: padded to a multiple of ``s``, block position ``p`` holds
  the contiguous ``p``-th ``1/s`` of the sequence;
- ``1 < u < s``, 2D: block position ``p = i·u + j``; the sequence is zigzag-split
  over the ``g = s/u`` *sub-blocks* (sub-block ``i`` holds the zigzag positions of
  rank ``i`` of ``g``), and rank ``j`` of a sub-block holds the contiguous
  ``j``-th ``1/u`` of its sub-block's positions. Padded to a multiple of
  ``lcm(2g, s)``: ``2g`` equal chunks, each sub-block's ``2`` of them split in
  ``u`` equal parts.

This module is the one place the rule lives. Packing (``packing.py``) slices
tokens with ``zigzag_positions`` and ``shard_positions`` and builds the K/V
gather index from them; the tests check both against these functions.
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

__all__ = ["padded_length", "shard_padded_length", "shard_positions", "zigzag_chunks", "zigzag_positions"]


def _check_cp(cp_size: int, cp_rank: int) -> None:
    if cp_size < 1:
        raise ValueError(f"cp_size must be at least 1, got {cp_size}")
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be in [0, {cp_size}), got {cp_rank}")


def padded_length(num_tokens: int, cp_size: int) -> int:
    """``num_tokens`` rounded up to a multiple of ``2 · cp_size`` (every chunk the same size)."""
    if num_tokens < 1:
        raise ValueError(f"a sequence needs at least one token, got {num_tokens}")
    if cp_size < 1:
        raise ValueError(f"cp_size must be at least 1, got {cp_size}")
    num_chunks = 2 * cp_size
    return -(-num_tokens // num_chunks) * num_chunks


def zigzag_chunks(cp_size: int, cp_rank: int) -> tuple[int, int]:
    """The two chunk ids (of ``2 · cp_size``) that ``cp_rank`` owns, in the order it stores them."""
    _check_cp(cp_size, cp_rank)
    return cp_rank, 2 * cp_size - 1 - cp_rank


def zigzag_positions(num_tokens: int, *, cp_size: int, cp_rank: int) -> npt.NDArray[np.int64]:
    """Global positions (0-based, in the padded sequence) of the tokens ``cp_rank`` holds, in storage order.

    The result has ``padded_length(num_tokens, cp_size) // cp_size`` entries; those ``>= num_tokens`` are padding.
    """
    _check_cp(cp_size, cp_rank)
    chunk_tokens = padded_length(num_tokens, cp_size) // (2 * cp_size)
    first, second = zigzag_chunks(cp_size, cp_rank)
    offsets = np.arange(chunk_tokens, dtype=np.int64)
    return np.concatenate([first * chunk_tokens + offsets, second * chunk_tokens + offsets])


def _check_ulysses(degree: int, ulysses_degree: int) -> None:
    if ulysses_degree < 1 or degree % ulysses_degree:
        raise ValueError(f"Ulysses degree {ulysses_degree} does not divide the collective's {degree} ranks")


def shard_padded_length(num_tokens: int, *, degree: int, ulysses_degree: int) -> int:
    """``num_tokens`` padded for a collective of ``degree`` ranks with Ulysses degree ``ulysses_degree``: a
    multiple of ``2 · degree`` (all-gather-KV), of ``degree`` (Ulysses), of ``lcm(2g, degree)`` (2D, ``g =
    degree / ulysses_degree``); every split of the layout is then exact."""
    _check_ulysses(degree, ulysses_degree)
    if ulysses_degree == 1:
        return padded_length(num_tokens, degree)
    if num_tokens < 1:
        raise ValueError(f"a sequence needs at least one token, got {num_tokens}")
    multiple = degree if ulysses_degree == degree else math.lcm(2 * (degree // ulysses_degree), degree)
    return -(-num_tokens // multiple) * multiple


def shard_positions(num_tokens: int, *, degree: int, ulysses_degree: int, position: int) -> npt.NDArray[np.int64]:
    """Global positions (in the padded sequence) of the tokens block position ``position`` holds, in storage order,
    under the layout of ``ulysses_degree`` (module docstring). ``shard_padded_length(...) // degree`` entries; those
    ``>= num_tokens`` are padding."""
    _check_cp(degree, position)
    if ulysses_degree == 1:
        return zigzag_positions(num_tokens, cp_size=degree, cp_rank=position)
    padded = shard_padded_length(num_tokens, degree=degree, ulysses_degree=ulysses_degree)
    per_rank = padded // degree
    if ulysses_degree == degree:
        return np.arange(position * per_rank, (position + 1) * per_rank, dtype=np.int64)
    sub_block, in_group = divmod(position, ulysses_degree)
    # ``padded`` is a multiple of 2g: the zigzag rule over the g sub-blocks adds no padding of its own.
    sub_block_positions = zigzag_positions(padded, cp_size=degree // ulysses_degree, cp_rank=sub_block)
    return sub_block_positions[in_group * per_rank:(in_group + 1) * per_rank]
