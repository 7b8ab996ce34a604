"""safetensors I/O: byte-identical to the safetensors library, lazy, strict, atomic."""

from __future__ import annotations

import json
import os

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from fp8ref.errors import CheckpointError
from fp8ref.io.atomic import atomic_folder
from fp8ref.io.outputs import MARKER
from fp8ref.io.safetensors import (
    DTYPES,
    SafetensorsFile,
    SafetensorsWriter,
    TensorSpec,
    open_store,
    write_safetensors,
)

TORCH = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
         "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
         "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
         "F8_E4M3FNUZ": torch.float8_e4m3fnuz, "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
         "F8_E8M0": torch.float8_e8m0fnu}


def _random_tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i, (name, dt) in enumerate(sorted(TORCH.items())):
        shape = [(3, 5), (0, 4), (), (7,), (2, 3, 2)][i % 5]
        raw = torch.randint(0, 256, (int(np.prod(shape)) * dt.itemsize,), generator=g, dtype=torch.uint8)
        t = raw.view(dt) if dt != torch.bool else (raw % 2).bool()
        out[f"t{i}.{name.lower()}"] = t.reshape(shape)
    return out


def _as_numpy(t: torch.Tensor) -> tuple[str, np.ndarray]:
    name = next(k for k, v in TORCH.items() if v == t.dtype)
    raw = t.contiguous().reshape(-1).view(torch.uint8).numpy() if t.dtype != torch.bool else t.numpy().view(np.uint8)
    dt = DTYPES[name].numpy
    return name, raw.reshape(-1).view(dt).reshape(tuple(t.shape))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_writer_is_byte_identical_to_safetensors(tmp_path, seed):
    tensors = _random_tensors(seed)
    save_file(tensors, tmp_path / "peer.safetensors", metadata={"format": "pt"})
    write_safetensors(tmp_path / "ours.safetensors", {k: _as_numpy(v) for k, v in tensors.items()},
                      {"format": "pt"})
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "peer.safetensors").read_bytes()


def test_reader_matches_safetensors_bytes(tmp_path):
    tensors = _random_tensors(5)
    save_file(tensors, tmp_path / "peer.safetensors")
    f = SafetensorsFile(tmp_path / "peer.safetensors")
    peer = load_file(tmp_path / "peer.safetensors")
    for name, t in peer.items():
        info = f.info(name)
        assert info.dtype == next(k for k, v in TORCH.items() if v == t.dtype)
        assert info.shape == tuple(t.shape)
        got = f.get(name)
        assert got.shape == tuple(t.shape)
        flat = t.contiguous().reshape(-1)
        expect = (flat.view(torch.uint8) if t.dtype != torch.bool else flat).numpy().tobytes()
        assert got.tobytes() == expect


def test_float8_read_as_codes_and_bf16_as_ml_dtypes(tmp_path):
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    save_file({"w": codes.view(torch.float8_e4m3fn), "b": torch.tensor([1.5, -2.0], dtype=torch.bfloat16)},
              tmp_path / "x.safetensors")
    f = SafetensorsFile(tmp_path / "x.safetensors")
    assert f.info("w").fmt == "float8_e4m3fn"
    assert f.get("w").dtype == np.uint8 and f.get("w").tolist() == list(range(256))
    assert f.get("b").dtype == ml_dtypes.bfloat16 and f.get("b").astype(np.float32).tolist() == [1.5, -2.0]


def test_f4_bytes_and_shape_follow_torch(tmp_path):
    packed = torch.tensor([0x21, 0x43, 0x65, 0x87], dtype=torch.uint8)
    save_file({"q": packed.view(torch.float4_e2m1fn_x2)}, tmp_path / "f4.safetensors")
    f = SafetensorsFile(tmp_path / "f4.safetensors")
    assert f.info("q").dtype == "F4" and f.info("q").shape == (8,)  # elements, not bytes
    assert f.read_bytes("q").tolist() == [0x21, 0x43, 0x65, 0x87]
    assert f.get("q").tolist() == [1, 2, 3, 4, 5, 6, 7, 8]  # low nibble first


def test_reads_are_lazy_and_counted(tmp_path):
    save_file({"big": torch.zeros(1000, 100), "small": torch.ones(3)}, tmp_path / "x.safetensors")
    f = SafetensorsFile(tmp_path / "x.safetensors")
    assert f.bytes_read == 0
    f.get("small")
    assert f.bytes_read == 12


