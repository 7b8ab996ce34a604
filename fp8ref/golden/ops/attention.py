"""attention with an FP8 KV cache (and optionally FP8 Q): the reference is fp8ref.attention's
exactly defined float64 computation, rounded once to the model dtype.

A backend whose attention runs in float64 in its own order, with its own exp (torch's SDPA),
declares ``accumulation_order = {"attention": "unspecified"}`` and is judged by the
float64-order tolerance (``bound_judge``), a declared rule, not a proof: with o the reference's
float64 output before rounding, R_i = |c1| max_j sum_t |q_it k_jt| the size of row i's logit
terms and M_it = v_s sum_j P_ij |v_jt|,

    E_it = 2**-45 * (d + Tk + 8) * M_it * (1 + R_i)

and ``got`` must lie in [r(o - E), r(o + E)], r = one RNE to D (monotone). Rounding the float64
result to fp32 first and then to D (torch's float64 -> bfloat16 conversion) is a mismatch, tagged
``double-rounding`` where that explains it (an xfail entry names it). A float64 evaluation
in any order errs by about (d + Tk) 2**-53 (1 + R_i) M_it (a logit error e moves P by a factor
within exp(+-2e); each sum adds its length in ulps), so E leaves a factor of 2**8. An fp32 or bf16
attention is far outside it by design: it is not the computation the reference defines.
"""

from __future__ import annotations

from itertools import product

import numpy as np

from ... import attention as ref
from ...codec import decode
from ...formats import get_format
from ...rounding import round_to, to_bits
from .. import values
from ..case import Case, Operation, shape_name
from ..fields import at_level, choices, per_level, shapes
from .quantize import DTYPES

_FP8 = ("float8_e4m3fn", "float8_e5m2")
TOLERANCE = 2.0 ** -45  # times (d + Tk + 8): the module docstring
# quantize -> the reference's kv_cache for the KV-cache variants (fp8ref.attention): per-head static
# scales (llm-compressor attn_head), vLLM's fp8_per_token_head, the NVFP4 KV cache (with FP8 Q or not)
KV_CACHE_OF = {"kv-head": "fp8", "qkv-head": "fp8", "kv-token-head": "fp8_per_token_head",
               "kv-nvfp4": "nvfp4", "qkv-nvfp4": "nvfp4", "kv-nvfp4-mult": "nvfp4_mult"}
QUANTIZE = ("kv", "qkv", "kvp", "qkvp", *KV_CACHE_OF)
P_SCALE = np.float32(1.0 / 448.0)  # P in [0, 1] onto e4m3fn's full range: 1 -> 448 (saturating)


def _calibrated(stream, shape, dtype, fmt, per_head: bool = False) -> np.ndarray:
    """fp32(amax of a separate calibration sample / fmt max), shape (1,) or one per head (axis 1):
    some values clip."""
    calib = np.abs(values.tensor(stream, shape, dtype).astype(np.float64))
    amax = calib.max(axis=(0, 2, 3)) if per_head else calib.max().reshape(1)
    return (amax / np.float64(get_format(fmt).max)).astype(np.float32)


def _nvfp4_global(stream, shape, dtype, multiplier: bool = False) -> np.ndarray:
    """The global scale of a calibration sample, shape (1,): FlashInfer's encode scale
    fp32(448 / amax), or as a decode multiplier fp32(amax / 448) (nvfp4_kv_quantize's)."""
    calib = np.abs(values.tensor(stream, shape, dtype).astype(np.float64))
    return np.float32(calib.max() / 448.0 if multiplier else 448.0 / calib.max()).reshape(1)


