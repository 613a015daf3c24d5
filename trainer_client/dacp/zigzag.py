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

This module is the one place the rule lives. Packing (``packing.py``) slices
tokens with ``zigzag_positions`` and builds the K/V gather index from it; the
tests check both against this function.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

__all__ = ["padded_length", "zigzag_chunks", "zigzag_positions"]


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
