"""Kernel-level GEMMs built from instruction models: a K loop of one instruction, a promotion
policy, where the scales are applied, split-K and the epilogue.

A ``Kernel`` is a frozen record (``Kernel.from_dict`` reads the YAML-able dict form, strictly):

``instruction``    (op, arch, shape_and_type) issued along K; its datapath is the inner sum.
``promote_every``  K elements accumulated by the tensor core (C chained from instruction to
                   instruction) before the result is added into an FP32 register accumulator
                   and the tensor-core accumulator restarts at 0; None: never ("fast accumulation",
                   the instruction's accumulator carries the whole K).
``promote``        "add": acc = fp32(acc + fp32(d * s)); "fma": acc = fma(d, s, acc), one rounding.
``scales``         "epilogue": tensor/row/column float32 scales multiply the FP32 result once;
                   "promotion": per-block float32 scales (a: (M, K/128), b: (K/128, N/128)), s at
                   each promotion is fp32(scale_a * scale_b) (DeepGEMM); "instruction": the MMA's
                   own block scales (UE8M0/UE4M3 codes), plus an optional float32 ``alpha``.
``split_k``        K is cut into split_k contiguous parts (multiples of the instruction's k), each
                   computed as above into FP32, then the parts are added in order in FP32.
Epilogue: out = round(fp32(fp32(acc * s) + bias)) to out_dtype (float32, bfloat16, float16; RNE).
K is padded with zero codes to a multiple of the instruction's k (zeros never raise the
alignment exponent: they take e_zero).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

import numpy as np

from ..errors import InputTypeError, ScaleError, ShapeError, SpecError
from . import native
from .instructions import as_codes, dot_add
from .isa import Instruction, instruction

PROMOTE_OPS = ("add", "fma")
SCALE_SITES = ("epilogue", "promotion", "instruction")
OUT_DTYPES = ("float32", "bfloat16", "float16")
_TILE = 1 << 21  # output elements x K-step elements per vectorised step (memory bound)


@dataclass(frozen=True)
class Kernel:
    name: str
    instruction: tuple[str, str, str]
    promote_every: int | None = None
    promote: str = "add"
    scales: str = "epilogue"
    split_k: int = 1
    block_n: int = 128  # N per scale block of b for scales="promotion"
    source: str = ""
    ins: Instruction = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        where = f"kernel {self.name!r}"
        if not (isinstance(self.instruction, (tuple, list)) and len(self.instruction) == 3):
            raise SpecError(f"{where}: instruction: expected [op, arch, shape_and_type], got {self.instruction!r}")
        object.__setattr__(self, "instruction", tuple(self.instruction))
        try:
            ins = instruction(*self.instruction)
        except InputTypeError as exc:
            raise SpecError(f"{where}: instruction: {exc}") from None
        object.__setattr__(self, "ins", ins)
        if self.promote not in PROMOTE_OPS:
            raise SpecError(f"{where}: promote: expected one of {PROMOTE_OPS}, got {self.promote!r}")
        if self.scales not in SCALE_SITES:
            raise SpecError(f"{where}: scales: expected one of {SCALE_SITES}, got {self.scales!r}")
        if (self.scales == "instruction") != (ins.scale_fmt is not None):
            raise SpecError(f"{where}: scales: 'instruction' goes with (and only with) a block-scaled instruction")
        for key, lo in (("split_k", 1), ("block_n", 1)):
            v = getattr(self, key)
            if type(v) is not int or v < lo:
                raise SpecError(f"{where}: {key}: expected an int >= {lo}, got {v!r}")
        p = self.promote_every
        if p is not None and (type(p) is not int or p < ins.k or p % ins.k):
            raise SpecError(f"{where}: promote_every: expected null or a multiple of the instruction's k "
                            f"({ins.k}), got {p!r}")
        if self.scales == "promotion" and p is None:
            raise SpecError(f"{where}: scales 'promotion' needs promote_every")

    @classmethod
    def from_dict(cls, d: Mapping, where: str = "kernel") -> Kernel:
        known = {"name", "instruction", "promote_every", "promote", "scales", "split_k", "block_n", "source"}
        if not isinstance(d, Mapping):
            raise SpecError(f"{where}: expected a mapping, got {type(d).__name__}")
        unknown = sorted(set(d) - known)
        if unknown:
            raise SpecError(f"{where}: unknown key {unknown[0]!r} (known: {', '.join(sorted(known))})")
        for key in ("name", "instruction"):
            if key not in d:
                raise SpecError(f"{where}: missing key {key!r}")
        return cls(**dict(d))

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("ins", None)
        d["instruction"] = list(self.instruction)
        return d


def _k(name, ins, **kw) -> Kernel:
    return Kernel(name, ins, **kw)


KERNELS: Mapping[str, Kernel] = {k.name: k for k in (
    _k("hopper-fast-accum", ("wgmma", "Hopper", "m64n128k32.f32.e4m3.e4m3"),
       source="cuBLASLt CUBLASLT_MATMUL_DESC_FAST_ACCUM / torch._scaled_mm(use_fast_accum=True): the wgmma "
              "accumulator carries all of K"),
    _k("hopper-promoted", ("wgmma", "Hopper", "m64n128k32.f32.e4m3.e4m3"), promote_every=128,
       source="CUTLASS sm90 FP8 GEMM (mma_promotion_interval = 4 wgmma k32), cuBLASLt without fast accum: "
              "FP32 add every 128 K, tensor scales in the epilogue"),
    _k("deepgemm-1x128-128x128", ("wgmma", "Hopper", "m64n128k32.f32.e4m3.e4m3"), promote_every=128,
       promote="fma", scales="promotion",
       source="DeepGEMM fp8_gemm: per 128-K block, final = fma(scale_a * scale_b, wgmma accum, final)"),
    _k("ada-fast-accum", ("mma", "Ada Lovelace", "m16n8k32.f32.e4m3.e4m3.f32"),
       source="sm_89 mma.sync FP8 chained over K"),
    _k("blackwell-fp8", ("tcgen05.mma", "Blackwell", "m128n128k32.kind::f8f6f4.f32.e4m3.e4m3"),
       source="sm_100 tcgen05.mma kind::f8f6f4 accumulating in tensor memory, tensor scales in the epilogue"),
    _k("blackwell-mxfp8", ("tcgen05.mma", "Blackwell", "m128n128k32.kind::mxf8f6f4.block32.f32.e4m3.e4m3.ue8m0"),
       scales="instruction", source="sm_100 tcgen05.mma kind::mxf8f6f4 block32 UE8M0 (MXFP8)"),
    _k("blackwell-nvfp4", ("tcgen05.mma", "Blackwell", "m128n128k64.kind::mxf4nvf4.block16.f32.e2m1.e2m1.ue4m3"),
       scales="instruction", source="sm_100 tcgen05.mma kind::mxf4nvf4 block16 UE4M3 (NVFP4), global scale "
                                    "as alpha in the epilogue"),
    _k("blackwell-mxfp4", ("tcgen05.mma", "Blackwell", "m128n128k64.kind::mxf4.block32.f32.e2m1.e2m1.ue8m0"),
       scales="instruction", source="sm_100 tcgen05.mma kind::mxf4 block32 UE8M0 (MXFP4)"),
    _k("cdna3", ("mfma", "CDNA3", "f32_32x32x16_fp8_fp8"),
       source="MI300 hipBLASLt-style: v_mfma_f32_32x32x16_fp8_fp8 chained over K in FP32 registers"),
)}


def get_kernel(kernel: Kernel | str | Mapping) -> Kernel:
    if isinstance(kernel, Kernel):
        return kernel
    if isinstance(kernel, Mapping):
        return Kernel.from_dict(kernel)
    if kernel not in KERNELS:
        raise InputTypeError(f"kernel: expected one of {', '.join(KERNELS)} or a Kernel, got {kernel!r}")
    return KERNELS[kernel]


# --------------------------------------------------------------------------------------------
# FP32 register arithmetic
# --------------------------------------------------------------------------------------------
def fma32(x: np.ndarray, y: np.ndarray, z: np.ndarray) -> np.ndarray:
    """fp32 fma(x, y, z) with one rounding: the float64 product is exact, the float64 sum is made
    round-to-odd (its error comes from TwoSum), and round-to-odd at 53 bits then RNE at 24 bits
    is the correctly rounded result (Boldo and Melquiond)."""
    p = x.astype(np.float64) * y.astype(np.float64)
    z64 = z.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        s = p + z64
        bv = s - p
        err = (p - (s - bv)) + (z64 - bv)
        bits = s.view(np.int64).copy()
        fix = np.isfinite(s) & (err != 0) & (bits & 1 == 0)
        toward = np.where((err > 0) == (s > 0), 1, -1)
        bits[fix] += toward[fix]
        return bits.view(np.float64).astype(np.float32)


def _round_out(acc32: np.ndarray, out_dtype: str) -> np.ndarray:
    if out_dtype == "float32":
        return acc32
    if out_dtype == "float16":
        return acc32.astype(np.float16)
    import ml_dtypes

    bits = acc32.view(np.uint32).astype(np.uint64)
    nan = np.isnan(acc32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    rounded[nan] = ((bits[nan] >> 16) | 0x40).astype(np.uint16)
    return rounded.view(ml_dtypes.bfloat16)


# --------------------------------------------------------------------------------------------
# The K loop
# --------------------------------------------------------------------------------------------
def _float32(x, what: str) -> np.ndarray:
    if type(x).__module__.startswith("torch"):
        x = x.detach().cpu().numpy()
    x = np.asarray(x)
    if x.dtype != np.float32:
        raise InputTypeError(f"{what}: expected float32, got {x.dtype}")
    return x


def _epilogue_scale(scale_a, scale_b, M: int, N: int) -> np.ndarray:
    if scale_a is None and scale_b is None:
        return np.ones((M, N), np.float32)
    sa, sb = _float32(scale_a, "scale_a"), _float32(scale_b, "scale_b")
    for what, s, ok in (("scale_a", sa, ((1,), (M, 1), (1, 1))), ("scale_b", sb, ((1,), (1, N), (1, 1)))):
        if s.shape not in ok and s.size != 1:
            per = "row (M, 1)" if what == "scale_a" else "column (1, N)"
            raise ShapeError(f"{what}: expected one scale or per-{per}, got shape {tuple(s.shape)}")
    sa = sa.reshape(-1, 1) if sa.size > 1 else sa.reshape(1, 1)
    sb = sb.reshape(1, -1) if sb.size > 1 else sb.reshape(1, 1)
    return np.broadcast_to(sa * sb, (M, N)).astype(np.float32)


def _check_scales_positive(s: np.ndarray, what: str):
    if not np.all(np.isfinite(s) & (s > 0)):
        raise ScaleError(f"{what}: scales must be finite and > 0")


def kernel_mm(a, b, scale_a=None, scale_b=None, *, kernel, out_dtype: str = "float32", bias=None, alpha=None):
    """out = epilogue(K loop of ``kernel``'s instruction over a (M, K) and b (K, N) codes).

    scale_a / scale_b by ``kernel.scales``: "epilogue": float32 per tensor, per row (M, 1) / per
    column (1, N) or None; "promotion": float32 blocks (M, ceil(K/128)) / (ceil(K/128),
    ceil(N/block_n)); "instruction": block-scale codes (M, K/block) / (K/block, N). ``alpha``: a
    float32 epilogue multiplier (e.g. NVFP4's global scale)."""
    k = get_kernel(kernel)
    ins = k.ins
    if out_dtype not in OUT_DTYPES:
        raise InputTypeError(f"out_dtype: expected one of {OUT_DTYPES}, got {out_dtype!r}")
    if ins.acc != "float32":
        raise SpecError(f"kernel {k.name!r}: kernels need an f32 accumulator instruction")
    A, B = as_codes(a, ins.a_fmt, "a"), as_codes(b, ins.b_fmt, "b")
    if A.ndim != 2 or B.ndim != 2 or A.shape[1] != B.shape[0]:
        raise ShapeError(f"a, b: expected (M, K) and (K, N), got {tuple(A.shape)} and {tuple(B.shape)}")
    (M, K), N = A.shape, B.shape[1]
    Kp = -(-K // ins.k) * ins.k
    SA = SB = None
    if k.scales == "instruction":
        nb = Kp // ins.block
        SA, SB = as_codes(scale_a, ins.scale_fmt, "scale_a"), as_codes(scale_b, ins.scale_fmt, "scale_b")
        if SA.shape != (M, -(-K // ins.block)) or SB.shape != (-(-K // ins.block), N):
            raise ShapeError(f"scale_a, scale_b: expected {(M, -(-K // ins.block))} and {(-(-K // ins.block), N)}, "
                             f"got {tuple(SA.shape)} and {tuple(SB.shape)}")
        one = 127 if ins.scale_type == "ue8m0" else 0x38
        SA = np.pad(SA, ((0, 0), (0, nb - SA.shape[1])), constant_values=one)
        SB = np.pad(SB, ((0, nb - SB.shape[0]), (0, 0)), constant_values=one)
        epi = np.ones((M, N), np.float32)
    elif k.scales == "promotion":
        sa, sb = _float32(scale_a, "scale_a"), _float32(scale_b, "scale_b")
        nkb = -(-K // k.promote_every)
        if sa.shape != (M, nkb) or sb.shape != (nkb, -(-N // k.block_n)):
            raise ShapeError(f"scale_a, scale_b: expected {(M, nkb)} and {(nkb, -(-N // k.block_n))}, "
                             f"got {tuple(sa.shape)} and {tuple(sb.shape)}")
        _check_scales_positive(sa, "scale_a")
        _check_scales_positive(sb, "scale_b")
        sb_full = np.repeat(sb, k.block_n, axis=1)[:, :N]
        epi = np.ones((M, N), np.float32)
    else:
        epi = _epilogue_scale(scale_a, scale_b, M, N)
    if alpha is not None:
        epi = (epi * _float32(np.asarray(alpha, np.float32), "alpha").reshape(())).astype(np.float32)
    A = np.pad(A, ((0, 0), (0, Kp - K)))
    B = np.pad(B, ((0, Kp - K), (0, 0)))
    part = max(ins.k, -(-Kp // ins.k // k.split_k) * ins.k)
    total = np.zeros((M, N), np.float32) if Kp == 0 else None  # K = 0: no instruction runs, the sum is 0
    for p0 in range(0, Kp, part):
        p1 = min(p0 + part, Kp)
        acc = _native_part(k, A, B, SA, SB, p0, p1, sa if k.scales == "promotion" else None,
                           sb_full if k.scales == "promotion" else None)
        if acc is not None:
            with np.errstate(over="ignore", invalid="ignore"):
                total = acc if total is None else (total + acc).astype(np.float32)
            continue
        step = k.promote_every or (p1 - p0)
        for i0 in range(p0, p1, step):
            i1 = min(i0 + step, p1)
            d = _tensor_core(ins, A, B, SA, SB, i0, i1)
            if acc is None and k.promote_every is None:
                acc = d
                continue
            if k.scales == "promotion":
                blk = i0 // k.promote_every
                s = (sa[:, blk:blk + 1] * sb_full[blk:blk + 1, :]).astype(np.float32)
            else:
                s = np.float32(1)
            if acc is None:
                acc = np.zeros((M, N), np.float32)
            with np.errstate(over="ignore", invalid="ignore"):
                acc = fma32(d, np.broadcast_to(s, d.shape), acc) if k.promote == "fma" else \
                    (acc + (d * s).astype(np.float32)).astype(np.float32)
        with np.errstate(over="ignore", invalid="ignore"):
            total = acc if total is None else (total + acc).astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        out = (total * epi).astype(np.float32)
        if bias is not None:
            out = (out + _float32(bias, "bias").reshape(1, N)).astype(np.float32)
    return _round_out(out, out_dtype)


def _native_part(k: Kernel, A, B, SA, SB, p0: int, p1: int, sa, sb_full) -> np.ndarray | None:
    """K range [p0, p1) of the K loop in C (promotions included), or None where it does not apply."""
    ins = k.ins
    bl = ins.block
    psa = psb = None
    if sa is not None:
        b0 = p0 // k.promote_every
        b1 = b0 - (-(p1 - p0) // k.promote_every)
        psa = np.ascontiguousarray(sa[:, b0:b1], np.float32)
        psb = np.ascontiguousarray(sb_full[b0:b1], np.float32)
    return native.promoted_matmul(ins, A[:, p0:p1], B[p0:p1], None if SA is None else SA[:, p0 // bl:p1 // bl],
                                  None if SB is None else SB[p0 // bl:p1 // bl], promote_every=k.promote_every,
                                  psa=psa, psb=psb, fma=k.promote == "fma")


def _tensor_core(ins, A, B, SA, SB, k0: int, k1: int) -> np.ndarray:
    """The instruction chained over K in [k0, k1) from C = 0, tiled over N to bound memory."""
    M, N = A.shape[0], B.shape[1]
    d = np.zeros((M, N), np.float32)
    bl = ins.block
    fast = native.chained_matmul(ins, A[:, k0:k1], B[k0:k1], d, None if SA is None else SA[:, k0 // bl:k1 // bl],
                               None if SB is None else SB[k0 // bl:k1 // bl])
    if fast is not None:
        return fast
    width = max(1, min(N, _TILE // max(1, M * (ins.datapath.L + 1))))
    for j0 in range(0, N, width):
        j1 = min(j0 + width, N)
        a = A[:, None, k0:k1]
        b = B[k0:k1, j0:j1].T[None, :, :]
        if SA is not None:
            d[:, j0:j1] = dot_add(ins, a, b, d[:, j0:j1], SA[:, None, k0 // bl:k1 // bl],
                                  SB[k0 // bl:k1 // bl, j0:j1].T[None, :, :])
        else:
            d[:, j0:j1] = dot_add(ins, a, b, d[:, j0:j1])
    return d
