"""``export_checkpoint``: quantize an original safetensors checkpoint into a producer's format.

One pass, one tensor at a time: for every output file the header is laid out first from the
plan (names, dtypes and shapes follow from the source headers and the schemes), then each
tensor is read, quantized or copied byte for byte, written at its offset and dropped. Peak
memory is therefore a few times the largest tensor. Everything goes into a temporary folder
that is renamed over the destination only when complete; the source is never written.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from math import prod
from pathlib import Path

import numpy as np

from ..errors import CheckpointError, Fp8RefError, InputTypeError, RecipeError
from ..io.atomic import atomic_folder, atomic_write_text, is_inside
from ..io.files import read_json
from ..io.paths import path_arg
from ..io.safetensors import INDEX_NAME, SafetensorsWriter, TensorSpec, TensorStore, open_store, pack_nibbles
from ..limits import shown
from ..recipes import store_dtype
from . import base
from .layout import BLOCK_SCALED, D_DTYPES, LayerQuant, from_scheme, nan_count

_EMBEDDING = ("embed", "wte", "wpe")
_STORE = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "float8_e8m0fnu": "F8_E8M0"}


@dataclass
class LayerPlan:
    name: str
    scheme: object  # QuantizationScheme
    quant: LayerQuant
    recipe: str
    dtype: str  # the source weight's dtype (the model dtype D of this layer)
    tensors: list[tuple[str, str, str, tuple]]  # (role, name, safetensors dtype, shape)
    amax: float | None = None
    global_amax: float | None = None  # nvfp4: the weight amax of the global scale (its fused group's max)


def _layer_config(spec):
    from ..spec import LayerConfig, load_spec, load_spec_dict

    if isinstance(spec, LayerConfig):
        return spec
    if isinstance(spec, Mapping):
        return load_spec_dict(dict(spec))
    if isinstance(spec, (str, os.PathLike)):
        return load_spec(spec)
    raise CheckpointError(f"spec: expected a YAML path, a mapping or a LayerConfig, got {type(spec).__name__}")


CALIBRATION_FORMAT = "fp8ref-calibration/1"
_CALIBRATION_KEYS = ("format", "holds", "fp8ref_version", "input_amax", "kv_amax")
_NOT_CALIBRATION = (f"not an fp8ref calibration file (expected a JSON object with \"format\": "
                    f"{CALIBRATION_FORMAT!r} and \"holds\": \"amax\"); write it with "
                    "fp8ref.write_calibration(path, amax), from observe_linear_inputs' states or amax values. "
                    "calibrate_input_scales returns scales, not amax: an input scale from them would be "
                    "448x too small for float8_e4m3fn")


def _amax_number(value, where: str) -> float:
    """One activation amax: a finite number >= 0 (an AmaxState of tensor granularity, a one-element
    array or a Python number)."""
    from ..calibrate import AmaxState

    if isinstance(value, AmaxState):
        if value.amax is None:
            raise CheckpointError(f"{where}: this layer saw no input (its AmaxState has no amax)")
        value = value.amax
    if isinstance(value, np.ndarray) or isinstance(value, np.generic):
        if np.size(value) != 1 or not np.issubdtype(np.asarray(value).dtype, np.number):
            raise CheckpointError(f"{where}: an activation amax is one number (tensor granularity), got an array "
                                  f"of shape {list(np.shape(value))}")
        value = np.asarray(value).reshape(-1)[0].item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CheckpointError(f"{where}: expected a number (activation amax), got {type(value).__name__}")
    try:
        amax = float(value)
    except OverflowError:  # a 5,000-digit integer
        raise CheckpointError(f"{where}: expected a number (activation amax), got {shown(value)}") from None
    if not np.isfinite(amax) or amax < 0:
        raise CheckpointError(f"{where}: activation amax must be finite and >= 0, got {amax!r}")
    return amax


def refuse_scales(amax, where: str) -> Mapping:
    """``amax`` (a mapping of name -> activation amax) as it is, or one CheckpointError when it is,
    or holds, scales from ``calibrate_input_scales``/``finalize``: stored as amax they would give
    input scales 448x too small (float8_e4m3fn)."""
    from ..calibrate import CalibratedScales, DequantScale

    if isinstance(amax, CalibratedScales):
        raise CheckpointError(f"{where}: these are calibrate_input_scales' scales (amax / format max), not amax; "
                              "pass their .amax (calibrate_input_scales(...).amax), the amax they came from")
    if not isinstance(amax, Mapping):
        raise CheckpointError(f"{where}: expected a mapping of name -> activation amax, got {type(amax).__name__}")
    for k, v in amax.items():
        if isinstance(v, DequantScale):
            raise CheckpointError(f"{where}[{k!r}]: a scale (amax / format max, from finalize or "
                                  "calibrate_input_scales), not an amax; pass the AmaxState that "
                                  "observe_linear_inputs returns (or calibrate_input_scales(...).amax[layer])")
    return amax


def amax_values(amax: Mapping, where: str) -> dict[str, float]:
    """name -> activation amax as numbers (see ``_amax_number``), or one CheckpointError; scales are
    refused (``refuse_scales``)."""
    return {str(k): _amax_number(v, f"{where}[{k!r}]") for k, v in refuse_scales(amax, where).items()}


def write_calibration(path: str | os.PathLike, input_amax: Mapping, *, kv_amax: Mapping | None = None) -> Path:
    """Write the calibration file ``export_checkpoint``/``fp8ref quantize --calibration`` read: per
    layer the activation amax (numbers, one-element arrays, or the ``AmaxState`` values
    ``observe_linear_inputs`` returns), and per attention module the KV-cache amax under
    ``ATTN.k_scale``/``ATTN.v_scale`` or ``ATTN.{k,v}_proj.output_amax``. The file says what it
    holds (amax, with this fp8ref's version), so a file of scales is never taken for one. Scales
    (``calibrate_input_scales``' result, ``finalize``'s ``DequantScale``) are refused: pass
    ``calibrate_input_scales(...).amax``."""
    from .. import __version__
    from ..io.files import write_bytes

    path = path_arg(path)
    layers = amax_values(input_amax, f"{path}: input_amax")
    kv = amax_values(kv_amax or {}, f"{path}: kv_amax")
    _check_kv_split(path, layers, kv)
    doc = {"format": CALIBRATION_FORMAT, "holds": "amax", "fp8ref_version": __version__,
           "input_amax": dict(sorted(layers.items())), "kv_amax": dict(sorted(kv.items()))}
    write_bytes(path, (json.dumps(doc, indent=1) + "\n").encode())
    return path


def _check_kv_split(where, layers: Mapping, kv: Mapping) -> None:
    not_kv = [k for k in kv if k in split_calibration({k: kv[k]}, str(where))[0]]
    if not_kv:
        raise CheckpointError(f"{where}: kv_amax[{not_kv[0]!r}]: expected a KV-cache key (ATTN.k_scale, ATTN.v_scale, "
                              "ATTN.k_proj.output_amax or ATTN.v_proj.output_amax)")
    is_kv = [k for k in layers if not split_calibration({k: layers[k]}, str(where))[0]]
    if is_kv:
        raise CheckpointError(f"{where}: input_amax[{is_kv[0]!r}]: a KV-cache key; put it under kv_amax")


def load_calibration(path: str | os.PathLike) -> dict[str, float]:
    """The activation amax (and KV-cache amax) of a file ``write_calibration`` wrote: JSON with
    ``"format": "fp8ref-calibration/1"``, ``"holds": "amax"``, ``"input_amax"`` and ``"kv_amax"``, or
    safetensors whose metadata has the same ``format`` and ``holds`` (one-element tensors named
    ``layer`` or a KV-cache key). Anything else, a bare ``{layer: value}`` object included, is refused:
    nothing says whether it holds amax or scales."""
    path = path_arg(path)
    if path.suffix == ".safetensors":
        store = open_store(path)
        meta = next(iter(store.files.values())).metadata or {}
        if meta.get("format") != CALIBRATION_FORMAT or meta.get("holds") != "amax":
            raise CheckpointError(f"{path}: safetensors metadata {dict(meta)!r:.120}: {_NOT_CALIBRATION}")
        raw = {}
        for name in store:
            values = np.asarray(store.get(name)).astype(np.float64).reshape(-1)
            if values.size != 1:
                raise CheckpointError(f"{store.where(name)}: an activation amax is one number, got shape "
                                      f"{list(store.info(name).shape)}")
            raw[name] = _amax_number(float(values[0]), store.where(name))
        return raw
    data = read_json(path, "calibration file")
    if not isinstance(data, dict) or data.get("format") != CALIBRATION_FORMAT:
        raise CheckpointError(f"{path}: {_NOT_CALIBRATION}")
    unknown = sorted(set(data) - set(_CALIBRATION_KEYS))
    if unknown:
        raise CheckpointError(f"{path}: unknown key {unknown[0]!r}; a calibration file has {list(_CALIBRATION_KEYS)}")
    if data.get("holds") != "amax":
        raise CheckpointError(f"{path}: \"holds\": expected \"amax\", got {shown(data.get('holds'))}; "
                              "fp8ref computes scales from amax itself (the recipe decides how)")
    sections = {}
    for key, required in (("input_amax", True), ("kv_amax", False)):
        value = data.get(key, None if required else {})
        if not isinstance(value, dict):
            raise CheckpointError(f"{path}: \"{key}\": expected an object of name -> amax, got {shown(value)}")
        sections[key] = {k: _amax_number(v, f"{path}: {key}[{k!r}]") for k, v in value.items()}
    _check_kv_split(path, sections["input_amax"], sections["kv_amax"])
    return {**sections["input_amax"], **sections["kv_amax"]}


# Calibration keys that carry the amax of an attention module's cached keys/values: the
# compressed-tensors tensor names, or the k/v projection's output amax (the ``.input_amax`` convention
# applied to outputs; what a forward hook on k_proj/v_proj records). vLLM and compressed-tensors
# quantize K after RoPE, so the amax of the rotated keys is the faithful value for ``k``.
KV_KEYS = (("k_scale", "k"), ("v_scale", "v"), ("k_proj.output_amax", "k"), ("v_proj.output_amax", "v"))

def split_calibration(calibration: Mapping[str, float], where: str = "calibration"
                      ) -> tuple[dict[str, float], dict[str, dict[str, tuple[str, float]]]]:
    """(layer -> input amax, attention module -> {"k"|"v": (calibration key, amax)})."""
    layers: dict[str, float] = {}
    kv: dict[str, dict[str, tuple[str, float]]] = {}
    for key, value in calibration.items():
        if not isinstance(key, str):
            raise CheckpointError(f"{where}: key {key!r}: expected a layer or KV-cache name (str)")
        match = next(((key[: -len(suffix) - 1], which) for suffix, which in KV_KEYS
                      if key.endswith("." + suffix)), None)
        if match is None:
            layers[key] = value
            continue
        if (isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating))
                or (type(value) is int and abs(value) > 2**1024)):
            raise CheckpointError(f"{where}: {key!r}: expected a number (KV-cache amax), got {shown(value)}")
        amax = float(value)
        if not np.isfinite(amax) or amax < 0:
            raise CheckpointError(f"{where}: {key!r}: a KV-cache amax must be a finite number >= 0, got {value!r:.80}")
        attn, which = match
        old = kv.setdefault(attn, {}).setdefault(which, (key, amax))
        if old[1] != amax:
            raise CheckpointError(f"{where}: {old[0]!r} = {old[1]!r} and {key!r} = {amax!r} give the same "
                                  f"KV-cache amax ({attn}.{which}_scale) two values")
    return layers, kv


@dataclass
class KVPlan:
    name: str  # the format's name for <attn>'s K or V scale (compressed-tensors: <attn>.k_scale)
    file: str  # the output file: the one holding <attn>.k_proj.weight (or v_proj)
    dtype: str  # safetensors dtype
    value: np.ndarray  # the stored tensor, in the format's KV shape


def plan_kv(store: TensorStore, kv: dict[str, dict[str, tuple[str, float]]], fmt: str,
            plans: Mapping[str, LayerPlan], *, recipe: str | None = None, where: str = "calibration"
            ) -> list[KVPlan]:
    """KV-cache scales for ``fmt`` from per-attention-module amax; every check runs before writing.

    Scale = the recipe's formula on the amax: the format's own KV rule (``kv_recipe``: ModelOpt
    fp32(fp32(amax)/448), Quark D(fp32(amax)/448)), else the ``recipe=`` override, else the recipe of
    the module's k_proj/v_proj layer, else compressed-tensors'; stored in the format's KV dtype
    (``kv_store``; None: the recipe's, the projection's dtype or float32), name and shape
    (``kv_name``, ``kv_shape``); with ``kv_shared`` (Quark) K and V both hold the larger scale.
    """
    from ..formats import FORMATS as FLOAT_FORMATS
    from ..recipes import compute_scale
    from ..registry import get_recipe

    if not kv:
        return []
    module = base.get(fmt)
    first = next(iter(kv.values()))
    example = next(iter(first.values()))[0]
    if module.kv_refusal:
        raise CheckpointError(f"{where}: KV-cache amax for {len(kv)} attention module(s) (e.g. {example!r}), but "
                              f"the {fmt} format cannot express KV-cache scales: {module.kv_refusal}. Export to "
                              f"compressed-tensors, modelopt or quark, or drop the KV-cache entries")
    attention = sorted(n[: -len(".k_proj.weight")] for n in store
                       if n.endswith(".k_proj.weight") and n.replace(".k_proj.weight", ".v_proj.weight") in store)
    files = {n: fname for fname, f in store.files.items() for n in f.tensors}
    out = []
    for attn in sorted(kv):
        entries = kv[attn]
        if attn not in attention:
            key = next(iter(entries.values()))[0]
            raise CheckpointError(f"{where}: {key!r}: {attn!r} is not an attention module of {store.root} "
                                  f"(one with k_proj and v_proj weights; found {len(attention)}, e.g. "
                                  f"{attention[:2]})")
        pair = []
        for which in ("k", "v"):
            if which not in entries:
                raise CheckpointError(f"{where}: {attn!r} has a {'v' if which == 'k' else 'k'} amax but no "
                                      f"{which} amax (key {attn}.{which}_scale); the {fmt} format scales "
                                      f"both K and V, and a missing scale becomes 1.0 in vLLM")
            name = module.kv_name(attn, which)
            if name in store:
                raise CheckpointError(f"{store.where(name)}: the source already has the KV-cache scale the "
                                      f"{fmt} export would write")
            proj = f"{attn}.{which}_proj"
            rec = get_recipe(module.kv_recipe or (recipe if recipe is not None else
                                                  plans[proj].recipe if proj in plans else "compressed-tensors"))
            weight = store.info(f"{proj}.weight")
            dtype = {v: k for k, v in D_DTYPES.items()}[weight.dtype]
            store_as = module.kv_store or ("model" if rec.scale_store_dtype == "model" else "F32")
            sdtype = D_DTYPES[dtype] if store_as == "model" else "F32"
            as_dtype = "model" if module.kv_store is None else {v: k for k, v in D_DTYPES.items()}[sdtype]
            stored, _ = compute_scale(np.array([entries[which][1]]), rec, FLOAT_FORMATS["float8_e4m3fn"], dtype,
                                      scale_dtype=as_dtype)
            if not (np.isfinite(stored).all() and (stored > 0).all()):
                raise CheckpointError(f"{where}: {entries[which][0]!r} = {entries[which][1]!r}: recipe {rec.name!r} "
                                      f"gives the scale {float(stored[0])!r} in {dtype}; a KV-cache scale must be "
                                      f"finite and > 0")
            pair.append(KVPlan(name, files[f"{proj}.weight"], sdtype,
                               _as_stored(np.asarray(stored, np.float32), sdtype).reshape(module.kv_shape)))
        if module.kv_shared:  # both hold the larger scale (the values are exact in their common dtype)
            big = max(pair, key=lambda p: float(np.asarray(p.value, np.float32).reshape(-1)[0]))
            for p in pair:
                p.value, p.dtype = big.value, big.dtype
        out += pair
    missing = [a for a in attention if a not in kv]
    if missing:
        raise CheckpointError(f"{where}: KV-cache amax for {len(kv)} of {len(attention)} attention modules; "
                              f"none for {missing[:3]}. The {fmt} format's KV-cache config covers every "
                              f"attention module, and a missing scale becomes 1.0 in vLLM")
    return out


def linear_layers(store: TensorStore) -> list[str]:
    """Modules with a 2-D float ``.weight``: the linear layers a spec can quantize."""
    out = []
    for n in store:
        info = store.info(n)
        if n.endswith(".weight") and len(info.shape) == 2 and info.dtype in ("BF16", "F16", "F32"):
            module = n[: -len(".weight")]
            if not any(e in module.rsplit(".", 1)[-1] for e in _EMBEDDING):
                out.append(module)
    return sorted(out)


def plan_layers(store: TensorStore, spec, fmt: str, *, recipe: str | None = None,
                calibration: Mapping[str, float] | None = None) -> dict[str, LayerPlan]:
    """Resolve the spec over the source's linear layers and check the format can hold each."""
    from ..recipes import BlockRecipe
    from ..registry import get_recipe

    module = base.get(fmt)
    config = _layer_config(spec)
    f8 = [n for n in store if store.info(n).fmt is not None]  # float8/6/4 codes (F64 is a plain float)
    if f8:
        raise CheckpointError(f"{store.where(f8[0])}: the source is already quantized "
                              f"({store.info(f8[0]).dtype}); export needs the original weights")
    plans = {}
    for name, scheme in config.resolve_all(linear_layers(store)).items():
        if scheme is None:
            continue
        where = f"{config.source}: layer {name!r}"
        quant = from_scheme(scheme, where, module.nvfp4_global)
        rec = get_recipe(scheme.recipe if recipe is None else recipe)
        pow2 = getattr(rec, "scale_pow2", None) is not None
        if pow2 and module.pow2_scale_fmt:
            quant = replace(quant, scale_fmt=module.pow2_scale_fmt)
        reason = module.cannot_express(quant)
        if scheme.rounding != "rne" or scheme.saturate is not True:
            reason = reason or (f"checkpoint consumers quantize with rne and saturation; rounding "
                                f"{scheme.rounding!r}, saturate {scheme.saturate!r} cannot be declared")
        if reason:
            raise CheckpointError(f"{where}: the {fmt} format cannot express this scheme: {reason}")
        info = store.info(name + ".weight")
        if 0 in info.shape:
            raise CheckpointError(f"{store.where(name + '.weight')}: shape {list(info.shape)} has no elements, "
                                  f"so no scale can be computed; leave {name!r} out of the spec (ignore it)")
        if quant.weight_strategy not in rec.granularities:
            raise CheckpointError(f"{where}: recipe {rec.name!r} has no {quant.weight_strategy!r} weights "
                                  f"(it implements {', '.join(rec.granularities)})")
        if quant.block and rec.require_divisible and (info.shape[0] % quant.block[0] or info.shape[1] % quant.block[1]):
            raise CheckpointError(f"{store.where(name + '.weight')}: shape {list(info.shape)}: recipe {rec.name!r} "
                                  f"needs the block {list(quant.block)} to divide it")
        dtype = {v: k for k, v in D_DTYPES.items()}[info.dtype]
        block = quant.weight_strategy in BLOCK_SCALED
        if block != isinstance(rec, BlockRecipe):
            raise CheckpointError(f"{where}: recipe {rec.name!r} is not a {quant.weight_strategy} recipe")
        scale_dtype = "F32"  # block-scaled formats: the format's own scale codes, planned by the format
        if not block:
            try:
                scale_dtype = _STORE[store_dtype(rec, dtype, scheme.scale_dtype)]
            except RecipeError as exc:
                raise CheckpointError(f"{where}: {exc}") from None
            e8m0 = scale_dtype == "F8_E8M0"
            if e8m0 and quant.scale_fmt != "ue8m0":
                raise CheckpointError(f"{where}: scale_dtype float8_e8m0fnu: the {fmt} format declares no "
                                      "power-of-two (ue8m0) scales (hf-fp8 does, with recipe hf-fp8-ue8m0)")
            if not module.scales_follow_recipe and scheme.scale_dtype not in ("model", "float32") and not e8m0:
                raise CheckpointError(f"{where}: scale_dtype {scheme.scale_dtype!r}: the {fmt} format stores "
                                      "float32 scales (use scale_dtype model or float32)")
        tensors = []
        for role, tname, tdtype, shape in module.tensor_plan(name, quant, *info.shape, dtype):
            if role in ("weight_scale", "input_scale") and module.scales_follow_recipe and not block:
                tdtype = scale_dtype
            elif role == "weight_scale" and not block and scale_dtype == "F8_E8M0":
                tdtype = scale_dtype
            tensors.append((role, tname, tdtype, shape))
        amax = None
        if quant.input in ("static", "nvfp4"):
            if calibration is None or name not in calibration:
                raise CheckpointError(f"{where}: static input quantization needs this layer's activation "
                                      f"amax; the calibration statistics have none")
            amax = calibration[name]
        plans[name] = LayerPlan(name, scheme, quant, rec.name, dtype, tensors, amax)
    if not plans:
        raise CheckpointError(f"{config.source}: the spec quantizes none of the {len(linear_layers(store))} "
                              f"linear layers of {store.root}")
    _fuse_nvfp4_globals(store, plans)
    clash = [t for p in plans.values() for _, t, _, _ in p.tensors[1:] if t in store]
    if clash:
        raise CheckpointError(f"{store.where(clash[0])}: the source already has a tensor the {fmt} export "
                              f"would write")
    return plans


# Linear layers that read one input and are fused by serving engines; both compressed-tensors
# (llm-compressor's observer fusion) and ModelOpt (preprocess_linear_fusion) give them one NVFP4 global.
FUSED_SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("w1", "w3"))


