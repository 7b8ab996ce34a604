"""Reports: JSON bit patterns, NaN results, verdict lines."""

import io

import ml_dtypes
import numpy as np
import pytest

from fp8ref.conformance import run
from fp8ref.conformance.report import mismatch_json, mismatch_line
from fp8ref.golden import parse_suite
from fp8ref.golden.judge import Mismatch
from tests.support.broken_backends import NanMM
from tests.support.cli import run_cli

MM = parse_suite("""\
suite: mm-nan
seed: 3
operations:
  - op: scaled_mm
    formats: [float8_e4m3fn]
    shapes: {1: [[2, 3, 4]]}
    scales: [tensor]
    out_dtypes: [float32, bfloat16]
    accumulate: [fp32]
    scale_order: [operands]
    bias: [false]
""", source="mm-nan.yaml")


@pytest.mark.parametrize("dtype, value, bits", [
    (ml_dtypes.bfloat16, 3.859375, "0x4077"), (ml_dtypes.bfloat16, 3.875, "0x4078"),
    (np.float16, 3.859375, "0x43b8"), (np.float32, 3.875, "0x40780000")])
def test_json_hex_is_the_bit_pattern(dtype, value, bits):
    v = np.array(value, dtype)[()]
    m = Mismatch("c", "scaled_mm", {}, "out", (0, 0), {}, v, v, 0)
    assert mismatch_json(m, False)["expected"]["hex"] == bits


def test_a_nan_result_is_reported_as_a_wrong_nan_result():
    result = run(NanMM(), MM)
    bad = [m for r in result.results for m in r.mismatches]
    assert [m.index for m in bad] == [(0, 0), (0, 0)]
    for m in bad:
        line = mismatch_line(m, None)
        assert "wrong NaN result (expected a number)" in line and "domain" not in line
        assert mismatch_json(m, False)["nan_result"] == "wrong NaN result (expected a number)"


def test_verdict_when_case_matches_nothing(capsys):
    assert run_cli("conform", "--backend", "torch", "--suite", "formats", "--case", "nosuch*", "--quiet") == 1
    out = capsys.readouterr().out
    assert "--case 'nosuch*' matched no case name" in out and "nothing was compared" not in out


def test_verdict_when_every_case_errored(tmp_path, capsys):
    (tmp_path / "xf.txt").write_text("* error\n")
    (tmp_path / "s.yaml").write_text("suite: e\nseed: 1\noperations:\n  - op: encode\n    formats: [float8_e4m3fn]\n"
                                     "    rounding: [rne]\n    saturate: [true]\n    random: {1: 8}\n")
    assert run_cli("conform", "--backend", "tests.support.broken_backends:Raises", "--suite", tmp_path / "s.yaml",
                   "--xfails", tmp_path / "xf.txt", "--quiet") == 1
    out = capsys.readouterr().out
    assert "raised an error" in out and "nothing was compared" not in out


def test_gemm_repro_prints_the_operands_it_needs(tmp_path, capsys):
    """The a row, the b column, their scales (and the bias element): enough for a kernel's unit test."""
    from fp8ref.conformance.runner import repro
    from fp8ref.golden.suite import cases

    text = MM.text.replace("bias: [false]", "bias: [true]").replace("scales: [tensor]", "scales: [row]")
    (tmp_path / "mm.yaml").write_text(text)
    name = next(n for _, _, n, p in cases(parse_suite(text, source="mm.yaml"), 1) if p["out_dtype"] == "float32")
    repro("tests.support.broken_backends:NanMM", str(tmp_path / "mm.yaml"), name, index=(0, 0))
    out = capsys.readouterr().out
    assert "a[0, :] = uint8 codes [" in out and "b[:, 0] = uint8 codes [" in out
    assert "scale_a[0] = f32:0x" in out and "scale_b[0] = f32:0x" in out and "bias[0] = f32:0x" in out
    assert "(got NaN: a wrong NaN result)" in out


