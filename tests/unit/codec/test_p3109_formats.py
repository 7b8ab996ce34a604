"""The P3109 binary8 formats' parameters and names (values and codes: tests/interop/test_p3109_gfloat.py
against gfloat, and the exhaustive oracle tests, which run over every registered format)."""

from fractions import Fraction

import pytest

from fp8ref.errors import FormatError, UnknownFormatError
from fp8ref.formats import FORMATS, get_format, p3109_binary8


@pytest.mark.parametrize("p", range(1, 8))
def test_binary8p_is_derived_from_its_precision(p):
    fmt = FORMATS[f"binary8p{p}"]
    assert (fmt.exponent_bits, fmt.mantissa_bits, fmt.bias, fmt.bits) == (8 - p, p - 1, 2 ** (7 - p), 8)
    assert (fmt.nan_codes, fmt.inf_code, fmt.code_of_neginf, fmt.code_of_negzero) == (frozenset({0x80}), 0x7F, 0xFF,
                                                                                       None)
    # max = code 0x7E: the top exponent with mantissa ...10 (p >= 2), or exponent field 126 (p = 1)
    want = 2 ** 62 if p == 1 else (2 - Fraction(2) ** (2 - p)) * Fraction(2) ** ((1 << (8 - p)) - 1 - 2 ** (7 - p))
    assert Fraction(fmt.max) == want
    assert p3109_binary8(p) == fmt


@pytest.mark.parametrize("alias", ["p3109_p5", "p3109_k8p5se"])
def test_other_spellings_name_the_same_format(alias):
    assert get_format(alias) is FORMATS["binary8p5"]
    assert alias not in list(FORMATS)  # listed once, under the report's name


@pytest.mark.parametrize("p", [0, 8, 3.0])
def test_other_precisions_are_refused(p):
    with pytest.raises(FormatError, match="precision 1..7"):
        p3109_binary8(p)


def test_an_unknown_name_suggests_the_p3109_ones():
    with pytest.raises(UnknownFormatError, match="binary8p3"):
        get_format("binary8p9")
