"""The C datapaths (fp8ref/_csrc/hw.c: fused, pairwise, a kernel's promotion) give the numpy
model's bytes on every instruction they serve: random codes with zeros, C across the whole fp32
range (subnormals, -0), every UE8M0 scale short of NaN (overflow to Inf included), K chained over
many steps, column counts that leave partial vector blocks, batches, and every kernel preset.
(test_fdpa_oracle.py checks mma(), and so these loops, against the Fraction oracle.)"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fp8ref._native import hw_job, kernels, kernels_available
from fp8ref.hardware import KERNELS, instruction, kernel_mm, names, native
from fp8ref.hardware.instructions import dot_add
from fp8ref.hardware.native import applies, chained_matmul

native_run = native._run

pytestmark = pytest.mark.skipif(not kernels_available(), reason="C kernels not built")
SERVED = [n for n in names() if applies(instruction(*n))]


def _finite(fmt, rng, shape, zeros):
    fin = np.array([c for c in range(fmt.n_codes) if fmt.exact_value(c) is not None], np.uint8)
    x = rng.choice(fin, shape)
    x[rng.random(shape) < zeros] = 0
    return x


def _c_values(rng, shape, kind, acc="float32"):
    f16 = acc == "float16"
    C = rng.standard_normal(shape)
    if kind == "wide":
        C = C * 2.0 ** (rng.integers(-26, 15, C.shape) if f16 else rng.integers(-150, 100, C.shape))
    elif kind == "zero":
        C = C * (rng.random(C.shape) < 0.1) * (1e-7 if f16 else 1e-42)
        C.flat[0] = -0.0
    elif kind == "huge":  # near the top of the accumulator: the first step's sum can overflow to Inf
        C = np.sign(C) * (65000.0 if f16 else 3.3e38)
    return C.astype(acc)


def _scales(fmt, rng, lo_hi, shape):
    """Finite scale codes in [lo, hi) (every one of them when the range holds no finite code)."""
    codes = [c for c in range(*lo_hi) if fmt.exact_value(c) is not None] or \
        [c for c in range(256) if fmt.exact_value(c) is not None]
    return rng.choice(np.array(codes, np.uint8), shape)


def _numpy(ins, A, B, C, SA, SB):
    return dot_add(ins, A[:, None, :], B.T[None], C, None if SA is None else SA[:, None, :],
                   None if SB is None else SB.T[None])


def test_serves_the_fp8_and_mx_instructions():
    kinds = {(op, s.split(".")[1] if "kind" in s else "") for op, _, s in SERVED}
    assert ("wgmma", "") in kinds and ("tcgen05.mma", "kind::mxf8f6f4") in kinds and ("mma", "") in kinds
    assert applies(instruction("mfma", "CDNA3", "f32_16x16x32_fp8_fp8"))  # the pairwise loop
    assert applies(instruction("wgmma", "Hopper", "m64n8k32.f16.e4m3.e4m3"))  # f16 accumulators
    assert applies(instruction("tcgen05.mma", "Blackwell", "m128n8k64.kind::mxf4nvf4.block16.f32.e2m1.e2m1.ue4m3"))
    assert SERVED == list(names())  # every modelled instruction has its C loop


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(SERVED), st.integers(0, 2**32 - 1), st.sampled_from([0.0, 0.3, 1.0]),
       st.sampled_from(["normal", "wide", "zero", "huge"]), st.sampled_from([(0, 255), (100, 150), (0, 20)]),
       st.sampled_from([1, 3]))
def test_native_equals_numpy(name, seed, zeros, c_kind, scale_range, steps):
    """One instruction, or K chained over 3 instructions: a step that overflows to Inf feeds the
    next step an Inf C (huge C, or scales up to 2**254)."""
    ins = instruction(*name)
    K = ins.k * steps
    rng = np.random.default_rng(seed)
    A, B = _finite(ins.a_fmt, rng, (ins.m, K), zeros), _finite(ins.b_fmt, rng, (K, ins.n), zeros)
    C = _c_values(rng, (ins.m, ins.n), c_kind, ins.acc)  # zeros = 1.0: C alone, subnormal C included
    SA = SB = None
    if ins.scale_fmt is not None:
        nb = K // ins.block
        SA = _scales(ins.scale_fmt, rng, scale_range, (ins.m, nb))
        SB = _scales(ins.scale_fmt, rng, scale_range, (nb, ins.n))
    got = chained_matmul(ins, A, B, C, SA, SB)
    if K % min(K, ins.datapath.L):  # m16n8k16 x 3 on a 32-element datapath: a partial step
        assert got is None
        return
    u = np.uint32 if ins.acc == "float32" else np.uint16
    assert np.array_equal(got.view(u), _numpy(ins, A, B, C, SA, SB).view(u))


def _probe_instructions():
    """One small instruction per (loop, element or scale format, sign rule) the loops read."""
    out = {}
    for n in names():
        ins = instruction(*n)
        if ins.m * ins.n > 16 * 8 * 16:
            continue
        key = (ins.datapath.family, ins.a_fmt.name, ins.b_fmt.name, ins.scale_type)
        out.setdefault(key, ins)
    return list(out.values())


def _want(fmt, code, ignore_sign=False):
    if code >= fmt.n_codes:
        return native.NOT_A_CODE
    c = code & ~fmt.sign_mask & 0xFF if ignore_sign else code
    return 0 if fmt.exact_value(c) is not None else native.NON_FINITE


@pytest.mark.parametrize("ins", _probe_instructions(), ids=lambda i: i.name)
def test_the_loops_flag_every_non_finite_or_invalid_code(ins):
    """Every byte 0..255 as an A code (first, last), a B code (last) and a scale code (first of
    scale_a, last of scale_b): the C loop flags NaN/Inf (NON_FINITE; UE4M3 reads its sign bit as 0)
    and bytes past a 4/6-bit format's codes (NOT_A_CODE), and nothing else; a NaN/Inf C too."""
    rng = np.random.default_rng(7)
    A, B = _finite(ins.a_fmt, rng, (ins.m, ins.k), 0.2), _finite(ins.b_fmt, rng, (ins.k, ins.n), 0.2)
    C = _c_values(rng, (ins.m, ins.n), "normal", ins.acc)
    SA = SB = None
    if ins.scale_fmt is not None:
        nb = ins.k // ins.block
        SA = _scales(ins.scale_fmt, rng, (120, 134), (ins.m, nb))
        SB = _scales(ins.scale_fmt, rng, (120, 134), (nb, ins.n))
    ue4m3 = ins.scale_type == "ue4m3"

    def flags(A=A, B=B, C=C, SA=SA, SB=SB):
        D = np.array(C, np.float32)
        return native_run(ins, A, B, D, SA, SB)

    assert flags() == 0
    for code in range(256):
        for what, (x, i) in {"A first": (A, (0, 0)), "A last": (A, (-1, -1)), "B last": (B, (-1, -1))}.items():
            x2 = x.copy()
            x2[i] = code
            got = flags(**{what[0]: x2})
            assert got == _want(ins.a_fmt if x is A else ins.b_fmt, code), f"{what} {code:#04x}"
        if SA is not None:
            for what, (x, i) in {"SA": (SA, (0, 0)), "SB": (SB, (-1, -1))}.items():
                x2 = x.copy()
                x2[i] = code
                assert flags(**{what: x2}) == _want(ins.scale_fmt, code, ue4m3), f"{what} {code:#04x}"
    for special in (np.nan, np.inf, -np.inf):
        C2 = C.copy()
        C2[-1, -1] = special
        assert flags(C=C2) == native.NON_FINITE
        assert chained_matmul(ins, A, B, C2, SA, SB) is None


