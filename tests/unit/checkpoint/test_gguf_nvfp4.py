"""GGUF NVFP4 (llama.cpp ``GGML_TYPE_NVFP4``): reading, the ``ggml-nvfp4`` recipe, verify, export.

Evidence: tests/fixtures/gguf/nvfp4.gguf holds blocks made by llama.cpp's own C quantizer
(quantize_row_nvfp4_ref compiled from its source by tools/make_gguf_nvfp4_fixtures.py, written by
gguf 0.19.0's GGUFWriter) from the weights of original_nvfp4.gguf; nvfp4_dequantized.gguf holds
gguf 0.19.0's own dequantization of those blocks and of every scale byte under every code. A scalar
float32 transcription of the C quantizer is checked against the C's bytes here, then used for
random inputs.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fp8ref.checkpoint import load_checkpoint
from fp8ref.checkpoint.gguf import export, quantize_weight, rewrite
from fp8ref.errors import CheckpointError, EncodeError
from fp8ref.io.gguf import GgufFile
from fp8ref.microscaling import ggml_fp32_to_ue4m3, ggml_nvfp4_dequantize
from fp8ref.nn.verify import verify
from tests.support.cli import run_cli

FIX = Path(__file__).resolve().parents[2] / "fixtures" / "gguf"
KVALUES = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12]
SPEC = {"scheme": {"bits": 4, "group_size": 16, "data_type": "nv_fp", "act_bits": 16, "recipe": "ggml-nvfp4"}}
F32 = np.float32


# --- a scalar transcription of llama.cpp's C, one float32 operation at a time -------------------

def c_ue4m3(x: F32) -> int:
    """ggml_fp32_to_ue4m3."""
    if not x > 0:
        return 0
    x = min(x, F32(448))
    bits = int(np.array([x], F32).view(np.uint32)[0])
    exp = ((bits >> 23) & 0xFF) - 127 + 7
    if exp <= 0:
        man = int(F32(F32(x * F32(512)) + F32(0.5)))  # float32 multiply and add, then C's truncation
        return 0 if man < 1 else min(man, 7)
    if exp >= 15:
        return 0x7E
    man = ((bits >> 20) & 7) + ((bits >> 19) & 1)
    if man > 7:
        man, exp = 0, exp + 1
        if exp >= 15:
            return 0x7E
    return (exp << 3) | man


def c_ue4m3_half(b: int) -> F32:
    """ggml_ue4m3_to_fp32."""
    if b in (0, 0x7F):
        return F32(0)
    exp, man = (b >> 3) & 0xF, b & 7
    raw = F32(np.ldexp(F32(man), -9)) if exp == 0 else F32(np.ldexp(F32(1 + F32(man) / F32(8)), exp - 7))
    return F32(raw * F32(0.5))


def c_quantize_row(x: np.ndarray) -> bytes:
    """quantize_row_nvfp4_ref."""
    out = bytearray()
    for blk in np.asarray(x, F32).reshape(-1, 64):
        scales, qs = [], []
        for sub in blk.reshape(4, 16):
            amax = F32(0)
            for v in sub:
                if amax < abs(v):
                    amax = abs(v)
            s = c_ue4m3(F32(amax / F32(6)))
            d = c_ue4m3_half(s)
            idx = []
            for v in sub:
                best, err = 0, abs(F32(F32(KVALUES[0]) * d) - v)
                for i in range(1, 16):
                    e = abs(F32(F32(KVALUES[i]) * d) - v)
                    if e < err:
                        best, err = i, e
                idx.append(best)
            scales.append(s)
            qs += [idx[j] | (idx[j + 8] << 4) for j in range(8)]
        out += bytes(scales) + bytes(qs)
    return bytes(out)


def ours(w: np.ndarray) -> bytes:
    return quantize_weight(np.asarray(w, F32), "ggml-nvfp4", "NVFP4")[0].tobytes()


# --- the recipe ---------------------------------------------------------------------------------

def test_the_recipe_reproduces_every_byte_of_llama_cpps_quantizer():
    tool, orig = GgufFile(FIX / "nvfp4.gguf"), GgufFile(FIX / "original_nvfp4.gguf")
    nv = [t.name for t in tool.gguf_tensors.values() if t.type_name == "NVFP4"]
    assert len(nv) == 5
    for name in nv:
        assert ours(orig.get(name)) == tool.raw(name).tobytes(), name
        assert c_quantize_row(orig.get(name)) == tool.raw(name).tobytes(), name  # the transcription too
    scales = tool.get("blk.0.attn_q.weight_scale")[:8, 0].tolist()  # the fixture's edge rows
    assert scales == [0x00, 0x3C, 0x30, 0x02, 0x01, 0x7E, 0x7E, 0x7E]


def test_ue4m3_matches_the_c_rule_on_every_boundary():
    """Every float32 within 3 ulps of each UE4M3 value and of each midpoint (and x*512 + 0.5 near
    the subnormal thresholds, 256, 448), 0, -0, negatives, NaN, Inf."""
    grid = [float(b & 7) * 2.0 ** -9 if b < 8 else (1 + (b & 7) / 8) * 2.0 ** ((b >> 3) - 7) for b in range(127)]
    points = sorted(set(grid + [(a + b) / 2 for a, b in zip(grid, grid[1:])] + [256.0, 448.0, 500.0, 2.0 ** -10]))
    bits = np.array(points, F32).view(np.uint32)
    near = (bits[:, None] + np.arange(-3, 4, dtype=np.int64)).astype(np.uint32).view(F32).reshape(-1)
    x = np.concatenate([near, np.array([0, -0.0, -1, np.nan, np.inf, -np.inf, 1e-45], F32)])
    with np.errstate(invalid="ignore"):
        assert ggml_fp32_to_ue4m3(x).tolist() == [c_ue4m3(v) for v in x]


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2 ** 32 - 1), exp=st.integers(-16, 10), ties=st.booleans())
def test_recipe_equals_the_c_transcription(seed, exp, ties):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((2, 64)) * 2.0 ** exp).astype(F32)
    if ties:  # exact midpoints of a scaled grid
        x = (rng.choice([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0], size=x.shape)
             * rng.choice([-1, 1], size=x.shape) * 2.0 ** exp).astype(F32)
    assert ours(x) == c_quantize_row(x)


def test_ties_go_to_the_smaller_magnitude_and_never_negative_zero():
    x = np.zeros((1, 64), F32)
    x[0, :8] = [0.75, 3.5, -0.75, -3.5, 6.0, -0.0, -1e-30, 2.5]  # amax 6: d = 0.5, the grid is e2m1 itself
    codes = np.asarray(quantize_weight(x, "ggml-nvfp4", "NVFP4")[1].codes)
    assert codes[0, :8].tolist() == [1, 5, 9, 13, 7, 0, 0, 4]  # 0.75 -> 0.5, 3.5 -> 3, 2.5 -> 2; -0 -> +0
    assert 0x8 not in codes


def test_non_finite_input_is_refused():
    x = np.zeros((1, 64), F32)
    x[0, 3] = np.nan
    with pytest.raises(EncodeError, match="needs finite values"):
        quantize_weight(x, "ggml-nvfp4", "NVFP4")


# --- reading the tool's files -----------------------------------------------------------------

def test_dequantize_is_gguf_pys_bit_for_bit():
    """producer mode is llama.cpp's kvalues * d (gguf-py's dequantize); reference mode decode(q) * s
    agrees on every value of these files (its one difference, 0x8 -> -0.0, never occurs in them)."""
    ckpt, peer = load_checkpoint(FIX / "nvfp4.gguf"), GgufFile(FIX / "nvfp4_dequantized.gguf")
    assert sorted(ckpt) == ["blk.0.attn_q", "blk.0.ffn_down", "blk.0.ffn_down_exps", "blk.1.attn_q", "blk.1.ffn_down"]
    for module in ckpt:
        want = peer.get(f"{module}.weight").reshape(ckpt[module].shape)
        assert np.array_equal(ckpt[module].dequantize("float32", mode="producer").view(np.uint32), want.view(np.uint32))
        assert np.array_equal(ckpt[module].dequantize("float32").view(np.uint32), want.view(np.uint32))
    assert ckpt["blk.0.ffn_down_exps"].shape == (32, 64)  # [2, 16, 64] experts as 32 rows


def test_every_scale_byte_under_every_code_dequantizes_as_gguf_py():
    """0x00 and 0x7F give 0 (so negative codes give -0.0), bit 7 is ignored, code 0x8 gives +0.0."""
    f = GgufFile(FIX / "nvfp4_dequantized.gguf")
    codes = np.asarray(f.get("all_bytes.blocks"))
    unpacked = np.stack([codes & 15, codes >> 4], axis=-1).reshape(1, -1)
    got = ggml_nvfp4_dequantize(unpacked, f.get("all_bytes.blocks_scale").view(np.uint8))
    want = f.get("all_bytes.weight")
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    assert np.signbit(want).any() and (want.view(np.uint32) == 0x80000000).any()  # -0.0 occurs


def test_verify_finds_the_ggml_recipe_and_others_differ():
    ckpt, orig = load_checkpoint(FIX / "nvfp4.gguf"), load_checkpoint(FIX / "original_nvfp4.gguf")
    res = verify(ckpt, orig)
    assert res["ok"] and {x["recipe"] for x in res["layers"]} == {"ggml-nvfp4"}
    other = verify(ckpt, orig, recipe="fp8ref")
    assert not other["ok"]


def test_export_reproduces_the_c_bytes_and_rewrites_identically(tmp_path):
    out = export(FIX / "original_nvfp4.gguf", tmp_path / "a.gguf", SPEC)
    mine, tool = GgufFile(out), GgufFile(FIX / "nvfp4.gguf")
    assert list(mine.gguf_tensors) == list(tool.gguf_tensors)
    for name, t in tool.gguf_tensors.items():
        assert mine.gguf_tensors[name].type_name == t.type_name
        assert mine.raw(name).tobytes() == tool.raw(name).tobytes(), name
    rewrite(out, tmp_path / "b.gguf")
    assert (tmp_path / "a.gguf").read_bytes() == (tmp_path / "b.gguf").read_bytes()


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2 ** 32 - 1), rows=st.integers(1, 4), blocks=st.integers(1, 3),
       dtype=st.sampled_from(["F32", "F16", "BF16"]))
def test_export_load_export_is_byte_identical(tmp_path_factory, seed, rows, blocks, dtype):
    from fp8ref.io.safetensors import save
    from fp8ref.rounding import round_to

    tmp = tmp_path_factory.mktemp("rt")
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, 64 * blocks)) * 2.0 ** rng.integers(-10, 5)
    w[0, :16] = 0  # an all-zero sub-block: scale byte 0, which loads
    np_dtype = {"F32": np.float32, "F16": np.float16, "BF16": None}[dtype]
    w = round_to(w, "bfloat16").astype(F32) if np_dtype is None else w.astype(np_dtype)
    save(tmp / "orig.safetensors", {"m.weight": w, "m.bias": np.arange(rows, dtype=F32)})
    a = export(tmp / "orig.safetensors", tmp / "a.gguf", SPEC)
    rewrite(a, tmp / "b.gguf")
    assert a.read_bytes() == (tmp / "b.gguf").read_bytes()
    layer = load_checkpoint(a)["m"]
    assert layer.bias.tolist() == list(range(rows)) and layer.weight_scale_codes[0, 0] == 0
    assert GgufFile(a).raw("m.weight").tobytes() == c_quantize_row(np.asarray(w, F32))


def test_cli_inspect_verify_quantize(tmp_path, capsys):
    assert run_cli("inspect", FIX / "nvfp4.gguf") == 0
    assert "gguf, model dtype float32, 5 quantized layers" in capsys.readouterr().out
    assert run_cli("verify", FIX / "nvfp4.gguf", "--original", FIX / "original_nvfp4.gguf") == 0
    assert "recipe 'ggml-nvfp4'" in capsys.readouterr().out
    spec = tmp_path / "spec.yaml"
    spec.write_text("scheme: {bits: 4, group_size: 16, data_type: nv_fp, act_bits: 16, recipe: ggml-nvfp4}\n")
    assert run_cli("quantize", FIX / "original_nvfp4.gguf", tmp_path / "o.gguf", "--spec", spec,
                   "--format", "gguf") == 0
    assert (tmp_path / "o.gguf").read_bytes() == export(FIX / "original_nvfp4.gguf", tmp_path / "e.gguf",
                                                       SPEC).read_bytes()
    assert run_cli("verify", tmp_path / "o.gguf", "--original", FIX / "original_nvfp4.gguf") == 0


# --- bad input ------------------------------------------------------------------------------

def _pad(b: bytes) -> bytes:
    return b + b"\0" * (-len(b) % 32)


def _file(ne=(64, 2), data: bytes | None = None, scale: int = 0x38) -> bytes:
    name = b"m.weight"
    info = (struct.pack("<Q", len(name)) + name + struct.pack("<I", len(ne)) + struct.pack(f"<{len(ne)}Q", *ne)
            + struct.pack("<IQ", 40, 0))
    block = bytes([scale] * 4) + bytes([0x21] * 32)
    return _pad(b"GGUF" + struct.pack("<IQQ", 3, 1, 0) + info) + (block * 2 if data is None else data)


BAD = {
    "truncated blocks": (_file()[:-10], "outside"),
    "a row of 32 elements": (_file(ne=(32, 2)), "whole 64-element"),
    "more rows than blocks": (_file(ne=(64, 3)), "outside"),
    "scale byte 0x7F (NaN)": (_file(scale=0x7F), "NaN"),
    "negative scale byte": (_file(scale=0xB8), "negative"),
}


def test_handmade_file_reads(tmp_path):
    """0x21: element j = 1 (0.5) and j + 8 = 2 (1.0) of each 16, under scale byte 0x38 (1.0)."""
    path = tmp_path / "good.gguf"
    path.write_bytes(_file())
    w = load_checkpoint(path)["m"].dequantize("float32")
    halves = w.reshape(2, 4, 2, 8)
    assert w.shape == (2, 64) and (halves[:, :, 0] == 0.5).all() and (halves[:, :, 1] == 1).all()


@pytest.mark.parametrize("case", list(BAD))
def test_bad_nvfp4_gguf_is_one_error_naming_file_and_tensor_and_nothing_written(tmp_path, capsys, case):
    data, words = BAD[case]
    path = tmp_path / "bad.gguf"
    path.write_bytes(data)
    with pytest.raises(CheckpointError, match=words) as info:
        load_checkpoint(path)
    assert str(path) in str(info.value) and "m.weight" in str(info.value)
    spec = tmp_path / "spec.yaml"
    spec.write_text("scheme: {bits: 4, group_size: 16, data_type: nv_fp, act_bits: 16, recipe: ggml-nvfp4}\n")
    capsys.readouterr()
    for argv in (("inspect", path), ("verify", path, "--original", FIX / "original_nvfp4.gguf"),
                 ("quantize", path, tmp_path / "out.gguf", "--spec", spec, "--format", "gguf")):
        assert run_cli(*argv) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("fp8ref: error:") and str(path) in err[0], argv
    assert sorted(os.listdir(tmp_path)) == ["bad.gguf", "spec.yaml"]


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_any_truncation_or_header_byte_change_is_read_or_one_checkpoint_error(tmp_path_factory, data):
    """A cut anywhere, or up to 3 header or scale bytes overwritten: a CheckpointError or a valid read."""
    raw = bytearray((FIX / "nvfp4.gguf").read_bytes())
    f = GgufFile(FIX / "nvfp4.gguf")
    t = f.gguf_tensors["blk.0.attn_q.weight"]
    if data.draw(st.booleans()):
        raw = raw[: data.draw(st.integers(0, len(raw) - 1))]
    else:
        for _ in range(data.draw(st.integers(1, 3))):
            at = data.draw(st.one_of(st.integers(0, f.data_start - 1),
                                     st.integers(0, 3).map(lambda i: f.data_start + t.begin + i)))
            raw[at] = data.draw(st.integers(0, 255))
    path = tmp_path_factory.mktemp("fuzz") / "x.gguf"
    path.write_bytes(bytes(raw))
    try:
        ckpt = load_checkpoint(path)
        for name in ckpt:
            ckpt[name].dequantize("float32", mode="producer")
    except CheckpointError as exc:
        assert str(path) in str(exc)


def test_mxfp4_producer_mode_is_llama_cpps_too(tmp_path):
    """GGUF MXFP4 in producer mode: kvalues * 2^(e-128), so code 0x8 gives +0.0 (reference: -0.0)."""
    name = b"m.weight"
    info = (struct.pack("<Q", len(name)) + name + struct.pack("<I", 2) + struct.pack("<2Q", 32, 1)
            + struct.pack("<IQ", 39, 0))
    path = tmp_path / "mx.gguf"
    path.write_bytes(_pad(b"GGUF" + struct.pack("<IQQ", 3, 1, 0) + info) + bytes([127] + [0x98] * 16))
    layer = load_checkpoint(path)["m"]
    producer, reference = layer.dequantize("float32", mode="producer"), layer.dequantize("float32")
    assert producer[0, :16].tolist() == [0.0] * 16 and not np.signbit(producer[0, :16]).any()
    assert np.signbit(reference[0, :16]).all() and (producer[0, 16:] == -0.5).all()
    ckpt = load_checkpoint(FIX / "mxfp4.gguf")
    for module in ckpt:
        assert np.array_equal(ckpt[module].dequantize("float32", mode="producer").view(np.uint32),
                              ckpt[module].dequantize("float32").view(np.uint32))
