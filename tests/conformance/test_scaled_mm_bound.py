"""The fp32-order bound (fp8ref.golden.judge): it accepts every fp32 summation
order (checked against real fp32 sums in many orders and a Fraction oracle), it catches
broken GEMMs with a minimal counterexample, and torch passes it with no scaled_mm xfail."""

import fnmatch
import io
import random
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest

from fp8ref import codec
from fp8ref.conformance import default_xfails, load_backend, run
from fp8ref.conformance.report import SUMMARY_COLUMNS, mismatch_line, summarize, table
from fp8ref.errors import BackendError
from fp8ref.golden import load_suite, parse_suite
from fp8ref.golden.judge import bound_interval, bound_judge
from tests.support.broken_backends import Fp16AccumulationMM, ReverseOrderMM, TransposedB, WrongScaleB

SHAPES = [[1, 1, 1], [1, 2, 2], [2, 3, 3], [5, 40, 40]]
SUITE = parse_suite(f"""\
suite: mm-meta
seed: 11
operations:
  - op: scaled_mm
    formats: [float8_e4m3fn]
    shapes: {{1: {SHAPES}}}
    scales: [tensor, row]
    out_dtypes: [float32, bfloat16]
    accumulate: [fp32]
    scale_order: [operands]
    bias: [false, true]
""", source="mm-meta.yaml")


def _smallest_failing(result):
    failing = [r for r in result.results if r.mismatches or r.status == "error"]
    return min(failing, key=lambda r: (np.prod(r.params["shape"]), r.case))


@pytest.mark.parametrize("backend, shape", [
    (WrongScaleB(), [1, 1, 1]),      # one product: the scale alone is off by up to 2**-9
    (Fp16AccumulationMM(), [1, 1, 1]),  # one product rounded to 11 bits
    (TransposedB(), [1, 2, 2]),      # a 1x1 b is its own transpose; 2x2 is the smallest that is not
])
def test_broken_gemms_are_caught_with_a_minimal_counterexample(backend, shape):
    result = run(backend, SUITE)
    assert result.exit_code == 1
    assert all(r.status == "compared" for r in result.results)
    first = _smallest_failing(result)
    assert first.params["shape"] == shape, first.case
    m = first.mismatches[0]
    assert m.bound_used > 1 and "fp32-order bound used" in mismatch_line(m, None)
    # no data hides these bugs: every float32 case from 2x3x3 on fails, and at 5x40x40 so does
    # every bfloat16 case (whose 8-bit rounding can absorb a small error in a short sum)
    assert all(r.mismatches for r in result.results
               if r.params["shape"][0] >= 5 or (r.params["shape"][0] >= 2 and r.params["out_dtype"] == "float32"))


def test_a_legitimate_order_passes_and_is_reported_as_in_bound_not_as_matches():
    result = run(ReverseOrderMM(), SUITE)
    assert result.unexpected == 0 and result.exit_code == 0
    row = summarize(result.results, result.xfailed)["scaled_mm"]
    assert row["in_bound"] > 0 and row["mismatches"] == 0
    assert row["exact"] + row["in_bound"] == row["elements"]
    assert 0 < row["bound_used"] <= 1
    text = table({"scaled_mm": row}, SUMMARY_COLUMNS)
    assert "in bound" in text.splitlines()[0] and "bound used" in text.splitlines()[0]


def test_torch_passes_with_no_scaled_mm_xfail():
    xfails = default_xfails("torch")
    suite = load_suite("fp8-static-w8a8")
    names = [r.case for r in run("torch", suite, select=lambda n: n.startswith("scaled_mm.")).results]
    assert not any(fnmatch.fnmatchcase(n, e.pattern) for n in names for e in xfails.entries)
    result = run("torch", suite, select=lambda n: n.startswith("scaled_mm."))  # no xfails at all
    assert result.unexpected == 0 and result.compared() == 16
    assert sum(r.in_bound for r in result.results) > 0  # BLAS's order differs, and it is shown
    assert all(r.rule == "fp32-order bound" for r in result.results if r.status == "compared")


