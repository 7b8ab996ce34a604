"""Hostile corpus, issue #10 items 5, 8, 10 and 13 (checkpoint side): float64 buffers, incomplete
checkpoints, absurd but finite scales, empty weights, a quantized ``--original``, ``--recipe ''``."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest

from fp8ref.checkpoint import export_checkpoint, load_checkpoint
from fp8ref.checkpoint.inspect import quantization_error
from fp8ref.cli import main
from fp8ref.errors import CheckpointError, RecipeError
from fp8ref.io.safetensors import write_safetensors
from tests.support.checkpoint_builders import build_autoround, build_ct, build_hf, write

Q = "model.layers.0.self_attn.q_proj"
INV_FREQ = "model.layers.0.self_attn.rotary_emb.inv_freq"


# --- item 5: F64 is a float, not F6 codes ------------------------------------------------------

@pytest.mark.parametrize("build", [lambda: build_ct("FP8_DYNAMIC"), build_autoround, build_hf])
def test_a_float64_buffer_loads_as_a_plain_tensor(tmp_path, build):
    tensors, cfg = build()
    tensors[INV_FREQ] = ("F64", np.linspace(1.0, 0.01, 16))
    ckpt = load_checkpoint(write(tmp_path / "ckpt", tensors, cfg))
    assert INV_FREQ in ckpt.unquantized and ckpt.tensor(INV_FREQ).dtype == np.float64


def test_a_source_with_a_float64_buffer_exports_and_keeps_it_bit_for_bit(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    inv = np.linspace(1.0, 0.01, 16)
    write_safetensors(src / "model.safetensors", {
        "model.layers.0.mlp.up_proj.weight": ("BF16", np.ones((32, 32), ml_dtypes.bfloat16)),
        "model.rotary_emb.inv_freq": ("F64", inv)})
    ckpt = load_checkpoint(export_checkpoint(src, tmp_path / "out", {"scheme": "FP8_DYNAMIC"}))
    assert list(ckpt) == ["model.layers.0.mlp.up_proj"]
    assert ckpt.tensor("model.rotary_emb.inv_freq").tobytes() == inv.tobytes()


def test_float6_codes_outside_a_layer_are_still_refused(tmp_path):
    from fp8ref.io.safetensors import SafetensorsWriter, TensorSpec

    tensors, cfg = build_ct("FP8")
    folder = write(tmp_path / "ckpt", tensors, cfg)
    specs = [TensorSpec(n, d, a.shape) for n, (d, a) in tensors.items()] + [TensorSpec("model.extra", "F6_E2M3", (4,))]
    w = SafetensorsWriter(folder / "model.safetensors", specs)
    for n, (_, a) in tensors.items():
        w.write(n, a)
    w.write("model.extra", b"\0\0\0")  # four 6-bit codes
    w.close()
    with pytest.raises(CheckpointError, match="F6_E2M3 tensor that is not the weight of a quantized layer"):
        load_checkpoint(folder)


# --- item 8: incomplete checkpoints -----------------------------------------------------------

def _blocks(n_blocks: int):
    """A compressed-tensors FP8 checkpoint of ``n_blocks`` decoder blocks (two linears each)."""
    tensors, cfg = build_ct("FP8")
    one = {k: v for k, v in tensors.items() if k.startswith("model.layers.0.")}
    for i in range(1, n_blocks):
        tensors.update({k.replace("model.layers.0.", f"model.layers.{i}."): v for k, v in one.items()})
    cfg["num_hidden_layers"] = n_blocks
    return tensors, cfg


def _sharded_by_block(folder, tensors, cfg, shards: int):
    """Blocks split evenly over ``shards`` files; the plain tensors go in the first."""
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    n = cfg["num_hidden_layers"]
    weight_map = {}
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        names = [k for k in tensors if (k.startswith("model.layers.") and int(k.split(".")[2]) * shards // n == s)
                 or (not k.startswith("model.layers.") and s == 0)]
        write_safetensors(folder / fname, {k: tensors[k] for k in names})
        weight_map.update(dict.fromkeys(names, fname))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return folder, weight_map


def test_an_index_that_omits_a_whole_shard_is_an_error(tmp_path):
    tensors, cfg = _blocks(14)
    folder, weight_map = _sharded_by_block(tmp_path / "ckpt", tensors, cfg, 2)
    assert len(load_checkpoint(folder)) == 28
    kept = {k: v for k, v in weight_map.items() if v.startswith("model-00001")}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": kept}))
    with pytest.raises(CheckpointError, match=r"index.json: weight_map references 1 of the 2 shards model-\*-of-00002;"
                                              r" no tensor is mapped to 1 of them, e.g. model-00002-of-00002"
                                              r".safetensors \(it is in the folder\)"):
        load_checkpoint(folder)


def test_a_config_whose_blocks_are_not_all_held_says_how_many_it_implies(tmp_path):
    tensors, cfg = _blocks(14)
    held = {k: v for k, v in tensors.items() if not k.startswith("model.layers.") or int(k.split(".")[2]) < 7}
    folder = write(tmp_path / "ckpt", held, cfg)
    with pytest.raises(CheckpointError) as exc:
        load_checkpoint(folder)
    assert str(exc.value) == (f"{folder / 'config.json'}: num_hidden_layers is 14, so the checkpoint should hold 14 "
                              f"blocks of quantized layers; its tensors hold 7 of them (model.layers.0-6), none for "
                              f"block(s) 7-13: a shard or index entry is missing")


def test_extra_blocks_beyond_num_hidden_layers_are_fine(tmp_path):
    tensors, cfg = _blocks(3)
    cfg["num_hidden_layers"] = 2  # block 2 plays a multi-token-prediction layer (DeepSeek-V3 style)
    assert len(load_checkpoint(write(tmp_path / "ckpt", tensors, cfg))) == 6


def test_an_empty_weight_map_is_an_error(tmp_path):
    tensors, cfg = build_ct("FP8")
    folder = write(tmp_path / "ckpt", tensors, cfg, shards=2)
    (folder / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    with pytest.raises(CheckpointError, match="index.json: weight_map is empty"):
        load_checkpoint(folder)


def test_an_exact_compressed_tensors_target_no_shard_holds(tmp_path):
    tensors, cfg = build_ct("FP8")
    group = cfg["quantization_config"]["config_groups"]["group_0"]
    group["targets"] = [Q, "model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]
    with pytest.raises(CheckpointError, match=r"config_groups.group_0.targets\[2\]: 'model.layers.1.mlp.down_proj' "
                                              r"is a layer no shard of .* holds \(2 quantized layers found\)"):
        load_checkpoint(write(tmp_path / "ckpt", tensors, cfg))


def test_a_quantizing_autoround_extra_config_key_no_shard_holds(tmp_path):
    from fp8ref.producers.auto_round import FP8_STATIC

    tensors, cfg = build_autoround()
    cfg["quantization_config"]["extra_config"] = {"model.layers.5.mlp.down_proj": dict(FP8_STATIC),
                                                  "lm_head": {"bits": 16, "act_bits": 16}}  # unquantized: fine
    with pytest.raises(CheckpointError, match=r"extra_config\['model.layers.5.mlp.down_proj'\]: quantizes a layer "
                                              r"no shard of .* holds"):
        load_checkpoint(write(tmp_path / "ckpt", tensors, cfg))


# --- item 10: absurd but finite scales ------------------------------------------------------

@pytest.mark.parametrize(("dtype", "scale"), [("bfloat16", 3.39e38), ("float16", 200.0), ("bfloat16", 2.0**120)])
def test_a_weight_scale_that_overflows_the_model_dtype_is_an_error_at_load(tmp_path, dtype, scale):
    tensors, cfg = build_ct("FP8")
    cfg["dtype"] = dtype
    tensors["model.layers.0.self_attn.k_proj.weight"] = tensors[f"{Q}.weight"]
    tensors["model.layers.0.self_attn.k_proj.weight_scale"] = ("F32", np.array([scale], np.float32))
    tensors["model.layers.0.self_attn.k_proj.input_scale"] = tensors[f"{Q}.input_scale"]
    folder = write(tmp_path / "ckpt", tensors, cfg)
    with pytest.raises(CheckpointError) as exc:
        load_checkpoint(folder)
    assert str(exc.value).startswith(f"{folder / 'model.safetensors'}: tensor "
                                     f"'model.layers.0.self_attn.k_proj.weight_scale': 1 of 1 scale values overflow "
                                     f"the model dtype {dtype}")
    lazy = load_checkpoint(folder, check_values=False)  # read later: the same check
    with pytest.raises(CheckpointError, match="overflow the model dtype"):
        lazy["model.layers.0.self_attn.k_proj"].dequantize()


def test_the_largest_scale_a_producer_writes_for_the_dtype_max_still_loads(tmp_path):
    """amax = 65504 in float16: 65504 / 448 rounds up to 146.25 (146.25 * 448 = 65520, which itself
    rounds to Inf): a real producer's output, within the declared slack."""
    tensors, cfg = build_ct("FP8")
    cfg["dtype"] = "float16"
    tensors[f"{Q}.weight_scale"] = ("F16", np.array([146.25], np.float16))
    assert Q in load_checkpoint(write(tmp_path / "ckpt", tensors, cfg))


