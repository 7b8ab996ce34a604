"""fp8ref's own kernel models posing as GPU backends, for ``--accumulation`` meta-tests.

Each computes scaled_mm and linear the way a GEMM kernel does, whatever ``accumulate`` it is
asked for: the K loop and epilogue of ``fp8ref.hardware.kernel_mm`` (its own out_dtype rounding and
bias add, not scaled_mm's), activations quantized by ``fp8ref.matmul.quantize_input``. The judge
recomputes its expected outputs through ``scaled_mm(accumulate=MODEL)``, so a pass also says the
two paths agree. ``FlippedLsb`` is hopper-fast-accum with one output bit wrong."""

import numpy as np

from fp8ref.conformance import Backend
from fp8ref.hardware import kernel_mm
from fp8ref.matmul import quantize_input

CAPS = {"scaled_mm": {"format": ("float8_e4m3fn",), "scales": ("tensor", "row")},
        "linear": {"scheme": ("FP8_STATIC",)}}


class _Kernel(Backend):
    capabilities = CAPS
    kernel = ""

    def version(self) -> str:
        return f"fp8ref kernel model {self.kernel}"

    def scaled_mm(self, a, b, scale_a, scale_b, *, bias, fmt, out_dtype, accumulate, scale_order):
        sa = np.asarray(scale_a, np.float32).reshape(-1, 1)
        sb = np.asarray(scale_b, np.float32).reshape(1, -1)
        return kernel_mm(a, b, sa, sb, kernel=self.kernel, out_dtype=out_dtype,
                         bias=None if bias is None else np.asarray(bias).astype(np.float32))

    def linear(self, x, weight, weight_scale, *, input_scale, dynamic, accumulate):
        codes, s_x = quantize_input(np.asarray(x, np.float32), input_scale=input_scale, dynamic=dynamic)
        ws = np.asarray(weight_scale, np.float32).reshape(1, -1)  # per tensor or per output channel
        return kernel_mm(codes, np.ascontiguousarray(weight.T), s_x.reshape(-1, 1), ws, kernel=self.kernel,
                         out_dtype=np.asarray(x).dtype.name)


class HopperFastAccum(_Kernel):
    name = "hopper-fast-accum-gpu"
    kernel = "hopper-fast-accum"


class HopperPromoted(_Kernel):
    name = "hopper-promoted-gpu"
    kernel = "hopper-promoted"


class BlackwellFp8(_Kernel):
    name = "blackwell-fp8-gpu"
    kernel = "blackwell-fp8"


class FlippedLsb(HopperFastAccum):
    """hopper-fast-accum, but element [0, 0] of every scaled_mm has its lowest bit flipped."""

    name = "hopper-flipped-lsb"

    def scaled_mm(self, a, b, scale_a, scale_b, **kw):
        out = np.array(super().scaled_mm(a, b, scale_a, scale_b, **kw))
        bits = out.view(np.uint32 if out.itemsize == 4 else np.uint16)
        bits[0, 0] ^= 1
        return out
