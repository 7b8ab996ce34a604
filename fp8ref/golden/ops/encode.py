"""encode and decode: every format x rounding x saturation x input dtype, on the special-value
table, seeded random values and (optionally) every 16-bit input; decode on every code."""

from __future__ import annotations

from fractions import Fraction
from itertools import product

import numpy as np

from ... import codec, profiles
from ...errors import SpecError
from ...formats import FORMATS, get_format
from .. import values
from ..case import Case, OpEntry, Operation
from ..fields import at_level, bit_patterns, check_str, choices, count, one_of, per_level

_BITS_DTYPES = {"uint8": 8, "uint16": 16, "uint32": 32}


class Encode(Operation):
    name = "encode"
    params = ("format", "rounding", "saturate", "dtype", "random_bits", "profile")
    outputs = ("codes",)
    signature = "encode(x, fmt, *, rounding, saturate, random_bits=None) -> uint8 codes"
    fields = {
        "formats": (choices(tuple(FORMATS)), tuple(FORMATS)),
        "rounding": (choices(codec.ROUNDING_MODES), codec.ROUNDING_MODES),
        "saturate": (choices((True, False), allow_all=False, kind=bool), (True, False)),
        "input_dtypes": (choices(values.INPUT_DTYPES), ("float32",)),
        "random": (per_level(count(1 << 20)), {1: 256, 2: 4096}),
        "exhaustive": (per_level(choices(("float16", "bfloat16"), allow_all=False, allow_empty=True)), {1: ()}),
        "random_bits": (choices(tuple(_BITS_DTYPES), allow_all=False), ("uint8",)),
        # imported vectors (fp8ref.golden.onnx_node): literal inputs instead of the generated ones, a
        # label that ends the case name, and the rule the expected codes follow (fp8ref.profiles)
        "values": (bit_patterns(), ()),
        "label": (check_str, ""),
        "profile": (one_of(profiles.PROFILES), "fp8ref"),
    }

    def expand(self, entry: OpEntry, level: int) -> list[tuple[str, dict]]:
        f = entry.fields
        out = []
        for fmt, rounding, sat, dtype in product(f["formats"], f["rounding"], f["saturate"], f["input_dtypes"]):
            params = {"format": fmt, "rounding": rounding, "saturate": sat, "dtype": dtype}
            if rounding == "stochastic":
                params["random_bits"] = f["random_bits"][0]
            if f["profile"] != "fp8ref":
                params["profile"] = f["profile"]
            out.append((self.case_name(params) + (f".{f['label']}" if f["label"] else ""), params))
        return out

    @staticmethod
    def case_name(params) -> str:
        sat = "sat" if params["saturate"] else "nosat"
        return f"encode.{params['format']}.{params['rounding']}.{sat}.{params['dtype']}"

    def make_case(self, name, params, entry, suite, level) -> Case:
        fmt, dtype = get_format(params["format"]), params["dtype"]
        if entry.fields["values"]:  # literal inputs, every one of them (nothing dropped or added)
            if params["rounding"] == "stochastic":
                raise SpecError(f"{suite.source}: case {name!r}: literal values take a deterministic rounding mode")
            bits = _literal(entry.fields["values"], values.BITS_DTYPES[dtype], f"{suite.source}: case {name!r}")
            return Case(name, self.name, params, {"x": values.from_bits(bits, dtype)}, len(bits))
        stream = values.Stream(suite.seed, name)
        special = values.special_values(fmt, dtype)
        parts = [special, values.random_values(stream, fmt, dtype, at_level(entry.fields["random"], level))]
        if dtype in at_level(entry.fields["exhaustive"], level):
            parts.append(np.arange(1 << 16, dtype=np.uint16))
        bits = self._encodable(np.concatenate(parts), fmt, dtype, params["saturate"])
        n_special = len(self._encodable(special, fmt, dtype, params["saturate"]))
        inputs = {"x": values.from_bits(bits, dtype)}
        if params["rounding"] == "stochastic":
            inputs["random_bits"] = stream.bits(len(bits), _BITS_DTYPES[params["random_bits"]])
        return Case(name, self.name, params, inputs, n_special)

    @staticmethod
    def _encodable(bits: np.ndarray, fmt, dtype: str, saturate: bool) -> np.ndarray:
        """Drop the inputs the contract rejects: NaN (and Inf when not saturating) for
        formats without NaN (fp4/fp6 raise EncodeError by design)."""
        if fmt.has_nan:
            return bits
        with np.errstate(invalid="ignore"):
            x = values.from_bits(bits, dtype).astype(np.float64)
        keep = ~np.isnan(x) & (np.isfinite(x) | saturate)
        return bits[keep]

    def reference(self, params, inputs):
        """fp8ref's codes, or under ``params["profile"]`` (set by ``run(..., profile=)``, never by a
        suite) what that specification prescribes (``fp8ref.profiles``)."""
        profile = params.get("profile", "fp8ref")
        if profile != "fp8ref":
            return {"codes": profiles.encode(inputs["x"], params["format"], saturate=params["saturate"],
                                             rounding=params["rounding"], profile=profile)}
        codes = codec.encode(inputs["x"], params["format"], saturate=params["saturate"],
                             rounding=params["rounding"], random_bits=inputs.get("random_bits"))
        return {"codes": codes}

    def call(self, backend, params, inputs):
        return {"codes": backend.encode(inputs["x"], params["format"], rounding=params["rounding"],
                                        saturate=params["saturate"], random_bits=inputs.get("random_bits"))}

    def output_format(self, params, output):
        return params["format"]

    def tags(self, params, inputs, index, got) -> list[tuple[str, ...]]:
        """Why each listed encode mismatch may have happened (xfail entries select on these).

        ``index`` selects the mismatching elements, ``got`` holds the backend's codes there."""
        fmt = get_format(params["format"])
        x = inputs["x"][index].astype(np.float64)
        with np.errstate(invalid="ignore"):
            a = np.abs(x)
            finite = np.isfinite(x)
            flags = {
                "nan-input": np.isnan(x), "inf-input": np.isinf(x), "overflow": finite & (a > fmt.max),
                "subnormal": (a > 0) & (a < fmt.min_normal), "tie": self._ties(fmt, x), "zero": x == 0,
                "negative": (x < 0) & (not fmt.signed), "input-subnormal": (a > 0) & (a < self._tiny(params)),
            }
            # a float64 input rounded to float32 first (torch, onnxruntime), a float32 one to float16
            # (OpenVINO's Convert to f8)
            narrow = {"float64": np.float32, "float32": np.float16}.get(params["dtype"])
            if narrow is not None:
                with np.errstate(over="ignore"):
                    xn = x.astype(narrow).astype(np.float64)
                bits = inputs.get("random_bits")
                via = codec.encode(xn, fmt, saturate=params["saturate"], rounding=params["rounding"],
                                   random_bits=None if bits is None else bits[index])
                direct = codec.encode(x, fmt, saturate=params["saturate"], rounding=params["rounding"],
                                      random_bits=None if bits is None else bits[index])
                changed = (via != direct) | self._ties(fmt, xn)
                flags["double-rounding"] = finite & (xn != x) & changed
        names = list(flags)
        table = np.stack([flags[n] for n in names], axis=1)
        return [tuple(n for n, f in zip(names, row, strict=True) if f) for row in table]

    @staticmethod
    def _tiny(params) -> float:
        """Smallest normal value of the input dtype; for float64 that of float32, the dtype
        peers convert float64 through (so a float32-subnormal intermediate is flagged)."""
        return {"float64": 2.0 ** -126, "float32": 2.0 ** -126, "float16": 2.0 ** -14,
                "bfloat16": 2.0 ** -126}[params["dtype"]]

    @staticmethod
    def _ties(fmt, x: np.ndarray) -> np.ndarray:
        """x lies exactly halfway between its two neighbours on the format's grid."""
        ok = np.isfinite(x) & (x != 0) & (np.abs(x) < fmt.max) & ((x > 0) | fmt.signed)
        y = np.where(ok, x, 1.0)
        lo = codec.decode(codec.encode(y, fmt, rounding="rtz"), fmt).astype(np.float64)
        up = codec.decode(codec.encode(y, fmt, rounding="rup"), fmt).astype(np.float64)
        down = codec.decode(codec.encode(y, fmt, rounding="rdown"), fmt).astype(np.float64)
        hi = np.where(y > 0, up, down)
        # above max the grid continues with the top binade's spacing: 464 for e4m3fn
        overflow_tie = np.abs(x) == fmt.max + 2.0 ** (fmt.emax - fmt.mantissa_bits - 1)
        return (ok & (lo != y) & (2 * y == lo + hi)) | overflow_tie

    @staticmethod
    def simplicity(params, element) -> tuple:
        """Sort key for counterexamples: specials, then fewest significant bits, then smallest |x|."""
        x = float(element["x"])
        if not np.isfinite(x):
            return (0, 0, 0.0)
        num = Fraction(abs(x)).numerator
        return (1, (num >> ((num & -num).bit_length() - 1)).bit_length() if num else 0, abs(x))

    def element_inputs(self, params, inputs, index):
        out = {"x": inputs["x"][index]}
        if "random_bits" in inputs:
            out["random_bits"] = inputs["random_bits"][index]
        return out


