"""Test-input generation: a pinned PRNG, exact special-value tables, deterministic randoms."""

import struct
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest

from fp8ref import FORMATS
from fp8ref.golden import values

MASK = (1 << 64) - 1


def splitmix64_reference(key: int, n: int) -> list[int]:
    """SplitMix64 (Steele, Lea, Flood 2014) in plain Python integers: an independent oracle."""
    out = []
    for i in range(1, n + 1):
        z = (key + i * 0x9E3779B97F4A7C15) & MASK
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
        out.append(z ^ (z >> 31))
    return out


def test_stream_is_splitmix64_and_continues_across_calls():
    s = values.Stream(7, "case")
    first, second = s.u64(5), s.u64(3)
    ref = splitmix64_reference(int(s._key), 8)
    assert [int(v) for v in np.concatenate([first, second])] == ref


def test_streams_are_keyed_by_seed_and_name():
    a = values.Stream(1, "x").u64(4)
    assert np.array_equal(a, values.Stream(1, "x").u64(4))
    assert not np.array_equal(a, values.Stream(2, "x").u64(4))
    assert not np.array_equal(a, values.Stream(1, "y").u64(4))


def test_bfloat16_rounding_matches_ml_dtypes():
    x = values.heavy_tailed(values.Stream(0, "bf16"), 20000, centre_exp=3)
    x = np.concatenate([x, [np.inf, -np.inf, 0.0, -0.0, 1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8]])
    ours = values.round_to(x, "bfloat16")
    peer = x.astype(np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)
    assert np.array_equal(ours, peer)


def f32(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def test_special_table_of_e4m3fn_has_the_boundaries():
    table = values.special_values(FORMATS["float8_e4m3fn"], "float32")
    got = set(int(b) for b in table)
    wanted = [448.0, 464.0, 480.0, 2.0 ** -6, 2.0 ** -9, 2.0 ** -10, 0.75 * 2.0 ** -9, 1.0625, 7 * 2.0 ** -10]
    for v in wanted:
        for sign in (1, -1):
            assert struct.unpack("<I", struct.pack("<f", sign * v))[0] in got, sign * v
    # midpoint 464 +- one float32 ulp (the overflow tie's neighbours)
    assert {0x43E7FFFF, 0x43E80001} <= got
    # zeros of both signs, Inf, NaNs with both signs and odd payloads
    assert {0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F800001} <= got
    assert len(got) == len(table)  # deduplicated


def test_special_table_contains_every_midpoint_between_adjacent_codes():
    fmt = FORMATS["float8_e5m2"]
    mags = sorted({fmt.exact_value(c) for c in range(0x80)} - {None})
    mids = [(a + b) / 2 for a, b in zip(mags[:-1], mags[1:], strict=True)]
    got = {Fraction(float(v)) for v in values.from_bits(values.special_values(fmt, "float64"), "float64")
           if np.isfinite(v)}
    assert set(mids) <= got and set(mags) <= got


@pytest.mark.parametrize("dtype", values.INPUT_DTYPES)
def test_random_values_are_deterministic(dtype):
    fmt = FORMATS["float8_e4m3fn"]
    a = values.random_values(values.Stream(5, "r"), fmt, dtype, 1001)
    b = values.random_values(values.Stream(5, "r"), fmt, dtype, 1001)
    assert a.dtype == b.dtype and len(a) == 1001 and np.array_equal(a, b)


def test_heavy_tailed_has_tails_and_outliers():
    x = values.heavy_tailed(values.Stream(0, "t"), 100000)
    body = np.quantile(np.abs(x), 0.5)
    assert np.abs(x).max() > 100 * body  # a Gaussian of this size stays below ~6 sigma
