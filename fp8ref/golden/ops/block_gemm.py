"""The block-scaled cases of the golden scaled_mm: NVFP4 (``scales: block16``) and MX (``block32``).

Operands as a block-scaled GEMM takes them (the layout ``backend:NAME`` already passes for NVFP4 /
MX layers, ``fp8ref.nn.modes``): element codes a (M, K) and b (K, N), one uint8 code per element
(E2M1 in the low nibble); float32 scales, one per ``block`` elements of K on both sides, a's
(M, KB) and b's (KB, N) with KB = ceil(K / block); the last block is cropped where K is not a
multiple of the block (a kernel pads it with zero codes: the same sum).

- ``block16``: NVFP4: float4_e2m1fn codes, E4M3 scale values (subnormals included), and ``alpha``,
  the float32 product of the two fp32 global scales as a serving engine passes it to the kernel
  (vLLM's ``cutlass_scaled_fp4_mm``, FlashInfer's ``mm_fp4``): alpha = fp32(g_a * g_b).
- ``block32``: MX: float4_e2m1fn (MXFP4), float8_e4m3fn / float8_e5m2 (MXFP8) codes, E8M0 scale
  values 2**-127 .. 2**127.

out = round(alpha * sum_k a_k * b_k * sa(m, k) * sb(k, n) + bias[n]) to out_dtype (float32,
bfloat16), under an accumulation model:

``exact``     the exact value rounded once (RNE); NaN/Inf products as IEEE arithmetic gives them
              (a NaN operand, Inf x 0, or Infs of both signs: NaN; else the Inf's sign).
              Every model's NaN is stored as +quiet NaN 0x7fc00000 (its sign and payload are the
              loop's, not the model's: judge them by ``--nan-rule any``).
``fp32``      ``epilogue``: per block a sequential fp32 sum of the products, times fp32(sa * sb),
              blocks added in fp32 (``fp8ref.matmul.block_scaled``); ``operands``: each element
              times its block scale in fp32 first, then one sequential fp32 sum over K. Both end
              in the kernels' epilogue round(fp32(fp32(acc * alpha) + bias)).
a kernel      a ``fp8ref.hardware`` preset whose instruction applies these block scales
              (blackwell-nvfp4, blackwell-mxfp8, blackwell-mxfp4) on the scale codes; any other
              model is "not implemented" with the reason (``block_scaled.refusal``).

Patterns (besides random heavy-tailed values quantized per block): ``zero-blocks`` (all-zero
blocks, some under the largest scale), ``scale-extremes`` (E8M0 2**-127 / 2**127, E4M3 subnormal
scales and 448), ``cancellation`` (a large block, a small one, then the large one negated: fp32
loses the small one), ``specials`` (NaN / Inf element codes; formats that have them).
"""

from __future__ import annotations

import numpy as np

from ... import codec
from ...formats import get_format
from ...matmul.block_scaled import block_scaled_mm, kernel_epilogue
from ...matmul.fp32 import _fp32
from ...matmul.global_scaled import block_scaled_linear
from .. import values
from ..degenerate import GEMM_PATTERNS, RANDOM

#: scales kind -> (block, scale format, element formats)
BLOCK_SCALES = {"block16": (16, "float8_e4m3fn", ("float4_e2m1fn",)),
                "block32": (32, "float8_e8m0fnu", ("float4_e2m1fn", "float8_e4m3fn", "float8_e5m2"))}
BLOCK_PATTERNS = ("zero-blocks", "scale-extremes", "cancellation", "specials")
_BLOCK_ONLY = tuple(p for p in BLOCK_PATTERNS if p not in GEMM_PATTERNS)
_E4M3_MAX = 448.0


def fits(fmt: str, scales: str, pattern: str, K: int) -> bool:
    """Whether a scaled_mm case of these parameters exists: FP4 only with block scales, block
    scales only with their element formats; the block patterns only on block scales (specials
    only where the format has NaN/Inf codes, cancellation with three blocks of K)."""
    if scales not in BLOCK_SCALES:
        return fmt != "float4_e2m1fn" and pattern not in _BLOCK_ONLY
    block, _, formats = BLOCK_SCALES[scales]
    if fmt not in formats or pattern not in (RANDOM, *BLOCK_PATTERNS):
        return False
    if pattern == "specials":
        return get_format(fmt).specials != "none"
    return pattern != "cancellation" or K >= 3 * block


def _scale_values(amax: np.ndarray, fmt: str, scales: str) -> np.ndarray:
    """Per-block float32 scales that hold amax without saturating: E8M0 2**ceil(log2(amax/max)), E4M3
    the value rounded up from amax / max (E4M3 subnormals below 2**-6); 1 where amax is 0."""
    sfmt = BLOCK_SCALES[scales][1]
    want = np.where(amax > 0, amax / get_format(fmt).max, 1.0)
    if scales == "block32":
        e = np.clip(np.ceil(np.log2(want)), -127, 127)
        return np.ldexp(1.0, e.astype(np.int64)).astype(np.float32)
    f = get_format(sfmt)
    code = codec.encode(np.minimum(want, _E4M3_MAX).astype(np.float32), f).astype(np.int64)
    code = np.where(codec.decode(code.astype(np.uint8), f) < want, np.minimum(code + 1, 0x7E), code)  # round up
    return np.maximum(codec.decode(np.maximum(code, 1).astype(np.uint8), f), f.min_positive).astype(np.float32)


