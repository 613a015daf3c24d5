"""The zigzag rule: padding, chunk ownership and even causal work."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from trainer_client.dacp.zigzag import padded_length, zigzag_chunks, zigzag_positions


@given(num_tokens=st.integers(1, 5000), cp_size=st.integers(1, 16))
def test_padding_rounds_up_to_a_multiple_of_twice_cp_size(num_tokens: int, cp_size: int) -> None:
    padded = padded_length(num_tokens, cp_size)
    assert padded % (2 * cp_size) == 0
    assert num_tokens <= padded < num_tokens + 2 * cp_size


@given(num_tokens=st.integers(1, 5000), cp_size=st.integers(1, 16))
def test_ranks_partition_the_padded_sequence(num_tokens: int, cp_size: int) -> None:
    owned = np.concatenate([zigzag_positions(num_tokens, cp_size=cp_size, cp_rank=r) for r in range(cp_size)])
    np.testing.assert_array_equal(np.sort(owned), np.arange(padded_length(num_tokens, cp_size)))


@pytest.mark.parametrize("cp_size", [1, 2, 3, 4, 8])
def test_rank_owns_chunk_r_and_its_mirror(cp_size: int) -> None:
    chunk_tokens = 5
    num_tokens = 2 * cp_size * chunk_tokens
    for cp_rank in range(cp_size):
        first, second = zigzag_chunks(cp_size, cp_rank)
        assert (first, second) == (cp_rank, 2 * cp_size - 1 - cp_rank)
        positions = zigzag_positions(num_tokens, cp_size=cp_size, cp_rank=cp_rank)
        np.testing.assert_array_equal(positions[:chunk_tokens] // chunk_tokens, first)
        np.testing.assert_array_equal(positions[chunk_tokens:] // chunk_tokens, second)
        assert np.all(np.diff(positions[:chunk_tokens]) == 1) and np.all(np.diff(positions[chunk_tokens:]) == 1)


@given(num_tokens=st.integers(1, 5000), cp_size=st.integers(1, 16))
def test_causal_work_is_equal_on_every_rank(num_tokens: int, cp_size: int) -> None:
    # Under causal attention a query at position p attends to p + 1 keys (padding included).
    work = {int(np.sum(zigzag_positions(num_tokens, cp_size=cp_size, cp_rank=r) + 1)) for r in range(cp_size)}
    assert len(work) == 1


def test_padding_lies_at_the_end_of_the_sequence() -> None:
    cp_size, num_tokens = 4, 13  # padded to 16 in chunks of 2: chunk 6 (rank 1) and chunk 7 (rank 0) hold padding
    owned = {r: zigzag_positions(num_tokens, cp_size=cp_size, cp_rank=r) for r in range(cp_size)}
    assert sorted(int(p) for r in owned for p in owned[r] if p >= num_tokens) == [13, 14, 15]
    assert list(owned[0][2:]) == [14, 15] and list(owned[1][2:]) == [12, 13]


@pytest.mark.parametrize(("num_tokens", "cp_size", "cp_rank"), [(0, 2, 0), (5, 0, 0), (5, 2, 2), (5, 2, -1)])
def test_rejects_invalid_arguments(num_tokens: int, cp_size: int, cp_rank: int) -> None:
    with pytest.raises(ValueError, match=r"cp_|token"):
        zigzag_positions(num_tokens, cp_size=cp_size, cp_rank=cp_rank)
