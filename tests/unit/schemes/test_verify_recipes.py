"""verify's recipe bookkeeping: the recipe every export records, discovery among a format's known
recipes when none is recorded, and original tensor names through a producer's renaming table."""

from __future__ import annotations

import json

import numpy as np
import pytest

import fp8ref
from fp8ref.checkpoint import base
from fp8ref.errors import CheckpointError, ModelError
from fp8ref.io.safetensors import open_store, write_safetensors
from fp8ref.nn.verify import verify
from tests.support.checkpoint_builders import LLMC_NAMES, build_mixtral_original, write
from tests.support.cli import run_cli

EXPERT = "model.layers.0.block_sparse_moe.experts"


def _renamed(src, dst, rename, metadata=None):
    """A copy of checkpoint ``src`` with tensor names mapped by ``rename`` (and the shard metadata
    replaced when given): what llm-compressor writes for a Mixtral, or a file without a recipe record."""
    store = open_store(src / "model.safetensors")
    f = store.files["model.safetensors"]
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    write_safetensors(dst / "model.safetensors", {rename(n): (store.info(n).dtype, store.get(n)) for n in store},
                      f.metadata if metadata is None else metadata)
    return dst


def _llmc_name(name: str) -> str:
    for w, proj in LLMC_NAMES.items():
        name = name.replace(f".{w}.", f".{proj}.")
    return name


@pytest.fixture
def mixtral(tmp_path):
    orig = write(tmp_path / "orig", *build_mixtral_original())
    spec = {"scheme": "FP8_DYNAMIC", "ignore": ["re:.*gate$"]}
    fp8ref.export_checkpoint(orig, tmp_path / "ours", spec)
    return orig, _renamed(tmp_path / "ours", tmp_path / "llmc", _llmc_name, {"format": "pt"})  # as llm-compressor


def test_verify_maps_llm_compressor_mixtral_names_to_the_original(mixtral, capsys):
    orig, llmc = mixtral
    ckpt = fp8ref.load_checkpoint(llmc)
    assert f"{EXPERT}.0.down_proj" in ckpt and f"{EXPERT}.0.down_proj.weight" not in open_store(orig)
    r = verify(ckpt, fp8ref.load_checkpoint(orig))
    assert r["ok"] and len(r["layers"]) == 6 and (r["recipe"], r["recipe_source"]) == ("compressed-tensors",
                                                                                      "discovered")
    assert run_cli("verify", llmc, "--original", orig) == 0
    assert capsys.readouterr().out.strip().endswith(": OK")


def test_the_renaming_is_the_producers_own_table(mixtral):
    """w2 is down, w1 gate, w3 up: a table that swapped two would fail on the bytes, not on a name."""
    from fp8ref.producers import compressed_tensors as ct

    assert base.get("compressed-tensors").original_names is ct.ORIGINAL_NAMES
    orig, llmc = mixtral
    swapped = _renamed(llmc, llmc.parent / "swapped", lambda n: n.replace("gate_proj", "X").replace(
        "up_proj", "gate_proj").replace("X", "up_proj"))
    r = verify(fp8ref.load_checkpoint(swapped), fp8ref.load_checkpoint(orig))
    assert not r["ok"] and len(r["mismatched_layers"]) == 4  # gate and up of both experts


def test_a_name_no_table_explains_is_one_error(mixtral, tmp_path):
    orig, llmc = mixtral
    odd = _renamed(llmc, tmp_path / "odd", lambda n: n.replace("down_proj", "out_proj"))
    with pytest.raises(ModelError, match=r"no tensor 'model.layers.0.block_sparse_moe.experts.0.out_proj.weight' "
                                         r"for the quantized layer .* \(nor under the names its producer renamed"):
        verify(fp8ref.load_checkpoint(odd), fp8ref.load_checkpoint(orig))


def test_quantize_hf_fp8_then_verify_passes_on_fps_own_output(tmp_path, capsys):
    """FP8_BLOCK's recipe is compressed-tensors'; the hf-fp8 file records it, verify uses it."""
    orig = write(tmp_path / "orig", *build_mixtral_original(inter=128, hidden=128))
    spec = tmp_path.parent / f"{tmp_path.name}-block.yaml"
    spec.write_text("scheme: FP8_BLOCK\nignore: ['re:.*gate$']\n")
    assert run_cli("quantize", orig, tmp_path / "hf", "--spec", spec, "--format", "hf-fp8") == 0
    capsys.readouterr()
    assert run_cli("verify", tmp_path / "hf", "--original", orig, "--json", "-") == 0
    r = json.loads(capsys.readouterr().out)
    assert (r["recipe"], r["recipe_source"]) == ("compressed-tensors", "recorded")
    assert r["recipes"] == {"compressed-tensors": 6}
    # the same bytes without the record: found by trying hf-fp8's known recipes (its own first)
    bare = _renamed(tmp_path / "hf", tmp_path / "bare", lambda n: n, metadata={"format": "pt"})
    assert run_cli("verify", bare, "--original", orig) == 0
    assert "with recipe 'compressed-tensors' (found among the format's known recipes)" in capsys.readouterr().out
    assert run_cli("verify", bare, "--original", orig, "--recipe", "hf-fp8") == 1
    assert "MISMATCH in 6 layers" in capsys.readouterr().out


def test_recipe_record_round_trip_and_refusal(tmp_path):
    meta = base.with_recipes({"format": "pt"}, {"a.q": "x", "a.k": "x", "b.v": "y"})
    assert json.loads(meta[base.RECIPE_METADATA]) == {"x": ["a.k", "a.q"], "y": ["b.v"]}
    write_safetensors(tmp_path / "m.safetensors", {"t": ("F32", np.zeros(1, np.float32))}, meta)
    assert base.recorded_recipes(open_store(tmp_path / "m.safetensors")) == {"a.k": "x", "a.q": "x", "b.v": "y"}
    write_safetensors(tmp_path / "bad.safetensors", {"t": ("F32", np.zeros(1, np.float32))},
                      {base.RECIPE_METADATA: "[1, 2]"})
    with pytest.raises(CheckpointError, match=r"bad.safetensors: __metadata__.fp8ref_recipes: expected a JSON object"):
        base.recorded_recipes(open_store(tmp_path / "bad.safetensors"))


@pytest.mark.parametrize("scheme", ["FP8_DYNAMIC", "FP8_BLOCK"])
def test_verify_discovers_a_compressed_tensors_checkpoint_made_on_gpu(tmp_path, capsys, scheme):
    """Codes of the Triton path (compressed-tensors on CUDA/XPU) without a recipe record: the eager recipe
    does not reproduce them, verify finds compressed-tensors-gpu among the format's known recipes."""
    orig = write(tmp_path / "orig", *build_mixtral_original(inter=128, hidden=128))
    fp8ref.export_checkpoint(orig, tmp_path / "gpu", {"scheme": scheme, "ignore": ["re:.*gate$"]},
                             recipe="compressed-tensors-gpu")
    bare = _renamed(tmp_path / "gpu", tmp_path / "bare", lambda n: n, metadata={"format": "pt"})
    r = verify(fp8ref.load_checkpoint(bare), fp8ref.load_checkpoint(orig))
    assert r["ok"] and (r["recipe"], r["recipe_source"]) == ("compressed-tensors-gpu", "discovered")
    eager = verify(fp8ref.load_checkpoint(bare), fp8ref.load_checkpoint(orig), recipe="compressed-tensors")
    assert not eager["ok"]
    assert run_cli("verify", bare, "--original", orig) == 0
    assert "with recipe 'compressed-tensors-gpu' (found among the format's known recipes)" in capsys.readouterr().out
