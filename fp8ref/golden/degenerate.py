"""Crafted degenerate inputs: the ``patterns`` of quantize, dequantize, scaled_mm and linear cases.

Random heavy-tailed tensors almost never hold the inputs where producers and kernels break: an
all-zero block (0/0), a block with one non-zero element, a block whose outlier flushes the rest,
a block of input-dtype subnormals, a partial last block along K, scales that are neither 1 nor a
power of two. Each pattern here builds one of them deterministically from a seeded stream
(``values.Stream``), on the case's own shape; docs/golden.md says what each one catches.

A *block* is one reduction set of the case's granularity (one scale): the whole tensor for
per-tensor scales, a row for per-channel/token, a group, a 2-D tile, an MX (32) or NVFP4 (16) block.
"""

from __future__ import annotations

import numpy as np

from .. import codec
from ..formats import get_format
from ..scaling import expand, layout
from . import values

RANDOM = "random"
# quantize / dequantize: every block of x is one of these
QUANT_PATTERNS = ("zero-tensor", "zero-blocks", "single-nonzero", "single-outlier", "denormal-only", "nan-scale",
                  "k-tail")
# quantize / dequantize patterns for a peer's own edge, named by the suite that needs them (mxfp4: gguf's
# float32 np.log2 of an amax just below a power of two returns that power), outside the degenerate suite
EDGE_PATTERNS = ("amax-below-power-of-two",)
GEMM_PATTERNS = ("zero-blocks", "single-nonzero", "single-outlier", "denormal-only", "scales")
LINEAR_PATTERNS = ("zero-blocks", "single-outlier", "denormal-only", "k-tail")
NAN_SCALE_AMAX = 0.5  # tensor amax of the nan-scale pattern: 448 / 0.5 = 896 >= 480
OUTLIER = 2.0 ** 15  # beside heavy-tailed values clipped to +-2**4: 2**-11 of the block amax at most
TAIL_BOOST = 2.0 ** 8
# (mantissa bits, smallest normal exponent) of the input dtypes: their subnormals are m * 2**(emin - bits)
_SUBNORMAL = {"bfloat16": (7, -126), "float16": (10, -14), "float32": (23, -126)}


def k_block(qa) -> int | None:
    """Length along K of one block of ``qa``'s granularity, None where a block spans all of K."""
    return {"group": qa.group_size, "block": (qa.block_shape or (0, 0))[1], "mx": 32, "nvfp4": 16}.get(qa.granularity)


def has_k_tail(shape, qa) -> bool:
    g = k_block(qa)
    return g is not None and shape[-1] % g != 0


def applies(pattern: str, shape, qa) -> bool:
    """Whether ``pattern`` means anything for this granularity and shape (k-tail needs a partial
    last block along K; nan-scale is about the E4M3 block scales of NVFP4)."""
    if pattern == "k-tail":
        return has_k_tail(shape, qa)
    if pattern == "nan-scale":
        return qa.granularity == "nvfp4"
    return True


def refused(pattern: str, recipe) -> str | None:
    """Why ``recipe`` has no golden output for ``pattern`` (the case is left out), or None.

    A multiplier NVFP4 global scale (ModelOpt's fp32(A) / 2688) is 0 for an all-zero tensor, so every
    block quotient is 0 / 0 = NaN (E4M3 scale byte 0x7F) and E2M1 has no NaN code: quantize refuses.
    A float recipe with no rule for a zero amax (no amax or scale minimum, no substitution) stores
    scale 0 for a zero block and computes 0 * (1/0) or 0 / 0 = NaN there, whose sign is the
    machine's (x86 negative, ARM positive): no bytes that are the same on every machine. (torchao's
    NVFP4 recipe models the multiplier of a zero tensor as 1, not torchao's 0: no NaN.)"""
    zero = pattern == "zero-tensor" or pattern == "zero-blocks"
    if (pattern == "zero-tensor" and getattr(recipe, "global_meaning", None) == "multiplier"
            and recipe.global_rule not in ("zero-to-one", "none")):
        return "the global multiplier of an all-zero tensor is 0: block scales 0/0 = NaN, no E2M1 code for NaN"
    no_zero_rule = hasattr(recipe, "zero_amax_scale") and all(
        getattr(recipe, f) is None for f in ("amax_min", "scale_min", "zero_amax_scale", "zero_stored_scale"))
    if zero and no_zero_rule:
        return "no rule for a zero amax: scale 0 and 0/0 = NaN codes, whose sign bit differs between machines"
    if pattern == "denormal-only" and no_zero_rule and recipe.scale_store_dtype == "model":
        return "D(amax/max) underflows to a stored scale 0 (torchao): codes x/0 clamped, a scale no linear accepts"
    return None


