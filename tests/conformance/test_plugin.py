"""The pytest plugin, run as a backend project would: ``pytest -p ... --fp8ref-backend=NAME``
(installed, the ``pytest11`` entry point loads it without ``-p``)."""

from tests.support.plugin import pytest_in

SUITE = """\
suite: plug
seed: 1
operations:
  - op: encode
    formats: [float8_e4m3fn, float8_e5m2]
    rounding: [rne, rtz]
    saturate: [true, false]
    random: {1: 64}
"""


def test_inactive_without_the_option(tmp_path):
    code, out = pytest_in(tmp_path)
    assert code == 0 and "1 passed" in out and "skipped" not in out


def test_runs_cases_and_hypothesis_against_a_backend(tmp_path):
    (tmp_path / "plug.yaml").write_text(SUITE)
    code, out = pytest_in(tmp_path, "--fp8ref-backend=torch", f"--fp8ref-suite={tmp_path / 'plug.yaml'}",
                          "--fp8ref-max-examples=10", "-rs")
    # torch: rne cases run (e4m3fn nosat overflow is a documented xfail), rtz is not implemented,
    # plus one hypothesis test per implemented format x saturate
    assert code == 0, out
    assert "skipped" not in out and "fp8ref: 4 case(s) not implemented by torch, not run:" in out
    assert "    4  torch encode does not implement rounding" in out and "stale xfail" not in out
    assert "xfailed" in out and "passed" in out


def test_a_broken_backend_fails_with_mismatch_lines(tmp_path):
    (tmp_path / "plug.yaml").write_text(SUITE.replace("[true, false]", "[true]"))
    code, out = pytest_in(tmp_path, "--fp8ref-backend=tests.support.broken_backends:FlushSubnormals",
                          f"--fp8ref-suite={tmp_path / 'plug.yaml'}", "--fp8ref-max-examples=30")
    assert code == 1
    assert "elements differ; simplest first" in out and "x=f32:0x3b000000" in out  # 2**-9 first
    assert "FAILED ::fp8ref-conformance::hypothesis::encode.float8_e4m3fn.rne." in out


def test_an_unknown_backend_is_a_usage_error(tmp_path):
    code, out = pytest_in(tmp_path, "--fp8ref-backend=nosuch")
    assert code == 4 and "INTERNALERROR" not in out  # pytest's usage-error exit
    assert "--fp8ref-backend=nosuch: unknown backend 'nosuch'" in out and len(out.splitlines()) < 5, out
    code, out = pytest_in(tmp_path, "--fp8ref-backend=tests.support.broken_backends:RaisesInImplements")
    assert code == 4 and "INTERNALERROR" not in out and "implements('encode', ...) failed: KeyError" in out


def test_a_failing_case_prints_only_its_mismatch_lines_and_repro(tmp_path):
    (tmp_path / "plug.yaml").write_text(SUITE.replace("[true, false]", "[true]").replace("[rne, rtz]", "[rne]")
                                        .replace("float8_e4m3fn, float8_e5m2", "float8_e4m3fn"))
    code, out = pytest_in(tmp_path, "--fp8ref-backend=tests.support.broken_backends:OffByOneExponent",
                          f"--fp8ref-suite={tmp_path / 'plug.yaml'}", "--fp8ref-max-examples=30")
    assert code == 1
    blocks = out.split("____")
    case = next(b for b in blocks if "elements differ; simplest first" in b)
    assert len(case.splitlines()) < 60 and "repro: python -c" in case and "pluggy" not in out, case
    hyp = next(b for b in blocks if "hypothesis::encode.float8_e4m3fn.rne.sat" in b and "repro" in b)
    assert "hypothesis input (float32 bits" in hyp and "-k 'hypothesis::encode.float8_e4m3fn.rne.sat" in hyp
    assert len(hyp.splitlines()) < 60, hyp
    assert len(out.splitlines()) < 120, out


def test_stale_xfails_are_reported(tmp_path):
    (tmp_path / "plug.yaml").write_text(SUITE)
    from fp8ref.conformance.xfails import XFAILS_DIR

    shipped = (XFAILS_DIR / "torch.txt").read_text().rstrip("\n") + "\n"
    n = len(shipped.splitlines())
    (tmp_path / "xf.txt").write_text(shipped + "encode.float8_e5m2.rne.sat.* tie\nscaled_mm.* error\n")
    code, out = pytest_in(tmp_path, "--fp8ref-backend=torch", f"--fp8ref-suite={tmp_path / 'plug.yaml'}",
                          f"--fp8ref-xfails={tmp_path / 'xf.txt'}", "--fp8ref-max-examples=5")
    assert code == 0, out
    assert f"xf.txt:{n + 1}: 'encode.float8_e5m2.rne.sat.* tie' matched nothing in this run" in out
    assert f"xf.txt:{n + 2}" not in out  # about cases this run did not include