def test_batches_and_non_finite_fall_back():
    ins = instruction("wgmma", "Hopper", "m64n16k32.f32.e4m3.e4m3")
    rng = np.random.default_rng(1)
    A, B = _finite(ins.a_fmt, rng, (5, 64, 32), 0.1), _finite(ins.b_fmt, rng, (5, 32, 16), 0.1)
    C = rng.standard_normal((5, 64, 16)).astype(np.float32)
    got = chained_matmul(ins, A, B, C)
    for i in range(5):
        assert np.array_equal(got[i].view(np.uint32), _numpy(ins, A[i], B[i], C[i], None, None).view(np.uint32))
    A[0, 0, 0] = 0x7F  # NaN: the numpy model handles specials
    assert chained_matmul(ins, A, B, C) is None
    C[1, 0, 0] = np.inf
    assert chained_matmul(ins, A[1:], B[1:], C[1:]) is None


MFMA = [n for n in names() if n[0] == "mfma"]


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(MFMA), st.integers(0, 2**32 - 1), st.sampled_from([0.0, 0.3, 0.9]),
       st.sampled_from(["normal", "wide", "zero", "huge"]), st.sampled_from([1, 3]), st.sampled_from([16, 40, 136]))
def test_pairwise_native_equals_numpy(name, seed, zeros, c_kind, steps, n):
    """CDNA3 MFMA chained over several steps, n columns (partial vector blocks and C units)."""
    ins = instruction(*name)
    rng = np.random.default_rng(seed)
    K = ins.datapath.L * steps
    A, B = _finite(ins.a_fmt, rng, (ins.m, K), zeros), _finite(ins.b_fmt, rng, (K, n), zeros)
    C = _c_values(rng, (ins.m, n), c_kind)
    got = chained_matmul(ins, A, B, C)
    assert np.array_equal(got.view(np.uint32), _numpy(ins, A, B, C, None, None).view(np.uint32))