def _fuse_nvfp4_globals(store: TensorStore, plans: dict[str, LayerPlan]) -> None:
    """Per nvfp4 layer, the max weight amax over its fused siblings (and the max input amax)."""
    from ..scaling import reduce_amax

    nv = {n: p for n, p in plans.items() if p.quant.weight_strategy == "nvfp4"}
    amax = {n: float(reduce_amax(np.asarray(store.get(n + ".weight")), "tensor")[0]) for n in nv}
    for name, plan in nv.items():
        parent, leaf = name.rsplit(".", 1) if "." in name else ("", name)
        group = next((g for g in FUSED_SIBLINGS if leaf in g), (leaf,))
        members = [m for m in (f"{parent}.{g}" if parent else g for g in group) if m in nv]
        plan.global_amax = max(amax[m] for m in members)
        if plan.amax is not None:
            plan.amax = max(plans[m].amax for m in members if plans[m].amax is not None)


def _prefetched(f):
    """(name, raw bytes) of every tensor of ``f`` in order, reading the next one in a background
    thread while the caller quantizes and writes the current one (at most two in memory)."""
    names = list(f.tensors)
    with ThreadPoolExecutor(max_workers=1) as pool:
        pending = pool.submit(f.read_bytes, names[0]) if names else None
        for i, name in enumerate(names):
            raw = pending.result()
            pending = pool.submit(f.read_bytes, names[i + 1]) if i + 1 < len(names) else None
            yield name, raw
            del raw


