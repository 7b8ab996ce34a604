"""A corpus of broken checkpoints, each built in code: every one must give a CheckpointError
that names the file and the tensor (or config key), and loading must write nothing."""

from __future__ import annotations

import json
import os

import ml_dtypes
import numpy as np
import pytest

from fp8ref.checkpoint import load_checkpoint
from fp8ref.errors import CheckpointError, Fp8RefError
from tests.support.checkpoint_builders import BF16, build_autoround, build_ct, build_hf, snapshot, write

Q = "model.layers.0.self_attn.q_proj"
D = "model.layers.0.mlp.down_proj"
FILE = "model.safetensors"


def _ct(tmp, preset="FP8", mutate=None, config=None, **kw):
    tensors, cfg = build_ct(preset)
    if mutate:
        mutate(tensors, cfg)
    return write(tmp / "ckpt", tensors, cfg if config is None else config, **kw)


def _patch_bytes(path, offset, data):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def missing_weight_scale(tmp):
    return _ct(tmp, mutate=lambda t, c: t.pop(f"{Q}.weight_scale")), [f"{Q}.weight_scale", "missing"]


def missing_input_scale(tmp):
    return _ct(tmp, mutate=lambda t, c: t.pop(f"{D}.input_scale")), [f"{D}.input_scale", "missing"]


def extra_zero_point(tmp):
    def m(t, c):
        t[f"{Q}.weight_zero_point"] = ("BF16", np.zeros(1, BF16))
    return _ct(tmp, mutate=m), [FILE, f"{Q}.weight_zero_point", "unexpected"]


def extra_fp8_tensor(tmp):
    def m(t, c):
        t["model.layers.0.mlp.gate.codes"] = ("F8_E4M3", np.zeros((2, 2), np.uint8))
    return _ct(tmp, mutate=m), [FILE, "model.layers.0.mlp.gate.codes", "F8_E4M3"]


def weight_not_fp8(tmp):
    def m(t, c):
        t[f"{Q}.weight"] = ("BF16", np.zeros((48, 32), BF16))
    return _ct(tmp, mutate=m), [FILE, f"{Q}.weight", "BF16"]


def weight_e5m2(tmp):
    def m(t, c):
        t[f"{Q}.weight"] = ("F8_E5M2", t[f"{Q}.weight"][1])
    return _ct(tmp, mutate=m), [FILE, "F8_E5M2"]


def weight_1d(tmp):
    def m(t, c):
        t[f"{Q}.weight"] = ("F8_E4M3", np.zeros(48 * 32, np.uint8))
    return _ct(tmp, mutate=m), [FILE, f"{Q}.weight", "[out, in]"]


def scale_int_dtype(tmp):
    def m(t, c):
        t[f"{Q}.weight_scale"] = ("I32", np.ones(1, np.int32))
    return _ct(tmp, mutate=m), [FILE, f"{Q}.weight_scale", "I32"]


def scale_wrong_shape(tmp):
    def m(t, c):
        t[f"{Q}.weight_scale"] = ("BF16", np.ones(48, BF16))  # [out] where CT needs [out, 1]
    return _ct(tmp, "FP8_DYNAMIC", mutate=m), [FILE, f"{Q}.weight_scale", "[48, 1]"]


def block_scale_wrong_shape(tmp):
    def m(t, c):
        t[f"{D}.weight_scale"] = ("BF16", np.ones((2, 2), BF16))  # 32x48 with 16x16 blocks: [2, 3]
    return _ct(tmp, "FP8_BLOCK", mutate=m), [FILE, f"{D}.weight_scale", "[2, 3]"]


def _bad_scale(value, word):
    def case(tmp):
        def m(t, c):
            t[f"{D}.weight_scale"] = ("BF16", np.array([value], BF16))
        return _ct(tmp, mutate=m), [FILE, f"{D}.weight_scale", word]
    case.__name__ = f"scale_{word}"
    return case


def input_scale_nan(tmp):
    def m(t, c):
        t[f"{Q}.input_scale"] = ("BF16", np.array([np.nan], BF16))
    return _ct(tmp, mutate=m), [FILE, f"{Q}.input_scale", "NaN"]


def ignore_lists_quantized_layer(tmp):
    def m(t, c):
        c["quantization_config"]["ignore"] = ["lm_head", Q]
    return _ct(tmp, mutate=m), [FILE, f"{Q}.weight", "ignore"]


def name_target_unquantized(tmp):
    def m(t, c):
        c["quantization_config"]["config_groups"]["group_0"]["targets"] = ["Linear", "lm_head"]
        c["quantization_config"]["ignore"] = []
    return _ct(tmp, mutate=m), [FILE, "lm_head.weight", "unquantized"]


def dynamic_config_static_tensor(tmp):
    def m(t, c):
        t[f"{Q}.input_scale"] = ("BF16", np.ones(1, BF16))
    return _ct(tmp, "FP8_DYNAMIC", mutate=m), [FILE, f"{Q}.input_scale", "dynamic"]


