"""fp8ref: the bit-exact reference for FP8 quantized inference."""

from .codec import ROUNDING_MODES, decode, encode, view_as_codes, view_as_float8
from .errors import Fp8RefError
from .formats import FORMATS, FloatFormat, get_format
from .quant import QuantArgs, QuantResult, dequantize, fake_quant, quantize
from .recipes import Recipe, get_recipe, load_recipes
from .scheme import KNOWN_RECIPES, PRESETS, QuantizationScheme
from .spec import LayerConfig, load_spec, load_spec_dict

__version__ = "0.1.0"

__all__ = ["FORMATS", "KNOWN_RECIPES", "PRESETS", "FloatFormat", "Fp8RefError", "LayerConfig", "QuantizationScheme",
           "QuantArgs", "QuantResult", "ROUNDING_MODES", "Recipe", "__version__", "decode", "dequantize", "encode",
           "fake_quant", "get_format", "get_recipe", "load_recipes", "load_spec", "load_spec_dict", "quantize",
           "view_as_codes", "view_as_float8"]
