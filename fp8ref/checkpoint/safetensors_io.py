"""safetensors reading and writing without pickle, without trusting the file.

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON (space-padded),
then the tensor data. The header is parsed with limits and checked completely before any
tensor byte is touched: known dtypes, integer shapes, offsets that match the shapes and tile
the data section exactly. Tensors are then read one at a time, on request, with a positioned
read of exactly their bytes, so opening a 100 GB checkpoint reads headers only and a large
tensor is freed as soon as the caller drops it.

Writing mirrors safetensors 0.8 byte for byte (tensors ordered by dtype rank then name,
header padded with spaces to a multiple of 8), but streams: the header is laid out from the
declared names, dtypes and shapes, then each tensor is written at its offset as it becomes
available. Everything is written under a temporary name and renamed into place.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from math import prod
from pathlib import Path

import numpy as np

from ..errors import CheckpointError

MAX_HEADER_BYTES = 100_000_000  # the limit safetensors itself enforces
MAX_DIMS = 16
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


@dataclass(frozen=True)
class DType:
    """A safetensors dtype string: its width in bits, the numpy dtype of its elements (None for
    sub-byte packed dtypes) and, for the small float formats, the fp8ref format name."""

    name: str
    bits: int
    numpy: np.dtype | None
    fmt: str | None = None


def _dtypes() -> dict[str, DType]:
    d = DType
    table = [
        d("BOOL", 8, np.dtype(np.bool_)), d("U8", 8, np.dtype(np.uint8)), d("I8", 8, np.dtype(np.int8)),
        d("I16", 16, np.dtype("<i2")), d("U16", 16, np.dtype("<u2")), d("I32", 32, np.dtype("<i4")),
        d("U32", 32, np.dtype("<u4")), d("I64", 64, np.dtype("<i8")), d("U64", 64, np.dtype("<u8")),
        # BF16 is stored as its bits; ``get`` views them as ml_dtypes.bfloat16 (imported on use).
        d("F16", 16, np.dtype("<f2")), d("BF16", 16, np.dtype("<u2")),
        d("F32", 32, np.dtype("<f4")), d("F64", 64, np.dtype("<f8")), d("C64", 64, np.dtype("<c8")),
        # Small floats are read as their uint8 codes; fp8ref decodes them itself.
        d("F8_E4M3", 8, np.dtype(np.uint8), "float8_e4m3fn"),
        d("F8_E5M2", 8, np.dtype(np.uint8), "float8_e5m2"),
        d("F8_E4M3FNUZ", 8, np.dtype(np.uint8), "float8_e4m3fnuz"),
        d("F8_E5M2FNUZ", 8, np.dtype(np.uint8), "float8_e5m2fnuz"),
        d("F8_E8M0", 8, np.dtype(np.uint8), "float8_e8m0fnu"),
        # Packed sub-byte floats: the shape counts elements, the bytes are numel * bits / 8.
        d("F4", 4, None, "float4_e2m1fn"),
        d("F6_E2M3", 6, None, "float6_e2m3fn"),
        d("F6_E3M2", 6, None, "float6_e3m2fn"),
    ]
    return {t.name: t for t in table}


DTYPES: Mapping[str, DType] = _dtypes()
@dataclass(frozen=True)
class TensorInfo:
    """One header entry. ``begin``/``end`` are offsets into the data section."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def numel(self) -> int:
        return prod(self.shape)

    @property
    def fmt(self) -> str | None:
        return DTYPES[self.dtype].fmt


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict:
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _is_int(value: object) -> bool:
    return type(value) is int