def _quantize_layer(store: TensorStore, plan: LayerPlan, raw: np.ndarray) -> dict[str, np.ndarray]:
    """Bytes of the layer's output tensors, by tensor name."""
    from ..formats import FORMATS as FLOAT_FORMATS
    from ..quant import quantize
    from ..recipes import compute_scale
    from ..registry import get_recipe

    roles = {role: (tname, tdtype, shape) for role, tname, tdtype, shape in plan.tensors}
    w = store.file_of(f"{plan.name}.weight").view(f"{plan.name}.weight", raw)
    if plan.quant.weight_strategy in BLOCK_SCALED:
        return _quantize_block_layer(store, plan, w, roles)
    try:
        q = quantize(w, plan.scheme, recipe=plan.recipe)
    except Fp8RefError as exc:
        raise CheckpointError(f"{store.where(plan.name + '.weight')}: cannot quantize: {exc}") from None
    n_nan, _ = nan_count(q.codes, plan.quant.weight_fmt)
    if n_nan:
        raise CheckpointError(f"{store.where(plan.name + '.weight')}: {n_nan} non-finite values; "
                              f"a checkpoint cannot hold NaN weights")
    out = {roles["weight"][0]: q.codes}
    name, sdtype, shape = roles["weight_scale"]
    if sdtype != "F32" and _STORE[q.scale_dtype] != sdtype:  # widening to F32 is exact, narrowing is not
        raise CheckpointError(f"{plan.name}: recipe {plan.recipe!r} produced {q.scale_dtype} scales, planned {sdtype}")
    values = _checked_scale(store, name, plan, np.asarray(q.scale).astype(np.float32).reshape(shape))
    out[name] = _as_stored(values, sdtype).reshape(shape)
    if "input_scale" in roles:
        name, sdtype, shape = roles["input_scale"]
        rec = get_recipe(plan.recipe)
        stored, _ = compute_scale(np.array([plan.amax]), rec, FLOAT_FORMATS[plan.quant.weight_fmt], plan.dtype,
                                  scale_dtype=plan.scheme.scale_dtype)
        out[name] = _checked_scale(store, name, plan,
                                   _as_stored(np.asarray(stored, np.float32), sdtype).reshape(shape))
    return out


