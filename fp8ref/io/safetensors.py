"""safetensors reading and writing without pickle, without trusting the file: the one reader and
the one writer of fp8ref (checkpoints, golden folders, and the outputs other languages write).

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON (space-padded),
then the tensor data. The header is parsed with limits and checked completely before any
tensor byte is touched: unique names, known dtypes, integer shapes, offsets that match the
shapes and tile the data section exactly (no overlap, no gap, no trailing byte). Tensors are
then read one at a time, on request, with a positioned read of exactly their bytes, so opening
a 100 GB checkpoint reads headers only and a large tensor is freed as soon as the caller drops it.

Writing fixes every choice the format leaves open, in one of two orders:
``"safetensors"`` mirrors safetensors 0.8's ``save_file`` byte for byte (tensors ordered by
dtype rank then name, metadata only when given); ``"name"`` is the golden folders' canonical
form (tensors in name order, every JSON key sorted, metadata always present). Either way the
header is padded with spaces to a multiple of 8 and laid out from the declared names, dtypes
and shapes, so a writer streams each tensor to its offset as it becomes available.
"""

from __future__ import annotations

import json
import mmap
import os
import re
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from math import prod
from pathlib import Path

import numpy as np

from .._arrays import bf16_bits_to_f32
from ..errors import CheckpointError, Fp8RefError
from ..formats import SAFETENSORS_DTYPES
from ..limits import MAX_DIM, MAX_NAME, int_in, shown
from .atomic import atomic_file, is_inside
from .files import MAX_JSON_BYTES, open_regular, parse_json, read_json, read_range, write_bytes

MAX_HEADER_BYTES = MAX_JSON_BYTES
MAX_DIMS = 16
MAX_FILE_NAME = 255  # bytes in one path component (NAME_MAX on Linux and macOS)
MAX_PATH = 4096
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
METADATA_NAMES = (INDEX_NAME, "config.json", "quantization_config.json")  # read beside the shards
DTYPES = SAFETENSORS_DTYPES
ORDERS = ("safetensors", "name")
PLAIN_DTYPES = tuple(name for name, t in DTYPES.items() if t.fmt is None)
"""dtypes that are plain numpy arrays (``dtype_name``'s range): what golden files hold."""


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


def parse_header(raw: bytes, where: str, data_size: int) -> tuple[dict[str, str], dict[str, TensorInfo]]:
    """Parse and validate a header's JSON against a data section of ``data_size`` bytes."""
    header = parse_json(raw, where, "header")
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
        if len(name) > MAX_NAME or "\x00" in name:
            raise CheckpointError(f"{where}: tensor name {shown(name)} is longer than {MAX_NAME} characters "
                                  f"or holds a NUL byte")
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            got = sorted(entry) if isinstance(entry, dict) else type(entry).__name__
            raise CheckpointError(f"{at}: expected keys dtype, shape, data_offsets; got {got}")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise CheckpointError(f"{at}: unknown dtype {shown(dtype)} (known: {', '.join(DTYPES)})")
        # every dimension and the element count in int64 (what numpy can index), also for an empty tensor
        if (not isinstance(shape, list) or len(shape) > MAX_DIMS
                or not all(int_in(d, 0, MAX_DIM) for d in shape) or prod(shape) > MAX_DIM):
            raise CheckpointError(f"{at}: shape must be a list of at most {MAX_DIMS} ints in 0..{MAX_DIM} "
                                  f"with at most {MAX_DIM} elements, got {shown(shape, 200)}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(int_in(o, 0, MAX_DIM) for o in offsets)
                and offsets[0] <= offsets[1]):
            raise CheckpointError(f"{at}: data_offsets must be [begin, end] with 0 <= begin <= end <= {MAX_DIM}, "
                                  f"got {shown(offsets, 200)}")
        bits = prod(shape) * DTYPES[dtype].bits
        if bits % 8 or bits // 8 != offsets[1] - offsets[0]:
            raise CheckpointError(f"{at}: shape {shape} of {dtype} needs {bits // 8}{'.5' if bits % 8 else ''} "
                                  f"bytes, data_offsets {offsets} span {offsets[1] - offsets[0]}")
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


class TensorFile:
    """What a single tensor file's reader shares: ``path`` and ``tensors`` (name -> TensorInfo)."""

    path: Path
    tensors: dict

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise CheckpointError(f"{self.path}: no tensor {name!r}") from None


