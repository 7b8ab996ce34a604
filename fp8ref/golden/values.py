"""Test inputs: special-value tables and seeded random values, identical on every machine.

Randomness comes from SplitMix64 keyed by sha256(seed, stream name), computed with numpy
integer arithmetic, so the values do not depend on numpy's generator versions. Random
floats are built from integers with exact operations only (ldexp, +, *, /, sqrt are
correctly rounded in IEEE 754; log/exp/cos are not and are avoided).
"""

from __future__ import annotations

import functools
import hashlib
from fractions import Fraction

import numpy as np

from .. import rounding
from .._arrays import BITS_DTYPES, numpy_bf16
from ..formats import FloatFormat

INPUT_DTYPES = ("float64", "float32", "float16", "bfloat16")
_FLOAT = {"float64": np.float64, "float32": np.float32, "float16": np.float16}
# NaN bit patterns with both signs, quiet and signalling, canonical and odd payloads.
_NANS = {
    "float64": [0x7FF8000000000000, 0xFFF8000000000000, 0x7FF0000000000001, 0x7FFFFFFFFFFFFFFF],
    "float32": [0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FFFFFFF, 0xFFA00000],
    "float16": [0x7E00, 0xFE00, 0x7C01, 0x7FFF],
    "bfloat16": [0x7FC0, 0xFFC0, 0x7F81, 0x7FFF],
}
_INF = {"float64": 0x7FF0000000000000, "float32": 0x7F800000, "float16": 0x7C00, "bfloat16": 0x7F80}
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GAMMA = np.uint64(0x9E3779B97F4A7C15)


class Stream:
    """A named, seeded stream of uint64 values (SplitMix64 over a counter)."""

    def __init__(self, seed: int, *names: str):
        digest = hashlib.sha256("\x1f".join([str(seed), *names]).encode()).digest()
        self._key = np.uint64(int.from_bytes(digest[:8], "little"))
        self._next = 0

    def u64(self, n: int) -> np.ndarray:
        idx = np.arange(self._next + 1, self._next + n + 1, dtype=np.uint64)
        self._next += n
        with np.errstate(over="ignore"):
            z = self._key + idx * _GAMMA
            z = (z ^ (z >> np.uint64(30))) * _M1
            z = (z ^ (z >> np.uint64(27))) * _M2
        return z ^ (z >> np.uint64(31))

    def uniform(self, n: int) -> np.ndarray:
        """float64 in [0, 1), multiples of 2**-53."""
        return (self.u64(n) >> np.uint64(11)).astype(np.float64) * 2.0 ** -53

    def integers(self, n: int, lo: int, hi: int) -> np.ndarray:
        """int64 in [lo, hi) (modulo bias below 2**-40 for the small ranges used here)."""
        return (self.u64(n) % np.uint64(hi - lo)).astype(np.int64) + lo

    def bits(self, n: int, width: int) -> np.ndarray:
        return (self.u64(n) >> np.uint64(64 - width)).astype({8: np.uint8, 16: np.uint16, 32: np.uint32,
                                                              64: np.uint64}[width])


# --- conversions between float64 values and input dtypes, done without any FP8/bf16 cast ---
def from_bits(bits: np.ndarray, dtype: str) -> np.ndarray:
    """View integer bit patterns as the input dtype (bfloat16 through ml_dtypes' dtype)."""
    bits = np.asarray(bits).astype(BITS_DTYPES[dtype])
    return numpy_bf16(bits) if dtype == "bfloat16" else bits.view(_FLOAT[dtype])


def to_bits(x: np.ndarray, dtype: str) -> np.ndarray:
    return np.asarray(x).view(BITS_DTYPES[dtype])


def round_to(values: np.ndarray, dtype: str) -> np.ndarray:
    """float64 -> bit patterns of ``dtype`` by IEEE round-to-nearest-even; bfloat16 inputs are
    rounded to float32 first (double rounding, kept: it fixes the bytes of the committed suites)."""
    values = np.asarray(values, dtype=np.float64)
    if dtype == "bfloat16":
        values = rounding.round_to(values, "float32")
    return rounding.to_bits(rounding.round_to(values, dtype), dtype)


def ulp_steps(bits: np.ndarray, steps: np.ndarray, dtype: str) -> np.ndarray:
    """Move each finite value ``steps`` ulps away from zero (negative: toward zero)."""
    width = np.dtype(BITS_DTYPES[dtype]).itemsize * 8
    sign = np.uint64(1) << np.uint64(width - 1)
    b = bits.astype(np.uint64)
    mag = (b & ~sign).astype(np.int64) + steps
    return ((b & sign) | np.maximum(mag, 0).astype(np.uint64)).astype(BITS_DTYPES[dtype])


# --- special values ------------------------------------------------------------------------
@functools.lru_cache(maxsize=64)
def grid(fmt: FloatFormat) -> tuple[Fraction, ...]:
    """Non-negative finite values of ``fmt`` in increasing order."""
    mags = {fmt.exact_value(c) for c in range(fmt.magnitude_mask + 1)} - {None}
    return tuple(sorted(v for v in mags if v >= 0))


