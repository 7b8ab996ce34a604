"""Tensor-core instructions by their ISA names, and the datapath each one uses.

An instruction is named the way its ISA (and MMA-Sim) spells it: ``("wgmma", "hopper",
"m64n8k32.f32.e4m3.e4m3")``, ``("tcgen05.mma", "blackwell",
"m128n8k32.kind::mxf8f6f4.block32.f32.e4m3.e4m3.ue8m0")``, ``("mfma", "cdna3",
"f32_16x16x32_fp8_fp8")``. ``instruction(op, arch, shape_and_type)`` parses and validates the
name and attaches its ``Datapath``: the published model's parameters (Xie et al., MMA-Sim,
arXiv 2511.10909; Khattak & Mikaitis, arXiv 2512.07004). Only the FP8/FP6/FP4 and block-scaled
instructions are modelled; fp16/bf16/tf32/fp64 instructions are out of scope.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache

from ..errors import InputTypeError
from ..formats import FORMATS, FloatFormat

# ISA element type -> fp8ref format; AMD spells the fnuz formats fp8/bf8
NV_TYPES = {"e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2", "e3m2": "float6_e3m2fn",
            "e2m3": "float6_e2m3fn", "e2m1": "float4_e2m1fn"}
AMD_TYPES = {"fp8": "float8_e4m3fnuz", "bf8": "float8_e5m2fnuz"}
# block-scale types: ue8m0 is float8_e8m0fnu; ue4m3 is e4m3 with the sign bit ignored
SCALE_TYPES = {"ue8m0": "float8_e8m0fnu", "ue4m3": "float8_e4m3fn"}
F8F6F4 = ("e5m2", "e4m3", "e3m2", "e2m3", "e2m1")
ACC_DTYPES = {"f32": "float32", "f16": "float16"}

ARCHS = {"volta": "Volta", "turing": "Turing", "ampere": "Ampere", "ada": "Ada Lovelace",
         "adalovelace": "Ada Lovelace", "hopper": "Hopper", "blackwell": "Blackwell",
         "rtxblackwell": "RTX Blackwell", "cdna1": "CDNA1", "cdna2": "CDNA2", "cdna3": "CDNA3"}
OPS = ("mma", "wgmma", "tcgen05.mma", "mfma")


@dataclass(frozen=True)
class Datapath:
    """How one instruction step adds products into the accumulator.

    ``fused``  (NVIDIA): every product (with its block scales) and C are aligned to the largest
               exponent among them and truncated to ``F`` fraction bits, summed exactly, then
               normalised by ``output`` ("rz-f32", "rz-e8m13": round toward zero to 23/13 fraction
               bits; "rne-f16"). ``L`` elements per step; a zero term's exponent is ``e_zero``.
    ``grouped``(NVIDIA mxf4/mxf4nvf4): groups of ``G`` products are summed exactly first, each
               group sum times its scales is one term of a ``fused`` step.
    ``pairwise`` (AMD CDNA3 FP8): even and odd products are fused separately with ``F`` bits,
               combined by floor to ``F``, added to C (floor to ``F2 + 1`` / ``F`` bits), floored
               to ``F2`` fraction bits and rounded to nearest FP32.
    """

    family: str
    F: int
    output: str
    L: int
    e_zero: int = 0
    G: int = 1
    F2: int = 0


@dataclass(frozen=True)
class Instruction:
    op: str
    arch: str
    shape_and_type: str
    m: int
    n: int
    k: int
    a_fmt: FloatFormat
    b_fmt: FloatFormat
    acc: str  # accumulator / result dtype: "float32" or "float16"
    datapath: Datapath
    kind: str | None = None
    scale_fmt: FloatFormat | None = None
    scale_type: str | None = None  # ISA spelling: "ue8m0" or "ue4m3"
    block: int | None = None  # K elements per block scale

    @property
    def name(self) -> str:
        return f"{self.op} {self.arch} {self.shape_and_type}"


def _arch(arch: str) -> str:
    key = re.sub(r"[\s_\-]", "", str(arch)).lower()
    if key not in ARCHS:
        raise InputTypeError(f"arch: expected one of {', '.join(sorted(set(ARCHS.values())))}, got {arch!r}")
    return ARCHS[key]


def _mnk(shape: str, what: str) -> tuple[int, int, int]:
    match = re.fullmatch(r"m(\d+)n(\d+)k(\d+)", shape)
    if not match:
        raise InputTypeError(f"{what}: expected a shape like m64n8k32, got {shape!r}")
    return tuple(int(g) for g in match.groups())


def _nv_fused(arch: str, acc: str, F: int, L: int) -> Datapath:
    f16 = acc == "float16"
    e_zero = {"Ada Lovelace": (-20, -132)}.get(arch, (-21, -133))[0 if f16 else 1]
    out = "rne-f16" if f16 else ("rz-e8m13" if F == 13 else "rz-f32")
    return Datapath("fused", F, out, L, e_zero)


def _bad(op, arch, s, why) -> InputTypeError:
    return InputTypeError(f"{op} {arch} {s!r}: {why}")


def instruction(op: str, arch: str, shape_and_type: str) -> Instruction:
    """The modelled instruction ``op`` on ``arch`` named ``shape_and_type`` (ISA spelling)."""
    if all(type(x) is str for x in (op, arch, shape_and_type)):
        return _parsed(op, arch, shape_and_type)
    return _parse(op, arch, shape_and_type)  # says what is wrong


@cache  # one frozen record per name: parsing is most of a small instruction's call
def _parsed(op: str, arch: str, shape_and_type: str) -> Instruction:
    return _parse(op, arch, shape_and_type)


def _parse(op: str, arch: str, shape_and_type: str) -> Instruction:
    if op not in OPS:
        raise InputTypeError(f"op: expected one of {', '.join(OPS)}, got {op!r}")
    arch = _arch(arch)
    s = shape_and_type
    if op == "mfma":
        return _mfma(arch, s)
    parts = s.split(".")
    m, n, k = _mnk(parts[0], f"{op} shape_and_type")
    kind = None
    if len(parts) > 1 and parts[1].startswith("kind::"):
        kind = parts[1].removeprefix("kind::")
        parts = [parts[0]] + parts[2:]
    block = None
    if len(parts) > 1 and parts[1].startswith("block"):
        block = int(parts[1].removeprefix("block") or 0)
        parts = [parts[0]] + parts[2:]
    if op == "mma" and len(parts) in (5, 6):  # mma spells C: d.a.b.c[.scale]
        if parts[4] != parts[1]:
            raise _bad(op, arch, s, f"C type {parts[4]} must equal D type {parts[1]}")
        parts = parts[:4] + parts[5:]
    if len(parts) not in (4, 5) or parts[1] not in ACC_DTYPES:
        raise _bad(op, arch, s, "expected shape[.kind::K][.blockB].dtype.atype.btype[.ctype][.stype]")
    d_type, a_type, b_type = parts[1:4]
    s_type = parts[4] if len(parts) == 5 else None
    for t in (a_type, b_type):
        if t not in NV_TYPES:
            raise _bad(op, arch, s, f"element type {t!r} is not modelled (FP8/FP6/FP4 only: {', '.join(NV_TYPES)})")
    acc = ACC_DTYPES[d_type]
    fp8_only = a_type in ("e4m3", "e5m2") and b_type in ("e4m3", "e5m2")
    scaled = s_type is not None or block is not None
    if scaled:
        return _block_scaled(op, arch, s, m, n, k, kind, block, acc, a_type, b_type, s_type)
    if op == "wgmma":
        ok = arch == "Hopper" and m == 64 and n % 8 == 0 and 8 <= n <= 256 and k == 32 and kind is None and fp8_only
        dp = _nv_fused(arch, acc, 13, 32)
    elif op == "tcgen05.mma":
        ok = arch == "Blackwell" and m in (64, 128) and n % 8 == 0 and 8 <= n <= 256 and k == 32 \
            and kind == "f8f6f4"
        dp = _nv_fused(arch, acc, 25, 32)
    else:  # mma
        if kind == "f8f6f4":
            ok = arch == "RTX Blackwell" and (m, n, k) == (16, 8, 32)
            dp = _nv_fused(arch, acc, 25, 32)
        else:
            ok = arch in ("Ada Lovelace", "RTX Blackwell") and (m, n) == (16, 8) and k in (16, 32) \
                and kind is None and fp8_only
            dp = _nv_fused(arch, acc, 13, 16) if arch == "Ada Lovelace" else _nv_fused(arch, acc, 25, 32)
    if not ok:
        raise _bad(op, arch, s, "not an FP8/FP6/FP4 instruction of this architecture (see fp8ref.hardware.names())")
    return Instruction(op, arch, s, m, n, k, FORMATS[NV_TYPES[a_type]], FORMATS[NV_TYPES[b_type]], acc, dp, kind)


def _block_scaled(op, arch, s, m, n, k, kind, block, acc, a_type, b_type, s_type) -> Instruction:
    ok = acc == "float32" and s_type in SCALE_TYPES
    if op == "tcgen05.mma":
        ok = ok and arch == "Blackwell" and m == 128 and n % 8 == 0 and 8 <= n <= 256
    elif op == "mma":
        ok = ok and arch == "RTX Blackwell" and (m, n) == (16, 8)
    else:
        ok = False
    if kind == "mxf8f6f4":
        ok = ok and k == 32 and block == 32 and s_type == "ue8m0"
        dp = Datapath("fused", 25, "rz-f32", 32, -133)
    elif kind in ("mxf4", "mxf4nvf4"):
        ok = ok and k == 64 and a_type == b_type == "e2m1"
        if kind == "mxf4":
            ok = ok and block == 32 and s_type == "ue8m0"
        else:
            ok = ok and (block, s_type) in ((32, "ue8m0"), (16, "ue8m0"), (16, "ue4m3"))
        dp = Datapath("grouped", 35, "rz-f32", 64, -139, G=16)
    else:
        ok = False
    if not ok:
        raise _bad(op, arch, s, "not a block-scaled instruction of this architecture (see fp8ref.hardware.names())")
    return Instruction(op, arch, s, m, n, k, FORMATS[NV_TYPES[a_type]], FORMATS[NV_TYPES[b_type]], acc, dp, kind,
                       FORMATS[SCALE_TYPES[s_type]], s_type, block)


def _mfma(arch: str, s: str) -> Instruction:
    match = re.fullmatch(r"f32_(\d+)x(\d+)x(\d+)_(fp8|bf8)_(fp8|bf8)", s)
    if arch != "CDNA3" or not match or tuple(int(g) for g in match.groups()[:3]) not in ((16, 16, 32), (32, 32, 16)):
        raise _bad("mfma", arch, s, "not an FP8 MFMA of CDNA3 (f32_16x16x32_* or f32_32x32x16_* with fp8/bf8)")
    m, n, k = (int(g) for g in match.groups()[:3])
    a, b = (FORMATS[AMD_TYPES[t]] for t in match.groups()[3:])
    return Instruction("mfma", arch, s, m, n, k, a, b, "float32", Datapath("pairwise", 24, "rne-f32", 16, F2=31))


def names(all_n: bool = False) -> Iterator[tuple[str, str, str]]:
    """Every modelled (op, arch, shape_and_type); N is 8 only unless ``all_n`` (8..256 by 8)."""
    ns = range(8, 257, 8) if all_n else (8,)
    fp8 = ("e5m2", "e4m3")
    for k in (32, 16):
        for d in ACC_DTYPES:
            for a in fp8:
                for b in fp8:
                    for arch in ("Ada Lovelace", "RTX Blackwell"):
                        yield "mma", arch, f"m16n8k{k}.{d}.{a}.{b}.{d}"
    for d in ACC_DTYPES:
        for a in F8F6F4:
            for b in F8F6F4:
                yield "mma", "RTX Blackwell", f"m16n8k32.kind::f8f6f4.{d}.{a}.{b}.{d}"
    for a in F8F6F4:
        for b in F8F6F4:
            yield "mma", "RTX Blackwell", f"m16n8k32.kind::mxf8f6f4.block32.f32.{a}.{b}.f32.ue8m0"
    yield "mma", "RTX Blackwell", "m16n8k64.kind::mxf4.block32.f32.e2m1.e2m1.f32.ue8m0"
    for blk, st in ((32, "ue8m0"), (16, "ue8m0"), (16, "ue4m3")):
        yield "mma", "RTX Blackwell", f"m16n8k64.kind::mxf4nvf4.block{blk}.f32.e2m1.e2m1.f32.{st}"
    for n in ns:
        for d in ACC_DTYPES:
            for a in fp8:
                for b in fp8:
                    yield "wgmma", "Hopper", f"m64n{n}k32.{d}.{a}.{b}"
        for m in (64, 128):
            for d in ACC_DTYPES:
                for a in F8F6F4:
                    for b in F8F6F4:
                        yield "tcgen05.mma", "Blackwell", f"m{m}n{n}k32.kind::f8f6f4.{d}.{a}.{b}"
        for a in F8F6F4:
            for b in F8F6F4:
                yield "tcgen05.mma", "Blackwell", f"m128n{n}k32.kind::mxf8f6f4.block32.f32.{a}.{b}.ue8m0"
        yield "tcgen05.mma", "Blackwell", f"m128n{n}k64.kind::mxf4.block32.f32.e2m1.e2m1.ue8m0"
        for blk, st in ((32, "ue8m0"), (16, "ue8m0"), (16, "ue4m3")):
            yield "tcgen05.mma", "Blackwell", f"m128n{n}k64.kind::mxf4nvf4.block{blk}.f32.e2m1.e2m1.{st}"
    for shape in ("16x16x32", "32x32x16"):
        for a in AMD_TYPES:
            for b in AMD_TYPES:
                yield "mfma", "CDNA3", f"f32_{shape}_{a}_{b}"
