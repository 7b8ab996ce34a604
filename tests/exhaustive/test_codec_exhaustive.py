"""Exhaustive agreement of fp8ref.codec with the Fraction oracle (tests/support/oracle.py).

(a) every code of every registered format: decode, and encode(decode(code)) in every mode;
(b) all 65 536 float16 and bfloat16 inputs x every format x deterministic mode x saturate;
(c) stochastic rounding against the oracle for several random_bits dtypes.

The oracle is evaluated once per (input dtype, format) by ``oracle.encode_table``:
``oracle.locate`` classifies each input (NaN/Inf/zero/exact code/between two codes and on which
side of the midpoint), which by the contract's definition decides every deterministic mode, and
``oracle.encode`` runs on one representative per class. ``test_grouping_matches_scalar_oracle`` re-checks that shortcut
against direct scalar calls.
"""

from __future__ import annotations

import functools
import math
import zlib

import ml_dtypes
import numpy as np
import pytest
import torch

from fp8ref.codec import decode, encode
from fp8ref.errors import EncodeError
from fp8ref.formats import FORMATS
from tests.support import oracle

FMT_NAMES = list(FORMATS)
SATURATE = (True, False)
RAISES = -1  # oracle.encode_table entry: the contract says this input must raise


def _all16(dtype: str):
    """All 2**16 bit patterns of a 16-bit float dtype, as (numpy or None, torch)."""
    bits = np.arange(1 << 16, dtype=np.uint16)
    if dtype == "float16":
        arr = bits.view(np.float16)
        return arr, torch.from_numpy(arr.copy())
    arr = bits.view(ml_dtypes.bfloat16)
    return arr, torch.from_numpy(bits.view(np.int16).copy()).view(torch.bfloat16)


@functools.cache
def _inputs(dtype: str) -> list[float]:
    """Exact float64 values of every input (float16/bfloat16 widen exactly)."""
    return _all16(dtype)[1].to(torch.float64).tolist()


@functools.cache
def _oracle_table(dtype: str, fmt_name: str) -> dict:
    """{(rounding, saturate): int16 codes (RAISES where the contract says raise)} for all inputs."""
    table = oracle.encode_table(_inputs(dtype), FORMATS[fmt_name], saturates=SATURATE)
    return {k: np.array(v, dtype=np.int16) for k, v in table.items()}


def _oracle_code(v, fmt, sat, mode, **kw) -> int:
    try:
        return oracle.encode(v, fmt, saturate=sat, rounding=mode, **kw)
    except oracle.NotRepresentable:
        return RAISES


def _mismatch_report(values, got, want, limit=8) -> str:
    bad = np.flatnonzero(got != want)
    rows = [f"x={values[i]!r}: got {int(got[i]):#04x} want {int(want[i]):#04x}" for i in bad[:limit]]
    return f"{bad.size} mismatches; " + "; ".join(rows)


# --- (a) every code ------------------------------------------------------------------------
def _expected_decode_bits(fmt) -> np.ndarray:
    """float32 bit patterns the contract requires for every code (canonical quiet NaN 0x7FC00000)."""
    out = []
    for c in range(fmt.n_codes):
        v = oracle.decode_float(c, fmt)
        if math.isnan(v):
            out.append(0x7FC00000 | (0x80000000 if math.copysign(1.0, v) < 0 else 0))
        else:
            assert float(np.float32(v)) == v or math.isinf(v)
            out.append(int(np.array(v, dtype=np.float32).view(np.uint32)))
    return np.array(out, dtype=np.uint32)


@pytest.mark.parametrize("fmt_name", FMT_NAMES)
def test_decode_every_code_bitwise(fmt_name):
    fmt = FORMATS[fmt_name]
    assert fmt.decode_dtype == "float32"  # every built-in format is exact in float32
    codes = np.arange(fmt.n_codes, dtype=np.uint8)
    want = _expected_decode_bits(fmt)
    got_np = decode(codes, fmt)
    got_t = decode(torch.from_numpy(codes), fmt_name)
    assert got_np.dtype == np.float32 and got_t.dtype == torch.float32
    np.testing.assert_array_equal(got_np.view(np.uint32), want)
    np.testing.assert_array_equal(got_t.numpy().view(np.uint32), want)


