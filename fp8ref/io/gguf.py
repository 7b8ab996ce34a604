"""GGUF files (llama.cpp): a strict reader and a writer, no dependency on the ``gguf`` package.

Layout (GGUF v2/v3, little-endian): ``GGUF``, uint32 version, uint64 tensor count, uint64
key-value count; the key-values (string key, uint32 type, value); per tensor its name, uint32
n_dims, uint64 ne[n_dims] (ne[0] the innermost: numpy shape is ne reversed), uint32 GGML type and
uint64 offset into the data section, which starts at the first multiple of ``general.alignment``
(default 32) after the tensor infos. Every count, length and offset is checked against the file
size before anything is allocated (the same hostile-input rules as the safetensors reader): a
bad file is one ``CheckpointError`` naming the file and, where there is one, the tensor.

``GgufFile`` offers ``SafetensorsFile``'s interface (``tensors``, ``info``, ``get``,
``read_bytes``, ``metadata``), so a GGUF opens as a ``TensorStore``: F32/F16/BF16 tensors as they
are, and each MXFP4 tensor ``T`` [..., out, in] as two views in compressed-tensors' vocabulary,
leading dimensions folded into rows: ``T`` U8 [rows, in/2] (E2M1 pairs, low nibble = even
element) and ``T_scale`` U8 [rows, in/32] (E8M0 bytes). A GGML MXFP4 block is 17 bytes: the E8M0
byte, then 16 bytes holding element j in the low nibble and element j + 16 in the high nibble.
Each NVFP4 tensor ``T`` gives three views: ``T`` U8 [rows, in/2] (E2M1 pairs as above),
``T_scale`` F8_E4M3 [rows, in/16] (the UE4M3 bytes) and ``T_global`` F32 [] = 1.0 (GGUF stores no
global scale). A GGML NVFP4 block is 36 bytes for 64 elements: four scale bytes (one per 16
elements), then four 8-byte groups, group s holding element 16s + j in the low nibble and
16s + j + 8 in the high nibble.
Tensors of other GGML types are listed (``unread``) but not read.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import CheckpointError
from .files import open_regular, read_range
from .safetensors import DTYPES, SINGLE_FILE_READERS, TensorFile, TensorInfo, _bfloat16, pack_nibbles, unpack_nibbles

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_COUNT = 1 << 20      # tensors or key-values in one file
MAX_STRING = 1 << 20     # bytes in one key or string value
MAX_DIMS = 4             # GGML_MAX_DIMS
MXFP4_BLOCK, MXFP4_BYTES = 32, 17
NVFP4_BLOCK, NVFP4_BYTES, NVFP4_SUB = 64, 36, 16
READ_QUANTIZED = ("MXFP4", "NVFP4")  # the GGML block types read as fp8ref layers
RECIPE_KEY = "fp8ref_recipes"  # base.RECIPE_METADATA: which recipe wrote which layers (JSON)

# GGML type id -> (name, block size, bytes per block); ggml.h / gguf-py constants GGML_QUANT_SIZES
GGML_TYPES = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 40), 10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98), 19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110), 22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56), 30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17), 40: ("NVFP4", 64, 36), 41: ("Q1_0", 128, 18),
}
TYPE_IDS = {name: t for t, (name, _, _) in GGML_TYPES.items()}
PLAIN = {"F32": "F32", "F16": "F16", "BF16": "BF16"}  # GGML type -> the safetensors dtype it is read as

# key-value types: id -> (name, struct format or None)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GgufTensor:
    """One tensor info as stored: numpy ``shape`` (ne reversed), GGML type, data-section range."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    begin: int
    end: int

    @property
    def type_name(self) -> str:
        return GGML_TYPES[self.ggml_type][0]


class _Reader:
    def __init__(self, raw: bytes, where: str):
        self.raw, self.pos, self.where = raw, 0, where

    def take(self, n: int, what: str) -> bytes:
        if n > len(self.raw) - self.pos:
            raise CheckpointError(f"{self.where}: truncated: {what} needs {n} bytes at offset {self.pos}, "
                                  f"the file has {len(self.raw) - self.pos} left")
        out = self.raw[self.pos:self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str, what: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> str:
        n = self.unpack("<Q", what)
        if n > MAX_STRING:
            raise CheckpointError(f"{self.where}: {what}: string length {n} is over {MAX_STRING} bytes")
        try:
            return self.take(n, what).decode("utf-8")
        except UnicodeDecodeError:
            raise CheckpointError(f"{self.where}: {what}: not UTF-8") from None

    def value(self, vtype: int, what: str):
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype], what)
        if vtype == _STRING:
            return self.string(what)
        if vtype == _ARRAY:
            etype, n = self.unpack("<I", what), self.unpack("<Q", what)
            if etype == _ARRAY:
                raise CheckpointError(f"{self.where}: {what}: nested arrays are not read")
            if n > len(self.raw) - self.pos:  # every element takes at least one byte
                raise CheckpointError(f"{self.where}: truncated: {what}: array of {n} elements")
            return [self.value(etype, what) for _ in range(n)]
        raise CheckpointError(f"{self.where}: {what}: unknown value type {vtype}")


