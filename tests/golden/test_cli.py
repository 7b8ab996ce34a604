"""``fp8ref golden ...`` handlers: exit codes and messages (the lead wires them into fp8ref.cli)."""


import numpy as np
import pytest

from fp8ref.io import safetensors as st
from tests.support.cli import run_cli

SUITE = """\
suite: clitest
seed: 2
operations:
  - op: encode
    formats: [float8_e4m3fn]
    rounding: [rne, rtz]
    saturate: [false]
    random: {1: 32}
"""


@pytest.fixture
def suite_file(tmp_path):
    path = tmp_path / "clitest.yaml"
    path.write_text(SUITE)
    return path


def test_generate_verify_check_round_trip(tmp_path, suite_file, capsys):
    out = tmp_path / "g"
    assert run_cli("golden", "generate", suite_file, "-o", out, "--quiet") == 0
    assert "2 cases" in capsys.readouterr().out
    assert run_cli("golden", "verify", out, "--quiet") == 0
    outputs = st.load(out / "encode.expected.safetensors")
    st.save(tmp_path / "o.safetensors", outputs)
    assert run_cli("golden", "check", out, "--outputs", tmp_path / "o.safetensors", "--json", tmp_path / "r.json") == 0
    assert "result: PASS" in capsys.readouterr().out
    key = "encode.float8_e4m3fn.rtz.nosat.float32/codes"
    outputs[key] = np.where(outputs[key] == 0x7E, np.uint8(0x7F), outputs[key])  # max -> NaN
    st.save(tmp_path / "o.safetensors", outputs)
    assert run_cli("golden", "check", out, "--outputs", tmp_path / "o.safetensors") == 1
    text = capsys.readouterr().out
    assert "encode float8_e4m3fn rtz nosat float32" in text and "expected 0x7e (+.1111.110 448)" in text
    assert "got 0x7f (+.1111.111 nan)" in text


def test_verify_of_a_damaged_folder_names_the_file(tmp_path, suite_file, capsys):
    out = tmp_path / "g"
    run_cli("golden", "generate", suite_file, "-o", out, "--quiet")
    (out / "suite.yaml").write_text(SUITE + "# edited\n")
    assert run_cli("golden", "verify", out) == 1
    assert "modified file 'suite.yaml'" in capsys.readouterr().err


def test_bad_suite_exits_1_with_file_and_line(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text(SUITE.replace("random:", "randum:"))
    assert run_cli("golden", "generate", bad, "-o", tmp_path / "g") == 1
    assert f"{bad}:8: operations[0].randum: unknown field 'randum'" in capsys.readouterr().err


def test_list_prints_case_names(capsys):
    assert run_cli("golden", "list", "fp8-static-w8a8") == 0
    assert "linear.FP8_STATIC.auto-round.bfloat16.exact.8x256x64" in capsys.readouterr().out


def test_check_allow_missing_counts_the_unchecked_and_xfails_excuse_known_differences(tmp_path, suite_file,
                                                                                     capsys):
    out = tmp_path / "g"
    assert run_cli("golden", "generate", suite_file, "-o", out, "--quiet") == 0
    outputs = st.load(out / "encode.expected.safetensors")
    key = "encode.float8_e4m3fn.rtz.nosat.float32/codes"
    outputs[key] = np.where(outputs[key] == 0x7E, np.uint8(0x7F), outputs[key])
    del outputs["encode.float8_e4m3fn.rne.nosat.float32/codes"]
    st.save(tmp_path / "o.safetensors", outputs)
    capsys.readouterr()
    assert run_cli("golden", "check", out, "--outputs", tmp_path / "o.safetensors", "--allow-missing") == 1
    text = capsys.readouterr().out
    assert "note: 1 case(s) have no outputs" in text and "went unchecked" in text
    # line 2 names a case that ran but excuses nothing (stale); line 3 names no case of the suite (not judged)
    (tmp_path / "xf.txt").write_text("encode.float8_e4m3fn.rtz.nosat.*\nencode.float8_e4m3fn.rtz.* negative\n"
                                     "encode.float8_e5m2.* tie\n")
    assert run_cli("golden", "check", out, "--outputs", tmp_path / "o.safetensors", "--allow-missing",
                   "--xfails", tmp_path / "xf.txt") == 0
    text = capsys.readouterr().out
    assert "result: PASS" in text and "stale xfail (matched nothing): " in text and "xf.txt:2" in text
    assert "xf.txt:3" not in text