def parse_header(raw: bytes, where: str, data_size: int) -> tuple[dict[str, str], dict[str, TensorInfo]]:
    """Parse and validate a header's JSON against a data section of ``data_size`` bytes."""
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(f"{where}: header is not valid JSON: {exc}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{where}: header must be a JSON object, got {type(header).__name__}")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError(f"{where}: __metadata__ must map strings to strings, got {metadata!r:.200}")
    tensors: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        at = f"{where}: tensor {name!r}"
        if not name:
            raise CheckpointError(f"{where}: empty tensor name in the header")
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            got = sorted(entry) if isinstance(entry, dict) else type(entry).__name__
            raise CheckpointError(f"{at}: expected keys dtype, shape, data_offsets; got {got}")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if dtype not in DTYPES:
            raise CheckpointError(f"{at}: unknown dtype {dtype!r} (known: {', '.join(DTYPES)})")
        if (not isinstance(shape, list) or len(shape) > MAX_DIMS
                or not all(_is_int(d) and d >= 0 for d in shape)):
            raise CheckpointError(f"{at}: shape must be a list of at most {MAX_DIMS} non-negative ints, "
                                  f"got {shape!r:.200}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)
                and 0 <= offsets[0] <= offsets[1]):
            raise CheckpointError(f"{at}: data_offsets must be [begin, end] with 0 <= begin <= end, "
                                  f"got {offsets!r:.200}")
        bits = prod(shape) * DTYPES[dtype].bits
        if bits % 8 or bits // 8 != offsets[1] - offsets[0]:
            raise CheckpointError(f"{at}: shape {shape} of {dtype} needs {bits / 8:g} bytes, "
                                  f"data_offsets {offsets} span {offsets[1] - offsets[0]}")
        tensors[name] = TensorInfo(name, dtype, tuple(shape), offsets[0], offsets[1])
    position = 0
    for info in sorted(tensors.values(), key=lambda t: (t.begin, t.end)):
        if info.begin != position:
            what = "overlaps the previous tensor" if info.begin < position else "leaves a gap"
            raise CheckpointError(f"{where}: tensor {info.name!r} starts at data byte {info.begin}, "
                                  f"expected {position} ({what})")
        position = info.end
    if position > data_size:
        last = max(tensors.values(), key=lambda t: t.end)
        raise CheckpointError(f"{where}: truncated: tensor {last.name!r} ends at data byte {position} "
                              f"but the file holds only {data_size} data bytes")
    if position < data_size:
        raise CheckpointError(f"{where}: {data_size - position} unexpected bytes after the last tensor "
                              f"(the header accounts for {position} of {data_size} data bytes)")
    return metadata, tensors


