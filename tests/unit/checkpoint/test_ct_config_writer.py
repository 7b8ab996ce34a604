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


@pytest.mark.parametrize("flag, version", [([], "0.20"), (["--ct-version", "0.19"], "0.19"),
                                            (["--ct-version", "0.20"], "0.20")])
def test_cli_ct_version_picks_the_writer(tmp_path, flag, version):
    from fp8ref.cli import main

    ckpt = load_checkpoint(FIXTURES / "llmc_fp8_dynamic")
    src = _bf16_source(ckpt, tmp_path / "src")
    (tmp_path / "spec.yaml").write_text("scheme: FP8_DYNAMIC\nignore: [lm_head]\n")
    assert main(["quantize", str(src), str(tmp_path / "out"), "--spec", str(tmp_path / "spec.yaml")] + flag) == 0
    qc = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert ("moe_sparsity_config" in qc) == (version == "0.20")
    assert qc == to_ct_config(load_spec_dict({"scheme": "FP8_DYNAMIC", "ignore": ["lm_head"]}), version=version)
    if version == "0.19":
        assert qc == _written_by_llm_compressor("llmc_fp8_dynamic")
    # convert keeps the numbers and writes the config of the version asked for
    assert main(["convert", str(tmp_path / "out"), str(tmp_path / "conv"), "--format", "compressed-tensors",
                 "--ct-version", "0.19"]) == 0
    assert json.loads((tmp_path / "conv" / "config.json").read_text())["quantization_config"] == \
        _written_by_llm_compressor("llmc_fp8_dynamic")


def test_ct_version_for_another_format_is_one_error_and_writes_nothing(tmp_path, capsys):
    from fp8ref.cli import main

    src = _bf16_source(load_checkpoint(FIXTURES / "llmc_fp8_dynamic"), tmp_path / "src")
    (tmp_path / "spec.yaml").write_text("scheme: FP8_DYNAMIC\nignore: [lm_head]\n")
    rc = main(["quantize", str(src), str(tmp_path / "out"), "--spec", str(tmp_path / "spec.yaml"),
               "--format", "hf-fp8", "--ct-version", "0.19"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc != 0 and len(err) == 1 and not (tmp_path / "out").exists()
    assert err[0] == "fp8ref: error: config version '0.19' for the hf-fp8 format: expected none: the format has one " \
                     "config writer"
