"""scaled_mm / linear: FP8 matrix products with declared scale and accumulation models.

``scaled_mm(a, b, scale_a, scale_b)`` computes ``out[m, n] = sum_k a[m, k] * b[k, n] * s(m, k, n)
+ bias[n]`` where a (M x K) and b (K x N) are FP8 codes and the scales are dequantization
multipliers (``torch._scaled_mm`` semantics). The accumulation model is an argument:

``exact``         the exact sum, rounded once (RNE) to ``out_dtype``. Integer matmuls in float64
                  whose exactness is proved per call; the float64 combination of the scaled block
                  sums decides every element that is provably far from a rounding boundary, the
                  others get an error-free summation (Rump, Ogita and Oishi's extraction) and exact
                  midpoint comparisons. docs/matmul.md has the proof.
``fp32``          fp32 accumulation in a declared order (sequential over k, optional K-blocks).
``fp32-limited``  an accumulator that keeps ``mantissa_bits`` fraction bits (truncation after
                  every addition) promoted to fp32 every ``promote_every`` elements.

Operands are decoded with ``fp8ref.codec.decode``; no FP8 cast of another library is used.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from ._native import KERNELS, seq_acc_f32
from .codec import decode, encode
from .errors import FormatError, InputTypeError, ScaleError, ShapeError
from .formats import FORMATS, FloatFormat, get_format

ACCUMULATIONS = ("exact", "fp32", "fp32-limited")
SCALE_ORDERS = ("epilogue", "operands")
DEFAULT_FORMAT = "float8_e4m3fn"
_CHUNK = 1 << 16  # output elements per vectorized step of the exact rounding (cache sized)


@dataclass(frozen=True)
class OutFormat:
    """A binary floating-point output type: ``precision`` significand bits (with the implicit
    one), normal exponents ``emin``..``emax``, IEEE subnormals, Inf and NaN."""

    name: str
    precision: int
    emin: int
    emax: int

    @property
    def max(self) -> float:
        return math.ldexp(2.0 - math.ldexp(1.0, 1 - self.precision), self.emax)


OUT_FORMATS = {
    "float32": OutFormat("float32", 24, -126, 127),
    "bfloat16": OutFormat("bfloat16", 8, -126, 127),
    "float16": OutFormat("float16", 11, -14, 15),
}


# --------------------------------------------------------------------------------------------
# Input plumbing
# --------------------------------------------------------------------------------------------
def _is_torch(x) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "dtype") and hasattr(x, "device")


def _shape_text(shape) -> str:
    return str(tuple(int(d) for d in shape))


def _operand(x, fmt, what: str) -> tuple[np.ndarray, FloatFormat]:
    """2-D numpy uint8 codes and their format, from codes or a torch float8 tensor."""
    if _is_torch(x):
        import torch
        if x.device.type != "cpu":
            raise InputTypeError(f"{what}: expected a CPU tensor, got device {x.device}")
        if x.dtype != torch.uint8 and x.element_size() == 1 and x.dtype.is_floating_point:
            named = str(x.dtype).removeprefix("torch.")
            if fmt is not None and get_format(fmt).name != named:
                raise FormatError(f"{what}: tensor dtype is {named} but fmt says {get_format(fmt).name}")
            fmt, x = named, x.view(torch.uint8)
        elif x.dtype != torch.uint8:
            raise InputTypeError(f"{what}: expected uint8 codes or a torch float8 tensor, got torch {x.dtype}")
        x = x.detach().contiguous().numpy()
    elif isinstance(x, np.ndarray):
        if x.dtype != np.uint8:
            raise InputTypeError(f"{what}: expected uint8 codes, got numpy {x.dtype}")
    else:
        raise InputTypeError(f"{what}: expected a numpy uint8 array or a torch tensor, got {type(x).__name__}")
    fmt = get_format(DEFAULT_FORMAT if fmt is None else fmt)
    if fmt.decode_dtype != "float32":
        raise FormatError(f"{what}: format {fmt.name} has values outside float32; scaled_mm needs a format "
                          "whose values float32 holds exactly")
    if x.ndim != 2:
        raise ShapeError(f"{what}: expected a 2-D matrix, got shape {_shape_text(x.shape)}")
    return x, fmt


@lru_cache(maxsize=32)
def _code_values(fmt: FloatFormat) -> np.ndarray:
    """float64 value of each code of ``fmt`` (read-only)."""
    values = decode(np.arange(fmt.n_codes, dtype=np.uint8), fmt).astype(np.float64)
    values.setflags(write=False)
    return values


def _float_array(x, what: str, dtypes: tuple[str, ...]) -> np.ndarray:
    """numpy copy of a numpy/torch float array whose dtype is one of ``dtypes`` (float64 values)."""
    if _is_torch(x):
        name = str(x.dtype).removeprefix("torch.")
        if name not in dtypes:
            raise InputTypeError(f"{what}: expected dtype {' or '.join(dtypes)}, got torch {name}")
        import torch
        return x.detach().cpu().to(dtype=torch.float64).numpy()
    if type(x) in (float, int) and "float32" in dtypes:
        if float(np.float32(x)) != float(x):
            raise InputTypeError(f"{what}: the Python number {x!r} is not a float32 value; pass a float32 array")
        return np.asarray(float(x), dtype=np.float64)
    if isinstance(x, (np.ndarray, np.generic)):
        if x.dtype.name not in dtypes:
            raise InputTypeError(f"{what}: expected dtype {' or '.join(dtypes)}, got numpy {x.dtype.name}")
        return np.asarray(x, dtype=np.float64)
    raise InputTypeError(f"{what}: expected a numpy array or torch tensor, got {type(x).__name__}")


def _scale(x, what: str) -> np.ndarray:
    s = _float_array(x, what, ("float32",))
    bad = ~(np.isfinite(s) & (s > 0))
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ScaleError(f"{what}: dequantization scales must be finite and > 0, got {s[idx]!r} at index "
                         f"{idx or '()'}")
    return s


def _canonical_scales(sa: np.ndarray, sb: np.ndarray, M: int, K: int, N: int, block_k: int,
                      block_n: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Scales as (M, KB) and (KB, N) arrays plus the K-block length (K when KB == 1).

    scale_a: (), (1,), (1, 1) per tensor; (M, 1) per row; (M, ceil(K/block_k)) per 1 x block_k group.
    scale_b: (), (1,), (1, 1) per tensor; (1, N) per column; (ceil(K/block_k), ceil(N/block_n)) blocks.
    """
    kb = -(-K // block_k) if K else 1
    nb = -(-N // block_n) if N else 1
    exp_a = {(): "per tensor", (1,): "per tensor", (1, 1): "per tensor", (M, 1): "per row",
             (M, kb): f"1x{block_k} groups"}
    exp_b = {(): "per tensor", (1,): "per tensor", (1, 1): "per tensor", (1, N): "per column",
             (kb, nb): f"{block_k}x{block_n} blocks"}
    for s, exp, what in ((sa, exp_a, "scale_a"), (sb, exp_b, "scale_b")):
        if tuple(s.shape) not in exp:
            listing = ", ".join(f"{_shape_text(k)} ({v})" for k, v in exp.items())
            raise ShapeError(f"{what}: got shape {_shape_text(s.shape)}, expected one of {listing} "
                             f"for a {M}x{K} @ {K}x{N} product")
    a_groups = kb > 1 and sa.shape == (M, kb)
    b_blocks = sb.shape == (kb, nb) and sb.size > 1 and sb.shape != (1, N)
    kb_used = kb if (a_groups or (b_blocks and kb > 1)) else 1
    full_a = np.broadcast_to(sa if a_groups else sa.reshape(-1, 1), (M, kb_used))
    if b_blocks:
        full_b = np.broadcast_to(np.repeat(sb, block_n, axis=1)[:, :N], (kb_used, N))
    else:
        full_b = np.broadcast_to(sb.reshape(1, -1), (kb_used, N))
    return full_a, full_b, (block_k if kb_used > 1 else max(K, 1))


def _out_format(out_dtype) -> OutFormat:
    """A name, a torch dtype, a numpy dtype or scalar type -> OutFormat."""
    if isinstance(out_dtype, type) and issubclass(out_dtype, np.generic) or isinstance(out_dtype, np.dtype):
        name = np.dtype(out_dtype).name
    else:
        name = str(out_dtype).removeprefix("torch.")
    if name not in OUT_FORMATS:
        raise InputTypeError(f"out_dtype: expected one of {', '.join(OUT_FORMATS)}, got {out_dtype!r}")
    return OUT_FORMATS[name]


def _deliver(values: np.ndarray, out: OutFormat, as_torch: bool):
    """float64 values that ``out`` holds exactly -> an array of that dtype (the cast is exact)."""
    if as_torch:
        import torch
        return torch.from_numpy(values).to(getattr(torch, out.name))
    if out.name == "bfloat16":
        import ml_dtypes  # only numpy's bfloat16 dtype: the bits are built here, no cast is trusted

        bits = np.asarray(values, np.float64).astype(np.float32).view(np.uint32) >> np.uint32(16)
        return bits.astype(np.uint16).view(ml_dtypes.bfloat16)  # exact: values already fit bf16
    return values.astype(out.name)


def _deliver_codes(codes: np.ndarray, as_torch: bool):
    """uint8 codes as numpy, or as a torch.uint8 tensor (no float8 dtype: not every format has one)."""
    if as_torch:
        import torch
        return torch.from_numpy(np.ascontiguousarray(codes))
    return codes


# --------------------------------------------------------------------------------------------
# Exact float64 building blocks (all vectorized; no overflow or underflow for the ranges used here)
# --------------------------------------------------------------------------------------------
def _two_sum(a, b):
    """s + e == a + b exactly, s = fl(a + b) (Knuth)."""
    s = a + b
    bb = s - a
    return s, (a - (s - bb)) + (b - bb)


def _split(a):
    """a == hi + lo with both halves of at most 26 significant bits (Veltkamp)."""
    c = 134217729.0 * a  # 2**27 + 1
    hi = c - (c - a)
    return hi, a - hi


def _two_product(a, b):
    """p + e == a * b exactly, p = fl(a * b) (Dekker)."""
    p = a * b
    ah, al = _split(a)
    bh, bl = _split(b)
    return p, al * bl - (((p - ah * bh) - al * bh) - ah * bl)


def _grow(expansion: list, b) -> list:
    """Shewchuk's Grow-Expansion: a nonoverlapping expansion (increasing magnitude) plus b."""
    out = []
    q = b
    for c in expansion:
        q, h = _two_sum(q, c)
        out.append(h)
    out.append(q)
    return out


def _sign(expansion: list) -> np.ndarray:
    """Exact sign of a nonoverlapping expansion: the sign of its largest nonzero component."""
    s = np.zeros(np.shape(expansion[0]))
    for c in expansion:
        s = np.where(c != 0, np.sign(c), s)
    return s


def _extract(terms: np.ndarray) -> list:
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


def _exponent(a: np.ndarray) -> np.ndarray:
    """floor(log2 |a|) for a != 0."""
    return np.frexp(a)[1] - 1


def _ulp_exponent(a: np.ndarray, out: OutFormat) -> np.ndarray:
    """Exponent of the spacing of ``out``'s grid (unbounded above) at magnitude ``a``."""
    e = np.where(a == 0, out.emin, _exponent(a))
    return np.maximum(e, out.emin) - (out.precision - 1)


def _round_to(values: np.ndarray, out: OutFormat) -> np.ndarray:
    """RNE of float64 ``values`` to ``out`` (float64 result), IEEE overflow to +-Inf."""
    u = _ulp_exponent(np.abs(values), out)
    r = np.ldexp(np.rint(np.ldexp(values, -u)), u)
    return np.where(np.abs(r) > out.max, np.copysign(np.inf, r), r)


def _gaps(c: np.ndarray, out: OutFormat):
    """Distances from grid points c (unbounded exponent) to their neighbours below and above, and
    whether c's integer significand is odd."""
    a = np.abs(c)
    u = _ulp_exponent(a, out)
    ulp = np.ldexp(1.0, u)
    e = _exponent(np.where(a == 0, 1.0, a))
    below = np.where((a != 0) & (a == np.ldexp(1.0, e)) & (e > out.emin), ulp / 2, ulp)  # toward zero
    odd = np.fmod(np.ldexp(a, -u), 2.0) == 1.0
    return np.where(c > 0, below, ulp), np.where(c < 0, below, ulp), odd


def _candidate(y: np.ndarray, bound: np.ndarray, out: OutFormat) -> tuple[np.ndarray, np.ndarray]:
    """RNE of y on ``out``'s grid (unbounded exponent; a zero keeps y's sign), and where that is
    certainly the RNE of every x with |x - y| <= bound/2 (``sure``)."""
    if isinstance(out, CodeOut):
        return out.candidate(y, bound)
    u = _ulp_exponent(np.abs(y), out)
    z = np.ldexp(y, -u)  # y in units of its own binade's spacing: rounding boundaries are at k + 1/2
    r = np.rint(z)
    c = np.ldexp(r, u)
    # that interval lies inside c's rounding interval, also where c is a power of two
    sure = 0.5 - np.abs(z - r) > np.ldexp(bound, -u)
    sure &= (c != 0) | (np.abs(y) > bound) | (bound == 0)  # the sign of a zero result is known too
    return np.where(c == 0, np.where(y < 0, -0.0, 0.0), c), sure


def _round_exact(taus: list, out: OutFormat) -> np.ndarray:
    """RNE of the exact sum of ``taus`` to ``out``. y = fl(sum) is within (n+1) 2**-53 sum|tau| of
    the exact sum (recursive summation bound); where y is farther than that from every rounding
    boundary its rounding is the answer, elsewhere ``_repair`` decides exactly."""
    if isinstance(out, CodeOut):
        return out.round_exact(taus)
    y, mag = taus[0], np.abs(taus[0])
    for t in taus[1:]:
        y, mag = y + t, mag + np.abs(t)
    c, sure = _candidate(y, 4.0 * mag * ((len(taus) + 1) * 2.0 ** -53), out)  # 4x: slack for mag's rounding
    if not sure.all():
        unsure = ~sure
        c[unsure] = _repair([t[unsure] for t in taus], c[unsure], out)
    return c


def _repair(taus: list, c: np.ndarray, out: OutFormat) -> np.ndarray:
    """Exact comparisons of sum(taus) with the midpoints around c, moving c until it is the RNE
    result. Signs come from nonoverlapping expansions (Shewchuk), so every test is exact."""
    exp = [taus[0]]
    for t in taus[1:]:
        exp = _grow(exp, t)
    while True:
        d_lo, d_hi, odd = _gaps(c, out)
        s_hi = _sign(_grow(exp, -(c + d_hi / 2)))
        s_lo = _sign(_grow(exp, -(c - d_lo / 2)))
        up = (s_hi > 0) | ((s_hi == 0) & odd)  # ties go to the even neighbour
        down = (s_lo < 0) | ((s_lo == 0) & odd)
        if not (up.any() or down.any()):
            break
        c = np.where(up, c + d_hi, np.where(down, c - d_lo, c))
    return np.where(c == 0, np.where(_sign(exp) < 0, -0.0, 0.0), c)  # underflow keeps the sign; 0 is +0


# --------------------------------------------------------------------------------------------
# Narrow (FP8/FP6/FP4) outputs: encode(v) with v = x / scale_result or x * scale_result
# --------------------------------------------------------------------------------------------
SCALE_RESULT_OPS = ("divide", "multiply")
CODE_ROUNDINGS = ("rne", "rna", "rtz", "rup", "rdown", "rto")


@dataclass(frozen=True)
class CodeOut:
    """An output in the codes of ``fmt`` (a format of fp8ref.formats with zero and subnormals).

    The exact machinery does not round to this grid itself: it produces a float64 *representative*
    t of the exact value v (``x / scale`` or ``x * scale``), then ``encode(t, fmt, saturate,
    rounding)`` runs. t == v when v is a point of the grid G (fmt's grid continued above max with
    the same spacing); otherwise t is the quarter or half point of the G-interval (lo, hi) holding
    v: lo + d/4 below the midpoint, the midpoint itself, lo + 3d/4 above it. Every deterministic
    mode of the codec decides from the sign, the G-interval, exactness and the side of the
    midpoint only, so encode(t) == encode(v), rounding once (docs/matmul.md)."""

    fmt: FloatFormat
    saturate: bool = True
    rounding: str = "rne"
    scale: float | None = None
    op: str = "divide"
    max = math.inf  # no Inf conversion by the float paths: the codec handles overflow

    @property
    def name(self) -> str:
        return self.fmt.name

    @property
    def grid(self) -> OutFormat:
        # emax only bounds OutFormat.max, which nothing here reads: the grid continues above max
        return OutFormat(self.fmt.name, self.fmt.mantissa_bits + 1, self.fmt.emin, 1023)

    def _scaled(self, y: np.ndarray, bound: np.ndarray, applied: bool):
        """Approximation of v and its error bound from one of x (``applied``: already scaled)."""
        if self.scale is None or applied:
            return y, bound
        v = y / self.scale if self.op == "divide" else y * self.scale
        b = bound / self.scale if self.op == "divide" else bound * self.scale
        return v, b * (1 + 2.0 ** -40) + np.abs(v) * 2.0 ** -51  # + the rounding of v itself

    def candidate(self, y, bound, applied: bool = False):
        """Representative t and where it is certain: v's interval [v - b, v + b] holds no grid
        point and no midpoint. Measured in half-units of v's own binade (boundaries at integers),
        valid also next to a power of two (the power itself is a boundary)."""
        v, b = self._scaled(y, bound, applied)
        u = _ulp_exponent(np.abs(v), self.grid)
        z = np.ldexp(v, 1 - u)
        f = np.floor(z)
        sure = np.minimum(z - f, f + 1 - z) > np.ldexp(b, 1 - u)
        zero = b == 0  # every term is zero: x == 0, the result is +0
        return np.where(zero, 0.0, np.ldexp(f + 0.5, u - 1)), sure | zero

    def round_exact(self, taus: list) -> np.ndarray:
        """Representative of v for the exact sum x of ``taus`` (same bound as _round_exact)."""
        applied = self.scale is not None and self.op == "multiply"
        if applied:  # x * s as an exact expansion: every tau * s is a TwoProduct
            taus = [h for t in taus for h in _two_product(t, self.scale)]
        y, mag = taus[0], np.abs(taus[0])
        for t in taus[1:]:
            y, mag = y + t, mag + np.abs(t)
        t, sure = self.candidate(y, 4.0 * mag * ((len(taus) + 1) * 2.0 ** -53), applied)
        if not sure.all():
            unsure = ~sure
            v = self._scaled(y[unsure], mag[unsure], applied)[0]  # a starting point only
            t[unsure] = self._repair([x[unsure] for x in taus], v)
        return t

    def _repair(self, taus: list, v: np.ndarray) -> np.ndarray:
        """Exact: the G-floor lo of v, then v == lo? and the side of the midpoint. ``taus`` sum to
        v (multiply, or no scale) or to x = v * s (divide: every point g is compared as s * g,
        exact in float64: s has 24 significant bits, g at most precision + 1 <= 5)."""
        grid = self.grid
        s = self.scale if self.scale is not None and self.op == "divide" else 1.0
        exp = [taus[0]]
        for t in taus[1:]:
            exp = _grow(exp, t)

        def cmp(g):  # exact sign of (taus - s * g)
            return _sign(_grow(exp, -(s * g)))

        u = _ulp_exponent(np.abs(v), grid)
        lo = np.ldexp(np.floor(np.ldexp(v, -u)), u)
        while True:
            d_lo, d_hi, _ = _gaps(lo, grid)
            down = cmp(lo) < 0
            up = ~down & (cmp(lo + d_hi) >= 0)
            if not (down.any() or up.any()):
                break
            lo = np.where(down, lo - d_lo, np.where(up, lo + d_hi, lo))
        d = _gaps(lo, grid)[1]
        on, side = cmp(lo), cmp(lo + d / 2)
        t = np.where(on == 0, lo, lo + d * np.where(side < 0, 0.25, np.where(side == 0, 0.5, 0.75)))
        return np.where(t == 0, 0.0, t)  # an exact zero is +0


def _code_out(out_dtype, saturate, rounding, scale_result, scale_result_op) -> CodeOut | None:
    """CodeOut for an FP8/FP6/FP4 format name (or torch float8 dtype), None for a float output."""
    try:
        numpy_like = isinstance(out_dtype, np.dtype) or issubclass(out_dtype, np.generic)
    except TypeError:
        numpy_like = False
    name = np.dtype(out_dtype).name if numpy_like else str(out_dtype).removeprefix("torch.")
    if name in OUT_FORMATS or name not in FORMATS:
        return None
    fmt = FORMATS[name]
    if not (fmt.has_zero and fmt.has_subnormals and fmt.signed):
        raise FormatError(f"out_dtype: {name} has no zero, no subnormals or no sign (a scale format); "
                          f"expected a signed element format such as float8_e4m3fn")
    if not isinstance(saturate, bool):
        raise InputTypeError(f"saturate: expected True or False, got {saturate!r}")
    if rounding not in CODE_ROUNDINGS:
        raise FormatError(f"rounding: expected one of {', '.join(CODE_ROUNDINGS)} for an {name} output, "
                          f"got {rounding!r}")
    if scale_result_op not in SCALE_RESULT_OPS:
        raise InputTypeError(f"scale_result_op: expected 'divide' or 'multiply', got {scale_result_op!r}")
    scale = None
    if scale_result is not None:
        sr = _float_array(scale_result, "scale_result", ("float32",))
        if sr.size != 1:
            raise ShapeError(f"scale_result: expected one float32 value (shape () or (1,)), got shape "
                             f"{_shape_text(sr.shape)}")
        scale = float(sr.reshape(-1)[0])
        if not (math.isfinite(scale) and scale > 0):
            raise ScaleError(f"scale_result: expected a finite float32 > 0, got {scale!r}")
    return CodeOut(fmt, saturate, rounding, scale, scale_result_op)


# --------------------------------------------------------------------------------------------
# exact
# --------------------------------------------------------------------------------------------
def _int_pieces(codes: np.ndarray, fmt: FloatFormat, present: np.ndarray, n: int):
    """Split the finite values of ``codes`` into n pieces by binade: value == sum(ints_i * 2**g_i)
    with every ints_i integer-valued and |ints_i| < 2**(ceil(span/n) + M) (see _piece_count).
    Built by table lookup: one gather per piece."""
    values = _code_values(fmt)
    e = np.full(values.shape, np.iinfo(np.int64).min)
    nz = np.isfinite(values) & (values != 0)
    e[nz] = np.maximum(_exponent(values[nz]), fmt.emin)
    used = e[nz & present]
    if not used.size:
        return [(np.zeros(codes.shape), 0)]
    lo, hi = int(used.min()), int(used.max())
    step = -(-(hi - lo + 1) // n)
    pieces = []
    for i in range(n):
        first = lo + i * step
        g = first - fmt.mantissa_bits
        table = np.where((e >= first) & (e < first + step), np.ldexp(np.where(nz, values, 0.0), -g), 0.0)
        pieces.append((np.take(table, codes), g))
    return pieces


def _span(fmt: FloatFormat, present: np.ndarray) -> int:
    """Number of binades (subnormals count as emin) among the finite nonzero values present."""
    values = _code_values(fmt)
    nz = np.isfinite(values) & (values != 0) & present
    if not nz.any():
        return 1
    e = np.maximum(_exponent(values[nz]), fmt.emin)
    return int(e.max() - e.min() + 1)


def _present(codes: np.ndarray, fmt: FloatFormat) -> np.ndarray:
    """Which of the format's codes occur (bool per code)."""
    return np.bincount(codes.reshape(-1), minlength=256)[:fmt.n_codes] > 0


def _check_codes(codes: np.ndarray, fmt: FloatFormat, what: str) -> bool:
    """Reject codes past 2**bits (FormatError); True when a NaN or Inf code occurs."""
    if fmt.bits < 8 and codes.size and int(codes.max()) >= fmt.n_codes:
        bad = int(codes[codes >= fmt.n_codes].reshape(-1)[0])
        raise FormatError(f"{what}: {fmt.name} has {fmt.bits}-bit codes (< {fmt.n_codes:#x}), got {bad:#04x}")
    if fmt.specials == "fnuz":  # the one NaN sits at the negative-zero code
        return bool((codes == fmt.sign_mask).any())
    if fmt.specials in ("ieee", "fn"):  # Inf/NaN are the magnitudes above the largest finite one
        return bool(((codes & fmt.magnitude_mask) > fmt.max_code_magnitude).any())
    return False


def _piece_count(span_a: int, span_b: int, m_a: int, m_b: int, k: int) -> tuple[int, int]:
    """Fewest pieces nA * nB such that every partial sum of a k-long dot product of integer pieces
    stays below 2**53: width(a) + width(b) + ceil(log2 k) <= 53, width = ceil(span/n) + M."""
    budget = 53 - math.ceil(math.log2(max(k, 1)))
    best = None
    for na in range(1, span_a + 1):
        for nb in range(1, span_b + 1):
            if -(-span_a // na) + m_a + -(-span_b // nb) + m_b <= budget:
                if best is None or na * nb < best[0] * best[1]:
                    best = (na, nb)
                break
    if best is None:
        raise ShapeError(f"K = {k} is too long for an exact float64 integer product")
    return best


def _specials(A: np.ndarray, B: np.ndarray) -> np.ndarray:
    """IEEE value of sum_k a*b where it is NaN or +-Inf (NaN operand, Inf*0, Inf - Inf), 0 elsewhere.
    Counts are products of 0/1 matrices: exact in float64."""
    f = np.float64
    nan_a, nan_b = np.isnan(A), np.isnan(B)
    pos_a, neg_a = (A > 0).astype(f), (A < 0).astype(f)
    pos_b, neg_b = (B > 0).astype(f), (B < 0).astype(f)
    inf_a, inf_b = np.isinf(A), np.isinf(B)
    zero_a, zero_b = (A == 0).astype(f), (B == 0).astype(f)
    nan = (nan_a.any(axis=1)[:, None] | nan_b.any(axis=0)[None, :]
           | ((inf_a.astype(f) @ zero_b + zero_a @ inf_b.astype(f)) > 0))
    ipa, ina = (inf_a & (A > 0)).astype(f), (inf_a & (A < 0)).astype(f)
    ipb, inb = (inf_b & (B > 0)).astype(f), (inf_b & (B < 0)).astype(f)
    plus = (ipa @ pos_b + ina @ neg_b + pos_a @ ipb + neg_a @ inb) > 0
    minus = (ipa @ neg_b + ina @ pos_b + pos_a @ inb + neg_a @ ipb) > 0
    return np.where(nan | (plus & minus), np.nan, np.where(plus, np.inf, np.where(minus, -np.inf, 0.0)))


def _narrow(s: np.ndarray) -> np.ndarray:
    """A (n, 1) or (1, n) scale slice whose entries are all equal as a (1, 1) array (cheaper products)."""
    return s[:1, :1] if s.size and (s == s.flat[0]).all() else s


def _per_block(pa, pb, sa, sb, bk, finite_bias, out: OutFormat) -> np.ndarray:
    """Exact rounding from one exact float64 integer matmul per K-block and piece pair (docs/matmul.md)."""
    M, K = pa[0][0].shape
    N = pb[0][0].shape[1]
    kb = sa.shape[1]
    n_terms = kb * len(pa) * len(pb)
    cols = max(1, min(N, (1 << 24) // max(1, n_terms * M)))  # bound the stored sums to ~128 MiB
    result = np.empty((M, N))
    for c0 in range(0, N, cols):
        cs = slice(c0, min(N, c0 + cols))
        sums, scales = [], []  # exact block dot products (float64 integers times 2**g) and their scales
        y = np.zeros((M, cs.stop - c0)) if finite_bias is None else np.broadcast_to(finite_bias[cs], (M, cs.stop - c0))
        mag = np.abs(y)
        for blk in range(kb):
            ks = slice(blk * bk, min(K, (blk + 1) * bk))
            scale = _narrow(sa[:, blk:blk + 1]) * _narrow(sb[blk:blk + 1, cs])  # exact: two float32 values
            for ia, ga in pa:
                for ib, gb in pb:
                    sums.append(np.ldexp(ia[:, ks] @ ib[ks, cs], ga + gb))
                    scales.append(scale)
                    t = scale * sums[-1]
                    y, mag = y + t, mag + np.abs(t)
        # y: n_terms rounded products and n_terms additions -> |y - x| <= 2 n_terms 2**-53 sum|terms|
        c, sure = _candidate(y, 4.0 * mag * ((2 * n_terms + 2) * 2.0 ** -53), out)
        if not sure.all():  # near a rounding boundary: exact terms (TwoProduct), exact sum, exact rounding
            unsure = ~sure
            terms = [finite_bias[cs][np.nonzero(unsure)[1]] if finite_bias is not None else np.zeros(unsure.sum())]
            for scale, ps in zip(scales, sums, strict=True):
                terms.extend(_two_product(np.broadcast_to(scale, ps.shape)[unsure], ps[unsure]))
            stack = np.stack(terms)
            c[unsure] = np.concatenate([_round_exact(_extract(stack[:, r0:r0 + _CHUNK]), out)
                                        for r0 in range(0, stack.shape[1], _CHUNK)])
        result[:, cs] = np.where(np.abs(c) > out.max, np.copysign(np.inf, c), c)
    return result


def _blocked(pa, pb, sa, sb, bk, finite_bias, out: OutFormat, max_unsure: float = 1 / 16):
    """The K-blocked case without exact block sums: with the scales folded into the operands
    (a' = a * sa, b' = b * sb: exact, at most 24 + 24 significant bits) y = bias + sum over blocks
    of the float64 product A'_blk @ B'_blk satisfies |y - x| <= gamma_(bk + kb) (|bias| + sum_k |a' b'|)
    in any BLAS order, with or without FMA, and sum_k |a' b'| <= |a'_m| |b'_n| (Cauchy-Schwarz).
    Elements that this bound leaves undecided get exact block sums from their own row and column.
    None when more than ``max_unsure`` of the elements are undecided (the per-block path is cheaper)."""
    M, K = pa[0][0].shape
    N = pb[0][0].shape[1]
    kb = sa.shape[1]
    A = sum(np.ldexp(ia, g) for ia, g in pa) * sa[:, np.minimum(np.arange(K) // bk, kb - 1)]  # exact
    B = sum(np.ldexp(ib, g) for ib, g in pb)
    y = np.zeros((M, N)) if finite_bias is None else np.repeat(finite_bias[None, :], M, axis=0)
    b_norm2, tmp, b_buf = np.zeros(N), np.empty((M, N)), np.empty((min(bk, K), N))
    for blk, k0 in enumerate(range(0, K, bk)):
        b_blk = np.multiply(B[k0:k0 + bk], sb[blk], out=b_buf[:min(bk, K - k0)])  # exact
        np.einsum("kn,kn->n", b_blk, b_blk, out=tmp[0])
        b_norm2 += tmp[0]
        np.matmul(A[:, k0:k0 + bk], b_blk, out=tmp)
        y += tmp
    mag = np.sqrt(np.einsum("mk,mk->m", A, A))[:, None] * np.sqrt(b_norm2)[None, :]
    if finite_bias is not None:
        mag += np.abs(finite_bias)
    # 4x slack covers the rounding of mag itself (relative error about (K + 2) 2**-53)
    c, sure = _candidate(y, 4.0 * mag * ((bk + kb + 2) * 2.0 ** -53), out)
    unsure = np.nonzero(~sure)
    if unsure[0].size > max_unsure * y.size:
        return None
    if unsure[0].size:
        c[unsure] = _repair_rows(pa, pb, sa, sb, bk, finite_bias, unsure, out)
    return np.where(np.abs(c) > out.max, np.copysign(np.inf, c), c)


def _repair_rows(pa, pb, sa, sb, bk, finite_bias, idx, out: OutFormat) -> np.ndarray:
    """Exact RNE of the elements (rows idx[0], columns idx[1]): per K-block and piece pair the
    integer dot product of the element's own row and column (exact in any order, _piece_count),
    times its block scale as an exact TwoProduct, then the exact summation of _round_exact."""
    K = pa[0][0].shape[1]
    starts = np.arange(0, K, bk)
    step = max(1, (1 << 22) // max(K, 1))  # elements per pass: products held at ~32 MiB
    done = []
    for e0 in range(0, idx[0].size, step):
        mi, ni = idx[0][e0:e0 + step], idx[1][e0:e0 + step]
        terms = [finite_bias[ni] if finite_bias is not None else np.zeros(mi.size)]
        for blk, k0 in enumerate(starts):
            scale = sa[mi, blk] * sb[blk, ni]  # exact: two float32 values
            for ia, ga in pa:
                for ib, gb in pb:
                    ps = np.ldexp((ia[mi, k0:k0 + bk] * ib[k0:k0 + bk, ni].T).sum(axis=1), ga + gb)
                    terms.extend(_two_product(scale, ps))
        done.append(_round_exact(_extract(np.stack(terms)), out))
    return np.concatenate(done)


def _exact(ca, cb, fa, fb, sa, sb, bk, bias, out: OutFormat) -> np.ndarray:
    M, K = ca.shape
    N = cb.shape[1]
    kb = sa.shape[1]
    special = None
    if _check_codes(ca, fa, "a") | _check_codes(cb, fb, "b"):
        special = _specials(decode(ca, fa), decode(cb, fb))
    # spans of the whole formats first; the data's own spans only when those need several pieces
    present_a, present_b = np.ones(fa.n_codes, bool), np.ones(fb.n_codes, bool)
    na, nb = _piece_count(_span(fa, present_a), _span(fb, present_b), fa.mantissa_bits, fb.mantissa_bits,
                          min(bk, K))
    if na * nb > 1:
        present_a, present_b = _present(ca, fa), _present(cb, fb)
        na, nb = _piece_count(_span(fa, present_a), _span(fb, present_b), fa.mantissa_bits, fb.mantissa_bits,
                              min(bk, K))
    if special is None and na == 1:  # one piece: the values themselves (ints times 2**g, g folded in)
        pa = [(decode(ca, fa).astype(np.float64), 0)]
    else:
        pa = _int_pieces(ca, fa, present_a, na)
    if special is None and nb == 1:
        pb = [(decode(cb, fb).astype(np.float64), 0)]
    else:
        pb = _int_pieces(cb, fb, present_b, nb)
    finite_bias = None if bias is None else np.where(np.isfinite(bias), bias, 0.0)
    result = _blocked(pa, pb, sa, sb, bk, finite_bias, out) if kb > 1 else None
    if result is None:
        result = _per_block(pa, pb, sa, sb, bk, finite_bias, out)
    # NaN/Inf: the finite sum plus a non-finite bias is that bias; specials follow IEEE addition
    bias_bad = np.zeros(N, bool) if bias is None else ~np.isfinite(bias)
    if special is not None or bias_bad.any():
        sp = np.zeros((M, N)) if special is None else special
        set_ = (sp != 0) | np.isnan(sp)
        result = np.where(set_ | bias_bad, sp + (0.0 if bias is None else bias), result)
    return result


# --------------------------------------------------------------------------------------------
# fp32 and fp32-limited
# --------------------------------------------------------------------------------------------
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
    The C loop (_kernels_matmul.c) and the numpy loop below compute the same bits."""
    M, K = ca.shape
    N = cb.shape[1]
    f32 = np.float32
    operands = scale_order == "operands"
    if operands:
        col = np.minimum(np.arange(K) // bk, sa.shape[1] - 1)
        A = (decode(ca, fa) * sa.astype(f32)[:, col]).astype(f32)
        B = (decode(cb, fb) * sb.astype(f32)[col, :]).astype(f32)
    if KERNELS is not None:
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
    e = np.where(a == 0, -126, _exponent(np.where(a == 0, 1.0, a)))
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
                s, err = _two_sum(acc, prod)
                finite = np.isfinite(s)
                acc = np.where(finite, _truncate(np.where(finite, s, 0.0), np.where(finite, err, 0.0),
                                                 mantissa_bits), s)
        blk = min(ks.start // bk, sa.shape[1] - 1)
        s32 = (sa[:, blk:blk + 1].astype(np.float32) * sb[blk:blk + 1, :].astype(np.float32)).astype(np.float32)
        total = (total + (s32 * acc.astype(np.float32)).astype(np.float32)).astype(np.float32)
    return total


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------
def scaled_mm(a, b, scale_a, scale_b, *, bias=None, out_dtype="float32", accumulate: str = "exact",
              fmt_a=None, fmt_b=None, block_k: int | None = None, block_n: int = 128,
              scale_order: str = "epilogue", promote_every: int = 128, mantissa_bits: int = 13,
              scale_result=None, scale_result_op: str = "divide", saturate: bool = True, rounding: str = "rne"):
    """``out = round(sum_k a[m,k] * b[k,n] * scale + bias[n])`` with ``torch._scaled_mm``'s operands.

    a: (M, K), b: (K, N): uint8 codes in ``fmt_a``/``fmt_b`` (default float8_e4m3fn) or torch float8
    tensors (format from the dtype). scale_a / scale_b: float32 dequantization multipliers per tensor,
    per row (M, 1) / per column (1, N), or per block: (M, ceil(K/block_k)) and
    (ceil(K/block_k), ceil(N/block_n)) (block_k defaults to 128). bias: (N,) float32/bfloat16/float16.
    out_dtype: float32, bfloat16 or float16. Output is torch when ``a`` is a torch tensor, else numpy.
    out_dtype may also name a signed format of fp8ref.formats with subnormals (float8_e4m3fn,
    float8_e5m2, the fnuz formats, float6_*, float4_e2m1fn; or a torch float8 dtype): the result is
    then uint8 codes (numpy, or a torch.uint8 tensor for torch input; ``codec.view_as_float8`` views
    it as torch float8), ``encode(v, fmt, saturate=saturate, rounding=rounding)`` with
    v = result / scale_result (``scale_result_op="divide"``, torch's CPU rule) or result * scale_result
    ("multiply", cuBLASLt's); scale_result is a positive finite float32 scalar (None: 1). In "exact"
    mode v is the exact value, rounded once; in the fp32 modes v = fp32(acc op scale_result).

    accumulate: "exact" (exact sum, one rounding), "fp32" (declared sequential order; ``block_k``
    also sets the K-blocks whose scaled sums are added to the fp32 total; ``scale_order`` "epilogue"
    scales each block sum, "operands" scales a and b first as torch's CPU path does), or
    "fp32-limited" (``mantissa_bits`` fraction bits, truncated after each addition, promoted to
    fp32 every ``promote_every`` elements). docs/matmul.md defines each order exactly.
    """
    if accumulate not in ACCUMULATIONS:
        raise InputTypeError(f"accumulate: expected one of {', '.join(ACCUMULATIONS)}, got {accumulate!r}")
    if scale_order not in SCALE_ORDERS:
        raise InputTypeError(f"scale_order: expected one of {', '.join(SCALE_ORDERS)}, got {scale_order!r}")
    for name, v, lo in (("block_k", block_k, 1), ("block_n", block_n, 1), ("promote_every", promote_every, 1),
                        ("mantissa_bits", mantissa_bits, 0)):
        if v is not None and (type(v) is not int or v < lo):
            raise InputTypeError(f"{name}: expected an int >= {lo}, got {v!r}")
    if mantissa_bits > 23:
        raise InputTypeError(f"mantissa_bits: at most 23 (fp32), got {mantissa_bits}")
    code = _code_out(out_dtype, saturate, rounding, scale_result, scale_result_op)
    if code is None:
        # torch's CPU _scaled_mm silently ignores scale_result for float outputs: refuse instead
        for name, v, default in (("scale_result", scale_result, None), ("saturate", saturate, True),
                                 ("rounding", rounding, "rne")):
            if v is not default and v != default:
                raise InputTypeError(f"{name}: applies only to an FP8/FP6/FP4 out_dtype, got {name}={v!r} "
                                     f"with out_dtype={out_dtype!r}")
        if scale_result_op not in SCALE_RESULT_OPS:
            raise InputTypeError(f"scale_result_op: expected 'divide' or 'multiply', got {scale_result_op!r}")
    out = code or _out_format(out_dtype)
    ca, fa = _operand(a, fmt_a, "a")
    cb, fb = _operand(b, fmt_b, "b")
    (M, K), (K2, N) = ca.shape, cb.shape
    if K != K2:
        raise ShapeError(f"b: got shape {_shape_text(cb.shape)}, expected ({K}, N) to match a of shape "
                         f"{_shape_text(ca.shape)}")
    sa, sb, bk = _canonical_scales(_scale(scale_a, "scale_a"), _scale(scale_b, "scale_b"), M, K, N,
                                   128 if block_k is None else block_k, block_n)
    if bias is not None:
        bias = _float_array(bias, "bias", ("float32", "bfloat16", "float16"))
        if bias.shape != (N,):
            raise ShapeError(f"bias: got shape {_shape_text(bias.shape)}, expected ({N},)")
    if accumulate == "exact":
        values = _exact(ca, cb, fa, fb, sa, sb, bk, bias, out)
        if code is not None:  # values are representatives (CodeOut): one rounding, by the codec
            return _deliver_codes(encode(values, code.fmt, saturate=saturate, rounding=rounding), _is_torch(a))
    else:
        if accumulate == "fp32":
            acc = _fp32(ca, cb, fa, fb, sa, sb, bk, block_k if block_k is not None else bk, scale_order)
        else:
            A, B = decode(ca, fa), decode(cb, fb)
            if bk % promote_every and sa.shape[1] > 1:
                raise ShapeError(f"promote_every: {promote_every} must divide the scale block length {bk}")
            acc = _fp32_limited(A, B, sa, sb, bk, promote_every, mantissa_bits)
        if bias is not None:
            acc = (acc + bias.astype(np.float32)).astype(np.float32)
        if code is not None:  # v = fp32(acc / s) or fp32(acc * s) (IEEE float32), then encode from fp32
            if code.scale is not None:
                with np.errstate(over="ignore", invalid="ignore", under="ignore"):
                    s32 = np.float32(code.scale)
                    acc = (acc / s32 if code.op == "divide" else acc * s32).astype(np.float32)
            return _deliver_codes(encode(acc, code.fmt, saturate=saturate, rounding=rounding), _is_torch(a))
        values = acc.astype(np.float64)
        if out.name != "float32":  # a float32 value is already on the float32 grid
            values = _round_to(values, out)
    return _deliver(values, out, _is_torch(a))


def linear(x, weight, weight_scale, *, input_scale=None, dynamic: str | None = None, bias=None,
           fmt="float8_e4m3fn", input_fmt="float8_e4m3fn", out_dtype=None, block_k: int = 128,
           block_n: int = 128, **mm_options):
    """A W8A8 linear layer: ``y = x @ W.T`` with W (N, K) FP8 codes and activations quantized to FP8.

    weight_scale: per tensor (numel 1), per channel (N,) / (N, 1), or per block
    (ceil(N/block_n), ceil(K/block_k)), the layout checkpoints store. Activations: static with
    ``input_scale`` (numel 1), or ``dynamic`` = "tensor", "token" (one scale per row of x) or
    "group" (1 x block_k groups). Dynamic scale = fp32(amax / fmt.max), 1.0 where amax == 0 (q is
    all zero then, so any scale gives the same product). Quantization: q = encode(fp32(x / s),
    input_fmt) (RNE, saturating). Everything else as ``scaled_mm`` (``mm_options``).
    """
    xv = _float_array(x, "x", ("float32", "bfloat16", "float16"))
    if xv.ndim < 1:
        raise ShapeError(f"x: expected shape (..., K), got {_shape_text(xv.shape)}")
    lead, K = xv.shape[:-1], xv.shape[-1]
    x2 = xv.reshape(-1, K).astype(np.float32)
    if _is_torch(weight):
        import torch
        w_codes = weight.view(torch.uint8) if weight.dtype != torch.uint8 else weight
        w_fmt = str(weight.dtype).removeprefix("torch.") if weight.dtype != torch.uint8 else fmt
        w_codes = w_codes.detach().contiguous().numpy()
    else:
        w_codes, w_fmt = weight, fmt
    if not isinstance(w_codes, np.ndarray) or w_codes.ndim != 2 or w_codes.shape[1] != K:
        raise ShapeError(f"weight: got shape {_shape_text(getattr(w_codes, 'shape', ()))}, expected (N, {K}) "
                         f"to match x of shape {_shape_text(xv.shape)}")
    N = w_codes.shape[0]
    ws = _scale(weight_scale, "weight_scale")
    nb, kb = -(-N // block_n), -(-K // block_k)
    if ws.size == 1:
        scale_b = ws.reshape(())
    elif ws.shape in ((N,), (N, 1)):
        scale_b = ws.reshape(1, N)
    elif ws.shape == (nb, kb):
        scale_b = ws.T
    else:
        raise ShapeError(f"weight_scale: got shape {_shape_text(ws.shape)}, expected (), (1,), ({N},), ({N}, 1) "
                         f"or ({nb}, {kb}) ({block_n}x{block_k} blocks)")
    ifmt = get_format(input_fmt)
    if input_scale is not None:
        if dynamic is not None:
            raise InputTypeError(f"dynamic: give either input_scale (static) or dynamic, got both ({dynamic!r})")
        s_x = _scale(input_scale, "input_scale")
        if s_x.size != 1:
            raise ShapeError(f"input_scale: static activation scales are per tensor, got shape "
                             f"{_shape_text(s_x.shape)}, expected () or (1,)")
        s_x = s_x.reshape(())
        s_cols = s_x.reshape(1, 1)
    else:
        if dynamic not in ("tensor", "token", "group"):
            raise InputTypeError(f"dynamic: expected 'tensor', 'token' or 'group' when input_scale is None, "
                                 f"got {dynamic!r}")
        amax = _group_amax(np.abs(x2), dynamic, block_k)
        s_x = (amax.astype(np.float32) / np.float32(ifmt.max)).astype(np.float64)
        s_x = np.where(amax == 0, 1.0, s_x)
        if dynamic == "tensor":
            s_x, s_cols = s_x.reshape(()), s_x.reshape(1, 1)
        elif dynamic == "token":
            s_cols = s_x
        else:
            s_cols = np.repeat(s_x, block_k, axis=1)[:, :K]
    q = encode((x2 / s_cols.astype(np.float32)).astype(np.float32), ifmt)
    if _is_torch(x):  # scaled_mm returns the library of its first operand
        import torch
        q = torch.from_numpy(q)
    y = scaled_mm(q, np.ascontiguousarray(w_codes.T), s_x.astype(np.float32), scale_b.astype(np.float32),
                  bias=bias, out_dtype=out_dtype or _default_out(x), fmt_a=ifmt, fmt_b=w_fmt,
                  block_k=block_k, block_n=block_n, **mm_options)
    return y.reshape(*lead, N)


def _default_out(x) -> str:
    name = str(x.dtype).removeprefix("torch.")
    return name if name in OUT_FORMATS else "float32"


def _group_amax(absx: np.ndarray, dynamic: str, block_k: int) -> np.ndarray:
    """amax per tensor (1, 1), per row (M, 1) or per 1 x block_k group (M, ceil(K/block_k))."""
    if dynamic == "tensor":
        return np.asarray(absx.max() if absx.size else 0.0).reshape(1, 1)
    if dynamic == "token":
        return absx.max(axis=1, keepdims=True) if absx.size else np.zeros((absx.shape[0], 1))
    M, K = absx.shape
    pad = -K % block_k
    padded = np.concatenate([absx, np.zeros((M, pad), absx.dtype)], axis=1)
    return padded.reshape(M, -1, block_k).max(axis=2)