class SafetensorsFile:
    """A validated safetensors file whose tensors are read only when asked for."""

    def __init__(self, path: str | os.PathLike, *, max_header_bytes: int = MAX_HEADER_BYTES):
        self.path = Path(path)
        where = str(self.path)
        try:
            with open(self.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                head = f.read(8)
                if len(head) < 8:
                    raise CheckpointError(f"{where}: truncated: {size} bytes, a safetensors file starts "
                                          f"with an 8-byte header length")
                n = int.from_bytes(head, "little")
                if n == 0 or n > max_header_bytes:
                    raise CheckpointError(f"{where}: header length {n} bytes is outside 1..{max_header_bytes}")
                if n > size - 8:
                    raise CheckpointError(f"{where}: truncated: header claims {n} bytes but only "
                                          f"{size - 8} follow the length field")
                raw = f.read(n)
        except OSError as exc:
            raise CheckpointError(f"{where}: cannot read: {exc.strerror or exc}") from None
        self.header_size = n
        self.data_start = 8 + n
        self.metadata, self.tensors = parse_header(raw, where, size - 8 - n)
        self.bytes_read = 0  # tensor data bytes read so far (headers excluded)

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise CheckpointError(f"{self.path}: no tensor {name!r}") from None

    def read_bytes(self, name: str) -> np.ndarray:
        """The tensor's raw bytes as a flat uint8 array (a fresh buffer, not a view of the file)."""
        info = self.info(name)
        out = np.empty(info.nbytes, dtype=np.uint8)
        try:
            with open(self.path, "rb") as f:
                f.seek(self.data_start + info.begin)
                got = f.readinto(memoryview(out))
        except OSError as exc:
            raise CheckpointError(f"{self.path}: tensor {name!r}: cannot read: {exc.strerror or exc}") from None
        if got != info.nbytes:
            raise CheckpointError(f"{self.path}: tensor {name!r}: file changed while reading "
                                  f"(got {got} of {info.nbytes} bytes)")
        self.bytes_read += info.nbytes
        return out

    def get(self, name: str) -> np.ndarray:
        """The tensor as a numpy array: float8 dtypes as uint8 codes, BF16 as ml_dtypes.bfloat16,
        F4 as one uint8 code per element (low nibble first). F6 packing has no single convention,
        so F6 tensors are available through ``read_bytes`` only."""
        return self.view(name, self.read_bytes(name))

    def view(self, name: str, raw: np.ndarray) -> np.ndarray:
        """``get`` for bytes already read with ``read_bytes``."""
        info = self.info(name)
        dt = DTYPES[info.dtype]
        if dt.name == "F4":
            codes = np.empty(raw.size * 2, dtype=np.uint8)
            codes[0::2], codes[1::2] = raw & 0x0F, raw >> 4
            return codes.reshape(info.shape)
        if dt.numpy is None:
            raise CheckpointError(f"{self.path}: tensor {name!r}: {info.dtype} has no agreed element "
                                  f"packing; use read_bytes() for the raw bytes")
        if dt.name == "BF16":
            return raw.view(_bfloat16(f"{self.path}: tensor {name!r}")).reshape(info.shape)
        return raw.view(dt.numpy).reshape(info.shape)


def _bfloat16(where: str):
    try:
        import ml_dtypes
    except ImportError:
        raise CheckpointError(f"{where}: BF16 tensors are returned as ml_dtypes.bfloat16 arrays; install "
                              f"ml_dtypes (the 'peers' extra) or use read_bytes()") from None
    return ml_dtypes.bfloat16


# --- index and file layout -------------------------------------------------------------------

def _inside(child: Path, root: Path) -> bool:
    try:
        child.relative_to(root)
        return True
    except ValueError:
        return False


def safe_member(folder: Path, name: object, where: str, *, symlinks_out: bool = False) -> Path:
    """Resolve ``name`` (from an index file) inside ``folder``; anything leaving it is an error.
    ``symlinks_out`` accepts a plain name that is a symlink to elsewhere (a Hugging Face cache
    snapshot links every file to ../../blobs); absolute paths and ``..`` stay errors."""
    if not isinstance(name, str) or not name or "\x00" in name:
        raise CheckpointError(f"{where}: shard file name must be a non-empty string, got {name!r}")
    pure = Path(name)
    if pure.is_absolute() or name.startswith(("/", "\\")) or (len(name) > 1 and name[1] == ":"):
        raise CheckpointError(f"{where}: shard path {name!r} is absolute; expected a file inside {folder}")
    if ".." in pure.parts or ".." in name.replace("\\", "/").split("/"):
        raise CheckpointError(f"{where}: shard path {name!r} leaves the checkpoint folder {folder}")
    root = folder.resolve()
    target = (folder / pure).resolve()
    if not _inside(target, root) and not (symlinks_out and _inside((folder / pure).parent.resolve(), root)):
        raise CheckpointError(f"{where}: shard path {name!r} resolves to {target}, outside the checkpoint "
                              f"folder {root} (symlink? pass symlinks_out=True if you trust it)")
    if not target.is_file():
        raise CheckpointError(f"{where}: shard {name!r} does not exist in {folder}")
    return target


@dataclass
class TensorStore:
    """All tensors of a checkpoint, single file or sharded: name -> (file, info)."""

    root: Path
    files: dict[str, SafetensorsFile]  # relative file name -> file
    locations: dict[str, str]  # tensor name -> relative file name
    index: dict | None = None  # the parsed index, None for a single file

    def __contains__(self, name: object) -> bool:
        return name in self.locations

    def __iter__(self) -> Iterator[str]:
        return iter(self.locations)

    def __len__(self) -> int:
        return len(self.locations)

    def file_of(self, name: str) -> SafetensorsFile:
        try:
            return self.files[self.locations[name]]
        except KeyError:
            raise CheckpointError(f"{self.root}: no tensor {name!r} in the checkpoint") from None

    def info(self, name: str) -> TensorInfo:
        return self.file_of(name).info(name)

    def get(self, name: str) -> np.ndarray:
        return self.file_of(name).get(name)

    def where(self, name: str) -> str:
        """``file:tensor`` for error messages."""
        return f"{self.file_of(name).path}: tensor {name!r}"

    @property
    def bytes_read(self) -> int:
        return sum(f.bytes_read for f in self.files.values())


def _read_json(path: Path, what: str) -> object:
    try:
        size = path.stat().st_size
        if size > MAX_HEADER_BYTES:
            raise CheckpointError(f"{path}: {what} is {size} bytes, more than the {MAX_HEADER_BYTES} limit")
        return json.loads(path.read_text(encoding="utf-8"), object_pairs_hook=_no_duplicates)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read {what}: {exc.strerror or exc}") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(f"{path}: {what} is not valid JSON: {exc}") from None


def read_json(path: str | os.PathLike, what: str = "JSON file") -> object:
    return _read_json(Path(path), what)


def open_store(path: str | os.PathLike, *, symlinks_out: bool = False) -> TensorStore:
    """Open a single safetensors file, or a folder with an index or one ``*.safetensors`` file
    (``symlinks_out``: see ``safe_member``)."""
    path = Path(path)
    if path.is_file():
        f = SafetensorsFile(path)
        return TensorStore(path.parent, {path.name: f}, dict.fromkeys(f.tensors, path.name))
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such file or folder")
    index_path = path / INDEX_NAME
    if index_path.exists():
        return _open_index(path, index_path, symlinks_out)
    candidates = sorted(p.name for p in path.glob("*.safetensors"))
    if SINGLE_NAME in candidates:
        candidates = [SINGLE_NAME]
    if len(candidates) != 1:
        raise CheckpointError(f"{path}: expected {SINGLE_NAME}, {INDEX_NAME} or exactly one *.safetensors "
                              f"file, found {candidates or 'none'}")
    target = safe_member(path, candidates[0], str(path), symlinks_out=symlinks_out)
    f = SafetensorsFile(target)
    return TensorStore(path, {candidates[0]: f}, dict.fromkeys(f.tensors, candidates[0]))


def _open_index(folder: Path, index_path: Path, symlinks_out: bool) -> TensorStore:
    where = str(index_path)
    index = _read_json(index_path, "index")
    if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict):
        raise CheckpointError(f"{where}: expected an object with a 'weight_map' object")
    weight_map = index["weight_map"]
    files: dict[str, SafetensorsFile] = {}
    for name, shard in weight_map.items():
        if shard not in files:
            files[shard] = SafetensorsFile(safe_member(folder, shard, f"{where}: weight_map[{name!r}]",
                                                       symlinks_out=symlinks_out))
        if name not in files[shard]:
            raise CheckpointError(f"{where}: weight_map puts {name!r} in {shard}, which has no such tensor")
    for shard, f in files.items():
        for name in f.tensors:
            if weight_map.get(name) != shard:
                other = weight_map.get(name)
                why = f"the index puts it in {other}" if other else "the index does not list it"
                raise CheckpointError(f"{f.path}: tensor {name!r}: {why}")
    return TensorStore(folder, files, dict(weight_map), index)


