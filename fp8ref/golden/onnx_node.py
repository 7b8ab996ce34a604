"""Import ONNX backend node tests as a golden suite (``fp8ref golden import onnx-node``).

A node test is a folder ``model.onnx`` + ``test_data_set_N/input_K.pb`` / ``output_K.pb`` (ONNX's
``onnx/backend/test/data/node/test_*``; the data left the onnx wheel in onnx #7959, its generators
``onnx/backend/test/case/node/*.py`` still ship: tools/make_onnx_node_vectors.py writes the folders
from them). Supported: a graph of one ``Cast`` or ``CastLike`` node from float32 / float64 / float16 /
bfloat16 to a float8, E8M0 or FP4 type (an encode case: saturate, E8M0 round_mode) or back to a float
type (a decode case). Every data set becomes one case whose inputs are the test's own values, written
as literal hex bit patterns into the suite (so ``golden verify`` re-derives everything from the suite
alone); ONNX's expected outputs become an outputs file for ``golden check``.

Hostile input is refused before anything is written, with one ``GoldenError`` naming the file: a
graph that is not a single supported node, a tensor whose type, shape or byte count does not match
the graph, input / output names that do not match, a missing or extra data file. The ``.onnx`` and
``.pb`` files are parsed by the onnx package (protobuf; optional: ``pip install fp8ref[engines]``);
their contents are only data (fp8ref runs nothing from them).

Under fp8ref's own rule (``profile="fp8ref"``) an element fp8ref refuses to encode (NaN, and Inf
without saturation, into FP4) is left out of the suite and listed; under ``profile="onnx"``
(fp8ref.profiles) every element stays.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import GoldenError
from ..io.files import read_bytes
from ..profiles import PROFILES
from ..rounding import round_to

# ONNX TensorProto.DataType -> (name, bytes per element; 0: two per byte)
_TYPES = {1: ("float32", 4), 10: ("float16", 2), 16: ("bfloat16", 2), 11: ("float64", 8),
          17: ("float8_e4m3fn", 1), 18: ("float8_e4m3fnuz", 1), 19: ("float8_e5m2", 1),
          20: ("float8_e5m2fnuz", 1), 24: ("float8_e8m0fnu", 1), 23: ("float4_e2m1fn", 0)}
FLOATS = ("float32", "float16", "bfloat16", "float64")
CODED = ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn")
_BITS = {"float32": np.uint32, "float16": np.uint16, "bfloat16": np.uint16, "float64": np.uint64}
# Cast round_mode (E8M0 only; default "up") -> fp8ref rounding
_ROUND_MODES = {"up": "rup", "down": "rtz", "nearest": "rna"}
MAX_MODEL_BYTES = 1 << 20
MAX_TENSOR_BYTES = 1 << 24


@dataclass
class Vector:
    """One data set of a node test: an encode or decode case with its literal inputs and ONNX's outputs."""

    test: str
    data_set: str
    op: str                       # encode | decode
    format: str
    dtype: str                    # encode: the input dtype; decode: the output dtype ONNX wrote
    saturate: bool = True
    rounding: str = "rne"
    bits: np.ndarray = field(default=None)       # encode: input bit patterns; decode: codes
    expected: np.ndarray = field(default=None)   # encode: codes; decode: float32 values
    # elements left out of the case: (index, input bits or code, why, whether ONNX's output is right: None
    # where fp8ref refuses the input)
    dropped: list = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{self.test}.{self.data_set}".replace("test_data_set_", "ds")


def _onnx():
    try:
        import onnx
    except ImportError:
        raise GoldenError("golden import onnx-node needs the onnx package to read .onnx and .pb files "
                          "(pip install 'fp8ref[engines]')") from None
    return onnx


def _parse(cls, path: Path, limit: int):
    data = read_bytes(path, error=GoldenError, limit=limit)
    try:
        return cls.FromString(data)
    except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError and friends: a damaged file
        raise GoldenError(f"{path}: not a valid {cls.__name__} ({type(exc).__name__}: {exc})") from None


