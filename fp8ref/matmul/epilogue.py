"""The last step of the exact model: rounding an exact sum (a list of float64 terms) once to the
output, a float format (``OutFormat``) or the codes of an FP8/FP6/FP4 format (``CodeOut``).

``_candidate`` rounds a float64 approximation and says where that is certainly right; ``_repair``
and ``CodeOut._repair`` decide the rest by exact comparisons (docs/matmul.md)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .._arrays import float64_values
from ..errors import FormatError, InputTypeError, ScaleError, ShapeError
from ..exact import expansion_sign, grow_expansion, two_product
from ..formats import FORMATS, FloatFormat
from ..rounding import OUT_FORMATS, OutFormat, exponent, ulp_exponent
from .operands import _shape_text

SCALE_RESULT_OPS = ("divide", "multiply")
CODE_ROUNDINGS = ("rne", "rna", "rtz", "rup", "rdown", "rto")


def _gaps(c: np.ndarray, out: OutFormat):
    """Distances from grid points c (unbounded exponent) to their neighbours below and above, and
    whether c's integer significand is odd."""
    a = np.abs(c)
    u = ulp_exponent(a, out)
    ulp = np.ldexp(1.0, u)
    e = exponent(np.where(a == 0, 1.0, a))
    below = np.where((a != 0) & (a == np.ldexp(1.0, e)) & (e > out.emin), ulp / 2, ulp)  # toward zero
    odd = np.fmod(np.ldexp(a, -u), 2.0) == 1.0
    return np.where(c > 0, below, ulp), np.where(c < 0, below, ulp), odd


def _candidate(y: np.ndarray, bound: np.ndarray, out: OutFormat) -> tuple[np.ndarray, np.ndarray]:
    """RNE of y on ``out``'s grid (unbounded exponent; a zero keeps y's sign), and where that is
    certainly the RNE of every x with |x - y| <= bound/2 (``sure``)."""
    if isinstance(out, CodeOut):
        return out.candidate(y, bound)
    u = ulp_exponent(np.abs(y), out)
    z = np.ldexp(y, -u)  # y in units of its own binade's spacing: rounding boundaries are at k + 1/2
    r = np.rint(z)
    c = np.ldexp(r, u)
    # that interval lies inside c's rounding interval, also where c is a power of two
    sure = 0.5 - np.abs(z - r) > np.ldexp(bound, -u)
    sure &= (c != 0) | (np.abs(y) > bound) | (bound == 0)  # the sign of a zero result is known too
    return np.where(c == 0, np.where(y < 0, -0.0, 0.0), c), sure


_EXP_MASK, _ABS_MASK = np.uint64(0x7FF0_0000_0000_0000), np.uint64(0x7FFF_FFFF_FFFF_FFFF)
_NATIVE_CASTS = {"float32": np.float32, "float16": np.float16}  # numpy's float64 casts: RNE, IEEE overflow

# Deciding a float64 y from its bits (``_decide_sum``, ``_decide_bound``). For y in ``out``'s
# normal range, with s = 53 - precision float64 fraction bits below out's last place, low = y's
# last s bits is y's offset above the grid point below it in units of ulp64(y); the rounding
# boundary (midpoint) sits at low == 2**(s-1), and the next ones are at least 2**(s-2) units away
# (below a power of two out's grid is twice as fine). So an x with |x - y| < d units rounds as y
# does when d <= |low - 2**(s-1)| and d <= 2**(s-2). A y below 2**emin (out's subnormals) is left
# to the exact path unless it is an exact zero (+0).


