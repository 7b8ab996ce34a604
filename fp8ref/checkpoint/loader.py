"""``load_checkpoint``: detect the format, validate every quantized layer, return a lazy
``Checkpoint``.

Validation reads headers for structure (names, dtypes, shapes, config/tensor agreement) and,
with ``check_values=True`` (the default), the scale tensors, which are tiny. Weights are read
only when asked for, and their codes are then checked for NaN. Every tensor in the checkpoint
must be accounted for: a layer's weight/scales/bias, a KV-cache scale the config declares, or
a plain unquantized tensor; anything else that looks like quantization data is an error.
"""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np

from ..errors import CheckpointError
from ..io.files import read_json
from ..io.paths import path_arg
from ..io.safetensors import INDEX_NAME, TensorStore, open_store, unpack_codes
from ..limits import MAX_GROUP, shown
from ..quant import QuantArgs, QuantResult, dequantize
from . import base
from .detect import UNQUANTIZED, detect_format
from .expert_names import name_warnings
from .forward import layer_forward
from .layout import (
    BLOCK_SCALED,
    LayerEntry,
    LayerQuant,
    check_global_values,
    check_layer,
    check_scale_values,
    model_dtype,
    nan_count,
    to_scheme,
    weight_scale_dtype,
    weight_shape,
)

# Tensor-name endings that only quantized checkpoints use; unclaimed ones are errors.
QUANT_SUFFIXES = ("weight_scale", "weight_scale_inv", "input_scale", "activation_scale", "weight_zero_point",
                  "input_zero_point", "weight_global_scale", "input_global_scale", "output_scale", "k_scale",
                  "v_scale", "q_scale", "weight_g_idx", "weight_packed", "weight_scale_2")


