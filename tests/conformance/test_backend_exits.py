"""A backend whose own code raises SystemExit or KeyboardInterrupt inside an operation fails that
case and stops the run, with the report of what ran; the user's Ctrl-C still stops fp8ref."""

import json
import signal

import pytest

from fp8ref.conformance import run
from fp8ref.conformance.backend import BackendExit, signals_seen
from fp8ref.golden import parse_suite
from tests.support.broken_backends import CtrlCInEncode, ExitsInEncode, InterruptsInEncode
from tests.support.cli import run_cli
from tests.support.plugin import pytest_in

SUITE_TEXT = """\
suite: exits
seed: 5
operations:
  - op: encode
    formats: [float8_e4m3fn]
    rounding: [rne, rtz]
    saturate: [true, false]
    random: {1: 64}
"""
SUITE = parse_suite(SUITE_TEXT, source="exits.yaml")
BACKENDS = "tests.support.broken_backends"


@pytest.mark.parametrize("backend, raised", [
    (ExitsInEncode, "called sys.exit(9)"),
    (InterruptsInEncode, "raised KeyboardInterrupt: cancelled by the kernel's watchdog (no Ctrl-C reached fp8ref)"),
])
def test_an_exit_inside_a_case_fails_that_case_and_stops_the_run(backend, raised):
    result = run(backend(), SUITE)
    first, second = result.results
    assert first.status == "compared" and not first.mismatches
    assert second.status == "error" and second.reason == f"backend {raised}; the run stopped here"
    assert result.stopped == f"backend {backend.name!r}: case {second.case}: {raised}; the run stopped there"
    assert result.not_run == 2 and result.exit_code == 1


def test_the_cli_prints_the_partial_report_and_exits_1_not_the_backends_code(tmp_path, capsys):
    (tmp_path / "exits.yaml").write_text(SUITE_TEXT)
    code = run_cli("conform", "--backend", f"{BACKENDS}:ExitsInEncode", "--suite", tmp_path / "exits.yaml",
                   "--suite", tmp_path / "exits.yaml", "--quiet", "--json", tmp_path / "report.json")
    out = capsys.readouterr().out
    assert code == 1
    lines = out.splitlines()
    assert lines[0].startswith("== fp8ref conform: backend exits-in-encode")
    error = [ln for ln in lines if ln.startswith("ERROR ")]
    assert len(error) == 1 and error[0].endswith(": backend called sys.exit(9); the run stopped here")
    stopped = [ln for ln in lines if ln.startswith("stopped: ")]
    assert stopped == [f"stopped: backend 'exits-in-encode': case {error[0].split()[1].rstrip(':')}: called "
                       "sys.exit(9); the run stopped there: 2 case(s) of suite exits not run, nor suite(s) exits"]
    assert lines[-1] == "result: FAIL: the backend stopped the run (the 'stopped:' line above); 1 case(s) compared"
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["exit_code"] == 1 and len(report["runs"]) == 1
    assert report["runs"][0]["not_run"] == 2 and "sys.exit(9)" in report["runs"][0]["stopped"]
    assert [c["status"] for c in report["runs"][0]["cases"]] == ["compared", "error"]


@pytest.fixture
def interactive_sigint():
    """SIGINT as in an interactive Python: a background job (``cmd &`` in a script) starts with
    SIGINT ignored, and then Ctrl-C cannot reach the process at all."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


def test_the_users_ctrl_c_still_stops_the_run(interactive_sigint):
    """SIGINT reached the process while the backend ran: that KeyboardInterrupt is the user's."""
    with pytest.raises(KeyboardInterrupt):
        run(CtrlCInEncode(), SUITE)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the recorder is removed


def test_the_users_ctrl_c_ends_the_cli_with_130(tmp_path, capsys, interactive_sigint):
    (tmp_path / "exits.yaml").write_text(SUITE_TEXT)
    assert run_cli("conform", "--backend", f"{BACKENDS}:CtrlCInEncode", "--suite", tmp_path / "exits.yaml",
                   "--quiet") == 130
    assert capsys.readouterr().err == "fp8ref: interrupted\n"


def test_signals_seen_records_only_signals_and_chains_the_handler():
    calls = []
    old = signal.signal(signal.SIGINT, lambda signum, frame: calls.append(signum))
    try:
        with signals_seen() as seen:
            assert seen == []
            signal.raise_signal(signal.SIGINT)
            assert seen == [signal.SIGINT] and calls == [signal.SIGINT]
        assert getattr(signal.getsignal(signal.SIGINT), "__name__", "") == "<lambda>"  # restored
    finally:
        signal.signal(signal.SIGINT, old)


def test_a_backend_exit_is_a_backend_error():
    from fp8ref.errors import BackendError, Fp8RefError

    assert issubclass(BackendExit, BackendError) and issubclass(BackendExit, Fp8RefError)


def test_the_pytest_plugin_fails_that_case_and_runs_the_others(tmp_path):
    (tmp_path / "exits.yaml").write_text(SUITE_TEXT)
    code, out = pytest_in(tmp_path, f"--fp8ref-backend={BACKENDS}:ExitsInEncode",
                          f"--fp8ref-suite={tmp_path / 'exits.yaml'}", "--fp8ref-max-examples=5")
    assert code == 1 and "INTERNALERROR" not in out, out
    # Count in the FAILURES section only: on CI (the CI variable set) pytest prints the short summary
    # untruncated, so the message appears there a second time.
    failures = out.split("short test summary info")[0]
    assert failures.count(": backend called sys.exit(9)") == 1, out
    assert "1 failed" in out and "passed" in out, out
