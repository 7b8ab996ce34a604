"""fake_quant: a float tensor through an FP8 format and back, with a scale and a shift, its output
values in the input's own dtype (the operation FakeConvert-style engines implement).

Form ``fakeconvert`` is OpenVINO's FakeConvert-13 (``fp8ref.fakeconvert``):
``(decode(encode(x * scale - shift)) + shift) / scale``, each line evaluated in float32 and rounded
once to x's dtype, the conversion saturating. Each case holds one scale and one shift (scalars in
x's dtype) and inputs x chosen so that x * scale - shift lands on every entry of the format's special-value table (every
value, midpoint and quarter point, max and the overflow tie, the smallest subnormal and half of it,
powers of two past both ends) and one ulp of x either side of it, the dtype's own specials (zeros,
extremes, +-Inf, NaNs with odd payloads) and seeded random values mapped the same way.
"""

from __future__ import annotations

from itertools import combinations, product

import numpy as np

from ... import fakeconvert
from ...formats import get_format
from .. import values
from ..case import Case, Operation
from ..fields import at_level, choices, count, numbers, per_level
from .encode import Encode

FORMS = ("fakeconvert",)
# the deviations of fp8ref.fakeconvert a mismatch is tried against, fewest first, and their xfail tags
_TAG = {"double-rounding": "double-rounding", "reciprocal": "reciprocal", "reciprocal-float32": "reciprocal",
        "zero": "zero"}
_COMBOS = sorted((c for n in range(1, 4) for c in combinations(fakeconvert.DEVIATIONS, n)
                  if not {"reciprocal", "reciprocal-float32"} <= set(c)), key=len)
FORMATS = ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")  # the FP8 formats with NaN


class FakeQuant(Operation):
    name = "fake_quant"
    params = ("form", "format", "dtype", "scale", "shift")
    outputs = ("values",)
    signature = "fake_quant(x, scale, shift, fmt, *, form) -> values in x's dtype"
    fields = {
        "forms": (choices(FORMS), FORMS),
        "formats": (choices(FORMATS), ("float8_e4m3fn", "float8_e5m2")),
        "input_dtypes": (choices(fakeconvert.DTYPES), ("float32",)),
        "scales": (numbers(positive=True), (1.0,)),
        "shifts": (numbers(), (0.0,)),
        "random": (per_level(count(1 << 20)), {1: 256, 2: 4096}),
    }

    def expand(self, entry, level):
        f = entry.fields
        return [(self.case_name(p), p) for p in (
            {"form": form, "format": fmt, "dtype": dtype, "scale": s, "shift": b}
            for form, fmt, dtype, s, b in product(f["forms"], f["formats"], f["input_dtypes"], f["scales"],
                                                  f["shifts"]))]

    @staticmethod
    def case_name(params) -> str:
        return (f"fake_quant.{params['form']}.{params['format']}.{params['dtype']}"
                f".s{params['scale']!r}.b{params['shift']!r}")

    def make_case(self, name, params, entry, suite, level) -> Case:
        fmt, dtype = get_format(params["format"]), params["dtype"]
        scale = fakeconvert.as_dtype(fakeconvert.round_to_dtype(np.array([params["scale"]]), dtype), dtype)
        shift = fakeconvert.as_dtype(fakeconvert.round_to_dtype(np.array([params["shift"]]), dtype), dtype)
        s, b = float(scale.astype(np.float64)[0]), float(shift.astype(np.float64)[0])

        def landing_on(target_bits):  # x with x * scale - shift at (or next to) each float64 target
            with np.errstate(over="ignore", invalid="ignore"):
                x = values.round_to((values.from_bits(target_bits, "float64") + b) / s, dtype)
            return np.concatenate([x, values.ulp_steps(x, np.full(len(x), 1), dtype),
                                   values.ulp_steps(x, np.full(len(x), -1), dtype)])

        special = _unique(np.concatenate([values.special_values(fmt, dtype),
                                          landing_on(values.special_values(fmt, "float64"))]))
        stream = values.Stream(suite.seed, name)
        rand = landing_on(values.random_values(stream, fmt, "float64", at_level(entry.fields["random"], level)))
        bits = _unique(np.concatenate([special, rand]))
        inputs = {"x": values.from_bits(bits, dtype), "scale": scale, "shift": shift}
        return Case(name, self.name, params, inputs, len(special))

    def reference(self, params, inputs):
        return {"values": fakeconvert.fake_convert(inputs["x"], inputs["scale"], inputs["shift"], params["format"])}

    def call(self, backend, params, inputs):
        return {"values": backend.fake_quant(inputs["x"], inputs["scale"], inputs["shift"], params["format"],
                                             form=params["form"])}

    def tags(self, params, inputs, mask, got) -> list[tuple[str, ...]]:
        """Why each mismatch may have happened, from t = x * scale - shift (rounded as the form says):
        ``nan-input``, ``inf-input``, ``overflow`` (|t| > max), ``subnormal`` (t in the format's subnormal
        range); and the deviations of ``fp8ref.fakeconvert`` (``double-rounding``, ``reciprocal``, ``zero``,
        and their combinations, fewest first) whose result is exactly the backend's: these tags are given
        only where they reproduce, bit for bit, what the backend returned."""
        fmt, dtype = get_format(params["format"]), params["dtype"]
        x, scale, shift = inputs["x"][mask], inputs["scale"], inputs["shift"]
        with np.errstate(invalid="ignore"):
            x64 = x.astype(np.float64)
        s, b = float(scale.astype(np.float64)[0]), float(shift.astype(np.float64)[0])
        with np.errstate(over="ignore", invalid="ignore"):
            t = fakeconvert.round_to_dtype(fakeconvert.round_to_dtype(
                fakeconvert.round_to_dtype(x64 * s, "float32") - b, "float32"), dtype)
            a = np.abs(t)
            flags = {"nan-input": np.isnan(x64), "inf-input": np.isinf(x64),
                     "overflow": np.isfinite(x64) & (a > fmt.max), "subnormal": (a > 0) & (a < fmt.min_normal)}
        got_bits = values.to_bits(np.asarray(got), dtype)
        explained = [()] * len(x)
        for combo in _COMBOS:
            variant = values.to_bits(fakeconvert.fake_convert(x, scale, shift, fmt, deviations=combo), dtype)
            for i in np.flatnonzero(variant == got_bits):
                if not explained[i]:
                    explained[i] = tuple(dict.fromkeys(_TAG[d] for d in combo))
        names = list(flags)
        table = np.stack([flags[n] for n in names], axis=1)
        return [tuple(n for n, f in zip(names, row, strict=True) if f) + explained[k]
                for k, row in enumerate(table)]

    simplicity = staticmethod(Encode.simplicity)

    def element_inputs(self, params, inputs, index):
        return {"x": inputs["x"][index], "scale": inputs["scale"][0], "shift": inputs["shift"][0]}


def _unique(bits: np.ndarray) -> np.ndarray:
    """The bit patterns without repeats, in first-seen order."""
    _, first = np.unique(bits, return_index=True)
    return bits[np.sort(first)]