class QuantizedLayer:
    """One quantized linear layer of a checkpoint; tensors are read on first use."""

    def __init__(self, checkpoint: Checkpoint, entry: LayerEntry):
        self._ckpt = checkpoint
        self.entry = entry
        self.name = entry.name
        self.quant: LayerQuant = entry.quant
        self.producer = entry.producer
        store = checkpoint.store
        fmt = base.get(entry.producer)
        self.scheme = to_scheme(entry.quant, fmt.recipe_of(entry.quant), fmt.scheme_scale_dtype)
        self.tensors = {role: n for role, n in entry.tensors.items() if n in store}
        self.shape = weight_shape(store, entry)

    def __repr__(self) -> str:
        return f"QuantizedLayer({self.name!r}, {self.quant.describe()}, shape={list(self.shape)})"

    @property
    def weight_codes(self) -> np.ndarray:
        """uint8 codes [out, in] (packed FP4 pairs and FP6 quads unpacked); NaN codes are rejected (no producer
        writes them)."""
        return self.read_weight_codes()

    def read_weight_codes(self, *, mapped: bool = False) -> np.ndarray:
        """``weight_codes``; ``mapped``: unpacked codes as a read-only view of the mapped file, not a
        copy (``TensorStore.get``), for one pass over them."""
        name = self.tensors["weight"]
        codes = self._ckpt.store.get(name, mapped=mapped)
        if self.quant.packed:
            codes = unpack_codes(codes, self.quant.weight_fmt, self._ckpt.store.where(name))
        n, idx = nan_count(codes, self.quant.weight_fmt)
        if n:
            raise CheckpointError(f"{self._ckpt.store.where(name)}: {n} NaN codes (first at {list(idx)}: "
                                  f"{int(codes[idx]):#04x}); a quantized weight must be finite")
        return codes

    def read_tensor(self, role: str, *, bf16_bits: bool = False) -> tuple[np.ndarray, str] | None:
        """(the stored tensor of ``role`` as its property gives it, its dtype name), None where the
        layer has none; ``bf16_bits``: a BF16 tensor as its uint16 bit patterns, dtype 'bfloat16'
        (ml_dtypes not imported)."""
        own = getattr(type(self), role, None)
        if isinstance(own, property) and own is not getattr(QuantizedLayer, role, None):
            t = own.fget(self)  # a layer class's own reading of it (e.g. block scales it unswizzles)
            if t is None:
                return None
            t = np.asarray(t)
            return (t.view(np.uint16), "bfloat16") if t.dtype.name == "bfloat16" else (t, t.dtype.name)
        t = self._tensor(role, bf16_bits=bf16_bits)
        if t is None:
            return None
        bf16 = t.dtype == np.uint16 and bf16_bits and self._ckpt.store.info(self.tensors[role]).dtype == "BF16"
        return t, "bfloat16" if bf16 else t.dtype.name

    def _tensor(self, role: str, *, bf16_bits: bool = False) -> np.ndarray | None:
        name = self.tensors.get(role)
        if name is None:
            return None
        if role in ("weight_scale", "input_scale", "weight_global"):
            block = self.quant.weight_strategy in BLOCK_SCALED and role == "weight_scale"
            e8m0 = self._ckpt.store.info(name).dtype == "F8_E8M0"  # hf-fp8 ue8m0 scales
            values = check_scale_values(self._ckpt.store, name, BLOCK_SCALED[self.quant.weight_strategy][2]
                                        if block else "float8_e8m0fnu" if e8m0 else None,
                                        elem_fmt=self.quant.weight_fmt,
                                        model_dtype=weight_scale_dtype(self.quant, role, self._ckpt.dtype),
                                        allow_zero=block and base.get(self.producer).zero_block_scales)
            if role == "weight_global" or (role == "input_scale" and self.quant.input == "nvfp4"):
                check_global_values(self._ckpt.store, name, values, self.quant, weight=role == "weight_global",
                                    dtype=self._ckpt.dtype)
            if block or e8m0:  # E4M3 / E8M0 values are exact in float32
                return values.astype(np.float32)
        return self._ckpt.store.get(name, bf16_bits=bf16_bits)

    @property
    def weight_scale(self) -> np.ndarray:
        """The stored weight scale, in its stored dtype and shape: a dequantization multiplier, or
        for nvfp4/mx the block scales' values as float32 (their bytes: ``weight_scale_codes``)."""
        return self._tensor("weight_scale")

    @property
    def weight_scale_codes(self) -> np.ndarray:
        """The stored bytes of an nvfp4 (E4M3) or mx (E8M0 biased exponent) block scale."""
        return self._ckpt.store.get(self.tensors["weight_scale"]).view(np.uint8)

    @property
    def weight_global(self) -> np.ndarray | None:
        """nvfp4: the stored F32 global weight scale (``quant.global_scale`` says divisor or multiplier)."""
        return self._tensor("weight_global")

    @property
    def input_scale(self) -> np.ndarray | None:
        return self._tensor("input_scale")

    @property
    def bias(self) -> np.ndarray | None:
        return self._tensor("bias")

    @property
    def output_scale(self) -> np.ndarray | None:
        """The stored output (KV-cache) scale of a layer whose producer quantizes its output (Quark k/v_proj)."""
        return self._tensor("output_scale")

    def expanded_scale(self) -> np.ndarray:
        """The weight scale as float64, broadcast to [out, in] (blocks cropped at the edges)."""
        out, inp = self.shape
        s = np.asarray(self.weight_scale).astype(np.float64)
        q = self.quant
        if q.weight_strategy == "tensor":
            return np.full((out, inp), s.reshape(-1)[0])
        if q.weight_strategy == "channel":
            return np.broadcast_to(s.reshape(out, 1), (out, inp))
        if q.weight_strategy in BLOCK_SCALED:  # the block scales only: the nvfp4 global is weight_global
            return np.repeat(s, BLOCK_SCALED[q.weight_strategy][0], axis=1)[:, :inp]
        r, c = q.block
        return np.repeat(np.repeat(s, r, axis=0), c, axis=1)[:out, :inp]

    def dequantize(self, dtype: str = "float32", *, mode: str = "reference") -> np.ndarray:
        """``mode="reference"``: decode(q) * s, computed exactly and rounded once to ``dtype`` (float64,
        float32, bfloat16 or float16): ``fp8ref.quant.dequantize`` of the stored codes and scale.
        ``mode="producer"``: the producer's own dequantization to the model dtype ``dtype`` (bfloat16,
        float16 or float32), with its roundings and its signed zeros: D(fp32(decode(q) * fp32 scale))
        as the compressed-tensors, auto-round and transformers loaders compute it (the -0 codes give
        -0.0), ModelOpt NVFP4's ``NVFP4QTensor.dequantize`` (E2M1 code 0x8 gives +0.0)."""
        if mode not in ("reference", "producer"):
            raise CheckpointError(f"{self.name}.dequantize: mode {mode!r}; expected 'reference' or 'producer'")
        if mode == "producer":
            return self._producer_dequantize(dtype)
        if dtype not in DEQUANTIZE_DTYPES:
            raise CheckpointError(f"{self.name}.dequantize: dtype {dtype!r}; expected one of "
                                  f"{', '.join(DEQUANTIZE_DTYPES)}")
        q, (out, _) = self.quant, self.shape
        s = np.asarray(self.weight_scale).astype(np.float64)
        if q.weight_strategy in BLOCK_SCALED:  # x = decode(q) * s_b (* m or / g), exact, rounded once
            args = QuantArgs(format=q.weight_fmt, granularity=q.weight_strategy)
            g = None if q.global_scale is None else np.asarray(self.weight_global, np.float32).reshape(1)
            stored = QuantResult(self.weight_codes, s, q.weight_fmt, q.weight_strategy, self.producer, args,
                                 "float64", dtype, global_scale=g, global_meaning=q.global_scale or "multiplier")
            return dequantize(stored, dtype=dtype)
        granularity = q.weight_strategy  # tensor, channel or block: quant granularity names
        s = s.reshape(()) if granularity == "tensor" else s.reshape(out, 1) if granularity == "channel" else s
        args = QuantArgs(format=q.weight_fmt, granularity=granularity, block_shape=q.block)
        stored = QuantResult(self.weight_codes, s, q.weight_fmt, granularity, self.producer, args, "float64", dtype)
        return dequantize(stored, dtype=dtype)

    def _producer_dequantize(self, dtype: str) -> np.ndarray:
        from .._arrays import deliver
        from .forward import producer_weight

        if dtype not in ("bfloat16", "float16", "float32"):
            raise CheckpointError(f"{self.name}.dequantize: mode 'producer' gives the model dtype: bfloat16, "
                                  f"float16 or float32, got {dtype!r}")
        fn = base.get(self.producer).producer_dequantize or producer_weight
        return deliver(fn(self, dtype), dtype, False)

    def forward(self, x, **kwargs):
        """What a correct W8A8 backend computes for this layer (see ``fp8ref.checkpoint.forward``)."""
        return layer_forward(self, x, **kwargs)