def test_header_limit_is_configurable(tmp_path):
    save_file({"a": torch.zeros(2)}, tmp_path / "x.safetensors")
    with pytest.raises(CheckpointError, match="header length"):
        SafetensorsFile(tmp_path / "x.safetensors", max_header_bytes=16)


def test_trailing_bytes_rejected(tmp_path):
    save_file({"a": torch.zeros(2)}, tmp_path / "x.safetensors")
    with open(tmp_path / "x.safetensors", "ab") as fh:
        fh.write(b"junk")
    with pytest.raises(CheckpointError, match="4 unexpected bytes"):
        SafetensorsFile(tmp_path / "x.safetensors")


def test_streaming_writer_any_order_and_completeness(tmp_path):
    specs = [TensorSpec("a", "F32", (2,)), TensorSpec("b", "F8_E4M3", (3,))]
    w = SafetensorsWriter(tmp_path / "s.safetensors", specs, {"format": "pt"})
    w.write("b", np.array([1, 2, 3], np.uint8))
    w.write("a", np.array([1.0, 2.0], np.float32))
    w.close()
    peer = load_file(tmp_path / "s.safetensors")
    assert peer["b"].view(torch.uint8).tolist() == [1, 2, 3] and peer["a"].tolist() == [1.0, 2.0]
    w = SafetensorsWriter(tmp_path / "t.safetensors", specs)
    w.write("a", np.array([1.0, 2.0], np.float32))
    with pytest.raises(CheckpointError, match="never written"):
        w.close()
    with pytest.raises(CheckpointError, match="declared"):
        SafetensorsWriter(tmp_path / "u.safetensors", specs).write("b", np.zeros(4, np.uint8))


def test_sharded_store_resolves_each_tensor(tmp_path):
    save_file({"a": torch.ones(2)}, tmp_path / "m-1.safetensors")
    save_file({"b": torch.zeros(3)}, tmp_path / "m-2.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"a": "m-1.safetensors", "b": "m-2.safetensors"}}))
    store = open_store(tmp_path)
    assert sorted(store) == ["a", "b"] and store.get("b").tolist() == [0, 0, 0]
    assert store.bytes_read == 12


def test_shard_tensor_missing_from_index_is_an_error(tmp_path):
    save_file({"a": torch.ones(2), "stray": torch.ones(1)}, tmp_path / "m-1.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "m-1.safetensors"}}))
    with pytest.raises(CheckpointError, match="'stray': the index does not list it"):
        open_store(tmp_path)


def test_folder_without_known_file_names(tmp_path):
    with pytest.raises(CheckpointError, match="found none"):
        open_store(tmp_path)
    save_file({"a": torch.ones(1)}, tmp_path / "one.safetensors")
    assert list(open_store(tmp_path)) == ["a"]
    save_file({"a": torch.ones(1)}, tmp_path / "two.safetensors")
    with pytest.raises(CheckpointError, match="exactly one"):
        open_store(tmp_path)


def test_atomic_folder_success_failure_and_force(tmp_path):
    dest = tmp_path / "out"
    with atomic_folder(dest) as tmp:
        (tmp / "f").write_text("1")
    assert (dest / "f").read_text() == "1"
    with pytest.raises(CheckpointError, match="already exists"):
        with atomic_folder(dest):
            pass
    with pytest.raises(RuntimeError):
        with atomic_folder(dest, force=True) as tmp:
            (tmp / "f").write_text("2")
            raise RuntimeError("interrupted")
    assert (dest / "f").read_text() == "1"
    assert sorted(os.listdir(tmp_path)) == ["out"]  # no temporary folder left behind
    with atomic_folder(dest, force=True) as tmp:
        (tmp / "g").write_text("3")
    assert sorted(os.listdir(dest)) == [MARKER, "g"] and sorted(os.listdir(tmp_path)) == ["out"]


@pytest.mark.parametrize("where", ["same", "inside", "parent"])
def test_atomic_folder_never_replaces_the_source(tmp_path, where):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    dest = {"same": src, "inside": src / "sub" / "out", "parent": tmp_path}[where]
    with pytest.raises(CheckpointError, match="source"):
        with atomic_folder(dest, force=True, protect=[src]):
            pass
    assert (src / "sub").is_dir()
