"""eval's and compare's refusal of non-finite logits tests the bit patterns (one integer max) instead
of torch.isfinite: the same answer for every bfloat16 and float16 pattern, float32's special ones."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from fp8ref.errors import ModelError  # noqa: E402
from fp8ref.nn.compare import _all_finite, refuse_nonfinite  # noqa: E402


@pytest.mark.parametrize("dtype, itype", [(torch.bfloat16, torch.int16), (torch.float16, torch.int16)])
def test_every_16_bit_pattern(dtype, itype):
    patterns = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(itype)
    values = patterns.view(dtype)
    finite = torch.isfinite(values)
    ones = torch.ones(3, dtype=dtype)
    got = []
    for v in values:
        ones[1] = v
        got.append(_all_finite(ones))
    assert got == finite.tolist()
    assert int((~finite).sum()) == (2 * 128 if dtype == torch.bfloat16 else 2 * 1024)


def test_float32_specials_and_other_dtypes():
    specials = np.array([0x7F800000, 0xFF800000, 0x7F800001, 0xFFC00000, 0x7FFFFFFF, 0x7F7FFFFF, 0xFF7FFFFF, 0,
                         0x80000000, 1], np.uint32).view(np.float32)
    for v in specials:
        t = torch.tensor([0.5, 0.0, -2.0], dtype=torch.float32)
        t[1] = torch.from_numpy(np.array([v]))[0]
        assert _all_finite(t) == bool(torch.isfinite(t).all())
    assert _all_finite(torch.tensor([1.0, 2.0], dtype=torch.float64))
    assert not _all_finite(torch.tensor([1.0, float("inf")], dtype=torch.float64))
    assert _all_finite(torch.zeros(0, dtype=torch.bfloat16))


def test_refusal_counts_as_before():
    logits = torch.zeros(2, 3, 4, dtype=torch.bfloat16)[:, :, ::2]  # a strided view
    logits[1, 2, 1] = float("nan")
    logits[0, 0, 0] = float("-inf")
    with pytest.raises(ModelError, match=r"^eval: x: 2 of 12 logits are not finite"):
        refuse_nonfinite(logits, "eval: x")
    refuse_nonfinite(torch.ones(2, 2, dtype=torch.bfloat16), "never")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_pieces_find_a_nonfinite_value_wherever_it_is(dtype, monkeypatch):
    """The check runs in pieces (its buffer bounded, not a second array the size of the logits):
    a NaN or Inf at either end of any piece, in the last short piece or in a non-contiguous view
    is found, and all-finite logits pass."""
    import fp8ref.nn.compare as compare

    monkeypatch.setattr(compare, "_FINITE_PIECE", 7)
    logits = torch.linspace(-3.0, 3.0, 50).to(dtype).reshape(5, 10)
    assert _all_finite(logits) and _all_finite(logits.t())
    for i in range(logits.numel()):
        for bad in (float("nan"), float("inf"), -float("inf")):
            t = logits.clone()
            t.view(-1)[i] = bad
            assert not _all_finite(t) and not _all_finite(t.t()), (i, bad)
