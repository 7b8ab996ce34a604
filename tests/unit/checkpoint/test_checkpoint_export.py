"""export_checkpoint and the quantize/inspect commands: layout, safety, calibration, errors."""

from __future__ import annotations

import json
import math
import re

import ml_dtypes
import numpy as np
import pytest

from fp8ref.checkpoint import export_checkpoint, load_calibration, load_checkpoint, write_calibration
from fp8ref.checkpoint.inspect import quantization_error
from fp8ref.errors import CheckpointError
from fp8ref.io.outputs import MARKER
from fp8ref.io.safetensors import SafetensorsFile, write_safetensors
from tests.support.checkpoint_builders import snapshot, write
from tests.support.cli import run_cli

BF16 = ml_dtypes.bfloat16
LAYERS = {"model.layers.0.self_attn.q_proj": (32, 48), "model.layers.0.mlp.down_proj": (48, 32),
          "model.layers.1.mlp.up_proj": (20, 32), "lm_head": (16, 32)}
CAL = {n: 2.0 + i for i, n in enumerate(LAYERS)}


def make_source(folder, shards: int = 1):
    folder.mkdir()
    rng = np.random.default_rng(0)
    tensors = {f"{n}.weight": ("BF16", rng.standard_normal(s).astype(BF16)) for n, s in LAYERS.items()}
    tensors["model.embed_tokens.weight"] = ("BF16", rng.standard_normal((16, 32)).astype(BF16))
    tensors["model.norm.weight"] = ("BF16", np.ones(32, BF16))
    tensors["model.layers.0.mlp.down_proj.bias"] = ("F32", rng.standard_normal(48).astype(np.float32))
    write(folder, tensors, {"model_type": "llama", "dtype": "bfloat16", "vocab_size": 16}, shards=shards)
    (folder / "tokenizer.json").write_text('{"t": 1}')
    (folder / "extra").mkdir()
    (folder / "extra" / "notes.txt").write_text("kept")
    return tensors


SPEC = {"scheme": "FP8_STATIC", "ignore": ["lm_head"]}


def test_sharded_export_keeps_layout_and_copies_everything(tmp_path):
    tensors = make_source(tmp_path / "src", shards=3)
    before = snapshot(tmp_path / "src")
    export_checkpoint(tmp_path / "src", tmp_path / "out", SPEC, format="compressed-tensors", calibration=CAL)
    assert snapshot(tmp_path / "src") == before  # the source is never written
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == sorted([MARKER] + [p.name for p in (tmp_path / "src").iterdir()])
    assert (out / "extra" / "notes.txt").read_text() == "kept" and (out / "tokenizer.json").read_text() == '{"t": 1}'
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = {f: SafetensorsFile(out / f) for f in set(index["weight_map"].values())}
    assert index["metadata"]["total_size"] == sum(i.nbytes for f in files.values() for i in f.tensors.values())
    for name, fname in index["weight_map"].items():
        assert name in files[fname]
    # the scales sit in the weight's shard; unquantized tensors are byte-identical copies
    for n in ("model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj", "model.layers.1.mlp.up_proj"):
        assert index["weight_map"][f"{n}.weight_scale"] == index["weight_map"][f"{n}.weight"]
    ckpt = load_checkpoint(out)
    for name in ("lm_head.weight", "model.embed_tokens.weight", "model.norm.weight",
                 "model.layers.0.mlp.down_proj.bias"):
        assert ckpt.tensor(name).tobytes() == tensors[name][1].tobytes()
    config = json.loads((out / "config.json").read_text())
    assert config["vocab_size"] == 16 and config["quantization_config"]["ignore"] == ["lm_head"]
    assert ckpt[("model.layers.0.mlp.down_proj")].tensors["bias"] == "model.layers.0.mlp.down_proj.bias"


