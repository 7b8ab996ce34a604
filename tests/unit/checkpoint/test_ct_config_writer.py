"""One compressed-tensors config writer: a spec, an export and a rewrite of the same scheme write
the same ``quantization_config``, and it is what llm-compressor wrote for the committed fixtures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fp8ref.checkpoint import export_checkpoint, load_checkpoint, write_checkpoint
from fp8ref.io.safetensors import write_safetensors
from fp8ref.producers.compressed_tensors import to_ct_config
from fp8ref.spec import load_spec_dict

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "interop" / "checkpoints"
CASES = [("llmc_fp8", "FP8"), ("llmc_fp8_dynamic", "FP8_DYNAMIC"), ("llmc_fp8_block", "FP8_BLOCK")]


def _written_by_llm_compressor(fixture: str) -> dict:
    qc = json.loads((FIXTURES / fixture / "config.json").read_text())["quantization_config"]
    del qc["version"]  # compressed-tensors' own version: fp8ref does not claim to be it
    return qc


def _bf16_source(ckpt, folder: Path) -> Path:
    """The fixture's model with every quantized weight dequantized to bf16: an export source."""
    folder.mkdir()
    tensors = {f"{n}.weight": ("BF16", ckpt.dequantize(n, "bfloat16")) for n in ckpt}
    for n in ckpt.unquantized:
        info = ckpt.store.info(n)
        tensors[n] = (info.dtype, ckpt.store.get(n))
    write_safetensors(folder / "model.safetensors", tensors, {"format": "pt"})
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "dtype": "bfloat16"}))
    return folder


@pytest.mark.parametrize("fixture, preset", CASES)
def test_spec_export_and_rewrite_write_what_llm_compressor_writes(tmp_path, fixture, preset):
    want = _written_by_llm_compressor(fixture)
    spec = {"scheme": preset, "ignore": ["lm_head"]}
    from_spec = to_ct_config(load_spec_dict(spec), version="0.19")

    ckpt = load_checkpoint(FIXTURES / fixture)
    rewritten = write_checkpoint(ckpt, tmp_path / "rewrite", format="compressed-tensors")  # keeps its writer
    from_rewrite = json.loads((rewritten / "config.json").read_text())["quantization_config"]

    calibration = dict.fromkeys(ckpt, 1.0) if preset == "FP8" else None
    exported = export_checkpoint(_bf16_source(ckpt, tmp_path / "src"), tmp_path / "export", spec,
                                 format="compressed-tensors", calibration=calibration, config_version="0.19")
    from_export = json.loads((Path(exported) / "config.json").read_text())["quantization_config"]

    assert from_spec == want
    assert from_export == want
    assert from_rewrite == want
