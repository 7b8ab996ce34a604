"""The C datapaths (fp8ref/_kernels_hw.c: fused, pairwise, a kernel's promotion) give the numpy
model's bytes on every instruction they serve: random codes with zeros, C across the whole fp32
range (subnormals, -0), every UE8M0 scale short of NaN (overflow to Inf included), K chained over
many steps, column counts that leave partial vector blocks, batches, and every kernel preset.
(test_fdpa_oracle.py checks mma(), and so these loops, against the Fraction oracle.)"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fp8ref._native import kernels_available
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


def _c_values(rng, shape, kind):
    C = rng.standard_normal(shape)
    if kind == "wide":
        C = C * 2.0 ** rng.integers(-150, 100, C.shape)
    elif kind == "zero":
        C = C * (rng.random(C.shape) < 0.1) * 1e-42
        C.flat[0] = -0.0
    elif kind == "huge":  # near the top of fp32: the first step's sum can overflow to Inf
        C = np.sign(C) * 3.3e38
    return C.astype(np.float32)


def _numpy(ins, A, B, C, SA, SB):
    return dot_add(ins, A[:, None, :], B.T[None], C, None if SA is None else SA[:, None, :],
                   None if SB is None else SB.T[None])


def test_serves_the_fp8_and_mx_instructions():
    kinds = {(op, s.split(".")[1] if "kind" in s else "") for op, _, s in SERVED}
    assert ("wgmma", "") in kinds and ("tcgen05.mma", "kind::mxf8f6f4") in kinds and ("mma", "") in kinds
    assert applies(instruction("mfma", "CDNA3", "f32_16x16x32_fp8_fp8"))  # the pairwise loop
    assert not applies(instruction("wgmma", "Hopper", "m64n8k32.f16.e4m3.e4m3"))


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
    C = _c_values(rng, (ins.m, ins.n), c_kind)  # zeros = 1.0: C alone, subnormal C included
    SA = SB = None
    if ins.scale_fmt is not None:
        nb = K // ins.block
        SA = rng.integers(*scale_range, (ins.m, nb)).astype(np.uint8)
        SB = rng.integers(*scale_range, (nb, ins.n)).astype(np.uint8)
    got = chained_matmul(ins, A, B, C, SA, SB)
    if K % min(K, ins.datapath.L):  # m16n8k16 x 3 on a 32-element datapath: a partial step
        assert got is None
        return
    assert np.array_equal(got.view(np.uint32), _numpy(ins, A, B, C, SA, SB).view(np.uint32))


@pytest.mark.parametrize("fmt", sorted({f for n in names() for f in (instruction(*n).a_fmt, instruction(*n).scale_fmt)
                                        if f is not None}, key=lambda f: f.name), ids=lambda f: f.name)
def test_finite_code_check_agrees_with_the_format(fmt):
    """The finite-code check (a max and compares, no gather) on every single code and on mixtures."""
    for code in range(fmt.n_codes):
        want = fmt.exact_value(code) is not None
        assert native._finite_codes(np.array([[code, 0]], np.uint8), fmt) == want, hex(code)
    finite = [c for c in range(fmt.n_codes) if fmt.exact_value(c) is not None]
    for size in (len(finite), 20000):  # the bytes scan, and the max-and-compare of big arrays
        codes = np.resize(np.array(finite, np.uint8), size)
        assert native._finite_codes(codes, fmt)
        for bad in sorted(set(range(fmt.n_codes)) - set(finite)):
            codes[size // 2] = bad
            assert not native._finite_codes(codes, fmt), hex(bad)


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


def _kernel_operands(k, rng, M, K, N):
    ins = k.ins
    A, B = _finite(ins.a_fmt, rng, (M, K), 0.2), _finite(ins.b_fmt, rng, (K, N), 0.2)
    if k.scales == "instruction":
        nb = -(-K // ins.block)
        return A, B, rng.integers(110, 140, (M, nb)).astype(np.uint8), rng.integers(110, 140, (nb, N)).astype(np.uint8)
    if k.scales == "promotion":
        nkb = -(-K // k.promote_every)
        return A, B, rng.uniform(1e-3, 4, (M, nkb)).astype(np.float32), \
            rng.uniform(1e-3, 4, (nkb, -(-N // k.block_n))).astype(np.float32)
    return A, B, None, None


@pytest.mark.parametrize("name", list(KERNELS) + ["split-k"])
def test_kernel_native_equals_numpy(name, monkeypatch):
    """Every kernel preset (and a split-K promoted one) in C against the numpy K loop: K not a
    multiple of the promotion interval, N not a multiple of the C loops' column blocks."""
    from fp8ref.hardware import Kernel

    if name == "split-k":
        k = Kernel("split", ("wgmma", "hopper", "m64n8k32.f32.e5m2.e4m3"), promote_every=64, split_k=3)
    else:
        k = KERNELS[name]
    rng = np.random.default_rng(len(name))
    A, B, sa, sb = _kernel_operands(k, rng, 70, 352, 150)
    calls = []
    monkeypatch.setattr(native, "_run", lambda *a, **kw: calls.append(native_run(*a, **kw)))
    got = kernel_mm(A, B, sa, sb, kernel=k)
    assert bool(calls) == applies(k.ins)  # the C loops ran wherever they apply
    monkeypatch.setenv("FP8REF_NO_KERNELS", "1")
    want = kernel_mm(A, B, sa, sb, kernel=k)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
