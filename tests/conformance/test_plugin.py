"""The pytest plugin, run as a backend project would: ``pytest -p ... --fp8ref-backend=NAME``
(installed, the ``pytest11`` entry point loads it without ``-p``)."""

import json
import re

import pytest

from tests.support.cli import run_cli
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


# --- which suites: the plugin chooses as `fp8ref conform` does (fp8ref.conformance.backend.suites_for) ---

OWN_BACKEND = """\
from fp8ref.conformance.adapters.torch_backend import TorchBackend


class Own(TorchBackend):  # torch's arithmetic and shipped xfails, with suites of its own
    default_suites = ({suite!r},)
"""

_VERDICT = re.compile(r"^(PASSED|FAILED|XFAIL) ::fp8ref-conformance::([^:\s]+)::(\S+)", re.M)


def _plugin_verdicts(out: str) -> dict[tuple[str, str], str]:
    """(suite, case) -> passed/failed/xfailed from pytest's -rA summary; the hypothesis items left out."""
    return {(suite, case): status.lower().replace("xfail", "xfailed")
            for status, suite, case in _VERDICT.findall(out) if suite != "hypothesis"}


def _conform_verdicts(spec: str, tmp_path, capsys) -> tuple[dict[tuple[str, str], str], str]:
    """(suite, case) -> verdict of every case `fp8ref conform --backend SPEC` (no --suite) compared, and its text."""
    run_cli("conform", "--backend", spec, "--quiet", "--json", tmp_path / "conform.json")
    text = capsys.readouterr().out
    runs = json.loads((tmp_path / "conform.json").read_text())["runs"]
    verdicts = {}
    for run in runs:
        for c in run["cases"]:
            if c["status"] == "not-implemented":
                continue
            unexpected = c["status"] == "error" or c["mismatches"]
            verdicts[run["suite"], c["case"]] = "failed" if unexpected else "xfailed" if c["xfailed"] else "passed"
    return verdicts, text


@pytest.mark.parametrize("spec", ["naive_block", "tests.support.broken_backends:BlockScaleShifted", "own_backend:Own"])
def test_the_plugin_runs_what_conform_runs_with_the_same_verdicts(tmp_path, monkeypatch, capsys, spec):
    """No --fp8ref-suite: the backend's default_suites (own_backend: a suite of its own instead of the
    defaults) and block-scaled where it declares block16/block32 scaled_mm (naive_block and its broken
    variant; not torch). Every case `fp8ref conform` compares is a test item with the same verdict."""
    (tmp_path / "plug.yaml").write_text(SUITE)
    (tmp_path / "own_backend.py").write_text(OWN_BACKEND.format(suite=str(tmp_path / "plug.yaml")))
    monkeypatch.syspath_prepend(str(tmp_path))
    code, out = pytest_in(tmp_path, f"--fp8ref-backend={spec}", "--fp8ref-max-examples=5", "-rA")
    plugin = _plugin_verdicts(out)
    conform, conform_text = _conform_verdicts(spec, tmp_path, capsys)
    assert plugin and plugin == conform, out[-3000:]
    suites = {suite for suite, _ in plugin}
    failed = {case for (_, case), v in plugin.items() if v == "failed"}
    if spec == "own_backend:Own":
        assert suites == {"plug"} and code == 0 and "xfailed" in plugin.values()  # torch's e4m3 nosat overflow
        skipped = "suite block-scaled skipped: backend 'torch' declares no scaled_mm with scales block16 or block32"
        assert f"fp8ref: {skipped}" in out and skipped in conform_text
        return
    assert suites == {"block-scaled"} and code == 1
    assert "passed" in plugin.values() and "skipped:" not in out
    # naive_block leaves float32's range only at the E8M0 2**+-127 scales; the shifted scales fail random blocks
    random_failed = {case for case in failed if ".scale-extremes." not in case}
    assert failed and (not random_failed if spec == "naive_block" else random_failed)