class SafetensorsFile(TensorFile):
    """A validated safetensors file whose tensors are read only when asked for."""

    def __init__(self, path: str | os.PathLike, *, max_header_bytes: int = MAX_HEADER_BYTES):
        self.path = Path(path)
        where = str(self.path)
        try:
            with open_regular(self.path, what="safetensors file") as f:
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
        self.data_size = size - 8 - n
        self.metadata, self.tensors = parse_header(raw, where, self.data_size)
        self.bytes_read = 0  # tensor data bytes read so far (headers excluded)

    def read_bytes(self, name: str) -> np.ndarray:
        """The tensor's raw bytes as a flat uint8 array (a fresh buffer, not a view of the file)."""
        info = self.info(name)
        out = read_range(self.path, "safetensors file", name, self.data_start + info.begin, info.nbytes)
        self.bytes_read += info.nbytes
        return out

    def map_bytes(self, name: str) -> np.ndarray:
        """``read_bytes`` without the copy: the tensor's bytes as a read-only flat uint8 view of the
        file mapped into memory, the page cache's own pages (unmapped when the last view of it is
        dropped). For one pass over a large tensor (``verify``): no fresh buffer to fault in, no copy.
        The file must still hold the tensor when it is mapped; one that another process truncates
        while a view is in use ends this process with SIGBUS, the price of every mapped read
        (safetensors' ``safe_open``, numpy's ``memmap``)."""
        info = self.info(name)
        if info.nbytes == 0:
            return np.empty(0, np.uint8)
        start = self.data_start + info.begin
        base = start - start % mmap.ALLOCATIONGRANULARITY  # a mapping starts on that boundary
        try:
            with open_regular(self.path, what="safetensors file") as f:  # swapped for a FIFO since: refused
                size = os.fstat(f.fileno()).st_size
                if size < start + info.nbytes:
                    raise CheckpointError(f"{self.path}: tensor {name!r}: file changed while reading (now "
                                          f"{size} bytes, the tensor ends at byte {start + info.nbytes})")
                length = start + info.nbytes - base
                if hasattr(mmap, "MAP_POPULATE"):  # Linux: the page table filled in one call, not per fault
                    m = mmap.mmap(f.fileno(), length, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE,
                                  prot=mmap.PROT_READ, offset=base)
                else:
                    m = mmap.mmap(f.fileno(), length, access=mmap.ACCESS_READ, offset=base)
        except OSError as exc:
            raise CheckpointError(f"{self.path}: tensor {name!r}: cannot map: {exc.strerror or exc}") from None
        self.bytes_read += info.nbytes
        return np.frombuffer(m, np.uint8, info.nbytes, start - base)

    def read_data(self) -> np.ndarray:
        """The whole data section as one uint8 array (one read: for small files read whole)."""
        size = self.data_size
        out = np.empty(size, dtype=np.uint8)
        try:
            with open_regular(self.path, what="safetensors file") as f:  # swapped for a FIFO since: refused
                f.seek(self.data_start)
                got = f.readinto(memoryview(out))
        except OSError as exc:
            raise CheckpointError(f"{self.path}: cannot read: {exc.strerror or exc}") from None
        if got != size:
            raise CheckpointError(f"{self.path}: file changed while reading (got {got} of {size} data bytes)")
        self.bytes_read += size
        return out

    def get(self, name: str, *, mapped: bool = False, bf16_bits: bool = False) -> np.ndarray:
        """The tensor as a numpy array: float8 dtypes as uint8 codes, BF16 as ml_dtypes.bfloat16,
        F4 as one uint8 code per element (low nibble first). F6 packing has no single convention,
        so F6 tensors are available through ``read_bytes`` only. ``mapped``: the bytes not copied but
        mapped (``map_bytes``): a read-only array (F4: unpacked into a new one). ``bf16_bits``: BF16
        as its uint16 bit patterns (ml_dtypes not imported: half a second of CPU)."""
        return self.view(name, self.map_bytes(name) if mapped else self.read_bytes(name), bf16_bits=bf16_bits)

    def view(self, name: str, raw: np.ndarray, *, bf16_bits: bool = False) -> np.ndarray:
        """``get`` for bytes already read with ``read_bytes``."""
        info = self.info(name)
        dt = DTYPES[info.dtype]
        if dt.name == "F4":
            return unpack_nibbles(raw).reshape(info.shape)
        if dt.numpy is None:
            raise CheckpointError(f"{self.path}: tensor {name!r}: {info.dtype} has no agreed element "
                                  f"packing; use read_bytes() for the raw bytes")
        if dt.name == "BF16":
            if bf16_bits:
                return raw.view(np.uint16).reshape(info.shape)
            return raw.view(_bfloat16(f"{self.path}: tensor {name!r}")).reshape(info.shape)
        return raw.view(np.dtype(dt.numpy)).reshape(info.shape)


