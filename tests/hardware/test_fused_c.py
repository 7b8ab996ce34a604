"""The C fused datapath (fp8ref/_kernels_hw.c) gives the numpy model's bytes on every instruction
it serves: random codes with zeros, C across the whole fp32 range (subnormals, -0), every UE8M0
scale short of NaN (overflow to Inf included), and batches."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fp8ref._native import kernels_available
from fp8ref.hardware import instruction, names
from fp8ref.hardware.instructions import dot_add
from fp8ref.hardware.native import applies, fused_matmul

pytestmark = pytest.mark.skipif(not kernels_available(), reason="C kernels not built")
SERVED = [n for n in names() if applies(instruction(*n))]


def _finite(fmt, rng, shape, zeros):
    fin = np.array([c for c in range(fmt.n_codes) if fmt.exact_value(c) is not None], np.uint8)
    x = rng.choice(fin, shape)
    x[rng.random(shape) < zeros] = 0
    return x


def _numpy(ins, A, B, C, SA, SB):
    return dot_add(ins, A[:, None, :], B.T[None], C, None if SA is None else SA[:, None, :],
                   None if SB is None else SB.T[None])


def test_serves_the_fp8_and_mx_instructions():
    kinds = {(op, s.split(".")[1] if "kind" in s else "") for op, _, s in SERVED}
    assert ("wgmma", "") in kinds and ("tcgen05.mma", "kind::mxf8f6f4") in kinds and ("mma", "") in kinds
    assert not applies(instruction("mfma", "CDNA3", "f32_16x16x32_fp8_fp8"))
    assert not applies(instruction("wgmma", "Hopper", "m64n8k32.f16.e4m3.e4m3"))


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(SERVED), st.integers(0, 2**32 - 1), st.sampled_from([0.0, 0.3]),
       st.sampled_from(["normal", "wide", "zero"]), st.sampled_from([(0, 255), (100, 150), (0, 20)]))
def test_native_equals_numpy(name, seed, zeros, c_kind, scale_range):
    ins = instruction(*name)
    rng = np.random.default_rng(seed)
    A, B = _finite(ins.a_fmt, rng, (ins.m, ins.k), zeros), _finite(ins.b_fmt, rng, (ins.k, ins.n), zeros)
    C = rng.standard_normal((ins.m, ins.n))
    if c_kind == "wide":
        C = C * 2.0 ** rng.integers(-150, 100, C.shape)
    elif c_kind == "zero":
        C = C * (rng.random(C.shape) < 0.1) * 1e-42
        C[0, 0] = -0.0
    C = C.astype(np.float32)
    SA = SB = None
    if ins.scale_fmt is not None:
        nb = ins.k // ins.block
        SA = rng.integers(*scale_range, (ins.m, nb)).astype(np.uint8)
        SB = rng.integers(*scale_range, (nb, ins.n)).astype(np.uint8)
    got = fused_matmul(ins, A, B, C, SA, SB)
    assert np.array_equal(got.view(np.uint32), _numpy(ins, A, B, C, SA, SB).view(np.uint32))


def test_batches_and_non_finite_fall_back():
    ins = instruction("wgmma", "Hopper", "m64n16k32.f32.e4m3.e4m3")
    rng = np.random.default_rng(1)
    A, B = _finite(ins.a_fmt, rng, (5, 64, 32), 0.1), _finite(ins.b_fmt, rng, (5, 32, 16), 0.1)
    C = rng.standard_normal((5, 64, 16)).astype(np.float32)
    got = fused_matmul(ins, A, B, C)
    for i in range(5):
        assert np.array_equal(got[i].view(np.uint32), _numpy(ins, A[i], B[i], C[i], None, None).view(np.uint32))
    A[0, 0, 0] = 0x7F  # NaN: the numpy model handles specials
    assert fused_matmul(ins, A, B, C) is None
    C[1, 0, 0] = np.inf
    assert fused_matmul(ins, A[1:], B[1:], C[1:]) is None
