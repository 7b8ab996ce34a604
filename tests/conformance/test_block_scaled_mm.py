"""The block-scaled scaled_mm case (scales: block128, suite fp8-block-w8a8): its expected output
is the Fraction oracle's, a correct block backend passes bit for bit, backends that misuse the
block scales fail, and torch's CPU _scaled_mm (no blockwise scaling) reports it not implemented."""

from __future__ import annotations

import pytest

from fp8ref.conformance import run
from fp8ref.golden import load_suite
from fp8ref.golden.ops import OPERATIONS
from fp8ref.golden.suite import build
from tests.support.broken_backends import BlockMM, IgnoresBlockScales, SwapsBlockScales
from tests.support.matmul_oracle import fraction_oracle, rounded, same

SUITE = load_suite("fp8-block-w8a8")


def _mm_cases():
    return [c for c in build(SUITE, 1) if c.op == "scaled_mm"]


def test_expected_output_is_the_oracles_exact_block_sum():
    """exact accumulation: out[m, n] = RNE(sum_k a*b * sa[m, k // 128] * sb[k // 128, n // 128] + bias)."""
    (case,) = [c for c in _mm_cases() if c.name == "scaled_mm.float8_e4m3fn.block128.float32.exact.bias.5x300x200"]
    i = case.inputs
    assert i["scale_a"].shape == (5, 3) and i["scale_b"].shape == (3, 2)
    assert len(set(i["scale_b"].reshape(-1).tolist())) == 6  # every block has its own scale
    out = OPERATIONS["scaled_mm"].reference(case.params, i)["out"]
    exact = fraction_oracle(i["a"], i["b"], i["scale_a"], i["scale_b"], bias=i["bias"], block_k=128, block_n=128)
    assert same(out, rounded(exact))


def test_a_correct_block_backend_passes_bit_for_bit():
    r = run(BlockMM(), SUITE, select=lambda n: n.startswith("scaled_mm"))
    assert r.compared() == len(_mm_cases()) == 36 and r.unexpected == 0


@pytest.mark.parametrize("backend", [IgnoresBlockScales(), SwapsBlockScales()], ids=lambda b: b.name)
def test_misused_block_scales_are_caught(backend):
    r = run(backend, SUITE, select=lambda n: n.startswith("scaled_mm"))
    failed = {x.case for x in r.results if x.mismatches}
    # every case with more than one K-block (or N-block, for the swap) differs; 128x128 has one block
    assert r.unexpected > 0 and failed and all("128x128" not in c for c in failed)
    assert any(c.endswith("5x300x200") for c in failed) and any(c.endswith("4x256x384") for c in failed)


def test_torch_cpu_declares_block_scales_unsupported():
    """torch 2.13's CPU _scaled_mm (and F.scaled_mm with ScalingType.BlockWise1x128/128x128) accepts
    TensorWise and RowWise scaling only: the torch backend does not declare block128, so its cases are
    not implemented, never failed."""
    torch = pytest.importorskip("torch")
    a = torch.zeros(2, 256, dtype=torch.float8_e4m3fn)
    b = torch.zeros(256, 256, dtype=torch.float8_e4m3fn).t().contiguous().t()
    with pytest.raises((RuntimeError, ValueError), match="Invalid scaling configuration"):
        torch._scaled_mm(a, b, torch.ones(2, 2), torch.ones(2, 2), out_dtype=torch.float32)
    r = run("torch", SUITE, select=lambda n: n.startswith("scaled_mm"))
    assert {x.status for x in r.results} == {"not-implemented"} and r.unexpected == 0
    assert "scales='block128'" in r.results[0].reason
