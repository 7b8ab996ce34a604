"""``fp8ref verify`` on every committed NVFP4 and MX checkpoint made by a real tool: each re-derives all
codes, block-scale bytes and NVFP4 global scales from the original weights (original_fp4_mx_bf16,
the one model all of them quantized) and names the recipe that made it. NVFP4 globals come from the
fused q/k/v and gate/up amax, as both tools share them: with each layer's own amax 3 of 7 layers
mismatch (k_proj, v_proj, up_proj: the global scale and 83-408 codes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fp8ref.checkpoint import load_checkpoint
from fp8ref.cli import main
from fp8ref.nn.verify import original_weight, verify_layer

pytestmark = pytest.mark.interop

ROOT = Path(__file__).resolve().parents[1] / "fixtures" / "interop" / "checkpoints"
ORIGINAL = ROOT / "original_fp4_mx_bf16"
RECIPE = {"llmc_mxfp4": "compressed-tensors-mx", "llmc_mxfp8": "compressed-tensors-mx",
          "llmc_nvfp4": "compressed-tensors-nvfp4", "llmc_nvfp4a16": "compressed-tensors-nvfp4",
          "modelopt_nvfp4": "modelopt-nvfp4", "modelopt_mxfp8": "modelopt-mxfp8", "quark_mxfp4": "quark-mxfp4",
          "ct020_mxfp6a16": "compressed-tensors-mx-0.20", "ct020_mxfp6a8": "compressed-tensors-mx-0.20",
          "ct020_mxfp4xfp8": "compressed-tensors-mx", "ct020_mxfp8": "compressed-tensors-mx"}


@pytest.mark.parametrize("name", sorted(RECIPE))
def test_verify_reproduces_every_byte_and_names_the_recipe(name, tmp_path, capsys):
    out = tmp_path / "report.json"
    assert main(["verify", str(ROOT / name), "--original", str(ORIGINAL), "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["ok"] and res["recipes"] == {RECIPE[name]: 7}
    assert res["unquantized"] == {"checked": 5, "mismatched": [], "why": [], "cast": {}, "missing_in_original": []}
    assert res["missing"] == [] and res["missing_layers"] == {}
    for layer in res["layers"]:
        assert layer["code_mismatches"] == layer["scale_mismatches"] == 0
        assert layer["recipe_source"] == "discovered"
        if "nvfp4" in name:
            assert layer["global_scale"] == "ok"


@pytest.mark.parametrize("name", ["llmc_nvfp4", "modelopt_nvfp4"])
def test_a_layers_own_amax_is_not_the_global_the_tools_wrote(name):
    ckpt, original = load_checkpoint(ROOT / name), load_checkpoint(ORIGINAL)
    bad = {}
    for n in ckpt:
        r = verify_layer(ckpt[n], original_weight(ckpt[n], original), RECIPE[name], None, ckpt.dtype)
        if r["code_mismatches"] or r["scale_mismatches"]:
            bad[n.rsplit(".", 1)[1]] = r["global_scale"]
    assert sorted(bad) == ["k_proj", "up_proj", "v_proj"]
    assert all(g.startswith("mismatch") for g in bad.values())
