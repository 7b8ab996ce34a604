"""Block-scaled (NVFP4 / MX) products under a named accumulation model other than ``exact``.

The operands are what a block-scaled GEMM receives: element codes a (M, K) and b (K, N), one scale
per ``block`` elements of K on both sides (a's (M, KB), b's (KB, N); E4M3 values for NVFP4's
16-element blocks, E8M0 powers of two for MX's 32), and an optional float32 ``alpha`` (NVFP4's
global scales, as a serving engine folds them: ``alpha_of``). Two models (``exact`` is
``fp8ref.matmul.global_scaled``):

``fp32``       per block: part = +0, part = fp32(part + fp32(a_k * b_k)) in k order (the element
               products are exact in fp32), then total = fp32(total + fp32(fp32(sa * sb) * part)),
               blocks in order: scaled_mm's ``fp32`` model with ``block_k = block`` (``fp32.py``).
a kernel       a preset of ``fp8ref.hardware.KERNELS`` whose instruction applies the block scales
               itself (``scales: instruction``: ``blackwell-nvfp4``, ``blackwell-mxfp8``,
               ``blackwell-mxfp4``) and takes these element formats, scale type and block:
               ``fp8ref.hardware.kernel_mm`` on the codes and the scale codes.

Both end in the kernels' epilogue: out = round(fp32(fp32(acc * alpha) + bias)) to out_dtype (RNE).
A weight-only layer (16-bit activations, ``values_mm``) has the ``fp32`` model only, in the operands
order (each weight element times its block scale, exact in fp32; one sequential fp32 sum over K):
no tensor-core instruction multiplies 16-bit activations by FP4/MX codes.
"""

from __future__ import annotations

import numpy as np

from ..codec import decode
from ..formats import get_format
from ..rounding import round_to
from .fp32 import _fp32, _seq_sum


def refusal(accumulate: str, *, fmt_a: str | None, fmt_b: str, scale_fmt: str, block: int) -> str | None:
    """Why ``accumulate`` has no definition for these operands (None: it has). ``fmt_a`` None: a
    weight-only layer (16-bit activations)."""
    from ..hardware import KERNELS

    if accumulate in ("exact", "fp32"):
        return None
    kind = "NVFP4" if block == 16 else "MX"
    if accumulate == "fp32-limited":
        return (f"accumulation fp32-limited models an accumulator promoted to fp32 every 128 products (Hopper FP8); "
                f"a {kind} scale changes every {block} elements, and no Hopper instruction applies block scales: "
                f"use exact, fp32 or a block-scaled kernel ({', '.join(_block_kernels())})")
    k = KERNELS.get(accumulate)
    if k is None:
        return f"accumulation {accumulate!r}: no model of that name for block-scaled {kind} products"
    ins = k.ins
    if k.scales != "instruction":
        return (f"accumulation {accumulate!r} ({ins.name}) applies float32 scales outside the instruction; {kind} "
                f"block scales need an instruction that applies them: {', '.join(_block_kernels())}")
    if fmt_a is None:
        return (f"accumulation {accumulate!r}: weight-only layer (16-bit activations); no tensor-core instruction "
                f"multiplies them by {fmt_b} codes (use exact or fp32)")
    want = (ins.a_fmt.name, ins.b_fmt.name, ins.scale_fmt.name, ins.block)
    got = (fmt_a, fmt_b, scale_fmt, block)
    if want != got:
        return (f"accumulation {accumulate!r} ({ins.name}) takes {want[0]} x {want[1]} with {want[2]} scales per "
                f"{want[3]}; this layer has {got[0]} x {got[1]} with {got[2]} scales per {got[3]}")
    return None


def _block_kernels() -> list[str]:
    from ..hardware import KERNELS

    return [n for n, k in KERNELS.items() if k.scales == "instruction"]


