"""GGUF MXFP4 checkpoints (fp8ref.io.gguf, fp8ref.checkpoint.gguf) and the ``ggml-mxfp4`` recipe.

Evidence: tests/fixtures/gguf/*.gguf written by gguf 0.19.0's own GGUFWriter and MXFP4 quantizer
(tools/make_gguf_fixtures.py); a float32 transcription of llama.cpp's quantize_row_mxfp4_ref
(best_index_mxfp4: the first of equal errors) with the C library's own log2f (ctypes); llama.cpp's
dequantization (kvalues_mxfp4 x 2^(e-128)) written out here, not through fp8ref's codec.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fp8ref.checkpoint import load_checkpoint
from fp8ref.checkpoint.gguf import export, rewrite
from fp8ref.errors import CheckpointError
from fp8ref.io.gguf import GgufFile
from fp8ref.nn.verify import verify
from fp8ref.quant import QuantArgs, quantize
from tests.support.cli import run_cli

FIX = Path(__file__).resolve().parents[2] / "fixtures" / "gguf"
KVALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.float32)
SPEC = {"scheme": {"bits": 4, "group_size": 32, "data_type": "mx_fp", "act_bits": 16, "recipe": "ggml-mxfp4"}}

_libm = ctypes.CDLL(ctypes.util.find_library("m"))
_libm.log2f.restype, _libm.log2f.argtypes = ctypes.c_float, [ctypes.c_float]


def _half(e: int) -> np.float32:
    """ggml_e8m0_to_fp32_half: 2^(e - 128) as float32 bits."""
    bits = (0x00200000 << e) if e < 2 else ((e - 1) << 23)
    return np.array([bits], np.uint32).view(np.float32)[0]


def ggml_quantize_row(x: np.ndarray) -> bytes:
    """quantize_row_mxfp4_ref, element by element in float32 (C's log2f, floorf, fabsf)."""
    out = bytearray()
    for blk in np.asarray(x, np.float32).reshape(-1, 32):
        amax = np.float32(0)
        for v in blk:
            if amax < abs(v):
                amax = abs(v)
        e = int(np.floor(np.float32(_libm.log2f(float(amax))))) - 2 + 127 if amax > 0 else 0
        d = _half(e)
        idx = []
        for v in blk:
            best, err = 0, abs(np.float32(KVALUES[0] * d) - v)
            for i in range(1, 16):
                cand = abs(np.float32(KVALUES[i] * d) - v)
                if cand < err:
                    best, err = i, cand
            idx.append(best)
        out += bytes([e]) + bytes(idx[j] | (idx[j + 16] << 4) for j in range(16))
    return bytes(out)


def ggml_dequantize(blocks: np.ndarray, shape) -> np.ndarray:
    b = blocks.reshape(-1, 17)
    d = np.array([_half(int(e)) for e in b[:, 0]], np.float32)[:, None]
    q = np.concatenate([b[:, 1:] & 15, b[:, 1:] >> 4], axis=1)
    return (KVALUES[q] * d).reshape(shape)


def _ours(x: np.ndarray) -> bytes:
    from fp8ref.io.gguf import mxfp4_blocks
    from fp8ref.io.safetensors import pack_nibbles

    r = quantize(x, QuantArgs(format="float4_e2m1fn", granularity="mx"), recipe="ggml-mxfp4")
    return mxfp4_blocks(pack_nibbles(np.asarray(r.codes)), np.asarray(r.scale_codes, np.uint8)).tobytes()


# --- the recipe -------------------------------------------------------------------------------

def test_ties_go_to_the_smaller_magnitude_and_never_negative_zero():
    x = np.array([0.75, 3.5, -0.75, -3.5, 0.25, -0.25, 2.5, -5, -0.0, -1e-30, 1.25, 12] + [0] * 20, np.float32)
    assert _ours(x[None]) == ggml_quantize_row(x)
    codes = quantize(x[None], QuantArgs(format="float4_e2m1fn", granularity="mx"), recipe="ggml-mxfp4").codes
    assert 0x8 not in np.asarray(codes)  # -0.0, -1e-30, -0.25 all give +0


def test_log2f_rounds_up_just_below_a_power_of_two_exhaustively():
    """Every float32 amax within 64 ulps below 2^k, k = -120..120: the scale byte is C's floorf(log2f)."""
    for k in range(-120, 121):
        top = np.float32(2.0 ** k)
        below = top.view(np.uint32) - np.arange(1, 65, dtype=np.uint32)
        amax = below.view(np.float32)
        x = np.zeros((amax.size, 32), np.float32)
        x[:, 0] = amax
        r = quantize(x, QuantArgs(format="float4_e2m1fn", granularity="mx"), recipe="ggml-mxfp4")
        want = [int(np.floor(np.float32(_libm.log2f(float(a))))) - 2 + 127 for a in amax]
        assert np.asarray(r.scale_codes).reshape(-1).tolist() == want, k


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2 ** 32 - 1), exp=st.integers(-20, 10), ties=st.booleans())
def test_recipe_equals_llama_cpp_reference(seed, exp, ties):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((2, 64)) * 2.0 ** exp).astype(np.float32)
    if ties:  # exact midpoints of the scaled grid
        x = (rng.choice([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0], size=x.shape)
             * rng.choice([-1, 1], size=x.shape) * 2.0 ** exp).astype(np.float32)
    assert _ours(x) == ggml_quantize_row(x)