def unknown_quant_method(tmp):
    def m(t, c):
        c["quantization_config"]["quant_method"] = "gptq"
    return _ct(tmp, mutate=m), ["config.json", "quant_method", "gptq"]


def config_not_json(tmp):
    folder = _ct(tmp)
    (folder / "config.json").write_text("{'quantization_config': ")
    return folder, ["config.json", "JSON"]


def group_strategy_weights(tmp):
    def m(t, c):
        c["quantization_config"]["config_groups"]["group_0"]["weights"].update(strategy="group", group_size=16)
    return _ct(tmp, mutate=m), ["config.json", "weights.strategy", "group"]


def truncated_file(tmp):
    folder = _ct(tmp)
    f = folder / FILE
    os.truncate(f, f.stat().st_size - 100)
    return folder, [FILE, "truncated"]


def tiny_file(tmp):
    folder = _ct(tmp)
    (folder / FILE).write_bytes(b"\x10\x00")
    return folder, [FILE, "truncated"]


def corrupted_header(tmp):
    folder = _ct(tmp)
    _patch_bytes(folder / FILE, 8, b"\xff\xfe garbage")
    return folder, [FILE, "JSON"]


def header_claims_gigabytes(tmp):
    folder = _ct(tmp)
    _patch_bytes(folder / FILE, 0, (5 * 2**30).to_bytes(8, "little"))
    return folder, [FILE, "header length"]


def header_longer_than_file(tmp):
    folder = _ct(tmp)
    _patch_bytes(folder / FILE, 0, (50_000_000).to_bytes(8, "little"))
    return folder, [FILE, "truncated"]


def _rewrite_header(folder, edit):
    path = folder / FILE
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    edit(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + data[8 + n:])


def overlapping_offsets(tmp):
    folder = _ct(tmp)

    def edit(h):
        h[f"{Q}.weight"]["data_offsets"] = [0, 48 * 32]
    _rewrite_header(folder, edit)
    return folder, [FILE, "overlaps"]


def shape_offsets_mismatch(tmp):
    folder = _ct(tmp)

    def edit(h):
        h[f"{Q}.weight"]["shape"] = [48, 33]
    _rewrite_header(folder, edit)
    return folder, [FILE, f"{Q}.weight", "needs"]


def unknown_dtype(tmp):
    folder = _ct(tmp)

    def edit(h):
        h[f"{Q}.weight"]["dtype"] = "F8_E4M3FN"
    _rewrite_header(folder, edit)
    return folder, [FILE, f"{Q}.weight", "unknown dtype"]


def duplicate_header_key(tmp):
    folder = _ct(tmp)
    path = folder / FILE
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    text = data[8:8 + n].rstrip()
    entry = json.dumps({"dtype": "F32", "shape": [], "data_offsets": [0, 0]})
    text = text[:-1] + f', "model.norm.weight": {entry}}}'.encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + data[8 + n:])
    return folder, [FILE, "duplicate"]


def _index_case(tmp, target):
    tensors, cfg = build_ct()
    folder = write(tmp / "ckpt", tensors, cfg, shards=2)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"][f"{Q}.weight"] = target
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


def index_parent_path(tmp):
    (tmp / "x.safetensors").write_bytes(b"")
    return _index_case(tmp, "../x.safetensors"), ["model.safetensors.index.json", "../x.safetensors", "leaves"]


def index_absolute_path(tmp):
    return _index_case(tmp, str(tmp / "x.safetensors")), ["model.safetensors.index.json", "absolute"]


def index_symlink_out(tmp):
    outside = tmp / "outside"
    outside.mkdir()
    tensors, cfg = build_ct()
    write(outside, {k: tensors[k] for k in list(tensors)[:1]}, None)
    folder = _index_case(tmp, "link.safetensors")
    os.symlink(outside / FILE, folder / "link.safetensors")
    return folder, ["link.safetensors", "outside"]


def index_names_missing_tensor(tmp):
    folder = _index_case(tmp, "model-00002-of-00002.safetensors")
    return folder, ["model.safetensors.index.json", "model-00002-of-00002.safetensors", f"{Q}.weight"]


def index_missing_shard(tmp):
    return _index_case(tmp, "model-00009-of-00009.safetensors"), ["model-00009-of-00009.safetensors",
                                                                  "does not exist"]


def autoround_not_fp8_static(tmp):
    tensors, cfg = build_autoround()
    cfg["quantization_config"]["group_size"] = 128
    return write(tmp / "ckpt", tensors, cfg), ["config.json", D, "FP8_STATIC", "'group_size': 128"]


def autoround_ct_shaped_scale(tmp):
    tensors, cfg = build_autoround()
    tensors[f"{Q}.weight_scale"] = ("BF16", np.ones((48, 1), BF16))
    return write(tmp / "ckpt", tensors, cfg), [FILE, f"{Q}.weight_scale", "[48]"]


