"""The three encoders in fp8ref.codec agree: C arithmetic loop, bf16-round-to-odd table, float64 exact.

The exhaustive proof against the Fraction oracle lives in tests/exhaustive; this file checks the
fast paths against each other on structured float32 inputs (all exponents, random mantissas,
ties, NaN payloads), and that CI really exercises the C loop.
"""

import os

import numpy as np
import pytest

from fp8ref import FORMATS, encode
from fp8ref.codec import _DETERMINISTIC, _encode_exact, _encode_f32_via_table, kernels_available


def _structured_f32(n_random: int = 40_000) -> np.ndarray:
    rng = np.random.default_rng(1234)
    exps = np.arange(256, dtype=np.uint32) << 23
    mants = np.concatenate([np.array([0, 1, 0x7FFFFF, 0x400000, 0x3FFFFF, 0x200000, 0x100000, 0x80000,
                                      0x0C0000, 0x040000, 0x020000, 0x010000], np.uint32),
                            rng.integers(0, 1 << 23, 24, dtype=np.uint32)])
    grid = (exps[:, None] | mants[None, :]).reshape(-1)
    rand = rng.integers(0, 1 << 32, n_random, dtype=np.uint64).astype(np.uint32)
    bits = np.concatenate([grid, grid | np.uint32(0x80000000), rand])
    return bits.view(np.float32)


X = _structured_f32()


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("saturate", [True, False])
def test_fast_paths_equal_exact_path(name, saturate):
    fmt = FORMATS[name]
    x = X[np.isfinite(X)] if fmt.specials == "none" else X
    for rounding in _DETERMINISTIC:
        with np.errstate(invalid="ignore"):  # signalling NaN patterns widen to quiet NaN
            exact = _encode_exact(x.astype(np.float64), fmt, saturate, rounding)
        via_api = encode(x, fmt, saturate=saturate, rounding=rounding)
        np.testing.assert_array_equal(via_api, exact, err_msg=f"{name} {rounding} sat={saturate}: encode")
        if fmt.mantissa_bits <= 5:
            table = np.empty(x.size, np.uint8)
            _encode_f32_via_table(x.view(np.uint32), table, fmt, saturate, rounding, use_c=False)
            np.testing.assert_array_equal(table, exact, err_msg=f"{name} {rounding} sat={saturate}: table")


def test_parallel_split_matches_single_call():
    """Inputs above the threading threshold are split across cores; the result must not depend on it."""
    rng = np.random.default_rng(7)
    x = (rng.standard_normal(1 << 21) * 300).astype(np.float32)
    whole = encode(x, "float8_e4m3fn")
    pieces = np.concatenate([encode(x[i:i + 4096], "float8_e4m3fn") for i in range(0, x.size, 4096)])
    np.testing.assert_array_equal(whole, pieces)


def test_ci_builds_the_c_kernels():
    if os.environ.get("FP8REF_REQUIRE_KERNELS") != "1":
        pytest.skip("set FP8REF_REQUIRE_KERNELS=1 to require the compiled loops (CI does)")
    assert kernels_available()
