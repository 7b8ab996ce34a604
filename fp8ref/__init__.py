"""fp8ref: the bit-exact reference for FP8 quantized inference.

The public API is re-exported here and imported lazily (PEP 562), so ``import fp8ref`` (and the
pytest plugin) stays cheap until a name is used.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "_native": ("build_info",),
    "calibrate": ("AmaxState", "CalibratedScales", "DequantScale", "amax_state", "calibrate_input_scales",
                  "finalize", "merge", "observe", "observe_linear_inputs"),
    "checkpoint": ("Checkpoint", "export_checkpoint", "load_checkpoint", "write_calibration", "write_checkpoint"),
    "codec": ("ROUNDING_MODES", "decode", "encode", "view_as_codes", "view_as_float8"),
    "errors": ("Fp8RefError",),
    "formats": ("FORMATS", "FloatFormat", "get_format"),
    "matmul": ("linear", "scaled_mm"),
    "quant": ("QuantArgs", "QuantResult", "dequantize", "fake_quant", "quantize"),
    "recipes": ("Recipe",),
    "registry": ("get_recipe", "load_recipes"),
    "scheme": ("KNOWN_RECIPES", "PRESETS", "QuantizationScheme"),
    "spec": ("LayerConfig", "load_spec", "load_spec_dict"),
    "ulp": ("ulp_distance",),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_MODULE_OF) + ["__version__"]


def __getattr__(name: str):
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'fp8ref' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
