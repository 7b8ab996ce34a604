"""The behaviour table of docs/codec.md, cell by cell, plus REFERENCE.md vectors,
user-defined formats, bad input and array plumbing (library, shape, out=).

Expected codes come from three independent places: hand-written contract tables below, the
Fraction oracle (tests/support/oracle.py), and the vectors REFERENCE.md measured on ONNX/ml_dtypes.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch

from fp8ref.codec import ROUNDING_MODES, decode, encode
from fp8ref.errors import EncodeError, FormatError, InputTypeError, UnknownFormatError
from fp8ref.formats import FORMATS, FloatFormat
from tests.support import oracle

FMT_NAMES = list(FORMATS)
DET = [m for m in ROUNDING_MODES if m != "stochastic"]


def test_rounding_modes_are_the_contracts():
    assert ROUNDING_MODES == ("rne", "rna", "rtz", "rup", "rdown", "rto", "stochastic") == oracle.MODES


def enc(x, fmt, sat=True, mode="rne", **kw) -> int:
    return int(encode(np.array([x], dtype=np.float64), fmt, saturate=sat, rounding=mode, **kw)[0])


def _overflow_code(fmt: FloatFormat, negative: bool) -> int:
    """Contract: +-Inf for 'ieee'/'p3109', NaN for 'fn' (signed NaN where signed)/'fnuz', +-max for 'none'."""
    sign = fmt.sign_mask if negative else 0
    return {"ieee": (fmt.inf_code or 0) | sign, "fn": (fmt.nan_code or 0) | sign, "p3109": 0x7F | sign,
            "fnuz": fmt.nan_code, "none": fmt.max_code | sign}[fmt.specials]


def _contract_overflow(fmt, negative, sat, mode) -> int:
    """The contract's overflow table, written out independently of the oracle."""
    to_max = fmt.max_code | (fmt.sign_mask if negative else 0)
    if sat or mode in ("rtz", "rto"):
        return to_max
    if mode == "rup":
        return to_max if negative else _overflow_code(fmt, False)
    if mode == "rdown":
        return _overflow_code(fmt, True) if negative else to_max
    return _overflow_code(fmt, negative)


# --- finite overflow ----------------------------------------------------------------------
@pytest.mark.parametrize("sat", [True, False])
@pytest.mark.parametrize("mode", ROUNDING_MODES)
@pytest.mark.parametrize("fmt_name", FMT_NAMES)
def test_finite_overflow(fmt_name, mode, sat):
    fmt = FORMATS[fmt_name]
    signs = (False, True) if fmt.signed else (False,)
    for neg in signs:
        x = -4.0 * fmt.max if neg else 4.0 * fmt.max
        kw = {"random_bits": np.array([123], np.uint8)} if mode == "stochastic" else {}
        want = _contract_overflow(fmt, neg, sat, mode)
        assert enc(x, fmt, sat, mode, **kw) == want
        assert oracle.encode(x, fmt, sat, mode, *((123, 8) if kw else ())) == want


@pytest.mark.parametrize("sat", [True, False])
@pytest.mark.parametrize("fmt_name", FMT_NAMES)
def test_round_first_then_overflow(fmt_name, sat):
    """Between max and the next point of the unbounded grid, rounding decides whether it overflows."""
    fmt = FORMATS[fmt_name]
    g = oracle.grid(fmt)
    mx, nxt = g.mags[g.max_code], g.mags[g.max_code + 1]
    for x in (mx + (nxt - mx) / 4, (mx + nxt) / 2, mx + 3 * (nxt - mx) / 4):
        for mode in DET:
            assert enc(float(x), fmt, sat, mode) == oracle.encode(x, fmt, sat, mode), (float(x), mode)
    tie = float((mx + nxt) / 2)
    # rne: the tie goes to the even code; max_code + 1 continues the code sequence.
    want = fmt.max_code if fmt.max_code % 2 == 0 else _contract_overflow(fmt, False, sat, "rne")
    assert enc(tie, fmt, sat, "rne") == want
    assert enc(tie, fmt, sat, "rna") == _contract_overflow(fmt, False, sat, "rna")


