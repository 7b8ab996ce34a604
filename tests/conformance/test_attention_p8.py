"""FP8 P before bmm2 (``p_scale``; the golden attention's ``quantize: kvp / qkvp``, suite
fp8-attention-p8): fp8ref.attention against an oracle written here in Python scalars and Fractions
(ml_dtypes' cast for the K/V/Q codes, the Fraction codec oracle for P's codes, an exact bmm2), and
backends that leave P unquantized or quantize it another way failing bit for bit."""

from __future__ import annotations

import math
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest

from fp8ref import attention as ref
from fp8ref.conformance import Backend, run
from fp8ref.errors import BackendError
from fp8ref.golden import load_suite, parse_suite
from fp8ref.golden.ops import OPERATIONS
from fp8ref.golden.suite import cases
from tests.support import oracle
from tests.support.matmul_oracle import round_fraction

E4M3 = "float8_e4m3fn"
OP = OPERATIONS["attention"]
SUITE = parse_suite("""\
suite: attention-p8-meta
seed: 9
operations:
  - op: attention
    dtypes: [bfloat16, float32, float16]
    quantize: [kvp, qkvp]
    causal: [true, false]
    shapes: {1: [[1, 2, 1, 3, 5, 8], [1, 2, 2, 4, 4, 16]]}
""", source="attention-p8-meta.yaml")


def _cases(suite=SUITE):
    return [op.make_case(name, params, entry, suite, 1) for op, entry, name, params in cases(suite, 1)]


def _cast(x, scale) -> np.ndarray:
    """ml_dtypes' e4m3fn cast of fp32(x / s), clamped to +-448 first (saturating), as float64."""
    y = np.clip((np.asarray(x, np.float32) / np.float32(scale)).astype(np.float32), -448, 448)
    return y.astype(ml_dtypes.float8_e4m3fn).astype(np.float64)


def _exp(x: float) -> float:
    """docs/models.md's exp64, one Python float operation at a time."""
    if x == -math.inf:
        return 0.0
    x = max(x, -800.0)
    k = float(round(x * 1.44269504088896338700e+00))  # rint: Python's round is half-to-even
    r = (x - k * 6.93147180369123816490e-01) - k * 1.90821492927058770002e-10
    p = 1.0 / math.factorial(13)
    for n in range(12, -1, -1):
        p = p * r + 1.0 / math.factorial(n)
    return math.ldexp(p, int(k))


def _oracle(case) -> np.ndarray:
    """O in D as float64: bmm1 and softmax in the declared float64 order (Python floats),
    P8 = oracle.encode(P / p_s), then the exact real bmm2 (p_s v_s) sum_j P8_j V8_j, rounded to
    float64 and then to D."""
    p, x = case.params, case.inputs
    B, H, Hkv, Tq, Tk, d = p["shape"]
    k, v = _cast(x["k"], x["k_scale"][0]), _cast(x["v"], x["v_scale"][0])
    q = np.asarray(x["q"], np.float64) if "q_scale" not in x else _cast(x["q"], x["q_scale"][0])
    qs = float(x["q_scale"][0]) if "q_scale" in x else 1.0
    c1 = (qs * float(x["k_scale"][0])) * (1.0 / math.sqrt(d))
    ps, vs = float(x["p_scale"][0]), float(x["v_scale"][0])
    fmt = ref.get_format(E4M3)
    out = np.zeros((B, H, Tq, d))
    for b in range(B):
        for h in range(H):
            g = h // (H // Hkv)
            for i in range(Tq):
                s = []
                for j in range(Tk):
                    a = float(q[b, h, i, 0]) * float(k[b, g, j, 0])
                    for t in range(1, d):
                        a = a + float(q[b, h, i, t]) * float(k[b, g, j, t])
                    s.append(a * c1 if not p["causal"] or j <= i + Tk - Tq else -math.inf)
                m = max(s)
                e = [_exp(sj - m) for sj in s]
                z = e[0]
                for ej in e[1:]:
                    z = z + ej
                p8 = [oracle.decode(oracle.encode(ej / z / ps, fmt), fmt) for ej in e]
                for t in range(d):
                    exact = sum((pj * Fraction(float(v[b, g, j, t])) for j, pj in enumerate(p8)), Fraction(0))
                    o64 = float(exact * Fraction(ps) * Fraction(vs))  # correctly rounded to float64
                    out[b, h, i, t] = round_fraction(Fraction(o64), p["dtype"])
    return out


