"""verify's fast path (mapped reads, quantize finding the amax itself with the codes, one reused codes
buffer, bytes compared 8 at a time) gives the very report of the plain computation: every layer
quantized with amax = max|W| given, its codes read by a copy, every mask counted and searched. Checked
on clean layers, NaN / Inf / zero rows and a changed ulp in the original, a flipped code, per-tensor,
per-channel, static and block (not dividing) schemes, and the real tools' checkpoints. And ``fp8ref
verify`` does not import torch."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import fp8ref
import fp8ref.nn.verify as engine
from fp8ref import _native
from fp8ref.errors import Fp8RefError, ModelError
from fp8ref.io.safetensors import open_store, write_safetensors

CKPTS = Path(__file__).resolve().parents[2] / "fixtures" / "interop" / "checkpoints"
SHAPES = (("mlp.down_proj", (96, 200)), ("self_attn.q_proj", (130, 64)), ("mlp.up_proj", (40, 96)))


def plain_layer(layer, weight, recipe=None, input_amax=None, model_dtype="bfloat16", global_amax=None, *,
                dtype=None, **_):
    """verify_layer as plain as it can be written (the computation before the fast path): bfloat16
    through ml_dtypes' dtype and the public quantize."""
    from fp8ref.checkpoint import base
    from fp8ref.quant import SELF_SCALED, as_args, quantize
    from fp8ref.scaling import reduce_amax

    if dtype == "bfloat16":  # verify reads a BF16 original as its bit patterns
        weight = np.asarray(weight).view(ml_dtypes.bfloat16)
    qa = as_args(layer.scheme)
    if tuple(weight.shape) != tuple(layer.shape):
        raise ModelError(f"{layer.name}: original weight {list(weight.shape)}, checkpoint {list(layer.shape)}")
    amax = None if qa.granularity in SELF_SCALED else reduce_amax(weight, qa.granularity, group_size=qa.group_size,
                                                                  block_shape=qa.block_shape)
    stored = layer.weight_codes
    scheme = layer.scheme
    if not base.get(layer.producer).scales_follow_recipe and qa.granularity not in SELF_SCALED:
        scheme = scheme.replace(scale_dtype="model")
    try:
        q = quantize(np.array(weight), scheme, recipe=recipe, amax=amax)
    except Fp8RefError as exc:
        n = int(np.asarray(layer.weight_scale).size)
        return {"name": layer.name, "recipe": recipe or layer.scheme["recipe"], "codes": int(stored.size),
                "code_mismatches": int(stored.size), "first_code_mismatch": None, "scales": n,
                "scale_mismatches": n, "first_scale_mismatch": None, "error": str(exc)}
    bad = np.argwhere(np.asarray(q.codes) != stored)
    c = engine._compare_scales(*engine._as_bits(q.scale), *engine._as_bits(layer.weight_scale))
    out = {"name": layer.name, "recipe": recipe or layer.scheme["recipe"], "codes": int(stored.size),
           "code_mismatches": len(bad), "first_code_mismatch": [int(i) for i in bad[0]] if len(bad) else None,
           "scales": int(np.asarray(layer.weight_scale).size), "scale_mismatches": c["mismatches"],
           "first_scale_mismatch": c["first"], **({"scale_note": c["note"]} if "note" in c else {})}
    if layer.quant.input == "static":
        if input_amax is None:
            out["input_scale"] = "not re-derived (needs the calibration data)"
        else:
            out["input_scale"] = engine._input_scale(layer, input_amax, out["recipe"], model_dtype)
            out["scale_mismatches"] += out["input_scale"] != "ok"
    return out


def _plain_report(ckpt, original, monkeypatch, **kw) -> dict:
    with monkeypatch.context() as m:
        m.setattr(engine, "verify_layer", plain_layer)
        m.setattr(engine, "_same_bytes", lambda a, b: a.dtype == b.dtype and np.array_equal(
            engine._bits(np.asarray(a)), engine._bits(np.asarray(b))))
        return engine.verify(ckpt, original, **kw)


def _original(folder: Path, rng) -> None:
    folder.mkdir(parents=True)
    t = {f"model.layers.{i}.{n}.weight": ("BF16", (rng.standard_normal(s) * 0.02).astype(ml_dtypes.bfloat16))
         for i in range(2) for n, s in SHAPES}
    t["model.embed_tokens.weight"] = ("BF16", rng.standard_normal((50, 64)).astype(ml_dtypes.bfloat16))
    write_safetensors(folder / "model.safetensors", t, {"format": "pt"})


