"""Block-scaled layers through a backend: ``backend:NAME`` runs 128x128-block / 1x128-group layers
as the golden scaled_mm's ``block128`` case; with a backend computing fp8ref's own model
(tests/support/broken_backends.BlockMM) every output equals mode ``reference`` bit for bit."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import fp8ref
from fp8ref.errors import ModelError
from fp8ref.nn import Fp8RefLinear, load_unquantized, swap_linears
from fp8ref.nn.compare import compare
from tests.support.broken_backends import BlockMM, SwapsBlockScales
from tests.support.checkpoint_builders import build_hf, write
from tests.support.tiny_llama import TinyLlama

CKPTS = Path(__file__).resolve().parents[2] / "fixtures" / "interop" / "checkpoints"
IDS = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(3))
# K and N over several 128-blocks, ragged at the edges
WIDE = {"model.layers.0.mlp.up_proj": (320, 200), "model.layers.0.mlp.down_proj": (200, 320)}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def test_block_model_in_backend_mode_equals_reference():
    """llm-compressor's FP8_BLOCK checkpoint (128x128 weight blocks, dynamic 1x128 input groups) in the
    tiny Llama: every layer runs the backend's block128 scaled_mm; nothing diverges."""
    ckpt = fp8ref.load_checkpoint(CKPTS / "llmc_fp8_block")
    m = TinyLlama(torch.bfloat16)
    swap_linears(m, ckpt, backend=BlockMM())
    load_unquantized(m, ckpt)
    r = compare(m, IDS, ["reference", "backend:mm-block"])
    assert r["first_divergent"]["backend:mm-block"] == {"teacher_forced": None, "free_running": None}
    tf = r["layers"][0]["teacher_forced"]["backend:mm-block"]
    assert tf["scaled_mm"]["scales"] == "block128" and tf["max_ulp"] == 0
    assert r["end_to_end"]["backend:mm-block"]["max_abs_diff"] == 0.0


class Wide(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList([torch.nn.Module()])
        self.model.layers[0].mlp = torch.nn.Module()
        for name, (out, inp) in WIDE.items():
            setattr(self.model.layers[0].mlp, name.rsplit(".", 1)[1], torch.nn.Linear(inp, out, bias=False))

    def forward(self, x):
        mlp = self.model.layers[0].mlp
        return mlp.down_proj(mlp.up_proj(x))


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    tensors, config = build_hf(1, block=128, layers=WIDE)
    return fp8ref.load_checkpoint(write(tmp_path_factory.mktemp("wide"), tensors, config))


@pytest.mark.parametrize("acc", ["exact", "fp32"])
def test_multi_block_layers_equal_reference_and_a_swapped_layout_does_not(wide, acc):
    x = (torch.randn(3, 5, 200, generator=torch.Generator().manual_seed(0)) * 4).to(torch.bfloat16)

    class Only(BlockMM):
        capabilities = {"scaled_mm": {**BlockMM.capabilities["scaled_mm"], "accumulate": (acc,)}}

    class SwappedOnly(SwapsBlockScales):
        capabilities = Only.capabilities

    m = Wide().to(torch.bfloat16)
    rep = swap_linears(m, wide, mode=f"reference:{acc}", backend={"good": Only(), "swapped": SwappedOnly()})
    assert sorted(rep.swapped) == sorted(WIDE) and not rep.unplaced
    layer = m.model.layers[0].mlp.up_proj
    assert isinstance(layer, Fp8RefLinear) and layer.layer.quant.block == (128, 128)
    ref = layer.run(x)
    good = layer.run(x, "backend:good")
    assert layer.last_backend_params == {"format": "float8_e4m3fn", "scales": "block128", "out_dtype": "bfloat16",
                                         "bias": False, "accumulate": acc, "scale_order": "epilogue"}
    assert torch.equal(_bits(good), _bits(ref))
    assert not torch.equal(_bits(layer.run(x, "backend:swapped")), _bits(ref))
    for mode in ("backend:good",):
        fp8ref.nn.set_mode(m, mode)
        y = m(x)
        fp8ref.nn.set_mode(m, f"reference:{acc}")
        assert torch.equal(_bits(y), _bits(m(x)))


def test_other_block_sizes_are_refused(tmp_path):
    tensors, config = build_hf(2)  # 16x16 blocks
    ckpt = fp8ref.load_checkpoint(write(tmp_path / "c", tensors, config))
    name = "model.layers.0.mlp.down_proj"
    lin = Fp8RefLinear(ckpt[name], backend=BlockMM())
    with pytest.raises(ModelError, match=r"down_proj: weight blocks \[16, 16\].*128x128 weight blocks"):
        lin.run(torch.ones(2, 48, dtype=torch.bfloat16), "backend:mm-block")
    assert np.isfinite(lin.run(torch.ones(2, 48, dtype=torch.bfloat16)).float().numpy()).all()
