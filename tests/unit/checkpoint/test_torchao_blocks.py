"""torchao MXTensor / NVFP4Tensor checkpoints (fp8ref.checkpoint.torchao) and the torchao-mx-* /
torchao-nvfp4* recipes.

Evidence: tests/fixtures/torchao/{mx*,nvfp4*}, written by torchao 0.18.0's own MX handler and
NVFP4Tensor.to_nvfp4 on CPU and saved by its flatten_tensor_state_dict with the config transformers'
TorchAoConfig writes (tools/make_torchao_block_fixtures.py); each folder's dequantized.json holds the
sha256 of torchao's own ``dequantize(torch.bfloat16)`` of each weight.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fp8ref import quantize
from fp8ref.checkpoint import load_checkpoint
from fp8ref.codec import decode, encode
from fp8ref.errors import CheckpointError
from fp8ref.io.safetensors import SafetensorsFile
from fp8ref.nn.verify import verify
from fp8ref.producers.torchao import swizzle
from fp8ref.quant import QuantArgs
from fp8ref.registry import get_recipe
from tests.support.cli import run_cli

FIX = Path(__file__).resolve().parents[2] / "fixtures" / "torchao"
ORIGINAL = FIX / "original_blocks"
MX_FOLDERS = {f"mxfp{e}_{m}": (fmt, f"torchao-mx-{m}") for e, fmt in (("8", "float8_e4m3fn"), ("4", "float4_e2m1fn"))
              for m in ("floor", "ceil", "rceil", "even")}
MX_FOLDERS.update({"mxfp8e5m2_rceil": ("float8_e5m2", "torchao-mx-rceil"),
                   "mxfp6e2m3_rceil": ("float6_e2m3fn", "torchao-mx-rceil"),
                   "mxfp6e3m2_rceil": ("float6_e3m2fn", "torchao-mx-rceil")})
NV_FOLDERS = {"nvfp4": ("float4_e2m1fn", "torchao-nvfp4"),
              "nvfp4_no_tensor_scale": ("float4_e2m1fn", "torchao-nvfp4-no-tensor-scale")}
FOLDERS = {**MX_FOLDERS, **NV_FOLDERS}
UP = "model.layers.0.mlp.up_proj"


def _sha(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).view(np.uint16).tobytes()).hexdigest()


@pytest.mark.parametrize("folder", sorted(FOLDERS))
def test_dequantize_equals_torchaos_own(folder):
    ckpt = load_checkpoint(FIX / folder)
    want = json.loads((FIX / folder / "dequantized.json").read_text())
    assert ckpt.format == "torchao" and sorted(f"{n}.weight" for n in ckpt) == sorted(want)
    for name in ckpt:
        layer = ckpt[name]
        assert layer.quant.weight_fmt == FOLDERS[folder][0]
        for mode in ("reference", "producer"):
            got = np.asarray(layer.dequantize("bfloat16", mode=mode))
            assert got.shape == tuple(layer.shape) and _sha(got) == want[f"{name}.weight"], (name, mode)


@pytest.mark.parametrize("folder", sorted(FOLDERS))
def test_verify_reproduces_every_code_and_swizzled_scale_with_its_mode(folder):
    res = verify(load_checkpoint(FIX / folder), load_checkpoint(ORIGINAL))
    assert res["ok"] and {x["recipe"] for x in res["layers"]} == {FOLDERS[folder][1]}
    assert sum(x["codes"] for x in res["layers"]) == 160 * 128 + 32 * 64


@pytest.mark.parametrize("folder", sorted(FOLDERS))
def test_the_recipe_rewrites_the_stored_bytes(folder):
    """Codes packed and scales swizzled as torchao stores them, from the original weight alone."""
    fmt, recipe = FOLDERS[folder]
    f = SafetensorsFile(FIX / folder / "model.safetensors")
    w = SafetensorsFile(ORIGINAL / "model.safetensors").get(f"{UP}.weight")
    gran = "nvfp4" if folder.startswith("nvfp4") else "mx"
    q = quantize(w, QuantArgs(format=fmt, granularity=gran), recipe=get_recipe(recipe))
    codes = np.asarray(q.codes)
    stored = f.get(f"{UP}._weight_qdata").view(np.uint8)
    packed = (codes[:, ::2] | (codes[:, 1::2] << 4)).astype(np.uint8) if fmt == "float4_e2m1fn" else codes
    assert packed.tobytes() == stored.tobytes()
    scales = swizzle(np.asarray(q.scale_codes, np.uint8).reshape(160, -1))
    assert scales.tobytes() == f.get(f"{UP}._weight_scale").view(np.uint8).tobytes()
    if folder == "nvfp4":
        assert np.float32(q.global_scale.reshape(-1)[0]).tobytes() == f.get(f"{UP}._weight_per_tensor_scale").tobytes()


def test_cli_verify_and_inspect(capsys):
    assert run_cli("verify", FIX / "mxfp4_even", "--original", ORIGINAL) == 0
    assert "torchao-mx-even" in capsys.readouterr().out
    assert run_cli("inspect", FIX / "nvfp4") == 0
    assert "torchao" in capsys.readouterr().out


def test_nvfp4_codes_come_from_multiplying_by_the_quotient():
    """torchao scales x by fp32(fp32(1/m) / s_b); dividing by fp32(m * s_b) changes codes of this layer."""
    f = SafetensorsFile(FIX / "nvfp4" / "model.safetensors")
    layer = load_checkpoint(FIX / "nvfp4")[UP]
    x = SafetensorsFile(ORIGINAL / "model.safetensors").get(f"{UP}.weight").astype(np.float32)
    m = np.float32(f.get(f"{UP}._weight_per_tensor_scale"))
    s = np.repeat(np.asarray(layer.weight_scale, np.float32), 16, axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        by_quotient = (x * ((np.float32(1) / m) / s).astype(np.float32)).astype(np.float32)
        by_product = (x / (m * s).astype(np.float32)).astype(np.float32)
    enc = [encode(np.clip(y, -6, 6), "float4_e2m1fn", rounding="rne", saturate=True) for y in (by_quotient, by_product)]
    assert np.array_equal(enc[0], layer.weight_codes)
    changed = int(np.count_nonzero(enc[1] != layer.weight_codes))
    assert changed > 0, "dividing by m * s_b should change codes of this layer"


def test_modes_differ_on_the_fixture():
    """Each MX mode's checkpoint fails verification with the other modes' recipes (RCEIL and CEIL coincide
    on MXFP4 amaxes except where amax / 6 is a power of two, so some pairs can agree: none does here)."""
    orig = load_checkpoint(ORIGINAL)
    for elem in ("8", "4"):
        for made in ("floor", "ceil", "rceil", "even"):
            ckpt = load_checkpoint(FIX / f"mxfp{elem}_{made}")
            for other in ("floor", "ceil", "rceil", "even"):
                ok = verify(ckpt, orig, recipe=f"torchao-mx-{other}")["ok"]
                assert ok == (other == made), (elem, made, other)


def test_zero_and_subnormal_blocks():
    """The fixture's all-zero MX block stores byte 0 and +0 codes; its bf16-subnormal block stores byte
    0, whose codes FLOOR/CEIL/EVEN computed against 2^-126 (not the 2^-127 they store) and RCEIL against 1
    (so RCEIL stores signed zeros there: what dequantizes is 0, not the block's values)."""
    for folder in ("mxfp8_floor", "mxfp8_rceil"):
        layer = load_checkpoint(FIX / folder)[UP]
        sc, codes = layer.weight_scale_codes, layer.weight_codes
        assert sc[5, 0] == 0 and not codes[5, :32].any()
        assert sc[7, 1] == 0
    w = SafetensorsFile(ORIGINAL / "model.safetensors").get(f"{UP}.weight").astype(np.float64)[7, 32:64]
    floor = load_checkpoint(FIX / "mxfp8_floor")[UP].weight_codes[7, 32:64]
    want = encode(w * 2.0**126, "float8_e4m3fn", rounding="rne", saturate=True)
    assert np.array_equal(floor, want) and floor.any()
    rceil = load_checkpoint(FIX / "mxfp8_rceil")[UP].weight_codes[7, 32:64]
    assert not (rceil & 0x7F).any() and (rceil == 0x80).any()  # x * 1: signed zeros, the sign kept


MX_RECIPES = ("torchao-mx-floor", "torchao-mx-ceil", "torchao-mx-rceil", "torchao-mx-even")


@pytest.mark.parametrize("recipe, fmt", [(r, f) for r in MX_RECIPES for f in ("float8_e4m3fn", "float4_e2m1fn")]
                         + [("torchao-nvfp4", "float4_e2m1fn"), ("torchao-nvfp4-no-tensor-scale", "float4_e2m1fn")])
def test_all_zero_tensors_never_give_nan(recipe, fmt):
    """fp8ref's recipes give finite scales and zero codes for an all-zero tensor; torchao's NVFP4 with a
    per-tensor scale stores m = 0 there and NaN block scales (0/0), which is why the recipe takes m = 1."""
    x = np.zeros((4, 64), np.float32)
    x[1] = -0.0
    gran = "nvfp4" if "nvfp4" in recipe else "mx"
    q = quantize(x, QuantArgs(format=fmt, granularity=gran), recipe=get_recipe(recipe))
    assert np.isfinite(np.asarray(q.scale)).all()
    assert not np.isnan(decode(np.asarray(q.codes), fmt)).any()
    assert (np.abs(decode(np.asarray(q.codes), fmt)) == 0).all()
    if gran == "nvfp4":
        assert float(np.asarray(q.global_scale).reshape(-1)[0]) == 1.0


# --- hostile metadata and tensors --------------------------------------------------------------------

def _edited(tmp_path: Path, folder: str, edit_meta=None, edit_tensors=None) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(FIX / folder, dst)
    f = SafetensorsFile(dst / "model.safetensors")
    tensors = {n: np.array(f.get(n)) for n in f.tensors}
    dtypes = {n: f.info(n).dtype for n in f.tensors}
    meta = dict(f.metadata)
    if edit_meta:
        edit_meta(meta)
    if edit_tensors:
        edit_tensors(tensors)
    header, offset, blobs = {"__metadata__": meta}, 0, []
    for n in sorted(tensors):  # the stored dtypes kept (get() gives FP8/E8M0 bytes as uint8)
        blob = np.ascontiguousarray(tensors[n]).tobytes()
        header[n] = {"dtype": dtypes[n], "shape": list(tensors[n].shape), "data_offsets": [offset, offset + len(blob)]}
        offset += len(blob)
        blobs.append(blob)
    raw = json.dumps(header).encode()
    (dst / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))
    return dst