@pytest.mark.parametrize("fmt_name", FMT_NAMES)
def test_oracle_derivations_match_formats(fmt_name):
    """formats.py derives its special codes independently of the oracle; they must agree."""
    fmt = FORMATS[fmt_name]
    want = {"sign_mask": fmt.sign_mask, "nan_code": fmt.nan_code, "inf_code": fmt.inf_code,
            "max_code": fmt.max_code, "has_negative_zero": fmt.has_negative_zero}
    assert oracle.grid(fmt).derived == want
    assert float(oracle.decode(fmt.max_code, fmt)) == fmt.max
    assert {c for c in range(fmt.n_codes) if oracle.decode(c, fmt) is None} == set(fmt.nan_codes)


@pytest.mark.parametrize("saturate", SATURATE)
@pytest.mark.parametrize("fmt_name", FMT_NAMES)
def test_decode_encode_roundtrip_every_code(fmt_name, saturate):
    """Finite codes come back unchanged in every mode. NaN codes come back as the format's
    canonical NaN code (sign kept for signed 'fn'/'ieee' formats), Inf codes follow the Inf rule."""
    fmt = FORMATS[fmt_name]
    codes = np.arange(fmt.n_codes, dtype=np.uint8)
    values = decode(codes, fmt)
    finite = np.isfinite(values)
    nan = np.isnan(values)
    signed_nan = fmt.specials in ("fn", "ieee")
    canonical_nan = np.array([fmt.nan_code | (c & fmt.sign_mask if signed_nan else 0) for c in codes[nan]],
                             dtype=np.uint8)
    rng = np.random.default_rng(0)
    for mode in oracle.MODES:
        kw = {}
        if mode == "stochastic":
            kw["random_bits"] = rng.integers(0, 256, size=codes.shape, dtype=np.uint8)
        got = encode(values, fmt, saturate=saturate, rounding=mode, **kw)
        np.testing.assert_array_equal(got[finite], codes[finite], err_msg=mode)
        np.testing.assert_array_equal(got[nan], canonical_nan, err_msg=mode)
        for c in codes[~finite & ~nan]:  # +-Inf codes of 'ieee' formats
            v = oracle.decode_float(int(c), fmt)
            assert int(got[c]) == oracle.encode(v, fmt, saturate, mode, *_bits_arg(kw, c)), (mode, c)


def _bits_arg(kw, i):
    return (int(kw["random_bits"][i]), 8) if kw else ()


# --- (b) all float16 / bfloat16 inputs -------------------------------------------------------
CASES = [(d, f) for d in ("float16", "bfloat16") for f in FMT_NAMES]


@pytest.mark.parametrize("dtype,fmt_name", CASES)
def test_all_16bit_inputs_match_oracle(dtype, fmt_name):
    fmt = FORMATS[fmt_name]
    arr_np, arr_t = _all16(dtype)
    values = _inputs(dtype)
    table = _oracle_table(dtype, fmt_name)
    for (mode, sat), want in table.items():
        ok = want != RAISES
        want_ok = want[ok].astype(np.uint8)
        sel_t = arr_t[torch.from_numpy(ok)]
        got_t = encode(sel_t, fmt, saturate=sat, rounding=mode)
        assert isinstance(got_t, torch.Tensor) and got_t.dtype == torch.uint8
        vals_ok = [v for v, k in zip(values, ok) if k]
        assert np.array_equal(got_t.numpy(), want_ok), \
            f"torch {dtype} {mode} sat={sat}: " + _mismatch_report(vals_ok, got_t.numpy(), want_ok)
        got_np = encode(arr_np[ok], fmt_name, saturate=sat, rounding=mode)
        assert isinstance(got_np, np.ndarray) and got_np.dtype == np.uint8
        assert np.array_equal(got_np, want_ok), \
            f"numpy {dtype} {mode} sat={sat}: " + _mismatch_report(vals_ok, got_np, want_ok)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("fmt_name", [n for n in FMT_NAMES if FORMATS[n].specials == "none"])