def _decide_sum(y: np.ndarray, out: OutFormat, p: np.ndarray | None = None, tiny: bool = True):
    """(RNE of y on out's grid, where it is certainly the RNE of x) for y = fl(x) (``p`` None) or
    y = fl(p + b) with p = fl(x - b) (b the bias, x exact); y and p are 0 or normal float64 (the
    exact model's sums: no float64 underflow). No bias: only a y exactly on a midpoint
    is unsure. With one: |x - y| <= ulp(p)/2 + ulp(y)/2 <= 1.5 ulp(y) where p's binade is at most
    one above y's, so |low - 2**(s-1)| >= 2 decides; the others (cancellation) are unsure.
    ``tiny=False``: the caller has proved that no nonzero y lies below 2**emin (nor, with p, below
    2**(emin+2)... through p: every nonzero p is >= 2**(emin+2) and every nonzero b >= 2**emin)."""
    s = 53 - out.precision
    y = np.ascontiguousarray(y, np.float64)
    u = y.view(np.uint64)
    work = np.bitwise_and(u, np.uint64((1 << s) - 1))
    if p is None:
        sure = work != np.uint64(1 << (s - 1))
    else:
        work -= np.uint64((1 << (s - 1)) - 1)  # |low - half| >= 2  <=>  (low - half + 1) mod 2**64 > 2
        sure = work > np.uint64(2)
        ep = np.bitwise_and(p.view(np.uint64), _EXP_MASK)
        np.bitwise_and(u, _EXP_MASK, out=work)
        work += np.uint64(1 << 52)
        sure &= ep <= work
    if tiny:
        _undecide_tiny(u, out, sure, work)
    return _round_bits(y, u, out, work), sure


def _decide_bound(y: np.ndarray, bound: np.ndarray, out: OutFormat):
    """(RNE of y on out's grid, where it is certainly the RNE of every x with |x - y| <= bound).
    A zero y with a zero bound is an exact zero: decided, +0."""
    s = 53 - out.precision
    y = np.ascontiguousarray(y, np.float64)
    u = y.view(np.uint64)
    work = np.bitwise_and(u, np.uint64((1 << s) - 1))
    dist = work.astype(np.float64)
    dist -= float(1 << (s - 1))
    np.abs(dist, out=dist)  # |low - half| in units of ulp64(y)
    np.minimum(dist, float(1 << (s - 2)), out=dist)
    binade = np.bitwise_and(u, _EXP_MASK, out=work).view(np.float64)  # 2**floor(log2|y|)
    dist *= binade
    dist *= 2.0 ** -52  # in absolute terms (ulp64(y) = binade 2**-52 for a normal y; 0 for a zero y)
    sure = bound < dist
    sure &= binade >= math.ldexp(1.0, out.emin)  # y >= 2**emin: not in out's subnormals
    sure |= (bound == 0) & (y == 0)
    return _round_bits(y, u, out, work), sure


def _undecide_tiny(u: np.ndarray, out: OutFormat, sure: np.ndarray, work: np.ndarray) -> None:
    """sure &= not (0 < |y| < 2**emin), from the bits u of y (work: scratch of u's shape)."""
    np.bitwise_and(u, _ABS_MASK, out=work)
    work -= np.uint64(1)  # 0 wraps to the top: zeros stay decided
    sure &= work >= np.uint64(np.float64(math.ldexp(1.0, out.emin)).view(np.uint64) - np.uint64(1))


def _round_bits(y: np.ndarray, u: np.ndarray, out: OutFormat, work: np.ndarray) -> np.ndarray:
    """RNE of finite float64 y to out (overflow to +-Inf, zero to +0), right wherever y is in out's
    normal range or zero: numpy's cast for float32/float16, else add half - 1 + the last kept bit
    (ties to even) and clear the low bits. float32/float16 arrays for those outputs."""
    if out.name in _NATIVE_CASTS:
        with np.errstate(over="ignore"):
            c = y.astype(_NATIVE_CASTS[out.name])
    else:
        s = 53 - out.precision
        np.right_shift(u, np.uint64(s), out=work)
        work &= np.uint64(1)
        work += u
        work += np.uint64((1 << (s - 1)) - 1)
        work &= np.uint64(~((1 << s) - 1) & 0xFFFF_FFFF_FFFF_FFFF)
        c = work.view(np.float64)
        if not (np.max(c, initial=0.0) <= out.max and np.min(c, initial=0.0) >= -out.max):
            c = np.where(np.abs(c) > out.max, np.copysign(np.inf, c), c)
    c += 0.0  # -0 -> +0: a decided zero is an exact zero
    return c


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
        exp = grow_expansion(exp, t)
    while True:
        d_lo, d_hi, odd = _gaps(c, out)
        s_hi = expansion_sign(grow_expansion(exp, -(c + d_hi / 2)))
        s_lo = expansion_sign(grow_expansion(exp, -(c - d_lo / 2)))
        up = (s_hi > 0) | ((s_hi == 0) & odd)  # ties go to the even neighbour
        down = (s_lo < 0) | ((s_lo == 0) & odd)
        if not (up.any() or down.any()):
            break
        c = np.where(up, c + d_hi, np.where(down, c - d_lo, c))
    return np.where(c == 0, np.where(expansion_sign(exp) < 0, -0.0, 0.0), c)  # underflow keeps the sign; 0 is +0


