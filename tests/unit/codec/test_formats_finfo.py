"""numpy.finfo-style and gfloat-style names of FloatFormat: identities between them, checked on every
registered format and on random user ExMy formats (ml_dtypes' finfo_test style: the numbers are not
restated), plus ml_dtypes' own finfo for the formats it has (independent evidence)."""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from fp8ref.errors import FormatError
from fp8ref.formats import FORMATS, SPECIALS, FloatFormat


@st.composite
def user_formats(draw) -> FloatFormat:
    signed = draw(st.booleans())
    e = draw(st.integers(1, 8 - int(signed)))
    m = draw(st.integers(0, 8 - int(signed) - e))
    try:
        return FloatFormat("user", e, m, draw(st.integers(-20, 40)), draw(st.sampled_from(SPECIALS)), signed,
                           has_zero=draw(st.booleans()))
    except FormatError:
        assume(False)


def _finite(fmt: FloatFormat) -> dict[int, Fraction]:
    return {c: v for c in range(fmt.n_codes) if (v := fmt.exact_value(c)) is not None}


def check_identities(fmt: FloatFormat) -> None:
    finite = _finite(fmt)
    positive = sorted(v for v in finite.values() if v > 0)
    assert fmt.nmant + fmt.nexp + int(fmt.signed) == fmt.bits
    assert fmt.eps == 2.0 ** fmt.machep
    assert Fraction(fmt.max) == max(finite.values()) == finite[fmt.code_of_max]
    assert fmt.maxexp == fmt.emax + 1 and fmt.max < 2.0 ** fmt.maxexp <= 2 * fmt.max
    assert fmt.minexp == fmt.emin and fmt.tiny == fmt.smallest_normal == 2.0 ** fmt.minexp
    assert Fraction(fmt.smallest_normal) == finite[fmt.code_of_smallest_normal]
    assert Fraction(fmt.smallest_subnormal) == positive[0]
    if fmt.code_of_smallest_subnormal is not None:
        assert finite[fmt.code_of_smallest_subnormal] == positive[0] < Fraction(fmt.smallest_normal)
    else:
        assert positive[0] == Fraction(fmt.smallest_normal)
    if fmt.emin <= 0 < fmt.emax and fmt.has_subnormals | (fmt.emin < 0):  # 1.0 normal, neighbours both sides
        # eps and epsneg are the spacings around 1.0
        above = min(v for v in positive if v > 1)
        below = max(v for v in finite.values() if v < 1)
        assert above - 1 == Fraction(fmt.eps) and 1 - below == Fraction(fmt.epsneg)
    # the code_of_* names, each against what the code decodes to
    for code in (fmt.code_of_nan,):
        assert (code is None) == (not fmt.has_nan)
        assert code is None or (code in fmt.nan_codes and fmt.exact_value(code) is None)
    for code, sign in ((fmt.code_of_posinf, 0), (fmt.code_of_neginf, fmt.sign_mask)):
        assert (code is None) == (not fmt.has_inf)
        assert code is None or (fmt.exact_value(code) is None and code not in fmt.nan_codes
                                and code & fmt.sign_mask == sign)
    assert (fmt.code_of_zero is None) == (not fmt.has_zero)
    assert fmt.code_of_zero is None or finite[fmt.code_of_zero] == 0
    assert (fmt.code_of_negzero is None) == (not fmt.has_negative_zero)
    if fmt.code_of_negzero is not None:
        assert finite[fmt.code_of_negzero] == 0 and fmt.code_of_negzero != fmt.code_of_zero
    assert (fmt.code_of_min is None) == (not fmt.signed)
    assert fmt.code_of_min is None or finite[fmt.code_of_min] == -Fraction(fmt.max) == min(finite.values())


@pytest.mark.parametrize("name", list(FORMATS))
def test_identities_registered(name):
    check_identities(FORMATS[name])


@given(user_formats())
def test_identities_user_formats(fmt):
    check_identities(fmt)


@pytest.mark.parametrize("name", list(FORMATS))
def test_same_as_ml_dtypes_finfo(name):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    if not hasattr(ml_dtypes, name):
        pytest.skip(f"ml_dtypes has no {name}")
    ref, fmt = ml_dtypes.finfo(getattr(ml_dtypes, name)), FORMATS[name]
    for attr in ("bits", "nmant", "nexp", "machep", "minexp", "maxexp"):
        assert getattr(fmt, attr) == int(getattr(ref, attr)), attr
    for attr in ("eps", "epsneg", "tiny", "smallest_normal", "smallest_subnormal", "max"):
        assert getattr(fmt, attr) == float(getattr(ref, attr)), attr
