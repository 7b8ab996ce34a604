"""fp8ref's instruction models bit for bit against MMA-Sim (``mmasim``, the published, hardware-
verified simulator) on every modelled instruction: random codes (finite, and with NaN/Inf),
crafted edge cases (cancellation, C swamping the products and the reverse, the underflow edge,
exponent spread wider than F, NaN/Inf, signed zeros) and every block-scale code.

Needs the peer: ``tox -e hardware`` (or ``pip install mmasim==2.1.1``); skipped without it, and
deselected from the default run (marker ``hardware``)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("mmasim")

from fp8ref.hardware import instruction, mma, names  # noqa: E402
from tests.support import mma_cases as cases  # noqa: E402
from tests.support.mmasim import run, simulator  # noqa: E402

pytestmark = pytest.mark.hardware
NAMES = list(names())


def _assert_same(ins, mine, ref, what):
    u = np.uint32 if ins.acc == "float32" else np.uint16
    diff = mine.view(u) != ref.view(u)
    if diff.any():
        i = tuple(int(x) for x in np.argwhere(diff)[0])
        pytest.fail(f"{ins.name} {what}: {int(diff.sum())} of {diff.size} differ; first at {i}: "
                    f"fp8ref {mine[i]!r} ({mine.view(u)[i]:#x}) mmasim {ref[i]!r} ({ref.view(u)[i]:#x})")


@pytest.mark.parametrize("op,arch,s", NAMES, ids=[f"{o}-{a}-{s}" for o, a, s in NAMES])
def test_instruction_matches_mmasim(op, arch, s):
    ins = instruction(op, arch, s)
    sim = simulator(op, arch, s)
    rng = np.random.default_rng(abs(hash(s)) % 2**32)
    operand_cases = [("random finite", cases.random_case(ins, rng, False)),
                     ("random with specials", cases.random_case(ins, rng, True)),
                     ("crafted", cases.crafted(ins, rng))]
    if ins.scale_fmt is None:
        for what, (A, B, C) in operand_cases:
            _assert_same(ins, mma(op, arch, s, A, B, C), run(sim, op, arch, s, A, B, C), what)
        return
    neutral = 127 if ins.scale_type == "ue8m0" else 0x38  # scale 1.0
    nb = ins.k // ins.block
    for what, (A, B, C) in operand_cases:
        SA = np.full((ins.m, nb), neutral, np.uint8)
        SB = np.full((nb, ins.n), neutral, np.uint8)
        _assert_same(ins, mma(op, arch, s, A, B, C, scale_a=SA, scale_b=SB), run(sim, op, arch, s, A, B, C, SA, SB),
                     what)
    A, B, C = cases.random_case(ins, rng, False)
    for SA, SB in cases.scale_cases(ins, rng):
        _assert_same(ins, mma(op, arch, s, A, B, C, scale_a=SA, scale_b=SB), run(sim, op, arch, s, A, B, C, SA, SB),
                     f"scale codes {SA.min():#x}..{SA.max():#x} x {SB.min():#x}..{SB.max():#x}")


def test_probe_reads_mmasim_wgmma_chained_over_k():
    """The probe run on MMA-Sim itself (wgmma m64nNk32 e4m3 chained over K, fast accumulation)
    finds Hopper's published parameters and names fp8ref's matching preset."""
    from fp8ref.codec import encode
    from fp8ref.hardware.probe import matching_models, probe

    def gemm(A, B):
        a = encode(A.astype(np.float32), "float8_e4m3fn", saturate=False)
        b = encode(B.astype(np.float32), "float8_e4m3fn", saturate=False)
        M, K = a.shape
        N = B.shape[1]
        Mp = -(-M // 64) * 64
        a = np.pad(a, ((0, Mp - M), (0, 0)))
        s = f"m64n{N}k32.f32.e4m3.e4m3"
        sim = simulator("wgmma", "hopper", s)
        D = np.zeros((Mp, N), np.float32)
        for i in range(0, Mp, 64):
            for k0 in range(0, K, 32):
                D[i:i + 64] = run(sim, "wgmma", "hopper", s, a[i:i + 64, k0:k0 + 32], b[k0:k0 + 32], D[i:i + 64])
        return D[:M]

    found = probe(gemm)
    assert found["fraction_bits"]["value"] == 13
    assert found["rounding"]["value"] == "truncate"
    assert found["block"]["value"] == 32
    assert found["promote_every"]["value"] is None
    assert found["c_aligned"]["value"] is True
    assert "hopper-fast-accum" in matching_models(found)


def _c_path_names():
    """Every grouped (MXFP4/NVFP4) and f16-accumulator instruction, and one of each other C loop."""
    out, seen = [], set()
    for n in NAMES:
        ins = instruction(*n)
        key = (ins.datapath.family, ins.acc, ins.kind, ins.scale_type)
        if ins.datapath.family == "grouped" or ins.acc == "float16" or key not in seen:
            out.append(n)
            seen.add(key)
    return out


C_NAMES = _c_path_names()


def _finite(ins, A, B, C):
    """The crafted operands with every NaN/Inf code and C replaced (zero codes, C = -0.0, max): the
    cases the C loops serve (NaN/Inf make them hand over to the numpy model)."""
    def keep(x, fmt):
        ok = np.array([fmt.exact_value(c) is not None for c in range(fmt.n_codes)])
        return np.where(ok[x], x, 0).astype(np.uint8)

    top = np.finfo(ins.acc).max
    C = np.where(np.isnan(C), -0.0, np.where(np.isinf(C), np.copysign(top, C), C)).astype(ins.acc)
    return keep(A, ins.a_fmt), keep(B, ins.b_fmt), C


@pytest.mark.parametrize("op,arch,s", C_NAMES, ids=[f"{o}-{a}-{s}" for o, a, s in C_NAMES])
def test_c_loops_match_mmasim(op, arch, s):
    """The C loops themselves (the instruction's cached plan) bit for bit against mmasim: random
    finite codes, the crafted cases made finite (cancellation, the underflow edge, spread wider than
    F, signed zeros, C subnormal / -0 / huge), every finite block-scale code in scale_a and in scale_b;
    and with a NaN/Inf code or C the loops hand over, and mma() still matches."""
    from fp8ref.hardware import native

    ins = instruction(op, arch, s)
    plan = native.plan(ins)
    assert plan is not None
    sim = simulator(op, arch, s)
    rng = np.random.default_rng(abs(hash(s + "c")) % 2**32)
    runs = [("random finite", cases.random_case(ins, rng, False)),
            ("crafted, finite", _finite(ins, *cases.crafted(ins, rng)))]
    scale_runs = []
    if ins.scale_fmt is not None:
        nb = ins.k // ins.block
        one = 127 if ins.scale_type == "ue8m0" else 0x38
        finite_scale = np.array([ins.scale_fmt.exact_value(c & (0x7F if ins.scale_type == "ue4m3" else 0xFF))
                                 is not None for c in range(256)])
        for SA, SB in cases.scale_cases(ins, rng):
            scale_runs.append((np.where(finite_scale[SA], SA, one).astype(np.uint8),
                               np.where(finite_scale[SB], SB, one).astype(np.uint8)))
        ones = (np.full((ins.m, nb), one, np.uint8), np.full((nb, ins.n), one, np.uint8))
    for what, (A, B, C) in runs:
        for SA, SB in scale_runs or [ones if ins.scale_fmt is not None else (None, None)]:
            got = plan(A, B, C, SA, SB)
            assert got is not None, f"{what}: the C loop handed over"
            ref = run(sim, op, arch, s, A, B, C, SA, SB)
            _assert_same(ins, got, ref, what + ("" if SA is None else f", scales {SA.min():#x}..{SA.max():#x}"))
    A, B, C = cases.random_case(ins, rng, False)
    A[0, 0] = sorted(ins.a_fmt.nan_codes)[0] if ins.a_fmt.nan_codes else A[0, 0]
    C2 = C.copy()
    C2[-1, -1] = np.inf
    SA, SB = ones if ins.scale_fmt is not None else (None, None)
    for A_, C_ in ((A, C), (A, C2)):
        if A_ is A and not ins.a_fmt.nan_codes:
            continue
        assert plan(A_, B, C_, SA, SB) is None
        _assert_same(ins, mma(op, arch, s, A_, B, C_, scale_a=SA, scale_b=SB), run(sim, op, arch, s, A_, B, C_, SA, SB),
                     "NaN/Inf: handed over")