DEQUANTIZE_DTYPES = ("float64", "float32", "bfloat16", "float16")


class Checkpoint(Mapping):
    """A loaded checkpoint: a read-only mapping of layer name -> ``QuantizedLayer``.

    Attributes: ``path``, ``format`` (compressed-tensors, auto-round, hf-fp8 or unquantized),
    ``config`` (config.json, {} when absent), ``quantization_config``, ``dtype`` (the model
    dtype), ``warnings`` (producer quirks, each with its fix), ``kv_scales`` (name -> tensor
    name), ``unquantized`` (names of the other tensors) and ``store`` (the lazy tensor store).
    """

    def __init__(self, path: Path, fmt: str, config: dict, qc: dict | None, store: TensorStore,
                 entries: list[LayerEntry], kv_scales: dict[str, str], warnings: list[str]):
        self.path = path
        self.format = fmt
        self.config = config
        self.quantization_config = qc
        self.store = store
        self.dtype = model_dtype(config, store)
        self.warnings = warnings
        self.kv_scales = kv_scales
        self._layers = {e.name: (getattr(base.get(e.producer), "layer_class", None) or QuantizedLayer)(self, e)
                        for e in entries}
        claimed = {n for layer in self._layers.values() for n in layer.tensors.values()} | set(kv_scales.values())
        self.unquantized = sorted(n for n in store if n not in claimed)

    def __getitem__(self, name: str) -> QuantizedLayer:
        try:
            return self._layers[name]
        except KeyError:
            raise CheckpointError(f"{self.path}: no quantized layer {name!r} "
                                  f"({len(self._layers)} layers, e.g. {list(self._layers)[:3]})") from None

    def __contains__(self, name: object) -> bool:
        return name in self._layers

    def get(self, name: str, default=None):
        return self._layers.get(name, default)

    def __iter__(self) -> Iterator[str]:
        return iter(self._layers)

    def __len__(self) -> int:
        return len(self._layers)

    def __repr__(self) -> str:
        return f"Checkpoint({str(self.path)!r}, format={self.format!r}, layers={len(self)})"

    def scheme(self, name: str):
        return self[name].scheme

    def dequantize(self, name: str, dtype: str = "float32", *, mode: str = "reference") -> np.ndarray:
        return self[name].dequantize(dtype, mode=mode)

    def tensor(self, name: str) -> np.ndarray:
        """Any tensor by its full name, as stored (float8 as uint8 codes)."""
        return self.store.get(name)

    def validate_values(self) -> None:
        """Read every scale and every weight and check them (NaN codes, bad scales)."""
        for layer in self._layers.values():
            _ = layer.weight_codes, layer.weight_scale, layer.input_scale, layer.weight_global  # reading checks
        for name in self.kv_scales.values():
            check_scale_values(self.store, name)


