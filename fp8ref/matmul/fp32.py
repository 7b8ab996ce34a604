"""accumulate="fp32" (declared sequential order, optional K-blocks) and "fp32-limited" (an accumulator
of ``mantissa_bits`` fraction bits, truncated after every addition, promoted to fp32 every
``promote_every`` elements). docs/matmul.md defines each order exactly."""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from .._native import kernels, seq_acc_f32
from ..codec import decode
from ..exact import two_sum
from ..formats import FloatFormat
from ..rounding import exponent
from .operands import _check_codes, _code_values


def _blocks(K: int, size: int):
    return [slice(k, min(K, k + size)) for k in range(0, K, size)] or [slice(0, 0)]


def _seq_sum(A: np.ndarray, B: np.ndarray, k0: int, k1: int) -> np.ndarray:
    """part[m, n] = +0, then part = fp32(part + fp32(A[m, k] * B[k, n])) for k = k0 .. k1-1."""
    M, N = A.shape[0], B.shape[1]
    part = np.zeros((M, N), np.float32)
    rows = max(1, min(M, (1 << 16) // max(N, 1)))  # keep the accumulator in cache
    with np.errstate(invalid="ignore", over="ignore"):  # IEEE Inf/NaN arithmetic is the model
        for r0 in range(0, M, rows):
            p = part[r0:r0 + rows]
            tmp = np.empty_like(p)
            for k in range(k0, k1):
                np.multiply(A[r0:r0 + rows, k:k + 1], B[k:k + 1, :], out=tmp)
                np.add(p, tmp, out=p)
    return part


def _products_exact_in_fp32(fa: FloatFormat, fb: FloatFormat) -> bool:
    """Every product of a value of ``fa`` and one of ``fb`` is an fp32 number (significand bits fit
    in 24, no overflow, no underflow below 2**-149): then rounding the product is a no-op and
    fp32(acc + fp32(a*b)) == fma(a, b, acc) bit for bit (NaN/Inf propagate alike)."""
    return (fa.mantissa_bits + fb.mantissa_bits + 2 <= 24 and fa.max * fb.max < 2.0 ** 128
            and fa.min_positive * fb.min_positive >= 2.0 ** -149)


def _fp32(ca, cb, fa, fb, sa, sb, bk, acc_block, scale_order) -> np.ndarray:
    """total = +0; per K-block b: part = +0, part = fp32(part + fp32(a_k * b_k)) for k in order;
    total = fp32(total + fp32(fp32(sa * sb) * part)). 'operands' scales the operands first.
    The C loop (_csrc/matmul.c) and the numpy loop below compute the same bits."""
    M, K = ca.shape
    N = cb.shape[1]
    f32 = np.float32
    operands = scale_order == "operands"
    if operands:
        col = np.minimum(np.arange(K) // bk, sa.shape[1] - 1)
        A = (decode(ca, fa) * sa.astype(f32)[:, col]).astype(f32)
        B = (decode(cb, fb) * sb.astype(f32)[col, :]).astype(f32)
    if kernels() is not None:
        if operands:
            return seq_acc_f32(A, B, None, None, None, None, acc_block, bk)
        _check_codes(ca, fa, "a"), _check_codes(cb, fb, "b")  # codes past the table raise, as decode does
        return seq_acc_f32(np.ascontiguousarray(ca), np.ascontiguousarray(cb), _code_table(fa), _code_table(fb),
                           np.ascontiguousarray(sa, f32), np.ascontiguousarray(sb, f32), acc_block, bk,
                           fused=_products_exact_in_fp32(fa, fb))
    if not operands:
        A, B = decode(ca, fa).astype(f32), decode(cb, fb).astype(f32)
    A, B = np.ascontiguousarray(A), np.ascontiguousarray(B)
    total = np.zeros((M, N), f32)
    for ks in _blocks(K, acc_block):
        part = _seq_sum(A, B, ks.start, ks.stop)
        if not operands:
            blk = min(ks.start // bk, sa.shape[1] - 1)
            s = (sa[:, blk:blk + 1].astype(f32) * sb[blk:blk + 1, :].astype(f32)).astype(f32)
            np.multiply(part, s, out=part)
        np.add(total, part, out=total)
    return total


@lru_cache(maxsize=32)
def _code_table(fmt: FloatFormat) -> np.ndarray:
    """float32 value of each of the 256 byte values (codes past the format's are never read)."""
    table = np.zeros(256, np.float32)
    table[:fmt.n_codes] = _code_values(fmt)
    table.setflags(write=False)
    return table


def _truncate(s: np.ndarray, err: np.ndarray, bits: int) -> np.ndarray:
    """Round the exact value s + err (s = fl(s + err)) toward zero to ``bits`` fraction bits with
    float32's exponent range (subnormal spacing 2**(-126-bits)); beyond float32's range -> +-Inf."""
    a = np.abs(s)
    e = np.where(a == 0, -126, exponent(np.where(a == 0, 1.0, a)))
    u = np.maximum(e, -126) - bits
    t = np.ldexp(np.floor(np.ldexp(a, -u)), u)
    # s on the grid but the exact value is smaller in magnitude: step one grid point toward zero
    below = np.where((a == np.ldexp(1.0, e)) & (e > -126), np.ldexp(1.0, u - 1), np.ldexp(1.0, u))
    t = np.where((t == a) & (a != 0) & (np.sign(err) == -np.sign(s)), t - below, t)
    t = np.copysign(t, s)
    return np.where(np.abs(t) > float(np.finfo(np.float32).max), np.copysign(np.inf, s), t)


def _fp32_limited(A, B, sa, sb, bk, promote_every, mantissa_bits) -> np.ndarray:
    """Per chunk of promote_every k: acc = +0, acc = trunc(acc + a_k * b_k) (exact sum, then
    truncation); total = fp32(total + fp32(fp32(sa * sb) * acc))."""
    M, K = A.shape
    N = B.shape[1]
    A64, B64 = A.astype(np.float64), B.astype(np.float64)
    total = np.zeros((M, N), np.float32)
    for ks in _blocks(K, promote_every):
        acc = np.zeros((M, N))
        for k in range(ks.start, ks.stop):
            prod = A64[:, k:k + 1] * B64[k:k + 1, :]  # exact: two FP8 values
            with np.errstate(invalid="ignore"):
                s, err = two_sum(acc, prod)
                finite = np.isfinite(s)
                acc = np.where(finite, _truncate(np.where(finite, s, 0.0), np.where(finite, err, 0.0),
                                                 mantissa_bits), s)
        blk = min(ks.start // bk, sa.shape[1] - 1)
        s32 = (sa[:, blk:blk + 1].astype(np.float32) * sb[blk:blk + 1, :].astype(np.float32)).astype(np.float32)
        total = (total + (s32 * acc.astype(np.float32)).astype(np.float32)).astype(np.float32)
    return total