# --- Inf, NaN, zeros ----------------------------------------------------------------------
@pytest.mark.parametrize("mode", DET)
@pytest.mark.parametrize("fmt_name", FMT_NAMES)
def test_infinities(fmt_name, mode):
    fmt = FORMATS[fmt_name]
    pos_max = fmt.max_code
    assert enc(math.inf, fmt, True, mode) == pos_max
    if fmt.signed:
        assert enc(-math.inf, fmt, True, mode) == pos_max | fmt.sign_mask
    else:
        assert enc(-math.inf, fmt, True, mode) == fmt.nan_code  # unsigned: -Inf is NaN
    if fmt.specials == "none":
        for x in (math.inf, -math.inf):
            with pytest.raises(EncodeError, match=fmt.name):
                enc(x, fmt, False, mode)
        return
    assert enc(math.inf, fmt, False, mode) == _overflow_code(fmt, False)
    if fmt.signed:
        assert enc(-math.inf, fmt, False, mode) == _overflow_code(fmt, True)


@pytest.mark.parametrize("sat", [True, False])
@pytest.mark.parametrize("fmt_name", FMT_NAMES)
def test_nan(fmt_name, sat):
    fmt = FORMATS[fmt_name]
    nans = np.array([np.nan, -np.nan])
    assert math.copysign(1, nans[1]) < 0
    if fmt.specials == "none":
        with pytest.raises(EncodeError, match="NaN"):
            encode(nans, fmt, saturate=sat)
        return
    want = {"float8_e4m3fn": [0x7F, 0xFF], "float8_e5m2": [0x7E, 0xFE], "float8_e4m3fnuz": [0x80, 0x80],
            "float8_e5m2fnuz": [0x80, 0x80], "float8_e4m3b11fnuz": [0x80, 0x80],
            "float8_e8m0fnu": [0xFF, 0xFF], **{f"binary8p{p}": [0x80, 0x80] for p in range(1, 8)}}[fmt_name]
    for mode in DET:
        assert encode(nans, fmt, saturate=sat, rounding=mode).tolist() == want, mode
        assert [oracle.encode(float(v), fmt, sat, mode) for v in nans] == want


@pytest.mark.parametrize("sat", [True, False])
@pytest.mark.parametrize("fmt_name", FMT_NAMES)
def test_zeros_and_underflow(fmt_name, sat):
    """-0 keeps its sign where the format has -0; values rounding to zero keep their sign too."""
    fmt = FORMATS[fmt_name]
    tiny = fmt.min_positive / 8
    for mode in DET:
        got = [enc(v, fmt, sat, mode) for v in (0.0, -0.0, tiny, -tiny)]
        if not fmt.has_zero:  # e8m0: no zero; below the minimum is 0x00, negatives NaN
            assert got == [0x00 if sat else 0xFF, 0x00 if sat else 0xFF, 0x00, 0xFF], mode
            continue
        neg_zero = fmt.sign_mask if fmt.has_negative_zero else 0
        assert got[:2] == [0, neg_zero], mode
        want_pos = 1 if mode in ("rup", "rto") else 0
        want_neg = (1 | fmt.sign_mask) if mode in ("rdown", "rto") else neg_zero
        assert got[2:] == [want_pos, want_neg], mode


def test_specific_zero_vectors():
    assert enc(-1e-9, "float8_e4m3fn") == 0x80
    assert enc(-1e-9, "float8_e4m3fnuz") == 0x00
    assert enc(-0.0, "float8_e5m2fnuz") == 0x00
    assert enc(-0.0, "float4_e2m1fn") == 0x8
    assert enc(-0.0, "float6_e3m2fn") == 0x20


