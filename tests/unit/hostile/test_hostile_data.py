"""Hostile corpus, issue #10 item 4 (data side): untrusted JSON and YAML are type-checked field by
field before use. Each case gave a traceback (RecursionError, TypeError unhashable, OverflowError,
ValueError) and is now a one-line Fp8RefError naming the file and the key or tensor."""

from __future__ import annotations

import json
import struct

import pytest

from fp8ref.checkpoint import load_checkpoint
from fp8ref.cli import main
from fp8ref.errors import CheckpointError, Fp8RefError, SpecError
from fp8ref.io.files import parse_json
from fp8ref.io.safetensors import SafetensorsFile
from fp8ref.io.yaml import load_yaml_string
from fp8ref.spec import load_spec_string
from tests.support.checkpoint_builders import build_autoround, build_ct, write


def _one_line(exc: Exception) -> str:
    text = str(exc)
    assert isinstance(exc, Fp8RefError) and "\n" not in text and len(text) < 600, text
    return text


# --- JSON ------------------------------------------------------------------------------------

@pytest.mark.parametrize("text", ["[" * 100_000 + "]" * 100_000, '{"a":' * 5_000 + "1" + "}" * 5_000,
                                  "[" * 65 + "]" * 65])
def test_deeply_nested_json_is_refused(text):
    with pytest.raises(CheckpointError) as exc:
        parse_json(text, "x.json", "config")
    assert _one_line(exc.value) == "x.json: config is nested deeper than 64 levels"


def test_a_5000_digit_integer_in_json_is_an_error():
    with pytest.raises(CheckpointError, match=r"^x.json: config is not valid JSON: Exceeds the limit"):
        parse_json('{"a": ' + "9" * 5000 + "}", "x.json", "config")


def test_deeply_nested_index_and_config(tmp_path):
    tensors, cfg = build_ct("FP8")
    folder = write(tmp_path / "ckpt", tensors, cfg, shards=2)
    (folder / "model.safetensors.index.json").write_text('{"weight_map": ' + "[" * 50_000 + "]" * 50_000 + "}")
    with pytest.raises(CheckpointError, match="model.safetensors.index.json: index is nested deeper"):
        load_checkpoint(folder)
    (folder / "model.safetensors.index.json").unlink()
    folder2 = write(tmp_path / "ckpt2", tensors, None)
    (folder2 / "config.json").write_text('{"quantization_config": ' + "{\"a\": " * 3000 + "1" + "}" * 3001)
    with pytest.raises(CheckpointError, match="config.json: config is nested deeper"):
        load_checkpoint(folder2)


def _header_file(tmp_path, entry: dict, data: bytes = b"") -> str:
    raw = json.dumps({"t": entry}).encode()
    path = tmp_path / "x.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return str(path)