# --- item 13: empty weights, a quantized original, --recipe '' -------------------------------------

def _source(tmp_path, shape):
    src = tmp_path / "src"
    src.mkdir()
    write_safetensors(src / "model.safetensors", {
        "model.layers.0.mlp.up_proj.weight": ("BF16", np.ones(shape, ml_dtypes.bfloat16)),
        "model.layers.0.mlp.down_proj.weight": ("BF16", np.ones((32, 32), ml_dtypes.bfloat16))})
    return src


@pytest.mark.parametrize("shape", [(0, 32), (32, 0)])
@pytest.mark.parametrize("preset", ["FP8_DYNAMIC", "FP8_STATIC", "FP8_BLOCK"])
def test_an_empty_weight_is_a_clear_error_before_anything_is_written(tmp_path, shape, preset):
    src = _source(tmp_path, shape)
    cal = {"model.layers.0.mlp.up_proj": 1.0, "model.layers.0.mlp.down_proj": 1.0}
    with pytest.raises(CheckpointError) as exc:
        export_checkpoint(src, tmp_path / "out", {"scheme": preset}, calibration=cal)
    assert str(exc.value) == (f"{src / 'model.safetensors'}: tensor 'model.layers.0.mlp.up_proj.weight': shape "
                              f"{list(shape)} has no elements, so no scale can be computed; leave "
                              f"'model.layers.0.mlp.up_proj' out of the spec (ignore it)")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
    # ignored, it is copied as it is
    export_checkpoint(src, tmp_path / "out", {"scheme": preset, "ignore": ["model.layers.0.mlp.up_proj"]},
                      calibration=cal)