def _literal(patterns: tuple, bits_dtype: str, where: str) -> np.ndarray:
    """A suite's literal bit patterns as ``bits_dtype`` (SpecError for one that does not fit)."""
    width = np.dtype(bits_dtype).itemsize * 8
    wide = [p for p in patterns if p >= 1 << width]
    if wide:
        raise SpecError(f"{where}: value {hex(wide[0])} does not fit the {width}-bit inputs of the case")
    return np.array(patterns, dtype=bits_dtype)


class Decode(Operation):
    name = "decode"
    params = ("format",)
    outputs = ("values",)
    signature = "decode(codes, fmt) -> float32 values"
    fields = {"formats": (choices(tuple(FORMATS)), tuple(FORMATS)),
              "values": (bit_patterns(256), ()),  # literal codes (imported vectors)
              "label": (check_str, "")}

    def expand(self, entry, level):
        label = f".{entry.fields['label']}" if entry.fields["label"] else ""
        return [(f"decode.{fmt}{label}", {"format": fmt}) for fmt in entry.fields["formats"]]

    def make_case(self, name, params, entry, suite, level) -> Case:
        if entry.fields["values"]:
            codes = _literal(entry.fields["values"], "uint8", f"{suite.source}: case {name!r}")
            if (codes >= get_format(params["format"]).n_codes).any():
                raise SpecError(f"{suite.source}: case {name!r}: a code is out of range for {params['format']}")
            return Case(name, self.name, params, {"codes": codes}, len(codes))
        n = get_format(params["format"]).n_codes  # exhaustive: every code, every level
        return Case(name, self.name, params, {"codes": np.arange(n, dtype=np.uint8)}, n)

    def reference(self, params, inputs):
        return {"values": codec.decode(inputs["codes"], params["format"])}

    def call(self, backend, params, inputs):
        return {"values": backend.decode(inputs["codes"], params["format"])}

    def element_inputs(self, params, inputs, index):
        return {"codes": inputs["codes"][index]}