BESIDE_A_FILE = ("config.json", "quantization_config.json")  # what loading a lone .safetensors file reads too


def files_read(path: str | os.PathLike) -> list[Path]:
    """What loading ``path`` reads: the folder, or the file and the JSON files beside it (outputs
    must not be any of these)."""
    path = Path(path)
    if path.is_dir():
        return [path]
    return [path] + [path.parent / name for name in BESIDE_A_FILE if (path.parent / name).exists()]


def load_checkpoint(path: str | os.PathLike, *, check_values: bool = True, symlinks_out: bool = False) -> Checkpoint:
    """Load an FP8 checkpoint (folder, sharded or not, or a single ``.safetensors`` file).

    ``check_values``: also read and check every scale tensor (finite, > 0). With False only
    headers and JSON files are read; values are checked when first used. ``symlinks_out``: accept
    shard files that are symlinks out of the folder (a Hugging Face cache snapshot); off by default.
    """
    path_arg(path)  # load_checkpoint(5): a typed error, not pathlib's TypeError
    path = Path(path)
    warnings: list[str] = []
    inner = _only_subfolder_checkpoint(path)
    if inner is not None:
        warnings.append(f"{path}: no checkpoint files here; loading its only subfolder holding one, {inner} "
                        f"(auto-round writes OUT/<model>-<scheme>/)")
        path = inner
    store = open_store(path, symlinks_out=symlinks_out)
    folder = path if path.is_dir() else path.parent
    config: dict = {}
    config_path = folder / "config.json"
    where = str(config_path)
    if path.suffix == ".gguf" and not path.is_dir():  # one file, no config.json: its format is its suffix
        config = {"quantization_config": {"quant_method": "gguf"}}
    elif config_path.exists() or config_path.is_symlink():  # a FIFO or device is an error, not "no config"
        loaded = read_json(config_path, "config")
        if not isinstance(loaded, dict):
            raise CheckpointError(f"{config_path}: expected a JSON object, got {type(loaded).__name__}")
        config = loaded
    qc = config.get("quantization_config")
    qc_path = folder / "quantization_config.json"
    if qc is not None and (qc_path.exists() or qc_path.is_symlink()):
        _check_second_copy(read_json(qc_path, "quantization config"), qc, qc_path, config_path)
    if qc is None and (qc_path.exists() or qc_path.is_symlink()):
        qc = read_json(qc_path, "quantization config")
        where = str(qc_path)
        warnings.append(f"{config_path}: no quantization_config; using {qc_path.name}. Fix: copy it into "
                        f"config.json as \"quantization_config\" (transformers and vLLM read only config.json)")
    fmt = detect_format(qc, store, f"{where}: quantization_config")
    if qc is None and fmt != UNQUANTIZED:
        warnings.append(f"{folder}: float8 weights but no quantization_config; layout inferred from tensor "
                        f"names and shapes as {fmt}. Fix: add the producer's quantization_config to config.json")
    where = f"{where}: quantization_config"
    producer = None if fmt == UNQUANTIZED else base.get(fmt)
    entries, kv = ([], {}) if producer is None else producer.layers(qc, store, where, warnings)
    dtype = model_dtype(config, store)
    for entry in entries:  # a format of non-linear layers (gpt-oss's fused experts) brings its own check
        getattr(producer, "check_layer", check_layer)(store, entry, check_values=check_values, dtype=dtype)
    for name in kv.values():
        info = store.info(name)
        if info.dtype not in ("F32", "BF16", "F16"):
            raise CheckpointError(f"{store.where(name)}: {info.dtype} {list(info.shape)}; a KV-cache scale is "
                                  f"a float scalar, [1] or [heads]")
        _check_head_count(store, name, list(info.shape), config)
        if check_values:
            check_scale_values(store, name)
    _check_leftovers(store, entries, kv)
    if producer is not None:
        check_blocks(config, store, str(config_path))
    if check_values and producer is not None:
        producer.validate(store, entries, warnings)
    warnings.extend(name_warnings(config, list(store), str(folder)))
    return Checkpoint(folder if path.is_dir() else path, fmt, config, qc, store, entries, kv, warnings)