def _quantize_block_layer(store: TensorStore, plan: LayerPlan, w: np.ndarray, roles: dict) -> dict[str, np.ndarray]:
    """nvfp4 / mx: element codes (packed two per byte for FP4), E4M3 / E8M0 block-scale bytes, the
    nvfp4 global weight scale of the fused group's amax and the global input scale of the calibrated amax."""
    from ..quant import QuantArgs, nvfp4_producer_global, quantize
    from ..registry import get_recipe

    q = plan.quant
    args = QuantArgs(format=q.weight_fmt, granularity=q.weight_strategy)
    try:
        res = quantize(w, args, recipe=plan.recipe, **({"amax": plan.global_amax} if plan.global_amax else {}))
    except Fp8RefError as exc:
        raise CheckpointError(f"{store.where(plan.name + '.weight')}: cannot quantize: {exc}") from None
    n_nan, _ = nan_count(np.asarray(res.scale_codes), BLOCK_SCALED[q.weight_strategy][2])
    if n_nan or nan_count(np.asarray(res.codes), q.weight_fmt)[0]:
        raise CheckpointError(f"{store.where(plan.name + '.weight')}: non-finite values or block scales; "
                              f"a checkpoint cannot hold NaN weights")
    codes = np.asarray(res.codes)
    out = {roles["weight"][0]: pack_nibbles(codes) if q.packed else codes,
           roles["weight_scale"][0]: np.asarray(res.scale_codes, np.uint8).reshape(roles["weight_scale"][2])}
    if "weight_global" in roles:
        name, _, shape = roles["weight_global"]
        out[name] = np.asarray(res.global_scale, np.float32).reshape(shape)
    if "input_scale" in roles:
        name, _, shape = roles["input_scale"]
        g = nvfp4_producer_global(plan.amax, get_recipe(plan.recipe), plan.dtype)
        out[name] = _checked_scale(store, name, plan, np.asarray(g, np.float32).reshape(shape))
    return out


