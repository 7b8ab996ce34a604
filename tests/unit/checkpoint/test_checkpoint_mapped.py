"""Mapped reads (``SafetensorsFile.map_bytes``, ``get(mapped=True)``, ``read_weight_codes(mapped=True)``)
give the bytes the copying reads give, read-only; a file cut short is a one-line error; the NaN-code
scan finds a NaN code wherever it lies (pieces of ``_NAN_CHUNK``)."""

from __future__ import annotations

import mmap
import os

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import fp8ref
from fp8ref.checkpoint import layout
from fp8ref.checkpoint.layout import nan_count
from fp8ref.errors import CheckpointError
from fp8ref.formats import FORMATS
from fp8ref.io.safetensors import SafetensorsFile, open_store

CKPTS = os.path.join(os.path.dirname(__file__), "..", "..", "fixtures", "interop", "checkpoints")


def test_mapped_bytes_equal_read_bytes_for_every_dtype(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {"a.u8": torch.randint(0, 256, (3,), generator=g, dtype=torch.uint8),
               "b.f32": torch.randn(70_000, generator=g),  # crosses mapping granularity boundaries
               "c.bf16": torch.randn(5, 7, generator=g).to(torch.bfloat16),
               "d.f8": torch.randint(0, 256, (33, 9), generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn),
               "e.empty": torch.zeros(0, 4), "f.scalar": torch.tensor(2.5, dtype=torch.float16)}
    save_file(tensors, tmp_path / "x.safetensors")
    f = SafetensorsFile(tmp_path / "x.safetensors")
    starts = [(f.data_start + f.info(n).begin) % mmap.ALLOCATIONGRANULARITY for n in tensors]
    assert any(starts) and f.info("b.f32").nbytes > mmap.ALLOCATIONGRANULARITY  # mapped from a boundary before
    for name in tensors:
        mapped, copied = f.map_bytes(name), f.read_bytes(name)
        assert mapped.dtype == np.uint8 and mapped.tobytes() == copied.tobytes(), name
        assert not mapped.flags.writeable or mapped.size == 0
        a, b = f.get(name, mapped=True), f.get(name)
        assert (a.dtype, a.shape) == (b.dtype, b.shape) and a.tobytes() == b.tobytes(), name
    with pytest.raises(ValueError, match="read-only"):
        f.get("c.bf16", mapped=True)[0, 0] = 1


def test_mapped_f4_is_unpacked_like_a_copied_read(tmp_path):
    save_file({"q": torch.tensor([0x21, 0x43, 0x65, 0x87], dtype=torch.uint8).view(torch.float4_e2m1fn_x2)},
              tmp_path / "f4.safetensors")
    assert SafetensorsFile(tmp_path / "f4.safetensors").get("q", mapped=True).tolist() == list(range(1, 9))


def test_mapping_a_file_cut_short_is_an_error(tmp_path):
    save_file({"a": torch.zeros(10), "b": torch.ones(1000)}, tmp_path / "x.safetensors")
    f = SafetensorsFile(tmp_path / "x.safetensors")  # header read and checked
    os.truncate(tmp_path / "x.safetensors", os.path.getsize(tmp_path / "x.safetensors") - 8)
    with pytest.raises(CheckpointError, match=r"x.safetensors: tensor 'b': file changed while reading"):
        f.map_bytes("b")
    assert f.map_bytes("a").tobytes() == bytes(40)  # what is still whole reads


def test_mapped_weight_codes_of_a_real_tool_checkpoint():
    for fixture in ("llmc_fp8", "llmc_fp8_block", "autoround_fp8_static"):
        ckpt = fp8ref.load_checkpoint(os.path.join(CKPTS, fixture))
        for name in ckpt:
            a, b = ckpt[name].read_weight_codes(mapped=True), ckpt[name].weight_codes
            assert a.shape == b.shape and np.array_equal(a, b) and not a.flags.writeable
    store = open_store(os.path.join(CKPTS, "original_bf16"))
    for name in store:
        assert store.get(name, mapped=True).tobytes() == store.get(name).tobytes()


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz"])
def test_nan_scan_finds_every_nan_code_at_every_piece_edge(fmt, monkeypatch):
    """Every code value at positions on and around the pieces' edges, against the format's own NaN
    code list: the count and the first index."""
    monkeypatch.setattr(layout, "_NAN_CHUNK", 64)
    nans = set(FORMATS[fmt].nan_codes)
    rng = np.random.default_rng(1)
    clean = rng.choice([c for c in range(256) if c not in nans], size=(5, 41)).astype(np.uint8)  # 205 codes
    assert nan_count(clean, fmt) == (0, None)
    for pos in (0, 1, 63, 64, 65, 127, 128, 204):
        for code in range(256):
            codes = clean.copy()
            codes.reshape(-1)[pos] = code
            expect = (1, tuple(int(i) for i in np.unravel_index(pos, codes.shape))) if code in nans else (0, None)
            assert nan_count(codes, fmt) == expect, (pos, code)
    codes = clean.copy()
    codes.reshape(-1)[[70, 3, 200]] = sorted(nans)[0]
    assert nan_count(codes, fmt) == (3, (0, 3))
