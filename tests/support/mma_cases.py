"""Operands for instruction tests: random codes and the crafted edge cases of each datapath."""

from __future__ import annotations

import numpy as np

from fp8ref.formats import FloatFormat


def finite_codes(fmt: FloatFormat) -> np.ndarray:
    return np.array([c for c in range(fmt.n_codes) if fmt.exact_value(c) is not None], np.uint8)


def _code_of(fmt: FloatFormat, value: float) -> int:
    for c in range(fmt.n_codes):
        v = fmt.exact_value(c)
        if v is not None and float(v) == value and not (value == 0 and c & fmt.sign_mask):
            return c
    raise KeyError(value)


def _extremes(fmt: FloatFormat) -> tuple[int, int]:
    """(smallest positive code, largest finite code)."""
    finite = [c for c in finite_codes(fmt) if not c & fmt.sign_mask and fmt.exact_value(int(c)) > 0]
    return min(finite), max(finite, key=lambda c: fmt.exact_value(int(c)))


def _neg(fmt: FloatFormat, code: int) -> int:
    return code | fmt.sign_mask


def _c_values(acc: str) -> list[float]:
    if acc == "float16":
        return [0.0, -0.0, 6.1e-05, -5.96e-08, 1024.0, 65504.0, -65504.0, 0.5, np.inf, -np.inf, np.nan, 3.0]
    return [0.0, -0.0, 1e-45, -1.1754942e-38, 2.0 ** -130, 2.0 ** 30, -(2.0 ** 30), 3.4028235e38, 0.25,
            np.inf, -np.inf, np.nan, 1.0, -7.0]


def crafted(ins, rng) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A (m, k), B (k, n), C (m, n): each row of A is one pattern, column 0 of B is all ones,
    column 1 all minus ones, the others random; C cycles through edge values."""
    m, n, k = ins.m, ins.n, ins.k
    fa, fb = ins.a_fmt, ins.b_fmt
    tiny_a, big_a = _extremes(fa)
    tiny_b, big_b = _extremes(fb)
    one_b = _code_of(fb, 1.0)
    fin_a, fin_b = finite_codes(fa), finite_codes(fb)
    def row(base, **at):
        r = np.array(base, np.uint8)
        for key, code in at.items():
            r[int(key[1:])] = code
        return r

    half = k // 2
    x = rng.choice(fin_a, half)
    pair = np.concatenate([x, x ^ fa.sign_mask])
    rows = [
        pair,  # cancellation against a column of ones
        row(pair, **{f"k{k - 1}": tiny_a}),  # cancellation leaving the smallest product
        row(np.full(k, tiny_a), k0=big_a),  # exponent spread wider than F
        np.where(np.arange(k) % 2 == 1, _neg(fa, tiny_a), tiny_a).astype(np.uint8),  # underflow edge, cancelling
        np.full(k, _neg(fa, 0), np.uint8),  # negative zeros
        np.zeros(k, np.uint8),  # zeros
        row(rng.choice(fin_a, k), k3=big_a, k4=_neg(fa, big_a)),
    ]
    for special in sorted(fa.nan_codes)[:1] + ([fa.inf_code, _neg(fa, fa.inf_code)] if fa.has_inf else []):
        rows.append(row(rng.choice(fin_a, k), k5=special))
    if fa.has_inf:  # +Inf and -Inf in one dot product; Inf times zero
        rows.append(row(np.zeros(k), k0=fa.inf_code, k1=_neg(fa, fa.inf_code)))
        rows.append(row(rng.choice(fin_a, k), k2=fa.inf_code))
    while len(rows) < m:
        rows.append(rng.choice(fin_a, k))
    A = np.stack(rows[:m]).astype(np.uint8)
    B = rng.choice(fin_b, (k, n)).astype(np.uint8)
    B[:, 0] = one_b
    if n > 1:
        B[:, 1] = _neg(fb, one_b)
    if n > 2:
        B[:, 2] = 0
        B[::3, 2] = tiny_b
        B[0, 2] = big_b
    if fb.has_inf and n > 3:
        B[2, 3] = fb.inf_code
    if fb.nan_codes and n > 4:
        B[7, 4] = sorted(fb.nan_codes)[0]
    cv = _c_values(ins.acc)
    C = np.array([[cv[(i * n + j) % len(cv)] for j in range(n)] for i in range(m)], dtype=ins.acc)
    return A, B, C


def random_case(ins, rng, specials: bool):
    fa, fb = ins.a_fmt, ins.b_fmt
    pool_a = np.arange(fa.n_codes, dtype=np.uint8) if specials else finite_codes(fa)
    pool_b = np.arange(fb.n_codes, dtype=np.uint8) if specials else finite_codes(fb)
    A = rng.choice(pool_a, (ins.m, ins.k)).astype(np.uint8)
    B = rng.choice(pool_b, (ins.k, ins.n)).astype(np.uint8)
    span = 20 if ins.acc == "float32" else 8
    C = (rng.standard_normal((ins.m, ins.n)) * 2.0 ** rng.integers(-span, span, (ins.m, ins.n))).astype(ins.acc)
    return A, B, C


def scale_cases(ins, rng):
    """(scale_a, scale_b) pairs that together put every code 0..255 of the scale type in scale_a
    and in scale_b; the partner is random (UE8M0 near 1, so products stay finite)."""
    nb = ins.k // ins.block

    def partner(shape):
        if ins.scale_type == "ue8m0":
            return rng.integers(100, 150, shape).astype(np.uint8)
        return rng.integers(0, 256, shape).astype(np.uint8)

    def sweep(shape, start):
        return ((np.arange(int(np.prod(shape))) + start) % 256).astype(np.uint8).reshape(shape)

    out = [(sweep((ins.m, nb), s), partner((nb, ins.n))) for s in range(0, 256, ins.m * nb)]
    out += [(partner((ins.m, nb)), sweep((nb, ins.n), s)) for s in range(0, 256, nb * ins.n)]
    return out
