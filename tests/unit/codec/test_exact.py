"""fp8ref.exact: each error-free transformation's identity, checked with exact Fractions."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from fp8ref.exact import expansion_sign, extract, grow_expansion, residual_sign, split, two_product, two_sum

# magnitudes where no product or sum overflows or underflows (the documented precondition)
finite = st.floats(min_value=-2.0 ** 400, max_value=2.0 ** 400, allow_nan=False, allow_infinity=False).filter(
    lambda v: v == 0 or abs(v) > 2.0 ** -400)
vectors = st.lists(finite, min_size=1, max_size=12)


def significant_bits(v: float) -> int:
    if v == 0:
        return 0
    n, d = Fraction(v).as_integer_ratio()
    n = abs(n)
    while n % 2 == 0:
        n //= 2
    return n.bit_length()


@given(vectors, vectors)
def test_two_sum(xs, ys):
    a, b = np.array(xs), np.resize(np.array(ys), len(xs))
    s, e = two_sum(a, b)
    for ai, bi, si, ei in zip(a, b, s, e, strict=True):
        assert Fraction(si) + Fraction(ei) == Fraction(ai) + Fraction(bi)
        assert si == float(Fraction(ai) + Fraction(bi))  # s is the rounded sum


@given(vectors)
def test_split(xs):
    a = np.array(xs)
    hi, lo = split(a)
    for ai, h, lw in zip(a, hi, lo, strict=True):
        assert Fraction(h) + Fraction(lw) == Fraction(ai)
        assert significant_bits(h) <= 26 and significant_bits(lw) <= 26


@given(vectors, vectors)
def test_two_product(xs, ys):
    a, b = np.array(xs), np.resize(np.array(ys), len(xs))
    p, e = two_product(a, b)
    for ai, bi, pi, ei in zip(a, b, p, e, strict=True):
        assert Fraction(pi) + Fraction(ei) == Fraction(ai) * Fraction(bi)


@given(st.lists(finite, min_size=1, max_size=10))
def test_grow_expansion_and_sign(xs):
    exp = [np.array([xs[0]])]
    for x in xs[1:]:
        exp = grow_expansion(exp, np.array([x]))
    total = sum(Fraction(x) for x in xs)
    assert sum(Fraction(float(c[0])) for c in exp) == total
    assert expansion_sign(exp)[0] == (total > 0) - (total < 0)


@given(st.lists(st.lists(finite, min_size=3, max_size=3), min_size=1, max_size=30))
def test_extract_sums_exactly(rows):
    terms = np.array(rows)  # (n, 3): three independent sums over axis 0
    taus = extract(terms)
    for j in range(terms.shape[1]):
        assert sum(Fraction(float(t[j])) for t in taus) == sum(Fraction(float(v)) for v in terms[:, j])


def test_extract_catastrophic_cancellation():
    terms = np.array([[2.0 ** 60], [1.0], [-(2.0 ** 60)], [2.0 ** -30]])
    taus = extract(terms)
    assert sum(Fraction(float(t[0])) for t in taus) == 1 + Fraction(1, 2 ** 30)


@given(st.floats(1.0, 2.0 ** 20), st.floats(2.0 ** -20, 2.0 ** 20), st.integers(-3, 3))
def test_residual_sign(x, s, nudge):
    q = x / s
    for _ in range(abs(nudge)):
        q = float(np.nextafter(q, np.inf if nudge > 0 else -np.inf))
    want = Fraction(x) - Fraction(q) * Fraction(s)
    got = residual_sign(np.array([x]), np.array([q]), np.array([s]))[0]
    assert got == (want > 0) - (want < 0)
