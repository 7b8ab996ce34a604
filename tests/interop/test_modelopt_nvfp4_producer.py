"""ModelOpt NVFP4 in ``mode="producer"``: the committed export (modelopt_nvfp4) dequantized and run as
ModelOpt 0.47.0's own ``NVFP4QTensor`` computes on CPU (tools/make_modelopt_nvfp4_producer.py wrote its
numbers to modelopt_nvfp4_producer.safetensors): weights, fake-quantized inputs and layer outputs bit
for bit, signed zeros included (code 0x8 dequantizes to +0.0 in ModelOpt, -0.0 in fp8ref's reference).
With nvidia-modelopt installed (tox -e modelopt) the same is checked against ModelOpt live on more inputs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from fp8ref.checkpoint import load_checkpoint
from fp8ref.cli import main
from fp8ref.io.safetensors import open_store

pytestmark = pytest.mark.interop

ROOT = Path(__file__).resolve().parents[1] / "fixtures" / "interop"
CKPT = ROOT / "checkpoints" / "modelopt_nvfp4"
PROBES = ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj", "model.layers.0.mlp.down_proj")


def _ref():
    store = open_store(ROOT / "modelopt_nvfp4_producer.safetensors")
    return {n: torch.from_numpy(np.asarray(store.get(n)).view(np.int16).copy()).view(torch.bfloat16) for n in store}


def _bits(t) -> torch.Tensor:
    return torch.as_tensor(np.asarray(t).view(np.int16)) if not isinstance(t, torch.Tensor) else \
        t.contiguous().view(torch.int16)


@pytest.mark.parametrize("layer", PROBES)
def test_producer_dequantize_is_nvfp4qtensor_dequantize(layer):
    ckpt, ref = load_checkpoint(CKPT), _ref()
    ours = ckpt.dequantize(layer, "bfloat16", mode="producer")
    assert torch.equal(_bits(ours), _bits(ref[f"{layer}.w"]))
    codes = ckpt[layer].weight_codes
    assert (codes == 0x8).any()  # the case that matters: ModelOpt's table has +0 at index 8
    reference = ckpt.dequantize(layer, "bfloat16")
    assert np.signbit(np.asarray(reference, np.float32)[codes == 0x8]).all()
    assert not np.signbit(np.asarray(ours, np.float32)[codes == 0x8]).any()


@pytest.mark.parametrize("layer", PROBES)
@pytest.mark.parametrize("kind", ["probe", "hard"])
def test_producer_forward_is_modelopt_qtensor_arithmetic(layer, kind):
    ckpt, ref = load_checkpoint(CKPT), _ref()
    y = ckpt[layer].forward(ref[f"{layer}.{kind}.x"], mode="producer")
    assert y.dtype == torch.bfloat16
    assert torch.equal(_bits(y), _bits(ref[f"{layer}.{kind}.y"]))


def test_compare_runs_the_fixture_in_producer_mode(tmp_path):
    pytest.importorskip("transformers")  # compare builds the model (fp8ref[hf]); the README's test run has none
    out = tmp_path / "cmp.json"
    assert main(["compare", str(CKPT), "--modes", "reference,producer", "--random", "1x8", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["format"] == "modelopt" and res["modes"] == ["reference", "producer"]
    assert set(res["end_to_end"]) == {"reference", "producer"}


def test_mxfp8_still_has_no_producer_mode():
    from fp8ref.errors import CheckpointError

    layer = load_checkpoint(ROOT / "checkpoints" / "modelopt_mxfp8")[PROBES[0]]
    with pytest.raises(CheckpointError, match="ModelOpt MXFP8: its in-memory fake quantization runs on CUDA only"):
        layer.forward(torch.zeros(1, 64, dtype=torch.bfloat16), mode="producer")


def test_against_modelopt_live_on_random_inputs():
    pytest.importorskip("modelopt")
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    ckpt = load_checkpoint(CKPT)
    g = torch.Generator().manual_seed(7)
    for layer in ckpt:
        q = ckpt[layer]
        m_in = torch.from_numpy(np.asarray(q.input_scale, np.float32).copy())
        for scale in (1e-3, 1.0, 50.0):
            x = (torch.randn(3, q.shape[1], generator=g) * scale).to(torch.bfloat16)
            x[0, :16] = 0
            qx, sx, _ = NVFP4QTensor.quantize(x, 16, weights_scaling_factor_2=m_in)
            x_qdq = qx.dequantize(dtype=torch.bfloat16, scale=sx, double_scale=m_in, block_sizes={-1: 16})
            w = torch.from_numpy(np.asarray(ckpt.dequantize(layer, "bfloat16", mode="producer")).view(np.int16)
                                 .copy()).view(torch.bfloat16)
            want = torch.nn.functional.linear(x_qdq, w)
            assert torch.equal(_bits(q.forward(x, mode="producer")), _bits(want)), (layer, scale)
