"""Properties of fp8ref.matmul (hypothesis): exact == Fraction oracle, the fp32 error bound, and the
documented rule that relates torch._scaled_mm on CPU to fp8ref (docs/matmul.md)."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fp8ref import FORMATS
from fp8ref.matmul import scaled_mm
from tests.support.matmul_oracle import OUT, code_value, fraction_oracle, rounded, same

FMTS = ["float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"]
FINITE = {n: [c for c in range(256) if FORMATS[n].exact_value(c) is not None] for n in FMTS}
SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
U = Fraction(1, 2 ** 24)

# float32 scales over the whole positive range: subnormals, powers of two, near the top
scales32 = st.one_of(
    st.floats(min_value=2.0 ** -149, max_value=float(np.finfo(np.float32).max), width=32, allow_subnormal=True),
    st.integers(-149, 127).map(lambda e: float(np.float32(2.0 ** e))),
    st.floats(min_value=0.25, max_value=4.0, width=32),
)


def codes(draw, fmt, shape, extreme):
    pool = FINITE[fmt]
    if extreme:  # the two ends of the format: subnormals/zero and the largest magnitudes
        pool = pool[:6] + pool[-6:] + [c ^ FORMATS[fmt].sign_mask for c in pool[-3:]
                                       if c ^ FORMATS[fmt].sign_mask in FINITE[fmt]]
    flat = draw(st.lists(st.sampled_from(pool), min_size=int(np.prod(shape)), max_size=int(np.prod(shape))))
    return np.array(flat, np.uint8).reshape(shape)


def negate(c: np.ndarray, fmt) -> np.ndarray:
    """Codes of the negated values (zero stays zero: fnuz has no -0 code)."""
    flipped = c ^ np.uint8(fmt.sign_mask)
    return np.where(np.vectorize(lambda x: fmt.exact_value(int(x)) == 0)(c), c, flipped).astype(np.uint8)


@st.composite
def problems(draw):
    fa, fb = draw(st.sampled_from(FMTS)), draw(st.sampled_from(FMTS))
    M, K, N = draw(st.integers(1, 3)), draw(st.integers(0, 9)), draw(st.integers(1, 3))
    a = codes(draw, fa, (M, K), draw(st.booleans()))
    b = codes(draw, fb, (K, N), draw(st.booleans()))
    if K and draw(st.booleans()):  # cancellation: append the negated pairs, so the sum is exactly 0
        a, b = np.concatenate([a, negate(a, FORMATS[fa])], axis=1), np.concatenate([b, b], axis=0)
        K *= 2
    layout = draw(st.sampled_from(["tensor", "row", "block"]))
    bk, bn = draw(st.integers(1, 4)), draw(st.integers(1, 2))
    kb, nb = max(1, -(-K // bk)), -(-N // bn)
    shape_a, shape_b = {"tensor": ((), ()), "row": ((M, 1), (1, N)), "block": ((M, kb), (kb, nb))}[layout]
    sa = np.array(draw(st.lists(scales32, min_size=int(np.prod(shape_a)), max_size=int(np.prod(shape_a)))),
                  np.float32).reshape(shape_a)
    sb = np.array(draw(st.lists(scales32, min_size=int(np.prod(shape_b)), max_size=int(np.prod(shape_b)))),
                  np.float32).reshape(shape_b)
    bias = None
    if draw(st.booleans()):
        bias = np.array(draw(st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False),
                                      min_size=N, max_size=N)), np.float32)
    return dict(a=a, b=b, sa=sa, sb=sb, fa=FORMATS[fa], fb=FORMATS[fb], bias=bias, bk=bk, bn=bn,
                out=draw(st.sampled_from(list(OUT))))


@SETTINGS
@given(problems())
def test_exact_equals_fraction_oracle(p):
    got = scaled_mm(p["a"], p["b"], p["sa"], p["sb"], bias=p["bias"], out_dtype=p["out"], fmt_a=p["fa"],
                    fmt_b=p["fb"], block_k=p["bk"], block_n=p["bn"])
    ref = fraction_oracle(p["a"], p["b"], p["sa"], p["sb"], p["fa"], p["fb"], p["bias"], p["bk"], p["bn"])
    assert same(np.asarray(got, np.float64), rounded(ref, p["out"]))


@st.composite
def moderate(draw):
    """e4m3fn/e5m2 operands with scales in [2**-20, 2**20]: no overflow, products far from underflow."""
    fa = draw(st.sampled_from(FMTS[:2]))
    M, K, N = draw(st.integers(1, 3)), draw(st.integers(1, 24)), draw(st.integers(1, 3))
    a = codes(draw, fa, (M, K), False)
    b = codes(draw, "float8_e4m3fn", (K, N), False)
    sc = st.floats(min_value=2.0 ** -20, max_value=2.0 ** 20, width=32)
    sa = np.array(draw(st.lists(sc, min_size=M, max_size=M)), np.float32).reshape(M, 1)
    sb = np.array(draw(st.lists(sc, min_size=N, max_size=N)), np.float32).reshape(1, N)
    return a, b, sa, sb, FORMATS[fa]


def abs_products(a, b, sa, sb, fa, m, n):
    return sum(abs(code_value(fa, a[m, k]) * code_value(FORMATS["float8_e4m3fn"], b[k, n]))
               for k in range(a.shape[1])) * Fraction(float(sa[m, 0])) * Fraction(float(sb[0, n]))


@SETTINGS
@given(moderate())
def test_fp32_within_the_classical_bound(problem):
    """K - 1 additions, fp32(sa*sb) and the scaling: K + 1 roundings, |err| <= gamma_{K+1} sum|p|."""
    a, b, sa, sb, fa = problem
    K = a.shape[1]
    got = scaled_mm(a, b, sa, sb, accumulate="fp32", fmt_a=fa)
    ref = fraction_oracle(a, b, sa, sb, fa)
    gamma = (K + 1) * U / (1 - (K + 1) * U)
    for (m, n), x in np.ndenumerate(ref):
        assert abs(Fraction(float(got[m, n])) - x) <= gamma * abs_products(a, b, sa, sb, fa, m, n)


def torch_cpu(a, b, sa, sb, fa):
    ta = torch.from_numpy(a).view(getattr(torch, fa.name))
    tb = torch.from_numpy(np.ascontiguousarray(b.T)).view(torch.float8_e4m3fn).t()  # column-major mat2
    return torch._scaled_mm(ta, tb, torch.from_numpy(sa), torch.from_numpy(sb), out_dtype=torch.float32).numpy()


@SETTINGS
@given(moderate())
def test_torch_cpu_scaled_mm_within_its_bound(problem):
    """torch CPU = fp32(a*sa) @ fp32(b*sb) in BLAS order: 2 operand roundings, a product rounding and
    K - 1 additions (any order, FMA or not) -> |torch - exact| <= gamma_{K+2} sum|p|."""
    a, b, sa, sb, fa = problem
    K = a.shape[1]
    got = torch_cpu(a, b, sa, sb, fa)
    ref = fraction_oracle(a, b, sa, sb, fa)
    gamma = (K + 2) * U / (1 - (K + 2) * U)
    for (m, n), x in np.ndenumerate(ref):
        assert abs(Fraction(float(got[m, n])) - x) <= gamma * abs_products(a, b, sa, sb, fa, m, n)


@SETTINGS
@given(moderate(), st.data())
def test_torch_cpu_scaled_mm_is_bit_exact_when_every_partial_sum_is(problem, data):
    """With power-of-two scales every scaled operand and product is exact; if moreover all products
    lie on one grid 2**g with sum|p| < 2**24 * 2**g, every partial sum in any order is exact, so
    torch's CPU path and fp8ref's exact mode agree bit for bit."""
    a, b, _, _, fa = problem
    M, N = a.shape[0], b.shape[1]
    sa = np.float32(2.0) ** np.array(data.draw(st.lists(st.integers(-8, 8), min_size=M, max_size=M)),
                                     np.float32).reshape(M, 1)
    sb = np.float32(2.0) ** np.array(data.draw(st.lists(st.integers(-8, 8), min_size=N, max_size=N)),
                                     np.float32).reshape(1, N)
    ref = fraction_oracle(a, b, sa, sb, fa)
    got = torch_cpu(a, b, sa, sb, fa)
    mine = scaled_mm(a, b, sa, sb, fmt_a=fa)
    fb = FORMATS["float8_e4m3fn"]
    for (m, n), _ in np.ndenumerate(ref):
        terms = [code_value(fa, a[m, k]) * code_value(fb, b[k, n]) * Fraction(float(sa[m, 0]))
                 * Fraction(float(sb[0, n])) for k in range(a.shape[1])]
        grid = max([t.denominator for t in terms] + [1])
        if sum(abs(t) for t in terms) * grid < 2 ** 24:
            if ref[m, n] == 0:
                # Documented rule (docs/matmul.md): fp8ref's exactly-zero result is +0; torch's BLAS
                # sums the products without a +0 start, so all -0 products give -0 there.
                assert got[m, n] == 0 and not np.signbit(mine[m, n])
            else:
                assert same(got[m, n], mine[m, n])