def _checked_scale(store, name: str, plan, scale: np.ndarray) -> np.ndarray:
    """A recipe can produce a scale no loader accepts: hf-fp8's 448/amax multiplier overflows fp32
    for a subnormal amax, so weight_scale_inv = 1/inf = 0. Refuse before anything is written."""
    values = np.asarray(scale, np.float32)
    bad = ~(np.isfinite(values) & (values > 0))
    if bad.any():
        first = float(values.reshape(-1)[np.argmax(bad.reshape(-1))])
        raise CheckpointError(f"{store.where(plan.name + '.weight')}: recipe {plan.recipe!r} gives {name} = "
                              f"{first!r} for {int(bad.sum())} of {values.size} element(s); a dequantization "
                              "scale must be > 0 and finite (tiny or zero amax: pick another recipe)")
    return scale


def _write_shard(folder: Path, fname: str, specs: list, metadata, items, weight_map: dict) -> int:
    """Stream ``items`` ((name, data) in ``specs`` order) into one safetensors file; a failure
    removes the partial file. Records the tensors in ``weight_map``; returns their data bytes."""
    writer = SafetensorsWriter(folder / fname, specs, metadata or {"format": "pt"})
    try:
        for name, data in items:
            writer.write(name, data)
    except BaseException:
        writer.abort()
        raise
    writer.close()
    weight_map.update({spec.name: fname for spec in specs})
    return sum(spec.nbytes for spec in specs)