@pytest.mark.parametrize("fmt_name", [n for n in FMT_NAMES if FORMATS[n].has_subnormals])
def test_subnormals_every_mode(fmt_name):
    """Every subnormal code, and the points between them (quarter, tie, three quarters)."""
    fmt = FORMATS[fmt_name]
    first_normal = 1 << fmt.mantissa_bits
    step = oracle.grid(fmt).mags[1]
    for k in range(first_normal):
        for frac in (0, 0.25, 0.5, 0.75):
            for neg in (False, True):
                x = float((k + frac) * step) * (-1 if neg else 1)
                for mode in DET:
                    for sat in (True, False):
                        assert enc(x, fmt, sat, mode) == oracle.encode(x, fmt, sat, mode), (x, mode, sat)
        assert enc(float(k * step), fmt) == k  # exact subnormals
    half = float(step / 2)  # tie between 0 (even) and code 1
    assert [enc(half, fmt, True, m) for m in DET] == [0, 1, 0, 1, 0, 1]
    three_halves = float(3 * step / 2)  # tie between codes 1 and 2
    assert [enc(three_halves, fmt, True, m) for m in DET] == [2, 2, 1, 2, 1, 1]


@pytest.mark.parametrize("sat", [True, False])
def test_unsigned_e8m0(sat):
    f = "float8_e8m0fnu"
    assert [enc(v, f, sat) for v in (1.0, 2.0, 0.5, 2.0 ** 127, 2.0 ** -127)] == [127, 128, 126, 254, 0]
    assert [enc(v, f, sat) for v in (-1.0, -2.0 ** -130)] == [0xFF, 0xFF]
    # rne ties to the even CODE: 1.5 lies between 1 (code 127) and 2 (128), 3 between 2 (128) and 4 (129)
    assert [enc(v, f, sat, "rne") for v in (1.5, 3.0, 0.75)] == [128, 128, 126]
    assert [enc(v, f, sat, "rna") for v in (1.5, 3.0, 0.75)] == [128, 129, 127]
    assert enc(2.0 ** -140, f, sat, "rup") == 0  # nothing smaller than the minimum exists
    assert enc(1.5 * 2.0 ** 127, f, sat, "rne") == 254  # tie: 0xFE is even, 0xFF (2**128) odd


# --- directed modes on ordinary values ------------------------------------------------------
@pytest.mark.parametrize("fmt_name", FMT_NAMES)
def test_each_mode_on_midpoints(fmt_name):
    """Between two normal codes: below, at and above the midpoint, both signs, hand-derived."""
    fmt = FORMATS[fmt_name]
    g = oracle.grid(fmt)
    i = g.max_code // 2 + 1  # an ordinary code in the middle
    lo, hi = g.mags[i], g.mags[i + 1]
    even_up = (i + 1) % 2 == 0
    for frac, rel in ((0.25, -1), (0.5, 0), (0.75, 1)):
        x = float(lo + (hi - lo) * frac)
        nearest_up = rel > 0 or (rel == 0 and even_up)
        want = {"rne": i + nearest_up, "rna": i + (rel >= 0), "rtz": i, "rup": i + 1, "rdown": i,
                "rto": i if i % 2 else i + 1}
        for mode, code in want.items():
            assert enc(x, fmt, True, mode) == code, (x, mode)
        if fmt.signed:
            neg = dict(want, rup=i, rdown=i + 1)
            for mode, code in neg.items():
                assert enc(-x, fmt, True, mode) == code | fmt.sign_mask, (-x, mode)


# --- REFERENCE.md vectors -----------------------------------------------------------------
# Section 2.2 inputs and the rows whose policy equals fp8ref's (onnx sat=1 -> saturate=True,
# onnx sat=0 / ml_dtypes (non-SAT RNE) -> saturate=False).
REF_INPUTS = [448, 464, 465, 480, 1e6, math.inf, -math.inf, math.nan, -math.nan, -0.0, 57344, 61440, 240, 248,
              2 ** -10, 2 ** -17]
