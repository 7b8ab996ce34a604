"""ulp_distance against independent enumeration: the sorted list of every finite value of the
format (from the Fraction oracle), where the distance is the difference of list positions."""

import numpy as np
import pytest

import fp8ref
from fp8ref import FORMATS, ulp_distance
from fp8ref.errors import EncodeError, InputTypeError
from tests.support import oracle


def _grid(fmt):
    """Every finite value once (+0 and -0 one point), sorted, from the oracle."""
    vals = set()
    for c in range(1 << FORMATS[fmt].bits):
        v = oracle.decode(c, FORMATS[fmt])
        if v is not None and abs(v) != float("inf"):
            vals.add(float(v))
    return sorted(vals)


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2", "float4_e2m1fn", "float8_e8m0fnu"])
def test_ulp_distance_is_the_distance_in_the_sorted_grid(fmt):
    grid = _grid(fmt)
    rng = np.random.default_rng(0)
    i, j = rng.integers(0, len(grid), 300), rng.integers(0, len(grid), 300)
    a, b = np.array(grid)[i], np.array(grid)[j]
    assert np.array_equal(ulp_distance(a, b, fmt), np.abs(i - j))


def test_float_dtypes_and_signed_zero_and_infinity():
    one_up = np.nextafter(np.float32(1), np.float32(2))
    assert ulp_distance(np.float32(1), one_up, "float32") == 1
    assert ulp_distance(-0.0, 0.0, "bfloat16") == 0
    assert ulp_distance(np.float32(-2.0 ** -133), np.float32(2.0 ** -133), "bfloat16") == 2  # smallest subnormals
    assert ulp_distance(65504.0, float("inf"), "float16") == 1
    assert ulp_distance(448.0, 416.0, fp8ref.FORMATS["float8_e4m3fn"]) == 1


def test_torch_dtype_names_the_format_and_bad_inputs_are_errors():
    torch = pytest.importorskip("torch")
    assert ulp_distance(1.0, 1.125, torch.float8_e4m3fn) == 1
    with pytest.raises(EncodeError, match=r"^b = 1.1 is not a float8_e4m3fn value"):
        ulp_distance(1.0, 1.1, "float8_e4m3fn")
    with pytest.raises(EncodeError, match="is not a bfloat16 value"):
        ulp_distance(1.0, 1.001, "bfloat16")
    with pytest.raises(InputTypeError, match="NaN has no ULP distance"):
        ulp_distance(float("nan"), 1.0, "float32")
