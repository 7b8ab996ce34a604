"""The reference attention with an FP8 KV cache (and optionally FP8 Q): one exactly defined,
deterministic computation, used by the golden ``attention`` operation and by ``fp8ref.nn``'s
reference mode alike (docs/models.md, "The reference attention").

With D the model dtype, inputs whose values D holds (q: (B, H, Tq, d); k, v: (B, Hkv, Tk, d),
H a multiple of Hkv, head h reading KV head h // (H / Hkv)) and per-tensor dequantization
multipliers k_s, v_s (and q_s) held by float32:

1. codes: ``K8 = encode(fp32(K / k_s))`` (fp32 division, RNE, saturating), V8 likewise, Q8 when
   q_s is given; k = decode(K8), v = decode(V8), q = decode(Q8) or Q itself. Every value below is
   float64 and every operation one IEEE float64 operation (no fused multiply-add), in this order:
2. bmm1: ``A[i, j] = ((q[i,0] k[j,0] + q[i,1] k[j,1]) + ...) + q[i,d-1] k[j,d-1]`` (sequential in
   the head dimension; exact when Q is FP8, as a scaled_mm of the codes), ``c1 = (q_s * k_s) * sm``
   with sm = 1 / sqrt(d) (each correctly rounded) unless given, ``S = A * c1``; masked entries
   (causal: key j > query i + Tk - Tq, the cache's last query aligned with the last key) are -inf.
3. softmax: ``m = max_j S``, ``e = exp64(S - m)`` (``exp64`` below: + * / and ldexp only, so its
   result does not depend on a libm), ``z = e[0] + e[1] + ...`` (sequential in j), ``P = e / z``.
4. bmm2: ``O = ((P[0] v[0] + P[1] v[1]) + ...) * v_s`` (sequential in j), rounded once (RNE) to D.
   With ``p_scale`` p_s (FP8 P, as FP8 attention kernels feed an FP8 bmm2): ``P8 = encode(P / p_s)``
   (one float64 division, one RNE to e4m3fn from float64, saturating), p = decode(P8), and
   ``O = ((p[0] v[0] + p[1] v[1]) + ...) * c2`` with ``c2 = p_s * v_s`` (exact: two float32 values);
   with e4m3fn V the sum is exact (every e4m3 x e4m3 product is a multiple of 2**-18, every partial
   sum below 2**53 of them for Tk < 2**17), so O is the real (p_s v_s) sum p v rounded to float64, then to D.

A query row with no unmasked key gives +0. NaN propagates (a NaN K or V code poisons its rows).

Per-head scales (llm-compressor's ``attn_head`` strategy: q_scale [H, 1, 1], k_scale / v_scale
[Hkv, 1, 1]): each scale argument may hold one value or one per head; step 1 divides each head by
its own scale, and c1 = (q_s[h] * k_s[h // (H / Hkv)]) * sm, c2 = v_s of the head, the same order.

``kv_cache`` picks how K and V are cached (docs/models.md, "KV-cache formats"):

- ``"fp8"`` (default): the static scales above.
- ``"fp8_per_token_head"`` (vLLM's ``--kv-cache-dtype fp8_per_token_head``): no stored scale; per
  token and KV head, ``s = max(fp32(amax / 448), fp32(1e-6))``, codes ``e4m3(clamp(fp32(x *
  fp32(1 / s)), +-448))``. bmm1 scales each logit by its key's scale, ``c1_j = (q_s * s_j) * sm``;
  bmm2 weighs each value row, ``O = ((w_0 v_0 + w_1 v_1) + ...)`` with ``w_j = P_j * s_j``.
- ``"nvfp4"`` (vLLM / FlashInfer / TRT-LLM's NVFP4 KV cache): k_scale / v_scale are the *encode*
  global scales G (FlashInfer computes 448 / amax); per 16 along head_dim, with every step one
  float32 operation: ``sf = G * (vmax * fp32(1/6))``, ``S8 = e4m3(sf)`` (RNE, saturating),
  ``r = 1 / (S8 * fp32(1/G))`` (0 where S8 is 0), codes ``e2m1(x * r)``; k = e2m1 * S8 (exact),
  and the global multiplier 1/G (one float64 division) takes k_s's place in c1 (v_s's in c2).
- ``"nvfp4_mult"`` (FlashInfer's ``nvfp4_kv_quantize``, which SGLang's NVFP4 KV cache calls): k_scale /
  v_scale are *multipliers* g; ``sf = fp32(1/g) * (vmax * fp32(1/6))``, ``S8 = e4m3(sf)``,
  ``r = 1 / (S8 * g)`` where vmax is not 0 (a block whose S8 is 0 but vmax is not gets r = inf
  there: its codes are not modelled, the reference writes 0; its values are 0 either way), codes
  ``e2m1(x * r)``; k = e2m1 * S8, and g takes k_s's place.
"""