def alpha_of(g_w, g_x, meaning: str) -> np.float32 | None:
    """The float32 epilogue multiplier of NVFP4's global scales as vLLM computes it: multipliers
    (ModelOpt ``weight_scale_2``, ``input_scale``): fp32(g_x * g_w); divisors (compressed-tensors
    ``weight_global_scale``, ``input_global_scale``): each inverted in fp32 first, then
    fp32(fp32(1/g_x) * fp32(1/g_w)) (vLLM ``CompressedTensorsW4A4Fp4.process_weights_after_loading``).
    g_x None: a weight-only layer. None when there is no global (MX)."""
    if g_w is None:
        return None
    f32 = np.float32
    parts = [f32(g_w)] + ([] if g_x is None else [f32(g_x)])
    if meaning == "divisor":
        parts = [f32(f32(1) / p) for p in parts]
    alpha = parts[0]
    for p in parts[1:]:
        alpha = f32(alpha * p)
    return alpha


def kernel_epilogue(acc32: np.ndarray, alpha, bias, out_dtype: str) -> np.ndarray:
    """round(fp32(fp32(acc * alpha) + bias)) to out_dtype (kernel_mm's epilogue): float32 values."""
    with np.errstate(over="ignore", invalid="ignore"):
        out = acc32 if alpha is None else (acc32 * np.float32(alpha)).astype(np.float32)
        if bias is not None:
            out = (out + np.asarray(bias, np.float32).reshape(1, -1)).astype(np.float32)
    return round_to(out, out_dtype).astype(np.float32)


def block_scaled_mm(a, b, scale_a, scale_b, *, fmt_a: str, fmt_b: str, scale_fmt: str, block: int,
                    accumulate: str, alpha=None, bias=None, out_dtype: str = "float32") -> np.ndarray:
    """(M, N) float32 values of ``out_dtype``: codes a (M, K), b (K, N); scale codes scale_a (M, KB),
    scale_b (KB, N) of ``scale_fmt`` (uint8 E4M3 / E8M0), one per ``block`` elements of K."""
    why = refusal(accumulate, fmt_a=fmt_a, fmt_b=fmt_b, scale_fmt=scale_fmt, block=block)
    if why is not None:
        from ..errors import InputTypeError

        raise InputTypeError(why)
    if accumulate == "fp32":
        sfmt = get_format(scale_fmt)
        sa = decode(np.ascontiguousarray(scale_a), sfmt).astype(np.float64)
        sb = decode(np.ascontiguousarray(scale_b), sfmt).astype(np.float64)
        acc = _fp32(np.ascontiguousarray(a), np.ascontiguousarray(b), get_format(fmt_a), get_format(fmt_b),
                    sa, sb, block, block, "epilogue")
        return kernel_epilogue(acc, alpha, bias, out_dtype)
    from ..hardware import kernel_mm

    y = kernel_mm(np.ascontiguousarray(a), np.ascontiguousarray(b), np.ascontiguousarray(scale_a),
                  np.ascontiguousarray(scale_b), kernel=accumulate, out_dtype=out_dtype,
                  bias=None if bias is None else np.asarray(bias, np.float32),
                  alpha=None if alpha is None else np.float32(alpha))
    return np.asarray(y).astype(np.float32)


def values_mm(x32: np.ndarray, w32: np.ndarray, *, alpha=None, bias=None, out_dtype: str = "float32") -> np.ndarray:
    """A weight-only block-scaled layer under ``fp32``: x (M, K) float32 (16-bit activations, exact),
    w (N, K) float32 (element x block scale, exact); acc = +0, acc = fp32(acc + fp32(x_k * w_k)) for
    k in order; then the epilogue. (M, N) float32 values of ``out_dtype``."""
    a = np.ascontiguousarray(x32, np.float32)
    bt = np.ascontiguousarray(np.asarray(w32, np.float32).T)
    return kernel_epilogue(_seq_sum(a, bt, 0, a.shape[1]), alpha, bias, out_dtype)