def _bfloat16(where: str):
    try:
        import ml_dtypes
    except ImportError:
        raise CheckpointError(f"{where}: BF16 tensors are returned as ml_dtypes.bfloat16 arrays; install "
                              f"ml_dtypes (the 'peers' extra) or use read_bytes()") from None
    return ml_dtypes.bfloat16




# --- index and file layout -------------------------------------------------------------------

def safe_member(folder: Path, name: object, where: str, *, symlinks_out: bool = False) -> Path:
    """Resolve ``name`` (from an index file) inside ``folder``; anything leaving it is an error.
    ``symlinks_out`` accepts a plain name that is a symlink to elsewhere (a Hugging Face cache
    snapshot links every file to ../../blobs); absolute paths and ``..`` stay errors."""
    if not isinstance(name, str) or not name or "\x00" in name:
        raise CheckpointError(f"{where}: shard file name must be a non-empty string, got {shown(name)}")
    if len(name) > MAX_PATH or any(len(part.encode("utf-8", "replace")) > MAX_FILE_NAME
                                   for part in name.replace("\\", "/").split("/")):
        raise CheckpointError(f"{where}: shard path {shown(name)} is longer than a file system allows "
                              f"({MAX_FILE_NAME} bytes a name, {MAX_PATH} characters a path)")
    pure = Path(name)
    if pure.is_absolute() or name.startswith(("/", "\\")) or (len(name) > 1 and name[1] == ":"):
        raise CheckpointError(f"{where}: shard path {name!r} is absolute; expected a file inside {folder}")
    if ".." in pure.parts or ".." in name.replace("\\", "/").split("/"):
        raise CheckpointError(f"{where}: shard path {name!r} leaves the checkpoint folder {folder}")
    try:
        root = folder.resolve()
        target = (folder / pure).resolve()
        inside = is_inside(target, root) or (symlinks_out and is_inside((folder / pure).parent.resolve(), root))
        exists = target.is_file()
    except (OSError, RuntimeError) as exc:  # a symlink loop, a name the file system refuses
        raise CheckpointError(f"{where}: shard path {shown(name)}: {getattr(exc, 'strerror', None) or exc}") from None
    if not inside:
        raise CheckpointError(f"{where}: shard path {name!r} resolves to {target}, outside the checkpoint "
                              f"folder {root} (symlink? pass symlinks_out=True if you trust it)")
    if not exists:
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

    def get(self, name: str, *, mapped: bool = False, bf16_bits: bool = False) -> np.ndarray:
        return self.file_of(name).get(name, mapped=mapped, bf16_bits=bf16_bits)

    def float_values(self, name: str) -> np.ndarray:
        """``get`` with a BF16 tensor as its exact float32 values (ml_dtypes not imported)."""
        a = self.get(name, bf16_bits=True)
        return bf16_bits_to_f32(a) if self.info(name).dtype == "BF16" else a

    def where(self, name: str) -> str:
        """``file:tensor`` for error messages."""
        return f"{self.file_of(name).path}: tensor {name!r}"

    @property
    def bytes_read(self) -> int:
        return sum(f.bytes_read for f in self.files.values())


# file suffix -> the reader of a single-file format other than safetensors (io/gguf.py registers ".gguf"
# when the io package loads): open_store opens those files with it, into the same TensorStore
SINGLE_FILE_READERS: dict[str, type] = {}


def open_store(path: str | os.PathLike, *, symlinks_out: bool = False) -> TensorStore:
    """Open a single safetensors file, or a folder with an index or one ``*.safetensors`` file
    (``symlinks_out``: see ``safe_member``)."""
    path = Path(path)
    reader = SINGLE_FILE_READERS.get(path.suffix)
    if reader is not None and path.exists() and not path.is_dir():  # another format's own strict reader
        f = reader(path)
        return TensorStore(path.parent, {path.name: f}, dict.fromkeys(f.tensors, path.name))
    if path.exists() and not path.is_dir():  # a FIFO or device: refused by SafetensorsFile by name
        f = SafetensorsFile(path)
        return TensorStore(path.parent, {path.name: f}, dict.fromkeys(f.tensors, path.name))
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such file or folder")
    for meta in METADATA_NAMES:  # the folder's own JSON files obey the same symlink rule as its shards
        if os.path.islink(path / meta):
            safe_member(path, meta, str(path / meta), symlinks_out=symlinks_out)
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


