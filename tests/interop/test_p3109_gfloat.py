"""IEEE P3109 binary8p1..p7 against gfloat's own P3109 definitions (``format_info_p3109(8, p)``:
signed, extended domain), the peer written by P3109 working-group members.

Decode: all 256 codes, values compared bit for bit (NaN by rule: gfloat's and fp8ref's single
NaN code 0x80 both decode to a NaN). Encode: float32 inputs at every boundary of each format
(every value, every midpoint between neighbours and the midpoint above max = the overflow
threshold, each +-1 float32 ulp; 0, the float32 extremes, +-Inf, NaN; both signs), plus all
float16 and bfloat16 values and random float32 bit patterns, under every rounding mode and
saturation setting gfloat has. No difference is expected and none is found (docs/codec.md).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from fp8ref.codec import decode, encode
from fp8ref.formats import FORMATS

gfloat = pytest.importorskip("gfloat")
from gfloat.formats import format_info_p3109  # noqa: E402

NAMES = [f"binary8p{p}" for p in range(1, 8)]
MODES = {"rne": "TiesToEven", "rna": "TiesToAway", "rtz": "TowardZero", "rup": "TowardPositive",
         "rdown": "TowardNegative"}


def info(name: str):
    return format_info_p3109(8, int(name.removeprefix("binary8p")))


def gfloat_codes(x: np.ndarray, name: str, mode: str, sat: bool, **sr) -> np.ndarray:
    with np.errstate(invalid="ignore", over="ignore"):
        rounded = gfloat.round_ndarray(info(name), x.astype(np.float64), getattr(gfloat.RoundMode, mode), sat, **sr)
        codes = gfloat.encode_ndarray(info(name), rounded)
    assert ((codes >= 0) & (codes < 256)).all()
    return codes.astype(np.uint8)


@functools.cache
def boundary_inputs(name: str) -> np.ndarray:
    fmt = FORMATS[name]
    top = fmt.exact_value(fmt.max_code)
    grid = sorted({abs(fmt.exact_value(c)) for c in range(256) if fmt.exact_value(c) is not None})
    grid.append(2 * top - fmt.exact_value(fmt.max_code - 1))  # the grid point above max
    points = grid + [(a + b) / 2 for a, b in zip(grid, grid[1:])]
    x = np.array([float(v) for v in points], np.float32)
    assert all(float(a) == v for a, v in zip(x, points)), "every boundary is exact in float32"
    up, down = np.nextafter(x, np.float32(np.inf)), np.nextafter(x, np.float32(0))
    f32 = np.finfo(np.float32)
    extra = np.array([0.0, np.inf, np.nan, f32.max, f32.tiny, f32.smallest_subnormal, 4 * float(top)], np.float32)
    x = np.concatenate([x, up, down, extra])
    return np.concatenate([x, -x])


@functools.cache
def wide_inputs() -> np.ndarray:
    import ml_dtypes

    bits16 = np.arange(1 << 16, dtype=np.uint16)
    rand = np.random.default_rng(3109).integers(0, 2**32, size=1 << 16, dtype=np.uint32).view(np.float32)
    return np.concatenate([bits16.view(np.float16).astype(np.float32),
                           bits16.view(ml_dtypes.bfloat16).astype(np.float32), rand])


@pytest.mark.parametrize("name", NAMES)
def test_every_code_decodes_as_gfloat_decodes_it(name):
    codes = np.arange(256)
    peer = gfloat.decode_ndarray(info(name), codes)
    ours = decode(codes.astype(np.uint8), name).astype(np.float64)
    assert np.flatnonzero(np.isnan(peer)).tolist() == np.flatnonzero(np.isnan(ours)).tolist() == [0x80]
    finite = ~np.isnan(peer)
    assert np.array_equal(peer[finite].view(np.uint64), ours[finite].view(np.uint64))  # signed zeros too
    assert ours[0x7F] == np.inf and ours[0xFF] == -np.inf and not np.signbit(ours[0])


@pytest.mark.parametrize("sat", [True, False])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", NAMES)
def test_boundary_encodes_match_gfloat(name, mode, sat):
    x = boundary_inputs(name)
    ours = encode(x, name, saturate=sat, rounding=mode)
    assert np.flatnonzero(gfloat_codes(x, name, MODES[mode], sat) != ours).tolist() == []
    # the inputs reach what they are for: overflow to Inf (or max), NaN, and -0 -> 0x00
    fmt = FORMATS[name]
    assert ours[np.isnan(x)].tolist() == [0x80, 0x80] and 0x80 not in ours[~np.isnan(x)]
    assert set(ours[np.isinf(x)].tolist()) == ({0x7E, 0xFE} if sat else {0x7F, 0xFF})
    assert set(ours[np.signbit(x) & (x == 0)].tolist()) == {0x00}
    assert (fmt.max_code in ours) and (0x01 in ours)


@pytest.mark.parametrize("name", NAMES)
def test_the_boundary_inputs_tell_the_modes_apart(name):
    """The comparison above can fail: on these inputs every pair of modes gives different codes."""
    x = boundary_inputs(name)
    codes = {m: encode(x, name, saturate=False, rounding=m).tobytes() for m in MODES}
    assert len(set(codes.values())) == len(MODES)


@pytest.mark.parametrize("bits", [8, 16])
@pytest.mark.parametrize("name", NAMES)
def test_stochastic_is_gfloats_stochastic_fastest(name, bits):
    """fp8ref: up iff floor(d * 2**N) + r >= 2**N; gfloat StochasticFastest: d + r * 2**-N >= 1 (the same)."""
    x = np.tile(boundary_inputs(name), 4)
    dtype = np.uint8 if bits == 8 else np.uint16
    r = np.random.default_rng(bits).integers(0, 1 << bits, size=x.size, dtype=dtype)
    for sat in (True, False):
        ours = encode(x, name, saturate=sat, rounding="stochastic", random_bits=r)
        peer = gfloat_codes(x, name, "StochasticFastest", sat, srbits=r.astype(np.int64), srnumbits=bits)
        assert np.flatnonzero(peer != ours).tolist() == []


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", NAMES)
def test_all_16_bit_and_random_float32_inputs_match_gfloat(name, mode):
    x = wide_inputs()
    for sat in (True, False):
        assert np.count_nonzero(gfloat_codes(x, name, MODES[mode], sat) != encode(x, name, saturate=sat,
                                                                                    rounding=mode)) == 0


@pytest.mark.parametrize("sat", [True, False])
@pytest.mark.parametrize("p, name", [(4, "float8_e4m3fnuz"), (3, "float8_e5m2fnuz")])
def test_the_finite_domain_formats_are_the_fnuz_ones(p, name, sat):
    """docs/codec.md: binary8p4 / binary8p3 of the finite domain are float8_e4m3fnuz / e5m2fnuz."""
    from gfloat.types import Domain, Signedness

    fi = format_info_p3109(8, p, Signedness.Signed, Domain.Finite)
    peer = gfloat.decode_ndarray(fi, np.arange(256))
    ours = decode(np.arange(256, dtype=np.uint8), name).astype(np.float64)
    assert np.array_equal(peer, ours, equal_nan=True) and np.array_equal(np.signbit(peer), np.signbit(ours))
    x = boundary_inputs(f"binary8p{p}")
    for mode, gm in MODES.items():
        with np.errstate(invalid="ignore", over="ignore"):
            rounded = gfloat.round_ndarray(fi, x.astype(np.float64), getattr(gfloat.RoundMode, gm), sat)
            codes = gfloat.encode_ndarray(fi, rounded).astype(np.uint8)
        assert np.flatnonzero(codes != encode(x, name, saturate=sat, rounding=mode)).tolist() == [], mode
