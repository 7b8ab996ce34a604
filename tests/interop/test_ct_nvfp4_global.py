"""compressed-tensors' NVFP4 global scale is torch's ``2688.0 / t`` on the bf16 amax, i.e.
``bf16(bf16(1/A) * 2688)`` (two roundings), not 2688/A rounded once: checked on compressed-tensors'
own generate_gparam for every finite bf16 and fp16 A, and on a weight whose amax splits the two rules
(A = 0.08447265625: 31744 stored, 31872 by one rounding), through calculate_qparams and quantize."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("compressed_tensors")
from compressed_tensors.quantization.lifecycle.forward import quantize as ct_quantize  # noqa: E402
from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme  # noqa: E402
from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam  # noqa: E402

from fp8ref.formats import FORMATS  # noqa: E402
from fp8ref.quant import QuantArgs, nvfp4_producer_global, quantize  # noqa: E402
from fp8ref.registry import get_recipe  # noqa: E402

pytestmark = pytest.mark.interop
REC = get_recipe("compressed-tensors-nvfp4")
ONE_ROUNDING = replace(REC, global_rule="clamp-amax")  # the rule before the fix


@pytest.mark.parametrize("dtype,name,top", [(torch.bfloat16, "bfloat16", 0x7F80), (torch.float16, "float16", 0x7C00)])
def test_global_scale_is_generate_gparams_for_every_amax(dtype, name, top):
    amax = torch.arange(0, top, dtype=torch.int32).to(torch.int16).view(dtype)
    amax = torch.cat([amax, torch.tensor([float("inf"), float("nan")], dtype=dtype)])
    bad, one_rounding_bad = [], 0
    for a in amax:
        tool = generate_gparam(torch.zeros(1, dtype=dtype), a.reshape(1))
        ours = nvfp4_producer_global(a.item(), REC, name)
        if np.float32(ours).view(np.uint32) != np.float32(tool.item()).view(np.uint32):
            bad.append((a.item(), tool.item(), float(ours)))
        one_rounding_bad += float(nvfp4_producer_global(a.item(), ONE_ROUNDING, name)) != tool.item()
    assert bad == []
    assert one_rounding_bad > 1000  # the old rule missed thousands of amax values (bf16: 8652, fp16: 7079)


def _ct_nvfp4(x):
    """(global, block scales, E2M1 values) as compressed-tensors computes them for a weight."""
    args = preset_name_to_scheme("NVFP4A16", ["Linear"]).weights  # scale_dtype float8_e4m3fn
    g = generate_gparam(x.amin().reshape(1), x.amax().reshape(1))
    blocks = x.reshape(x.shape[0], -1, 16)
    scale, zp = calculate_qparams(blocks.amin(-1), blocks.amax(-1), args, global_scale=g)
    q = ct_quantize(x, scale, zp, args, global_scale=g)
    return g, scale, q


def test_weight_whose_amax_splits_the_two_roundings():
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(64, 256, generator=gen) * 0.02).clamp(-0.08, 0.08)
    x[5, 17] = 0.08447265625
    x = x.to(torch.bfloat16)
    g, scale, q = _ct_nvfp4(x)
    assert g.item() == 31744.0
    ours = quantize(x, QuantArgs(format="float4_e2m1fn", granularity="nvfp4"), recipe="compressed-tensors-nvfp4")
    assert float(np.asarray(ours.global_scale).reshape(-1)[0]) == 31744.0
    tool_scale = scale.reshape(-1).to(torch.float8_e4m3fn).view(torch.uint8).numpy()  # e4m3 values: exact
    assert np.array_equal(np.asarray(ours.scale_codes).reshape(-1), tool_scale)
    e2m1 = FORMATS["float4_e2m1fn"]
    mags = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)
    codes = np.asarray(ours.codes).reshape(-1)
    values = np.where(codes & e2m1.sign_mask, -mags[codes & 7], mags[codes & 7])
    tool = q.float().reshape(-1).numpy()
    assert np.array_equal(values, tool) and np.array_equal(np.signbit(values), np.signbit(tool))
    before = quantize(x, QuantArgs(format="float4_e2m1fn", granularity="nvfp4"), recipe=ONE_ROUNDING)
    assert float(np.asarray(before.global_scale).reshape(-1)[0]) == 31872.0
    assert (np.asarray(before.scale_codes).reshape(-1) != tool_scale).sum() > 0