_SHARD_NAME = re.compile(r"^(.*)-(\d+)-of-(\d+)\.safetensors$")


def _check_shard_set(folder: Path, where: str, weight_map: dict) -> None:
    """An index that leaves out a whole shard would load silently as a smaller model: the shard
    names say how many there are (``model-00002-of-00004.safetensors``, the Hugging Face naming),
    and every one of them must be referenced."""
    named: dict[tuple[str, str], set[int]] = {}
    for shard in set(weight_map.values()):
        m = _SHARD_NAME.match(shard) if isinstance(shard, str) else None
        if m:
            named.setdefault((m.group(1), m.group(3)), set()).add(int(m.group(2)))
    for (stem, total), seen in named.items():
        missing = sorted(set(range(1, int(total) + 1)) - seen) if int(total) <= 100_000 else []
        if missing:
            example = f"{stem}-{missing[0]:0{len(total)}d}-of-{total}.safetensors"
            on_disk = " (it is in the folder)" if (folder / example).is_file() else ""
            raise CheckpointError(f"{where}: weight_map references {len(seen)} of the {int(total)} shards "
                                  f"{stem}-*-of-{total}; no tensor is mapped to {len(missing)} of them, e.g. "
                                  f"{example}{on_disk}: an incomplete index loads as a smaller model")


def _open_index(folder: Path, index_path: Path, symlinks_out: bool) -> TensorStore:
    where = str(index_path)
    index = read_json(index_path, "index")
    if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict):
        raise CheckpointError(f"{where}: expected an object with a 'weight_map' object")
    weight_map = index["weight_map"]
    if not weight_map:
        raise CheckpointError(f"{where}: weight_map is empty; a checkpoint index maps every tensor to its shard")
    files: dict[str, SafetensorsFile] = {}
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or shard not in files:
            files[shard] = SafetensorsFile(safe_member(folder, shard, f"{where}: weight_map[{name!r}]",
                                                       symlinks_out=symlinks_out))
        if name not in files[shard]:
            raise CheckpointError(f"{where}: weight_map puts {name!r} in {shard}, which has no such tensor")
    _check_shard_set(folder, where, weight_map)
    for shard, f in files.items():
        for name in f.tensors:
            if weight_map.get(name) != shard:
                other = weight_map.get(name)
                why = f"the index puts it in {other}" if other else "the index does not list it"
                raise CheckpointError(f"{f.path}: tensor {name!r}: {why}")
    return TensorStore(folder, files, dict(weight_map), index)

def load(path: str | os.PathLike, *, error: type[Fp8RefError] = CheckpointError,
         dtypes: Iterable[str] | None = None) -> dict[str, np.ndarray]:
    """Every tensor of one file, strictly checked (see the module docstring), in header order;
    ``dtypes`` limits the accepted safetensors dtypes. Errors are ``error`` (one line, naming the file)."""
    try:
        f = SafetensorsFile(path)
        if dtypes is not None:
            allowed = tuple(dtypes)
            for info in f.tensors.values():
                if info.dtype not in allowed:
                    raise CheckpointError(f"{f.path}: tensor {info.name!r}: dtype {info.dtype} is not "
                                          f"accepted here (expected one of {', '.join(allowed)})")
        data = f.read_data()
        return {name: f.view(name, data[info.begin:info.end].copy()) for name, info in f.tensors.items()}
    except CheckpointError as exc:
        if error is CheckpointError:
            raise
        raise error(str(exc)) from None


def dtype_name(array: np.ndarray) -> str:
    """safetensors dtype string of a plain numpy array (ml_dtypes bfloat16 -> BF16; uint8 -> U8,
    never a float8 dtype: codes say which format they hold only through the caller)."""
    if array.dtype.name == "bfloat16":
        return "BF16"
    for name in PLAIN_DTYPES:
        if name != "BF16" and np.dtype(DTYPES[name].numpy) == array.dtype:
            return name
    raise CheckpointError(f"dtype {array.dtype} has no safetensors dtype")


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