GROUPED = [n for n in names() if instruction(*n).datapath.family == "grouped"]


@settings(max_examples=80, deadline=None)
@given(st.sampled_from(GROUPED), st.integers(0, 2**32 - 1), st.sampled_from([0.0, 0.3, 0.9]),
       st.sampled_from(["normal", "wide", "zero", "huge"]), st.sampled_from([(0, 255), (100, 150), (0, 20)]),
       st.sampled_from([1, 3]), st.sampled_from([8, 40, 136, 256]), st.booleans())
def test_grouped_vector_and_portable_passes_equal_numpy(name, seed, zeros, c_kind, scale_range, steps, n, portable):
    """MXFP4 / NVFP4 over n columns (partial vectors and chunks), K chained, scales up to overflow:
    the AVX-512 alignment pass (where the CPU has it) and the portable one (FP8REF_NO_AVX512) both
    give the numpy model's bytes."""
    ins = instruction(*name)
    rng = np.random.default_rng(seed)
    K = ins.k * steps
    A, B = _finite(ins.a_fmt, rng, (ins.m, K), zeros), _finite(ins.b_fmt, rng, (K, n), zeros)
    C = _c_values(rng, (ins.m, n), c_kind)
    SA = _scales(ins.scale_fmt, rng, scale_range, (ins.m, K // ins.block))
    SB = _scales(ins.scale_fmt, rng, scale_range, (K // ins.block, n))
    with pytest.MonkeyPatch.context() as mp:
        if portable:
            mp.setenv("FP8REF_NO_AVX512", "1")
        got = chained_matmul(ins, A, B, C, SA, SB)
    assert np.array_equal(got.view(np.uint32), _numpy(ins, A, B, C, SA, SB).view(np.uint32))


def _avx512_loop_serves(ins, K: int = 4096) -> bool:
    """fp8ref_hw_fast_prepare (_csrc/hw_avx512.c): whether the AVX-512 fused loop takes this
    instruction's whole 128-column units on this CPU."""
    job = hw_job.from_buffer_copy(native._template(ins)[0])
    job.K, job.L = K, min(K, ins.datapath.L)
    return bool(kernels().fp8ref_hw_fast_prepare(ctypes.byref(job), ctypes.create_string_buffer(4096)))


FP8_F32 = [n for n in SERVED if instruction(*n).datapath.family == "fused" and instruction(*n).acc == "float32"
           and instruction(*n).scale_fmt is None and instruction(*n).a_fmt.bits == instruction(*n).b_fmt.bits == 8]
AVX512_FUSED = [n for n in FP8_F32 if instruction(*n).datapath.F <= 13]


def test_the_avx512_fused_loop_serves_hopper_and_ada_fp8_only():
    """F <= 13, FP8 operands, no block scales, f32 accumulators: the Hopper / Ada FP8 instructions;
    not Blackwell (F = 25), f16 accumulators or block-scaled kinds. Without the CPU's AVX-512 VNNI
    and VBMI the loop serves none (then the portable loops give the same bytes)."""
    serves = {n: _avx512_loop_serves(instruction(*n)) for n in SERVED}
    if not any(serves.values()):
        pytest.skip("this CPU lacks AVX-512 VNNI / VBMI: the portable loops serve every unit")
    assert AVX512_FUSED and {n for n, ok in serves.items() if ok} == set(AVX512_FUSED)
    assert any(n[1] == "Hopper" for n in AVX512_FUSED) and any(n[1] == "Ada Lovelace" for n in AVX512_FUSED)


@settings(max_examples=120, deadline=None)
@given(st.sampled_from(AVX512_FUSED or FP8_F32), st.integers(0, 2**32 - 1), st.sampled_from([0.0, 0.3, 0.9]),
       st.sampled_from(["normal", "wide", "zero", "huge", "edge"]), st.sampled_from([1, 3, 8]),
       st.sampled_from([128, 256, 300]), st.sampled_from([1, 3, 7]), st.booleans())
def test_avx512_and_portable_fused_loops_equal_numpy(name, seed, zeros, c_kind, steps, n, m, portable):
    """Whole 128-column units (and a partial one at n = 300) over K chained: the AVX-512 loop's
    magic-number terms, int8 exponents and sign-split K give the numpy model's bytes, as the
    portable loop does (FP8REF_NO_AVX512). C across the fp32 range: subnormal, -0, huge (its units
    go to the portable loop), and |C| either side of 2**100, where the AVX-512 loop hands a unit over."""
    ins = instruction(*name)
    rng = np.random.default_rng(seed)
    K = ins.datapath.L * steps
    A, B = _finite(ins.a_fmt, rng, (m, K), zeros), _finite(ins.b_fmt, rng, (K, n), zeros)
    if c_kind == "edge":
        C = (np.sign(rng.standard_normal((m, n))) * np.float32(2.0 ** 100)).astype(np.float32)
        C.view(np.uint32)[rng.random((m, n)) < 0.5] -= 1  # just below 2**100
    else:
        C = _c_values(rng, (m, n), c_kind)
    with pytest.MonkeyPatch.context() as mp:
        if portable:
            mp.setenv("FP8REF_NO_AVX512", "1")
        got = chained_matmul(ins, A, B, C)
    assert np.array_equal(got.view(np.uint32), _numpy(ins, A, B, C, None, None).view(np.uint32))


def _kernel_operands(k, rng, M, K, N):
    ins = k.ins
    A, B = _finite(ins.a_fmt, rng, (M, K), 0.2), _finite(ins.b_fmt, rng, (K, N), 0.2)
    if k.scales == "instruction":
        nb = -(-K // ins.block)
        return A, B, _scales(ins.scale_fmt, rng, (110, 140), (M, nb)), _scales(ins.scale_fmt, rng, (110, 140), (nb, N))
    if k.scales == "promotion":
        nkb = -(-K // k.promote_every)
        return A, B, rng.uniform(1e-3, 4, (M, nkb)).astype(np.float32), \
            rng.uniform(1e-3, 4, (nkb, -(-N // k.block_n))).astype(np.float32)
    return A, B, None, None


@pytest.mark.parametrize("name", list(KERNELS) + ["split-k", "nvfp4-promoted", "mxfp4-fma"])
def test_kernel_native_equals_numpy(name, monkeypatch):
    """Every kernel preset (and a split-K promoted one, and grouped MXFP4/NVFP4 instructions promoted
    to FP32) in C against the numpy K loop: K not a multiple of the promotion interval, N not a
    multiple of the C loops' column blocks."""
    from fp8ref.hardware import Kernel

    if name == "split-k":
        k = Kernel("split", ("wgmma", "hopper", "m64n8k32.f32.e5m2.e4m3"), promote_every=64, split_k=3)
    elif name == "nvfp4-promoted":
        k = Kernel(name, ("tcgen05.mma", "blackwell", "m128n8k64.kind::mxf4nvf4.block16.f32.e2m1.e2m1.ue4m3"),
                   promote_every=128, scales="instruction", split_k=2)
    elif name == "mxfp4-fma":
        k = Kernel(name, ("tcgen05.mma", "blackwell", "m128n8k64.kind::mxf4.block32.f32.e2m1.e2m1.ue8m0"),
                   promote_every=64, promote="fma", scales="instruction")
    else:
        k = KERNELS[name]
    rng = np.random.default_rng(len(name))
    A, B, sa, sb = _kernel_operands(k, rng, 70, 352, 150)
    calls = []
    monkeypatch.setattr(native, "_run", lambda *a, **kw: calls.append(native_run(*a, **kw)) or calls[-1])
    got = kernel_mm(A, B, sa, sb, kernel=k)
    assert bool(calls) == applies(k.ins)  # the C loops ran wherever they apply
    assert not any(calls)  # and their results stood (finite operands and scales)
    monkeypatch.setenv("FP8REF_NO_KERNELS", "1")
    want = kernel_mm(A, B, sa, sb, kernel=k)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
