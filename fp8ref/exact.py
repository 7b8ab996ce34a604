"""Error-free transformations of float64 values (vectorized over numpy arrays).

Each function returns floats whose exact sum (or sign) equals an exact real quantity, assuming
no overflow and no underflow in the intermediate products (the callers bound their ranges):
TwoSum (Knuth), Veltkamp's split and TwoProduct (Dekker), Shewchuk's Grow-Expansion and the
sign of a nonoverlapping expansion, and Rump, Ogita and Oishi's ExtractVector.
"""

from __future__ import annotations

import math

import numpy as np

_SPLITTER = 134217729.0  # 2**27 + 1


def two_sum(a, b):
    """s + e == a + b exactly, s = fl(a + b) (Knuth)."""
    s = a + b
    bb = s - a
    return s, (a - (s - bb)) + (b - bb)


def split(a):
    """a == hi + lo with both halves of at most 26 significant bits (Veltkamp)."""
    c = _SPLITTER * a
    hi = c - (c - a)
    return hi, a - hi


def two_product(a, b):
    """p + e == a * b exactly, p = fl(a * b) (Dekker; e == 0 when a and b have <= 26 bits)."""
    p = a * b
    ah, al = split(a)
    bh, bl = split(b)
    return p, ((ah * bh - p) + ah * bl + al * bh) + al * bl


def grow_expansion(expansion: list, b) -> list:
    """Shewchuk's Grow-Expansion: a nonoverlapping expansion (increasing magnitude) plus b."""
    out = []
    q = b
    for c in expansion:
        q, h = two_sum(q, c)
        out.append(h)
    out.append(q)
    return out


def expansion_sign(expansion: list) -> np.ndarray:
    """Exact sign of a nonoverlapping expansion: the sign of its largest nonzero component."""
    s = np.zeros(np.shape(expansion[0]))
    for c in expansion:
        s = np.where(c != 0, np.sign(c), s)
    return s


def extract(terms: np.ndarray) -> list:
    """Doubles tau_j with sum(tau) == terms.sum(axis=0) exactly (Rump-Ogita-Oishi ExtractVector,
    repeated until nothing is left). Each tau is a sum computed without any rounding error."""
    m = math.ceil(math.log2(terms.shape[0] + 2))
    taus = []
    p = terms
    while True:
        mu = np.abs(p).max(axis=0)
        if not mu.any():
            return taus or [np.zeros(terms.shape[1:])]
        f, e = np.frexp(mu)
        sigma = np.ldexp(1.0, e - (f == 0.5) + m)  # 2**m * 2**ceil(log2 mu) >= (n + 2) * mu
        q = (sigma + p) - sigma  # p rounded to the grid ulp(sigma)/2: exact
        p = p - q                # exact remainder, |p| <= 2**-53 * sigma
        taus.append(q.sum(axis=0))  # every partial sum is a multiple of 2**-53 sigma below sigma: exact


def residual_sign(x: np.ndarray, q: np.ndarray, s: np.ndarray) -> np.ndarray:
    """sign(x - q*s) exactly where q*s ~ x: q*s = p + err (TwoProduct), x - p exact (Sterbenz);
    NaN (0*inf, inf-inf) -> 0."""
    p, err = two_product(q, s)
    d = (x - p) - err
    return np.sign(np.where(np.isnan(d), 0.0, d))