def autoround_bad_packing(tmp):
    tensors, cfg = build_autoround()
    cfg["quantization_config"]["packing_format"] = "auto_round:auto_gptq"
    return write(tmp / "ckpt", tensors, cfg), ["config.json", "packing_format", "auto_gptq"]


def hf_scale_wrong_shape(tmp):
    tensors, cfg = build_hf()
    tensors[f"{Q}.weight_scale_inv"] = ("F32", np.ones((3, 3), np.float32))
    return write(tmp / "ckpt", tensors, cfg), [FILE, f"{Q}.weight_scale_inv", "[3, 2]"]


def hf_not_converted_but_fp8(tmp):
    tensors, cfg = build_hf()
    cfg["quantization_config"]["modules_to_not_convert"] = ["lm_head", D]
    return write(tmp / "ckpt", tensors, cfg), [FILE, f"{D}.weight", "modules_to_not_convert"]


def hf_scale_negative(tmp):
    tensors, cfg = build_hf()
    tensors[f"{D}.weight_scale_inv"][1][0, 1] = -1.0
    return write(tmp / "ckpt", tensors, cfg), [FILE, f"{D}.weight_scale_inv", "negative", "[0, 1]"]


CASES = [missing_weight_scale, missing_input_scale, extra_zero_point, extra_fp8_tensor, weight_not_fp8,
         weight_e5m2, weight_1d, scale_int_dtype, scale_wrong_shape, block_scale_wrong_shape,
         _bad_scale(np.nan, "NaN"), _bad_scale(np.inf, "infinite"), _bad_scale(0.0, "zero"),
         _bad_scale(-0.5, "negative"), input_scale_nan, ignore_lists_quantized_layer, name_target_unquantized,
         dynamic_config_static_tensor, unknown_quant_method, config_not_json, group_strategy_weights,
         truncated_file, tiny_file, corrupted_header, header_claims_gigabytes, header_longer_than_file,
         overlapping_offsets, shape_offsets_mismatch, unknown_dtype, duplicate_header_key, index_parent_path,
         index_absolute_path, index_symlink_out, index_names_missing_tensor, index_missing_shard,
         autoround_not_fp8_static, autoround_ct_shaped_scale, autoround_bad_packing, hf_scale_wrong_shape,
         hf_not_converted_but_fp8, hf_scale_negative]


def test_corpus_is_large_enough():
    assert len(CASES) >= 20


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
def test_broken_checkpoint_is_named_error(case, tmp_path):
    folder, needles = case(tmp_path)
    before = snapshot(tmp_path)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(folder)
    message = str(info.value)
    assert isinstance(info.value, Fp8RefError)
    for needle in needles:
        assert needle in message, f"{needle!r} not in {message!r}"
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("build", [build_ct, build_autoround, build_hf], ids=lambda b: b.__name__)
def test_baselines_load(build, tmp_path):
    """The corpus breaks valid checkpoints; the valid ones load cleanly."""
    tensors, cfg = build()
    ckpt = load_checkpoint(write(tmp_path / "ok", tensors, cfg))
    assert sorted(ckpt) == sorted([Q, D])
    assert ckpt.warnings == []


def test_nan_weight_codes_rejected_on_read(tmp_path):
    tensors, cfg = build_ct()
    tensors[f"{Q}.weight"][1][3, 4] = 0xFF
    ckpt = load_checkpoint(write(tmp_path / "c", tensors, cfg))  # weights are not read at load
    with pytest.raises(CheckpointError) as info:
        _ = ckpt[Q].weight_codes
    assert FILE in str(info.value) and f"{Q}.weight" in str(info.value) and "[3, 4]" in str(info.value)
    with pytest.raises(CheckpointError):
        ckpt.validate_values()


def test_lazy_values_checked_on_first_use(tmp_path):
    tensors, cfg = build_ct()
    tensors[f"{Q}.weight_scale"] = ("BF16", np.array([np.inf], ml_dtypes.bfloat16))
    ckpt = load_checkpoint(write(tmp_path / "c", tensors, cfg), check_values=False)
    with pytest.raises(CheckpointError, match="infinite"):
        _ = ckpt[Q].weight_scale


def test_symlinks_out_only_when_asked(tmp_path):
    """A Hugging Face cache snapshot links every file out of its folder: an error unless the
    caller opts in; '..' and absolute names in an index stay errors even then."""
    tensors, cfg = build_ct()
    blobs = write(tmp_path / "blobs", tensors, cfg)
    snap = tmp_path / "snap"
    snap.mkdir()
    for name in ("model.safetensors", "config.json"):
        os.symlink(blobs / name, snap / name)
    with pytest.raises(CheckpointError, match="outside the checkpoint folder"):
        load_checkpoint(snap)
    assert sorted(load_checkpoint(snap, symlinks_out=True)) == sorted([Q, D])
    (tmp_path / "other").mkdir()
    folder, _ = index_parent_path(tmp_path / "other")
    with pytest.raises(CheckpointError, match="leaves the checkpoint folder"):
        load_checkpoint(folder, symlinks_out=True)