class Attention(Operation):
    name = "attention"
    params = ("format", "dtype", "quantize", "causal", "shape")
    outputs = ("out",)
    # p_scale is passed to FP8-P cases only, so a backend without them keeps the signature it has
    signature = ("attention(q, k, v, k_scale, v_scale, *, q_scale, fmt, causal) "
                 "-> out (B, H, Tq, d) in q's dtype; quantize kvp / qkvp cases also pass p_scale=, the "
                 "KV-cache variants (kv-head, qkv-head, kv-token-head, kv-nvfp4, qkv-nvfp4, kv-nvfp4-mult) "
                 "kv_cache=")
    fields = {
        "formats": (choices(_FP8), ("float8_e4m3fn",)),
        "dtypes": (choices(DTYPES), ("bfloat16",)),
        # kv: K and V in FP8; qkv: Q too; kvp / qkvp: and P, e4m3fn with p_scale = fp32(1/448), before bmm2;
        # kv-head / qkv-head: one scale per head; kv-token-head: vLLM's fp8_per_token_head (no stored
        # scale); kv-nvfp4 / qkv-nvfp4: the NVFP4 KV cache with encode global scales (Q per tensor in FP8);
        # kv-nvfp4-mult: the same with decode-multiplier globals (FlashInfer nvfp4_kv_quantize, SGLang)
        "quantize": (choices(QUANTIZE, allow_all=False), ("kv",)),
        "causal": (choices((False, True), allow_all=False, kind=bool), (True,)),
        "shapes": (per_level(shapes(6)), None),  # B, H, Hkv, Tq, Tk, d
    }
    tolerance_rule = "float64-order tolerance"
    # keyword -> (case parameter, values): passed only to those cases; a backend that declares one
    # of the values must take the keyword (checked at load)
    conditional_keywords = {"p_scale": ("quantize", ("kvp", "qkvp")), "kv_cache": ("quantize", tuple(KV_CACHE_OF))}

    def expand(self, entry, level):
        f, out = entry.fields, []
        for fmt, dtype, qz, causal, shape in product(f["formats"], f["dtypes"], f["quantize"], f["causal"],
                                                     at_level(f["shapes"], level)):
            if shape[1] % shape[2]:
                continue  # query heads must be a multiple of the KV heads
            params = {"format": fmt, "dtype": dtype, "quantize": qz, "causal": causal, "shape": list(shape)}
            name = f"attention.{fmt}.{dtype}.{qz}" + (".causal" if causal else "") + f".{shape_name(shape)}"
            out.append((name, params))
        return out

    def make_case(self, name, params, entry, suite, level) -> Case:
        """q: heavy-tailed without outliers (logits of a trained model stay moderate); k, v:
        heavy-tailed with per-row powers of two and outliers; scales calibrated on separate samples."""
        stream = values.Stream(suite.seed, name)
        B, H, Hkv, Tq, Tk, d = params["shape"]
        dtype, fmt = params["dtype"], params["format"]
        qv = values.heavy_tailed(stream, B * H * Tq * d, outlier_rate=0.0).reshape(B, H, Tq, d)
        qz = params["quantize"]
        kv_shape = (B, Hkv, Tk, d)
        inputs = {"q": values.from_bits(values.round_to(qv, dtype), dtype),
                  "k": values.tensor(stream, kv_shape, dtype), "v": values.tensor(stream, kv_shape, dtype)}
        cache = KV_CACHE_OF.get(qz, "fp8")
        if cache.startswith("nvfp4"):
            inputs["k_scale"], inputs["v_scale"] = (_nvfp4_global(stream, kv_shape, dtype, cache == "nvfp4_mult")
                                                    for _ in "kv")
        elif cache == "fp8":
            inputs["k_scale"], inputs["v_scale"] = (_calibrated(stream, kv_shape, dtype, fmt, qz.endswith("-head"))
                                                    for _ in "kv")
        if qz in ("kvp", "qkvp"):
            inputs["p_scale"] = P_SCALE.reshape(1)
        if qz.startswith("qkv"):
            amax = np.abs(qv).max(axis=(0, 2, 3)) if qz.endswith("-head") else np.abs(qv).max().reshape(1)
            inputs["q_scale"] = (amax / np.float64(get_format(fmt).max)).astype(np.float32)
        return Case(name, self.name, params, inputs)

    @staticmethod
    def _run(params, inputs, v=None, unrounded=False):
        return ref.attention(inputs["q"], inputs["k"], inputs["v"] if v is None else v, inputs.get("k_scale"),
                             inputs.get("v_scale"), dtype=params["dtype"], fmt=params["format"],
                             q_scale=inputs.get("q_scale"), causal=params["causal"], unrounded=unrounded,
                             p_scale=inputs["p_scale"][0] if "p_scale" in inputs else None,
                             kv_cache=KV_CACHE_OF.get(params["quantize"], "fp8"))

    def reference(self, params, inputs):
        out = self._run(params, inputs)
        return {"out": values.from_bits(to_bits(out, params["dtype"]), params["dtype"])}

    def call(self, backend, params, inputs):
        p = {"p_scale": inputs["p_scale"]} if "p_scale" in inputs else {}
        if params["quantize"] in KV_CACHE_OF:
            p["kv_cache"] = KV_CACHE_OF[params["quantize"]]
        k_scale, v_scale = inputs.get("k_scale"), inputs.get("v_scale")  # None for kv-token-head
        return {"out": backend.attention(inputs["q"], inputs["k"], inputs["v"], k_scale, v_scale,
                                         q_scale=inputs.get("q_scale"), fmt=params["format"],
                                         causal=params["causal"], **p)}

    def element_inputs(self, params, inputs, index):
        b, h, i, t = index
        return {"batch": b, "head": h, "query": i, "dim": t}

    def tags(self, params, inputs, index, got) -> list[tuple[str, ...]]:
        """``double-rounding``: got is o rounded to fp32 and then to D, not o rounded once."""
        o = self._run(params, inputs, unrounded=True)[index]
        dtype = params["dtype"]
        twice = round_to(round_to(o, "float32"), dtype).astype(np.float64)
        flag = (twice != round_to(o, dtype).astype(np.float64)) & (np.asarray(got).astype(np.float64) == twice)
        return [("double-rounding",) if f else () for f in flag]

    # --- the float64-order tolerance (module docstring) ---
    def bound_applies(self, params) -> str | None:
        if params.get("quantize") in ("kvp", "qkvp"):
            return ("the float64-order tolerance does not cover an FP8 P (a P that differs in its last bits "
                    "can round to another e4m3 code)")
        if params.get("quantize") in KV_CACHE_OF:
            return "the float64-order tolerance is derived for per-tensor KV scales only"
        return None

    def bound_interval(self, params, inputs) -> dict[str, np.ndarray]:
        fmt, dtype = params["format"], params["dtype"]
        o = self._run(params, inputs, unrounded=True)
        mag = self._run(params, inputs, v=np.abs(np.asarray(inputs["v"], np.float32)), unrounded=True)

        H, d = inputs["q"].shape[1], inputs["q"].shape[3]
        kd = np.abs(decode(ref.quantize_per_tensor(inputs["k"], inputs["k_scale"][0], fmt), fmt).astype(np.float64))
        kd = np.repeat(kd, H // kd.shape[1], axis=1)
        if "q_scale" in inputs:
            qd = decode(ref.quantize_per_tensor(inputs["q"], inputs["q_scale"][0], fmt), fmt).astype(np.float64)
            qs = float(inputs["q_scale"][0])
        else:
            qd, qs = np.asarray(inputs["q"], np.float64), 1.0
        c1 = qs * float(inputs["k_scale"][0]) / np.sqrt(d)
        with np.errstate(invalid="ignore", over="ignore"):
            r = (np.abs(qd) @ np.swapaxes(kd, -1, -2)).max(axis=-1, keepdims=True) * abs(c1)
            err = TOLERANCE * (d + kd.shape[2] + 8) * mag * (1.0 + r)

            lo, hi = round_to(o - err, dtype).astype(np.float64), round_to(o + err, dtype).astype(np.float64)
        domain = np.isfinite(o) & np.isfinite(err)
        return {"x": o, "err": err, "lo": lo, "hi": hi, "domain": domain}

    def bound_judge(self, params, inputs, got) -> dict[str, np.ndarray]:
        """``within``: got in [r(o - E), r(o + E)]; ``used``: the distance from o to the edge of
        got's rounding interval (the midpoint between got and r(o)) over E: 0 where got is r(o),
        above 1 outside; NaN outside the domain. (A diagnostic; ``within`` is the verdict.)"""
        iv = self.bound_interval(params, inputs)
        g = np.asarray(got).astype(np.float64)
        within = iv["domain"] & (g >= iv["lo"]) & (g <= iv["hi"])
        rounded = round_to(iv["x"], params["dtype"]).astype(np.float64)
        with np.errstate(divide="ignore", invalid="ignore"):
            used = np.where(g == rounded, 0.0, np.abs((g + rounded) / 2 - iv["x"]) / iv["err"])
        return {"within": within, "used": np.where(iv["domain"] & ~np.isnan(g), used, np.nan)}
