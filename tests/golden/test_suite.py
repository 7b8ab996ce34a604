"""Suite YAML loading: shipped suites parse; bad suites fail with FILE:LINE: key.path."""

import pytest

from fp8ref.errors import SpecError
from fp8ref.golden import DEFAULT_SUITES, load_suite, parse_suite
from fp8ref.golden.suite import cases

GOOD = """\
suite: tiny
seed: 3
operations:
  - op: encode
    formats: [float8_e4m3fn]
    rounding: [rne]
    saturate: [true]
    random: {1: 8, 2: 16}
"""


@pytest.mark.parametrize("name", DEFAULT_SUITES)
def test_shipped_suites_load_and_expand(name):
    suite = load_suite(name)
    assert suite.name == name
    names = [c[2] for c in cases(suite, 1)]
    assert names and len(names) == len(set(names))


def test_formats_suite_covers_every_format_mode_and_saturation():
    from fp8ref import FORMATS, ROUNDING_MODES

    names = {c[2] for c in cases(load_suite("formats"), 1)}
    for fmt in FORMATS:
        for mode in ROUNDING_MODES:
            for sat in ("sat", "nosat"):
                assert f"encode.{fmt}.{mode}.{sat}.float32" in names
        assert f"decode.{fmt}" in names


def test_static_w8a8_suite_covers_the_path_end_to_end():
    ops = {c[0].name for c in cases(load_suite("fp8-static-w8a8"), 1)}
    assert ops == {"encode", "decode", "quantize", "dequantize", "scaled_mm", "linear"}


def test_levels_pick_the_largest_key_at_or_below():
    suite = parse_suite(GOOD)
    assert suite.level == 1 and suite.seed == 3
    (entry,) = suite.entries
    assert entry.fields["random"] == {1: 8, 2: 16}


@pytest.mark.parametrize("text, where, what", [
    (GOOD.replace("op: encode", "op: encodez"), "t.yaml:4: operations[0].op", "unknown operation 'encodez'"),
    (GOOD.replace("    saturate: [true]\n", "    saturate: [true]\n    colour: red\n"),
     "t.yaml:8: operations[0].colour", "unknown field 'colour'"),
    (GOOD.replace("seed: 3", "seed: three"), "t.yaml:2: seed", "expected an integer"),
    (GOOD.replace("rounding: [rne]", "rounding: [rnx]"), "t.yaml:6: operations[0].rounding[0]",
     "expected one of"),
    (GOOD.replace("{1: 8, 2: 16}", "{2: 16}"), "t.yaml:8: operations[0].random", "level 1 must be given"),
    (GOOD.replace("{1: 8, 2: 16}", "{1: 8, 3: 16}"), "t.yaml:8: operations[0].random[3]", "expected a level"),
    (GOOD + "seed: 4\n", "t.yaml:9: seed", "duplicate key"),
    (GOOD.replace("suite: tiny\n", ""), "t.yaml:1", "missing required field 'suite'"),
])
def test_bad_suites_name_file_line_and_key(text, where, what):
    with pytest.raises(SpecError) as err:
        parse_suite(text, source="t.yaml")
    assert str(err.value).startswith(where), str(err.value)
    assert what in str(err.value)


def test_unknown_suite_name_lists_the_shipped_ones():
    with pytest.raises(SpecError, match="shipped: .*formats"):
        load_suite("no-such-suite")
