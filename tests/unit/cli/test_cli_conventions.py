"""The same flag means the same on every command: --json OUT ('-': stdout), --quiet/--progress,
one result line; encode's stochastic rounding; defaults shown in --help."""

import json

import pytest

from tests.support.cli import run_cli

TINY = "tests/golden/data/tiny.yaml"


@pytest.mark.parametrize("argv", [("formats",), ("encode", "1.5"), ("decode", "0x7e"),
                                  ("spec", "validate", "specs/examples/mixed.yaml"),
                                  ("spec", "show", "specs/examples/mixed.yaml")])
def test_json_dash_is_json_on_stdout_and_a_path_is_a_file(argv, tmp_path, capsys):
    assert run_cli(*argv, "--json", "-") == 0
    out = capsys.readouterr().out
    doc = json.loads(out)  # nothing but JSON on stdout
    assert run_cli(*argv, "--json", tmp_path / "r.json") == 0
    assert json.loads((tmp_path / "r.json").read_text()) == doc
    assert capsys.readouterr().out.strip() != ""  # the text report as well


def test_reports_with_json_dash_move_the_text_to_stderr(tmp_path, capsys):
    from fp8ref.io import safetensors as st

    assert run_cli("golden", "generate", TINY, "-o", tmp_path / "g", "--quiet") == 0
    st.save(tmp_path / "o.safetensors", st.load(tmp_path / "g" / "encode.expected.safetensors"))
    capsys.readouterr()
    assert run_cli("golden", "check", tmp_path / "g", "--outputs", tmp_path / "o.safetensors", "--allow-missing",
                   "--json", "-") == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["unchecked"] > 0 and "result: PASS" in captured.err
    assert run_cli("conform", "--backend", "ml_dtypes", "--suite", TINY, "--case", "decode.*", "--quiet",
                   "--json", "-") == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["exit_code"] == 0 and "result: PASS" in captured.err


def test_verify_ends_with_the_result_line(tmp_path, capsys):
    assert run_cli("golden", "generate", TINY, "-o", tmp_path / "g", "--quiet") == 0
    assert run_cli("golden", "verify", tmp_path / "g", "--quiet") == 0
    assert capsys.readouterr().out.rstrip().splitlines()[-1] == "result: PASS"


def test_progress_bars_when_asked_even_without_a_terminal(tmp_path, capsys):
    assert run_cli("golden", "generate", TINY, "-o", tmp_path / "a", "--progress") == 0
    assert "generate: " in capsys.readouterr().err  # tqdm's bar (stderr is captured, not a terminal)
    assert run_cli("golden", "generate", TINY, "-o", tmp_path / "b") == 0
    assert capsys.readouterr().err == ""
    with pytest.raises(SystemExit):
        run_cli("golden", "generate", TINY, "-o", tmp_path / "c", "--progress", "--quiet")


def test_quantize_help_shows_the_format_default_and_one_progress_flag(capsys):
    with pytest.raises(SystemExit):
        run_cli("quantize", "--help")
    text = capsys.readouterr().out
    assert "(default: compressed-tensors)" in text and "--quiet" in text and "--no-progress" not in text


def test_encode_stochastic_with_random_bits(capsys):
    """1.0625 lies halfway between e4m3fn's 1.0 and 1.125: random bits below half round down, above up."""
    assert run_cli("encode", "1.0625", "1.0625", "--rounding", "stochastic", "--random-bits", "0", "0xffffffff",
                   "--json", "-") == 0
    assert [r["code"] for r in json.loads(capsys.readouterr().out)] == ["0x38", "0x39"]
    assert run_cli("encode", "1.0625", "--rounding", "stochastic") == 1
    assert "needs --random-bits" in capsys.readouterr().err
    assert run_cli("encode", "1.0625", "--random-bits", "1") == 1
    assert "only used with --rounding stochastic" in capsys.readouterr().err
