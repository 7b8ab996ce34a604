"""The exact model's fast path (fp8ref/matmul/exact_fast.py) against the general path of exact.py
(the previous implementation, kept as fallback) and the Fraction oracle of test_matmul.py.

Bytes are compared (float64 bit patterns of the rounded values, or uint8 codes), so signed zeros
and NaN payloads count. Problems are drawn so that the fast path's shortcuts are attacked:
cancellation to exact zero, results on and next to rounding midpoints of the output format,
subnormal outputs, overflow, non-finite biases, K-blocks of every length.
"""

from __future__ import annotations

import inspect
import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fp8ref import FORMATS
from fp8ref.errors import FormatError
from fp8ref.matmul import exact_fast
from fp8ref.matmul.epilogue import CODE_ROUNDINGS, CodeOut, _decide_bound, _decide_sum
from fp8ref.matmul.exact import _exact
from fp8ref.matmul.exact_fast import _fast_exact, _stage
from fp8ref.matmul.operands import _canonical_scales
from fp8ref.rounding import OUT_FORMATS
from tests.support.matmul_oracle import OUT, fraction_oracle, round_fraction

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# format pairs whose whole code spans need one integer piece for the K drawn below (K <= 24;
# e5m2 x e4m3 only up to K = 8, and e5m2 x e5m2 never: the general path runs, see below)
FAST_PAIRS = [("float8_e4m3fn", "float8_e4m3fn"), ("float8_e4m3fnuz", "float8_e4m3fn"),
              ("float8_e4m3b11fnuz", "float8_e4m3fnuz"), ("float6_e2m3fn", "float8_e4m3fn"),
              ("float6_e3m2fn", "float6_e2m3fn"), ("float4_e2m1fn", "float8_e5m2"),
              ("float8_e5m2", "float8_e4m3fn")]
FINITE = {n: [c for c in range(FORMATS[n].n_codes) if FORMATS[n].exact_value(c) is not None] for n in FORMATS}
scales32 = st.one_of(
    st.floats(min_value=2.0 ** -149, max_value=2.0 ** 100, width=32, allow_subnormal=True),
    st.integers(-149, 127).map(lambda e: float(np.float32(2.0 ** e))),
    st.floats(min_value=0.25, max_value=4.0, width=32),
)
CODE_OUTS = ["float8_e4m3fn", "float8_e5m2", "float4_e2m1fn"]


def bits(x) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(x, np.float64)).view(np.uint64)


def both(p):
    """(fast result, general result) of one drawn problem in canonical form."""
    sa, sb, bk = _canonical_scales(p["sa"].astype(np.float64), p["sb"].astype(np.float64), p["a"].shape[0],
                                   p["a"].shape[1], p["b"].shape[1], p["bk"], p["bn"])
    args = (p["a"], p["b"], FORMATS[p["fa"]], FORMATS[p["fb"]], sa, sb, bk, p["bias"], p["out"])
    return _fast_exact(*args), _exact(*args)


def assert_same(fast, general, out):
    """Same bit patterns: rounded values, or for code outputs the representatives the codec
    encodes (each is a function of the exact value alone: docs/matmul.md, "Narrow outputs")."""
    assert fast is not None, "the fast path declined a problem it covers"
    np.testing.assert_array_equal(bits(fast), bits(general))


@st.composite
def outputs(draw):
    if draw(st.booleans()):
        return OUT_FORMATS[draw(st.sampled_from(list(OUT)))]
    fmt = FORMATS[draw(st.sampled_from(CODE_OUTS))]
    scale = draw(st.one_of(st.none(), st.floats(2.0 ** -20, 2.0 ** 20, width=32)))
    return CodeOut(fmt, draw(st.booleans()), draw(st.sampled_from(CODE_ROUNDINGS)), scale,
                   draw(st.sampled_from(["divide", "multiply"])))


def codes(draw, fmt, shape):
    pool = FINITE[fmt]
    if draw(st.booleans()):  # the ends of the format: zero, subnormals, the largest magnitudes
        pool = pool[:4] + pool[-4:] + [c for c in range(FORMATS[fmt].n_codes)
                                       if c in FINITE[fmt] and c & FORMATS[fmt].sign_mask][-4:]
    flat = draw(st.lists(st.sampled_from(pool), min_size=int(np.prod(shape)), max_size=int(np.prod(shape))))
    return np.array(flat, np.uint8).reshape(shape)


def negate(c: np.ndarray, fmt: str) -> np.ndarray:
    f = FORMATS[fmt]
    flipped = c ^ np.uint8(f.sign_mask)
    return np.where(np.vectorize(lambda x: f.exact_value(int(x)) == 0)(c), c, flipped).astype(np.uint8)