REF_ROWS = {
    ("float8_e4m3fn", True): "7e 7e 7e 7e 7e 7e fe 7f ff 80 7e 7e 77 78 00 00",
    ("float8_e4m3fn", False): "7e 7e 7f 7f 7f 7f ff 7f ff 80 7f 7f 77 78 00 00",
    ("float8_e5m2", False): "5f 5f 5f 60 7c 7c fc 7e fe 80 7b 7c 5c 5c 14 00",
    ("float8_e5m2", True): "5f 5f 5f 60 7b 7b fb 7e fe 80 7b 7b 5c 5c 14 00",
    ("float8_e4m3fnuz", False): "80 80 80 80 80 80 80 80 80 00 80 80 7f 80 01 00",
    ("float8_e4m3fnuz", True): "7f 7f 7f 7f 7f 7f ff 80 80 00 7f 7f 7f 7f 01 00",
    ("float8_e5m2fnuz", False): "63 63 63 64 80 80 80 80 80 00 7f 80 60 60 18 01",
    ("float8_e5m2fnuz", True): "63 63 63 64 7f 7f ff 80 80 00 7f 7f 60 60 18 01",
}


@pytest.mark.parametrize("fmt_name,sat", list(REF_ROWS))
def test_reference_2_2_rows(fmt_name, sat):
    x = np.array(REF_INPUTS, dtype=np.float32)
    assert np.signbit(x[8]) and not np.signbit(x[7])  # NaN, -NaN
    want = [int(h, 16) for h in REF_ROWS[fmt_name, sat].split()]
    assert encode(x, fmt_name, saturate=sat).tolist() == want
    assert [oracle.encode(float(v), FORMATS[fmt_name], sat) for v in x] == want


BOUNDARY = [  # REFERENCE.md section 2.1, non-SAT RNE
    ("float8_e4m3fn", 464.0, 0x7E), ("float8_e4m3fn", 464.0001, 0x7F),
    ("float8_e4m3fn", 2 ** -10, 0x00), ("float8_e4m3fn", 2 ** -10 * (1 + 2 ** -23), 0x01),
    ("float8_e4m3fn", 3 * 2 ** -10, 0x02), ("float8_e4m3fn", 5 * 2 ** -10, 0x02),
    ("float8_e5m2", 61439.0, 0x7B), ("float8_e5m2", 61440.0, 0x7C), ("float8_e5m2", 65504.0, 0x7C),
    ("float8_e4m3fnuz", 247.99, 0x7F), ("float8_e4m3fnuz", 248.0, 0x80), ("float8_e5m2fnuz", 61440.0, 0x80),
    ("float8_e4m3fn", float.fromhex("0x0.94p-6"), 0x05),  # -> 0x0.Ap-6 = 5 * 2**-9
    ("float8_e5m2", float.fromhex("0x0.A8p-14"), 0x03),  # -> 0x0.Cp-14 = 3 * 2**-16
]


@pytest.mark.parametrize("fmt_name,x,code", BOUNDARY)
def test_reference_2_1_boundaries(fmt_name, x, code):
    x32 = np.array([x], dtype=np.float32)
    assert oracle.encode(float(x32[0]), FORMATS[fmt_name], False) == code
    assert int(encode(x32, fmt_name, saturate=False)[0]) == code


DOUBLE_ROUNDING = [  # REFERENCE.md section 2.4: (format, float64 input, exact code, code via float32)
    ("float8_e4m3fn", 1 + 2 ** -4 + 2 ** -30, 0x39, 0x38),  # 1.125 exact; 1.0 via f32
    ("float8_e4m3fn", -431.99999999999994, 0xFD, 0xFE),  # -416 exact; -448 via f32
    ("float8_e5m2", 1 + 2 ** -3 + 2 ** -30, 0x3D, 0x3C),  # 1.25 exact; 1.0 via f32
]


@pytest.mark.parametrize("fmt_name,x,exact,via_f32", DOUBLE_ROUNDING)
def test_float64_rounds_once(fmt_name, x, exact, via_f32):
    fmt = FORMATS[fmt_name]
    assert oracle.encode(x, fmt) == exact
    assert oracle.encode(float(np.float32(x)), fmt) == via_f32
    assert int(encode(np.array([x]), fmt)[0]) == exact
    assert int(encode(torch.tensor([x], dtype=torch.float64), fmt)[0]) == exact
    assert int(encode(np.array([x], dtype=np.float32), fmt)[0]) == via_f32
    assert float(oracle.decode(exact, fmt)) == {0x39: 1.125, 0xFD: -416.0, 0x3D: 1.25}[exact]


