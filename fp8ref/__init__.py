"""fp8ref: the bit-exact reference for FP8 quantized inference."""

from .codec import ROUNDING_MODES, decode, encode, view_as_codes, view_as_float8
from .errors import Fp8RefError
from .formats import FORMATS, FloatFormat, get_format
from .scheme import KNOWN_RECIPES, PRESETS, QuantizationScheme
from .spec import LayerConfig, load_spec, load_spec_dict

__version__ = "0.1.0"

__all__ = ["FORMATS", "KNOWN_RECIPES", "PRESETS", "FloatFormat", "Fp8RefError", "LayerConfig", "QuantizationScheme",
           "ROUNDING_MODES", "__version__", "decode", "encode", "get_format", "load_spec", "load_spec_dict",
           "view_as_codes", "view_as_float8"]
