"""compressed-tensors and auto-round adapters against their real packages (installed in the
interop environment, e.g. /work/venvs/interop; skipped where absent)."""

import pytest

from fp8ref.conformance import run
from fp8ref.golden import load_suite

pytestmark = pytest.mark.interop


@pytest.mark.parametrize("name, module, ops", [
    ("compressed_tensors", "compressed_tensors", {"quantize", "dequantize"}),
    ("auto_round", "auto_round", {"quantize"}),
])
def test_producer_matches_its_fp8ref_recipe_bit_exactly(name, module, ops):
    pytest.importorskip(module)
    result = run(name, load_suite("fp8-static-w8a8"))
    compared = [r for r in result.results if r.status == "compared"]
    assert {r.op for r in compared} == ops and all(r.elements for r in compared)
    assert result.unexpected == 0, [(r.case, r.reason, r.mismatches[:1]) for r in result.results
                                    if r.status == "error" or r.mismatches][:3]