@pytest.mark.parametrize("case", _cases(), ids=lambda c: c.name)
def test_reference_equals_the_scalar_fraction_oracle(case):
    got = OP.reference(case.params, case.inputs)["out"].astype(np.float64)
    want = _oracle(case)
    assert np.array_equal(got, want)  # values; a zero's sign is IEEE's sum of signed products (not compared)
    assert case.inputs["p_scale"][0] == np.float32(1 / 448)
    # quantizing P changes the result (the test can fail): without it, another output
    no_p = ref.attention(case.inputs["q"], case.inputs["k"], case.inputs["v"], case.inputs["k_scale"][0],
                         case.inputs["v_scale"][0], dtype=case.params["dtype"], causal=case.params["causal"],
                         q_scale=case.inputs["q_scale"][0] if "q_scale" in case.inputs else None)
    assert not np.array_equal(no_p.astype(np.float64), want)


def test_p_codes_saturate_and_an_empty_row_is_zero():
    """p_s = 2**-9. Row 0: three equal keys, P = 1/3, P / p_s = 170.67 -> e4m3 176 (spacing 16 above
    128). Row 1: one key, P = 1, P / p_s = 512 -> 448, saturated. Row 2: every key masked: +0."""
    ps = np.float32(2.0 ** -9)
    q = np.ones((1, 1, 3, 4), np.float32)
    k = np.zeros((1, 1, 3, 4), np.float32)
    v = np.full((1, 1, 3, 4), 2.0, np.float32)  # v / v_s = 4, exact in e4m3
    mask = np.array([[True, True, True], [True, False, False], [False, False, False]])
    o = ref.attention(q, k, v, 1.0, 0.5, dtype="float32", mask=mask, p_scale=ps, unrounded=True)
    c2 = float(ps) * 0.5
    assert o[0, 0, 0].tolist() == [(176.0 * 4 + 176.0 * 4 + 176.0 * 4) * c2] * 4
    assert o[0, 0, 1].tolist() == [448.0 * 4 * c2] * 4
    assert o[0, 0, 2].tolist() == [0.0] * 4 and not np.signbit(o[0, 0, 2]).any()


class _P8(Backend):
    capabilities = {"attention": {"quantize": ("kvp", "qkvp")}}

    def attention(self, q, k, v, k_scale, v_scale, *, q_scale, fmt, causal, p_scale=None):
        out = ref.attention(q, k, v, k_scale[0], v_scale[0], dtype=q.dtype.name, fmt=fmt, causal=causal,
                            q_scale=None if q_scale is None else q_scale[0], p_scale=self.p(p_scale))
        return out.astype(q.dtype)  # float32 values of q's dtype: exact

    def p(self, p_scale):
        return p_scale[0]


class Correct(_P8):
    name = "p8-correct"


class Unquantized(_P8):
    """Leaves P in float64 (an FP8 attention judged as if its P were exact)."""

    name = "p8-unquantized"

    def p(self, p_scale):
        return None


class ScaleOne(_P8):
    """Casts P to e4m3 without its scale (P in [0, 1]: small P flushed, coarse steps)."""

    name = "p8-scale-one"

    def p(self, p_scale):
        return np.float32(1.0)


def test_backends_on_the_shipped_suite():
    suite = load_suite("fp8-attention-p8")
    r = run(Correct(), suite)
    assert r.compared() == len(_cases(suite)) == 36 and r.unexpected == 0
    for bad in (Unquantized(), ScaleOne()):
        r = run(bad, suite)
        assert r.compared() == 36 and sum(1 for x in r.results if x.mismatches) >= 30, bad.name
    r = run("torch", suite)  # torch's adapter has no FP8 P (and the float64 tolerance does not cover it)
    assert {x.status for x in r.results} == {"not-implemented"} and r.unexpected == 0


def test_a_backend_declaring_fp8_p_must_take_p_scale():
    class NoKeyword(Backend):
        name = "p8-no-keyword"
        capabilities = {"attention": {"quantize": ("kv", "kvp")}}

        def attention(self, q, k, v, k_scale, v_scale, *, q_scale, fmt, causal):
            raise AssertionError("not called")

    with pytest.raises(BackendError, match=r"declares attention cases with quantize kvp, which pass p_scale="):
        run(NoKeyword(), SUITE)