def metadata_names(sharded: bool, qc: dict, fmt: base.CheckpointFormat) -> set[str]:
    """The files ``_write_metadata`` writes."""
    return ({INDEX_NAME} if sharded else set()) | {"config.json"} | set(fmt.extra_files(qc))


def _refuse_collisions(store: TensorStore, qc: dict, fmt: base.CheckpointFormat) -> None:
    """Before anything is written: a shard named like a file the format writes beside it (an index
    naming a shard ``quantization_config.json``) would be overwritten by it."""
    for name in sorted(set(store.files) & metadata_names(store.index is not None, qc, fmt)):
        raise CheckpointError(f"{store.files[name].path}: a shard named {name!r}, but the {fmt.name} format writes "
                              f"its own {name!r} beside the shards; rename the shard (and its index entries)")


def _write_metadata(tmp: Path, sharded: bool, weight_map: dict, total_size: int, config: dict, qc: dict,
                    fmt: base.CheckpointFormat) -> None:
    """The shard index (when the source had one), config.json with ``qc`` as its
    quantization_config, and the other files the format keeps its config in."""
    if sharded:
        index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
        atomic_write_text(tmp / INDEX_NAME, json.dumps(index, indent=2) + "\n")
    config["quantization_config"] = qc
    atomic_write_text(tmp / "config.json", json.dumps(config, indent=2, sort_keys=True) + "\n")
    for name, document in fmt.extra_files(qc).items():
        atomic_write_text(tmp / name, json.dumps(document, indent=2, sort_keys=True) + "\n")


