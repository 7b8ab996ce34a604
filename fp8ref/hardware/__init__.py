"""What the hardware computes: bit-exact tensor-core instruction models (``mma``), kernel-level
GEMMs built from them (``kernel_mm``, ``KERNELS``) and the probe that infers which model an
unknown GEMM follows. docs/accumulation.md describes every rule."""

from .instructions import dot_add, mma
from .isa import Datapath, Instruction, instruction, names
from .kernels import KERNELS, Kernel, get_kernel, kernel_mm

__all__ = ["KERNELS", "Datapath", "Instruction", "Kernel", "dot_add", "get_kernel", "instruction", "kernel_mm", "mma",
           "names"]