# --- user-defined formats -----------------------------------------------------------------
USER_FORMATS = [
    FloatFormat("user_e3m4", 3, 4, 3, "fn"),
    FloatFormat("user_e2m5", 2, 5, 1, "fn"),
    FloatFormat("user_e4m3_ieee", 4, 3, 7, "ieee"),
    FloatFormat("user_e5m3_unsigned", 5, 3, 15, "fn", signed=False),
    FloatFormat("user_e3m3_fnuz", 3, 3, 4, "fnuz"),
    FloatFormat("user_e2m2_none", 2, 2, 1, "none"),
    FloatFormat("user_e4m4_nozero", 4, 4, 7, "fn", signed=False, has_zero=False),
]
PROBES = np.concatenate([
    np.arange(1 << 16, dtype=np.uint16)[::3].view(np.float16).astype(np.float64),
    np.random.default_rng(7).standard_normal(3000) * 2.0 ** np.random.default_rng(8).integers(-12, 12, 3000),
])


@pytest.mark.parametrize("fmt", USER_FORMATS, ids=lambda f: f.name)
def test_user_format_end_to_end(fmt):
    codes = np.arange(fmt.n_codes, dtype=np.uint8)
    got = decode(codes, fmt)
    want = [oracle.decode_float(int(c), fmt) for c in codes]
    for c, g, w in zip(codes, got.tolist(), want):
        assert (math.isnan(g) and math.isnan(w) and math.copysign(1, g) == math.copysign(1, w)) or \
            (g == w and math.copysign(1, g) == math.copysign(1, w)), (hex(c), g, w)
    x = PROBES[~np.isnan(PROBES)] if fmt.specials == "none" else PROBES
    x = x[np.abs(x) != np.inf] if fmt.specials == "none" else x
    table = oracle.encode_table(x.tolist(), fmt)
    for (mode, sat), want_codes in table.items():
        ok = np.array(want_codes) >= 0
        got_codes = encode(x[ok], fmt, saturate=sat, rounding=mode)
        bad = np.flatnonzero(got_codes != np.array(want_codes)[ok])
        assert bad.size == 0, (mode, sat, x[ok][bad[:5]], got_codes[bad[:5]], np.array(want_codes)[ok][bad[:5]])
    finite = codes[np.isfinite(got)]
    for mode in DET:
        assert np.array_equal(encode(got[np.isfinite(got)], fmt, rounding=mode), finite)


# --- bad input ----------------------------------------------------------------------------
def test_unknown_format_name_suggests():
    with pytest.raises(UnknownFormatError, match=r"'float8_e4m3'.*float8_e4m3fn"):
        encode(np.zeros(2, np.float32), "float8_e4m3")
    with pytest.raises(UnknownFormatError, match="fp8_e5m2"):
        decode(np.zeros(2, np.uint8), "fp8_e5m2")


@pytest.mark.parametrize("x", [np.zeros(3, np.int32), np.zeros(3, bool), np.zeros(3, np.complex64),
                               torch.zeros(3, dtype=torch.int32), torch.zeros(3, dtype=torch.bool),
                               torch.zeros(3, dtype=torch.complex64), np.zeros(3, np.uint8)],
                         ids=lambda x: f"{type(x).__module__.split('.')[0]}-{x.dtype}")
def test_non_float_input_dtype(x):
    name = str(x.dtype).replace("torch.", "")
    with pytest.raises(InputTypeError, match=rf"(?s){name}.*|float16.*{name}"):
        encode(x, "float8_e4m3fn")


def test_non_array_input():
    with pytest.raises(InputTypeError, match="list"):
        encode([1.0, 2.0], "float8_e4m3fn")


@pytest.mark.parametrize("codes", [np.zeros(3, np.int32), np.zeros(3, np.int8), np.zeros(3, np.float32),
                                   torch.zeros(3, dtype=torch.int16), torch.zeros(3, dtype=torch.float32)],
                         ids=lambda c: str(c.dtype))
def test_codes_must_be_uint8(codes):
    name = str(codes.dtype).replace("torch.", "")
    with pytest.raises(InputTypeError, match=rf"(?s)uint8.*{name}|{name}.*uint8"):
        decode(codes, "float8_e4m3fn")


