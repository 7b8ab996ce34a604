"""GGUF checkpoints (llama.cpp): ``GGML_TYPE_MXFP4`` and ``GGML_TYPE_NVFP4`` tensors read, verified
and written.

A ``.gguf`` file opens as a ``TensorStore`` (``fp8ref.io.gguf``): each MXFP4 tensor ``M.weight``
[..., out, in] is one MX layer ``M`` of [rows, in] (leading dimensions, gpt-oss's experts, folded
into the rows) with the views ``M.weight`` (E2M1 pairs) and ``M.weight_scale`` (E8M0 bytes); F32,
F16 and BF16 tensors are plain tensors. Tensors of the other GGML types (Q4_K, Q8_0, ...) are
listed by ``inspect`` as not read and compared by nobody.

llama.cpp's quantizer is the recipe ``ggml-mxfp4`` (e = floorf(log2f(amax)) - 2 + 127 in float32,
elements to the nearest doubled E2M1 value, ties to the smaller magnitude, never -0); its
dequantization kvalues_mxfp4[q] * 2^(e - 128) is decode(q) * 2^(e - 127), exact in float32, which
is what fp8ref's MX dequantize gives.

NVFP4 tensors are NVFP4 layers with a multiplier global scale of 1 (``M.weight_global``, a view:
GGUF stores none) and E4M3 block scales per 16 (the UE4M3 bytes; ggml's decoder ignores bit 7 and
reads 0x7F as 0, which fp8ref refuses as a negative or NaN scale). llama.cpp's quantizer is the
recipe ``ggml-nvfp4`` (s = ggml_fp32_to_ue4m3(amax/6), elements by the smallest float32 error);
``dequantize(mode="producer")`` is llama.cpp's kvalues_mxfp4[q] * d (E2M1 0x8 gives +0.0).

``export`` writes a GGUF v3 file whose 2-D (or 3-D expert)
weights the spec quantizes to MXFP4 and whose other tensors are copied (F32/F16/BF16); the recipe
is recorded in the key ``fp8ref_recipes`` (the safetensors formats' ``__metadata__`` record).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ..errors import CheckpointError, Fp8RefError
from ..io.gguf import READ_QUANTIZED, RECIPE_KEY, GgufFile, dumps, mxfp4_blocks, nvfp4_blocks
from ..io.safetensors import TensorStore
from . import layout
from .base import Defaults, ScaleDecl, register
from .layout import LayerEntry, LayerQuant, check_scale_values

NAME = "gguf"
QUANT = LayerQuant("mx", None, None, weight_fmt="float4_e2m1fn")  # weight-only MXFP4
NV_QUANT = LayerQuant("nvfp4", None, None, weight_fmt="float4_e2m1fn", global_scale="multiplier")
RECIPE, NV_RECIPE = "ggml-mxfp4", "ggml-nvfp4"
MX, NV = 32, 64  # elements per GGML block
# GGML type -> (its LayerQuant, llama.cpp's recipe, elements per block)
TYPES = {"MXFP4": (QUANT, RECIPE, MX), "NVFP4": (NV_QUANT, NV_RECIPE, NV)}
_DTYPE_TO_GGML = {"F32": "F32", "F16": "F16", "BF16": "BF16"}


def is_gguf(path: str | os.PathLike) -> bool:
    return Path(path).suffix == ".gguf" and not Path(path).is_dir()


def _output_file(output: str | os.PathLike, force: bool) -> Path:
    """The GGUF file to write, checked before any work: a GGUF is recognised by its suffix alone (it
    has no config.json), so a file written under another name could not be read back."""
    out = Path(output)
    if not is_gguf(out):
        raise CheckpointError(f"{out}: a GGUF is one file named *.gguf (fp8ref and llama.cpp know it by that "
                              f"suffix); name the output {out.name}.gguf")
    if out.exists() and not force:
        raise CheckpointError(f"{out}: exists; give --force to replace it")
    return out


def gguf_files(store: TensorStore) -> list[GgufFile]:
    return [f for f in store.files.values() if isinstance(f, GgufFile)]


def layers(qc, store: TensorStore, where: str, warnings: list[str]):
    files = gguf_files(store)
    if not files:
        raise CheckpointError(f"{store.root}: quant_method 'gguf' names a .gguf file; this is a safetensors checkpoint")
    entries = []
    for f in files:
        for t in f.gguf_tensors.values():
            if t.type_name not in READ_QUANTIZED:
                continue
            if not t.name.endswith(".weight"):
                raise CheckpointError(f"{f.path}: tensor {t.name!r}: an {t.type_name} tensor whose name does not "
                                      f"end in '.weight'; fp8ref reads {t.type_name} weights only")
            module = t.name[: -len(".weight")]
            tensors = {"weight": t.name, "weight_scale": f"{t.name}_scale"}
            if t.type_name == "NVFP4":
                tensors["weight_global"] = f"{t.name}_global"
            if f"{module}.bias" in store:
                tensors["bias"] = f"{module}.bias"
            entries.append(LayerEntry(module, TYPES[t.type_name][0], tensors, NAME))
        skipped = f.unread()
        if skipped:
            warnings.append(f"{f.path}: {len(skipped)} tensors of GGML types fp8ref does not read are left out "
                            f"(first: {skipped[0]})")
    return entries, {}


def original_weight(layer, store: TensorStore) -> np.ndarray:
    """The original of ``layer``: ``M.weight`` of the original (a float GGUF or safetensors file with
    the GGUF's tensor names), leading dimensions folded into the rows as the layer holds them."""
    key = f"{layer.name}.weight"
    if key not in store:
        raise CheckpointError(f"{store.root}: no tensor {key!r} for the quantized layer {layer.name!r} (the "
                              f"original must use the GGUF's tensor names: a float .gguf from convert_hf_to_gguf)")
    w = np.asarray(store.get(key))
    if w.ndim < 2 or (int(np.prod(w.shape[:-1])), w.shape[-1]) != tuple(layer.shape):
        raise CheckpointError(f"{store.where(key)}: shape {list(w.shape)} does not fold to the layer's "
                              f"{list(layer.shape)}")
    return w.reshape(layer.shape)


# --- writing ---------------------------------------------------------------------------------

def _source(source) -> tuple[TensorStore, dict]:
    from ..io.safetensors import open_store

    store = open_store(source)
    kv = {}
    for f in gguf_files(store):
        if f.unread():
            raise CheckpointError(f"{f.path}: holds tensors of GGML types fp8ref does not read ({f.unread()[0]}); "
                                  f"export from a float (F32/F16/BF16) GGUF")
        kv = {k: v for k, v in f.kv.items() if k not in ("general.alignment", RECIPE_KEY)}
    return store, kv


def quantize_weight(w: np.ndarray, recipe: str, gtype: str = "MXFP4") -> tuple[np.ndarray, np.ndarray]:
    """GGML ``gtype`` (MXFP4 or NVFP4) bytes of ``w`` [..., in] by ``recipe``: (blocks [..., in/32*17]
    or [..., in/64*36], the recipe's result)."""
    from ..io.safetensors import pack_nibbles
    from ..quant import QuantArgs, quantize

    rows = np.asarray(w).reshape(-1, w.shape[-1])
    granularity = TYPES[gtype][0].weight_strategy
    res = quantize(rows, QuantArgs(format="float4_e2m1fn", granularity=granularity), recipe=recipe)
    if gtype == "NVFP4" and not np.array_equal(np.asarray(res.global_scale).reshape(-1), [1.0]):
        raise CheckpointError(f"recipe {recipe!r} makes an NVFP4 global scale; a GGUF NVFP4 tensor has none "
                              f"(use ggml-nvfp4)")
    pack = mxfp4_blocks if gtype == "MXFP4" else nvfp4_blocks
    blocks = pack(pack_nibbles(np.asarray(res.codes)), np.asarray(res.scale_codes, np.uint8))
    return blocks.reshape(*w.shape[:-1], -1), res


def export(source: str | os.PathLike, output: str | os.PathLike, spec, *, recipe: str | None = None,
           force: bool = False, symlinks_out: bool = False) -> Path:
    """Quantize the ``.weight`` tensors of ``source`` (a float GGUF, or safetensors) that ``spec`` gives a
    weight-only MXFP4 scheme into the GGUF file ``output``; every other tensor is copied as it is."""
    import json

    from ..io.atomic import atomic_file
    from .layout import from_scheme
    from .plan import layer_config

    out = _output_file(output, force)
    store, kv = _source(source)
    cfg = layer_config(spec)
    candidates = [n[: -len(".weight")] for n in store
                  if n.endswith(".weight") and store.info(n).dtype in _DTYPE_TO_GGML and len(store.info(n).shape) >= 2]
    plans: dict[str, tuple[str, str]] = {}  # weight -> (GGML type, recipe)
    for module, scheme in cfg.resolve_all(candidates).items():
        if scheme is None:
            continue
        where = f"{cfg.source}: layer {module!r}"
        quant = from_scheme(scheme, where, "multiplier")
        gtype = next((g for g, (q, _, _) in TYPES.items() if q == quant), None)
        if gtype is None:
            raise CheckpointError(f"{where}: GGUF holds weight-only MXFP4 (data_type mx_fp, 4 bits, act_bits 16) "
                                  f"or weight-only NVFP4 (nv_fp, group_size 16); got {scheme.to_dict()}")
        block = TYPES[gtype][2]
        if store.info(f"{module}.weight").shape[-1] % block:
            raise CheckpointError(f"{store.where(module + '.weight')}: the last dimension is not a multiple of "
                                  f"{block} (a GGML {gtype} block)")
        plans[f"{module}.weight"] = (gtype, recipe or scheme.recipe)
    if not plans:
        raise CheckpointError(f"{cfg.source}: the spec quantizes none of the {len(candidates)} weights of {source}")
    by_recipe: dict[str, list[str]] = {}
    for name, (_, r) in sorted(plans.items()):
        by_recipe.setdefault(r, []).append(name[: -len(".weight")])
    kv[RECIPE_KEY] = json.dumps(by_recipe, sort_keys=True, separators=(",", ":"))
    tensors = []
    for name in store:
        info = store.info(name)
        if name in plans:
            gtype, r = plans[name]
            try:
                blocks, _ = quantize_weight(np.asarray(store.get(name), np.float32), r, gtype)
            except Fp8RefError as exc:
                raise CheckpointError(f"{store.where(name)}: cannot quantize: {exc}") from None
            tensors.append((name, gtype, info.shape, blocks))
        elif info.dtype in _DTYPE_TO_GGML:
            tensors.append((name, _DTYPE_TO_GGML[info.dtype], info.shape, store.file_of(name).read_bytes(name)))
        else:
            raise CheckpointError(f"{store.where(name)}: dtype {info.dtype}; a GGUF holds F32, F16, BF16, MXFP4 "
                                  f"or NVFP4")
    data = dumps(kv, tensors)
    with atomic_file(out) as tmp:
        tmp.write_bytes(data)
    return out


def rewrite(checkpoint: str | os.PathLike, output: str | os.PathLike, *, force: bool = False) -> Path:
    """Write a loaded GGUF checkpoint again from what fp8ref read (key-values, float tensors, MXFP4
    codes and scale bytes): byte-identical to a file fp8ref wrote."""
    from ..io.atomic import atomic_file

    out = _output_file(output, force)
    f = GgufFile(checkpoint)
    if f.unread():
        raise CheckpointError(f"{f.path}: holds tensors of GGML types fp8ref does not read ({f.unread()[0]})")
    tensors = []
    for t in f.gguf_tensors.values():
        if t.type_name in READ_QUANTIZED:
            pack = mxfp4_blocks if t.type_name == "MXFP4" else nvfp4_blocks
            blocks = pack(f.get(t.name), f.get(f"{t.name}_scale"))
            tensors.append((t.name, t.type_name, t.shape, blocks))
        else:
            tensors.append((t.name, t.type_name, t.shape, f.get(t.name)))
    kv = {k: v for k, v in f.kv.items() if k != "general.alignment"}
    align = f.kv.get("general.alignment", 32)
    if "general.alignment" in f.kv:
        kv = {"general.alignment": align, **kv}
    with atomic_file(out) as tmp:
        tmp.write_bytes(dumps(kv, tensors, align))
    return out


# --- the format --------------------------------------------------------------------------------

def cannot_express(quant: LayerQuant) -> str | None:
    if quant not in (QUANT, NV_QUANT):
        return (f"GGUF's MXFP4 and NVFP4 are weight-only (mx or nvfp4 with no global scale, E2M1, no input "
                f"quantization); got {quant.describe()}")
    return None


def check_layer(store: TensorStore, entry: LayerEntry, *, check_values: bool, dtype: str | None = None) -> None:
    """The loader's per-layer check (structure was checked when the views were made): the block scale
    bytes; an NVFP4 scale byte 0 is a zero scale (an all-zero block), 0x7F (E4M3 NaN, which llama.cpp
    reads as 0) and bytes >= 0x80 (negative) are refused with the tensor and index named."""
    layout.check_layer(store, entry, check_values=False, dtype=dtype)  # presence, dtypes, shapes, bias
    if check_values:
        fmt = "float8_e4m3fn" if entry.quant == NV_QUANT else "float8_e8m0fnu"
        check_scale_values(store, entry.tensors["weight_scale"], fmt, allow_zero=entry.quant == NV_QUANT)


def producer_dequantize(layer, dtype: str) -> np.ndarray:
    """llama.cpp's dequantization to float32 (``dequantize_row_mxfp4`` / ``_nvfp4``: kvalues_mxfp4[q] times
    the half scale, so E2M1 code 0x8 gives +0.0), rounded once to ``dtype``."""
    from ..microscaling import ggml_nvfp4_dequantize
    from ..rounding import round_to

    codes = np.asarray(layer.weight_codes, np.uint8)  # unpacked E2M1 codes
    if layer.quant == NV_QUANT:
        w = ggml_nvfp4_dequantize(codes, np.asarray(layer.weight_scale_codes, np.uint8))
    else:
        kvalues = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.float32)
        e = np.asarray(layer.weight_scale_codes, np.int32)
        half = np.ldexp(np.float32(1), e - 128).astype(np.float32)  # ggml_e8m0_to_fp32_half, exact
        w = (kvalues[codes] * np.repeat(half, MX, axis=-1)).astype(np.float32)
    return round_to(w, dtype)