def _check_head_count(store, name: str, shape: list[int], config: dict) -> None:
    """A KV-cache (or Q) scale is one value, or one per head: [n], [n, 1, 1] (llm-compressor's
    attn_head) with n the config's KV heads (k, v) or attention heads (q)."""
    if shape in ([], [1]):
        return
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    key = "num_attention_heads" if name.endswith(".q_scale") else "num_key_value_heads"
    n = text.get(key, text.get("num_attention_heads"))
    if not isinstance(n, int) or isinstance(n, bool):
        raise CheckpointError(f"{store.where(name)}: shape {shape}, one scale per head, but config.json has no "
                              f"integer {key} to check it against")
    if shape not in ([n], [n, 1, 1]):
        raise CheckpointError(f"{store.where(name)}: shape {shape}; config.json has {key} {n}, so a per-head "
                              f"scale is [{n}, 1, 1] (or [{n}]); one per tensor is [] or [1]")


def _only_subfolder_checkpoint(path: Path) -> Path | None:
    """The one direct subfolder of ``path`` that holds safetensors files, where ``path`` is a folder
    without any (a producer's output folder with the checkpoint one level down); None otherwise."""
    if not path.is_dir() or path.is_symlink() or any(path.glob("*.safetensors")) or (path / INDEX_NAME).exists():
        return None
    found = [d for d in sorted(itertools.islice(path.iterdir(), 1000))
             if d.is_dir() and not d.is_symlink() and (any(d.glob("*.safetensors")) or (d / INDEX_NAME).exists())]
    return found[0] if len(found) == 1 else None


def _check_second_copy(copy: object, qc: object, qc_path: Path, config_path: Path) -> None:
    """auto-round writes its config twice (config.json and quantization_config.json); loaders read
    one or the other, so two copies that differ make a checkpoint mean two things."""
    if copy == qc:
        return
    if not isinstance(copy, dict) or not isinstance(qc, dict):
        raise CheckpointError(f"{qc_path}: expected a JSON object equal to {config_path.name}'s quantization_config, "
                              f"got {type(copy).__name__}")
    path, here, there = _first_difference(copy, qc)
    raise CheckpointError(f"{qc_path}: {'.'.join(path)}: {here}, but {config_path.name}'s quantization_config "
                          f"{'says ' + there if there != 'missing' else 'does not have it'}; loaders read one copy or "
                          f"the other, so they must agree")


def _side(obj: dict, key) -> str:
    """One side of a difference; an object by its keys as written (repr would double backslashes)."""
    if key not in obj:
        return "missing"
    value = obj[key]
    if isinstance(value, dict):
        return f"an object with keys {', '.join(map(str, list(value)[:5]))}"[:200]
    return shown(value)


