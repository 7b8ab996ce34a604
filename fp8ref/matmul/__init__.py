"""scaled_mm / linear: FP8 matrix products with declared scale and accumulation models.

``scaled_mm(a, b, scale_a, scale_b)`` computes ``out[m, n] = sum_k a[m, k] * b[k, n] * s(m, k, n)
+ bias[n]`` where a (M x K) and b (K x N) are FP8 codes and the scales are dequantization
multipliers (``torch._scaled_mm`` semantics). The accumulation model is an argument (a name, or an
``Accumulation`` record), looked up in a registry (``models.py``):

``exact``         the exact sum, rounded once (RNE) to ``out_dtype`` (``exact.py``, ``epilogue.py``).
``fp32``          fp32 accumulation in a declared order (sequential over k, optional K-blocks).
``fp32-limited``  an accumulator that keeps ``mantissa_bits`` fraction bits (truncation after
                  every addition) promoted to fp32 every ``promote_every`` elements (``fp32.py``).
hardware kernels  every preset of ``fp8ref.hardware.KERNELS`` (``hopper-fast-accum``,
                  ``hopper-promoted``, ``deepgemm-1x128-128x128``, ``cdna3``, ...): the bit-exact
                  tensor-core instruction models in a K loop (``hardware.py``; docs/accumulation.md).

Operands are decoded with ``fp8ref.codec.decode``; no FP8 cast of another library is used.
Layout: api (entry points, records) -> models (registry) -> exact, fp32 -> epilogue -> operands.
"""

from ..rounding import OUT_FORMATS, OutFormat
from . import hardware as _hardware  # noqa: E402,F401  (registers the fp8ref.hardware kernel presets)
from .api import ACTIVATION_RECIPE, Output, linear, quantize_input, scaled_mm
from .epilogue import CODE_ROUNDINGS, SCALE_RESULT_OPS, CodeOut
from .models import ACCUMULATION_MODELS, ACCUMULATIONS, SCALE_ORDERS, Accumulation, register_accumulation
from .operands import DEFAULT_FORMAT, SCALE_BLOCK, DecodedCodes

__all__ = ["ACCUMULATIONS", "ACCUMULATION_MODELS", "ACTIVATION_RECIPE", "Accumulation", "CODE_ROUNDINGS", "CodeOut",
           "DEFAULT_FORMAT", "DecodedCodes", "OUT_FORMATS", "Output", "OutFormat", "SCALE_BLOCK", "SCALE_ORDERS",
           "SCALE_RESULT_OPS", "linear", "quantize_input", "register_accumulation", "scaled_mm"]
