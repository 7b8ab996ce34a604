"""Calls the MMA-Sim peer (``mmasim``, the published simulator) on fp8ref's operands."""

from __future__ import annotations

import numpy as np
import torch

from fp8ref.hardware import instruction

_TORCH_DTYPES = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2,
                 "float8_e4m3fnuz": torch.float8_e4m3fnuz, "float8_e5m2fnuz": torch.float8_e5m2fnuz,
                 "float8_e8m0fnu": torch.float8_e8m0fnu}


def _elements(codes: np.ndarray, fmt) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(codes))
    if fmt.name in _TORCH_DTYPES:
        return t.view(_TORCH_DTYPES[fmt.name])
    # mmasim holds FP6 in bits 5:0 and FP4 in bits 5:2 of a byte
    return t << 2 if fmt.bits == 4 else t


def _packed_fp4(codes: np.ndarray, axis: int) -> torch.Tensor:
    """Two FP4 codes per byte along ``axis``: element 2i in the high nibble, 2i+1 in the low."""
    c = np.moveaxis(codes, axis, -1)
    packed = (c[..., 0::2] << 4) | c[..., 1::2]
    return torch.from_numpy(np.ascontiguousarray(np.moveaxis(packed, -1, axis)))


def simulator(op: str, arch: str, s: str):
    from mmasim import amd, nv_ptx

    ins = instruction(op, arch, s)
    if op == "mfma":
        return amd.MFMA(ins.arch, s)
    scaled = ins.scale_fmt is not None
    cls = {("mma", False): nv_ptx.MMA, ("mma", True): nv_ptx.MMABlockScale, ("wgmma", False): nv_ptx.WGMMA,
           ("tcgen05.mma", False): nv_ptx.TCGen05MMA, ("tcgen05.mma", True): nv_ptx.TCGen05MMABlockScale}
    return cls[op, scaled](ins.arch, s)


def run(sim, op: str, arch: str, s: str, A, B, C, SA=None, SB=None) -> np.ndarray:
    ins = instruction(op, arch, s)
    c = torch.from_numpy(np.ascontiguousarray(C))
    if ins.datapath.family == "grouped":
        a, b = _packed_fp4(A, 1), _packed_fp4(B, 0)
    else:
        a, b = _elements(A, ins.a_fmt), _elements(B, ins.b_fmt)
    if ins.scale_fmt is None:
        return sim(a, b, c).numpy()
    sdt = _TORCH_DTYPES[ins.scale_fmt.name]
    sa = torch.from_numpy(np.ascontiguousarray(SA)).view(sdt)
    sb = torch.from_numpy(np.ascontiguousarray(SB)).view(sdt)
    return sim(a, b, c, sa, sb).numpy()
