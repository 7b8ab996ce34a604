"""Which accumulation model does an unknown GEMM follow? Crafted inputs, in the spirit of the
tensor-core studies and of FPRev (arXiv 2411.00442), each isolating one parameter.

``gemm(a, b)`` takes float64 value matrices a (M, K), b (K, N) whose values are powers of two
(or 1.5 times one) in [2**-9, 2**7], exact in every FP8 E4M3 flavour, and returns the float32
product (scales 1). Every probe case is one output element (row m against column n); B is the
biggest product used (2**14). Stages, each using what the earlier ones found:

fraction_bits  t = 2**(14 - j), then +B, -B: t survives iff it is within F bits of B when they
               meet (alignment to the largest exponent, or an FP32 add). F = the largest j kept.
rounding       t = +-0.75 ulp at F bits beside B, -B: 0/0 truncate, +u/-u nearest, 0/-u floor, +u/0 up.
block          B, -B at k = 0, 1, t (lost beside B) at k = p: the first p where t survives starts a new
               normalisation step: the elements summed before normalising (1 or 2: every addition).
promote_every  B at 0, t at p with F < j <= 22: t is lost against the accumulator until it restarts
               in FP32 registers (promotion); the first such p.
c_aligned      step 1 leaves C = 2**10 + 2**(11 - F); step 2 adds -2**14: C truncated by the
               alignment gives exactly -(2**14 - 2**10); an exact C then a truncating (RZ)
               normalisation does not. Only under truncation (nearest rounding hides it).
order          B at 0, -B at q, small s elsewhere in the first 32 (swamped by B): the survivors as
               a function of q reveal sequential, reversed, fused-block or other trees (FPRev).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..codec import encode
from .kernels import KERNELS, get_kernel, kernel_mm

BIG = 14  # log2 of the biggest product
K_PROBE = 512
MAX_J = 32  # t = 2**(14 - j) >= 2**-18, the smallest product of two E4M3 subnormals... of 2**-9 each


def _pow2_pair(e: int) -> tuple[float, float]:
    """a, b powers of two in [2**-9, 2**7] with a * b = 2**e (-18 <= e <= 14)."""
    a = min(7, max(-9, e + 9 if e < -2 else e // 2))
    return 2.0 ** a, 2.0 ** (e - a)


class _Batch:
    """Probe cases as (a row, b column) pairs, evaluated in one GEMM call; cases with the same b
    share a column."""

    def __init__(self, K: int):
        self.K = K
        self.rows, self.cols, self.col_of, self.index = [], [], [], {}

    def add(self, products: dict[int, tuple[float, float]]) -> int:
        """products: k -> (a, b), every other product zero."""
        a = np.zeros(self.K)
        b = np.zeros(self.K)
        for k, (x, y) in products.items():
            a[k], b[k] = x, y
        key = b.tobytes()
        if key not in self.index:
            self.index[key] = len(self.cols)
            self.cols.append(b)
        self.rows.append(a)
        self.col_of.append(self.index[key])
        return len(self.rows) - 1

    def run(self, gemm) -> np.ndarray:
        A = np.stack(self.rows)
        B = np.stack(self.cols, axis=1)
        m = A.shape[0]
        B = np.pad(B, ((0, 0), (0, -B.shape[1] % 16)))  # CUDA GEMMs want N % 16 == 0
        A = np.pad(A, ((0, -m % 16), (0, 0)))
        out = np.asarray(gemm(A, B), dtype=np.float32)
        return out[np.arange(m), np.array(self.col_of)]


def _product(e: int, sign: float = 1.0, mant: float = 1.0) -> tuple[float, float]:
    a, b = _pow2_pair(e)
    return sign * mant * a, b


def probe(gemm: Callable[[np.ndarray, np.ndarray], np.ndarray], K: int = K_PROBE) -> dict:
    """Infer the accumulation parameters of ``gemm``; each with its evidence."""
    result = {}
    # fraction bits -------------------------------------------------------------------------
    batch = _Batch(K)
    js = list(range(1, MAX_J + 1))
    for j in js:
        batch.add({0: _product(BIG - j), 1: _product(BIG), 2: _product(BIG, -1.0)})
    out = batch.run(gemm)
    kept = [bool(out[i] == 2.0 ** (BIG - j)) for i, j in enumerate(js)]
    F = 0
    while F < len(js) and kept[F]:
        F += 1
    exact = F == len(js)
    result["fraction_bits"] = {
        "value": None if exact else F,
        "evidence": f"t = 2**(14-j) beside +-2**14 kept for j <= {F}" + (" (all: no truncation seen)" if exact else
                                                                           f", lost for j = {F + 1}"),
    }
    if exact:
        for key in ("rounding", "block", "promote_every", "c_aligned"):
            result[key] = {"value": None, "evidence": "no truncation seen, so nothing to measure against"}
        result["order"] = _order(gemm, K, None)
        return result
    # rounding ------------------------------------------------------------------------------
    batch = _Batch(K)
    u = BIG - F
    for sign in (1.0, -1.0):
        batch.add({0: _product(u - 1, sign, 1.5), 1: _product(BIG), 2: _product(BIG, -1.0)})
    pos, neg = batch.run(gemm)
    names = {(0.0, 0.0): "truncate", (1.0, -1.0): "nearest", (0.0, -1.0): "floor", (1.0, 0.0): "up"}
    key = (float(pos) / 2.0 ** u, float(neg) / 2.0 ** u)
    result["rounding"] = {"value": names.get(key, "unknown"),
                          "evidence": f"+-0.75 ulp at F bits gave {key[0]:+g} / {key[1]:+g} ulp"}
    # block and promotion: t lost beside B -------------------------------------------------
    jt = min(F + 1, MAX_J)
    L = _first_hit(gemm, K, 2, lambda p: {0: _product(BIG), 1: _product(BIG, -1.0), p: _product(BIG - jt)},
                   lambda v: v == 2.0 ** (BIG - jt))
    note = " (every addition normalises)" if L == 2 else ""
    result["block"] = {"value": (1 if L == 2 else L), "evidence": f"t after B - B survives first at k = {L}{note}"}
    if F < 22:
        jp = F + 1
        want = np.float32(2.0 ** BIG + 2.0 ** (BIG - jp))
        P = _first_hit(gemm, K, 1, lambda p: {0: _product(BIG), p: _product(BIG - jp)}, lambda v: v == want)
        evidence = (f"B + 2**-{jp}B kept first at k = {P}" if P else
                    f"B + 2**-{jp}B never kept up to k = {K - 1}: no promotion")
        result["promote_every"] = {"value": P, "evidence": evidence}
    else:
        result["promote_every"] = {"value": None, "evidence": f"F = {F} >= 22: an FP32 promotion would not show"}
    # C aligned with the products ----------------------------------------------------------
    step = max(L or 2, 2)
    if result["rounding"]["value"] != "truncate":
        result["c_aligned"] = {"value": None, "evidence": "measurable only when the sum truncates (a nearest "
                                                          "rounding of C looks the same)"}
    elif F <= 29 and step < K:
        batch = _Batch(K)
        batch.add({0: _product(10), 1: _product(11 - F), step: _product(BIG, -1.0)})
        (v,) = batch.run(gemm)
        aligned = bool(v == -(2.0 ** 14 - 2.0 ** 10))
        result["c_aligned"] = {"value": aligned, "evidence": f"C = 2**10 + 2**{11 - F}, then -2**14 gave {float(v)!r}"}
    else:
        result["c_aligned"] = {"value": None, "evidence": "needs F <= 29 and a second step"}
    result["order"] = _order(gemm, K, F)
    return result


def _first_hit(gemm, K: int, start: int, case, hit) -> int | None:
    """The first k >= start where ``hit(out)`` holds for the case ``case(k)``: every k up to 16,
    then every 16th, then every k before the first coarse hit (the effects probed are monotone:
    once a new step or promotion interval starts, every later k is in one too)."""
    def run(ks):
        batch = _Batch(K)
        for k in ks:
            batch.add(case(k))
        return [k for k, v in zip(ks, batch.run(gemm)) if hit(v)]

    coarse = sorted(set(range(start, min(K, 17))) | set(range(16, K, 16)))
    hits = run(coarse)
    if not hits:
        return None
    before = [k for k in coarse if k < hits[0]]
    fine = list(range(before[-1] + 1, hits[0])) if before else []
    found = run(fine) if fine else []
    return found[0] if found else hits[0]


def _order(gemm, K: int, F: int | None) -> dict:
    n = 32
    js = max(26, (F or 0) + 2)
    if js > 32:
        return {"value": None, "evidence": "F too wide to swamp a product"}
    batch = _Batch(K)
    qs = list(range(1, n))
    for q in qs:
        prods = {k: _product(BIG - js) for k in range(n)}
        prods[0], prods[q] = _product(BIG), _product(BIG, -1.0)
        batch.add(prods)
    out = batch.run(gemm)
    counts = [int(round(float(v) / 2.0 ** (BIG - js))) for v in out]
    patterns = {"sequential": [n - 1 - q for q in qs], "reversed": [q - 1 for q in qs]}
    for L in (2, 4, 8, 16, 32):
        patterns[f"fused blocks of {L}"] = [(n - L) if q < L else None for q in qs]
    value = "unknown"
    for name, pat in patterns.items():
        if all(p is None or p == c for p, c in zip(pat, counts)):
            value = name
            break
    return {"value": value, "evidence": f"survivors for -B at q = 1..{n - 1}: {counts}"}


PARAMETERS = ("fraction_bits", "rounding", "block", "promote_every", "c_aligned", "order")


def model_gemm(kernel) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
    """A probe ``gemm`` computed by one of fp8ref's kernel models (neutral scales)."""
    k = get_kernel(kernel)
    ins = k.ins

    def gemm(A, B):
        a = encode(A.astype(np.float32), ins.a_fmt, saturate=False)
        b = encode(B.astype(np.float32), ins.b_fmt, saturate=False)
        if k.scales == "instruction":
            one = 127 if ins.scale_type == "ue8m0" else 0x38
            nb = -(-A.shape[1] // ins.block)
            return kernel_mm(a, b, np.full((A.shape[0], nb), one, np.uint8), np.full((nb, B.shape[1]), one, np.uint8),
                             kernel=k)
        if k.scales == "promotion":
            nkb = -(-A.shape[1] // k.promote_every)
            return kernel_mm(a, b, np.ones((A.shape[0], nkb), np.float32),
                             np.ones((nkb, -(-B.shape[1] // k.block_n)), np.float32), kernel=k)
        return kernel_mm(a, b, kernel=k)

    return gemm


def _holds_probe_values(kernel) -> bool:
    ins = kernel.ins
    return all(f.exponent_bits >= 4 and f.mantissa_bits >= 1 for f in (ins.a_fmt, ins.b_fmt))


_PRESET_CACHE: dict[str, dict] = {}


def preset_signatures() -> dict[str, dict]:
    """Probe values of every preset kernel whose element format holds the probe's values."""
    for name, k in KERNELS.items():
        if name not in _PRESET_CACHE and _holds_probe_values(k):
            found = probe(model_gemm(k))
            _PRESET_CACHE[name] = {p: found[p]["value"] for p in PARAMETERS}
    return dict(_PRESET_CACHE)


def matching_models(found: dict) -> list[str]:
    """Preset kernels whose probe values equal ``found``'s."""
    values = {p: found[p]["value"] for p in PARAMETERS}
    return [name for name, sig in preset_signatures().items() if sig == values]