def _quantize(v: np.ndarray, fmt: str, scales: str) -> tuple[np.ndarray, np.ndarray]:
    """Codes of v (R, K) per 1 x block of K and the (R, KB) float32 scales."""
    block = BLOCK_SCALES[scales][0]
    R, K = v.shape
    kb = -(-K // block)
    pad = np.zeros((R, kb * block))
    pad[:, :K] = np.abs(v)
    s = _scale_values(pad.reshape(R, kb, block).max(axis=2), fmt, scales)
    full = np.repeat(s.astype(np.float64), block, axis=1)[:, :K]
    return codec.encode((v / full).astype(np.float32), fmt, saturate=True), s


def _extremes(scales: str) -> np.ndarray:
    """The scale values of the scale-extremes pattern: E8M0 2**-127, 2**-126, 2**-1, 1, 2, 2**126,
    2**127; E4M3 every subnormal 2**-9 .. 7 * 2**-9, the smallest normal 2**-6, 1 and 448."""
    if scales == "block32":
        return np.ldexp(1.0, np.array([-127, -126, -1, 0, 1, 126, 127])).astype(np.float32)
    return np.array([k * 2.0 ** -9 for k in range(1, 8)] + [2.0 ** -6, 1.0, 448.0], np.float32)


def operands(pattern: str, stream: values.Stream, M: int, K: int, N: int, fmt: str,
             scales: str) -> dict[str, np.ndarray]:
    """a (M, K), b (K, N) codes and scale_a (M, KB), scale_b (KB, N) of a block case."""
    block = BLOCK_SCALES[scales][0]
    kb = -(-K // block)
    a, sa = _quantize(values.tensor(stream, (M, K), "float32").astype(np.float64), fmt, scales)
    bt, sbt = _quantize(values.tensor(stream, (N, K), "float32").astype(np.float64), fmt, scales)
    f = get_format(fmt)
    if pattern == "zero-blocks":  # a's first block of every row, b's last K block of every other column
        a[:, :block] = 0
        bt[::2, (kb - 1) * block:] = 0
        big = _extremes(scales)[-1]
        sa[::2, 0], sbt[::2, kb - 1] = big, big  # zero codes under the largest scale: still 0
        if M > 1:
            a[1] = 0
    elif pattern == "scale-extremes":
        ext = _extremes(scales)
        if scales == "block32":  # per K block 2**e on a, about 2**-e on b: the operands leave fp32's range,
            e = np.log2(ext[stream.integers(kb, 0, ext.size)]).astype(np.int64)  # their products do not
            sa = np.ldexp(1.0, np.broadcast_to(e, (M, kb))).astype(np.float32)
            sbt = np.ldexp(1.0, np.clip(-e[None, :] + stream.integers(N * kb, -1, 2).reshape(N, kb),
                                        -127, 127)).astype(np.float32)
            sbt[N - 1] = ext[-1]  # the last column: 2**127 under every block (the exact sum may overflow)
        else:
            sa = ext[stream.integers(M * kb, 0, ext.size)].reshape(M, kb)
            sbt = ext[stream.integers(N * kb, 0, ext.size)].reshape(N, kb)
        sa[0], sbt[0] = ext[-1], ext[0]  # row 0 x column 0: largest times smallest on every block
    elif pattern == "cancellation":  # blocks 0, 1, 2: big, small, -big (b's block 2 repeats block 0)
        a[:, 2 * block:3 * block] = a[:, :block] ^ np.uint8(f.sign_mask)
        sa[:, 2] = sa[:, 0]
        bt[:, 2 * block:3 * block] = bt[:, :block]
        sbt[:, 2] = sbt[:, 0]
        sa[:, 0] = sa[:, 2] = np.minimum(sa[:, 0] * 2.0 ** 20, 2.0 ** 127)
        if scales == "block16":  # E4M3 scales cannot grow by 2**20: shrink the small block instead
            sa[:, 0], sa[:, 2] = _E4M3_MAX, _E4M3_MAX
            sa[:, 1] = get_format("float8_e4m3fn").min_positive
    elif pattern == "specials":  # NaN and Inf codes where the format has them
        nan = f.sign_mask - 1  # the largest magnitude code: NaN in fn formats (E4M3 0x7F), a NaN in E5M2
        a[0, 0] = nan
        if f.specials == "ieee":
            inf = np.uint8(f.max_code_magnitude + 1)  # E5M2 0x7C
            a[M - 1, K - 1] = inf
            bt[N - 1, 0] = inf | np.uint8(f.sign_mask)  # -Inf: Inf x -Inf and Inf x 0 on some elements
            bt[0, K - 1] = 0
        else:
            bt[N - 1, K - 1] = nan | np.uint8(f.sign_mask)
    return {"a": a, "b": np.ascontiguousarray(bt.T), "scale_a": np.ascontiguousarray(sa, np.float32),
            "scale_b": np.ascontiguousarray(sbt.T, np.float32)}


def alpha(stream: values.Stream) -> np.ndarray:
    """NVFP4's alpha = fp32(g_a * g_b), each global an fp32 amax / (6 * 448) of a tensor's amax."""
    amax = np.abs(values.heavy_tailed(stream, 2)) * 16 + 1
    g = (amax / np.float64(6 * _E4M3_MAX)).astype(np.float32)
    return np.array([np.float32(g[0] * g[1])], np.float32)


def _exact(params, inputs, block: int) -> np.ndarray:
    """alpha * sum_k a_k b_k sa sb + bias rounded once to out_dtype; non-finite products by IEEE rules."""
    fa = get_format(params["format"])
    a = codec.decode(inputs["a"], fa).astype(np.float64)
    b = codec.decode(inputs["b"], fa).astype(np.float64)
    g = float(inputs["alpha"].reshape(-1)[0]) if "alpha" in inputs else 1.0
    bias = inputs.get("bias")
    finite_a, finite_b = np.where(np.isfinite(a), a, 0.0), np.where(np.isfinite(b), b, 0.0)
    y = block_scaled_linear(finite_a, inputs["scale_a"].astype(np.float64), finite_b.T,
                            inputs["scale_b"].T.astype(np.float64), block, fa, fa, g, "multiplier",
                            bias=None if bias is None else np.asarray(bias).astype(np.float64),
                            out_dtype=params["out_dtype"])
    if np.isfinite(a).all() and np.isfinite(b).all():
        return y

    def count(x, z):  # how many k have x[m, k] and z[k, n] both true
        return x.astype(np.float64) @ z.astype(np.float64) > 0

    nan = np.isnan(a).any(axis=1)[:, None] | np.isnan(b).any(axis=0)[None, :]
    nan |= count(np.isinf(a), b == 0) | count(a == 0, np.isinf(b))
    live_a, live_b = ~np.isnan(a) & (a != 0), ~np.isnan(b) & (b != 0)
    inf_a, inf_b = np.isinf(a), np.isinf(b)
    pos = (count(inf_a & (a > 0), live_b & (b > 0)) | count(inf_a & (a < 0), live_b & (b < 0))
           | count(live_a & (a > 0), inf_b & (b > 0)) | count(live_a & (a < 0), inf_b & (b < 0)))
    neg = (count(inf_a & (a > 0), live_b & (b < 0)) | count(inf_a & (a < 0), live_b & (b > 0))
           | count(live_a & (a > 0), inf_b & (b < 0)) | count(live_a & (a < 0), inf_b & (b > 0)))
    y = np.where(pos, np.inf, np.where(neg, -np.inf, y))
    return np.where(nan | (pos & neg), np.nan, y)


def reference(params, inputs) -> np.ndarray:
    """The case's output (float32 values of out_dtype) under ``params["accumulate"]``."""
    block, sfmt, _ = BLOCK_SCALES[params["scales"]]
    acc = params["accumulate"]
    alpha_ = np.float32(inputs["alpha"].reshape(-1)[0]) if "alpha" in inputs else None
    bias = inputs.get("bias")
    bias32 = None if bias is None else np.asarray(bias).astype(np.float32)
    with np.errstate(all="ignore"):  # Inf and NaN are the fp32 models' IEEE arithmetic
        out = _reference(params, inputs, acc, block, sfmt, alpha_, bias32).astype(np.float32)
    # one NaN, +quiet 0x7fc00000: a NaN's sign and payload follow the C or numpy loop's operation
    # order, not the model (judged by --nan-rule); golden bytes are the same on every path
    return np.where(np.isnan(out), np.float32(np.nan), out)


def _reference(params, inputs, acc, block, sfmt, alpha_, bias32) -> np.ndarray:
    fmt = params["format"]
    if acc == "exact":
        return _exact(params, inputs, block).astype(np.float32)
    if acc == "fp32" and params.get("scale_order") == "operands":
        f = get_format(fmt)
        K = inputs["a"].shape[1]
        part = _fp32(inputs["a"], inputs["b"], f, f, inputs["scale_a"].astype(np.float64),
                     inputs["scale_b"].astype(np.float64), block, max(K, 1), "operands")
        return kernel_epilogue(part, alpha_, bias32, params["out_dtype"])
    return block_scaled_mm(inputs["a"], inputs["b"], codec.encode(inputs["scale_a"], sfmt),
                           codec.encode(inputs["scale_b"], sfmt), fmt_a=fmt, fmt_b=fmt, scale_fmt=sfmt, block=block,
                           accumulate=acc, alpha=alpha_, bias=bias32, out_dtype=params["out_dtype"])