def _edited_original(src: Path, dst: Path, edit) -> None:
    store = open_store(src)
    t = {n: ("BF16", np.array(store.get(n))) for n in store}
    edit(t)
    dst.mkdir(parents=True)
    write_safetensors(dst / "model.safetensors", t, {"format": "pt"})


DOWN = "model.layers.1.mlp.down_proj.weight"
EDITS = {
    "clean": lambda t: None,
    "nan": lambda t: t[DOWN][1].__setitem__((1, 3), np.nan),
    "inf": lambda t: t[DOWN][1].__setitem__((2, 5), -np.inf),
    "zero-rows": lambda t: t[DOWN][1].__setitem__(slice(0, 4), 0),
    "one-ulp": lambda t: (t[DOWN][1].view(np.uint16).__setitem__((7, 7), t[DOWN][1].view(np.uint16)[7, 7] + 1),
                          t["model.embed_tokens.weight"][1].view(np.uint16).__setitem__((0, 0), 0x3F80)),
}
SCHEMES = {"channel": "FP8_DYNAMIC", "tensor": {"scheme": "FP8_DYNAMIC", "weight_granularity": "tensor"},
           "static": "FP8", "block": "FP8_BLOCK"}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("verify-paths")
    _original(root / "orig", np.random.default_rng(3))
    for name, scheme in SCHEMES.items():
        cal = {f"model.layers.{i}.{n}": 0.75 for i in range(2) for n, _ in SHAPES} if name == "static" else None
        fp8ref.export_checkpoint(root / "orig", root / name, {"scheme": scheme}, calibration=cal)
    for edit, fn in EDITS.items():
        _edited_original(root / "orig", root / f"orig-{edit}", fn)
    flipped = root / "channel-flipped"
    shutil.copytree(root / "channel", flipped)
    raw = bytearray((flipped / "model.safetensors").read_bytes())
    n = int.from_bytes(raw[:8], "little")
    begin = json.loads(raw[8:8 + n])["model.layers.0.mlp.up_proj.weight"]["data_offsets"][0]
    raw[8 + n + begin + 3 * 96 + 5] ^= 0x01
    (flipped / "model.safetensors").write_bytes(bytes(raw))
    return root


@pytest.mark.parametrize("scheme", [*SCHEMES, "channel-flipped"])
@pytest.mark.parametrize("edit", list(EDITS))
def test_fast_path_report_equals_the_plain_computation(exported, scheme, edit, monkeypatch):
    ckpt, orig = fp8ref.load_checkpoint(exported / scheme), fp8ref.load_checkpoint(exported / f"orig-{edit}")
    for recipe in (None, "compressed-tensors", "auto-round", "hf-fp8", "fp8ref"):
        got = engine.verify(ckpt, orig, recipe=recipe)
        assert got == _plain_report(ckpt, orig, monkeypatch, recipe=recipe), recipe
        if edit == "clean" and recipe is None:  # the recorded recipe
            assert got["ok"] == (scheme != "channel-flipped")
    if edit in ("nan", "inf"):  # fp8ref's recipe refuses NaN/Inf; the message is the plain call's (amax given)
        errors = [x.get("error", "") for x in engine.verify(ckpt, orig, recipe="fp8ref")["layers"]]
        assert sum(e.startswith("amax: expected finite non-negative values") for e in errors) == 1


@pytest.mark.parametrize("fixture, original", [
    *[(CKPTS / f, CKPTS / "original_bf16") for f in ("llmc_fp8", "llmc_fp8_dynamic", "llmc_fp8_block",
                                                      "autoround_fp8_static_llmc")],
    (CKPTS / "llmc_mixtral_fp8_dynamic", CKPTS / "moe_mixtral_bf16"),  # renamed experts
    (CKPTS.parents[1] / "gptoss" / "mxfp4", CKPTS.parents[1] / "gptoss" / "original_bf16")])  # MXFP4: codes copied
