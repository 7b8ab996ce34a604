"""The harness itself: broken backends are caught with a minimal counterexample; backend
errors fail only their case; not implemented is never a pass; xfails and stale entries."""

import struct

import numpy as np
import pytest

from fp8ref.conformance import run
from fp8ref.conformance.xfails import parse_xfails
from fp8ref.errors import SpecError
from fp8ref.golden import parse_suite
from tests.support.broken_backends import FlushSubnormals, Nothing, OffByOneExponent, Raises, RoundHalfUp

SUITE = parse_suite("""\
suite: meta
seed: 5
operations:
  - op: encode
    formats: [float8_e4m3fn]
    rounding: [rne]
    saturate: [true, false]
    random: {1: 512}
""", source="meta.yaml")


def f32_bits(v: float) -> int:
    return struct.unpack("<I", struct.pack("<f", v))[0]


@pytest.mark.parametrize("backend, minimal", [
    # 2**-10 is the tie between 0 and the smallest subnormal 2**-9: RNE gives 0x00, half-up 0x01.
    (RoundHalfUp(), 2.0 ** -10),
    # the smallest normal, a single significant bit: the first value whose code has an exponent field.
    (OffByOneExponent(), 2.0 ** -6),
    # the smallest subnormal, a single significant bit.
    (FlushSubnormals(), 2.0 ** -9),
])
def test_broken_backends_are_caught_with_a_minimal_counterexample(backend, minimal):
    result = run(backend, SUITE)
    assert result.exit_code == 1
    for r in result.results:
        assert r.status == "compared" and r.mismatches
        first = r.mismatches[0]
        assert int(np.asarray(first.inputs["x"]).view(np.uint32)) == f32_bits(minimal), (r.case, first)


def test_a_raising_backend_fails_that_case_and_the_run_goes_on():
    result = run(Raises(), SUITE)
    statuses = {r.case: (r.status, r.reason) for r in result.results}
    assert all(s == "error" and "RuntimeError: kernel launch failed" in why for s, why in statuses.values())
    assert result.unexpected == len(statuses) == 2 and result.exit_code == 1


def test_not_implemented_is_reported_and_never_a_pass():
    result = run(Nothing(), SUITE)
    assert {r.status for r in result.results} == {"not-implemented"}
    assert all("does not implement encode" in r.reason for r in result.results)
    assert result.compared() == 0 and result.exit_code == 1


def test_xfails_select_by_case_and_tags_and_report_stale_entries():
    xf = parse_xfails("""
# ties round up in this backend
encode.float8_e4m3fn.rne.*.float32 tie   # documented
encode.float8_e4m3fn.* negative   # names cases that ran, excuses none: stale
encode.float8_e5m2.* overflow      # SUITE has no e5m2 case: not judged
attention.*.bfloat16.* double-rounding
""", "be.txt")
    result = run(RoundHalfUp(), SUITE, xfails=xf)
    assert result.unexpected == 0 and result.exit_code == 0
    assert [e.line for e in xf.stale()] == [4]
    # without the tie tag requirement only ties are excused: an off-by-one exponent is not
    result = run(OffByOneExponent(), SUITE, xfails=parse_xfails("encode.* tie"))
    assert result.unexpected > 0


def test_xfails_reject_unknown_tags_with_file_and_line():
    with pytest.raises(SpecError, match=r"be.txt:2: unknown tag 'overflw'"):
        parse_xfails("# x\nencode.* overflw\n", "be.txt")


def test_nan_rule_decides_whether_nan_codes_must_match():
    class OtherNaN(RoundHalfUp):
        name = "other-nan"

        def breaks(self, x, codes):  # NaN inputs -> NaN with the opposite sign
            return np.where(np.isnan(x), codes ^ 0x80, codes).astype(np.uint8)

    assert run(OtherNaN(), SUITE, nan_rule="any").unexpected == 0
    exact = run(OtherNaN(), SUITE, nan_rule="exact")
    tags = {m.tags for r in exact.results for m in r.mismatches}
    assert exact.unexpected > 0 and tags == {("nan-input", "nan-code")}
    assert run(OtherNaN(), SUITE, nan_rule="sign").unexpected == exact.unexpected