@pytest.mark.parametrize("shape", [(0, 32), (32, 0), (0,)])
@pytest.mark.parametrize("preset", ["FP8_DYNAMIC", "FP8_BLOCK", "MXFP8"])
def test_quantize_refuses_empty_input(shape, preset):
    from fp8ref import quantize
    from fp8ref.errors import ShapeError
    from fp8ref.scheme import PRESETS

    with pytest.raises(ShapeError, match=r"x: shape .* has no elements"):
        quantize(np.ones(shape, np.float32), PRESETS[preset])


def test_inspect_original_refuses_a_quantized_checkpoint(tmp_path, capsys):
    tensors, cfg = build_ct("FP8")
    folder = write(tmp_path / "ckpt", tensors, cfg)
    with pytest.raises(CheckpointError, match=r"tensor '.*\.weight': F8_E4M3: the original must hold the unquantized"):
        quantization_error(load_checkpoint(folder), folder)
    assert main(["inspect", str(folder), "--original", str(folder)]) == 1
    assert capsys.readouterr().err.count("\n") == 1


def test_an_empty_recipe_is_not_taken_as_no_override(tmp_path, capsys):
    src = _source(tmp_path, (32, 32))
    with pytest.raises(RecipeError, match="recipe: unknown recipe ''"):
        export_checkpoint(src, tmp_path / "out", {"scheme": "FP8_DYNAMIC"}, recipe="")
    spec = tmp_path / "spec.yaml"
    spec.write_text("scheme: FP8_DYNAMIC\n")
    assert main(["quantize", str(src), str(tmp_path / "out"), "--spec", str(spec), "--recipe", ""]) == 1
    assert "unknown recipe ''" in capsys.readouterr().err and not (tmp_path / "out").exists()