# --- writing ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class TensorSpec:
    """A tensor to be written: name, safetensors dtype string, shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise CheckpointError(f"tensor {self.name!r}: unknown safetensors dtype {self.dtype!r}")
        if prod(self.shape) * DTYPES[self.dtype].bits % 8:
            raise CheckpointError(f"tensor {self.name!r}: {self.shape} of {self.dtype} is not whole bytes")

    @property
    def nbytes(self) -> int:
        return prod(self.shape) * DTYPES[self.dtype].bits // 8


# safetensors' Dtype enum order; it writes tensors by this rank descending, then by name.
DTYPE_RANK = {name: i for i, name in enumerate(
    "BOOL F4 F6_E2M3 F6_E3M2 U8 I8 F8_E5M2 F8_E4M3 F8_E8M0 F8_E4M3FNUZ F8_E5M2FNUZ I16 U16 F16 BF16 I32 U32 "
    "F32 C64 F64 I64 U64".split())}


def layout(specs: Iterable[TensorSpec], metadata: Mapping[str, str] | None) -> tuple[bytes, dict[str, int]]:
    """Header bytes (length prefix included) and each tensor's absolute file offset, ordered as
    safetensors 0.8 orders them: by its dtype enum rank descending, then by name."""
    specs = list(specs)
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise CheckpointError(f"duplicate tensor names {dup}")
    ordered = sorted(specs, key=lambda s: (-DTYPE_RANK[s.dtype], s.name))
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offsets, position = {}, 0
    for s in ordered:
        header[s.name] = {"dtype": s.dtype, "shape": list(s.shape), "data_offsets": [position, position + s.nbytes]}
        offsets[s.name] = position
        position += s.nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)
    start = 8 + len(text)
    return len(text).to_bytes(8, "little") + text, {name: start + off for name, off in offsets.items()}


class SafetensorsWriter:
    """Streams tensors into ``path`` in any order; the header is fixed up front by ``specs``."""

    def __init__(self, path: str | os.PathLike, specs: Iterable[TensorSpec],
                 metadata: Mapping[str, str] | None = None):
        self.path = Path(path)
        self.specs = {s.name: s for s in specs}
        head, self.offsets = layout(self.specs.values(), metadata)
        self.total = len(head) + sum(s.nbytes for s in self.specs.values())
        self._written: set[str] = set()
        self._file = open(self.path, "wb")
        self._file.write(head)
        self._file.truncate(self.total)

    def write(self, name: str, data: np.ndarray | bytes) -> None:
        """Write a tensor: an array of its dtype and shape, or its raw bytes (flat uint8/bytes)."""
        spec = self.specs.get(name)
        if spec is None:
            raise CheckpointError(f"{self.path}: tensor {name!r} was not declared")
        if name in self._written:
            raise CheckpointError(f"{self.path}: tensor {name!r} written twice")
        raw = isinstance(data, np.ndarray) and data.dtype == np.uint8 and data.ndim == 1 and data.size == spec.nbytes
        if isinstance(data, np.ndarray) and not raw:
            if data.dtype.itemsize * 8 != DTYPES[spec.dtype].bits and DTYPES[spec.dtype].numpy is not None:
                raise CheckpointError(f"{self.path}: tensor {name!r}: {data.dtype} does not fit {spec.dtype}")
            if DTYPES[spec.dtype].numpy is not None and tuple(data.shape) != spec.shape:
                raise CheckpointError(f"{self.path}: tensor {name!r}: shape {tuple(data.shape)}, "
                                      f"declared {spec.shape}")
            buf = memoryview(np.ascontiguousarray(data).reshape(-1).view(np.uint8))
        else:
            buf = memoryview(data).cast("B")
        if buf.nbytes != spec.nbytes:
            raise CheckpointError(f"{self.path}: tensor {name!r}: {buf.nbytes} bytes, expected {spec.nbytes}")
        self._file.seek(self.offsets[name])
        self._file.write(buf)
        self._written.add(name)

    def close(self) -> None:
        missing = sorted(set(self.specs) - self._written)
        self._file.close()
        if missing:
            raise CheckpointError(f"{self.path}: tensors never written: {missing[:10]}")

    def abort(self) -> None:
        self._file.close()


def write_safetensors(path: str | os.PathLike, tensors: Mapping[str, tuple[str, np.ndarray]],
                      metadata: Mapping[str, str] | None = None) -> None:
    """Write ``{name: (dtype, array)}`` atomically (temporary file, then rename)."""
    path = Path(path)
    specs = [TensorSpec(n, dt, tuple(a.shape) if DTYPES[dt].numpy is not None else _packed_shape(dt, a))
             for n, (dt, a) in tensors.items()]
    with atomic_file(path) as tmp:
        w = SafetensorsWriter(tmp, specs, metadata)
        try:
            for name, (_, array) in tensors.items():
                w.write(name, array if DTYPES[w.specs[name].dtype].numpy is not None else _pack(w.specs[name], array))
        except BaseException:
            w.abort()
            raise
        w.close()


def _packed_shape(dtype: str, codes: np.ndarray) -> tuple[int, ...]:
    if dtype != "F4":
        raise CheckpointError(f"writing {dtype} needs packed bytes; only F4 is packed by fp8ref")
    return tuple(codes.shape)


def _pack(spec: TensorSpec, codes: np.ndarray) -> np.ndarray:
    flat = np.ascontiguousarray(codes, dtype=np.uint8).reshape(-1)
    if flat.size % 2 or (flat > 0x0F).any():
        raise CheckpointError(f"tensor {spec.name!r}: F4 needs an even number of 4-bit codes")
    return (flat[0::2] | (flat[1::2] << 4)).astype(np.uint8)


@contextmanager
def atomic_file(path: Path) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; rename it over ``path`` on success, delete it on failure."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        yield Path(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    with atomic_file(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


@contextmanager
def atomic_folder(dest: str | os.PathLike, *, force: bool = False,
                  protect: Iterable[str | os.PathLike] = ()) -> Iterator[Path]:
    """Yield an empty temporary folder beside ``dest``; on success it replaces ``dest``.

    Refuses an existing ``dest`` unless ``force``, and any ``dest`` that is, contains or lies
    inside a protected path (the source checkpoint). On any failure, interrupts included, the
    temporary folder is removed and ``dest`` is left as it was.
    """
    dest = Path(dest)
    real = dest.resolve()
    for p in protect:
        src = Path(p).resolve()
        if real == src or _inside(real, src) or _inside(src, real):
            raise CheckpointError(f"{dest}: output must not be, contain or lie inside the source {p}")
    if dest.exists() or dest.is_symlink():
        if not force:
            raise CheckpointError(f"{dest}: already exists; pass force=True (CLI: --force) to replace it")
        if not dest.is_dir() or dest.is_symlink():
            raise CheckpointError(f"{dest}: exists and is not a folder; refusing to replace it")
    if not dest.parent.is_dir():
        raise CheckpointError(f"{dest}: parent folder {dest.parent} does not exist")
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".partial"))
    try:
        yield tmp
        if dest.exists():
            old = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".old"))
            os.replace(dest, old / "x")
            os.replace(tmp, dest)
            shutil.rmtree(old)
        else:
            os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