def block_ids(shape, qa) -> np.ndarray:
    """The index of each element's block (its scale, in the scale array's flat order)."""
    kw = {"group_size": qa.group_size, "block_shape": qa.block_shape}
    sshape = layout(shape, qa.granularity, **kw)
    ids = np.arange(int(np.prod(sshape)), dtype=np.int64).reshape(sshape)
    return np.broadcast_to(expand(ids, shape, qa.granularity, **kw), shape)


def _signed_zeros(stream, n: int) -> np.ndarray:
    """+0.0 and -0.0, half each (the sign of zero is a rule producers differ on)."""
    return np.where(stream.bits(n, 8) & 1, -0.0, 0.0)


def _one_per_block(stream, ids: np.ndarray) -> np.ndarray:
    """A mask with exactly one element per block, at a seeded position."""
    flat = ids.reshape(-1)
    order = np.argsort(flat, kind="stable")
    counts = np.bincount(flat)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    pick = order[starts + stream.integers(len(counts), 0, 1 << 30) % counts]
    mask = np.zeros(flat.size, bool)
    mask[pick] = True
    return mask.reshape(ids.shape)


def _subnormals(stream, n: int, dtype: str) -> np.ndarray:
    """Subnormals of the input dtype (float64, exact in it), both signs, never zero."""
    bits, emin = _SUBNORMAL[dtype]
    m = stream.integers(n, 1, 1 << bits).astype(np.float64)
    return np.where(stream.bits(n, 8) & 1, -1.0, 1.0) * np.ldexp(m, emin - bits)


def quant_values(pattern: str, stream, shape, dtype: str, qa) -> np.ndarray:
    """x for a quantize case: ``pattern`` applied block by block, as the input dtype."""
    n = int(np.prod(shape))
    ids = block_ids(shape, qa)
    v = values.heavy_tailed(stream, n, outlier_rate=0.0).reshape(shape)
    if pattern == "zero-tensor":
        v = _signed_zeros(stream, n).reshape(shape)
    elif pattern == "zero-blocks":  # every third block (the whole tensor for per-tensor scales)
        v = np.where(ids % 3 == 0, _signed_zeros(stream, n).reshape(shape), v)
    elif pattern == "single-nonzero":  # the block's amax is its one element
        v = np.where(_one_per_block(stream, ids), v, _signed_zeros(stream, n).reshape(shape))
    elif pattern == "single-outlier":  # one element 2**15 beside values within +-16: they flush toward 0
        v = np.where(_one_per_block(stream, ids), np.copysign(OUTLIER, v), np.clip(v, -16, 16))
    elif pattern == "denormal-only":  # every other block holds subnormals of the input dtype only
        v = np.where(ids % 2 == 0, _subnormals(stream, n, dtype).reshape(shape), v)
    elif pattern == "nan-scale":
        # blocks 0, 4, 8, ... all zero; the tensor amax is exactly NAN_SCALE_AMAX. Substituting a
        # zero block's amax (1.0) instead of its quotient gives the block scale 1 / (6 * A / 2688)
        # = 448 / A = 896: NaN (0x7F) in a non-saturating E4M3 cast.
        v = np.where(ids % 4 == 0, _signed_zeros(stream, n).reshape(shape), v)
        v = v / np.abs(v).max() * NAN_SCALE_AMAX
        v.reshape(-1)[np.argmax(np.abs(v))] = -NAN_SCALE_AMAX
    elif pattern == "amax-below-power-of-two":  # each block's amax is the dtype's largest value below 2**k
        k = stream.integers(int(ids.max()) + 1, 4, 16)[ids]  # a power per block (float16 tops out at 2**16)
        precision = {"bfloat16": 8, "float16": 11, "float32": 24}[dtype]
        top = np.ldexp(1.0 - 2.0 ** -precision, k)
        rest = np.clip(v, -15, 15) * np.ldexp(1.0, k - 4)  # within +-(15/16) 2**k: below the amax
        v = np.where(_one_per_block(stream, ids), np.copysign(top, v), rest)
    elif pattern == "k-tail":  # the partial last block along K is 2**8 x larger than the others
        g = k_block(qa)
        tail = np.arange(shape[-1]) >= shape[-1] - shape[-1] % g
        v = np.where(tail, v * TAIL_BOOST, v)
    else:
        raise ValueError(f"unknown quantize pattern {pattern!r}")
    return values.from_bits(values.round_to(v, dtype), dtype)