KEY = f"{UP}.weight"


def _json_edit(fn):
    def edit(meta):
        doc = json.loads(meta[KEY])
        fn(doc)
        meta[KEY] = json.dumps(doc)
    return edit


def _padding(tensors):
    tensors[f"{UP}._weight_scale"].reshape(-1)[-1] = 0x7F  # zero padding (row 255 of the second 128-row tile)


HOSTILE = {
    "malformed JSON": ("mxfp8_floor", lambda m: m.update({KEY: '{"_type": "MXTensor", '}), None, "malformed JSON"),
    "unknown subclass": ("mxfp8_floor", lambda m: m.update({KEY: json.dumps({"_type": "builtins.eval"})}), None,
                         "unknown torchao tensor subclass 'builtins.eval'"),
    "unknown element dtype": ("mxfp8_floor", _json_edit(lambda d: d["_data"].update(elem_dtype="fp3_e1m1")), None,
                              "element dtype 'fp3_e1m1'"),
    "unknown scaling mode": ("mxfp4_floor", _json_edit(lambda d: d["_data"]["act_quant_kwargs"]["_data"].update(
        scaling_mode={"_type": "ScaleCalculationMode", "_data": "os.system"})), None, "scaling_mode"),
    "extra key": ("mxfp8_floor", _json_edit(lambda d: d["_data"].update(__reduce__="x")), None, "expected an object"),
    "MX block size": ("mxfp8_floor", _json_edit(lambda d: d["_data"].update(block_size=16)), None, "block_size"),
    "static activation scale": ("nvfp4", _json_edit(lambda d: d.update(
        _tensor_data_names=["act_per_tensor_scale", "per_tensor_scale", "qdata", "scale"])), None,
        "act_per_tensor_scale"),
    "unswizzled scale shape": ("mxfp8_floor", _json_edit(lambda d: d["_data"].update(is_swizzled_scales=False)), None,
                               "expected F8_E8M0"),
    "nonzero padding": ("mxfp8_floor", None, _padding, "padding of the swizzled"),
    "NaN block scale": ("nvfp4", None, lambda t: t.update({f"{UP}._weight_scale": swizzle(  # what torchao writes
        np.full((160, 8), 0x7F, np.uint8))}), "all-zero tensor"),
    "zero tensor scale": ("nvfp4", None, lambda t: t.update({f"{UP}._weight_per_tensor_scale": np.float32(0)}),
                          "per-tensor scale 0.0"),
    "FP6 byte": ("mxfp6e2m3_rceil", None, lambda t: t[f"{UP}._weight_qdata"].__setitem__((0, 0), 0xC1),
                 "not a 6-bit"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_input_is_one_error_line(tmp_path, capsys, case):
    folder, meta, tensors, words = HOSTILE[case]
    ckpt = _edited(tmp_path, folder, meta, tensors)
    with pytest.raises(CheckpointError, match=words):
        c = load_checkpoint(ckpt)
        for name in c:
            c[name].dequantize("bfloat16")
    capsys.readouterr()
    before = sorted(p.name for p in ckpt.iterdir())
    assert run_cli("verify", ckpt, "--original", ORIGINAL) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fp8ref: error:") and "model.safetensors" in err[0], err
    assert sorted(p.name for p in ckpt.iterdir()) == before


# --- writing -------------------------------------------------------------------------------------------

def _spec(fmt: str, recipe: str) -> dict:
    """MX weights and inputs of ``fmt`` (torchao's MX config), or NVFP4 weights (its inputs are dynamic)."""
    from fp8ref.formats import FORMATS
    from fp8ref.scheme import PRESETS

    if "nvfp4" in recipe:
        d = PRESETS["NVFP4"].to_dict()
        d.update(act_bits=16)
    else:
        d = PRESETS["MXFP8"].to_dict()
        d.update(weight_format=fmt, act_format=fmt, bits=FORMATS[fmt].bits, act_bits=FORMATS[fmt].bits)
    d.update(recipe=recipe)
    return {"scheme": d}


@pytest.mark.parametrize("folder", sorted(FOLDERS))
def test_export_writes_torchaos_tensors_descriptions_and_config(tmp_path, folder):
    import fp8ref

    fmt, recipe = FOLDERS[folder]
    out = fp8ref.export_checkpoint(ORIGINAL, tmp_path / "o", _spec(fmt, recipe), format="torchao")
    mine, tool = SafetensorsFile(out / "model.safetensors"), SafetensorsFile(FIX / folder / "model.safetensors")
    assert sorted(mine.tensors) == sorted(tool.tensors)
    for n in tool.tensors:
        assert mine.info(n).dtype == tool.info(n).dtype and mine.get(n).tobytes() == tool.get(n).tobytes(), n
    for key, value in tool.metadata.items():
        if key == "tensor_names":
            assert sorted(json.loads(mine.metadata[key])) == sorted(json.loads(value))
        else:
            assert mine.metadata[key] == value, key
    ours = json.loads((out / "config.json").read_text())["quantization_config"]
    assert ours == json.loads((FIX / folder / "config.json").read_text())["quantization_config"]


def test_export_refuses_what_torchao_cannot_hold(tmp_path):
    import fp8ref
    from fp8ref.scheme import PRESETS

    d = PRESETS["MXFP6A16"].to_dict()
    d.update(recipe="torchao-mx-floor")
    with pytest.raises(CheckpointError, match="MX inputs of the same element format"):
        fp8ref.export_checkpoint(ORIGINAL, tmp_path / "a", {"scheme": d}, format="torchao")
    # only torchao stores an NVFP4 layer without a global scale
    with pytest.raises(CheckpointError, match="makes no per-tensor scale; the compressed-tensors format stores one"):
        fp8ref.export_checkpoint(ORIGINAL, tmp_path / "b", _spec("float4_e2m1fn", "torchao-nvfp4-no-tensor-scale"))
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2 ** 32 - 1), rows=st.integers(1, 140), blocks=st.integers(1, 5),
       kind=st.sampled_from(sorted(set(FOLDERS.values()))))
