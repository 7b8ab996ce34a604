"""Zero-copy views between uint8 codes and torch float8 dtypes."""

import pytest
import torch

from fp8ref import FORMATS, decode, view_as_codes, view_as_float8
from fp8ref.codec import torch_dtype
from fp8ref.errors import FormatError, InputTypeError

TORCH_FORMATS = [name for name, fmt in FORMATS.items() if fmt.torch_dtype_name and hasattr(torch, fmt.torch_dtype_name)]


@pytest.mark.parametrize("name", TORCH_FORMATS)
def test_views_share_memory_and_round_trip(name):
    codes = torch.arange(256, dtype=torch.uint8).reshape(16, 16)
    f8 = view_as_float8(codes, name)
    assert f8.dtype == getattr(torch, FORMATS[name].torch_dtype_name)
    assert f8.data_ptr() == codes.data_ptr()
    back = view_as_codes(f8)
    assert back.dtype == torch.uint8 and back.data_ptr() == codes.data_ptr()
    assert torch.equal(back, codes)


def test_formats_torch_lacks_have_no_dtype():
    assert torch_dtype("float4_e2m1fn") is None
    with pytest.raises(FormatError, match="torch has no dtype for float8_e4m3b11fnuz"):
        view_as_float8(torch.zeros(2, dtype=torch.uint8), "float8_e4m3b11fnuz")


def test_view_rejects_wrong_inputs():
    with pytest.raises(InputTypeError, match="expected a torch.uint8 tensor"):
        view_as_float8(torch.zeros(2, dtype=torch.int8), "float8_e4m3fn")
    with pytest.raises(InputTypeError, match="expected a torch float8 tensor"):
        view_as_codes(torch.zeros(2, dtype=torch.float32))


def test_decode_of_a_view_equals_torch_cast_on_finite_codes():
    """Peer check: torch's float8 -> float32 cast agrees with decode on every non-NaN e4m3fn code."""
    codes = torch.arange(256, dtype=torch.uint8)
    finite = (codes & 0x7F) != 0x7F
    ours = decode(codes, "float8_e4m3fn")
    theirs = view_as_float8(codes, "float8_e4m3fn").float()
    assert torch.equal(ours[finite].view(torch.int32), theirs[finite].view(torch.int32))
    assert torch.isnan(ours[~finite]).all() and torch.isnan(theirs[~finite]).all()
