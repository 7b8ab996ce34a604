"""The one-line repros printed with mismatches run and show both results."""

import subprocess
import sys
from pathlib import Path

from fp8ref.conformance import run
from fp8ref.conformance.report import repro_line
from fp8ref.golden import load_suite

ROOT = Path(__file__).resolve().parents[2]


def test_encode_repro_runs_and_prints_expected_then_got():
    r = run("torch", load_suite("formats"), select=lambda n: n == "encode.float8_e4m3fn.rne.nosat.bfloat16")
    m = r.results[0].mismatches[0]
    line = repro_line(m, "torch", "formats", 1)
    assert line.startswith('python -c "') and "\n" not in line
    out = subprocess.run([sys.executable, "-c", line[len('python -c "'):-1]], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout.split()
    assert out == [hex(int(m.expected)), hex(int(m.got))]


def test_generic_repro_reruns_one_element(capsys):
    """A scaled_mm outside the fp32-order bound: the repro shows the exact result and the
    allowed interval, and got outside it."""
    spec = "tests.support.broken_backends:WrongScaleB"
    r = run(spec, load_suite("fp8-static-w8a8"), select=lambda n: n.startswith("scaled_mm") and "fp32-op" in n)
    m = next(m for x in r.results for m in x.mismatches)
    line = repro_line(m, spec, "fp8-static-w8a8", 1)
    code = line[len('python -c "'):-1]
    exec(code, {})  # noqa: S102 - the line itself is the thing under test
    text = capsys.readouterr().out
    assert m.case in text and "expected" in text and "got" in text
    bound = text.split("fp32-order bound: exact ")[1]
    lo, hi = (float(v.split("(")[-1].rstrip(")")) for v in bound.split("allowed [")[1].split("]")[0].split(", "))
    assert not lo <= float(m.got) <= hi


def test_quantize_repro_prints_the_codes_at_a_2d_index(capsys):
    spec = "tests.support.broken_backends:FlipsLastCode"
    r = run(spec, load_suite("fp8-static-w8a8"), select=lambda n: n.startswith("quantize."))
    m = next(m for x in r.results for m in x.mismatches)
    assert len(m.index) == 2
    exec(repro_line(m, spec, "fp8-static-w8a8", 1)[len('python -c "'):-1], {})  # noqa: S102
    text = capsys.readouterr().out
    assert f"codes: expected np.uint8({int(m.expected)}), got np.uint8({int(m.got)})" in text


def test_profile_repro_calls_the_profile():
    """Under --profile onnx the expected codes are fp8ref.profiles.encode's: ml_dtypes gives 0x00 for
    2**-128 without saturation, ONNX's table NaN."""
    r = run("ml_dtypes", load_suite("formats"), select=lambda n: n == "encode.float8_e8m0fnu.rne.nosat.float32",
            profile="onnx")
    m = next(m for x in r.results for m in x.mismatches if "profile" in m.params)
    line = repro_line(m, "ml_dtypes", "formats", 1)
    assert "fp8ref.profiles.encode(" in line and "profile='onnx'" in line
    out = subprocess.run([sys.executable, "-c", line[len('python -c "'):-1]], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout.split()
    assert out == [hex(int(m.expected)), hex(int(m.got))]
