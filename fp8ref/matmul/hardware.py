"""The kernel models of ``fp8ref.hardware`` as accumulation models of scaled_mm:
``scaled_mm(a, b, sa, sb, accumulate="hopper-promoted")``.

Each preset kernel (``fp8ref.hardware.KERNELS``) is registered under its name. Epilogue-scaled
kernels take tensor / row / column scales; "promotion" kernels (DeepGEMM) take 1 x promote_every
groups for a and promote_every x block_n blocks for b (block_k must equal promote_every).
Kernels whose instruction carries block-scale codes (MXFP8, NVFP4) are called with codes through
``fp8ref.hardware.kernel_mm``; scaled_mm refuses them with that pointer.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..errors import InputTypeError, ShapeError
from ..hardware import KERNELS, Kernel, kernel_mm
from .models import register_accumulation


class KernelModel:
    """A hardware kernel model (instruction K loop, promotion, split-K, epilogue scale)."""

    rounds_once = False

    def __init__(self, kernel: Kernel):
        self.kernel = kernel
        self.name = kernel.name

    def __call__(self, ca, cb, fa, fb, sa, sb, bk, bias, out, acc):
        k, ins = self.kernel, self.kernel.ins
        if (fa, fb) != (ins.a_fmt, ins.b_fmt):
            raise InputTypeError(f"accumulate={k.name!r}: its instruction {ins.name} takes {ins.a_fmt.name} x "
                                 f"{ins.b_fmt.name} operands, got {fa.name} x {fb.name}")
        if k.scales == "instruction":
            raise InputTypeError(f"accumulate={k.name!r}: the instruction applies {ins.scale_type} block-scale codes; "
                                 "call fp8ref.hardware.kernel_mm with the codes")
        sa32, sb32 = np.ascontiguousarray(sa, np.float32), np.ascontiguousarray(sb, np.float32)
        if k.scales == "promotion":
            if sa.shape[1] > 1 and bk != k.promote_every:
                raise ShapeError(f"accumulate={k.name!r}: block_k must be its promotion interval "
                                 f"{k.promote_every}, got {bk}")
            nkb = -(-ca.shape[1] // k.promote_every)
            sa32 = np.ascontiguousarray(np.broadcast_to(sa32, (sa32.shape[0], nkb)))
            sb32 = np.ascontiguousarray(np.broadcast_to(sb32, (nkb, sb32.shape[1])))
            return kernel_mm(ca, cb, sa32, sb32, kernel=replace(k, block_n=1))
        if sa.shape[1] > 1:
            raise ShapeError(f"accumulate={k.name!r}: applies tensor/row/column scales in the epilogue; "
                             "K-block scales need a 'promotion' kernel (e.g. deepgemm-1x128-128x128)")
        return kernel_mm(ca, cb, sa32[:, :1], sb32[:1, :], kernel=k)


for _kernel in KERNELS.values():
    register_accumulation(KernelModel(_kernel))