def _as_stored(values32: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values that are exact in ``dtype`` -> an array of that dtype, bit-exact (F8_E8M0: the
    biased exponent bytes 127 + log2 v of powers of two)."""
    import ml_dtypes

    if dtype == "F32":
        return values32
    if dtype == "F8_E8M0":
        _, e = np.frexp(np.asarray(values32, np.float64))
        return (e.astype(np.int64) - 1 + 127).astype(np.uint8)
    if dtype == "F16":
        return values32.astype(np.float16)
    bits = (np.ascontiguousarray(values32).view(np.uint32) >> np.uint32(16)).astype(np.uint16)
    return bits.view(ml_dtypes.bfloat16)


def export_checkpoint(source: str | os.PathLike, output: str | os.PathLike, spec, *,
                      format: str = "compressed-tensors", calibration=None, recipe: str | None = None,
                      force: bool = False, progress: bool = False, symlinks_out: bool = False) -> Path:
    """Quantize ``source`` (a safetensors file or folder, sharded or not) per ``spec`` (YAML path,
    mapping or LayerConfig) into a complete ``format`` checkpoint at ``output``.

    calibration: per-layer activation amax (a mapping, or a JSON/safetensors path), required for
    layers with static inputs; KV-cache amax entries (``<attn>.k_scale``/``v_scale`` or
    ``<attn>.{k,v}_proj.output_amax``) add ``<attn>.{k,v}_scale`` and ``kv_cache_scheme``
    (compressed-tensors only; other formats raise CheckpointError before writing). recipe:
    overrides each scheme's recipe. Every non-quantized tensor and every other file of the source
    folder is copied unchanged; config.json gets the format's ``quantization_config``. Refuses an
    existing ``output`` unless ``force``. ``symlinks_out``: accept source files that link out of
    the folder (a Hugging Face cache snapshot).
    """
    module = base.get(format)
    if hasattr(module, "export"):  # a format of fused tensors, not linear layers (gpt-oss): its own writer
        return module.export(source, output, spec, recipe=recipe, force=force, symlinks_out=symlinks_out)
    if recipe is not None:  # '' is a wrong name, not "no override"
        from ..registry import get_recipe

        get_recipe(recipe)
    source = path_arg(source, "source")
    output = path_arg(output, "output")
    store = open_store(source, symlinks_out=symlinks_out)
    folder = source if source.is_dir() else source.parent
    given = (spec, calibration)  # files never inside the output
    where = "calibration"
    if calibration is not None and not isinstance(calibration, Mapping):
        where = str(calibration)
        calibration = load_calibration(calibration)
    elif calibration is not None:
        refuse_scales(calibration, where)
    kv_amax = {}
    if calibration is not None:
        calibration, kv_amax = split_calibration(calibration, where)
        calibration = {k: _amax_number(v, f"{where}[{k!r}]") for k, v in calibration.items()}  # AmaxState too
    if kv_amax and module.kv_refusal:  # before the spec is resolved: the format is the first thing wrong
        plan_kv(store, kv_amax, format, {}, where=where)
    plans = plan_layers(store, spec, format, recipe=recipe, calibration=calibration)
    kv_plans = plan_kv(store, kv_amax, format, plans, recipe=recipe, where=where)
    kv_by_file: dict[str, list[KVPlan]] = {}
    for k in kv_plans:
        kv_by_file.setdefault(k.file, []).append(k)
    config = {}
    if (folder / "config.json").exists() or (folder / "config.json").is_symlink():  # a FIFO: refused by read_json
        config = read_json(folder / "config.json", "config")
        if not isinstance(config, dict):
            raise CheckpointError(f"{folder / 'config.json'}: expected a JSON object")
        if config.get("quantization_config") is not None:
            raise CheckpointError(f"{folder / 'config.json'}: the source already has a quantization_config")
    layers = {n: p.quant for n, p in plans.items()}
    unquantized = [m for m in linear_layers(store) if m not in plans]
    qc = module.quantization_config(layers, unquantized, kv=bool(kv_plans))
    _refuse_collisions(store, qc, module)
    bar = _progress(len(store), progress)
    inputs = [folder if source.is_dir() else source] + [p for p in given if isinstance(p, (str, os.PathLike))]
    with atomic_folder(output, force=force, protect=inputs) as tmp:
        weight_map, total_size = {}, 0
        for fname, f in store.files.items():
            by_source = {}
            specs = []
            for tname, info in f.tensors.items():
                layer = tname[: -len(".weight")] if tname.endswith(".weight") else None
                if layer in plans:
                    entries = plans[layer].tensors
                    by_source[tname] = layer
                    specs += [TensorSpec(n, d, tuple(s)) for _, n, d, s in entries]
                else:
                    specs.append(TensorSpec(tname, info.dtype, info.shape))
            specs += [TensorSpec(k.name, k.dtype, tuple(k.value.shape)) for k in kv_by_file.get(fname, [])]
            def tensors(f=f, fname=fname, by_source=by_source):
                for tname, raw in _prefetched(f):
                    if tname in by_source:
                        yield from _quantize_layer(store, plans[by_source[tname]], raw).items()
                    else:
                        yield tname, raw
                    bar.update(1)
                for k in kv_by_file.get(fname, []):
                    yield k.name, k.value

            meta = base.with_recipes(f.metadata, {layer: plans[layer].recipe for layer in by_source.values()})
            total_size += _write_shard(tmp, fname, specs, meta, tensors(), weight_map)
        _write_metadata(tmp, store.index is not None, weight_map, total_size, config, qc, module)
        if source.is_dir():
            _copy_others(folder, tmp, set(store.files) | {INDEX_NAME, "config.json"} | _config_files(),
                         symlinks_out=symlinks_out)
    bar.close()
    return Path(output)


def _config_files() -> set[str]:
    """Files some format keeps its config in: written from the new config, never copied (a stale
    hf_quant_config.json beside a compressed-tensors config would misdescribe the tensors)."""
    return {f for name in base.names() for f in base.get(name).config_files}


def _copy_others(src: Path, dst: Path, skip: set[str], *, symlinks_out: bool = False) -> None:
    """Copy every other file and folder of the source (tokenizer, generation config, ...)."""
    root = src.resolve()
    for entry in sorted(src.iterdir()):
        if entry.name in skip or entry.name.startswith("."):
            continue
        _copy_entry(entry, dst / entry.name, root, symlinks_out, ())


def _copy_entry(entry: Path, target: Path, root: Path, symlinks_out: bool, parents: tuple[Path, ...]) -> None:
    """Regular files and folders only. A symlink is copied as what it names when that lies inside
    the source folder (anywhere with ``symlinks_out``: a Hugging Face snapshot); a dangling link, a
    loop, a FIFO, a device or a socket is refused, never opened (a FIFO would block the copy)."""
    try:
        real = entry.resolve(strict=True)
        mode = real.stat().st_mode
    except (OSError, RuntimeError) as exc:  # RuntimeError: a symlink loop (Python < 3.13)
        why = getattr(exc, "strerror", None) or "symlink loop"
        raise CheckpointError(f"{entry}: cannot copy it into the output: {why} (a dangling symlink or a loop?)") \
            from None
    if entry.is_symlink() and not symlinks_out and not is_inside(real, root):
        raise CheckpointError(f"{entry}: a symlink to {real}, outside the source folder {root}; refusing to copy it "
                              "into the output (pass symlinks_out=True, CLI --symlinks-out, if you trust it)")
    if stat.S_ISDIR(mode):
        if real in parents:
            raise CheckpointError(f"{entry}: a symlink to its own parent folder {real} (a loop); refusing to copy it")
        target.mkdir()
        for child in sorted(entry.iterdir()):
            _copy_entry(child, target / child.name, root, symlinks_out, (*parents, real))
    elif stat.S_ISREG(mode):
        shutil.copy2(real, target)
    else:
        kind = "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device file"
        raise CheckpointError(f"{entry}: {kind}, not a regular file or folder; refusing to copy it into the output")


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, enabled: bool, desc: str = "export", unit: str = "tensor"):
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, unit=unit, desc=desc, leave=False)


def write_checkpoint(checkpoint, output: str | os.PathLike, *, format: str | None = None,
                     force: bool = False, symlinks_out: bool = False) -> Path:
    """Write a loaded ``Checkpoint`` again, in its own format or another one that can express
    every layer: codes and scale values are copied bit for bit (scales keep their dtype and
    are only reshaped/renamed to the target layout); other tensors and files are copied
    (``symlinks_out``: also files that are symlinks out of the checkpoint folder)."""
    from .loader import Checkpoint

    if not isinstance(checkpoint, Checkpoint):
        raise InputTypeError(f"checkpoint: expected a Checkpoint (fp8ref.load_checkpoint(path)), got "
                             f"{type(checkpoint).__name__}")
    output = path_arg(output, "output")
    fmt = format or checkpoint.format
    module = base.get(fmt)
    store = checkpoint.store
    renames: dict[str, tuple[str, tuple]] = {}  # source tensor -> (target name, target shape)
    for name, layer in checkpoint.items():
        base.refuse_fused(checkpoint, layer, module)
        reason = module.cannot_express(layer.quant)
        if reason:
            raise CheckpointError(f"{checkpoint.path}: layer {name!r}: the {fmt} format cannot express it: {reason}")
        out, inp = layer.shape
        if fmt != checkpoint.format and store.info(layer.tensors["weight_scale"]).dtype == "F8_E8M0":
            raise CheckpointError(f"{store.where(layer.tensors['weight_scale'])}: F8_E8M0 (ue8m0) scales are kept "
                                  f"only by {checkpoint.format}; the {fmt} format stores float scales")
        plan = (module.layer_plan(layer, checkpoint.dtype) if hasattr(module, "layer_plan")  # gpt-oss experts
                else module.tensor_plan(name, layer.quant, out, inp, checkpoint.dtype))
        for role, tname, _, shape in plan:
            if role in layer.tensors:
                renames[layer.tensors[role]] = (tname, shape)
    for kname in sorted(checkpoint.kv_scales.values()):
        if module.kv_refusal or kname.endswith(".q_scale"):
            why = module.kv_refusal or "compressed-tensors' kv_cache_scheme has no query scale"
            raise CheckpointError(f"{store.where(kname)}: a KV-cache scale, but the {fmt} format cannot express "
                                  f"it: {why}")
        renames[kname] = module.kv_tensor(kname, store.info(kname).shape)
    layers = {n: layer.quant for n, layer in checkpoint.items()}
    unquantized = [m for m in linear_layers(store) if m not in layers]
    qc = module.quantization_config(layers, unquantized, kv=bool(checkpoint.kv_scales))
    if fmt == checkpoint.format:
        qc = module.carry_config(checkpoint.quantization_config, qc)
    folder = checkpoint.path if checkpoint.path.is_dir() else checkpoint.path.parent
    _refuse_collisions(store, qc, module)
    with atomic_folder(output, force=force, protect=[checkpoint.path]) as tmp:
        weight_map, total_size = {}, 0
        for fname, f in store.files.items():
            specs = []
            for n, info in f.tensors.items():
                target, shape = renames.get(n, (n, info.shape))
                if prod(shape) != info.numel:
                    raise CheckpointError(f"{store.where(n)}: shape {list(info.shape)} cannot become {list(shape)}")
                specs.append(TensorSpec(target, info.dtype, tuple(shape)))
            items = ((renames.get(n, (n,))[0], f.read_bytes(n)) for n in f.tensors)
            total_size += _write_shard(tmp, fname, specs, f.metadata, items, weight_map)
        config = {k: v for k, v in checkpoint.config.items() if k != "quantization_config"}
        _write_metadata(tmp, store.index is not None, weight_map, total_size, config, qc, module)
        if checkpoint.path.is_dir():
            _copy_others(folder, tmp, set(store.files) | {INDEX_NAME, "config.json"} | _config_files(),
                         symlinks_out=symlinks_out)
    return Path(output)
