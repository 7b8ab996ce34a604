"""attention with an FP8 KV cache (and optionally FP8 Q): the reference is fp8ref.attention's
exactly defined float64 computation, rounded once to the model dtype.

A backend whose attention runs in float64 in its own order, with its own exp (torch's SDPA),
declares ``accumulation_order = {"attention": "unspecified"}`` and is judged by the
float64-order tolerance (``bound_judge``), a declared rule, not a proof: with o the reference's
float64 output before rounding, R_i = |c1| max_j sum_t |q_it k_jt| the size of row i's logit
terms and M_it = v_s sum_j P_ij |v_jt|,

    E_it = 2**-30 * M_it * (1 + R_i)

and ``got`` must lie in [r(o - E), r(o + E)], r = RNE to fp32 then to D (both monotone: a single
rounding and fp32-first double rounding of any value within E of o pass). A float64 evaluation
in any order errs by about (d + Tk) 2**-53 (1 + R_i) M_it (a logit error e moves P by a factor
within exp(+-2e)), so 2**-30 leaves a factor of 2**10 for d, Tk <= 2**12. An fp32 or bf16
attention is outside it by design: it is not the computation the reference defines.
"""

from __future__ import annotations

from itertools import product

import numpy as np

from ... import attention as ref
from ...formats import get_format
from ...rounding import round_to, to_bits
from .. import values
from ..case import Case, Operation, shape_name
from ..fields import at_level, choices, per_level, shapes
from .quantize import DTYPES

_FP8 = ("float8_e4m3fn", "float8_e5m2")
TOLERANCE = 2.0 ** -30


def _calibrated(stream, shape, dtype, fmt) -> np.ndarray:
    """fp32(amax of a separate calibration sample / fmt max), shape (1,): some values clip."""
    calib = values.tensor(stream, shape, dtype).astype(np.float64)
    return (np.abs(calib).max() / np.float64(get_format(fmt).max)).astype(np.float32).reshape(1)


class Attention(Operation):
    name = "attention"
    params = ("format", "dtype", "quantize", "causal", "shape")
    outputs = ("out",)
    signature = ("attention(q, k, v, k_scale, v_scale, *, q_scale, fmt, causal) "
                 "-> out (B, H, Tq, d) in q's dtype")
    fields = {
        "formats": (choices(_FP8), ("float8_e4m3fn",)),
        "dtypes": (choices(DTYPES), ("bfloat16",)),
        "quantize": (choices(("kv", "qkv"), allow_all=False), ("kv",)),
        "causal": (choices((False, True), allow_all=False, kind=bool), (True,)),
        "shapes": (per_level(shapes(6)), None),  # B, H, Hkv, Tq, Tk, d
    }
    tolerance_rule = "float64-order tolerance"

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
        inputs = {"q": values.from_bits(values.round_to(qv, dtype), dtype),
                  "k": values.tensor(stream, (B, Hkv, Tk, d), dtype),
                  "v": values.tensor(stream, (B, Hkv, Tk, d), dtype),
                  "k_scale": _calibrated(stream, (B, Hkv, Tk, d), dtype, fmt),
                  "v_scale": _calibrated(stream, (B, Hkv, Tk, d), dtype, fmt)}
        if params["quantize"] == "qkv":
            inputs["q_scale"] = (np.abs(qv).max() / np.float64(get_format(fmt).max)).astype(np.float32).reshape(1)
        return Case(name, self.name, params, inputs)

    @staticmethod
    def _run(params, inputs, v=None, unrounded=False):
        return ref.attention(inputs["q"], inputs["k"], inputs["v"] if v is None else v, inputs["k_scale"][0],
                             inputs["v_scale"][0], dtype=params["dtype"], fmt=params["format"],
                             q_scale=inputs["q_scale"][0] if "q_scale" in inputs else None,
                             causal=params["causal"], unrounded=unrounded)

    def reference(self, params, inputs):
        out = self._run(params, inputs)
        return {"out": values.from_bits(to_bits(out, params["dtype"]), params["dtype"])}

    def call(self, backend, params, inputs):
        return {"out": backend.attention(inputs["q"], inputs["k"], inputs["v"], inputs["k_scale"], inputs["v_scale"],
                                         q_scale=inputs.get("q_scale"), fmt=params["format"],
                                         causal=params["causal"])}

    def element_inputs(self, params, inputs, index):
        b, h, i, t = index
        return {"batch": b, "head": h, "query": i, "dim": t}

    # --- the float64-order tolerance (module docstring) ---
    def bound_applies(self, params) -> str | None:
        return None

    def bound_interval(self, params, inputs) -> dict[str, np.ndarray]:
        fmt, dtype = params["format"], params["dtype"]
        o = self._run(params, inputs, unrounded=True)
        mag = self._run(params, inputs, v=np.abs(np.asarray(inputs["v"], np.float32)), unrounded=True)
        from ...codec import decode

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
            err = TOLERANCE * mag * (1.0 + r)

            def out_round(x):
                return round_to(round_to(x, "float32"), dtype).astype(np.float64)

            lo, hi = out_round(o - err), out_round(o + err)
        domain = np.isfinite(o) & np.isfinite(err)
        return {"x": o, "err": err, "lo": lo, "hi": hi, "domain": domain}

    def bound_judge(self, params, inputs, got) -> dict[str, np.ndarray]:
        """``within``: got in [r(o - E), r(o + E)]; ``used``: |got - o| / E (0 where got is o
        correctly rounded; NaN outside the domain)."""
        iv = self.bound_interval(params, inputs)
        g = np.asarray(got).astype(np.float64)
        within = iv["domain"] & (g >= iv["lo"]) & (g <= iv["hi"])
        rounded = round_to(iv["x"], params["dtype"]).astype(np.float64)
        with np.errstate(divide="ignore", invalid="ignore"):
            used = np.where(g == rounded, 0.0, np.abs(g - iv["x"]) / iv["err"])
        return {"within": within, "used": np.where(iv["domain"] & ~np.isnan(g), used, np.nan)}
