"""fp8ref: the bit-exact reference for FP8 quantized inference."""

from .codec import ROUNDING_MODES, decode, encode, view_as_codes, view_as_float8
from .errors import Fp8RefError
from .formats import FORMATS, FloatFormat, get_format

__version__ = "0.1.0"

__all__ = ["FORMATS", "FloatFormat", "Fp8RefError", "ROUNDING_MODES", "__version__", "decode", "encode",
           "get_format", "view_as_codes", "view_as_float8"]
