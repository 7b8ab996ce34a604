"""``fp8ref quantize --spec`` with a block-scaled preset (MXFP4, MXFP8, NVFP4: their scheme names
fp8ref's element-scale recipe) and no --recipe uses the format's own block recipe and says which.
Evidence: the bytes llm-compressor 0.14.0.1 wrote for the same presets of the same original (the
committed llmc_* fixtures), tensor for tensor (NVFP4's input global scale comes from calibration
data, which differ, so it is left out); and verify re-derives the output with the recorded recipe."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fp8ref.checkpoint import write_calibration
from fp8ref.io.safetensors import open_store
from tests.support.cli import run_cli

CKPTS = Path(__file__).resolve().parents[2] / "fixtures" / "interop" / "checkpoints"
ORIGINAL = CKPTS / "original_fp4_mx_bf16"


@pytest.mark.parametrize("scheme, fixture, recipe", [("MXFP4", "llmc_mxfp4", "compressed-tensors-mx"),
                                                     ("MXFP8", "llmc_mxfp8", "compressed-tensors-mx"),
                                                     ("NVFP4", "llmc_nvfp4", "compressed-tensors-nvfp4")])
def test_a_block_preset_without_a_recipe_gets_the_formats_own(scheme, fixture, recipe, tmp_path, capsys):
    spec = tmp_path / "spec.yaml"
    spec.write_text(f"scheme: {scheme}\nignore: [lm_head]\n")
    store = open_store(ORIGINAL)
    layers = sorted(n[:-len(".weight")] for n in store if n.endswith("_proj.weight"))
    extra = []
    if scheme == "NVFP4":  # static input global scales need activation amax
        cal = tmp_path / "cal.json"
        write_calibration(cal, {n: 4.0 for n in layers})
        extra = ["--calibration", cal]
    assert run_cli("quantize", ORIGINAL, tmp_path / "out", "--spec", spec, *extra) == 0
    assert capsys.readouterr().out.strip().endswith(f"{len(layers)} quantized layers; recipe {recipe!r} for "
                                                   f"{len(layers)} layers")
    mine, tool = open_store(tmp_path / "out"), open_store(CKPTS / fixture)
    compared = [n for n in tool if n.startswith(tuple(layers)) and not n.endswith("input_global_scale")]
    assert len(compared) >= 2 * len(layers)
    for n in compared:
        assert mine.info(n).dtype == tool.info(n).dtype, n
        assert np.array_equal(np.asarray(mine.get(n, bf16_bits=True)).view(np.uint8),
                              np.asarray(tool.get(n, bf16_bits=True)).view(np.uint8)), n
    assert run_cli("verify", tmp_path / "out", "--original", ORIGINAL) == 0
    assert f"with recipe {recipe!r} (recorded in the checkpoint)" in capsys.readouterr().out


def test_an_element_recipe_given_for_block_layers_names_the_formats_own(tmp_path, capsys):
    spec = tmp_path / "spec.yaml"
    spec.write_text("scheme: MXFP4\nignore: [lm_head]\n")
    assert run_cli("quantize", ORIGINAL, tmp_path / "out", "--spec", spec, "--recipe", "fp8ref") == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fp8ref: error: ")
    assert err[0].endswith("recipe 'fp8ref' is not a mx recipe (leave --recipe out for the compressed-tensors "
                           "format's own, 'compressed-tensors-mx')")
    assert not (tmp_path / "out").exists()
