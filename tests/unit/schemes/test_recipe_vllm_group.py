"""vllm-group (REFERENCE.md 4.4): per 1x128 group s = fp32(max(amax, 1e-10) / 448), q = e4m3(clamp(fp32(x / s))).

The expected bytes are computed here step by step with torch float32 arithmetic and the codec,
independently of the recipe engine that reads specs/recipes/vllm-group.yaml.
"""

import numpy as np
import pytest
import torch

from fp8ref import QuantArgs, encode, quantize
from fp8ref.errors import Fp8RefError

ARGS = QuantArgs(format="float8_e4m3fn", granularity="group", group_size=128, dynamic=True)


def expected(x: torch.Tensor):
    g = x.float().reshape(x.shape[0], -1, 128)
    amax = g.abs().amax(dim=-1, keepdim=True).clamp_min(1e-10)
    s = amax / 448.0
    q = (g / s).clamp(-448, 448).reshape(x.shape)
    return encode(q, "float8_e4m3fn"), s.reshape(x.shape[0], -1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_bytes_and_scales(dtype):
    torch.manual_seed(3)
    x = (torch.randn(6, 384) * torch.logspace(-3, 3, 384)).to(dtype)
    x[1, :128] = 0  # a zero group: amax floor 1e-10
    x[2, 5] = -0.0
    q = quantize(x, ARGS, recipe="vllm-group")
    codes, scale = expected(x)
    assert torch.equal(q.codes, codes)
    assert q.scale.dtype == torch.float32
    assert torch.equal(q.scale.view(torch.int32), scale.view(torch.int32))
    assert q.scale[1, 0].item() == np.float32(1e-10) / np.float32(448)


def test_group_must_divide():
    with pytest.raises(Fp8RefError, match="128"):
        quantize(torch.randn(2, 200), ARGS, recipe="vllm-group")
