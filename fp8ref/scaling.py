"""amax reductions and scale formulas for every granularity (pure: arrays in, arrays out).

Layout of a quantized tensor ``x`` of shape (..., K) (a weight is W[out, in], so K = in):

============  =========================  ==============================================
granularity   reduction set              scale shape
============  =========================  ==============================================
tensor        all elements               (1,)
channel       one output row (last axis)  (..., 1)
token         one token (last axis)       (..., 1)
group G       G consecutive along K       (..., ceil(K/G)); the last group may be partial
block bh,bw   bh x bw tiles of (.., R, K) (..., ceil(R/bh), ceil(K/bw)); edge tiles partial
mx            32 along K, E8M0 scale      (..., ceil(K/32))
nvfp4         16 along K, E4M3 scale      (..., ceil(K/16)), plus one fp32 global scale
============  =========================  ==============================================

Partial groups/blocks take the max over the elements that exist, which is what zero-padding
producers (compressed-tensors, DeepSeek) compute: |0| never raises a max.

amax is reduced on the magnitude bit patterns (sign bit cleared): for IEEE binary formats
unsigned integer order equals magnitude order, every NaN pattern sorts above Inf (so NaN
propagates), and the result is exact in the input dtype.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np

from ._arrays import bits_view
from .errors import ShapeError
from .formats import FloatFormat
from .limits import MAX_GROUP, shown

GRANULARITIES = ("tensor", "channel", "token", "group", "block", "mx", "nvfp4")
MX_BLOCK = 32
NVFP4_BLOCK = 16
# E8M0 scale rules by name (docs/quantize.md has their mismatch rates): ocp-floor (OCP MX v1.0; "floor"
# is its older name, kept), rceil (NVIDIA RCEIL, ModelOpt MXFP8), even (AMD Quark 0.13's even_round:
# a float32 bit trick), ct-round-to-power-2 (compressed-tensors: MXFP4 and MXFP8 alike, MXFP6 its own), round-up
# (triton_kernels' downcast_to_mxfp_torch ROUND_UP, what transformers' Mxfp4Quantize writes for gpt-oss),
# log2f-floor (llama.cpp's GGML_TYPE_MXFP4: floorf(log2f(amax)), one float32 rounding before the floor);
# torchao 0.18's ScaleCalculationMode: FLOOR is ocp-floor, torchao-ceil (CEIL), torchao-even (EVEN), torchao-rceil
# (RCEIL's CPU path: float32 amax / max_elem, float32 log2, ceil).
MX_SCALE_RULES = ("floor", "rceil", "ct-round-to-power-2", "ocp-floor", "even", "round-up", "log2f-floor",
                  "torchao-ceil", "torchao-even", "torchao-rceil")



def layout(shape: tuple, granularity: str, *, group_size: int | None = None,
           block_shape: tuple[int, int] | None = None) -> tuple:
    """Scale shape for ``x.shape``; raises ShapeError naming what does not fit."""
    shape = tuple(int(n) for n in shape)
    if granularity not in GRANULARITIES:
        raise ShapeError(f"granularity: expected one of {', '.join(GRANULARITIES)}, got {granularity!r}")
    if granularity == "tensor":
        return (1,)
    if len(shape) < 1:
        raise ShapeError(f"x: granularity {granularity!r} needs at least 1 dimension, got shape {shape}")
    if granularity in ("channel", "token"):
        return shape[:-1] + (1,)
    if granularity == "block":
        bh, bw = _block(block_shape)
        if len(shape) < 2:
            raise ShapeError(f"x: granularity 'block' needs at least 2 dimensions, got shape {shape}")
        return shape[:-2] + (-(-shape[-2] // bh), -(-shape[-1] // bw))
    g = group_of(granularity, group_size)
    return shape[:-1] + (-(-shape[-1] // g),)


def group_of(granularity: str, group_size: int | None) -> int:
    if granularity == "mx":
        return MX_BLOCK
    if granularity == "nvfp4":
        return NVFP4_BLOCK
    if type(group_size) is not int or group_size < 1:
        raise ShapeError(f"group_size: granularity 'group' needs a positive int, got {shown(group_size)}")
    if group_size > MAX_GROUP:  # beyond it the C loops' int64/size_t arithmetic wraps
        raise ShapeError(f"group_size: expected at most {MAX_GROUP}, got {shown(group_size)}")
    return group_size


def _block(block_shape) -> tuple[int, int]:
    ok = (isinstance(block_shape, (tuple, list)) and len(block_shape) == 2
          and all(type(b) is int and b > 0 for b in block_shape))
    if not ok:
        raise ShapeError(f"block_shape: expected two positive ints (rows, cols), got {shown(block_shape)}")
    if not all(b <= MAX_GROUP for b in block_shape):  # beyond it the C loops' int64/size_t arithmetic wraps
        raise ShapeError(f"block_shape: expected two ints in 1..{MAX_GROUP} (rows, cols), got {shown(block_shape)}")
    return int(block_shape[0]), int(block_shape[1])


def _magnitude_bits(x: np.ndarray) -> np.ndarray:
    """|x| as unsigned ints (same width), order-preserving; NaN patterns sort above Inf."""
    if x.dtype.kind != "f" and x.dtype.name != "bfloat16":
        raise ShapeError(f"x: expected a floating-point array, got {x.dtype.name}")
    u = bits_view(x)
    return u & u.dtype.type((1 << (8 * x.dtype.itemsize - 1)) - 1)


def _pad_last(a: np.ndarray, multiple: int, axis: int = -1) -> np.ndarray:
    n = a.shape[axis]
    extra = -n % multiple
    if not extra:
        return a
    pad = [(0, 0)] * a.ndim
    pad[axis] = (0, extra)
    return np.pad(a, pad)  # zero bits = +0.0, neutral for a max of magnitudes


def reduce_amax(x: np.ndarray, granularity: str, *, group_size: int | None = None,
                block_shape: tuple[int, int] | None = None) -> np.ndarray:
    """max|x| over each reduction set, as float64 (exact), shaped like ``layout``."""
    out_shape = layout(x.shape, granularity, group_size=group_size, block_shape=block_shape)
    m = _magnitude_bits(np.asarray(x))
    if granularity == "tensor":
        r = m.max(initial=0).reshape(1)
    elif granularity in ("channel", "token"):
        r = m.max(axis=-1, keepdims=True, initial=0)
    elif granularity == "block":
        bh, bw = _block(block_shape)
        p = _pad_last(_pad_last(m, bh, axis=-2), bw, axis=-1)
        r = p.reshape(p.shape[:-2] + (p.shape[-2] // bh, bh, p.shape[-1] // bw, bw)).max(axis=(-3, -1))
    else:
        g = group_of(granularity, group_size)
        p = _pad_last(m, g)
        r = p.reshape(p.shape[:-1] + (p.shape[-1] // g, g)).max(axis=-1)
    return magnitudes_to_f64(r, x.dtype).reshape(out_shape)


def magnitudes_to_f64(bits: np.ndarray, dtype: np.dtype | str) -> np.ndarray:
    """float64 values of magnitude bit patterns of ``dtype`` (a dtype or its name: 'bfloat16'
    needs no ml_dtypes)."""
    if getattr(dtype, "name", dtype) == "bfloat16":  # the top half of a float32: exact, no bfloat16 arithmetic
        return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32).astype(np.float64)
    return bits.view(dtype).astype(np.float64)


def expand(scale: np.ndarray, shape: tuple, granularity: str, *, group_size: int | None = None,
           block_shape: tuple[int, int] | None = None) -> np.ndarray:
    """``scale`` repeated so that it broadcasts elementwise against an array of ``shape``."""
    shape = tuple(shape)
    if granularity in ("tensor", "channel", "token"):
        return scale.reshape((1,) * len(shape)) if granularity == "tensor" else scale
    if granularity == "block":
        bh, bw = _block(block_shape)
        s = np.repeat(np.repeat(scale, bh, axis=-2), bw, axis=-1)
        return s[..., :shape[-2], :shape[-1]]
    g = group_of(granularity, group_size)
    return np.repeat(scale, g, axis=-1)[..., :shape[-1]]


# --- scale formulas -----------------------------------------------------------------------
def amax_over_max(amax: np.ndarray, fmt: FloatFormat) -> np.ndarray:
    """fp32(amax / fmt.max), rounded once.

    The float64 quotient is correctly rounded; rounding it again to float32 can go wrong
    only if it lands exactly on a float32 midpoint (25 significant bits) while the exact
    quotient does not. For amax with <= 24 bits that cannot happen (fmt.max has <= 8
    significant bits, so a non-midpoint quotient is >= 2**-33 relative away from every
    midpoint, far above float64's 2**-53); float64 amax can, and those few elements are
    settled with exact rationals.
    """
    a = np.asarray(amax, np.float64)
    q = a / fmt.max
    s = q.astype(np.float32)
    on_mid = (q.view(np.uint64) & np.uint64(0x1FFFFFFF)) == np.uint64(0x10000000)
    for i in zip(*np.nonzero(on_mid & np.isfinite(q)), strict=True):
        exact = Fraction(float(a[i])) / Fraction(fmt.max)
        if exact != Fraction(float(q[i])):  # nudge off the midpoint toward the exact value
            s[i] = np.float32(np.nextafter(q[i], np.inf if exact > Fraction(float(q[i])) else -np.inf))
    return s


def _frexp_exponent(v: np.ndarray) -> np.ndarray:
    """floor(log2 v) for positive finite v, exactly (frexp, never log2)."""
    _, e = np.frexp(v)
    return e.astype(np.int64) - 1


def mx_scale_exponent(amax: np.ndarray, elem: FloatFormat, rule: str) -> np.ndarray:
    """Unbiased E8M0 exponent per block, clipped to [-127, 127]; NaN/Inf amax -> 128 (NaN code).

    floor / ocp-floor (OCP MX v1.0): floor(log2 amax) - emax_elem; large elements then clip to +-max_elem.
    rceil (NVIDIA/cuBLAS, torchao RCEIL): ceil(log2(amax / max_elem)), so nothing clips.
    ct-round-to-power-2 (compressed-tensors ``round_to_power_2(x, elem_mantissa)``: adds
    2**-(elem_mantissa + 1) of the significand's unit and truncates): floor(log2 amax) + [significand
    >= 2 - 2**-(elem_mantissa + 1)] - emax_elem, where compressed-tensors 0.20.1's ``generate_mx_scales``
    passes elem_mantissa 3 for FP6 E2M3 (significand >= 1.9375) and 1 (E2M1's) for every other element,
    E4M3 included (significand >= 1.75; 0.19.0 has the 1.75 rule only). Any significand width of the
    amax's dtype of at least elem_mantissa + 2 bits (bf16, fp16, fp32) gives the same threshold.
    even (AMD Quark 0.13 ``even_round``): amax rounded to float32, ``bits + (1 << 21)`` masked to
    sign and exponent (the 2**-2 significand step of an E2M1 mantissa), then floor(log2) - emax_elem;
    the same exponents as ct-round-to-power-2 for every float32 amax, computed on the bits.
    round-up (triton_kernels ``downcast_to_mxfp_torch``, DequantScaleRoundingMode.ROUND_UP): the float32
    quotient d = fp32(fp32(amax) / max_elem), then ``(bits(d) + 0x007FFFFF) & 0x7F800000``: any mantissa
    bit carries into the exponent, so 2**e >= d; a subnormal d becomes 2**-126 (byte 1), d == 0 byte 0.
    torchao-ceil (torchao CEIL: the float32 amax's exponent field, + 1 if any mantissa bit is set): ceil(log2
    amax) - emax_elem. torchao-even (torchao EVEN): as ``even`` but adding 2**-(elem mantissa bits + 1)
    of the significand's unit (``1 << (22 - m)``), the element's own mantissa width (``even`` is its
    E2M1 case). torchao-rceil (torchao RCEIL off sm100 / outside torch.compile): d = fp32(amax /
    max_elem), then ceil(float32 log2(d)) (``pow2_exponent``'s ceil-fp32-log2; a subnormal d by its
    float32 log2 too), clipped to -127.
    amax == 0 -> -127 (code 0x00, the smallest scale; gfloat, TE).
    """
    if rule not in MX_SCALE_RULES:
        raise ShapeError(f"mx_rule: expected one of {', '.join(MX_SCALE_RULES)}, got {rule!r}")
    a = np.asarray(amax, np.float64)
    finite_pos = np.isfinite(a) & (a > 0)
    safe = np.where(finite_pos, a, 1.0)
    if rule in ("floor", "ocp-floor"):
        e = _frexp_exponent(safe) - elem.emax
    elif rule == "even":
        bits = safe.astype(np.float32).view(np.uint32).astype(np.int64) + (1 << 21)
        field = (bits >> 23) & 0xFF  # a carry out of the mantissa bumps the exponent; 255 is inf
        e = np.where(field == 0, -127, field - 127 - elem.emax)  # 0: log2(0) = -inf, clipped below
    elif rule == "torchao-ceil":
        e = _frexp_exponent(safe) + (np.frexp(safe)[0] != 0.5) - elem.emax
    elif rule == "torchao-even":
        bits = safe.astype(np.float32).view(np.uint32).astype(np.int64) + (1 << (22 - elem.mantissa_bits))
        field = (bits >> 23) & 0xFF
        e = np.where(field == 0, -127, field - 127 - elem.emax)
    elif rule == "torchao-rceil":
        d = amax_over_max(safe, elem)  # torch's float32 quotient, rounded once
        normal = d >= np.float32(2.0**-126)
        e = pow2_exponent(np.where(normal, d, np.float32(1.0)), "ceil-fp32-log2")
        with np.errstate(divide="ignore", invalid="ignore"):
            l2 = np.log2(np.where(normal, np.float32(1.0), d).astype(np.float64)).astype(np.float32)  # float32 log2
        sub = np.ceil(np.maximum(l2, np.float32(-200.0))).astype(np.int64)  # log2(0) = -inf: clipped below
        e = np.where(normal, e, np.maximum(sub, -127))
    elif rule == "round-up":
        with np.errstate(over="ignore"):
            d = safe.astype(np.float32) / np.float32(elem.max)  # one float32 rounding, as torch divides
        field = ((d.view(np.uint32).astype(np.int64) + 0x007FFFFF) & 0x7F800000) >> 23
        e = np.where(field == 0, -127, field - 127)  # 0: d underflowed to 0 (a float32 amax below 3 * 2**-149)
    elif rule == "log2f-floor":
        # llama.cpp: floorf(log2f(amax)) in float32. log2f rounds to k just below 2**k, so the floor
        # is k there; float64 log2 rounded once to float32 is the correctly rounded log2f.
        with np.errstate(divide="ignore"):
            l2 = np.log2(safe.astype(np.float32).astype(np.float64)).astype(np.float32)
        e = np.floor(l2).astype(np.int64) - elem.emax
    elif rule == "ct-round-to-power-2":
        elem_mantissa = 3 if elem.name == "float6_e2m3fn" else 1
        m, e2 = np.frexp(safe)  # safe = m * 2**e2, m in [0.5, 1): significand 2m >= 2 - 2**-(em+1)
        e = (e2.astype(np.int64) - 1) + (m >= 1.0 - 2.0 ** -(elem_mantissa + 2)) - elem.emax
    else:
        # amax/max_elem in float64 is a power of two only when the exact ratio is one
        # (same gap argument as amax_over_max), so frexp's mantissa == 0.5 tests it exactly.
        t = safe / elem.max
        m, e2 = np.frexp(t)
        e = np.where(m == 0.5, e2 - 1, e2).astype(np.int64)
    e = np.clip(e, -127, 127)
    e = np.where(finite_pos, e, -127)
    return np.where(np.isfinite(a), e, 128)


POW2_RULES = ("ceil", "ceil-fp32-log2")


def _log2_rounds_down() -> np.ndarray:
    """Per e in -126..127: how many float32 steps above 2**e float32 log2 still rounds to e.

    log2(2**e * (1 + n * 2**-23)) = e + log2(1 + n * 2**-23) rounds to the float32 e while that
    excess is below half the float32 gap g above e, i.e. n < (2**(g/2) - 1) * 2**23. The bounds are
    at least 1e-3 away from an integer (tests check), so float64 expm1 decides them exactly."""
    e = np.arange(-126, 128).astype(np.float32)
    gap = (np.nextafter(e, np.float32(np.inf)) - e).astype(np.float64)
    return np.expm1(gap / 2 * np.log(2.0)) * 2.0**23


_LOG2_DOWN = _log2_rounds_down()


def pow2_exponent(scale: np.ndarray, rule: str = "ceil-fp32-log2") -> np.ndarray:
    """k with 2**k the power-of-two scale ``rule`` gives float32 scales (int64, scale's shape).

    ceil (DeepGEMM deep_gemm/utils/math.py ``ceil_to_ue8m0``, vLLM UE8M0): the biased exponent +
    [mantissa != 0], clamped to 1..254: exact for every float32 (no log2); a subnormal or zero s
    gives 2**-126, an infinite s (and NaN) 2**127.

    ceil-fp32-log2 (transformers 5.17 ``Fp8Quantize`` with ``scale_fmt: ue8m0``:
    ``2**ceil(log2(clamp(s, min=tiny)))`` in float32): the exact ceil(log2 s), except that float32
    log2 of an s a few steps above 2**e rounds to the integer e (``_log2_rounds_down``: 2 steps at
    e = 10, 22 at e = 100), and then k = e. Checked against torch's log2 for every e (tests)."""
    if rule not in POW2_RULES:
        raise ShapeError(f"pow2: expected one of {', '.join(POW2_RULES)}, got {rule!r}")
    if rule == "ceil":
        bits = np.abs(np.asarray(scale, np.float32)).view(np.uint32)
        e = (bits >> np.uint32(23)).astype(np.int64) + ((bits & np.uint32(0x7FFFFF)) != 0)
        return np.clip(e, 1, 254) - 127
    s = np.maximum(np.asarray(scale, np.float32), np.float32(np.finfo(np.float32).tiny))
    e = _frexp_exponent(s.astype(np.float64))  # floor(log2 s); s is normal
    n = (s.view(np.uint32) & np.uint32(0x7FFFFF)).astype(np.float64)  # steps above 2**e
    down = (n == 0) | (n < _LOG2_DOWN[np.clip(e, -126, 127) + 126])
    return np.where(down, e, e + 1)


def ceil_to_ue8m0(s: np.ndarray) -> np.ndarray:
    """2**k of the ``ceil`` rule as float32 (DeepGEMM's ``ceil_to_ue8m0``)."""
    return np.ldexp(np.float32(1.0), pow2_exponent(s, "ceil")).astype(np.float32)


def e8m0_value(exponent: np.ndarray) -> np.ndarray:
    """2**e as float32 (exact for -127..127; 128 -> NaN)."""
    e = np.asarray(exponent, np.int64)
    v = np.ldexp(1.0, np.clip(e, -127, 127)).astype(np.float32)
    return np.where(e == 128, np.float32(np.nan), v)


def nvfp4_global_scale(amax_tensor: float, elem: FloatFormat, scale_fmt: FloatFormat) -> np.float32:
    """Dequant global scale fp32(amax / (max_elem * max_scale)) (2688 for e2m1 x e4m3); 0 -> 1."""
    if not amax_tensor > 0:
        return np.float32(1.0)
    # elem.max * scale_fmt.max = 6 * 448 has <= 8 significant bits: the amax_over_max argument holds.
    return np.float32(np.float64(amax_tensor) / (elem.max * scale_fmt.max))

