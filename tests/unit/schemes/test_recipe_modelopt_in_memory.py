"""Recipe ``modelopt-fp8-in-memory`` against ModelOpt 0.47.0's ``_fp8_eager`` (tensor_quant.py, the CPU
path of its FP8 fake quantization) transcribed in torch below: torch's float32 ops and its float8 cast
are the peer. tests/interop/test_modelopt_in_memory.py checks the transcription and the recipe against
ModelOpt itself."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fp8ref.errors import SpecError
from fp8ref.quant import QuantArgs, dequantize, fake_quant, quantize
from fp8ref.registry import RECIPES_DIR, load_recipes
from fp8ref.rounding import round_to

RECIPE = "modelopt-fp8-in-memory"
ALL_BF16 = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)


def modelopt_fp8_eager(x: torch.Tensor, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ModelOpt's arithmetic, line for line: (codes, fake-quantized x in x's dtype)."""
    amax = amax.to(torch.float32)
    zero = amax <= 1.0 / (1 << 24)
    safe = torch.where(zero, torch.ones_like(amax), amax)
    scale = 448.0 / safe
    scale_inv = 1 / scale
    q = (x.to(torch.float32) * scale).clamp(min=-448.0, max=448.0).to(torch.float8_e4m3fn)
    return q.view(torch.uint8), (q.to(torch.float32) * scale_inv).to(x.dtype)


def _same(ours: torch.Tensor, theirs: torch.Tensor) -> bool:
    """Bitwise, NaN by rule: NaN where theirs is NaN (payloads and signs of NaN not compared)."""
    nan = torch.isnan(theirs)
    if not torch.equal(torch.isnan(ours), nan):
        return False
    view = torch.int32 if theirs.dtype == torch.float32 else torch.int16
    return torch.equal(ours[~nan].view(view), theirs[~nan].view(view))


AMAXES = [3.78125, 1.0, 448.0, 0.0, 2.0 ** -24, 2.0 ** -25, 1e-30, 2.0 ** -24 * 1.0078125, 3.0e38,
          float("inf"), float("nan")]


@pytest.mark.parametrize("amax", AMAXES)
def test_every_bf16_value_under_a_static_amax(amax):
    """All 65,536 bf16 patterns (NaN, Inf, -0 included) through a calibrated per-tensor amax: codes
    and fake-quantized values. amax <= 2^-24 is a zero amax (m = 448), NaN stays NaN."""
    a = torch.tensor(amax, dtype=torch.bfloat16)
    codes, qdq = modelopt_fp8_eager(ALL_BF16, a)
    args = QuantArgs(granularity="tensor", dynamic=False)
    q = quantize(ALL_BF16, args, recipe=RECIPE, amax=a)
    x_nan = torch.isnan(ALL_BF16)
    nan_codes = (codes & 0x7F) == 0x7F
    assert torch.equal(q.codes[~nan_codes], codes[~nan_codes])
    assert torch.equal((q.codes[nan_codes] & 0x7F), codes[nan_codes] & 0x7F)  # NaN codes for NaN (sign free)
    assert bool(nan_codes[x_nan].all())
    assert _same(dequantize(q), qdq)
    assert _same(fake_quant(ALL_BF16, args, recipe=RECIPE, amax=a), qdq)


def test_zero_amax_threshold_is_at_most_2_to_minus_24():
    """The mask is ``amax <= 2^-24``: 2^-24 is a zero amax, the next bf16 above it is not; a recipe
    with only the amax == 0 rule (hf-fp8's) would give m = 448 / 2^-24 there."""
    for a, m in ((2.0 ** -24, 448.0), (2.0 ** -25, 448.0), (2.0 ** -24 * 1.0078125, None)):
        q = quantize(torch.tensor([a]), QuantArgs(granularity="tensor"), recipe=RECIPE)
        s = np.float32(q.scale.reshape(-1)[0])
        if m is not None:
            assert s == np.float32(1.0) / np.float32(m)
        else:
            assert s < np.float32(1e-9) and q.codes.item() == 0x7E  # a/fp32(1/m) -> 448
    x = torch.tensor([2.0 ** -24])
    assert quantize(x, QuantArgs(granularity="tensor"), recipe=RECIPE).codes.item() == 0x00  # 2^-24 * 448
    assert quantize(x, QuantArgs(granularity="tensor"), recipe="hf-fp8").codes.item() == 0x7E