def layout(specs: Iterable[TensorSpec], metadata: Mapping[str, str] | None,
           order: str = "safetensors") -> tuple[bytes, dict[str, int]]:
    """Header bytes (length prefix included) and each tensor's absolute file offset, in ``order``
    (see the module docstring)."""
    if order not in ORDERS:
        raise CheckpointError(f"order must be one of {ORDERS}, got {order!r}")
    specs = list(specs)
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise CheckpointError(f"duplicate tensor names {dup}")
    canonical = order == "name"
    ordered = sorted(specs, key=(lambda s: s.name) if canonical else (lambda s: (-DTYPE_RANK[s.dtype], s.name)))
    header: dict[str, object] = {}
    if metadata or canonical:
        header["__metadata__"] = dict(metadata or {})
    offsets, position = {}, 0
    for s in ordered:
        header[s.name] = {"dtype": s.dtype, "shape": list(s.shape), "data_offsets": [position, position + s.nbytes]}
        offsets[s.name] = position
        position += s.nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=canonical, sort_keys=canonical).encode("utf-8")
    text += b" " * (-len(text) % 8)
    start = 8 + len(text)
    return len(text).to_bytes(8, "little") + text, {name: start + off for name, off in offsets.items()}


class SafetensorsWriter:
    """Streams tensors into ``path`` in any order; the header is fixed up front by ``specs``."""

    def __init__(self, path: str | os.PathLike, specs: Iterable[TensorSpec],
                 metadata: Mapping[str, str] | None = None, *, order: str = "safetensors"):
        self.path = Path(path)
        self.specs = {s.name: s for s in specs}
        head, self.offsets = layout(self.specs.values(), metadata, order)
        self.total = len(head) + sum(s.nbytes for s in self.specs.values())
        self._written: set[str] = set()
        self._file = open(self.path, "wb")
        with self._naming_errors():
            self._file.write(head)
            self._file.truncate(self.total)

    @contextmanager
    def _naming_errors(self):
        """A write error (a full disk) names this file (the output rule, ``io.outputs``)."""
        try:
            yield
        except OSError as exc:
            if exc.filename is not None:
                raise
            raise OSError(exc.errno, exc.strerror or str(exc), str(self.path)) from None

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
            if data.dtype.byteorder == ">":
                data = data.astype(data.dtype.newbyteorder("<"))
            buf = memoryview(np.ascontiguousarray(data).reshape(-1).view(np.uint8))
        else:
            buf = memoryview(data).cast("B")
        if buf.nbytes != spec.nbytes:
            raise CheckpointError(f"{self.path}: tensor {name!r}: {buf.nbytes} bytes, expected {spec.nbytes}")
        with self._naming_errors():
            self._file.seek(self.offsets[name])
            self._file.write(buf)
        self._written.add(name)

    def close(self) -> None:
        missing = sorted(set(self.specs) - self._written)
        with self._naming_errors():
            self._file.close()
        if missing:
            raise CheckpointError(f"{self.path}: tensors never written: {missing[:10]}")

    def abort(self) -> None:
        self._file.close()


def write_safetensors(path: str | os.PathLike, tensors: Mapping[str, tuple[str, np.ndarray]],
                      metadata: Mapping[str, str] | None = None, *, order: str = "safetensors") -> None:
    """Write ``{name: (dtype, array)}`` atomically (temporary file, then rename)."""
    path = Path(path)
    specs = [TensorSpec(n, dt, tuple(a.shape) if DTYPES[dt].numpy is not None else _packed_shape(dt, a))
             for n, (dt, a) in tensors.items()]
    with atomic_file(path) as tmp:
        w = SafetensorsWriter(tmp, specs, metadata, order=order)
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
    return pack_nibbles(flat)


def unpack_nibbles(packed: np.ndarray) -> np.ndarray:
    """Bytes [..., n] -> 4-bit codes [..., 2n], the low nibble first (the even element): the F4
    dtype's order, and the order of the uint8-packed FP4 pairs compressed-tensors and ModelOpt write."""
    p = np.asarray(packed).view(np.uint8)
    return np.stack([p & np.uint8(0x0F), p >> np.uint8(4)], axis=-1).reshape(p.shape[:-1] + (2 * p.shape[-1],))


def pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """4-bit codes [..., 2n] -> bytes [..., n], the even element in the low nibble."""
    c = np.asarray(codes, np.uint8)
    if c.shape[-1] % 2:
        raise CheckpointError(f"packed FP4: the last dimension must be even, got shape {list(c.shape)}")
    return ((c[..., 0::2] & np.uint8(0x0F)) | (c[..., 1::2] << np.uint8(4))).astype(np.uint8)


