"""torch: native casts to the float8 dtypes (``Tensor.to``) and their decode, and
``torch._scaled_mm``, on CPU (``torch``) or on torch's CUDA device (``torch_cuda``,
``torch_cuda_fast_accum``: cuBLASLt's FP8 GEMM, ``use_fast_accum`` off and on).

encode saturate=False is the plain cast. saturate=True is ``clamp(-max, max)`` then the
cast: the recipe torch users are told to follow. Only round-to-nearest-even exists.
"""

from __future__ import annotations

import numpy as np

from ..backend import Backend
from ._common import INPUT_DTYPES, clamp_to_max, dist_version, missing

_FORMATS = ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")


class TorchBackend(Backend):
    name = "torch"
    device = "cpu"
    fast_accum = False  # torch._scaled_mm's use_fast_accum (CUDA only; the CPU kernel has one path)
    capabilities = {
        "encode": {"format": _FORMATS, "rounding": ("rne",), "saturate": (True, False), "dtype": INPUT_DTYPES},
        "decode": {"format": _FORMATS},
        # CPU _scaled_mm: (A.f32 * scale_a) @ (B.f32 * scale_b) in fp32 (ATen Blas.cpp), i.e.
        # fp32 accumulation with the scales applied to the operands, in BLAS's own order.
        # No block128: torch 2.13's CPU _scaled_mm (and F.scaled_mm with ScalingType.BlockWise1x128 /
        # BlockWise128x128) accepts TensorWise and RowWise scales only ("Invalid scaling configuration").
        "scaled_mm": {"format": ("float8_e4m3fn", "float8_e5m2"), "scales": ("tensor", "row"),
                      "out_dtype": ("float32", "bfloat16", "float16"), "accumulate": ("fp32",),
                      "scale_order": ("operands",), "bias": (False, True)},
        # K, V (and Q) cast to float8 by torch, dequantized exactly in float64, then
        # F.scaled_dot_product_attention (CPU math path) in float64, rounded to D by torch
        "attention": {"format": ("float8_e4m3fn", "float8_e5m2"), "dtype": INPUT_DTYPES, "quantize": ("kv", "qkv"),
                      "causal": (False, True)},
    }
    # BLAS sums in its own order: judged against the exact result by the fp32-order bound
    # (fp8ref.golden.judge), never bit for bit against fp8ref's sequential model; SDPA's float64
    # order and exp are its own: judged by the float64-order tolerance (fp8ref.golden.ops.attention)
    accumulation_order = {"scaled_mm": "unspecified", "attention": "unspecified"}

    def unavailable(self) -> str | None:
        return missing("torch")

    def version(self) -> str:
        return dist_version("torch")

    @staticmethod
    def _tensor(x: np.ndarray):
        import torch

        if x.dtype.name == "bfloat16":  # numpy has no bfloat16: carry the bits
            return torch.from_numpy(x.view(np.uint16).copy()).view(torch.bfloat16)
        return torch.from_numpy(np.ascontiguousarray(x))

    def encode(self, x, fmt, *, rounding, saturate, random_bits=None):
        import torch

        t = self._tensor(clamp_to_max(x, fmt) if saturate else x).to(self.device)
        return t.to(getattr(torch, fmt)).view(torch.uint8).cpu().numpy()

    def decode(self, codes, fmt):
        import torch

        t = torch.from_numpy(np.ascontiguousarray(codes)).to(self.device).view(getattr(torch, fmt))
        return t.to(torch.float32).cpu().numpy()

    def scaled_mm(self, a, b, scale_a, scale_b, *, bias, fmt, out_dtype, accumulate, scale_order):
        import torch

        dt, dev = getattr(torch, fmt), self.device
        ta = torch.from_numpy(np.ascontiguousarray(a)).to(dev).view(dt)
        tb = torch.from_numpy(np.ascontiguousarray(b.T)).to(dev).view(dt).t()  # column-major (K, N)
        sa = torch.from_numpy(np.ascontiguousarray(scale_a, dtype=np.float32)).to(dev)
        sb = torch.from_numpy(np.ascontiguousarray(scale_b, dtype=np.float32)).to(dev)
        if sa.numel() == 1:
            sa, sb = sa.reshape(()), sb.reshape(())
        tbias = None if bias is None else self._tensor(bias).to(dev)
        kw = {"use_fast_accum": True} if self.fast_accum else {}
        out = torch._scaled_mm(ta, tb, sa, sb, bias=tbias, out_dtype=getattr(torch, out_dtype), **kw).cpu()
        if out.dtype == torch.bfloat16:
            import ml_dtypes

            return out.view(torch.uint16).numpy().view(ml_dtypes.bfloat16)
        return out.numpy()

    def attention(self, q, k, v, k_scale, v_scale, *, q_scale, fmt, causal):
        import torch

        dt = getattr(torch, fmt)

        def fp8(x, scale):  # torch's static per-tensor quantization, dequantized exactly in float64
            s = torch.from_numpy(np.ascontiguousarray(scale, dtype=np.float32)).reshape(())
            x8 = (self._tensor(x).to(torch.float32) / s).clamp(-torch.finfo(dt).max, torch.finfo(dt).max).to(dt)
            return x8.to(torch.float64) * s.to(torch.float64)

        tq = self._tensor(q).to(torch.float64) if q_scale is None else fp8(q, q_scale)
        tk, tv = fp8(k, k_scale), fp8(v, v_scale)
        Tq, Tk = tq.shape[2], tk.shape[2]
        mask = None
        if causal:  # the cache's last query aligned with its last key
            mask = torch.arange(Tk)[None, :] <= torch.arange(Tq)[:, None] + (Tk - Tq)
        out = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, attn_mask=mask,
                                                               enable_gqa=tk.shape[1] != tq.shape[1])
        if q.dtype.name == "bfloat16":
            import ml_dtypes

            return out.to(torch.bfloat16).view(torch.uint16).numpy().view(ml_dtypes.bfloat16)
        return out.to(getattr(torch, q.dtype.name)).numpy()


class TorchCudaBackend(TorchBackend):
    """Casts and ``torch._scaled_mm`` on torch's CUDA device (inputs copied there, outputs back).
    The GEMM's accumulation is the GPU kernel's own, declared nowhere: judge it with
    ``--accumulation best`` (which registered model reproduces it) or by the fp32-order bound."""

    name = "torch_cuda"
    device = "cuda"
    # cuBLASLt applies the scales to the fp32 accumulator in its epilogue (not to the operands as
    # the CPU kernel does); no attention: the CPU adapter's SDPA path is not the GPU's
    capabilities = {op: c for op, c in TorchBackend.capabilities.items() if op != "attention"}
    capabilities["scaled_mm"] = dict(capabilities["scaled_mm"], scale_order=("epilogue",))

    def unavailable(self) -> str | None:
        if reason := missing("torch"):
            return reason
        import torch

        return None if torch.cuda.is_available() else "torch sees no CUDA device"


class TorchCudaFastAccumBackend(TorchCudaBackend):
    """``torch_cuda`` with ``torch._scaled_mm(..., use_fast_accum=True)`` (Hopper: no promotion of the
    tensor cores' partial sums to fp32 every few K steps)."""

    name = "torch_cuda_fast_accum"
    fast_accum = True