def test_dynamic_token_amax_bf16_and_fp16():
    """Per-token dynamic scales (FP8_PER_CHANNEL_PER_TOKEN's input quantizer: amax over the last axis),
    with a zero token, a token at the threshold and one just above, -0 and heavy tails; per-channel
    weights are the same arithmetic per row."""
    g = torch.Generator().manual_seed(3)
    for dtype in (torch.bfloat16, torch.float16):
        x = (torch.randn(3, 9, 96, generator=g) * torch.exp(2 * torch.randn(3, 9, 96, generator=g))).to(dtype)
        x[0, 0] = 0.0
        x[0, 1] = 2.0 ** -24
        x[0, 2] = -(2.0 ** -24) * 1.0078125 if dtype == torch.bfloat16 else 2.0 ** -23
        x[0, 3, 5] = -0.0
        amax = x.abs().amax(dim=-1, keepdim=True)
        codes, qdq = modelopt_fp8_eager(x, amax)
        q = quantize(x, QuantArgs(granularity="token"), recipe=RECIPE)
        assert torch.equal(q.codes, codes)
        assert _same(dequantize(q), qdq)
        w = x.reshape(-1, 96)
        codes, qdq = modelopt_fp8_eager(w, w.abs().amax(dim=1, keepdim=True))
        assert _same(fake_quant(w, QuantArgs(granularity="channel"), recipe=RECIPE), qdq)


def test_dequantization_rounds_the_float32_product_again():
    """x.to(float32) * scale_inv, then .to(D): two roundings. Over every (finite code, 16-bit amax)
    pair they differ from one rounding of the exact product in 0 of 2,451,330 pairs for bf16 amax
    and output, and in 4,424 of 3,999,492 for fp16 ones; this is one: fp16 amax 0x3c01, code 0x07."""
    a = torch.tensor([1.0009765625], dtype=torch.float16)
    x = torch.tensor([0.013671875 * 1.0009765625 / 448.0], dtype=torch.float16)
    _, qdq = modelopt_fp8_eager(x, a)
    q = quantize(x, QuantArgs(granularity="tensor", dynamic=False), recipe=RECIPE, amax=a)
    assert q.codes.item() == 0x07  # 7/512
    ours = dequantize(q)
    once = round_to(np.float64(7 / 512) * q.scale.numpy().astype(np.float64), "float16")  # the exact product, once
    assert _same(ours, qdq) and ours.item() == 2.0 ** -15 and float(once[0]) == 3.057718276977539e-05


def test_zero_at_most_needs_a_zero_amax_scale(tmp_path):
    src = (RECIPES_DIR / f"{RECIPE}.yaml").read_text()
    (tmp_path / f"{RECIPE}.yaml").write_text(src.replace("    zero_amax: '1/448' ", "    zero_amax: null "))
    with pytest.raises(SpecError, match=r"steps.amax.zero_at_most: a zero amax needs its scale"):
        load_recipes(str(tmp_path))


@settings(max_examples=60, deadline=None)
@given(bits=st.lists(st.integers(0, 2 ** 32 - 1), min_size=1, max_size=64),
       amax=st.floats(0.0, allow_nan=False, allow_infinity=False, width=32),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
def test_any_input_dtype_and_float32_amax(bits, amax, dtype):
    """Random float32 bit patterns (NaN, Inf, subnormals) cast to the input dtype, any float32 amax."""
    x = torch.tensor(np.array(bits, np.uint32).view(np.float32)).to(dtype)
    a = torch.tensor(amax, dtype=torch.float32)
    codes, qdq = modelopt_fp8_eager(x, a)
    q = quantize(x, QuantArgs(granularity="tensor", dynamic=False), recipe=RECIPE, amax=a)
    keep = (codes & 0x7F) != 0x7F
    assert torch.equal(q.codes[keep], codes[keep]) and bool(((q.codes[~keep] & 0x7F) == 0x7F).all())
    assert _same(dequantize(q), qdq)