@functools.lru_cache(maxsize=256)
def special_values(fmt: FloatFormat, dtype: str) -> np.ndarray:
    """The special-value table of ``fmt`` as bit patterns of ``dtype``, deduplicated, in order.

    Zeros of both signs, every representable value, midpoints and quarter points between
    adjacent values (and the midpoints +-1 ulp of the input dtype: for float64 inputs these
    expose double rounding through float32), max+-ulp and the overflow tie, the smallest
    value and half of it, powers of two past both ends of the range, +-Inf and NaNs with
    both signs and odd payloads, and the input dtype's own extremes.
    """
    g = grid(fmt)
    top, step_top = g[-1], g[-1] - g[-2]
    exact: list[Fraction] = list(g)
    pairs = list(zip(g[:-1], g[1:], strict=True))
    mids = [(a + b) / 2 for a, b in pairs] + [top + step_top / 2]  # and the overflow tie
    exact += [a + (b - a) / 4 for a, b in pairs] + [a + 3 * (b - a) / 4 for a, b in pairs]
    exact += [top + step_top * k / 4 for k in (1, 2, 3, 4, 8)] + [2 * top, 4 * top]
    low = g[1] if g[0] == 0 else g[0]
    exact += [low / 4, 3 * low / 4, low / 2 + low / 8]
    mids.append(low / 2)
    e_lo, e_hi = fmt.emin - fmt.mantissa_bits - 3, fmt.emax + 3
    exact += [Fraction(2) ** k for k in range(e_lo, e_hi + 1)]

    pos = np.array([float(v) for v in exact], dtype=np.float64)
    pos_mid = round_to(np.array([float(v) for v in mids], dtype=np.float64), dtype)
    mid_bits = np.concatenate([pos_mid, ulp_steps(pos_mid, np.full(len(pos_mid), 1), dtype),
                               ulp_steps(pos_mid, np.full(len(pos_mid), -1), dtype)])
    # the input dtype's own zero, smallest subnormal, largest finite value and Inf
    ends = np.array([0, 1, _INF[dtype] - 1, _INF[dtype]], dtype=BITS_DTYPES[dtype])
    pos_bits = np.concatenate([ends, round_to(pos, dtype), mid_bits])
    sign = np.uint64(1) << np.uint64(np.dtype(BITS_DTYPES[dtype]).itemsize * 8 - 1)
    neg_bits = (pos_bits.astype(np.uint64) | sign).astype(pos_bits.dtype)
    both = np.stack([pos_bits, neg_bits], axis=1).reshape(-1)
    both = np.concatenate([both, np.array(_NANS[dtype], dtype=np.uint64).astype(pos_bits.dtype)])
    _, first = np.unique(both, return_index=True)
    table = both[np.sort(first)]
    table.flags.writeable = False  # cached: shared by every caller
    return table


# --- random values -------------------------------------------------------------------------
def random_values(stream: Stream, fmt: FloatFormat, dtype: str, n: int) -> np.ndarray:
    """``n`` seeded bit patterns of ``dtype``, a quarter from each distribution:

    raw bit patterns (anything, NaN and Inf included), log-uniform over the format's range
    and beyond, values within a few input ulps of a grid point or midpoint (where rounding
    decisions happen), and heavy-tailed values with outliers (what real tensors look like).
    """
    k = [n // 4 + (1 if i < n % 4 else 0) for i in range(4)]
    width = np.dtype(BITS_DTYPES[dtype]).itemsize * 8
    parts = [stream.bits(k[0], width).astype(BITS_DTYPES[dtype])]

    sign = np.where(stream.bits(k[1], 8) & 1, -1.0, 1.0)
    exps = stream.integers(k[1], fmt.emin - fmt.mantissa_bits - 4, fmt.emax + 5)
    parts.append(round_to(sign * np.ldexp(1.0 + stream.uniform(k[1]), exps), dtype))

    g = np.array([float(v) for v in grid(fmt)], dtype=np.float64)
    pick = stream.integers(k[2], 0, len(g) - 1)
    half = stream.bits(k[2], 8) & 1
    centre = np.where(half == 1, (g[pick] + g[pick + 1]) / 2, g[pick + 1])
    near = ulp_steps(round_to(centre, dtype), stream.integers(k[2], -3, 4), dtype)
    near_sign = (stream.bits(k[2], 8) & 1).astype(np.uint64) << np.uint64(width - 1)
    parts.append((near.astype(np.uint64) | near_sign).astype(BITS_DTYPES[dtype]))

    parts.append(round_to(heavy_tailed(stream, k[3], centre_exp=(fmt.emin + fmt.emax) // 2), dtype))
    return np.concatenate(parts)


def heavy_tailed(stream: Stream, n: int, *, centre_exp: int = 0, outlier_rate: float = 0.01) -> np.ndarray:
    """float64 values: roughly normal / sqrt(uniform) (Student-t-like tails) times 2**centre_exp,
    with ``outlier_rate`` of them multiplied by 2**4 .. 2**12."""
    u = [stream.uniform(n) for _ in range(4)]
    normal = ((u[0] + u[1]) + (u[2] + u[3]) - 2.0) * 1.7320508075688772  # Irwin-Hall, variance 1
    tail = normal / np.sqrt(1.0 - stream.uniform(n))  # 1 - U in (0, 1]
    outlier = stream.uniform(n) < outlier_rate
    boost = np.where(outlier, np.ldexp(1.0, stream.integers(n, 4, 13)), 1.0)
    return np.ldexp(tail * boost, centre_exp)


def tensor(stream: Stream, shape: tuple, dtype: str) -> np.ndarray:
    """A heavy-tailed tensor in ``dtype`` whose rows differ in magnitude by powers of two."""
    rows = int(np.prod(shape[:-1], dtype=np.int64))
    v = heavy_tailed(stream, rows * shape[-1]).reshape(rows, shape[-1])
    v = np.ldexp(v, stream.integers(rows, -3, 4)[:, None]).reshape(shape)
    return from_bits(round_to(v, dtype), dtype)
