"""``fp8ref conform`` names every xfail entry that excused something: its line, count, reason (the
comment block above it), simplest excused mismatch and one-line repro; stale entries stay stale."""

from __future__ import annotations

import json

from fp8ref.conformance.xfails import parse_xfails
from tests.support.cli import run_cli

SUITE = """suite: ties
seed: 3
operations:
  - op: encode
    formats: [float8_e4m3fn]
    rounding: [rne]
    saturate: [true]
    input_dtypes: [float32]
    random: {1: 64}
"""
XFAILS = """# header of the file: not a reason

# a planted rule: ties go up
# (second line of the reason)
encode.float8_e4m3fn.* tie
encode.float8_e5m2.* tie
# never matches
decode.* zero
"""


def test_reasons_are_the_comment_block_above_each_entry_group():
    entries = parse_xfails(XFAILS).entries
    assert [e.reason for e in entries] == ["a planted rule: ties go up (second line of the reason)"] * 2 + [
        "never matches"]


def test_conform_prints_each_excusing_entry_with_its_reason_example_and_repro(tmp_path, capsys):
    (tmp_path / "s.yaml").write_text(SUITE)
    (tmp_path / "x.txt").write_text(XFAILS)
    code = run_cli("conform", "--backend", "tests.support.broken_backends:RoundHalfUp", "--suite", tmp_path / "s.yaml",
                   "--xfails", tmp_path / "x.txt", "--json", tmp_path / "r.json")
    out = capsys.readouterr().out
    assert code == 0, out
    known = out.split("known differences (excused by ")[1]
    lines = known.splitlines()
    assert lines[1].startswith("  line 5: encode.float8_e4m3fn.* tie  (")
    assert lines[2] == "    why: a planted rule: ties go up (second line of the reason)"
    assert lines[3].startswith("    e.g. encode float8_e4m3fn rne sat float32") and " tie]" in lines[3]
    assert lines[4].startswith("    repro: python -c ") and "'tests.support.broken_backends:RoundHalfUp'" in lines[4]
    assert "line 6" not in known and "line 8" not in known  # excused nothing: not listed (not run: not stale)
    report = json.loads((tmp_path / "r.json").read_text())
    assert [k["line"] for k in report["known_differences"]] == [5] and report["known_differences"][0]["hits"] > 0