def test_export_load_export_is_byte_identical(tmp_path_factory, seed, rows, blocks, kind):
    import ml_dtypes

    import fp8ref
    from fp8ref.checkpoint import write_checkpoint
    from fp8ref.io.safetensors import save

    fmt, recipe = kind
    tmp = tmp_path_factory.mktemp("rt")
    rng = np.random.default_rng(seed)
    cols = blocks * 32
    w = (rng.standard_normal((rows, cols)) * 0.05 * np.exp(rng.standard_normal((rows, 1)))).astype(ml_dtypes.bfloat16)
    w[rng.integers(0, rows), :16] = 0  # a zero block (NVFP4) or half of one (MX)
    (tmp / "src").mkdir()
    save(tmp / "src" / "model.safetensors", {"m.proj.weight": w})
    (tmp / "src" / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    a = fp8ref.export_checkpoint(tmp / "src", tmp / "a", _spec(fmt, recipe), format="torchao")
    ckpt = load_checkpoint(a)
    assert verify(ckpt, load_checkpoint(tmp / "src"))["ok"]
    b = write_checkpoint(ckpt, tmp / "b")
    for name in ("model.safetensors", "config.json"):
        assert (Path(a) / name).read_bytes() == (Path(b) / name).read_bytes(), name


@pytest.mark.parametrize("folder", sorted(NV_FOLDERS))
def test_nvfp4_export_of_the_fixture_model_rewrites_byte_for_byte(tmp_path, folder):
    """With and without the per-tensor scale: export -> load (the description decides the recipe) ->
    write_checkpoint gives the same bytes, and verify re-derives every code from the original."""
    import fp8ref
    from fp8ref.checkpoint import write_checkpoint

    fmt, recipe = NV_FOLDERS[folder]
    a = fp8ref.export_checkpoint(ORIGINAL, tmp_path / "a", _spec(fmt, recipe), format="torchao")
    ckpt = load_checkpoint(a)
    assert any(n.endswith("_weight_per_tensor_scale") for n in ckpt.store) == (recipe == "torchao-nvfp4")
    res = verify(ckpt, load_checkpoint(ORIGINAL))
    assert res["ok"] and {x["recipe"] for x in res["layers"]} == {recipe}
    b = write_checkpoint(ckpt, tmp_path / "b")
    for name in ("model.safetensors", "config.json"):
        assert (Path(a) / name).read_bytes() == (Path(b) / name).read_bytes(), name


@pytest.mark.parametrize("folder", ["mxfp8_floor", "mxfp4_rceil", "nvfp4"])
def test_producer_forward_names_where_torchaos_cpu_forward_stops(folder):
    import torch

    layer = load_checkpoint(FIX / folder)["model.layers.0.mlp.down_proj"]
    x = torch.ones(2, 64, dtype=torch.bfloat16)
    assert np.asarray(layer.forward(x.float().numpy())).shape == (2, 32)  # fp8ref's reference forward runs
    with pytest.raises(CheckpointError, match="does not run on CPU"):
        layer.forward(x, mode="producer")


@settings(max_examples=40, deadline=None)
@given(folder=st.sampled_from(["mxfp6e3m2_rceil", "nvfp4", "mxfp4_even"]), pos=st.integers(0, 10 ** 6),
       char=st.sampled_from(list('{}[]":,0123456789 tfnxel_')))
def test_a_mutated_description_loads_or_is_one_checkpoint_error(tmp_path_factory, folder, pos, char):
    """One character of a weight's JSON replaced: either still a valid description (then it dequantizes
    or is refused) or a CheckpointError; never another exception."""
    def mutate(meta):
        raw = meta[KEY]
        i = pos % len(raw)
        meta[KEY] = raw[:i] + char + raw[i + 1:]

    ckpt = _edited(tmp_path_factory.mktemp("m"), folder, mutate)
    try:
        c = load_checkpoint(ckpt)
        for name in c:
            c[name].dequantize("bfloat16")
    except CheckpointError as exc:
        assert "\n" not in str(exc) and "model.safetensors" in str(exc)


@pytest.mark.parametrize("folder", ["mxfp8_even", "nvfp4"])
def test_unswizzled_scales_read_as_torchao_dequantizes_them(tmp_path, folder):
    """is_swizzled_scales false (MXTensor.to_mx's default): the [out, in/block] scale matrix as is. Made
    here from the fixture by torchao's own from_blocked layout (row r = 32 i + j, column c at byte
    16 j + 4 i + c of each 512-byte tile), written out with plain indexing; torchao's dequantize hash holds."""
    def unblock(stored, rows, cols):
        out = np.zeros((rows, cols), np.uint8)
        tiles = stored.reshape(-1)
        col_tiles = -(-cols // 4)
        for r in range(rows):
            for c in range(cols):
                tile = (r // 128) * col_tiles + c // 4
                i, j = (r % 128) // 32, r % 32
                out[r, c] = tiles[tile * 512 + 16 * j + 4 * i + c % 4]
        return out

    block = 16 if folder == "nvfp4" else 32

    def edit_meta(meta):
        for key in (f"{UP}.weight", "model.layers.0.mlp.down_proj.weight"):
            doc = json.loads(meta[key])
            doc["_data"]["is_swizzled_scales"] = False
            meta[key] = json.dumps(doc)

    def edit_tensors(t):
        for m, (rows, cols) in ((UP, (160, 128)), ("model.layers.0.mlp.down_proj", (32, 64))):
            t[f"{m}._weight_scale"] = unblock(t[f"{m}._weight_scale"], rows, cols // block)

    ckpt = _edited(tmp_path, folder, edit_meta, edit_tensors)
    want = json.loads((FIX / folder / "dequantized.json").read_text())
    c = load_checkpoint(ckpt)
    for name in c:
        assert _sha(np.asarray(c[name].dequantize("bfloat16"))) == want[f"{name}.weight"], name
    assert verify(c, load_checkpoint(ORIGINAL))["ok"]