@pytest.mark.parametrize("fmt_name,bad", [("float4_e2m1fn", 16), ("float4_e2m1fn", 255),
                                          ("float6_e2m3fn", 64), ("float6_e3m2fn", 0x80)])
def test_codes_out_of_range(fmt_name, bad):
    with pytest.raises(FormatError, match=rf"{fmt_name}.*{bad:#04x}"):
        decode(np.array([0, bad], np.uint8), fmt_name)
    decode(np.array([0, FORMATS[fmt_name].n_codes - 1], np.uint8), fmt_name)  # the top code is fine


@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_random_bits_errors(lib):
    x = np.linspace(-3, 3, 12, dtype=np.float32).reshape(3, 4)
    mk = (lambda a: a) if lib == "numpy" else torch.from_numpy
    x = mk(x)
    with pytest.raises(InputTypeError, match=r"random_bits.*\(3, 4\).*\(4, 3\)"):
        encode(x, "float8_e4m3fn", rounding="stochastic", random_bits=mk(np.zeros((4, 3), np.uint8)))
    with pytest.raises(InputTypeError, match=r"random_bits.*\(3, 4\).*\(12,\)"):
        encode(x, "float8_e4m3fn", rounding="stochastic", random_bits=mk(np.zeros(12, np.uint8)))
    for bad in (np.zeros((3, 4), np.int8), np.zeros((3, 4), np.float32), np.zeros((3, 4), np.int32)):
        with pytest.raises(InputTypeError, match=rf"random_bits.*uint8.*{bad.dtype}"):
            encode(x, "float8_e4m3fn", rounding="stochastic", random_bits=mk(bad))
    with pytest.raises(InputTypeError, match="random_bits.*stochastic"):
        encode(x, "float8_e4m3fn", rounding="stochastic")
    for mode in DET:
        with pytest.raises(InputTypeError, match=rf"random_bits.*{mode}"):
            encode(x, "float8_e4m3fn", rounding=mode, random_bits=mk(np.zeros((3, 4), np.uint8)))


def test_unknown_rounding_mode():
    with pytest.raises(FormatError, match=r"rounding.*rne.*'nearest'"):
        encode(np.zeros(2, np.float32), "float8_e4m3fn", rounding="nearest")


@pytest.mark.parametrize("kwargs,match", [
    (dict(exponent_bits=5, mantissa_bits=3, bias=15), "at most 8 bits.*E5.*M3"),
    (dict(exponent_bits=0, mantissa_bits=3, bias=1), "exponent_bits must be >= 1, got 0"),
    (dict(exponent_bits=4, mantissa_bits=-1, bias=7), "mantissa_bits must be >= 0, got -1"),
    (dict(exponent_bits=4, mantissa_bits=3, bias=7.0), "bias must be an int, got 7.0"),
    (dict(exponent_bits=4, mantissa_bits=3, bias=7, specials="ocp"), "specials must be one of.*'ocp'"),
    (dict(exponent_bits=5, mantissa_bits=0, bias=15, specials="ieee"), "'ieee'.*E5M0"),
    (dict(exponent_bits=4, mantissa_bits=3, bias=7, specials="fnuz", signed=False), "sign bit"),
    (dict(exponent_bits=1, mantissa_bits=0, bias=0, specials="fn"), "no finite nonzero"),
    (dict(exponent_bits=4, mantissa_bits=3, bias=5000), "bias 5000"),
    (dict(exponent_bits=4, mantissa_bits=3, bias=7, has_zero=False), "without zero.*signed=True"),
])
def test_impossible_format_parameters(kwargs, match):
    with pytest.raises(FormatError, match=rf"'bad'.*{match}"):
        FloatFormat("bad", **kwargs)