@pytest.mark.parametrize(("entry", "expected"), [
    ({"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}, "tensor 't': unknown dtype ['F32']"),
    ({"dtype": {"a": 1}, "shape": [1], "data_offsets": [0, 4]}, "tensor 't': unknown dtype {'a': 1}"),
    ({"dtype": "F32", "shape": [10**400, 1], "data_offsets": [0, 4]}, "tensor 't': shape must be a list"),
    ({"dtype": "F32", "shape": [0, 10**30], "data_offsets": [0, 0]}, "tensor 't': shape must be a list"),
    ({"dtype": "F32", "shape": [2**40, 2**40], "data_offsets": [0, 4]}, "at most 9223372036854775807 elements"),
    ({"dtype": "F32", "shape": [1], "data_offsets": [0, 10**400]}, "data_offsets must be [begin, end]"),
    ({"dtype": "F32", "shape": [3**300], "data_offsets": [0, 4]}, "tensor 't': shape must be a list"),
])
def test_header_fields_of_the_wrong_type_or_range(tmp_path, entry, expected):
    path = _header_file(tmp_path, entry, b"\0" * 4)
    with pytest.raises(CheckpointError) as exc:
        SafetensorsFile(path)
    assert _one_line(exc.value).startswith(f"{path}: ") and expected in str(exc.value)


def test_header_names_are_bounded(tmp_path):
    raw = json.dumps({"n" * 2000: {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
    path = tmp_path / "x.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * 4)
    with pytest.raises(CheckpointError, match="is longer than 1024 characters or holds a NUL byte"):
        SafetensorsFile(path)


# --- checkpoint configs and indexes -----------------------------------------------------------

def _index_folder(tmp_path, mutate):
    tensors, cfg = build_ct("FP8")
    folder = write(tmp_path / "ckpt", tensors, cfg, shards=2)
    path = folder / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    mutate(index["weight_map"])
    path.write_text(json.dumps(index))
    return folder


@pytest.mark.parametrize(("value", "expected"), [
    (["model-00001-of-00002.safetensors"], "shard file name must be a non-empty string, got ['model-0"),
    ({"a": 1}, "shard file name must be a non-empty string"),
    ("a" * 300 + ".safetensors", "is longer than a file system allows (255 bytes a name"),
    ("a" * 300 + "/b.safetensors", "is longer than a file system allows"),
    ("a\x00b.safetensors", "shard file name must be a non-empty string"),
])
def test_shard_names_of_the_wrong_type_or_length(tmp_path, value, expected):
    folder = _index_folder(tmp_path, lambda wm: wm.__setitem__("lm_head.weight", value))
    with pytest.raises(CheckpointError) as exc:
        load_checkpoint(folder)
    assert "model.safetensors.index.json: weight_map['lm_head.weight']" in _one_line(exc.value)
    assert expected in str(exc.value)


@pytest.mark.parametrize("value", [["compressed-tensors"], {"a": 1}, 8, None])
def test_quant_method_of_the_wrong_type(tmp_path, value):
    tensors, cfg = build_ct("FP8")
    cfg["quantization_config"]["quant_method"] = value
    with pytest.raises(CheckpointError, match=r"config.json: quantization_config.quant_method: unknown"):
        load_checkpoint(write(tmp_path / "ckpt", tensors, cfg))


@pytest.mark.parametrize(("key", "value", "expected"), [
    ("bits", "8", "quantization_config.bits: expected an integer in 1..64, got '8'"),
    ("act_bits", [8], "quantization_config.act_bits: expected an integer in 1..64, got [8]"),
    ("sym", "true", "quantization_config.sym: expected true, false or null, got 'true'"),
    ("data_type", ["fp"], "quantization_config.data_type: expected a string or null, got ['fp']"),
    ("modules_to_not_convert", [1], "quantization_config.modules_to_not_convert: expected a list of module names"),
    ("modules_to_not_convert", "lm_head", "quantization_config.modules_to_not_convert: expected a list"),
])
def test_autoround_fields_are_type_checked(tmp_path, key, value, expected):
    tensors, cfg = build_autoround()
    cfg["quantization_config"][key] = value
    with pytest.raises(CheckpointError) as exc:
        load_checkpoint(write(tmp_path / "ckpt", tensors, cfg))
    assert "config.json: " + expected in _one_line(exc.value)


def test_autoround_extra_config_entries_are_type_checked(tmp_path):
    tensors, cfg = build_autoround()
    cfg["quantization_config"]["extra_config"] = {"model.layers.0.mlp.down_proj": {"bits": "16"}}
    with pytest.raises(CheckpointError, match=r"extra_config\['model.layers.0.mlp.down_proj'\].bits: expected an"):
        load_checkpoint(write(tmp_path / "ckpt", tensors, cfg))


# --- YAML ------------------------------------------------------------------------------------

@pytest.mark.parametrize(("text", "expected"), [
    ("a: " + "[" * 1000 + "]" * 1000 + "\n", "x.yaml:1: nested deeper than 64 levels"),
    ("".join("  " * i + f"k{i}:\n" for i in range(1000)) + "  " * 1000 + "v\n", "x.yaml:64: nested deeper"),
    ("a: &x [*x]\n", "x.yaml:1: a[0]: recursive alias: a collection that contains itself"),
    ("a: &x {b: *x}\n", "x.yaml:1: a.b: recursive alias"),
    ("a: " + "9" * 5000 + "\n", "x.yaml:1: a: cannot read the value: Exceeds the limit (4300 digits)"),
    ("a: x\x00y\n", "x.yaml: invalid YAML: unacceptable character #x0000"),
])
def test_hostile_yaml_is_a_one_line_error(text, expected):
    with pytest.raises(SpecError) as exc:
        load_yaml_string(text, source="x.yaml")
    assert _one_line(exc.value).startswith(expected)


def test_a_spec_with_a_huge_integer_or_recursive_alias(capsys, tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("scheme: &s {scheme: FP8, group_size: " + "9" * 5000 + "}\n")
    assert main(["spec", "validate", str(path)]) == 1
    assert capsys.readouterr().err.count("\n") == 1
    with pytest.raises(SpecError, match="recursive alias"):
        load_spec_string("scheme: FP8\nlayer_config: &l {a: *l}\n", source="x.yaml")


def test_spec_selector_names_are_bounded():
    with pytest.raises(SpecError, match=r"layer name of 2000 characters; at most 1024"):
        load_spec_string(f"scheme: FP8\nignore: [{'a' * 2000}]\n", source="x.yaml")


# --- the command line -------------------------------------------------------------------------

@pytest.mark.parametrize("value", ["0x1p99999", "-0x1p99999", "0x1.8p1024"])
def test_encode_of_a_hex_float_past_float64_is_a_one_line_error(capsys, value):
    assert main(["encode", "--", value]) == 1
    assert capsys.readouterr().err == (f"fp8ref: error: value {value!r}: a hex float beyond float64's range "
                                       f"(largest 0x1.fffffffffffffp+1023)\n")


def test_encode_keeps_float64_parsing_of_decimals_and_tiny_hex(capsys):
    assert main(["encode", "--", "1e999", "1" + "0" * 400, "0x1p-99999", "inf"]) == 0
    assert capsys.readouterr().out.count("code=") == 4


@pytest.mark.parametrize(("text", "expected"), [
    ("{", "quantization_config.json: quantization config is not valid JSON"),
    ("[1]", "quantization_config.json: expected a JSON object equal to config.json's quantization_config, got list"),
    ("[" * 100000 + "]" * 100000, "quantization_config.json: quantization config is nested deeper than 64 levels"),
    ('{"bits": "8"}', "quantization_config.json: act_bits: missing, but config.json's quantization_config says 8"),
])
def test_autoround_second_config_copy_is_read_and_must_agree(tmp_path, text, expected):
    """auto-round writes its config twice; a broken or different second copy was never read."""
    tensors, cfg = build_autoround()
    folder = write(tmp_path / "ckpt", tensors, cfg)
    (folder / "quantization_config.json").write_text(json.dumps(cfg["quantization_config"]))
    assert len(load_checkpoint(folder)) == 2  # an equal copy is fine
    (folder / "quantization_config.json").write_text(text)
    with pytest.raises(CheckpointError) as exc:
        load_checkpoint(folder)
    assert expected in _one_line(exc.value)


def test_autoround_second_copy_difference_names_the_key_as_written(tmp_path):
    tensors, cfg = build_autoround()
    folder = write(tmp_path / "ckpt", tensors, cfg)
    copy = dict(cfg["quantization_config"], extra_config={r"([\w.]+)+!": {"bits": 16}})
    (folder / "quantization_config.json").write_text(json.dumps(copy))
    with pytest.raises(CheckpointError) as exc:
        load_checkpoint(folder)
    assert str(exc.value).endswith(r"quantization_config.json: extra_config: an object with keys ([\w.]+)+!, but "
                                   r"config.json's quantization_config does not have it; loaders read one copy or "
                                   r"the other, so they must agree")


def test_compressed_tensors_top_level_format_of_the_wrong_type(tmp_path):
    tensors, cfg = build_ct("FP8")
    cfg["quantization_config"]["format"] = ["float-quantized"]  # every group has its own format
    with pytest.raises(CheckpointError, match=r"config.json: quantization_config.format: expected a compression"):
        load_checkpoint(write(tmp_path / "ckpt", tensors, cfg))