def test_without_the_declaration_torch_is_judged_bit_for_bit():
    """The declared (default) order is still bit-exact against fp8ref's sequential model."""
    torch_be = load_backend("torch")

    class Declared(type(torch_be)):
        accumulation_order = {}

    result = run(Declared(), load_suite("fp8-static-w8a8"),
                 select=lambda n: n == "scaled_mm.float8_e4m3fn.tensor.float32.fp32-operands.16x64x32")
    assert result.unexpected > 0


def test_bad_declaration_and_uncovered_cases():
    class Bad(ReverseOrderMM):
        accumulation_order = {"scaled_mm": "whatever"}

    with pytest.raises(BackendError, match=r"accumulation_order\['scaled_mm'\]: expected one of"):
        run(Bad(), SUITE)

    class Exactish(ReverseOrderMM):
        capabilities = {"scaled_mm": dict(ReverseOrderMM.capabilities["scaled_mm"], accumulate=("exact",),
                                          scale_order=("epilogue",))}

    suite = parse_suite(SUITE.text.replace("accumulate: [fp32]", "accumulate: [exact]"), source="x.yaml")
    r = run(Exactish(), suite)
    assert r.compared() == 0 and "accumulate='fp32' only" in r.results[0].reason


# --- the bound itself, against independent evidence -------------------------------------------
def _random_case(rng, M, K, N, out_dtype, bias):
    a = rng.integers(0, 256, (M, K), dtype=np.uint8)
    b = rng.integers(0, 256, (K, N), dtype=np.uint8)
    a[(a & 0x7F) == 0x7F] = 0x3C  # no NaN codes
    b[(b & 0x7F) == 0x7F] = 0x3C
    sa = (rng.uniform(0.5, 1, (M, 1)) * 2.0 ** rng.integers(-12, 4, (M, 1))).astype(np.float32)
    sb = (rng.uniform(0.5, 1, (1, N)) * 2.0 ** rng.integers(-12, 4, (1, N))).astype(np.float32)
    inputs = {"a": a, "b": b, "scale_a": sa, "scale_b": sb}
    if bias:
        inputs["bias"] = rng.standard_normal(N).astype(np.float32).astype(
            ml_dtypes.bfloat16 if out_dtype == "bfloat16" else np.float32)
    params = {"format": "float8_e4m3fn", "scales": "row", "out_dtype": out_dtype, "accumulate": "fp32",
              "scale_order": "operands", "bias": bias, "shape": [M, K, N]}
    return params, inputs


def _fp32_orders(a32, b32, rng, n_orders):
    """fp32 dot products of one row and column in many orders: sequential, reversed, random
    permutations, pairwise trees, FMA-like (product unrounded), and 8 strided partial sums."""
    K = a32.size
    prods = [np.float32(x) * np.float32(y) for x, y in zip(a32, b32, strict=True)]
    out = []
    for t in range(n_orders):
        idx = list(range(K))
        if t == 1:
            idx.reverse()
        elif t > 1:
            rng.shuffle(idx)
        terms = [prods[i] for i in idx]
        acc = np.float32(0)
        for p in terms:
            acc = np.float32(acc + p)
        out.append(acc)
        while len(terms) > 1:  # pairwise tree of the same permutation
            terms = [np.float32(terms[i] + terms[i + 1]) if i + 1 < len(terms) else terms[i]
                     for i in range(0, len(terms), 2)]
        out.append(terms[0])
        fma = np.float32(0)  # fused: the product enters the sum unrounded
        for i in idx:
            fma = np.float32(float(fma) + float(a32[i]) * float(b32[i]))
        out.append(fma)
        lanes = [np.float32(0)] * 8
        for j, i in enumerate(idx):
            lanes[j % 8] = np.float32(lanes[j % 8] + prods[i])
        acc = np.float32(0)
        for x in lanes:
            acc = np.float32(acc + x)
        out.append(acc)
    return out