def _array(t, path: Path, want_type: int, want_name: str) -> np.ndarray:
    """The tensor's elements as raw bit patterns (uint8 codes, or the float type's unsigned ints),
    checked against the type and name the graph declares."""
    if t.name != want_name:
        raise GoldenError(f"{path}: tensor name {t.name!r} does not match the graph's {want_name!r}")
    if t.data_type != want_type:
        raise GoldenError(f"{path}: element type {t.data_type} does not match the graph's {want_type} "
                          f"for {want_name!r}")
    name, size = _TYPES[t.data_type]
    n = 1
    for d in t.dims:
        if d < 0:
            raise GoldenError(f"{path}: negative dimension in {list(t.dims)}")
        n *= d
    if t.HasField("raw_data") or not any(len(getattr(t, f)) for f in ("float_data", "double_data", "int32_data")):
        raw = t.raw_data
        need = (n + 1) // 2 if size == 0 else n * size
        if len(raw) != need:
            raise GoldenError(f"{path}: {want_name!r} holds {len(raw)} bytes of raw data; shape {list(t.dims)} of "
                              f"{name} needs {need} (truncated or padded)")
        if size == 0:  # FP4: two codes a byte, the first in the low nibble
            b = np.frombuffer(raw, np.uint8)
            return np.stack([b & 0x0F, b >> 4], axis=-1).reshape(-1)[:n]
        return np.frombuffer(raw, np.uint8 if size == 1 else np.dtype(_BITS[name]).newbyteorder("<")).astype(
            np.uint8 if size == 1 else _BITS[name])
    if name == "float32" and len(t.float_data) == n:
        return np.array(t.float_data, np.float32).view(np.uint32)
    if name == "float64" and len(t.double_data) == n:
        return np.array(t.double_data, np.float64).view(np.uint64)
    if name not in ("float32", "float64") and len(t.int32_data) in (n, (n + 1) // 2 if size == 0 else n):
        vals = np.array(t.int32_data, np.int64)
        if size == 0:
            vals = np.stack([vals & 0x0F, vals >> 4], axis=-1).reshape(-1)[:n]
        if (vals < 0).any() or (vals >= (1 << (8 * max(size, 1)))).any():
            raise GoldenError(f"{path}: {want_name!r}: int32_data holds values outside {name}'s bit patterns")
        return vals.astype(np.uint8 if size <= 1 else _BITS[name])
    raise GoldenError(f"{path}: {want_name!r}: the element count does not match shape {list(t.dims)} (truncated?)")


def _graph_io(value_infos, path: Path, what: str) -> list[tuple[str, int]]:
    out = []
    for v in value_infos:
        t = v.type.tensor_type.elem_type if v.type.HasField("tensor_type") else 0
        if t not in _TYPES:
            raise GoldenError(f"{path}: graph {what} {v.name!r} has element type {t}, not a float, float8, E8M0 "
                              "or FP4 tensor type")
        out.append((v.name, t))
    return out


def read_node_test(folder: Path, profile: str = "fp8ref") -> list[Vector]:
    """The vectors of one node-test folder (GoldenError for anything not supported or damaged)."""
    from .. import codec

    onnx = _onnx()
    model_path = folder / "model.onnx"
    model = _parse(onnx.ModelProto, model_path, MAX_MODEL_BYTES)
    graph = model.graph
    if len(graph.node) != 1 or graph.node[0].op_type not in ("Cast", "CastLike") or graph.node[0].domain:
        ops = [n.op_type for n in graph.node]
        raise GoldenError(f"{model_path}: expected a graph of a single Cast or CastLike node, got {ops}")
    node = graph.node[0]
    inputs = _graph_io(graph.input, model_path, "input")
    outputs = _graph_io(graph.output, model_path, "output")
    want_in = 2 if node.op_type == "CastLike" else 1
    if len(inputs) != want_in or len(outputs) != 1 or list(node.input) != [n for n, _ in inputs] or \
            list(node.output) != [outputs[0][0]]:
        raise GoldenError(f"{model_path}: the node's inputs {list(node.input)} / outputs {list(node.output)} do not "
                          f"match the graph's {[n for n, _ in inputs]} / {[n for n, _ in outputs]}")
    attrs = {a.name: a for a in node.attribute}
    unknown = set(attrs) - {"to", "saturate", "round_mode"}
    if unknown:
        raise GoldenError(f"{model_path}: {node.op_type} attribute(s) {sorted(unknown)} not supported")
    src, dst = _TYPES[inputs[0][1]][0], _TYPES[outputs[0][1]][0]
    if node.op_type == "Cast" and ("to" not in attrs or attrs["to"].i != outputs[0][1]):
        raise GoldenError(f"{model_path}: Cast 'to' does not match the graph's output type {outputs[0][1]}")
    if node.op_type == "CastLike" and inputs[1][1] != outputs[0][1]:
        raise GoldenError(f"{model_path}: CastLike's target input and output types differ")
    if src in FLOATS and dst in CODED:
        op, fmt, dtype = "encode", dst, src
    elif src in CODED and dst in ("float32", "float16", "bfloat16"):
        op, fmt, dtype = "decode", src, dst
    else:
        raise GoldenError(f"{model_path}: {node.op_type} from {src} to {dst} is not an encode or decode fp8ref judges "
                          "(float -> float8/E8M0/FP4, or back)")
    saturate = bool(attrs["saturate"].i) if "saturate" in attrs else True
    mode = attrs["round_mode"].s.decode() if "round_mode" in attrs else "up"
    if mode not in _ROUND_MODES:
        raise GoldenError(f"{model_path}: round_mode {mode!r}: expected one of {sorted(_ROUND_MODES)}")
    rounding = _ROUND_MODES[mode] if fmt == "float8_e8m0fnu" else "rne"
    if fmt == "float4_e2m1fn":
        saturate = True  # ONNX's Cast has no saturate for FP4; it clamps
    sets = sorted(p for p in folder.iterdir() if p.name.startswith("test_data_set_"))
    if not sets:
        raise GoldenError(f"{folder}: no test_data_set_* folder")
    vectors = []
    for ds in sets:
        files = sorted(p.name for p in ds.iterdir())
        want = [f"input_{i}.pb" for i in range(want_in)] + ["output_0.pb"]
        if files != sorted(want):
            raise GoldenError(f"{ds}: expected exactly {want}, found {files}")
        x = _array(_parse(onnx.TensorProto, ds / "input_0.pb", MAX_TENSOR_BYTES), ds / "input_0.pb", *inputs[0][::-1])
        y_t = _parse(onnx.TensorProto, ds / "output_0.pb", MAX_TENSOR_BYTES)
        y = _array(y_t, ds / "output_0.pb", outputs[0][1], outputs[0][0])
        if want_in == 2:  # CastLike's target: only its type matters, but it must be a well-formed tensor
            _array(_parse(onnx.TensorProto, ds / "input_1.pb", MAX_TENSOR_BYTES), ds / "input_1.pb",
                   *inputs[1][::-1])
        if x.size != y.size:
            raise GoldenError(f"{ds}: input has {x.size} elements, output {y.size}")
        v = Vector(folder.name, ds.name, op, fmt, dtype, saturate, rounding)
        if op == "encode":
            v.bits, v.expected = x, y.astype(np.uint8)
            if profile == "fp8ref" and fmt == "float4_e2m1fn":  # what fp8ref refuses to encode
                with np.errstate(invalid="ignore"):
                    wide = _floats(x, dtype)
                bad = np.isnan(wide) | (np.isinf(wide) & (not saturate))
                v.dropped = [(int(i), int(x[i]), f"ONNX gives code 0x{int(y[i]):x}; fp8ref refuses NaN / Inf to FP4 "
                              "(docs/codec.md; --profile onnx keeps it)", None) for i in np.flatnonzero(bad)]
                v.bits, v.expected = x[~bad], v.expected[~bad]
        else:
            vals = _floats(y, dst)
            v.bits, v.expected = x.astype(np.uint8), vals.astype(np.float32)  # float16 / bfloat16 -> float32: exact
            if dst != "float32":  # ONNX's output is decode(code) rounded to dst: judged here where that rounds
                exact = codec.decode(v.bits, fmt).astype(np.float64)
                with np.errstate(invalid="ignore", over="ignore"):
                    rounded = round_to(exact, dst).astype(np.float64)
                    moved = ~np.isnan(exact) & (rounded != exact)
                    same = (rounded == vals) | (np.isnan(rounded) & np.isnan(vals))
                v.dropped = [(int(i), int(v.bits[i]), f"ONNX's {dst} output {vals[i]!r} must be fp8ref's {exact[i]!r} "
                              f"rounded to {dst}, {rounded[i]!r}", bool(same[i])) for i in np.flatnonzero(moved)]
                v.bits, v.expected = v.bits[~moved], v.expected[~moved]
        vectors.append(v)
    return vectors


def _floats(bits: np.ndarray, dtype: str) -> np.ndarray:
    from .values import from_bits

    return np.asarray(from_bits(bits, dtype)).astype(np.float64)


def find_tests(root: Path) -> list[Path]:
    """``root`` itself when it is a node-test folder, else its subfolders that hold a model.onnx."""
    root = Path(root)
    if not root.is_dir():
        raise GoldenError(f"{root}: not a folder (expected an ONNX node-test folder or a folder of them)")
    if (root / "model.onnx").exists():
        return [root]
    tests = sorted(p for p in root.iterdir() if p.is_dir() and (p / "model.onnx").exists())
    if not tests:
        raise GoldenError(f"{root}: no model.onnx in it or in any subfolder")
    return tests


def suite_text(name: str, vectors: list[Vector], profile: str, source: str) -> str:
    """The suite YAML of the vectors: one entry per data set, its inputs as literal hex patterns."""
    if profile not in PROFILES:
        raise GoldenError(f"profile: expected one of {', '.join(PROFILES)}, got {profile!r}")
    lines = [f"# Imported by 'fp8ref golden import onnx-node' from {source}; the inputs are ONNX's own.",
             f"suite: {name}", "description: >-", f"  ONNX backend node tests (Cast / CastLike) from {source}, "
             f"expected outputs by fp8ref's {'ONNX profile' if profile == 'onnx' else 'own rule'}.",
             "seed: 0", "level: 1", "operations:"]
    for v in vectors:
        if not v.bits.size:
            continue
        width = {"float32": 8, "float16": 4, "bfloat16": 4, "float64": 16}.get(v.dtype, 2) if v.op == "encode" else 2
        values = ", ".join(f'"0x{int(b):0{width}x}"' for b in v.bits)
        lines.append(f"  - op: {v.op}")
        lines.append(f"    formats: [{v.format}]")
        if v.op == "encode":
            lines += [f"    rounding: [{v.rounding}]", f"    saturate: [{str(v.saturate).lower()}]",
                      f"    input_dtypes: [{v.dtype}]"]
            if profile != "fp8ref":
                lines.append(f"    profile: {profile}")
        lines += [f"    label: {v.label}", f"    values: [{values}]"]
    return "\n".join(lines) + "\n"


def case_name(v: Vector) -> str:
    """The case the suite names for vector ``v`` (golden.ops.encode's names)."""
    if v.op == "decode":
        return f"decode.{v.format}.{v.label}"
    sat = "sat" if v.saturate else "nosat"
    return f"encode.{v.format}.{v.rounding}.{sat}.{v.dtype}.{v.label}"


def peer_outputs(vectors: list[Vector]) -> dict[str, np.ndarray]:
    """ONNX's expected outputs, named as ``golden check`` reads them (``<case>/codes``, ``<case>/values``)."""
    return {f"{case_name(v)}/{'codes' if v.op == 'encode' else 'values'}": v.expected
            for v in vectors if v.bits.size}