def unpack_sextets(packed: np.ndarray, where: str = "packed FP6") -> np.ndarray:
    """Bytes [..., 3n] -> 6-bit codes [..., 4n]: each 3 bytes are a little-endian 24-bit word holding
    four codes, the first in the low 6 bits (compressed-tensors 0.20.1 ``unpack_fp6_from_uint8``).
    ``where`` names the tensor in the error for a byte count that is not a multiple of 3."""
    p = np.asarray(packed).view(np.uint8)
    if p.shape[-1] % 3:
        raise CheckpointError(f"{where}: {p.shape[-1]} bytes per row, not a multiple of 3; packed FP6 "
                              f"stores 4 six-bit codes in every 3 bytes")
    b = p.reshape(p.shape[:-1] + (p.shape[-1] // 3, 3)).astype(np.uint32)
    word = b[..., 0] | (b[..., 1] << np.uint32(8)) | (b[..., 2] << np.uint32(16))
    codes = np.stack([(word >> np.uint32(k)) & np.uint32(0x3F) for k in (0, 6, 12, 18)], axis=-1)
    return codes.astype(np.uint8).reshape(p.shape[:-1] + (4 * (p.shape[-1] // 3),))


def pack_sextets(codes: np.ndarray) -> np.ndarray:
    """6-bit codes [..., 4n] -> bytes [..., 3n], the inverse of ``unpack_sextets``."""
    c = np.asarray(codes, np.uint8)
    if c.shape[-1] % 4:
        raise CheckpointError(f"packed FP6: the last dimension must be a multiple of 4, got shape {list(c.shape)}")
    q = (c & np.uint8(0x3F)).astype(np.uint32).reshape(c.shape[:-1] + (c.shape[-1] // 4, 4))
    word = q[..., 0] | (q[..., 1] << np.uint32(6)) | (q[..., 2] << np.uint32(12)) | (q[..., 3] << np.uint32(18))
    out = np.stack([word & np.uint32(0xFF), (word >> np.uint32(8)) & np.uint32(0xFF), word >> np.uint32(16)], axis=-1)
    return out.astype(np.uint8).reshape(c.shape[:-1] + (3 * (c.shape[-1] // 4),))


# element format -> (codes, bytes) of its uint8 packing in checkpoints: FP4 pairs (low nibble first;
# compressed-tensors, ModelOpt, gpt-oss), FP6 E2M3 quads in 3 bytes (compressed-tensors 0.20.1)
PACKINGS = {"float4_e2m1fn": (2, 1), "float6_e2m3fn": (4, 3)}


def pack_codes(codes: np.ndarray, fmt: str) -> np.ndarray:
    """Codes [..., K] of a packed element format (``PACKINGS``) -> its bytes [..., K * bytes / codes]."""
    if fmt not in PACKINGS:
        raise CheckpointError(f"{fmt} has no packed checkpoint form; packed formats: {', '.join(PACKINGS)}")
    return pack_nibbles(codes) if fmt == "float4_e2m1fn" else pack_sextets(codes)


def unpack_codes(packed: np.ndarray, fmt: str, where: str = "packed weight") -> np.ndarray:
    """The bytes of a packed element format (``PACKINGS``) -> one uint8 code per element."""
    if fmt not in PACKINGS:
        raise CheckpointError(f"{where}: {fmt} has no packed checkpoint form; packed formats: {', '.join(PACKINGS)}")
    return unpack_nibbles(packed) if fmt == "float4_e2m1fn" else unpack_sextets(packed, where)




def dumps(tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None,
          order: str = "name") -> bytes:
    """The bytes of a file holding plain numpy arrays (dtype from ``dtype_name``), built in memory."""
    arrays = {n: np.ascontiguousarray(a) for n, a in tensors.items()}
    specs = [TensorSpec(n, dtype_name(a), tuple(a.shape)) for n, a in arrays.items()]
    head, offsets = layout(specs, metadata, order)
    out = bytearray(head)
    for name in sorted(offsets, key=offsets.__getitem__):
        a = arrays[name]
        if a.dtype.byteorder == ">":
            a = a.astype(a.dtype.newbyteorder("<"))
        out += a.reshape(-1).view(np.uint8).tobytes()
    return bytes(out)


def save(path: str | os.PathLike, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None,
         order: str = "name") -> bytes:
    """Write ``dumps(tensors, metadata, order)`` to ``path`` (``io.files.write_bytes``: atomically,
    or into a FIFO); returns the bytes."""
    data = dumps(tensors, metadata, order)
    write_bytes(path, data)
    return data
