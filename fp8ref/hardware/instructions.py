"""``mma(op, arch, shape_and_type, a, b, c)``: one tensor-core instruction, bit for bit."""

from __future__ import annotations

import numpy as np

from ..errors import FormatError, InputTypeError, ShapeError
from ..formats import FloatFormat
from . import fdpa, native
from .isa import Instruction, instruction


def _is_torch(x) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "dtype") and hasattr(x, "device")


def as_codes(x, fmt: FloatFormat, what: str) -> np.ndarray:
    """numpy uint8 codes of ``fmt`` from numpy/torch uint8 codes or a torch float8 tensor."""
    if _is_torch(x):
        import torch
        if x.dtype != torch.uint8:
            if x.element_size() != 1 or not x.dtype.is_floating_point:
                raise InputTypeError(f"{what}: expected uint8 codes or a torch float8 tensor, got torch {x.dtype}")
            x = x.view(torch.uint8)
        x = x.detach().cpu().contiguous().numpy()
    if not isinstance(x, np.ndarray) or x.dtype != np.uint8:
        raise InputTypeError(f"{what}: expected a uint8 code array, got {getattr(x, 'dtype', type(x).__name__)}")
    if fmt.bits < 8 and x.size and int(x.max()) >= fmt.n_codes:
        raise FormatError(f"{what}: {fmt.name} has {fmt.bits}-bit codes (< {fmt.n_codes:#x}), got {int(x.max()):#04x}")
    return x


def as_acc(x, acc: str, what: str) -> np.ndarray:
    if _is_torch(x):
        x = x.detach().cpu().contiguous().numpy()
    if not isinstance(x, np.ndarray) or x.dtype != np.dtype(acc):
        raise InputTypeError(f"{what}: expected a {acc} array (the instruction's accumulator), "
                             f"got {getattr(x, 'dtype', type(x).__name__)}")
    return x


def dot_add(ins: Instruction, a, b, c, sa=None, sb=None) -> np.ndarray:
    """The instruction's dot-product-add along the last axis: a, b (..., k) codes, c (...),
    sa, sb (..., k // block) scale codes. Steps of ``L`` elements, C chained between steps."""
    dp = ins.datapath
    K = a.shape[-1]
    L = min(K, dp.L)
    for i in range(0, K, L):
        sl = slice(i, i + L)
        if dp.family == "pairwise":
            c = fdpa.pairwise_step(dp, a[..., sl], b[..., sl], ins.a_fmt, ins.b_fmt, c)
            continue
        ss = slice(i // ins.block, (i + L) // ins.block) if ins.block else None
        c = fdpa.fused_step(dp, ins.acc, a[..., sl], b[..., sl], ins.a_fmt, ins.b_fmt, c,
                            None if ss is None else sa[..., ss], None if ss is None else sb[..., ss],
                            ins.scale_fmt, ins.scale_type == "ue4m3", ins.block)
    return c


_PLANS: dict[tuple[str, str, str], native.Plan] = {}  # (op, arch, shape_and_type) as given -> its C plan


def mma(op: str, arch: str, shape_and_type: str, a, b, c, *, scale_a=None, scale_b=None):
    """D = A·B + C as the instruction computes it, bit for bit (the published model).

    a: (m, k) and b: (k, n) element codes (uint8, one code per byte, FP4/FP6 in the low bits; or
    torch float8 tensors); c: (m, n) in the accumulator dtype (float32, or float16 for .f16).
    Block-scaled kinds take scale_a (m, k // block) and scale_b (k // block, n) as UE8M0 / UE4M3
    codes (UE4M3: the sign bit is ignored, as the hardware does). Returns D like c (numpy, or
    torch when ``a`` is torch)."""
    try:  # the plain case (numpy operands of the right shapes, finite): the cached plan, no re-parsing
        plan = _PLANS[op, arch, shape_and_type]
    except (KeyError, TypeError):
        plan = None
    if plan is not None and native.kernels() is not None:
        D = plan(a, b, c, scale_a, scale_b)
        if D is not None:
            return D
    return _checked_mma(op, arch, shape_and_type, a, b, c, scale_a, scale_b)


def _checked_mma(op, arch, shape_and_type, a, b, c, scale_a, scale_b):
    """mma() with every argument validated (a one-line Fp8RefError for bad input)."""
    ins = instruction(op, arch, shape_and_type)
    A = as_codes(a, ins.a_fmt, "a")
    B = as_codes(b, ins.b_fmt, "b")
    C = as_acc(c, ins.acc, "c")
    for what, x, shape in (("a", A, (ins.m, ins.k)), ("b", B, (ins.k, ins.n)), ("c", C, (ins.m, ins.n))):
        if x.shape != shape:
            raise ShapeError(f"{what}: {ins.name} takes shape {shape}, got {tuple(x.shape)}")
    SA = SB = None
    if ins.scale_fmt is not None:
        if scale_a is None or scale_b is None:
            raise InputTypeError(f"{ins.name}: block-scaled; scale_a and scale_b are required")
        nb = ins.k // ins.block
        SA, SB = as_codes(scale_a, ins.scale_fmt, "scale_a"), as_codes(scale_b, ins.scale_fmt, "scale_b")
        for what, x, shape in (("scale_a", SA, (ins.m, nb)), ("scale_b", SB, (nb, ins.n))):
            if x.shape != shape:
                raise ShapeError(f"{what}: {ins.name} takes shape {shape}, got {tuple(x.shape)}")
    elif scale_a is not None or scale_b is not None:
        raise InputTypeError(f"{ins.name}: not block-scaled; scale_a/scale_b must be None")
    if all(type(x) is str for x in (op, arch, shape_and_type)) and (plan := native.plan(ins)) is not None:
        _PLANS[op, arch, shape_and_type] = plan
    D = native.chained_matmul(ins, A, B, C, SA, SB)
    if D is None:
        D = dot_add(ins, A[:, None, :], B.T[None, :, :], C, None if SA is None else SA[:, None, :],
                    None if SB is None else SB.T[None, :, :])
    if _is_torch(a):
        import torch
        return torch.from_numpy(D)
    return D