# --- scaled_mm: codes and scales ---------------------------------------------------------------
def row_codes(v: np.ndarray, fmt) -> tuple[np.ndarray, np.ndarray]:
    """Codes of v quantized per row by fp32(amax / max) (a zero row: codes of its zeros, scale 0
    until the caller substitutes one), and the per-row scales."""
    amax = np.abs(v).max(axis=1, keepdims=True)
    scale = (amax / np.float64(get_format(fmt).max)).astype(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1.0))
    return codec.encode((v / safe).astype(np.float32), fmt), scale


def _subnormal_codes(stream, shape, fmt) -> np.ndarray:
    f = get_format(fmt)
    n = int(np.prod(shape))
    mant = stream.integers(n, 1, 1 << f.mantissa_bits).astype(np.uint8)
    return (mant | np.where(stream.bits(n, 8) & 1, f.sign_mask, 0).astype(np.uint8)).reshape(shape)


def row_scales(n: int, num: int, den: int, e: int, step: int) -> np.ndarray:
    """fp32(num / den * 2**e * (1 + i / step)) for i < n: distinct, neither 1 nor a power of two
    (num * (step + i) / (den * step) is one only if num divides den * step * 2**j: it does not)."""
    i = np.arange(n, dtype=np.float64)
    return (num / den * 2.0 ** e * (1 + i / step)).astype(np.float32)


def gemm_operands(pattern: str, stream, M: int, K: int, N: int, fmt: str) -> dict[str, np.ndarray]:
    """a (M, K), b^T (N, K) codes and their per-row scales (M, 1), (N, 1) for a scaled_mm case."""
    def rows(r):
        return values.heavy_tailed(stream, r * K, outlier_rate=0.0).reshape(r, K)

    va, vb = rows(M), rows(N)
    if pattern == "zero-blocks":  # zero rows of a (scale 2**-23, Quark's) and columns of b (scale 1.0, ModelOpt's)
        za, zb = np.arange(M) % 3 == 0, np.arange(N) % 3 == 1
        va[za], vb[zb] = _signed_zeros(stream, int(za.sum()) * K).reshape(-1, K), 0.0
        a, sa = row_codes(va, fmt)
        bt, sb = row_codes(vb, fmt)
        sa[za], sb[zb] = np.float32(2.0 ** -23), 1.0  # scaled_mm takes positive scales: the producers' zero rules
        bt[zb] = np.where(stream.bits(int(zb.sum()) * K, 8) & 1, 0x80, 0).astype(np.uint8).reshape(-1, K)
        return {"a": a, "bt": bt, "sa": sa, "sb": sb}
    if pattern == "single-nonzero":
        one_a = _one_per_block(stream, np.broadcast_to(np.arange(M)[:, None], (M, K)))
        one_b = _one_per_block(stream, np.broadcast_to(np.arange(N)[:, None], (N, K)))
        va, vb = np.where(one_a, va, 0.0), np.where(one_b, vb, 0.0)
    elif pattern == "single-outlier":
        va = np.where(_one_per_block(stream, np.broadcast_to(np.arange(M)[:, None], (M, K))),
                      np.copysign(OUTLIER, va), np.clip(va, -16, 16))
    elif pattern == "denormal-only":  # every code subnormal; scales random (normal) per row
        a, bt = _subnormal_codes(stream, (M, K), fmt), _subnormal_codes(stream, (N, K), fmt)
        return {"a": a, "bt": bt, "sa": row_codes(va, fmt)[1], "sb": row_codes(vb, fmt)[1]}
    elif pattern == "scales":  # a scale_a / scale_b swap or a dropped scale changes every element
        a, bt = row_codes(va, fmt)[0], row_codes(vb, fmt)[0]
        # different progressions: sa[m] sb[n] != sa[n] sb[m] for m != n (equal steps would cancel a swap)
        return {"a": a, "bt": bt, "sa": row_scales(M, 3, 7, -5, 8).reshape(M, 1),
                "sb": row_scales(N, 5, 13, -7, 3).reshape(N, 1)}
    elif pattern != RANDOM:
        raise ValueError(f"unknown scaled_mm pattern {pattern!r}")
    a, sa = row_codes(va, fmt)
    bt, sb = row_codes(vb, fmt)
    return {"a": a, "bt": bt, "sa": sa, "sb": sb}


def result_scale(exact_out: np.ndarray) -> np.float32:
    """scale_result for an FP8 output: fp32(max|result| / 200), times 1.25 if that is a power of two
    (or 0.375 for an all-zero result): never 1, never a power of two, most results in range."""
    top = float(np.abs(exact_out[np.isfinite(exact_out)]).max(initial=0.0))
    s = np.float32(top / 200) if top > 0 else np.float32(0.375)
    if np.frexp(s)[0] == 0.5:
        s = np.float32(s * np.float32(1.25))
    return s
