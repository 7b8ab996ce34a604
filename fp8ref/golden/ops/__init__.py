"""The operations table: one row per operation a suite can declare and a backend can implement.

Adding an operation is one Operation subclass (fp8ref.golden.case) and one row here; suites
(its fields), folders, the judge (its output formats), the conformance backend protocol
(capability and option checks) and the reports (parameter order, signatures) all read this table.
"""

from __future__ import annotations

from ..case import Operation
from .attention import Attention
from .encode import Decode, Encode
from .fake_quant import FakeQuant
from .gemm import Linear, ScaledMM
from .quantize import Dequantize, Quantize

OPERATIONS: dict[str, Operation] = {op.name: op for op in (Encode(), Decode(), Quantize(), Dequantize(),
                                                           ScaledMM(), Linear(), Attention(), FakeQuant())}

__all__ = ["OPERATIONS", "Operation"]