def _first_difference(a: object, b: object, path: tuple = ()) -> tuple[tuple, str, str]:
    """The key path (keys as written) where two JSON values first differ, and each side shown."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b), key=str):
            if key not in a or key not in b:
                return path + (str(key),), _side(a, key), _side(b, key)
            if a[key] != b[key]:
                return _first_difference(a[key], b[key], path + (str(key),))
    return path, shown(a), shown(b)


_BLOCK = re.compile(r"(.*?(?:^|\.)(?:layers|h|blocks|block))\.(\d+)\.")


def block_indices(store: TensorStore) -> dict[str, set[int]]:
    """Container (``model.layers``) -> the block indices its tensor names hold."""
    found: dict[str, set[int]] = {}
    for name in store:
        m = _BLOCK.match(name)
        if m and len(m.group(2)) <= 9:  # an index past 10**9 is no block any config can declare
            found.setdefault(m.group(1), set()).add(int(m.group(2)))
    return found


def check_blocks(config: dict, store: TensorStore, where: str) -> None:
    """A quantized checkpoint must hold every decoder block its config declares: an index or a
    shard left out would otherwise load as a smaller model (7 of 14 layers, exit 0). Passes when
    some container of numbered blocks (``model.layers.N.``, ``transformer.h.N.``) has every index
    below ``num_hidden_layers``; extra blocks (multi-token prediction layers) are fine. Nothing is
    allocated in proportion to ``num_hidden_layers``: only the indices the names hold are counted."""
    n = config.get("num_hidden_layers")
    if type(n) is not int or n <= 0:
        return
    if n > MAX_GROUP:
        raise CheckpointError(f"{where}: num_hidden_layers: expected an integer in 1..{MAX_GROUP}, got {shown(n)}")
    below = {c: sorted(i for i in seen if i < n) for c, seen in block_indices(store).items()}
    if any(len(have) == n for have in below.values()):
        return
    best = max(below, key=lambda c: (len(below[c]), c)) if below else None
    have = below[best] if best else []
    held = f"{len(have)} of them ({best}.{_ranges(have)})" if have else "none of them"
    raise CheckpointError(f"{where}: num_hidden_layers is {n}, so the checkpoint should hold {n} blocks of "
                          f"quantized layers; its tensors hold {held}, none for block(s) {_gaps(have, n)}: "
                          f"a shard or index entry is missing")


def _gaps(have: list[int], n: int) -> str:
    """The indices in 0..n-1 missing from sorted ``have``, as ``_ranges`` writes them (first 6 runs),
    found from the runs between held indices, never by listing 0..n-1."""
    runs, start = [], 0
    for v in have + [n]:
        if v > start:
            runs.append(f"{start}" if v - 1 == start else f"{start}-{v - 1}")
        start = v + 1
        if len(runs) > 6:
            break
    return ",".join(runs[:6]) + (",..." if len(runs) > 6 else "")


def _ranges(values: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2,5,7-8' (first 6 runs)."""
    runs, start = [], None
    for i, v in enumerate(values):
        if start is None:
            start = v
        if i + 1 == len(values) or values[i + 1] != v + 1:
            runs.append(f"{start}" if start == v else f"{start}-{v}")
            start = None
    return ",".join(runs[:6]) + (",..." if len(runs) > 6 else "")


def _check_leftovers(store: TensorStore, entries: list[LayerEntry], kv: dict[str, str]) -> None:
    claimed = {n for e in entries for n in e.tensors.values()} | set(kv.values())
    for name in store:
        if name in claimed:
            continue
        info = store.info(name)
        if info.fmt is not None:  # float8/6/4 codes (F64 is a plain float)
            raise CheckpointError(f"{store.where(name)}: {info.dtype} tensor that is not the weight of a "
                                  f"quantized layer the config describes")
        suffix = name.rsplit(".", 1)[-1]
        if suffix in QUANT_SUFFIXES:
            layer = name.rsplit(".", 1)[0]
            raise CheckpointError(f"{store.where(name)}: unexpected tensor: no quantized layer or config entry "
                                  f"uses a {suffix!r} for {layer!r}")