def test_refuses_overwrite_without_force(tmp_path):
    make_source(tmp_path / "src")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine.txt").write_text("precious")
    with pytest.raises(CheckpointError, match="already exists.*force"):
        export_checkpoint(tmp_path / "src", tmp_path / "out", SPEC, calibration=CAL)
    assert (tmp_path / "out" / "mine.txt").read_text() == "precious"
    with pytest.raises(CheckpointError, match="not replaced: .*fp8ref did not write it"):
        export_checkpoint(tmp_path / "src", tmp_path / "out", SPEC, calibration=CAL, force=True)
    assert (tmp_path / "out" / "mine.txt").read_text() == "precious"
    (tmp_path / "out" / "mine.txt").unlink()
    export_checkpoint(tmp_path / "src", tmp_path / "out", SPEC, calibration=CAL)
    export_checkpoint(tmp_path / "src", tmp_path / "out", SPEC, calibration=CAL, force=True)
    assert len(load_checkpoint(tmp_path / "out")) == 3


def test_interrupted_export_leaves_nothing(tmp_path, monkeypatch):
    import fp8ref.checkpoint.export as ex

    make_source(tmp_path / "src")
    calls = []
    real = ex._quantize_layer

    def interrupt(store, plan, raw):
        calls.append(plan.name)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(store, plan, raw)

    monkeypatch.setattr(ex, "_quantize_layer", interrupt)
    before = snapshot(tmp_path)
    with pytest.raises(KeyboardInterrupt):
        export_checkpoint(tmp_path / "src", tmp_path / "out", SPEC, calibration=CAL)
    assert snapshot(tmp_path) == before and sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_static_layer_without_amax_is_an_error_before_writing(tmp_path):
    make_source(tmp_path / "src")
    cal = dict(CAL)
    del cal["model.layers.1.mlp.up_proj"]
    with pytest.raises(CheckpointError, match="'model.layers.1.mlp.up_proj'.*amax"):
        export_checkpoint(tmp_path / "src", tmp_path / "out", SPEC, calibration=cal)
    assert not (tmp_path / "out").exists()


def test_already_quantized_source_is_refused(tmp_path):
    make_source(tmp_path / "src")
    export_checkpoint(tmp_path / "src", tmp_path / "q", SPEC, calibration=CAL)
    with pytest.raises(CheckpointError, match="already quantized"):
        export_checkpoint(tmp_path / "q", tmp_path / "qq", SPEC, calibration=CAL)


def test_calibration_files(tmp_path):
    from fp8ref.calibrate import amax_state, observe
    from fp8ref.checkpoint import write_calibration

    state = observe(amax_state(), np.array([[-2.5, 1.0]], np.float32))
    write_calibration(tmp_path / "a.json", {"x.y": state, "z": 1, "w": np.float32(0.5)})
    doc = json.loads((tmp_path / "a.json").read_text())
    assert doc["format"] == "fp8ref-calibration/1" and doc["holds"] == "amax" and doc["fp8ref_version"]
    assert load_calibration(tmp_path / "a.json") == {"x.y": 2.5, "z": 1.0, "w": 0.5}
    write_safetensors(tmp_path / "a.safetensors", {"x.y": ("F32", np.array([3.0], np.float32)),
                                                   "z": ("BF16", np.array(1.5, BF16))},
                      {"format": "fp8ref-calibration/1", "holds": "amax"})
    assert load_calibration(tmp_path / "a.safetensors") == {"x.y": 3.0, "z": 1.5}
    doc["input_amax"]["x"] = -1.0
    (tmp_path / "bad.json").write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match="bad.json.*'x'.*>= 0"):
        load_calibration(tmp_path / "bad.json")
    doc["input_amax"]["x"] = "big"
    (tmp_path / "bad2.json").write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match="bad2.json.*'x'"):
        load_calibration(tmp_path / "bad2.json")
    with pytest.raises(CheckpointError, match=r"input_amax\['m.k_scale'\]: a KV-cache key"):
        write_calibration(tmp_path / "c.json", {"m.k_scale": 1.0})