# --- array plumbing -----------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(), (0,), (2, 0, 3), (2, 3, 4)])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_library_and_shape_preserved(shape, dtype):
    rng = np.random.default_rng(1)
    x64 = rng.standard_normal(shape) * 50
    want = np.array([oracle.encode(float(v), FORMATS["float8_e4m3fn"]) for v in
                     np.asarray(x64, dtype=dtype if dtype != "bfloat16" else ml_dtypes.bfloat16).ravel()
                     .astype(np.float64)], dtype=np.uint8).reshape(shape)
    npdt = ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype
    xn = np.asarray(x64).astype(npdt)
    got_n = encode(xn, "float8_e4m3fn")
    assert isinstance(got_n, np.ndarray) and got_n.dtype == np.uint8 and got_n.shape == shape
    assert np.array_equal(got_n, want)
    xt = torch.from_numpy(np.asarray(x64)).to(getattr(torch, dtype))
    got_t = encode(xt, "float8_e4m3fn")
    assert isinstance(got_t, torch.Tensor) and got_t.dtype == torch.uint8 and tuple(got_t.shape) == shape
    assert np.array_equal(got_t.numpy(), want)
    back_n, back_t = decode(got_n, "float8_e4m3fn"), decode(got_t, "float8_e4m3fn")
    assert isinstance(back_n, np.ndarray) and back_n.shape == shape and back_n.dtype == np.float32
    assert isinstance(back_t, torch.Tensor) and tuple(back_t.shape) == shape and back_t.dtype == torch.float32


def test_non_contiguous_torch_input():
    base = torch.linspace(-500, 500, 24, dtype=torch.float32).reshape(4, 6)
    for view in (base.t(), base[:, ::2], base[::2, 1::3].t()):
        assert not view.is_contiguous()
        got = encode(view, "float8_e4m3fn", rounding="rtz")
        exact = view.to(torch.float64).ravel().tolist()
        want = [oracle.encode(v, FORMATS["float8_e4m3fn"], True, "rtz") for v in exact]
        assert tuple(got.shape) == tuple(view.shape) and got.ravel().tolist() == want
        codes = got.t()  # non-contiguous codes decode too
        assert decode(codes, "float8_e4m3fn").tolist() == decode(codes.contiguous(), "float8_e4m3fn").tolist()


def test_non_contiguous_numpy_input():
    base = np.linspace(-500, 500, 24, dtype=np.float64).reshape(4, 6)
    view = base[:, ::2].T
    want = [oracle.encode(float(v), FORMATS["float8_e5m2"]) for v in view.ravel()]
    assert encode(view, "float8_e5m2").ravel().tolist() == want


def test_out_is_written_and_returned():
    x = np.array([[1.0, -2.5], [448.0, 1e-3]], dtype=np.float32)
    want = np.array([[oracle.encode(float(v), FORMATS["float8_e4m3fn"]) for v in row] for row in x], np.uint8)
    out = np.full(x.shape, 0xAA, np.uint8)
    assert encode(x, "float8_e4m3fn", out=out) is out and np.array_equal(out, want)
    out_t = torch.full(x.shape, 0xAA, dtype=torch.uint8)
    assert encode(torch.from_numpy(x), "float8_e4m3fn", out=out_t) is out_t
    assert np.array_equal(out_t.numpy(), want)
    vals = np.zeros(x.shape, np.float32)
    assert decode(want, "float8_e4m3fn", out=vals) is vals
    assert vals.tolist() == [[float(oracle.decode(int(c), FORMATS["float8_e4m3fn"])) for c in r] for r in want]
    vals_t = torch.zeros(x.shape, dtype=torch.float32)
    assert decode(torch.from_numpy(want), "float8_e4m3fn", out=vals_t) is vals_t
    assert vals_t.numpy().tolist() == vals.tolist()


def test_out_wrong_dtype_or_shape():
    x = np.ones((2, 2), np.float32)
    with pytest.raises(InputTypeError, match="out.*uint8"):
        encode(x, "float8_e4m3fn", out=np.zeros((2, 2), np.int8))
    with pytest.raises(InputTypeError, match=r"out.*\(2, 2\)"):
        encode(x, "float8_e4m3fn", out=np.zeros((4,), np.uint8))
    with pytest.raises(InputTypeError, match="out"):
        encode(torch.from_numpy(x), "float8_e4m3fn", out=np.zeros((2, 2), np.uint8))