def test_fast_path_on_the_real_tools_checkpoints(fixture, original, monkeypatch):
    ckpt, orig = fp8ref.load_checkpoint(fixture), fp8ref.load_checkpoint(original)
    for recipe in (None, "compressed-tensors"):
        got = engine.verify(ckpt, orig, recipe=recipe)
        assert got == _plain_report(ckpt, orig, monkeypatch, recipe=recipe), recipe
    assert engine.verify(ckpt, orig)["ok"]


def test_one_scratch_serves_layers_of_every_shape(exported):
    """The reused codes buffer grows to the largest layer and is a view of the right shape each time."""
    ckpt, orig = fp8ref.load_checkpoint(exported / "channel"), fp8ref.load_checkpoint(exported / "orig-clean")
    scratch = engine.Scratch()
    for name in sorted(ckpt, key=lambda n: ckpt[n].shape[0] * ckpt[n].shape[1]) * 2:
        r = engine.verify_layer(ckpt[name], engine.original_weight(ckpt[name], orig, mapped=True), scratch=scratch)
        assert r["code_mismatches"] == 0 and r["scale_mismatches"] == 0, name
    assert scratch.codes((3, 4)).shape == (3, 4)


def test_same_bytes():
    a = np.arange(37, dtype=np.uint8)
    for i in (0, 31, 32, 36):  # in the 8-byte words and in the tail
        b = a.copy()
        b[i] ^= 0x80
        assert not engine._same_bytes(a, b) and engine._same_bytes(a, a.copy())
    assert not engine._same_bytes(a, a[:36]) and engine._same_bytes(a[:0], a[:0])
    x = np.array([np.nan, -0.0], np.float32)
    assert engine._same_bytes(x, x.copy()) and not engine._same_bytes(x, np.array([np.nan, 0.0], np.float32))


@pytest.mark.parametrize("fixture, original, rc", [
    ("llmc_fp8", "original_bf16", 0),  # BF16 per-channel weight scales
    ("llmc_fp8_block", "original_bf16", 0),
    ("autoround_fp8_static", "original_bf16", 0),  # BF16 input scales
    ("quark_fp8", "original_bf16", 1),  # BF16 KV output scales (made from another original: mismatches)
    ("llmc_nvfp4", "original_fp4_mx_bf16", 0),
    ("llmc_mxfp8", "original_fp4_mx_bf16", 0),
])
def test_verify_command_imports_neither_torch_nor_ml_dtypes(fixture, original, rc):
    """BF16 originals and scales are read as their bit patterns: importing ml_dtypes was a quarter of
    verify's CPU at 1B, and torch would be more; --json too (its writer was in the torch layer). Without
    the C loops (FP8REF_NO_KERNELS=1) the numpy quantize takes a BF16 amax through ml_dtypes: that path
    is for correctness, not speed, so only torch is ruled out there."""
    code = ("import sys; from fp8ref.cli import main; "
            f"rc = main(['verify', {str(CKPTS / fixture)!r}, '--original', {str(CKPTS / original)!r}, "
            "'--json', '-']); print(rc, 'torch' in sys.modules, 'ml_dtypes' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[3]).stdout
    ml = "False" if _native.kernels_available() else out.strip().split()[-1]
    assert out.strip().splitlines()[-1] == f"{rc} False {ml}"


def test_read_tensor_gives_bf16_bits_and_a_layer_class_own_reading():
    """QuantizedLayer.read_tensor (what verify compares): a BF16 scale as its bit patterns, the same
    bytes as the ``weight_scale`` property's ml_dtypes array; a layer class with its own
    ``weight_scale`` property (torchao's unswizzled block scales) is read through it."""
    ckpt = fp8ref.load_checkpoint(CKPTS / "llmc_fp8")
    layer = ckpt[next(iter(ckpt))]
    bits, dtype = layer.read_tensor("weight_scale", bf16_bits=True)
    assert dtype == "bfloat16" and bits.dtype == np.uint16
    assert bits.tobytes() == np.asarray(layer.weight_scale).tobytes()
    assert layer.read_tensor("bias", bf16_bits=True) is None

    class OwnScale(type(layer)):
        @property
        def weight_scale(self):
            return np.full((3, 1), 2.0, ml_dtypes.bfloat16)

    layer.__class__ = OwnScale
    bits, dtype = layer.read_tensor("weight_scale", bf16_bits=True)
    assert dtype == "bfloat16" and bits.tolist() == [[0x4000]] * 3