@pytest.mark.parametrize("document, message", [
    ({"x.y": 2.5}, "not an fp8ref calibration file"),  # a bare mapping: amax or scales?
    ({"input_amax": {"x.y": 2.5}}, "not an fp8ref calibration file"),
    ({"format": "fp8ref-calibration/1", "holds": "scale", "input_amax": {"x.y": 0.005}}, '"holds": expected "amax"'),
    ({"format": "fp8ref-calibration/1", "holds": "amax", "input_amax": {}, "scales": {}}, "unknown key 'scales'"),
    ({"format": "fp8ref-calibration/1", "holds": "amax"}, '"input_amax": expected an object'),
    ([1, 2], "not an fp8ref calibration file"),
])
def test_calibration_files_that_do_not_say_they_hold_amax_are_refused(tmp_path, document, message):
    (tmp_path / "cal.json").write_text(json.dumps(document))
    with pytest.raises(CheckpointError, match=re.escape(message)):
        load_calibration(tmp_path / "cal.json")


def test_the_calibrate_input_scales_trap_is_refused(tmp_path, capsys):
    """Scales from calibrate_input_scales saved as the calibration file would give input scales
    448x too small; without the header that says "amax" the file is refused, naming the trap."""
    torch = pytest.importorskip("torch")
    from fp8ref.calibrate import calibrate_input_scales, observe_linear_inputs
    from fp8ref.checkpoint import write_calibration

    make_source(tmp_path / "src")
    model = torch.nn.Sequential()
    model.add_module("lm_head", torch.nn.Linear(32, 16))
    batches = [torch.ones(2, 32) * 3]
    scales = calibrate_input_scales(model, batches, ["lm_head"])
    (tmp_path / "scales.json").write_text(json.dumps({k: float(v) for k, v in scales.items()}))
    (tmp_path / "spec.yaml").write_text("scheme: FP8_STATIC\n")
    argv = ["quantize", tmp_path / "src", tmp_path / "out", "--spec", tmp_path / "spec.yaml", "--calibration"]
    assert run_cli(*argv, tmp_path / "scales.json") == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "calibrate_input_scales returns scales, not amax" in err
    write_calibration(tmp_path / "amax.json", observe_linear_inputs(model, batches, ["lm_head"]))
    assert load_calibration(tmp_path / "amax.json") == {"lm_head": 3.0}


def test_spec_yaml_file_and_single_file_source(tmp_path):
    make_source(tmp_path / "src")
    (tmp_path / "spec.yaml").write_text("scheme: FP8_DYNAMIC\nignore: [lm_head]\n")
    export_checkpoint(tmp_path / "src" / "model.safetensors", tmp_path / "out", tmp_path / "spec.yaml")
    ckpt = load_checkpoint(tmp_path / "out")
    assert ckpt.format == "compressed-tensors" and {layer.quant.input for layer in ckpt.values()} == {"dynamic-token"}
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [MARKER, "config.json", "model.safetensors"]


def test_quantization_error_against_independent_sums(tmp_path):
    make_source(tmp_path / "src")
    export_checkpoint(tmp_path / "src", tmp_path / "out", SPEC, calibration=CAL)
    rows = quantization_error(load_checkpoint(tmp_path / "out"), tmp_path / "src")
    assert [r["snr_db"] for r in rows] == sorted(r["snr_db"] for r in rows)  # worst first
    ckpt = load_checkpoint(tmp_path / "out")
    src = load_checkpoint(tmp_path / "src")
    for r in rows:
        w = [float(v) for v in src.tensor(r["layer"] + ".weight").astype(np.float64).reshape(-1)]
        dq = [float(v) for v in ckpt.dequantize(r["layer"], "float64").reshape(-1)]
        err = [a - b for a, b in zip(dq, w, strict=True)]
        assert r["max_abs"] == max(abs(e) for e in err)
        assert math.isclose(r["rel_rms"], math.sqrt(math.fsum(e * e for e in err) / math.fsum(v * v for v in w)),
                            rel_tol=1e-12)