def test_none_formats_raise_on_nan_and_unsaturated_inf(dtype, fmt_name):
    """fp4/fp6 have no NaN/Inf code: NaN always raises, Inf raises unless saturating."""
    _, arr_t = _all16(dtype)
    nan = torch.isnan(arr_t)
    inf = torch.isinf(arr_t)
    finite = arr_t[~nan & ~inf]
    assert nan.sum() > 0 and inf.sum() == 2
    for mode in oracle.DETERMINISTIC:
        for sat in SATURATE:
            with pytest.raises(EncodeError):
                encode(torch.cat([finite[:3], arr_t[nan][:1]]), fmt_name, saturate=sat, rounding=mode)
        with pytest.raises(EncodeError):
            encode(arr_t[inf], fmt_name, saturate=False, rounding=mode)
        sat_inf = encode(arr_t[inf], fmt_name, saturate=True, rounding=mode).tolist()
        fmt = FORMATS[fmt_name]
        want = [oracle.encode(v, fmt, True, mode) for v in arr_t[inf].to(torch.float64).tolist()]
        assert sat_inf == want == [fmt.max_code, fmt.max_code | fmt.sign_mask]  # [+Inf, -Inf]


@pytest.mark.parametrize("dtype,fmt_name", [("float16", n) for n in FMT_NAMES[:6]])
def test_grouping_matches_scalar_oracle(dtype, fmt_name):
    """The per-class shortcut of _oracle_table equals calling the scalar oracle on each input."""
    fmt = FORMATS[fmt_name]
    values = _inputs(dtype)
    table = _oracle_table(dtype, fmt_name)
    for i in range(0, len(values), 97):
        for (mode, sat), want in table.items():
            assert _oracle_code(values[i], fmt, sat, mode) == want[i], (values[i], mode, sat)


# --- (c) stochastic -----------------------------------------------------------------------
def _stochastic_inputs(dtype: str, n: int, rng) -> np.ndarray:
    """n random finite values spread over all binades of dtype, as float64 numpy (exact)."""
    if dtype in ("float16", "bfloat16"):
        vals = np.array(_inputs(dtype))
        vals = vals[np.isfinite(vals)]
        return rng.choice(vals, size=n)
    mant = rng.uniform(-2.0, 2.0, size=n)
    exps = rng.integers(-150, 127, size=n)
    x = np.ldexp(mant, exps)
    return x.astype(np.float32).astype(np.float64) if dtype == "float32" else x


def _as_input(x64: np.ndarray, dtype: str, lib: str):
    if dtype == "bfloat16":
        t = torch.from_numpy(x64).to(torch.bfloat16)
        return t if lib == "torch" else t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    arr = x64.astype(dtype)
    return torch.from_numpy(arr) if lib == "torch" else arr


STOCH = [(d, lib) for d in ("float16", "bfloat16", "float32", "float64") for lib in ("numpy", "torch")]


@pytest.mark.parametrize("dtype,lib", STOCH)
@pytest.mark.parametrize("fmt_name", FMT_NAMES)
def test_stochastic_matches_oracle(fmt_name, dtype, lib):
    fmt = FORMATS[fmt_name]
    rng = np.random.default_rng(zlib.crc32(f"{fmt_name}/{dtype}/{lib}".encode()))
    x64 = _stochastic_inputs(dtype, 600, rng)
    x = _as_input(x64, dtype, lib)
    exact = (x.to(torch.float64) if lib == "torch" else np.asarray(x, dtype=np.float64)).tolist()
    for bits_dtype, n in ((np.uint8, 8), (np.uint16, 16), (np.uint32, 32)):
        r = rng.integers(0, 1 << n, size=len(exact), dtype=bits_dtype)
        r_in = torch.from_numpy(r) if lib == "torch" else r
        for sat in SATURATE:
            got = encode(x, fmt, saturate=sat, rounding="stochastic", random_bits=r_in)
            got = got.numpy() if lib == "torch" else got
            want = np.array([oracle.encode(v, fmt, sat, "stochastic", int(b), n)
                             for v, b in zip(exact, r.tolist())], dtype=np.uint8)
            assert np.array_equal(got, want), f"{bits_dtype.__name__} sat={sat}: " + \
                _mismatch_report(exact, got, want)
