"""Deterministic safetensors writing and strict reading for golden folders.

Golden files must be byte-identical on every run and machine, so the writer fixes every
choice the format leaves open: tensors in name order, compact JSON with sorted keys, fixed
metadata, the header padded with spaces to a multiple of 8. The reader accepts any valid
file (any order, any padding) because a backend written in another language produces the
outputs that ``golden check`` reads.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from ..errors import GoldenError

# safetensors dtype string <-> numpy dtype. bfloat16 travels as its raw uint16 bits here
# (numpy has no bfloat16); callers that need values view them through ml_dtypes.
_DTYPES = {
    "U8": np.uint8, "I8": np.int8, "U16": np.uint16, "I16": np.int16, "U32": np.uint32,
    "I32": np.int32, "U64": np.uint64, "I64": np.int64, "F16": np.float16, "F32": np.float32,
    "F64": np.float64, "BF16": np.uint16, "BOOL": np.bool_,
}
_NAMES = {np.dtype(v): k for k, v in _DTYPES.items() if k != "BF16"}
_MAX_HEADER = 100 * 1024 * 1024


def dtype_name(array: np.ndarray) -> str:
    """safetensors dtype string of an array (ml_dtypes bfloat16 -> BF16)."""
    if array.dtype.name == "bfloat16":
        return "BF16"
    try:
        return _NAMES[array.dtype]
    except KeyError:
        raise GoldenError(f"dtype {array.dtype} cannot be stored in a golden file") from None


def dumps(tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> bytes:
    """The safetensors bytes of ``tensors``, identical for identical inputs."""
    header: dict = {"__metadata__": dict(sorted((metadata or {}).items()))}
    chunks, offset = [], 0
    for name in sorted(tensors):
        arr = np.ascontiguousarray(tensors[name])
        data = arr.view(np.uint16).tobytes() if arr.dtype.name == "bfloat16" else arr.astype(
            arr.dtype.newbyteorder("<"), copy=False).tobytes()
        header[name] = {"dtype": dtype_name(arr), "shape": list(arr.shape),
                        "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + b"".join(chunks)


def save(path: Path, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> bytes:
    data = dumps(tensors, metadata)
    Path(path).write_bytes(data)
    return data


def loads(data: bytes, where: str) -> dict[str, np.ndarray]:
    """Parse safetensors bytes; BF16 comes back as ml_dtypes bfloat16 when available."""
    if len(data) < 8:
        raise GoldenError(f"{where}: not a safetensors file ({len(data)} bytes, expected an 8-byte header length)")
    (n,) = struct.unpack("<Q", data[:8])
    if n > min(_MAX_HEADER, len(data) - 8):
        raise GoldenError(f"{where}: header length {n} does not fit the {len(data)}-byte file")
    try:
        header = json.loads(data[8:8 + n])
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise GoldenError(f"{where}: header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise GoldenError(f"{where}: header must be a JSON object")
    body = memoryview(data)[8 + n:]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = np.dtype(_DTYPES[info["dtype"]]).newbyteorder("<")
            begin, end = (int(v) for v in info["data_offsets"])
            shape = tuple(int(v) for v in info["shape"])
        except (KeyError, TypeError, ValueError):
            raise GoldenError(f"{where}: tensor {name!r}: bad entry {info!r} (expected dtype one of "
                              f"{sorted(_DTYPES)}, shape, data_offsets)") from None
        count = int(np.prod(shape, dtype=np.int64))
        if not 0 <= begin <= end <= len(body) or end - begin != count * dtype.itemsize:
            raise GoldenError(f"{where}: tensor {name!r}: data_offsets {[begin, end]} do not match "
                              f"shape {list(shape)} of {info['dtype']} in a {len(body)}-byte body")
        arr = np.frombuffer(body[begin:end], dtype=dtype).reshape(shape).astype(dtype.newbyteorder("="))
        if info["dtype"] == "BF16":
            arr = _as_bfloat16(arr)
        out[name] = arr
    return out


def load(path: Path) -> dict[str, np.ndarray]:
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise GoldenError(f"{path}: cannot read ({exc.strerror})") from None
    return loads(data, str(path))


def _as_bfloat16(bits: np.ndarray) -> np.ndarray:
    import ml_dtypes  # only a dtype container here: no value is converted

    return bits.view(ml_dtypes.bfloat16)