def test_cli_quantize_and_inspect(tmp_path, capsys):
    make_source(tmp_path / "src")
    (tmp_path / "spec.yaml").write_text("scheme: FP8_STATIC\nignore: [lm_head]\n")
    write_calibration(tmp_path / "cal.json", CAL)
    argv = ["quantize", str(tmp_path / "src"), str(tmp_path / "out"), "--spec", str(tmp_path / "spec.yaml"),
            "--format", "auto-round", "--calibration", str(tmp_path / "cal.json"), "--json", "-"]
    assert run_cli(*argv) == 0
    assert json.loads(capsys.readouterr().out)["format"] == "auto-round"
    assert run_cli(*argv) == 1
    assert re.fullmatch(r"fp8ref: error: .*force.*\n", capsys.readouterr().err)
    assert run_cli(*argv, "--force") == 0
    capsys.readouterr()
    assert run_cli("inspect", tmp_path / "out", "--original", tmp_path / "src", "--json", "-") == 0
    info = json.loads(capsys.readouterr().out)
    assert info["format"] == "auto-round" and len(info["layers"]) == 3 and len(info["error"]) == 3
    assert info["layers"]["model.layers.0.self_attn.q_proj"]["weight_scale"]["shape"] == [32]
    assert run_cli("inspect", tmp_path / "out") == 0
    text = capsys.readouterr().out
    assert "auto-round" in text and "model.layers.1.mlp.up_proj" in text


def test_cli_errors_are_fp8ref_errors(tmp_path, capsys):
    """main() prints these as one line and exits 1; nothing here may escape as another type."""
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "model.safetensors").write_bytes(b"\xff" * 16)
    assert run_cli("inspect", tmp_path / "bad") == 1
    assert re.fullmatch(r"fp8ref: error: .*model\.safetensors.*\n", capsys.readouterr().err)
    assert run_cli("inspect", tmp_path / "missing") == 1
    assert re.fullmatch(r"fp8ref: error: .*no such file.*\n", capsys.readouterr().err)


def test_a_recipe_scale_no_loader_accepts_is_refused_before_writing(tmp_path):
    """hf-fp8 multiplies by fp32(448 * fp32(1/amax)): for a subnormal bf16 amax 1/amax overflows to
    inf, so weight_scale_inv = 1/inf = 0, which no loader accepts (found by the round-trip property)."""
    src = tmp_path / "src"
    src.mkdir()
    w = np.full((128, 128), 9.18355e-41, BF16)  # bf16 subnormal
    write_safetensors(src / "model.safetensors", {"model.layers.0.mlp.up_proj.weight": ("BF16", w)}, {"format": "pt"})
    spec = {"scheme": {"scheme": "FP8_BLOCK", "recipe": "hf-fp8"}}
    with pytest.raises(CheckpointError, match=r"recipe 'hf-fp8' gives .*weight_scale_inv = 0\.0 .* must be > 0"):
        export_checkpoint(src, tmp_path / "out", spec, format="hf-fp8")
    assert not (tmp_path / "out").exists()


def test_exported_folder_and_files_follow_the_umask(tmp_path):
    import os
    import stat

    make_source(tmp_path / "src")
    old = os.umask(0o022)
    try:
        export_checkpoint(tmp_path / "src", tmp_path / "out", SPEC, calibration=CAL)
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "out").iterdir()}
    assert stat.S_IMODE((tmp_path / "out").stat().st_mode) == 0o755
    assert modes["config.json"] == 0o644 and modes["model.safetensors"] == 0o644 and modes["extra"] == 0o755, modes


def _rename_shard(folder, old, new):
    (folder / old).rename(folder / new)
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"] = {k: new if v == old else v for k, v in index["weight_map"].items()}
    index_path.write_text(json.dumps(index))