@pytest.mark.parametrize("out_dtype, bias", [("float32", False), ("float32", True), ("bfloat16", True)])
def test_every_fp32_order_lies_inside_the_bound(out_dtype, bias):
    """Real fp32 arithmetic in 4 x 12 orders per element, never outside the bound; and the
    bound is used (the worst order uses a visible fraction of it, so it is not vacuous)."""
    rng = np.random.default_rng(3)
    prng = random.Random(3)
    worst = 0.0
    for K in (1, 2, 7, 64, 300):
        params, inputs = _random_case(rng, 3, K, 4, out_dtype, bias)
        a32 = codec.decode(inputs["a"], "float8_e4m3fn") * inputs["scale_a"]
        b32 = codec.decode(inputs["b"], "float8_e4m3fn") * inputs["scale_b"]
        iv = bound_interval(params, inputs)
        assert iv["domain"].all()
        for m in range(3):
            for n in range(4):
                for s in _fp32_orders(a32[m].astype(np.float32), b32[:, n].astype(np.float32), prng, 12):
                    v = s if not bias else np.float32(s + np.float32(inputs["bias"][n]))
                    got = np.array([[v]], np.float32)
                    if out_dtype == "bfloat16":
                        got = got.astype(ml_dtypes.bfloat16)
                    full = np.zeros((3, 4), got.dtype)
                    full[m, n] = got[0, 0]
                    j = bound_judge(params, inputs, full)
                    assert j["within"][m, n], (K, m, n, v, iv["lo"][m, n], iv["hi"][m, n])
                    worst = max(worst, float(j["used"][m, n]))
    assert worst <= 1.0
    if out_dtype == "float32":  # bfloat16's rounding absorbs every order's difference here
        assert worst > 0.01


def test_interval_matches_a_fraction_oracle():
    """x and E recomputed with Fractions from the codes and scales; the interval is exactly
    [r(x - E), r(x + E)] (r = RNE to fp32 of the Fraction, then to out_dtype) up to the
    float64 slack, which must not move either end by more than one output ulp."""
    rng = np.random.default_rng(5)
    for out_dtype in ("float32", "bfloat16"):
        params, inputs = _random_case(rng, 2, 33, 3, out_dtype, True)
        iv = bound_interval(params, inputs)
        av = codec.decode(inputs["a"], "float8_e4m3fn").astype(np.float64)
        bv = codec.decode(inputs["b"], "float8_e4m3fn").astype(np.float64)
        g = Fraction(35, 2 ** 24 - 35)
        for m in range(2):
            for n in range(3):
                s = Fraction(float(inputs["scale_a"][m, 0])) * Fraction(float(inputs["scale_b"][0, n]))
                prods = [Fraction(float(av[m, k])) * Fraction(float(bv[k, n])) for k in range(33)]
                x = s * sum(prods) + Fraction(float(inputs["bias"][n]))
                e = g * abs(s) * sum(abs(p) for p in prods)
                assert abs(Fraction(float(iv["x"][m, n])) - x) <= abs(x) * Fraction(1, 2 ** 52)
                assert Fraction(float(iv["err"][m, n])) >= e  # never below the proven bound
                # and above it by no more than the declared float64 slack (docs/conformance.md)
                slack = (abs(s) * sum(abs(p) for p in prods) + abs(Fraction(float(inputs["bias"][n])))) \
                    * Fraction(33 + 8, 2 ** 49)
                fma = Fraction(33, 2 ** 149)
                assert Fraction(float(iv["err"][m, n])) <= e * (1 + Fraction(1, 2 ** 39)) + slack + fma
                for end, val in (("lo", x - e), ("hi", x + e)):
                    want = np.array([float(val)], np.float64)  # float64 of the Fraction: one rounding
                    r = np.float32(want[0])
                    r = float(r.astype(ml_dtypes.bfloat16)) if out_dtype == "bfloat16" else float(r)
                    assert iv[end][m, n] == r or abs(iv[end][m, n] - r) <= abs(r) * 2.0 ** -7, (end, m, n)


def test_report_line_and_summary_distinguish_in_bound(capsys):
    from fp8ref.conformance.report import print_results

    result = run(WrongScaleB(), SUITE)
    out = io.StringIO()
    print_results(result.results, header="h", is_xfailed=result.xfailed, out=out, max_errors=1)
    assert "fp32-order bound used" in out.getvalue()
    row = summarize(result.results, result.xfailed)["scaled_mm"]
    assert row["mismatches"] > 0 and row["bound_used"] > 1
