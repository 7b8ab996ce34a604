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
from tests.hardware import cases  # noqa: E402
from tests.hardware.mmasim_support import run, simulator  # noqa: E402

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