def test_a_shard_named_like_a_config_file_is_refused_before_writing(tmp_path):
    """auto-round writes quantization_config.json beside the shards: a shard of that name would be
    overwritten and the broken folder renamed into place."""
    make_source(tmp_path / "src", shards=2)
    _rename_shard(tmp_path / "src", "model-00001-of-00002.safetensors", "weights.safetensors")
    _rename_shard(tmp_path / "src", "model-00002-of-00002.safetensors", "quantization_config.json")
    with pytest.raises(CheckpointError, match="a shard named 'quantization_config.json'.*auto-round format writes"):
        export_checkpoint(tmp_path / "src", tmp_path / "out", SPEC, format="auto-round", calibration=CAL)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def _exported_names(tmp_path, **kw):
    export_checkpoint(tmp_path / "src", tmp_path / "out", SPEC, calibration=CAL, **kw)
    return sorted(p.name for p in (tmp_path / "out").rglob("*"))


def test_source_copy_refuses_symlinks_out_of_the_source(tmp_path):
    make_source(tmp_path / "src")
    secret = tmp_path / "secret.txt"
    secret.write_text("root:x:0:0")
    (tmp_path / "src" / "passwd").symlink_to(secret)
    with pytest.raises(CheckpointError, match=r"src/passwd: a symlink to .*secret.txt, outside the source folder"):
        export_checkpoint(tmp_path / "src", tmp_path / "out", SPEC, calibration=CAL)
    assert not (tmp_path / "out").exists()
    (tmp_path / "src" / "passwd").unlink()
    (tmp_path / "src" / "extra" / "deep").symlink_to(secret)  # inside a copied subfolder too
    with pytest.raises(CheckpointError, match="outside the source folder"):
        export_checkpoint(tmp_path / "src", tmp_path / "out", SPEC, calibration=CAL)
    # trusted: a Hugging Face snapshot links everything out; the content is copied, not the link
    names = _exported_names(tmp_path, symlinks_out=True)
    assert "deep" in names and not (tmp_path / "out" / "extra" / "deep").is_symlink()
    assert (tmp_path / "out" / "extra" / "deep").read_text() == "root:x:0:0"


def test_source_copy_keeps_symlinks_inside_the_source_as_files(tmp_path):
    make_source(tmp_path / "src")
    (tmp_path / "src" / "tok.json").symlink_to("tokenizer.json")
    _exported_names(tmp_path)
    out = tmp_path / "out" / "tok.json"
    assert not out.is_symlink() and out.read_text() == '{"t": 1}'


@pytest.mark.parametrize("kind", ["fifo", "loop", "dangling", "parent-loop"])
def test_source_copy_refuses_special_files_and_broken_links_in_one_line(tmp_path, kind, capsys):
    import os

    make_source(tmp_path / "src")
    entry = tmp_path / "src" / "odd"
    if kind == "fifo":
        os.mkfifo(entry)
    elif kind == "loop":
        entry.symlink_to("odd2")
        (tmp_path / "src" / "odd2").symlink_to("odd")
    elif kind == "dangling":
        entry.symlink_to("missing")
    else:
        (tmp_path / "src" / "extra" / "up").symlink_to("..")
    spec = tmp_path / "spec.yaml"
    spec.write_text("scheme: FP8_DYNAMIC\nignore: [lm_head]\n")
    assert run_cli("quantize", tmp_path / "src", tmp_path / "out", "--spec", spec) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("fp8ref: error: "), err
    assert re.search({"fifo": "a FIFO", "loop": "symlink loop|Too many levels", "dangling": "No such file",
                      "parent-loop": "its own parent folder"}[kind], err), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["spec.yaml", "src"]


@pytest.mark.parametrize("name", ["config.json", "model.safetensors.index.json"])
def test_symlinks_out_applies_to_config_and_index_too(tmp_path, name):
    make_source(tmp_path / "src", shards=2)
    moved = tmp_path / f"elsewhere-{name}"
    (tmp_path / "src" / name).rename(moved)
    (tmp_path / "src" / name).symlink_to(moved)
    with pytest.raises(CheckpointError, match=f"'{name}' resolves to .*outside the checkpoint folder"):
        export_checkpoint(tmp_path / "src", tmp_path / "out", SPEC, calibration=CAL)
    with pytest.raises(CheckpointError, match="outside the checkpoint folder"):
        load_checkpoint(tmp_path / "src")
    export_checkpoint(tmp_path / "src", tmp_path / "out", SPEC, calibration=CAL, symlinks_out=True)
    assert not (tmp_path / "out" / name).is_symlink()