# --- reading the tool's files ----------------------------------------------------------------

def test_fixture_layers_dequantize_as_llama_cpp():
    ckpt = load_checkpoint(FIX / "mxfp4.gguf")
    f = GgufFile(FIX / "mxfp4.gguf")
    mx = [t for t in f.gguf_tensors.values() if t.type_name == "MXFP4"]
    assert sorted(ckpt) == sorted(t.name[: -len(".weight")] for t in mx) and len(mx) == 5
    for t in mx:
        layer = ckpt[t.name[: -len(".weight")]]
        want = ggml_dequantize(f.raw(t.name), layer.shape)
        assert np.array_equal(layer.dequantize("float32").view(np.uint32), want.view(np.uint32)), t.name
    assert ckpt["blk.0.ffn_down_exps"].shape == (128, 64)  # [2, 64, 64] experts as 128 rows


def test_verify_finds_the_ggml_recipe_and_the_ocp_recipe_differs():
    ckpt, orig = load_checkpoint(FIX / "mxfp4.gguf"), load_checkpoint(FIX / "original.gguf")
    res = verify(ckpt, orig)
    assert res["ok"] and {x["recipe"] for x in res["layers"]} == {"ggml-mxfp4"}
    assert res["unquantized"]["checked"] == 2
    ocp = verify(ckpt, orig, recipe="fp8ref")
    assert not ocp["ok"] and all(x["code_mismatches"] > 0 for x in ocp["layers"])


def test_export_reproduces_gguf_bytes_and_rewrites_identically(tmp_path):
    out = export(FIX / "original.gguf", tmp_path / "a.gguf", SPEC)
    mine, tool = GgufFile(out), GgufFile(FIX / "mxfp4.gguf")
    assert list(mine.gguf_tensors) == list(tool.gguf_tensors)
    for name, t in tool.gguf_tensors.items():
        assert mine.gguf_tensors[name].type_name == t.type_name
        assert mine.raw(name).tobytes() == tool.raw(name).tobytes(), name
    rewrite(out, tmp_path / "b.gguf")
    assert (tmp_path / "a.gguf").read_bytes() == (tmp_path / "b.gguf").read_bytes()
    assert verify(load_checkpoint(out), load_checkpoint(FIX / "original.gguf"))["layers"][0]["recipe"] == "ggml-mxfp4"


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2 ** 32 - 1), rows=st.integers(1, 4), blocks=st.integers(1, 3),
       dtype=st.sampled_from(["F32", "F16", "BF16"]))
def test_export_load_export_is_byte_identical(tmp_path_factory, seed, rows, blocks, dtype):
    from fp8ref.io.safetensors import save
    from fp8ref.rounding import round_to

    tmp = tmp_path_factory.mktemp("rt")
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, 32 * blocks)) * 2.0 ** rng.integers(-10, 5)
    np_dtype = {"F32": np.float32, "F16": np.float16, "BF16": None}[dtype]
    w = round_to(w, "bfloat16").astype(np.float32) if np_dtype is None else w.astype(np_dtype)
    save(tmp / "orig.safetensors", {"m.weight": w, "m.bias": np.arange(rows, dtype=np.float32)})
    a = export(tmp / "orig.safetensors", tmp / "a.gguf", SPEC)
    rewrite(a, tmp / "b.gguf")
    assert a.read_bytes() == (tmp / "b.gguf").read_bytes()
    layer = load_checkpoint(a)["m"]
    assert layer.bias.tolist() == list(range(rows))
    assert GgufFile(a).raw("m.weight").tobytes() == ggml_quantize_row(np.asarray(w, np.float32))


def test_cli_inspect_verify_quantize(tmp_path, capsys):
    assert run_cli("inspect", FIX / "mxfp4.gguf") == 0
    assert "gguf, model dtype float32, 5 quantized layers" in capsys.readouterr().out
    assert run_cli("verify", FIX / "mxfp4.gguf", "--original", FIX / "original.gguf") == 0
    assert "recipe 'ggml-mxfp4'" in capsys.readouterr().out
    spec = tmp_path / "spec.yaml"
    spec.write_text("scheme: {bits: 4, group_size: 32, data_type: mx_fp, act_bits: 16, recipe: ggml-mxfp4}\n")
    assert run_cli("quantize", FIX / "original.gguf", tmp_path / "o.gguf", "--spec", spec, "--format", "gguf") == 0
    assert run_cli("verify", tmp_path / "o.gguf", "--original", FIX / "original.gguf") == 0