@st.composite
def problems(draw, max_k=24):
    fa, fb = draw(st.sampled_from(FAST_PAIRS))
    if draw(st.booleans()):
        fa, fb = fb, fa
    M, N = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    K = draw(st.integers(0, 8 if "float8_e5m2" in (fa, fb) else max_k))
    a, b = codes(draw, fa, (M, K)), codes(draw, fb, (K, N))
    if K and K <= 4 and draw(st.booleans()):  # cancellation: the negated pairs appended, sum exactly 0
        a, b = np.concatenate([a, negate(a, fa)], axis=1), np.concatenate([b, b], axis=0)
        K *= 2
    layout = draw(st.sampled_from(["tensor", "row", "block"]))
    bk, bn = draw(st.sampled_from([1, 2, 3, 5, 16])), draw(st.integers(1, 3))
    kb, nb = max(1, -(-K // bk)), -(-N // bn)
    shape_a, shape_b = {"tensor": ((), ()), "row": ((M, 1), (1, N)), "block": ((M, kb), (kb, nb))}[layout]
    draw_scales = lambda shape: np.array(draw(st.lists(scales32, min_size=int(np.prod(shape)),  # noqa: E731
                                                       max_size=int(np.prod(shape)))), np.float32).reshape(shape)
    sa, sb = draw_scales(shape_a), draw_scales(shape_b)
    bias = None
    if draw(st.booleans()):
        finite = st.floats(width=32, allow_nan=False, allow_infinity=False)
        special = st.sampled_from([math.inf, -math.inf, math.nan, 0.0, -0.0, 2.0 ** -140])
        bias = np.array(draw(st.lists(st.one_of(finite, special), min_size=N, max_size=N)), np.float32)
        bias = bias.astype(np.float64)
    return dict(a=a, b=b, sa=sa, sb=sb, fa=fa, fb=fb, bias=bias, bk=bk, bn=bn, out=draw(outputs()))


@SETTINGS
@given(problems())
def test_fast_path_equals_general_path(p):
    fast, general = both(p)
    assert_same(fast, general, p["out"])


@st.composite
def near_midpoints(draw, max_n=3):
    """x = bias + s * (1 + d): s is half a unit in the last place of the output at the bias, so x
    sits on a rounding midpoint (d = 0) or a few units of 2**-18 s beside it; per tensor, per row
    or per K-block (block_k 1: every product its own block)."""
    out = draw(st.sampled_from(list(OUT)))
    precision, emin, _ = OUT[out]
    N = draw(st.integers(1, max_n))
    e = draw(st.lists(st.integers(emin + 2, 60), min_size=N, max_size=N))
    sig = draw(st.lists(st.integers(2 ** (precision - 1), 2 ** precision - 1), min_size=N, max_size=N))
    sign = draw(st.lists(st.sampled_from([1, -1]), min_size=N, max_size=N))
    bias = np.array([s * m * 2.0 ** (x - precision + 1) for s, m, x in zip(sign, sig, e)])
    half_ulp = np.array([2.0 ** (x - precision) for x in e])
    layout = draw(st.sampled_from(["row", "block"]))
    # a = [1, t], b = [[+-1], [u]]: the dot product is +-1 + t*u, t*u from the smallest e4m3 codes
    f = FORMATS["float8_e4m3fn"]
    tiny = [c for c in FINITE["float8_e4m3fn"] if 0 < f.exact_value(c) < 2 ** -6]
    one, minus_one = 0x38, 0xB8  # 1.0 and -1.0 in e4m3fn
    a = np.array([[one, draw(st.sampled_from([0] + tiny))]], np.uint8)
    b = np.array([[draw(st.sampled_from([one, minus_one])) for _ in range(N)],
                  [draw(st.sampled_from([0] + tiny + [c | 0x80 for c in tiny])) for _ in range(N)]], np.uint8)
    if layout == "row":
        sa, sb, bk = np.ones((1, 1), np.float32), half_ulp.astype(np.float32).reshape(1, N), 2
    else:
        sa, sb, bk = np.ones((1, 2), np.float32), np.repeat(half_ulp.astype(np.float32)[None, :], 2, axis=0), 1
    return dict(a=a, b=b, sa=sa, sb=sb, fa="float8_e4m3fn", fb="float8_e4m3fn", bias=bias, bk=bk, bn=1,
                out=OUT_FORMATS[out], name=out)


@SETTINGS
@given(near_midpoints())
def test_ties_and_near_ties_against_the_fraction_oracle(p):
    fast, general = both(p)
    assert_same(fast, general, p["out"])
    ref = fraction_oracle(p["a"], p["b"], p["sa"], p["sb"], bias=p["bias"], block_k=p["bk"], block_n=1)
    expect = np.vectorize(lambda x: round_fraction(x, p["name"]), otypes=[np.float64])(ref)
    np.testing.assert_array_equal(bits(fast), bits(expect))


@SETTINGS
@given(near_midpoints(max_n=21))
def test_ties_and_near_ties_in_the_c_epilogues_vector_lanes(p):
    """The same, 8 to 21 columns: the C epilogue's 8-wide body and its scalar end both see ties."""
    test_ties_and_near_ties_against_the_fraction_oracle.hypothesis.inner_test(p)


def test_a_midpoint_rounds_to_even_and_a_hair_above_rounds_up():
    """x = 1 + 2**-24 (a float32 tie: 1.0) and 1 + 2**-24 (1 + 2**-18) (up: 1 + 2**-23), from a
    per-tensor scale of 2**-24 on a dot product of 1 and 1 + 2**-18."""
    f32 = OUT_FORMATS["float32"]
    one, tiny = 0x38, 0x01  # 1.0, 2**-9
    a = np.array([[one, 0], [one, tiny]], np.uint8)
    b = np.array([[one], [tiny]], np.uint8)
    s = np.full((1, 1), 2.0 ** -24)
    got = _fast_exact(a, b, FORMATS["float8_e4m3fn"], FORMATS["float8_e4m3fn"], s, np.ones((1, 1)), 2,
                      np.array([1.0]), f32)
    assert got.reshape(-1).tolist() == [1.0, 1.0 + 2.0 ** -23]


@SETTINGS
@given(problems(max_k=300))
def test_long_k_and_many_blocks(p):
    fast, general = both(p)
    assert_same(fast, general, p["out"])


def weight_record(b: np.ndarray):
    """b (K, N) as linear gives a weight record to the exact model: the transposed view of a
    ``DecodedCodes`` of the (N, K) codes, row-major (the layout of the few-row lookup product)."""
    from fp8ref.matmul import DecodedCodes

    return DecodedCodes(np.ascontiguousarray(b.T), keep=False).T


@SETTINGS
@given(problems(max_k=300))
def test_few_row_lookup_product_of_a_weight_record_equals_general_path(p):
    """M <= 8 with a weight record: the lookup loop (per K-block sums for blocked scales, each
    row's blocks in turn) against the general path, every layout, bias and output."""
    sa, sb, bk = _canonical_scales(p["sa"].astype(np.float64), p["sb"].astype(np.float64), p["a"].shape[0],
                                   p["a"].shape[1], p["b"].shape[1], p["bk"], p["bn"])
    rest = (sa, sb, bk, p["bias"], p["out"])
    fa, fb = FORMATS[p["fa"]], FORMATS[p["fb"]]
    assert_same(_fast_exact(p["a"], weight_record(p["b"]), fa, fb, *rest), _exact(p["a"], p["b"], fa, fb, *rest),
                p["out"])


def test_a_blocked_decode_step_uses_the_lookup_product_and_keeps_only_block_norms(monkeypatch):
    """K-blocked scales at M = 1 with a weight record: no whole decode per call (the block norms of b
    decoded once and kept, (KB, N) float64), the same bits as the plain codes' GEMM path."""
    if exact_fast.kernels() is None:
        pytest.skip("the lookup product is a C loop")
    rng = np.random.default_rng(3)
    K, N, bk = 1000, 70, 128  # K not a multiple of the block: a short last block
    b = rng.integers(0, 0x7F, (K, N), dtype=np.uint8) ^ rng.choice([0, 0x80], (K, N)).astype(np.uint8)
    a = rng.integers(0, 0x7F, (1, K), dtype=np.uint8)
    kb = -(-K // bk)
    sa = rng.uniform(0.5, 2, (1, kb)).astype(np.float32).astype(np.float64)
    sb = np.repeat(rng.uniform(0.5, 2, (kb, 1)).astype(np.float32).astype(np.float64), N, axis=1)
    e4, out = FORMATS["float8_e4m3fn"], OUT_FORMATS["bfloat16"]
    decodes = []
    real = exact_fast._decode_b
    monkeypatch.setattr(exact_fast, "_decode_b", lambda *x: decodes.append(1) or real(*x))
    rec = weight_record(b)
    want = _exact(a, b, e4, e4, sa, sb, bk, None, out)
    for _ in range(3):
        np.testing.assert_array_equal(bits(_fast_exact(a, rec, e4, e4, sa, sb, bk, None, out)), bits(want))
    assert len(decodes) == 1 and rec.nbytes_kept == 8 * kb * N


@pytest.mark.parametrize("bk", [None, 128])
@pytest.mark.parametrize("M", [1, 3, 8])
def test_the_portable_lookup_and_decode_loops_give_the_same_bits(monkeypatch, M, bk):
    """FP8REF_NO_AVX512 (read at each call) runs the C loops' portable lookup product and decode,
    which a CPU without AVX-512 runs: the same bits as the general path, with and without K-blocks."""
    if exact_fast.kernels() is None:
        pytest.skip("the lookup product is a C loop")
    rng = np.random.default_rng(M)
    K, N = 1000, 37  # K not a multiple of 16 nor of the block: every tail runs
    b = rng.integers(0, 0x7F, (K, N), dtype=np.uint8) ^ rng.choice([0, 0x80], (K, N)).astype(np.uint8)
    a = rng.integers(0, 0x7F, (M, K), dtype=np.uint8)
    kb = 1 if bk is None else -(-K // bk)
    sa = rng.uniform(0.5, 2, (M, kb)).astype(np.float32).astype(np.float64)
    sb = rng.uniform(0.5, 2, (kb, N)).astype(np.float32).astype(np.float64)
    e4, out = FORMATS["float8_e4m3fn"], OUT_FORMATS["float32"]
    want = bits(_exact(a, b, e4, e4, sa, sb, bk or K, None, out))
    got = {}
    for portable in (False, True):
        if portable:
            monkeypatch.setenv("FP8REF_NO_AVX512", "1")
        got[portable] = bits(_fast_exact(a, weight_record(b), e4, e4, sa, sb, bk or K, None, out))
    np.testing.assert_array_equal(got[False], want)
    np.testing.assert_array_equal(got[True], want)


@pytest.mark.parametrize("fa, fb, K", [("float8_e5m2", "float8_e5m2", 4), ("float8_e5m2", "float8_e4m3fn", 9),
                                       ("float8_e4m3fn", "float8_e4m3fn", 2 ** 17 + 1)])
def test_declines_where_one_piece_does_not_cover_the_formats(fa, fb, K):
    """The integer bound over the formats' whole code spans fails: the general path runs."""
    a = np.full((1, K), 0x38, np.uint8)
    b = np.full((K, 1), 0x38, np.uint8)
    one = np.ones((1, 1))
    assert _fast_exact(a, b, FORMATS[fa], FORMATS[fb], one, one, K, None, OUT_FORMATS["float32"]) is None


@pytest.mark.parametrize("code", [0x7F, 0xFF])
def test_declines_on_nan_codes_and_scaled_mm_still_propagates_them(code):
    from fp8ref.matmul import scaled_mm
    a = np.array([[0x38, code]], np.uint8)
    b = np.array([[0x38], [0x00]], np.uint8)  # NaN * 0
    one = np.ones((1, 1))
    e4 = FORMATS["float8_e4m3fn"]
    assert _fast_exact(a, b, e4, e4, one, one, 2, None, OUT_FORMATS["float32"]) is None
    assert np.isnan(scaled_mm(a, b, np.float32(1), np.float32(1))).all()


def test_declines_on_inf_codes_of_e5m2_in_b():
    e5, fp4 = FORMATS["float8_e5m2"], FORMATS["float4_e2m1fn"]
    a = np.array([[0x02]], np.uint8)
    b = np.array([[0x7C]], np.uint8)  # +Inf
    one = np.ones((1, 1))
    assert _fast_exact(a, b, fp4, e5, one, one, 1, None, OUT_FORMATS["float32"]) is None


@pytest.mark.parametrize("name", [n for n in FORMATS if FORMATS[n].has_zero])
def test_staged_float64_values_are_the_exact_values_of_every_code(name, monkeypatch):
    """Both staging routes (the C table loop, vector body and scalar tail, contiguous and strided
    codes; and decode-then-widen) give each finite code's exact value (Fraction from the format's
    definition), bit for bit, signed zeros included."""
    fmt = FORMATS[name]
    finite = np.array(FINITE[name], np.uint8)
    expect = np.array([float(fmt.exact_value(int(c))) for c in finite])
    expect[[fmt.exact_value(int(c)) == 0 and (int(c) & fmt.sign_mask) != 0 for c in finite]] = -0.0
    rows = np.stack([np.roll(finite, r) for r in range(3)])  # 3 rows, each every finite code
    want = np.stack([np.roll(expect, r) for r in range(3)])
    for no_kernels in ("", "1"):
        monkeypatch.setenv("FP8REF_NO_KERNELS", no_kernels)
        for codes in (rows, np.ascontiguousarray(rows.T).T, rows[:, 5:]):  # contiguous, strided, a tail
            got = np.full(codes.shape, 7.0)
            _stage(codes, fmt, "b", got)
            np.testing.assert_array_equal(bits(got), bits(want[:, -codes.shape[1]:]))


@pytest.mark.parametrize("name", ["float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float4_e2m1fn"])
def test_staging_flags_every_non_finite_or_invalid_code_wherever_it_sits(name):
    """One NaN/Inf code anywhere in a row (vector body or tail, contiguous or strided) makes the
    stager decline (_NonFinite); a code past 2**bits raises the general path's FormatError."""
    fmt = FORMATS[name]
    bad = [c for c in range(fmt.n_codes) if fmt.exact_value(c) is None]
    if fmt.bits < 8:
        bad.append(fmt.n_codes)
    for c in bad:
        for pos in (0, 15, 16, 33, 39):
            codes = np.zeros((2, 40), np.uint8)
            codes[1, pos] = c
            for view in (codes, np.ascontiguousarray(codes.T).T):
                if c >= fmt.n_codes:
                    with pytest.raises(FormatError):
                        _stage(view, fmt, "b", np.empty(view.shape))
                else:
                    with pytest.raises(exact_fast._NonFinite):
                        _stage(view, fmt, "b", np.empty(view.shape))


# --- the float64-bit decisions of epilogue.py, against the exact oracle ------------------------------------
finite64 = st.one_of(st.floats(min_value=2.0 ** -300, max_value=2.0 ** 140), st.floats(min_value=-2.0 ** 140,
                                                                                     max_value=-2.0 ** -300))


def near_grid(draw, out):
    """A float64 at, or a few float64 ulps beside, a midpoint or a point of ``out``'s grid."""
    precision, emin, emax = OUT[out]
    e = draw(st.integers(emin - precision - 2, emax + 1))
    m = draw(st.integers(0, 2 ** (precision + 1) - 1))
    base = m * 2.0 ** (e - precision)  # a grid point (m even) or a midpoint (m odd) near 2**e
    k = draw(st.integers(-3, 3))
    # no float64 underflow: the exact model's sums are 0 or above 2**-400 (float32 scales, FP8 values)
    return draw(st.sampled_from([1, -1])) * (base + k * math.ulp(base) if base else k * 2.0 ** -400)


@SETTINGS
@given(st.data())
def test_decide_sum_without_bias_is_right_wherever_it_decides(data):
    """y = fl(x) for an x the oracle knows exactly: x = y + e with |e| < ulp(y)/2."""
    out = data.draw(st.sampled_from(list(OUT)))
    y = np.array([near_grid(data.draw, out) for _ in range(8)])
    e = np.array([data.draw(st.sampled_from([0, 1, -1])) for _ in range(8)])
    c, sure = _decide_sum(y, OUT_FORMATS[out])
    for yi, ei, ci, si in zip(y, e, c, sure):
        x = Fraction(yi) + ei * Fraction(math.ulp(yi)) / 4 if yi else Fraction(0)
        if si:
            assert bits(ci) == bits(round_fraction(x, out)), (yi, ei)


@SETTINGS
@given(st.data())
def test_decide_sum_with_bias_is_right_wherever_it_decides(data):
    """x = p + e + b exactly, p = fl(s T), y = fl(p + b): the oracle sees x."""
    out = data.draw(st.sampled_from(list(OUT)))
    b = np.array([near_grid(data.draw, out) for _ in range(6)])
    p = np.array([data.draw(st.one_of(st.just(0.0), st.sampled_from([-1.0, 1.0]).map(lambda s: s * 2.0 ** -30),
                                      finite64.map(lambda v: v * 2.0 ** -40), st.just(-bi)))
                  for bi in b])
    e = [data.draw(st.sampled_from([0, 1, -1])) * Fraction(math.ulp(pi)) / 4 if pi else Fraction(0) for pi in p]
    y = p + b
    c, sure = _decide_sum(y, OUT_FORMATS[out], p)
    for pi, ei, bi, ci, si in zip(p, e, b, c, sure):
        if si:
            assert bits(ci) == bits(round_fraction(Fraction(pi) + ei + Fraction(bi), out)), (pi, ei, bi)


@SETTINGS
@given(st.data())
def test_decide_bound_is_right_for_both_ends_of_the_interval(data):
    """Where _decide_bound decides, y - bound and y + bound round like y (RNE is monotone, so every
    x between them does too); a decided zero is an exact zero."""
    out = data.draw(st.sampled_from(list(OUT)))
    y = np.array([near_grid(data.draw, out) for _ in range(8)])
    bound = np.array([abs(yi) * data.draw(st.sampled_from([0.0, 2.0 ** -60, 2.0 ** -52, 2.0 ** -40, 2.0 ** -24]))
                      for yi in y])
    c, sure = _decide_bound(y, bound, OUT_FORMATS[out])
    for yi, bi, ci, si in zip(y, bound, c, sure):
        if si:
            for x in (Fraction(yi) - Fraction(bi), Fraction(yi) + Fraction(bi)):
                want = round_fraction(x, out) if x != 0 or bi == 0 else None
                assert want is not None and bits(ci) == bits(want), (yi, bi)


@pytest.mark.parametrize("stream, K, flip", [(False, 1200, False), (True, 1200, False), (True, 1203, False),
                                             (True, 1200, True), (True, 1203, True)])
def test_large_problem_matches_the_general_path_on_every_layout(stream, K, flip, monkeypatch):
    """Sizes where the batched GEMMs, K-chunks and column chunks of the fast path all engage; with
    stream, b's decode into the workspace writes around the cache (threshold lowered to 0), on rows
    that start on a cache line (K = 1200) and rows that mostly do not (1203), b as stored or as a
    (N, K) weight's transposed view."""
    rng = np.random.default_rng(11)
    from fp8ref import _arrays, encode
    streamed = []
    if stream:
        monkeypatch.setattr(_arrays, "STREAM_BYTES", 0)
        stage = exact_fast._stage

        def spy(*args, **kwargs):
            streamed.append(inspect.signature(stage).bind(*args, **kwargs).arguments.get("stream", False))
            return stage(*args, **kwargs)
        monkeypatch.setattr(exact_fast, "_stage", spy)
    M, N = 24, 300
    a = encode(rng.standard_normal((M, K)).astype(np.float32) * 4, "float8_e4m3fn")
    b = encode(rng.standard_normal((K, N)).astype(np.float32) * 4, "float8_e4m3fn")
    if flip:
        b = np.ascontiguousarray(b.T).T
    kb = -(-K // 128)
    layouts = [(np.float32(0.37), np.float32(0.011)),
               (rng.uniform(0.5, 2, (M, 1)).astype(np.float32), rng.uniform(0.5, 2, (1, N)).astype(np.float32)),
               (rng.uniform(0.5, 2, (M, kb)).astype(np.float32), rng.uniform(0.5, 2, (kb, 3)).astype(np.float32))]
    bias = rng.standard_normal(N).astype(np.float32).astype(np.float64)
    e4 = FORMATS["float8_e4m3fn"]
    for sa, sb in layouts:
        SA, SB, bk = _canonical_scales(np.asarray(sa, np.float64), np.asarray(sb, np.float64), M, K, N, 128, 128)
        for out in (OUT_FORMATS["float32"], OUT_FORMATS["bfloat16"], CodeOut(e4, scale=0.5)):
            for bv in (None, bias):
                args = (a, b, e4, e4, SA, SB, bk, bv, out)
                assert_same(_fast_exact(*args), _exact(*args), out)
    assert stream == any(streamed), streamed


def test_small_chunks_cross_every_boundary(monkeypatch):
    """The K-chunks of b, the column chunks of the batched GEMM and the repair steps at their
    smallest: results stay the same bytes."""
    rng = np.random.default_rng(5)
    from fp8ref import encode
    M, K, N = 5, 70, 9
    a = encode(rng.standard_normal((M, K)).astype(np.float32), "float8_e4m3fn")
    b = encode(rng.standard_normal((K, N)).astype(np.float32), "float8_e4m3fn")
    e4 = FORMATS["float8_e4m3fn"]
    expected = []
    cases = [(np.ones((M, 1)), np.ones((1, N)), K), (rng.uniform(1, 2, (M, 5)), rng.uniform(1, 2, (5, N)), 16)]
    for sa, sb, bk in cases:
        expected.append(_exact(a, b, e4, e4, sa, sb, bk, None, OUT_FORMATS["float32"]))
    monkeypatch.setattr(exact_fast, "_REPAIR_BYTES", 8 * K * 2)
    for (sa, sb, bk), want in zip(cases, expected):
        got = _fast_exact(a, b, e4, e4, sa, sb, bk, None, OUT_FORMATS["float32"])
        np.testing.assert_array_equal(bits(got), bits(want))


def all_undecided(epilogue):
    """exact_fast._epilogue, then every element marked undecided with its input kept (the C loop's
    contract), so the Python exact routes take all of them."""
    def run(T, mode, *args, **kw):
        keep = T.copy()
        c, unsure = epilogue(T, mode, *args, **kw)
        if mode == 0:
            c[...] = keep  # the exact TwoProduct route reads T there
        return c, np.ones_like(unsure)
    return run


@pytest.mark.parametrize("kernels", ["", "1"])
@pytest.mark.parametrize("bias", [None, "finite"])
def test_exact_path_alone_gives_the_same_bytes(monkeypatch, bias, kernels):
    """Every element sent to the exact path (nothing decided from float64 bits, nor by the C
    epilogue): the exact TwoProduct / repair route alone reproduces the general path, for all
    three layouts, with the C loops (block sums in C) and without them (numpy)."""
    monkeypatch.setenv("FP8REF_NO_KERNELS", kernels)
    monkeypatch.setattr(exact_fast, "_epilogue", all_undecided(exact_fast._epilogue))
    rng = np.random.default_rng(7)
    from fp8ref import encode
    M, K, N = 6, 40, 7
    a = encode(rng.standard_normal((M, K)).astype(np.float32) * 3, "float8_e4m3fn")
    b = encode(rng.standard_normal((K, N)).astype(np.float32) * 3, "float8_e4m3fn")
    a[0] = 0  # a zero row: exact zeros (+0) through the exact path too
    e4 = FORMATS["float8_e4m3fn"]
    bv = None if bias is None else rng.standard_normal(N).astype(np.float32).astype(np.float64)
    cases = [(np.full((1, 1), 0.3), np.full((1, 1), 0.7), K), (rng.uniform(1, 2, (M, 1)), rng.uniform(1, 2, (1, N)), K),
             (rng.uniform(1, 2, (M, 3)), rng.uniform(1, 2, (3, N)), 16)]
    outs = [OUT_FORMATS[n] for n in OUT]
    want = [[_exact(a, b, e4, e4, sa, sb, bk, bv, out) for out in outs] for sa, sb, bk in cases]

    def undecided(decide):
        def run(y, *args, **kw):
            c, sure = decide(y, *args, **kw)
            return c, np.zeros_like(sure)
        return run

    monkeypatch.setattr(exact_fast, "_decide_sum", undecided(exact_fast._decide_sum))
    monkeypatch.setattr(exact_fast, "_decide_bound", undecided(exact_fast._decide_bound))
    monkeypatch.setattr(exact_fast, "_REPAIR_BYTES", 8 * K * 5)  # several repair steps
    for (sa, sb, bk), row in zip(cases, want):
        for out, w in zip(outs, row):
            np.testing.assert_array_equal(bits(_fast_exact(a, b, e4, e4, sa, sb, bk, bv, out)), bits(w))


@pytest.mark.parametrize("scales", ["tensor", "row"])
def test_column_panels_and_k_chunks_against_the_fraction_oracle(monkeypatch, scales):
    """Panels of 4 columns over N = 11 (a short last panel) and K-chunks of 3 rows over K = 13:
    every result, with and without a bias (one of them -0), float32 and bfloat16 outputs, a column
    of signed-zero products and a row that cancels to exactly zero (+0 by the rule), equals the
    oracle's and the general path's."""
    rng = np.random.default_rng(3)
    from fp8ref import encode
    M, K, N = 3, 13, 11
    a = encode(rng.standard_normal((M, K)).astype(np.float32) * 4, "float8_e4m3fn")
    b = encode(rng.standard_normal((K, N)).astype(np.float32) * 4, "float8_e4m3fn")
    b[:, 9] = np.where(np.arange(K) % 2, 0x80, 0x00)  # +-0: the sum is exactly zero
    b[:, 10] = 0x38  # 1.0 in every row; a[2] cancels it
    a[2] = 0x00
    a[2, :4], a[2, 4:8] = 0x38, 0xB8
    bias = rng.standard_normal(N).astype(np.float32).astype(np.float64)
    bias[9] = -0.0
    if scales == "tensor":
        sa, sb = np.float32(0.37), np.float32(0.011)
    else:
        sa, sb = rng.uniform(0.5, 2, (M, 1)).astype(np.float32), rng.uniform(0.5, 2, (1, N)).astype(np.float32)
    SA, SB, bk = _canonical_scales(np.asarray(sa, np.float64), np.asarray(sb, np.float64), M, K, N, 128, 128)
    e4 = FORMATS["float8_e4m3fn"]
    for bv in (None, bias):
        ref = fraction_oracle(a, b, sa, sb, bias=bv)
        for out in ("float32", "bfloat16"):
            got = _fast_exact(a, b, e4, e4, SA, SB, bk, bv, OUT_FORMATS[out])
            expect = np.vectorize(lambda x, out=out: round_fraction(x, out), otypes=[np.float64])(ref)
            np.testing.assert_array_equal(bits(got), bits(expect))  # an exact zero is +0 (docs/matmul.md)
            np.testing.assert_array_equal(bits(got), bits(_exact(a, b, e4, e4, SA, SB, bk, bv, OUT_FORMATS[out])))


def test_a_non_finite_code_in_the_last_panel_falls_back(monkeypatch):
    """A NaN code in b's last column panel, after earlier panels were multiplied: the fast path
    declines and scaled_mm's result (general path) has NaN exactly in that column."""
    from fp8ref.matmul import scaled_mm
    a = np.full((2, 5), 0x38, np.uint8)
    b = np.full((5, 10), 0x38, np.uint8)
    b[3, 9] = 0x7F  # NaN in e4m3fn
    one = np.ones((1, 1))
    e4 = FORMATS["float8_e4m3fn"]
    assert _fast_exact(a, b, e4, e4, one, one, 5, None, OUT_FORMATS["float32"]) is None
    got = scaled_mm(a, b, np.float32(1), np.float32(1))
    assert np.isnan(got[:, 9]).all() and (got[:, :9] == 5.0).all()


def test_k_at_the_exactness_limit_against_the_fraction_oracle():
    """K = 2**17 (the longest e4m3 x e4m3 K the fast path takes): sums of the largest and the
    smallest products, the float64 GEMM exact at its limit; K + 1 goes to the general path."""
    e4 = FORMATS["float8_e4m3fn"]
    K = 2 ** 17
    a = np.where(np.arange(K) % 3 == 0, 0x7E, 0x01).astype(np.uint8).reshape(1, K)  # 448 and 2**-9
    b = np.stack([np.where(np.arange(K) % 2 == 0, 0x7E, 0x81), np.full(K, 0x01)], axis=1).astype(np.uint8)
    one = np.ones((1, 1))
    got = _fast_exact(a, b, e4, e4, one, one, K, None, OUT_FORMATS["float32"])
    va = np.where(a[0] == 0x7E, Fraction(448), Fraction(1, 512))
    for n in range(2):
        vb = [Fraction(448) if c == 0x7E else Fraction(1, 512) if c == 0x01 else Fraction(-1, 512) for c in b[:, n]]
        x = sum((p * q for p, q in zip(va, vb)), Fraction(0))
        assert bits(got[0, n]) == bits(round_fraction(x, "float32"))
    assert _fast_exact(np.zeros((1, K + 1), np.uint8), np.zeros((K + 1, 1), np.uint8), e4, e4, one, one, K + 1,
                       None, OUT_FORMATS["float32"]) is None


# --- the C loops of the fast path at sizes where their vector bodies, tails and threads engage --------------
def ragged_problem(rng, M, K, N, fa="float8_e4m3fn", fb="float8_e4m3fn"):
    """Codes drawn over every finite code (zeros of both signs, subnormals, the largest values),
    a zero row and a column of signed zeros (exact zero sums: +0), and a row that cancels exactly."""
    a = rng.choice(np.array(FINITE[fa], np.uint8), (M, K))
    b = rng.choice(np.array(FINITE[fb], np.uint8), (K, N))
    a[0] = 0
    b[:, 0] = np.where(np.arange(K) % 2, FORMATS[fb].sign_mask, 0)
    if M > 2 and K >= 2:
        a[1] = 0
        a[1, :2] = FINITE[fa][5], negate(np.array([FINITE[fa][5]], np.uint8), fa)[0]
        b[:2, 1] = FINITE[fb][7]
    return a, b


SHAPES = [(3, 17, 33), (17, 70, 21), (5, 129, 48), (9, 256, 130)]


@pytest.mark.parametrize("M, K, N", SHAPES)
@pytest.mark.parametrize("layout", ["tensor", "row", "block16", "block24", "block128"])
@pytest.mark.parametrize("orient", ["rows", "transposed"])
def test_c_loops_equal_the_general_path_on_ragged_shapes(M, K, N, layout, orient):
    """Every output (float32, bfloat16, float16, FP8 codes), with no bias and with one holding
    -0, +-Inf, NaN and subnormals; block lengths that are and are not multiples of 16 (the staging's
    vector and scalar routes), ragged last blocks and panels; b as rows or as the transposed view of
    a (N, K) weight (linear's)."""
    rng = np.random.default_rng(M * 1000 + K + N)
    a, b = ragged_problem(rng, M, K, N)
    if orient == "transposed":
        b = np.ascontiguousarray(b.T).T
    bk = {"tensor": K, "row": K, "block16": 16, "block24": 24, "block128": 128}[layout]
    kb = -(-K // bk)
    if layout == "tensor":
        sa, sb = np.full((1, 1), 0.37), np.full((1, 1), 2.0 ** -7)
    elif layout == "row":
        sa, sb = rng.uniform(0.5, 2, (M, 1)), rng.uniform(2.0 ** -20, 1, (1, N))
    else:
        sa, sb = rng.uniform(0.5, 2, (M, kb)), rng.uniform(2.0 ** -10, 1, (kb, -(-N // 3)))
    SA, SB, bk = _canonical_scales(sa.astype(np.float32).astype(np.float64), sb.astype(np.float32).astype(np.float64),
                                   M, K, N, bk, 3)
    bias = rng.standard_normal(N).astype(np.float32).astype(np.float64)
    bias[:5] = [-0.0, np.inf, -np.inf, np.nan, 2.0 ** -140][:min(5, N)]
    e4 = FORMATS["float8_e4m3fn"]
    for out in [OUT_FORMATS[n] for n in OUT] + [CodeOut(e4, scale=0.5)]:
        for bv in (None, bias):
            args = (a, b, e4, e4, SA, SB, bk, bv, out)
            assert_same(_fast_exact(*args), _exact(*args), out)


@pytest.mark.parametrize("layout", ["row", "block"])
def test_c_loops_against_the_fraction_oracle_with_signed_zeros(layout):
    """The C epilogue and staging on a 7 x 40 x 19 problem against the Fraction oracle, bfloat16
    and float16 outputs: a zero row and a column of +-0 products give +0 (an exact zero), every
    other element the oracle's rounding."""
    rng = np.random.default_rng(21)
    M, K, N = 7, 40, 19
    a, b = ragged_problem(rng, M, K, N)
    if layout == "row":
        sa, sb, bk = rng.uniform(0.5, 2, (M, 1)).astype(np.float32), rng.uniform(0.5, 2, (1, N)).astype(np.float32), 128
    else:
        sa = rng.uniform(0.5, 2, (M, 3)).astype(np.float32)
        sb, bk = rng.uniform(0.5, 2, (3, -(-N // 8))).astype(np.float32), 16
    SA, SB, bk_ = _canonical_scales(sa.astype(np.float64), sb.astype(np.float64), M, K, N, bk, 8)
    e4 = FORMATS["float8_e4m3fn"]
    ref = fraction_oracle(a, b, sa, sb, block_k=bk, block_n=8)
    for out in ("bfloat16", "float16", "float32"):
        got = _fast_exact(a, b, e4, e4, SA, SB, bk_, None, OUT_FORMATS[out])
        expect = np.vectorize(lambda x, out=out: round_fraction(x, out), otypes=[np.float64])(ref)
        np.testing.assert_array_equal(bits(got), bits(expect))
    assert (bits(got[0]) == 0).all() and (bits(got[:, 0]) == 0).all()  # +0, not -0


@pytest.mark.parametrize("layout", ["row", "block"])
def test_one_and_two_threads_give_the_same_bytes(monkeypatch, layout):
    """Every C loop split into pieces (threshold lowered to 1), one thread and two: same bytes
    (and the same as the general path), the block sums of the repair included."""
    torch = pytest.importorskip("torch")
    import fp8ref._native as native
    monkeypatch.setattr(native, "_PARALLEL_MIN", 1)
    rng = np.random.default_rng(4)
    M, K, N = 33, 300, 65
    a, b = ragged_problem(rng, M, K, N)
    if layout == "row":
        SA, SB, bk = rng.uniform(0.5, 2, (M, 1)), rng.uniform(0.5, 2, (1, N)), K
    else:
        SA, SB, bk = _canonical_scales(rng.uniform(0.5, 2, (M, 3)).astype(np.float32).astype(np.float64),
                                       rng.uniform(0.5, 2, (3, 1)).astype(np.float32).astype(np.float64),
                                       M, K, N, 128, 128)
    e4 = FORMATS["float8_e4m3fn"]
    bias = rng.standard_normal(N).astype(np.float32).astype(np.float64)
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for out in (OUT_FORMATS["float32"], OUT_FORMATS["bfloat16"]):
                results.append(bits(_fast_exact(a, b, e4, e4, SA, SB, bk, bias, out)))
            monkeypatch.setattr(exact_fast, "_epilogue", all_undecided(exact_fast._epilogue))
            results.append(bits(_fast_exact(a, b, e4, e4, SA, SB, bk, bias, OUT_FORMATS["float32"])))
            monkeypatch.undo()
            monkeypatch.setattr(native, "_PARALLEL_MIN", 1)
    finally:
        torch.set_num_threads(before)
    for one, two in zip(results[:3], results[3:]):
        np.testing.assert_array_equal(one, two)
    np.testing.assert_array_equal(results[0], bits(_exact(a, b, e4, e4, SA, SB, bk, bias, OUT_FORMATS["float32"])))


@pytest.mark.parametrize("name", ["float8_e4m3fn", "float8_e4m3fnuz"])
def test_block_scaled_staging_flags_non_finite_codes_and_declines(name):
    """A NaN code in b's vector body or tail while the block scales and norms are folded in: the
    fast path declines and scaled_mm gives NaN in exactly that column."""
    from fp8ref.matmul import scaled_mm
    fmt = FORMATS[name]
    nan = [c for c in range(fmt.n_codes) if fmt.exact_value(c) is None][0]
    code_one = [c for c in FINITE[name] if fmt.exact_value(c) == 1][0]
    for col in (3, 37):
        a = np.full((4, 256), code_one, np.uint8)
        b = np.full((256, 40), code_one, np.uint8)
        b[200, col] = nan
        sa = np.full((4, 2), 0.5, np.float32)
        sb = np.full((2, 1), 0.25, np.float32)
        SA, SB, bk = _canonical_scales(sa.astype(np.float64), sb.astype(np.float64), 4, 256, 40, 128, 128)
        assert _fast_exact(a, b, fmt, fmt, SA, SB, bk, None, OUT_FORMATS["float32"]) is None
        got = scaled_mm(a, b, sa, sb, fmt_a=name, fmt_b=name)
        assert np.isnan(got[:, col]).all() and (np.delete(got, col, axis=1) == 256 * 0.125).all()


# --- a few rows times a weight's codes, looked up as they are read (no float64 copy of the weight) ----------
def decoded_product(monkeypatch, *args):
    """_fast_exact with the on-the-fly product switched off: b decoded to float64, then the GEMM."""
    with monkeypatch.context() as m:
        m.setattr(exact_fast, "_lut_product", lambda *a: None)
        return _fast_exact(*args)


@pytest.mark.parametrize("M", [1, 2, 5, 8, 9])
@pytest.mark.parametrize("K", [1, 15, 16, 130, 2048])
@pytest.mark.parametrize("fb", ["float8_e4m3fn", "float6_e3m2fn", "float6_e2m3fn", "float4_e2m1fn"])
def test_few_rows_on_the_fly_equal_the_decoded_weights_product(monkeypatch, M, K, fb):
    """b as linear passes it (the transposed view of a (N, K) weight): the on-the-fly product of
    M <= 8 rows gives the bytes of the decoded-weight GEMM and of the general path (exact.py), for
    every output, with and without a bias; K ragged against the 16-code vector step."""
    rng = np.random.default_rng(M * 7919 + K)
    N = 37
    a, b = ragged_problem(rng, M, K, N, fb=fb)
    b = np.ascontiguousarray(b.T).T
    sa = rng.uniform(0.5, 2, (M, 1)).astype(np.float32).astype(np.float64)
    sb = rng.uniform(2.0 ** -10, 1, (1, N)).astype(np.float32).astype(np.float64)
    bias = rng.standard_normal(N).astype(np.float32).astype(np.float64)
    fa_, fb_ = FORMATS["float8_e4m3fn"], FORMATS[fb]
    calls = []
    product = exact_fast._lut_product
    monkeypatch.setattr(exact_fast, "_lut_product", lambda *x: calls.append(1) or product(*x))
    for out in [OUT_FORMATS[n] for n in OUT] + [CodeOut(FORMATS["float8_e4m3fn"], scale=0.5)]:
        for bv in (None, bias):
            args = (a, b, fa_, fb_, sa, sb, K, bv, out)
            got = _fast_exact(*args)
            assert_same(got, decoded_product(monkeypatch, *args), out)
            assert_same(got, _exact(*args), out)
    if exact_fast.kernels() is not None:
        assert calls  # the on-the-fly product ran (it declines M = 9 itself)


def test_few_rows_on_the_fly_at_the_exactness_limit_against_the_fraction_oracle():
    """K = 2**17 with the weight's layout: every partial sum at the float64 limit, any order exact."""
    e4 = FORMATS["float8_e4m3fn"]
    K = 2 ** 17
    a = np.where(np.arange(K) % 3 == 0, 0x7E, 0x01).astype(np.uint8).reshape(1, K)
    w = np.stack([np.where(np.arange(K) % 2 == 0, 0x7E, 0x81), np.full(K, 0x01)]).astype(np.uint8)  # (N, K)
    one = np.ones((1, 1))
    got = _fast_exact(a, w.T, e4, e4, one, one, K, None, OUT_FORMATS["float32"])
    va = np.where(a[0] == 0x7E, Fraction(448), Fraction(1, 512))
    for n in range(2):
        vb = [Fraction(448) if c == 0x7E else Fraction(1, 512) if c == 0x01 else Fraction(-1, 512) for c in w[n]]
        assert bits(got[0, n]) == bits(round_fraction(sum((p * q for p, q in zip(va, vb)), Fraction(0)), "float32"))


@pytest.mark.parametrize("where", [0, 17, 40])
def test_few_rows_on_the_fly_flags_a_nan_code_in_the_vector_body_or_the_tail(where):
    """A NaN weight code in the vector steps or the scalar tail: the fast path declines (the general
    path propagates it); a code past 2**bits of a narrow format is a FormatError, as on the general path."""
    e4 = FORMATS["float8_e4m3fn"]
    a = np.full((1, 41), 0x38, np.uint8)
    w = np.full((3, 41), 0x38, np.uint8)
    w[1, where] = 0x7F
    one = np.ones((1, 1))
    assert _fast_exact(a, w.T, e4, e4, one, one, 41, None, OUT_FORMATS["float32"]) is None
    w[1, where] = 0x40
    with pytest.raises(FormatError, match="6-bit codes"):
        _fast_exact(a, w.T, e4, FORMATS["float6_e2m3fn"], one, one, 41, None, OUT_FORMATS["float32"])