_SCALE_NAMES = {"compressed-tensors": "weight_scale", "auto-round": "weight_scale", "hf-fp8": "weight_scale_inv"}


@pytest.mark.parametrize("fmt, scheme", [("compressed-tensors", "FP8_BLOCK"), ("compressed-tensors", "FP8_STATIC"),
                                         ("auto-round", "FP8_STATIC"), ("hf-fp8", "FP8_BLOCK")])
@pytest.mark.parametrize("scale_dtype, stored", [("float32", "F32"), ("bfloat16", "BF16"), ("float16", "F16")])
def test_scale_dtype_is_honoured_or_refused_naming_the_layer(tmp_path, fmt, scheme, scale_dtype, stored):
    """The scheme's scale_dtype decides the stored scales' dtype: the recipe's float32 scale rounded
    once to it (compared with an independent RNE of the float32 scale); hf-fp8 stores float32 only."""
    make_source(tmp_path / "src")
    layer = "model.layers.0.mlp.down_proj"
    spec = {"scheme": "FP8_DYNAMIC" if scheme == "FP8_BLOCK" else scheme, "ignore": ["lm_head"],
            "layer_config": {layer: {"scheme": scheme, "scale_dtype": scale_dtype}}} if fmt != "hf-fp8" else \
        {"scheme": {"scheme": scheme, "scale_dtype": scale_dtype}, "ignore": ["lm_head"]}
    if fmt == "hf-fp8" and scale_dtype != "float32":
        with pytest.raises(CheckpointError, match=f"layer '.*': scale_dtype '{scale_dtype}': the hf-fp8 format "
                                                  "stores float32"):
            export_checkpoint(tmp_path / "src", tmp_path / "out", spec, format=fmt, calibration=CAL)
        return
    export_checkpoint(tmp_path / "src", tmp_path / "out", spec, format=fmt, calibration=CAL, recipe=None)
    out = SafetensorsFile(tmp_path / "out" / "model.safetensors")
    info = out.tensors[f"{layer}.{_SCALE_NAMES[fmt]}"]
    assert info.dtype == stored
    if fmt != "hf-fp8":
        ref_dir = tmp_path / "ref"
        ref_spec = {**spec, "layer_config": {layer: {"scheme": scheme, "scale_dtype": "float32"}}}
        export_checkpoint(tmp_path / "src", ref_dir, ref_spec, format=fmt, calibration=CAL)
        s32 = np.asarray(SafetensorsFile(ref_dir / "model.safetensors").get(f"{layer}.{_SCALE_NAMES[fmt]}"),
                         np.float32)
        got = np.asarray(out.get(f"{layer}.{_SCALE_NAMES[fmt]}")).astype(np.float32)
        want = s32.astype(np.float16).astype(np.float32) if scale_dtype == "float16" else \
            s32.astype(BF16).astype(np.float32) if scale_dtype == "bfloat16" else s32
        assert got.tobytes() == want.tobytes()


@pytest.mark.parametrize("recipe, scale_dtype, message", [
    ("compressed-tensors", "float8_e8m0fnu", "has no rule to round it to float8_e8m0fnu"),
    ("fp8ref", "bfloat16", "computes its scale exactly and stores it in float32"),
])
def test_scale_dtype_a_recipe_cannot_produce_is_refused(tmp_path, recipe, scale_dtype, message):
    make_source(tmp_path / "src")
    spec = {"scheme": "FP8_DYNAMIC", "ignore": ["lm_head"],
            "layer_config": {"model.layers.0.mlp.down_proj": {"scheme": "FP8_DYNAMIC", "scale_dtype": scale_dtype,
                                                        "recipe": recipe}}}
    with pytest.raises(CheckpointError, match=f"layer 'model.layers.0.mlp.down_proj'.*{message}"):
        export_checkpoint(tmp_path / "src", tmp_path / "out", spec)
    assert not (tmp_path / "out").exists()
