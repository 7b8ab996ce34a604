"""naive_block: the block-scaled GEMM people write first when no kernel is at hand (torch's CPU has
no block-scaled scaled_mm): decode the NVFP4 / MX element codes with ml_dtypes, multiply each by its
block scale in float32, one float32 numpy matmul (BLAS, its own order), times NVFP4's alpha and plus
the bias in float32, then the cast to the output dtype (ml_dtypes' RNE for bfloat16).

Judged by the fp32-order bound against the exact result (``accumulation_order: unspecified``);
where a scaled operand leaves float32's range (E8M0 scales 2**+-127) it is compared bit for bit and
its deviations are reported (docs/conformance.md, "Block-scaled GEMMs").
"""

from __future__ import annotations

import numpy as np

from ..backend import Backend
from ._common import dist_version, missing

_BLOCK = {"block16": 16, "block32": 32}


class NaiveBlockBackend(Backend):
    name = "naive_block"
    capabilities = {
        "scaled_mm": {"format": ("float4_e2m1fn", "float8_e4m3fn", "float8_e5m2"), "scales": tuple(_BLOCK),
                      "out_dtype": ("float32", "bfloat16"), "accumulate": ("fp32",),
                      "scale_order": ("operands",), "bias": (False, True)},
    }
    accumulation_order = {"scaled_mm": "unspecified"}

    def unavailable(self) -> str | None:
        return missing("ml_dtypes")

    def version(self) -> str:
        return f"numpy {np.__version__}, {dist_version('ml_dtypes')}"

    def scaled_mm(self, a, b, scale_a, scale_b, *, bias, fmt, out_dtype, accumulate, scale_order, alpha=None):
        import ml_dtypes

        block = self.block(a.shape[1], scale_a.shape[1])
        with np.errstate(all="ignore"):  # Inf / NaN as float32 arithmetic gives them
            A = self.dequantize(np.asarray(a), fmt, np.asarray(scale_a, np.float32), block, axis=1)
            B = self.dequantize(np.asarray(b), fmt, np.asarray(scale_b, np.float32), block, axis=0)
            out = A @ B
            if alpha is not None:
                out = out * np.float32(np.asarray(alpha, np.float32).reshape(-1)[0])
            if bias is not None:
                out = out + np.asarray(bias).astype(np.float32)
        return out.astype(np.float32) if out_dtype == "float32" else out.astype(ml_dtypes.bfloat16)

    @staticmethod
    def block(K: int, kb: int) -> int:
        """The block length the scales' shape implies (16 or 32)."""
        return next(n for n in sorted(_BLOCK.values()) if -(-K // n) == kb)

    @staticmethod
    def dequantize(codes, fmt, scales, block, axis):
        import ml_dtypes

        values = codes.view(getattr(ml_dtypes, fmt)).astype(np.float32)
        full = np.repeat(scales, block, axis=axis)
        full = full[:, :codes.shape[1]] if axis == 1 else full[:codes.shape[0]]
        return values * full
