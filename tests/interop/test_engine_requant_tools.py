"""``fp8ref explain --target blackwell``'s DeepGEMM UE8M0 requantization against the engines' own
code on CPU (``tox -e tools``, marker ``tools``; each test skips when its engine is absent):

* vLLM 0.33.0's ``requant_weight_ue8m0_inplace`` (fp8_utils.py, with its own ``per_block_cast_to_fp8``
  from vllm/utils/deep_gemm.py), run as it is on CPU tensors;
* SGLang 0.5.23's ``requant_weight_ue8m0`` arithmetic: ``block_quant_dequant(..., torch.bfloat16)`` then
  its ``per_block_cast_to_fp8`` (DeepGEMM's copy), executed from its files (tests/support/producer_tools.py).

Every code and every scale of every 128x128 block-FP8 layer of the committed fixtures, and crafted scales
a few float32 steps above a power of two, where vLLM's float32 log2 and DeepGEMM's exponent bit rule part.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fp8ref.checkpoint import load_checkpoint
from fp8ref.checkpoint.engine import ue8m0_costs
from fp8ref.codec import encode

torch = pytest.importorskip("torch")

from tests.support import producer_tools  # noqa: E402

pytestmark = pytest.mark.tools
ROOT = Path(__file__).resolve().parents[1] / "fixtures" / "interop" / "checkpoints"
FIXTURES = ("llmc_deepseek_v3_fp8_block", "llmc_qwen3_moe_fp8_block", "hf_fp8_ue8m0", "llmc_fp8_block")


class _Layer:
    """A block-FP8 layer made of crafted codes and scales (what ue8m0_costs reads of a layer)."""

    def __init__(self, codes, scale):
        self.weight_codes, self.weight_scale = codes, scale
        self.quant = type("Q", (), {"weight_fmt": "float8_e4m3fn", "block": (128, 128)})()


def _block_layers():
    for fx in FIXTURES:
        for name, layer in load_checkpoint(ROOT / fx).items():
            if layer.quant.weight_strategy == "block" and tuple(layer.quant.block) == (128, 128):
                yield f"{fx}:{name}", layer.weight_codes, np.asarray(layer.weight_scale, np.float32), layer


def _log2_edge():
    """Blocks whose max code is 448 with scales 2**e * (1 + n * 2**-23): float32 log2 rounds some to e."""
    rng = np.random.default_rng(7)
    codes = encode(rng.standard_normal((256, 512)).astype(np.float32) * 60, "float8_e4m3fn")
    codes[::128, ::128] = 0x7E  # 448 in every block
    scale = np.array([[2.0 ** 10 * (1 + 2 ** -23), 2.0 ** 10 * (1 + 2 * 2 ** -23), 2.0 ** -7 * (1 + 2 ** -23), 0.3],
                      [2.0 ** 100 * (1 + 20 * 2 ** -23), 2.0 ** -20, 2.0 ** 3 * (1 + 2 ** -22), 1e-3]], np.float32)
    return codes, scale


def _vllm_requant(codes, scale):
    mods = producer_tools.vllm_modules()
    if mods is None:
        pytest.skip("vLLM is not installed (tox -e tools)")
    w = torch.from_numpy(codes.copy()).view(torch.float8_e4m3fn)
    s = torch.from_numpy(scale.copy())
    mods["fp8_utils"].requant_weight_ue8m0_inplace(w, s, (128, 128))
    return w.view(torch.uint8).numpy(), s.numpy()


def _sglang_requant(codes, scale):
    fns = producer_tools.sglang_fp8_functions()
    if fns is None:
        pytest.skip("SGLang is not installed (tox -e tools)")
    w = torch.from_numpy(codes.copy()).view(torch.float8_e4m3fn)
    dq = fns["block_quant_dequant"](w, torch.from_numpy(scale.copy()), [128, 128], torch.bfloat16)
    q, s = fns["per_block_cast_to_fp8"](dq)
    return q.view(torch.uint8).numpy(), s.numpy()


def test_vllm_requant_weight_ue8m0_inplace_matches_every_code_and_scale():
    n = 0
    for name, codes, scale, layer in _block_layers():
        want_codes, want_scale = _vllm_requant(codes, scale)
        got = ue8m0_costs(layer, "vllm-block-ue8m0", ("float32",))
        assert np.array_equal(got["codes"], want_codes), name
        assert np.array_equal(got["scale"], want_scale.astype(np.float64)), name
        n += 1
    assert n == 76


def test_sglang_requant_weight_ue8m0_matches_every_code_and_scale():
    n = 0
    for name, codes, scale, layer in _block_layers():
        want_codes, want_scale = _sglang_requant(codes, scale)
        got = ue8m0_costs(layer, "deepgemm-ue8m0", ("float32", "bfloat16"))
        assert np.array_equal(got["codes"], want_codes), name
        assert np.array_equal(got["scale"], want_scale.astype(np.float64)), name
        n += 1
    assert n == 76


def test_scales_just_above_a_power_of_two_part_the_engines():
    """A block whose max code is 448 with scale 2**10 * (1 + 2**-23): vLLM's torch.log2 rounds the new
    scale's log2 down to 10 (scale 2**10, the 448 codes stay); DeepGEMM's exponent bit rule on the same
    float32 tensor takes 2**11 (codes halve); SGLang's bfloat16 dequantization rounds 448 * s to
    448 * 2**10 first, so it keeps 2**10 too. Elsewhere its extra bf16 rounding changes codes."""
    codes, scale = _log2_edge()
    layer = _Layer(codes, scale)
    v_codes, v_scale = _vllm_requant(codes, scale)
    s_codes, s_scale = _sglang_requant(codes, scale)
    v = ue8m0_costs(layer, "vllm-block-ue8m0", ("float32",))
    s = ue8m0_costs(layer, "deepgemm-ue8m0", ("float32", "bfloat16"))
    exact_rule = ue8m0_costs(layer, "deepgemm-ue8m0", ("float32",))
    assert np.array_equal(v["codes"], v_codes) and np.array_equal(v["scale"], v_scale.astype(np.float64))
    assert np.array_equal(s["codes"], s_codes) and np.array_equal(s["scale"], s_scale.astype(np.float64))
    assert (v_scale[0, 0], s_scale[0, 0], exact_rule["scale"][0, 0]) == (2.0 ** 10, 2.0 ** 10, 2.0 ** 11)
    assert not np.array_equal(v["scale"], exact_rule["scale"])
    assert not np.array_equal(v_codes, s_codes)