def tensor_plan(name: str, quant: LayerQuant, out: int, inp: int, dtype: str):
    raise CheckpointError(f"{NAME}: {name}: a GGUF is one file written by fp8ref quantize --format gguf "
                          f"(OUT.gguf), not a safetensors folder")


class Gguf(Defaults):
    name = NAME
    scales = (ScaleDecl("mx", "weight (GGML_TYPE_MXFP4 block byte 0)", "E8M0 exponent", "U8 in 17-byte blocks",
                        "[out, in/32]", "32 (fixed)", "block = E8M0 byte + 16 bytes: element j low nibble, j+16 "
                        "high nibble; llama.cpp's kvalues (doubled E2M1) x 2^(e-128)"),
              ScaleDecl("nvfp4", "weight (GGML_TYPE_NVFP4 block bytes 0-3)", "multiplier",
                        "UE4M3 in 36-byte blocks", "[out, in/16]", "16 (fixed; 64 per block)",
                        "no global scale; block = 4 scale bytes + 4 x 8 bytes: per 16, element j low nibble, "
                        "j+8 high nibble; llama.cpp's kvalues x e4m3(s)/2 (0x7F read as 0)"))
    methods = (NAME,)  # implied by the .gguf suffix (a GGUF has no config.json)
    detect_rank = 5
    scheme_scale_dtype = "float32"
    scales_follow_recipe = False
    kv_refusal = "a GGUF has no KV-cache scale tensors"
    known_recipes = (RECIPE, NV_RECIPE, "fp8ref")

    def detect(self, store: TensorStore, fp8_layers: list[str]) -> bool:
        return False

    def recipe_of(self, quant: LayerQuant) -> str:
        return NV_RECIPE if quant == NV_QUANT else RECIPE

    def quantization_config(self, layers: dict, unquantized: list[str], kv: bool = False) -> dict:
        raise CheckpointError(f"{NAME}: a GGUF has no quantization_config; write it with fp8ref quantize "
                              f"--format gguf")

    layers = staticmethod(layers)
    original_weight = staticmethod(original_weight)
    cannot_express = staticmethod(cannot_express)
    producer_dequantize = staticmethod(producer_dequantize)
    check_layer = staticmethod(check_layer)
    zero_block_scales = True
    tensor_plan = staticmethod(tensor_plan)
    export = staticmethod(export)


register(Gguf())
