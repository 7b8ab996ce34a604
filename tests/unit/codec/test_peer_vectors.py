"""Peers' own hard-coded codec vectors, read as data (issue #24).

torchao's FP4 cases (pytorch/ao test/prototype/mx_formats/test_custom_cast.py, ``test_fp4_*``): each row
is (fp32 input, the value it must quantize to, its sign-exponent-mantissa bits), checked there for both
signs by ``f32_to_f4_unpacked`` / ``f4_unpacked_to_f32`` (CPU code). They are copied here as numbers
and judged against fp8ref's codec: every one agrees. (microxcaling's corner cases, mx/tests/
test_corners_mx.py, hold hard-coded data too, but for MXINT4/INT8 elements and blocks of 4 or 10, which
fp8ref does not define, and for NaN/Inf propagation through a block, which fp8ref's MX recipes refuse:
nothing of theirs is comparable. docs/findings.md.)
"""

from __future__ import annotations

import numpy as np
import pytest

import fp8ref

# (input, expected value, expected bits without the sign), torchao's test_fp4_0_0 ... test_fp4_6_0
TORCHAO_FP4 = [
    (0.25, 0.0, "000"), (0.1, 0.0, "000"), (0.0, 0.0, "000"),
    (0.6, 0.5, "001"), (0.5, 0.5, "001"), (0.4, 0.5, "001"),
    (1.25, 1.0, "010"), (1.1, 1.0, "010"), (1.0, 1.0, "010"), (0.9, 1.0, "010"), (0.75, 1.0, "010"),
    (1.6, 1.5, "011"), (1.5, 1.5, "011"), (1.4, 1.5, "011"),
    (2.5, 2.0, "100"), (2.1, 2.0, "100"), (2.0, 2.0, "100"), (1.9, 2.0, "100"), (1.75, 2.0, "100"),
    (3.1, 3.0, "101"), (3.0, 3.0, "101"), (2.9, 3.0, "101"),
    (5.0, 4.0, "110"), (4.1, 4.0, "110"), (4.0, 4.0, "110"), (3.9, 4.0, "110"), (3.5, 4.0, "110"),
    (6.1, 6.0, "111"), (6.0, 6.0, "111"), (5.9, 6.0, "111"),
]


@pytest.mark.parametrize("sign", ["0", "1"])
def test_torchao_fp4_vectors(sign):
    s = 1.0 if sign == "0" else -1.0
    x = np.array([s * v for v, _, _ in TORCHAO_FP4], np.float32)  # torch.tensor(f32_val): float32
    codes = fp8ref.encode(x, "float4_e2m1fn", saturate=True, rounding="rne")
    assert [f"{int(c):04b}" for c in codes] == [sign + bits for _, _, bits in TORCHAO_FP4]
    values = fp8ref.decode(codes, "float4_e2m1fn")
    assert values.tolist() == [s * ref for _, ref, _ in TORCHAO_FP4]  # -0.0 == 0.0, as torchao compares