def _value_type(value) -> int:
    if isinstance(value, bool):
        return 7
    if isinstance(value, str):
        return _STRING
    if isinstance(value, list):
        return _ARRAY
    if isinstance(value, float):
        return 6
    return 4 if 0 <= value < 1 << 32 else 11  # int


def parse(raw: bytes, where: str, file_size: int) -> tuple[int, dict, dict[str, GgufTensor], int]:
    """(version, key-values, tensors, data start) of a GGUF whose header is at the start of ``raw``
    (``file_size`` bytes in all). Each tensor's range is checked against the data section."""
    r = _Reader(raw, where)
    if r.take(4, "magic") != MAGIC:
        raise CheckpointError(f"{where}: not a GGUF file (no 'GGUF' magic)")
    version = r.unpack("<I", "version")
    if version not in VERSIONS:
        raise CheckpointError(f"{where}: GGUF version {version}; fp8ref reads versions {VERSIONS}")
    n_tensors, n_kv = r.unpack("<Q", "tensor count"), r.unpack("<Q", "key-value count")
    for what, n in (("tensor count", n_tensors), ("key-value count", n_kv)):
        if n > MAX_COUNT:
            raise CheckpointError(f"{where}: {what} {n} is over {MAX_COUNT}")
    kv: dict = {}
    for i in range(n_kv):
        key = r.string(f"key-value {i} key")
        if key in kv:
            raise CheckpointError(f"{where}: key {key!r} appears twice")
        kv[key] = r.value(r.unpack("<I", f"key {key!r} type"), f"key {key!r}")
    align = kv.get("general.alignment", DEFAULT_ALIGNMENT)
    if type(align) is not int or align < 1 or align & (align - 1):
        raise CheckpointError(f"{where}: general.alignment {align!r} is not a power of two")
    infos = []
    for i in range(n_tensors):
        name = r.string(f"tensor {i} name")
        n_dims = r.unpack("<I", f"tensor {name!r} n_dims")
        if not 1 <= n_dims <= MAX_DIMS:
            raise CheckpointError(f"{where}: tensor {name!r}: {n_dims} dimensions, expected 1..{MAX_DIMS}")
        ne = [r.unpack("<Q", f"tensor {name!r} dims") for _ in range(n_dims)]
        infos.append((name, ne, r.unpack("<I", f"tensor {name!r} type"), r.unpack("<Q", f"tensor {name!r} offset")))
    start = -(-r.pos // align) * align
    if start > file_size:
        raise CheckpointError(f"{where}: truncated: the data section would start at {start}, past the end "
                              f"({file_size} bytes)")
    size = file_size - start
    tensors: dict[str, GgufTensor] = {}
    for name, ne, gtype, offset in infos:
        if name in tensors:
            raise CheckpointError(f"{where}: tensor {name!r} appears twice")
        if gtype not in GGML_TYPES:
            raise CheckpointError(f"{where}: tensor {name!r}: unknown GGML type {gtype}")
        tname, block, nbytes = GGML_TYPES[gtype]
        if ne[0] % block:
            raise CheckpointError(f"{where}: tensor {name!r}: {tname} needs rows of whole {block}-element blocks, "
                                  f"got ne[0] = {ne[0]}")
        length = nbytes * (ne[0] // block)
        for n in ne[1:]:
            length *= n
        if offset % align or offset > size or length > size - offset:
            raise CheckpointError(f"{where}: tensor {name!r}: {length} bytes at offset {offset} lie outside the "
                                  f"{size}-byte data section (or off its {align}-byte alignment)")
        tensors[name] = GgufTensor(name, tuple(reversed(ne)), gtype, offset, offset + length)
    spans = sorted((t.begin, t.end, t.name) for t in tensors.values() if t.end > t.begin)
    for (_, end, a), (begin, _, b) in zip(spans, spans[1:]):
        if begin < end:
            raise CheckpointError(f"{where}: tensors {a!r} and {b!r} overlap in the data section")
    return version, kv, tensors, start


class GgufFile(TensorFile):
    """A validated GGUF file read as safetensors-like tensors (see the module docstring)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            with open_regular(self.path, what="GGUF file") as f:
                size = os.fstat(f.fileno()).st_size
                raw = f.read(min(size, 1 << 26))  # headers of real files are a few MB at most
        except OSError as exc:
            raise CheckpointError(f"{self.path}: cannot read: {exc.strerror or exc}") from None
        self.version, self.kv, self.gguf_tensors, self.data_start = parse(raw, str(self.path), size)
        self.data_size = size - self.data_start
        recipes = self.kv.get(RECIPE_KEY)
        self.metadata = {RECIPE_KEY: recipes} if isinstance(recipes, str) else {}
        self.tensors: dict[str, TensorInfo] = {}
        self._views: dict[str, tuple[str, str]] = {}  # shown name -> (GGUF tensor, role)
        for t in self.gguf_tensors.values():
            if t.type_name in PLAIN:
                self._add(t.name, t.name, "plain", PLAIN[t.type_name], t.shape, t.begin, t.end)
            elif t.type_name == "MXFP4":
                rows, k = int(np.prod(t.shape[:-1])), t.shape[-1]  # experts [E, out, in]: E * out rows
                blocks = t.end - t.begin
                self._add(t.name, t.name, "codes", "U8", (rows, k // 2), t.begin, t.begin + blocks * 16 // 17)
                self._add(f"{t.name}_scale", t.name, "scales", "U8", (rows, k // MXFP4_BLOCK), 0, blocks // 17)
            elif t.type_name == "NVFP4":
                rows, k = int(np.prod(t.shape[:-1])), t.shape[-1]
                blocks = (t.end - t.begin) // NVFP4_BYTES
                self._add(t.name, t.name, "nv-codes", "U8", (rows, k // 2), t.begin, t.begin + blocks * 32)
                self._add(f"{t.name}_scale", t.name, "nv-scales", "F8_E4M3", (rows, k // NVFP4_SUB), 0, blocks * 4)
                self._add(f"{t.name}_global", t.name, "one", "F32", (), 0, 4)
        self.bytes_read = 0

    def _add(self, shown: str, source: str, role: str, dtype: str, shape, begin: int, end: int) -> None:
        if shown in self.tensors:
            raise CheckpointError(f"{self.path}: tensor {shown!r} is both stored and the scale view of {source!r}")
        self.tensors[shown] = TensorInfo(shown, dtype, tuple(shape), begin, end)
        self._views[shown] = (source, role)

    def unread(self) -> list[str]:
        """GGUF tensors of types fp8ref does not read (kept out of ``tensors``), as 'name (TYPE)'."""
        return [f"{t.name} ({t.type_name})" for t in self.gguf_tensors.values()
                if t.type_name not in PLAIN and t.type_name not in READ_QUANTIZED]

    def raw(self, name: str) -> np.ndarray:
        """The stored bytes of GGUF tensor ``name`` (any type) as a flat uint8 array."""
        t = self.gguf_tensors.get(name)
        if t is None:
            raise CheckpointError(f"{self.path}: no tensor {name!r}")
        out = read_range(self.path, "GGUF file", name, self.data_start + t.begin, t.end - t.begin)
        self.bytes_read += out.size
        return out

    def get(self, name: str, *, mapped: bool = False, bf16_bits: bool = False) -> np.ndarray:
        """The tensor as safetensors' reader gives it (``mapped``: accepted for TensorStore's sake; a GGUF
        tensor is read from this reader's own copy of the file either way; ``bf16_bits``: BF16 as uint16)."""
        info = self.info(name)
        source, role = self._views[name]
        if role == "one":
            return np.ones((), np.float32)
        raw = self.raw(source)
        if role.startswith("nv-"):
            blocks = raw.reshape(-1, NVFP4_BYTES)
            if role == "nv-scales":
                return blocks[:, :4].reshape(info.shape).copy()
            qs = blocks[:, 4:].reshape(-1, NVFP4_BLOCK // NVFP4_SUB, NVFP4_SUB // 2)
            codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # per 16: elements 0-7, then 8-15
            return pack_nibbles(codes.reshape(*info.shape[:-1], info.shape[-1] * 2))
        if role == "plain":
            dt = (np.dtype(np.uint16) if bf16_bits else np.dtype(_bfloat16(str(self.path)))) if info.dtype == "BF16" \
                else np.dtype(DTYPES[info.dtype].numpy)
            return raw.view(dt).reshape(info.shape)
        blocks = raw.reshape(-1, MXFP4_BYTES)
        if role == "scales":
            return blocks[:, 0].reshape(info.shape).copy()
        qs = blocks[:, 1:]
        codes = np.concatenate([qs & 0x0F, qs >> 4], axis=1)  # elements 0-15, then 16-31
        return pack_nibbles(codes.reshape(*info.shape[:-1], info.shape[-1] * 2))

    def read_bytes(self, name: str) -> np.ndarray:
        return np.ascontiguousarray(self.get(name, bf16_bits=True)).reshape(-1).view(np.uint8)

    def view(self, name: str, raw: np.ndarray, *, bf16_bits: bool = False) -> np.ndarray:
        info = self.info(name)
        if info.dtype in ("U8", "F8_E4M3"):
            return raw.reshape(info.shape)
        return self.get(name, bf16_bits=bf16_bits)


# --- writing ---------------------------------------------------------------------------------

def mxfp4_blocks(packed: np.ndarray, scale_bytes: np.ndarray) -> np.ndarray:
    """GGML MXFP4 bytes [..., in/32 * 17] from even/odd-packed E2M1 pairs [..., in/2] and E8M0 bytes
    [..., in/32] (the inverse of ``GgufFile``'s two views)."""
    codes = unpack_nibbles(np.asarray(packed, np.uint8))
    lead, k = codes.shape[:-1], codes.shape[-1]
    halves = codes.reshape(*lead, k // MXFP4_BLOCK, 2, MXFP4_BLOCK // 2)
    qs = halves[..., 0, :] | (halves[..., 1, :] << 4)
    blocks = np.concatenate([np.asarray(scale_bytes, np.uint8).reshape(*lead, -1, 1), qs], axis=-1)
    return blocks.reshape(*lead, -1).astype(np.uint8)


def nvfp4_blocks(packed: np.ndarray, scale_bytes: np.ndarray) -> np.ndarray:
    """GGML NVFP4 bytes [..., in/64 * 36] from even/odd-packed E2M1 pairs [..., in/2] and UE4M3 bytes
    [..., in/16] (the inverse of ``GgufFile``'s views)."""
    codes = unpack_nibbles(np.asarray(packed, np.uint8))
    lead, k = codes.shape[:-1], codes.shape[-1]
    halves = codes.reshape(*lead, k // NVFP4_BLOCK, NVFP4_BLOCK // NVFP4_SUB, 2, NVFP4_SUB // 2)
    qs = (halves[..., 0, :] | (halves[..., 1, :] << 4)).reshape(*lead, k // NVFP4_BLOCK, NVFP4_BLOCK // 2)
    scales = np.asarray(scale_bytes, np.uint8).reshape(*lead, k // NVFP4_BLOCK, NVFP4_BLOCK // NVFP4_SUB)
    return np.concatenate([scales, qs], axis=-1).reshape(*lead, -1).astype(np.uint8)


def _encode_value(value) -> bytes:
    t = _value_type(value)
    if t == _STRING:
        b = value.encode("utf-8")
        return struct.pack("<Q", len(b)) + b
    if t == _ARRAY:
        et = _value_type(value[0]) if value else 4
        return struct.pack("<IQ", et, len(value)) + b"".join(_encode_value(v) for v in value)
    return struct.pack(_SCALARS[t], value)


def dumps(kv: dict, tensors: list[tuple[str, str, tuple, np.ndarray]], alignment: int = DEFAULT_ALIGNMENT) -> bytes:
    """A GGUF v3 file: ``kv`` (str, bool, int, float or lists of one of them) and ``tensors`` as
    (name, GGML type name, numpy shape, stored bytes) in order, each aligned to ``alignment``."""
    head = [MAGIC, struct.pack("<IQQ", 3, len(tensors), len(kv))]
    for key, value in kv.items():
        head += [_encode_value(key), struct.pack("<I", _value_type(value)), _encode_value(value)]
    body, offset = [], 0
    for name, gtype, shape, data in tensors:
        head += [_encode_value(name), struct.pack("<I", len(shape)), struct.pack(f"<{len(shape)}Q", *reversed(shape)),
                 struct.pack("<IQ", TYPE_IDS[gtype], offset)]
        raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8).tobytes()
        pad = -len(raw) % alignment
        body.append(raw + b"\0" * pad)
        offset += len(raw) + pad
    header = b"".join(head)
    return header + b"\0" * (-len(header) % alignment) + b"".join(body)


SINGLE_FILE_READERS[".gguf"] = GgufFile  # open_store reads llama.cpp's files through this reader