from __future__ import annotations

import math

import numpy as np

from .codec import decode, encode
from .errors import InputTypeError
from .formats import get_format
from .rounding import round_to

# fdlibm's split of ln 2: _LN2_HI has 32 trailing zero bits, so k * _LN2_HI is exact for |k| < 2**20
_LN2_HI = 6.93147180369123816490e-01
_LN2_LO = 1.90821492927058770002e-10
_INV_LN2 = 1.44269504088896338700e+00
P_FORMAT = get_format("float8_e4m3fn")  # FP8 P: the format FP8 attention kernels feed bmm2
KV_CACHES = ("fp8", "fp8_per_token_head", "nvfp4", "nvfp4_mult")
NVFP4_BLOCK = 16
_E2M1 = get_format("float4_e2m1fn")
_E4M3 = get_format("float8_e4m3fn")
PER_TOKEN_HEAD_MIN_SCALE = np.float32(1e-6)  # vLLM's floor under amax / 448
_TAYLOR = tuple(1.0 / math.factorial(n) for n in range(14))  # each correctly rounded


def exp64(x: np.ndarray) -> np.ndarray:
    """exp(x) for float64 x <= 0 (-inf gives 0) with a fixed sequence of IEEE operations:
    k = rint(x / ln 2), r = (x - k ln2_hi) - k ln2_lo, a degree-13 Taylor polynomial of r in
    Horner form, times 2**k (ldexp). Within a few ulps of exp; what matters is that it is
    the same bits on every machine (numpy's own exp is libm's or SIMD code)."""
    x = np.maximum(np.asarray(x, np.float64), -800.0)  # exp(-800) underflows to 0 below anyway
    k = np.rint(x * _INV_LN2)
    r = (x - k * _LN2_HI) - k * _LN2_LO
    p = np.full_like(r, _TAYLOR[13])
    for c in reversed(_TAYLOR[:13]):
        p = p * r + c
    return np.ldexp(p, k.astype(np.int64))


def quantize_per_tensor(x: np.ndarray, scale, fmt="float8_e4m3fn") -> np.ndarray:
    """Codes of ``encode(fp32(x / scale))`` (RNE, saturating): the KV-cache (and Q) rule."""
    x32 = np.asarray(x, np.float32)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        return encode((x32 / np.float32(scale)).astype(np.float32), get_format(fmt))


def quantize_per_head(x: np.ndarray, scales, fmt="float8_e4m3fn") -> np.ndarray:
    """Codes of (B, Hh, T, d) ``x``, head h divided by ``scales[h]`` (one value or one per head)."""
    s = _per_head(scales, np.shape(x)[1], "scale")
    return quantize_per_tensor(x, s.reshape(1, -1, 1, 1), fmt)


def quantize_per_token_head(x: np.ndarray, fmt="float8_e4m3fn") -> tuple[np.ndarray, np.ndarray]:
    """vLLM's fp8_per_token_head cache write: (codes (..., d), float32 scales (...)), one scale per
    row of the last axis: ``s = max(fp32(amax / fmax), 1e-6)``, ``codes = encode(clamp(fp32(x * fp32(1 / s))))``."""
    f = get_format(fmt)
    x32 = np.asarray(x, np.float32)
    fmax = np.float32(f.max)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        s = np.maximum((np.abs(x32).max(axis=-1) / fmax).astype(np.float32), PER_TOKEN_HEAD_MIN_SCALE)
        inv = (np.float32(1.0) / s).astype(np.float32)
        y = np.clip((x32 * inv[..., None]).astype(np.float32), -fmax, fmax)
    return encode(y, f), s


