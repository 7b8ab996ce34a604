"""Packed FP6 (compressed-tensors 0.20.1 ``pack_fp6_to_uint8``): four 6-bit codes in three bytes,
little-endian, the first code in the low 6 bits. Checked against an oracle on Python integers (the
24-bit word of each quad, written out byte by byte), exhaustively for every code in every position,
and by hypothesis for whole rows; the bytes compressed-tensors itself wrote are in the ct020_*
fixtures (tests/interop/test_ct020_fixtures.py)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fp8ref.errors import CheckpointError
from fp8ref.io.safetensors import pack_codes, pack_sextets, unpack_codes, unpack_sextets


def _oracle_pack(codes: list[int]) -> bytes:
    out = bytearray()
    for i in range(0, len(codes), 4):
        word = sum(c << (6 * j) for j, c in enumerate(codes[i:i + 4]))
        out += word.to_bytes(3, "little")
    return bytes(out)


@pytest.mark.parametrize("position", range(4))
def test_every_code_in_every_position(position):
    quads = np.zeros((64, 4), np.uint8)
    quads[:, position] = np.arange(64)
    packed = pack_sextets(quads)
    assert packed.shape == (64, 3)
    for code in range(64):
        assert packed[code].tobytes() == _oracle_pack([int(c) for c in quads[code]])
    assert np.array_equal(unpack_sextets(packed), quads)


@given(st.integers(1, 4), st.lists(st.integers(0, 63), min_size=4, max_size=64).map(
    lambda c: c[: len(c) // 4 * 4]))
def test_rows_match_the_oracle_and_round_trip(rows, codes):
    a = np.tile(np.array(codes, np.uint8), (rows, 1))
    packed = pack_codes(a, "float6_e2m3fn")
    assert packed.shape == (rows, 3 * len(codes) // 4)
    assert all(packed[r].tobytes() == _oracle_pack(codes) for r in range(rows))
    assert np.array_equal(unpack_codes(packed, "float6_e2m3fn"), a)


def test_byte_count_not_a_multiple_of_three_names_the_tensor():
    with pytest.raises(CheckpointError, match=r"model.safetensors: tensor 'w': 4 bytes per row, not a multiple of 3"):
        unpack_codes(np.zeros((2, 4), np.uint8), "float6_e2m3fn", "model.safetensors: tensor 'w'")


def test_codes_not_a_multiple_of_four_are_refused():
    with pytest.raises(CheckpointError, match="multiple of 4"):
        pack_sextets(np.zeros((1, 6), np.uint8))


def test_unpacked_formats_have_no_packing():
    with pytest.raises(CheckpointError, match="no packed checkpoint form"):
        pack_codes(np.zeros((1, 4), np.uint8), "float8_e4m3fn")