def test_max_errors_is_per_operation():
    from fp8ref.conformance.report import print_results
    from tests.support.broken_backends import FlushSubnormals

    suite = parse_suite(MM.text + """\
  - op: encode
    formats: [float8_e4m3fn]
    rounding: [rne]
    saturate: [true]
    random: {1: 64}
""", source="two.yaml")

    class Both(NanMM):
        name = "both"
        capabilities = {**FlushSubnormals.capabilities, **NanMM.capabilities}
        encode, breaks = FlushSubnormals.encode, FlushSubnormals.breaks

    result = run(Both(), suite)
    out = io.StringIO()
    print_results(result.results, header="h", is_xfailed=result.xfailed, max_errors=1, out=out)
    lines = out.getvalue().splitlines()
    assert sum(line.startswith("scaled_mm ") for line in lines) == 1  # not hidden behind encode's lines
    assert sum(line.startswith("encode ") for line in lines) == 1
    assert any("more unexpected encode mismatches not shown" in line for line in lines)


def test_dump_failing_saves_each_failing_case(tmp_path, capsys):
    from fp8ref.io import safetensors as st

    (tmp_path / "mm.yaml").write_text(MM.text)
    assert run_cli("conform", "--backend", "tests.support.broken_backends:NanMM", "--suite", tmp_path / "mm.yaml",
                   "--quiet", "--dump-failing", tmp_path / "d") == 1
    files = sorted(p.name for p in (tmp_path / "d").iterdir())
    assert len(files) == 2 and "note: 2 failing case(s) saved" in capsys.readouterr().out
    t = st.load(tmp_path / "d" / files[0])
    assert set(t) == {"input/a", "input/b", "input/scale_a", "input/scale_b", "expected/out", "got/out"}
    assert np.isnan(t["got/out"][0, 0].astype(np.float64)) and not np.isnan(t["expected/out"][0, 0].astype(np.float64))


def test_skipped_reasons_put_the_backends_own_words_first_and_group_undeclared_values():
    """A peer's missing kernel (the backend's own words, 10 cases) is printed under 7 parameters the
    backend does not declare (thousands of cases, 40 values), never folded into '... more reason(s)'."""
    from fp8ref.conformance import Backend, report
    from fp8ref.golden.judge import CaseResult

    class Declares(Backend):  # Backend.implements writes the undeclared reasons
        name = "torch"
        capabilities = {"quantize": {"recipe": ("fp8ref",)}, "encode": {"rounding": ("rne",)}}

    backend = Declares()
    recipes = [f"r{i}" for i in range(40)]
    reasons = [backend.implements("quantize", {"recipe": r}) for r in recipes for _ in range(recipes.index(r) + 1)]
    for op in ("linear", "attention", "fake_quant", "kv_cache", "matmul", "quantize_kv"):
        reasons += [f"torch does not implement {op}"] * 100
    reasons += ["torch has no CPU kernel for X with FLOAT4E2M1"] * 10
    results = [CaseResult(case=f"c{i}", op="x", params={}, status="not-implemented", reason=why)
               for i, why in enumerate(reasons)]
    lines = report.skipped_lines(results)
    assert lines[0] == f"not implemented, skipped: {len(reasons)} case(s):"
    assert lines[1] == "     10  torch has no CPU kernel for X with FLOAT4E2M1"
    assert lines[2] == "    820  torch quantize does not implement recipe='r39', 'r38', 'r37' and 37 more"
    assert len(lines) == 8 and lines[-1] == "  ... 2 more reason(s) (--json has each case's)"
    # one value: the reason as Backend.implements wrote it
    one = report.skipped_lines([CaseResult(case="c", op="x", params={}, status="not-implemented",
                                           reason=backend.implements("encode", {"rounding": "rtz"}))])
    assert one[1] == "      1  torch encode does not implement rounding='rtz'"