def test_quantize_refuses_an_output_not_named_gguf_before_writing(tmp_path, capsys):
    """A GGUF is known by its suffix: written as OUT it could not be read back (quantize used to write
    it, then fail reading it as safetensors)."""
    spec = tmp_path / "spec.yaml"
    spec.write_text("scheme: {bits: 4, group_size: 32, data_type: mx_fp, act_bits: 16, recipe: ggml-mxfp4}\n")
    capsys.readouterr()
    assert run_cli("quantize", FIX / "original.gguf", tmp_path / "o", "--spec", spec, "--format", "gguf") == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0] == (f"fp8ref: error: {tmp_path / 'o'}: a GGUF is one file named *.gguf (fp8ref "
                                        "and llama.cpp know it by that suffix); name the output o.gguf")
    assert sorted(os.listdir(tmp_path)) == ["spec.yaml"]


# --- hostile files ---------------------------------------------------------------------------

def _header(n_tensors=1, n_kv=0, version=3) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv)


def _tensor_info(name=b"m.weight", ne=(32, 2), gtype=39, offset=0) -> bytes:
    return (struct.pack("<Q", len(name)) + name + struct.pack("<I", len(ne)) + struct.pack(f"<{len(ne)}Q", *ne)
            + struct.pack("<IQ", gtype, offset))


def _pad(b: bytes) -> bytes:
    return b + b"\0" * (-len(b) % 32)


GOOD = _pad(_header() + _tensor_info()) + bytes([127] + [0x21] * 16) * 2
BAD = {
    "truncated header": (GOOD[:10], "truncated"),
    "truncated tensor info": (_header() + _tensor_info()[:12], "truncated"),
    "tensor count past the end": (_header(n_tensors=5) + _tensor_info(), "truncated"),
    "key-value count past the end": (_header(n_kv=3) + _tensor_info(), "truncated|type|string length"),
    "huge tensor count": (_header(n_tensors=2 ** 40), "tensor count"),
    "offset past the end": (_pad(_header() + _tensor_info(offset=64)) + GOOD[-34:], "outside"),
    "data past the end": (_pad(_header() + _tensor_info(ne=(32, 9))) + GOOD[-34:], "outside"),
    "unknown GGML type": (_pad(_header() + _tensor_info(gtype=77)) + GOOD[-34:], "unknown GGML type 77"),
    "not gguf": (b"GGUX" + GOOD[4:], "magic"),
    "bad version": (_pad(_header(version=9) + _tensor_info()) + GOOD[-34:], "version 9"),
    "partial block": (_pad(_header() + _tensor_info(ne=(16, 2))) + GOOD[-34:], "whole 32-element"),
}


def test_handmade_file_reads(tmp_path):
    """The byte 0x21 holds element j = 1 (0.5 at e = 127) and element j + 16 = 2 (1.0)."""
    path = tmp_path / "good.gguf"
    path.write_bytes(GOOD)
    w = load_checkpoint(path)["m"].dequantize("float32")
    assert w.shape == (2, 32) and (w[:, :16] == 0.5).all() and (w[:, 16:] == 1.0).all()


@pytest.mark.parametrize("case", list(BAD))
def test_hostile_gguf_is_one_error_naming_file_and_nothing_written(tmp_path, capsys, case):
    data, words = BAD[case]
    path = tmp_path / "bad.gguf"
    path.write_bytes(data)
    with pytest.raises(CheckpointError, match=words) as info:
        load_checkpoint(path)
    assert str(path) in str(info.value)
    if "GGML type" in words or "outside" in words:
        assert "'m.weight'" in str(info.value)
    spec = tmp_path / "spec.yaml"
    spec.write_text("scheme: {bits: 4, group_size: 32, data_type: mx_fp, act_bits: 16, recipe: ggml-mxfp4}\n")
    capsys.readouterr()
    assert run_cli("quantize", path, tmp_path / "out.gguf", "--spec", spec, "--format", "gguf") == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fp8ref: error:") and str(path) in err[0]
    assert sorted(os.listdir(tmp_path)) == ["bad.gguf", "spec.yaml"]


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_any_truncation_or_header_byte_change_is_read_or_one_checkpoint_error(tmp_path_factory, data):
    """A cut anywhere, or up to 3 bytes of the header overwritten: a CheckpointError or a valid read,
    never another exception."""
    raw = bytearray((FIX / "mxfp4.gguf").read_bytes())
    header_end = GgufFile(FIX / "mxfp4.gguf").data_start
    if data.draw(st.booleans()):
        raw = raw[: data.draw(st.integers(0, len(raw) - 1))]
    else:
        for _ in range(data.draw(st.integers(1, 3))):
            raw[data.draw(st.integers(0, header_end - 1))] = data.draw(st.integers(0, 255))
    path = tmp_path_factory.mktemp("fuzz") / "x.gguf"
    path.write_bytes(bytes(raw))
    try:
        ckpt = load_checkpoint(path)
        for name in ckpt:
            ckpt[name].dequantize("float32")
    except CheckpointError as exc:
        assert str(path) in str(exc)