def quantize_nvfp4_kv(x: np.ndarray, global_scale, *, multiplier: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """The NVFP4 KV-cache write (module docstring): (E2M1 codes (..., d), E4M3 block-scale codes
    (..., d / 16)) of ``x`` with the encode global scale G (float32), or with ``multiplier=True``
    the decode multiplier g (FlashInfer's nvfp4_kv_quantize)."""
    x32 = np.asarray(x, np.float32)
    d = x32.shape[-1]
    if d % NVFP4_BLOCK:
        raise InputTypeError(f"attention: an NVFP4 KV cache needs head_dim a multiple of {NVFP4_BLOCK}, got {d}")
    g = np.float32(global_scale)
    blocks = x32.reshape(*x32.shape[:-1], d // NVFP4_BLOCK, NVFP4_BLOCK)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        vmax = np.abs(blocks).max(axis=-1)
        inv_g = (np.float32(1.0) / g).astype(np.float32)
        sf = ((inv_g if multiplier else g) * (vmax * np.float32(1.0 / 6.0)).astype(np.float32)).astype(np.float32)
        s8 = encode(sf, _E4M3)
        sv = decode(s8, _E4M3).astype(np.float32)
        r = np.float32(1.0) / (sv * (g if multiplier else inv_g)).astype(np.float32)
        r = np.where(sv != 0, r, np.float32(0.0)).astype(np.float32)
        codes = encode((blocks * r[..., None]).astype(np.float32), _E2M1)
    return codes.reshape(x32.shape), s8


def _per_head(scale, n: int, what: str) -> np.ndarray:
    """float32 (n,): one scale for every head, or one per head."""
    s = np.asarray(scale, np.float32).reshape(-1)
    if s.size == 1:
        return np.repeat(s, n)
    if s.size != n:
        raise InputTypeError(f"attention: {what} has {s.size} values; expected 1 or {n} (one per head)")
    return s


def _cache(x, scale, kv_cache: str, fmt, what: str):
    """(decoded values float64 (B, Hkv, T, d), multiplier) of K or V as the cache holds them: the
    multiplier is float64 (B or 1, Hkv, 1 or T, 1)."""
    hkv = x.shape[1]
    if kv_cache == "fp8":
        s = _per_head(scale, hkv, f"{what}_scale")
        return decode(quantize_per_head(x, s, fmt), fmt).astype(np.float64), s.astype(np.float64).reshape(1, -1, 1, 1)
    if scale is not None and kv_cache == "fp8_per_token_head":
        raise InputTypeError(f"attention: kv_cache 'fp8_per_token_head' computes its scales; {what}_scale must be None")
    if kv_cache == "fp8_per_token_head":
        codes, s = quantize_per_token_head(x, fmt)
        return decode(codes, fmt).astype(np.float64), s.astype(np.float64)[..., None]
    g = _per_head(scale, hkv, f"{what}_scale")
    mult_given = kv_cache == "nvfp4_mult"
    codes, s8 = quantize_nvfp4_kv(x, g.reshape(1, -1, 1, 1), multiplier=mult_given)
    blk = np.repeat(decode(s8, _E4M3).astype(np.float64), NVFP4_BLOCK, axis=-1)
    with np.errstate(divide="ignore"):
        mult = g.astype(np.float64) if mult_given else 1.0 / g.astype(np.float64)
    return decode(codes, _E2M1).astype(np.float64) * blk, mult.reshape(1, -1, 1, 1)


def causal_mask(tq: int, tk: int) -> np.ndarray:
    """(Tq, Tk) True where query i may see key j: j <= i + Tk - Tq."""
    return np.arange(tk)[None, :] <= np.arange(tq)[:, None] + (tk - tq)


def _heads(x: np.ndarray, h: int, what: str) -> np.ndarray:
    hkv = x.shape[1]
    if h % hkv:
        raise InputTypeError(f"attention: {what} has {hkv} heads, which do not divide the query's {h}")
    return np.repeat(x, h // hkv, axis=1)


def attention(q, k, v, k_scale, v_scale, *, dtype: str, q_scale=None, fmt="float8_e4m3fn", causal=False,
              mask=None, sm_scale: float | None = None, p_scale=None, unrounded: bool = False, kv_cache: str = "fp8"):
    """The reference attention output (B, H, Tq, d) as float32 values of ``dtype`` (float64
    for ``unrounded=True``: O before its rounding to D, which the torch tolerance rule is centred on).
    ``mask``: bool, broadcastable to (B, H, Tq, Tk), True where attending is allowed (with ``causal``).
    ``p_scale``: P's float32 dequantization multiplier (e.g. fp32(1/448)): bmm2 on e4m3fn P codes
    (step 4); None keeps P in float64. ``kv_cache``: one of KV_CACHES (module docstring); scales hold
    one value or one per head."""
    q, k, v = (np.asarray(t, np.float32) for t in (q, k, v))
    if q.ndim != 4 or k.shape != v.shape or k.ndim != 4 or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise InputTypeError(f"attention: expected q (B, H, Tq, d) and k, v (B, Hkv, Tk, d), got "
                             f"{list(q.shape)}, {list(k.shape)}, {list(v.shape)}")
    if kv_cache not in KV_CACHES:
        raise InputTypeError(f"attention: kv_cache {kv_cache!r}; expected one of {', '.join(KV_CACHES)}")
    if p_scale is not None and kv_cache != "fp8":
        raise InputTypeError(f"attention: an FP8 P (p_scale) is defined for kv_cache 'fp8' only, not {kv_cache!r}")
    B, H, Tq, d = q.shape
    Tk = k.shape[2]
    f = get_format(fmt)
    kd, km = _cache(k, k_scale, kv_cache, f, "k")
    vd, vm = _cache(v, v_scale, kv_cache, f, "v")
    kd, vd = _heads(kd, H, "k"), _heads(vd, H, "v")
    km, vm = np.repeat(km, H // k.shape[1], axis=1), np.repeat(vm, H // k.shape[1], axis=1)
    if q_scale is None:
        qd, qs = q.astype(np.float64), np.ones((1, H, 1, 1))
    else:
        qs32 = _per_head(q_scale, H, "q_scale")
        qd = decode(quantize_per_head(q, qs32, f), f).astype(np.float64)
        qs = qs32.astype(np.float64).reshape(1, H, 1, 1)
    sm = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
    per_token = kv_cache == "fp8_per_token_head"
    # (B|1, H, 1, Tk|1): a key's multiplier along the last axis, as S is (B, H, Tq, Tk)
    c1 = (qs * np.swapaxes(km, -1, -2)) * sm
    with np.errstate(invalid="ignore", over="ignore"):
        a = qd[..., :, None, 0] * kd[..., None, :, 0]
        for t in range(1, d):
            a = a + qd[..., :, None, t] * kd[..., None, :, t]
        s = a * c1
        allowed = np.ones((1, 1, Tq, Tk), bool)
        if causal:
            allowed = allowed & causal_mask(Tq, Tk)
        if mask is not None:
            allowed = allowed & np.asarray(mask, bool)
        allowed = np.broadcast_to(allowed, s.shape)
        s = np.where(allowed, s, -np.inf)
        m = s.max(axis=-1, keepdims=True)
        empty = ~allowed.any(axis=-1, keepdims=True)
        e = exp64(np.where(empty, -np.inf, s - np.where(empty, 0.0, m)))
        z = e[..., 0]
        for j in range(1, Tk):
            z = z + e[..., j]
        p = e / np.where(empty[..., 0], 1.0, z)[..., None]
        if per_token:  # w_j = P_j * s_j, then the plain sum of w_j v_j
            p = p * np.swapaxes(vm, -1, -2)
            c2 = None
        else:
            c2 = vm
        if p_scale is not None:
            ps = float(np.float32(p_scale))
            p = decode(encode(p / ps, P_FORMAT), P_FORMAT).astype(np.float64)
            c2 = ps * c2
        o = p[..., 0, None] * vd[:, :, None, 0, :]
        for j in range(1, Tk):
            o = o + p[..., j, None] * vd[:, :, None, j, :]
        if c2 is not None:
            o = o * c2
    return o if unrounded else round_to(o, dtype)
