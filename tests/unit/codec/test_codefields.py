"""Code fields: every code of every format splits into fields that reassemble to it, with
the widths the format declares; hand-picked codes print as the CLI and reports show them."""

import pytest

from fp8ref.codefields import code_fields, fields_text
from fp8ref.formats import FORMATS


@pytest.mark.parametrize("name", list(FORMATS))
def test_fields_reassemble_to_the_code(name):
    fmt = FORMATS[name]
    for code in range(fmt.n_codes):
        s, e, m = code_fields(code, fmt)
        assert (len(s), len(e), len(m)) == (int(fmt.signed), fmt.exponent_bits, fmt.mantissa_bits)
        assert int(s + e + m, 2) == code


@pytest.mark.parametrize("code, fmt, bit, symbol", [
    (0x7E, "float8_e4m3fn", "0.1111.110", "+.1111.110"),
    (0xFF, "float8_e4m3fn", "1.1111.111", "-.1111.111"),
    (0x80, "float8_e5m2", "1.00000.00", "-.00000.00"),
    (0x7F, "float8_e8m0fnu", "01111111", ".01111111"),  # unsigned, no mantissa
    (0x0F, "float4_e2m1fn", "1.11.1", "-.11.1"),
    (0x21, "float6_e3m2fn", "1.000.01", "-.000.01"),
])
def test_hand_picked_codes(code, fmt, bit, symbol):
    assert fields_text(code, fmt) == bit
    assert fields_text(code, fmt, sign="symbol") == symbol