def _round_quotient_exact(taus: list, g: np.ndarray, out: OutFormat) -> np.ndarray:
    """RNE of (exact sum of ``taus``) / g to ``out``, g > 0 finite float64: a float64 candidate,
    then exact comparisons of the sum with mid * g (TwoProduct: mid * g = hi + lo exactly) for the
    midpoints around it where the candidate may be wrong, as ``_repair`` does for sums."""
    y, mag = taus[0], np.abs(taus[0])
    for t in taus[1:]:
        y, mag = y + t, mag + np.abs(t)
    g = np.broadcast_to(np.asarray(g, np.float64), np.shape(y))
    with np.errstate(over="ignore", invalid="ignore"):
        c, sure = _candidate(y / g, 4.0 * mag * ((len(taus) + 2) * 2.0 ** -53) / g, out)
    if sure.all():
        return np.where(np.abs(c) > out.max, np.copysign(np.inf, c), c)
    unsure = ~sure
    exp = [taus[0][unsure]]
    for t in taus[1:]:
        exp = grow_expansion(exp, t[unsure])
    gu, cu = g[unsure], c[unsure]
    while True:
        d_lo, d_hi, odd = _gaps(cu, out)
        signs = []
        for mid in (cu + d_hi / 2, cu - d_lo / 2):  # exact: half a gap of a float64 grid point
            hi, lo = two_product(mid, gu)
            signs.append(expansion_sign(grow_expansion(grow_expansion(exp, -hi), -lo)))
        up = (signs[0] > 0) | ((signs[0] == 0) & odd)
        down = (signs[1] < 0) | ((signs[1] == 0) & odd)
        if not (up.any() or down.any()):
            break
        cu = np.where(up, cu + d_hi, np.where(down, cu - d_lo, cu))
    c[unsure] = np.where(cu == 0, np.where(expansion_sign(exp) < 0, -0.0, 0.0), cu)
    return np.where(np.abs(c) > out.max, np.copysign(np.inf, c), c)


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
        u = ulp_exponent(np.abs(v), self.grid)
        z = np.ldexp(v, 1 - u)
        f = np.floor(z)
        sure = np.minimum(z - f, f + 1 - z) > np.ldexp(b, 1 - u)
        zero = b == 0  # every term is zero: x == 0, the result is +0
        return np.where(zero, 0.0, np.ldexp(f + 0.5, u - 1)), sure | zero

    def round_exact(self, taus: list) -> np.ndarray:
        """Representative of v for the exact sum x of ``taus`` (same bound as _round_exact)."""
        applied = self.scale is not None and self.op == "multiply"
        if applied:  # x * s as an exact expansion: every tau * s is a TwoProduct
            taus = [h for t in taus for h in two_product(t, self.scale)]
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
            exp = grow_expansion(exp, t)

        def cmp(g):  # exact sign of (taus - s * g)
            return expansion_sign(grow_expansion(exp, -(s * g)))

        u = ulp_exponent(np.abs(v), grid)
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
        sr = float64_values(scale_result, "scale_result", ("float32",))
        if sr.size != 1:
            raise ShapeError(f"scale_result: expected one float32 value (shape () or (1,)), got shape "
                             f"{_shape_text(sr.shape)}")
        scale = float(sr.reshape(-1)[0])
        if not (math.isfinite(scale) and scale > 0):
            raise ScaleError(f"scale_result: expected a finite float32 > 0, got {scale!r}")
    return CodeOut(fmt, saturate, rounding, scale, scale_result_op)
