"""``export_checkpoint``: quantize an original safetensors checkpoint into a producer's format.

One pass, one tensor at a time: for every output file the header is laid out first from the
plan (names, dtypes and shapes follow from the source headers and the schemes), then each
tensor is read, quantized or copied byte for byte, written at its offset and dropped. Peak
memory is therefore a few times the largest tensor. Everything goes into a temporary folder
that is renamed over the destination only when complete; the source is never written.

The walk: the calibration file (calibration_file.py), then the plan of every layer and KV-cache
scale with every refusal and every scale but the weights' (plan.py), then per tensor
``quantize()`` (here) and the streaming writer (writer.py).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from ..errors import CheckpointError, Fp8RefError
from ..io.atomic import atomic_folder
from ..io.files import read_json
from ..io.paths import path_arg
from ..io.safetensors import INDEX_NAME, TensorSpec, TensorStore, open_store, pack_codes
from ..quant import QuantArgs, quantize
from ..registry import get_recipe
from . import base
from .calibration_file import amax_number, load_calibration, refuse_scales, split_calibration
from .layout import BLOCK_SCALED, nan_count
from .plan import KVPlan, LayerPlan, linear_layers, plan_kv, plan_layers
from .scales import STORE_DTYPES, as_stored, checked_scale
from .writer import config_files, copy_others, prefetched, progress_bar, refuse_collisions, write_metadata, write_shard


def export_checkpoint(source: str | os.PathLike, output: str | os.PathLike, spec, *,
                      format: str = "compressed-tensors", calibration=None, recipe: str | None = None,
                      force: bool = False, progress: bool = False, symlinks_out: bool = False,
                      config_version: str | None = None) -> Path:
    """Quantize ``source`` (a safetensors file or folder, sharded or not) per ``spec`` (YAML path,
    mapping or LayerConfig) into a complete ``format`` checkpoint at ``output``.

    calibration: per-layer activation amax (a mapping, or a JSON/safetensors path), required for
    layers with static inputs; KV-cache amax entries (``<attn>.k_scale``/``v_scale`` or
    ``<attn>.{k,v}_proj.output_amax``) add ``<attn>.{k,v}_scale`` and ``kv_cache_scheme``, a number
    each or a list with one per head (attn_head); ``<attn>.q_scale`` entries add the query's scale and
    an attention group (compressed-tensors only; where a format cannot store them, CheckpointError
    before writing). recipe:
    overrides each scheme's recipe. Every non-quantized tensor and every other file of the source
    folder is copied unchanged; config.json gets the format's ``quantization_config``. Refuses an
    existing ``output`` unless ``force``. ``symlinks_out``: accept source files that link out of
    the folder (a Hugging Face cache snapshot). ``config_version``: write the config as that version
    of the producer writes it (compressed-tensors: 0.19 or 0.20; None: the newest).
    """
    module = base.get(format)
    options = base.config_options(module, config_version)
    if hasattr(module, "export"):  # a format of fused tensors, not linear layers (gpt-oss): its own writer
        return module.export(source, output, spec, recipe=recipe, force=force, symlinks_out=symlinks_out)
    if recipe is not None:  # '' is a wrong name, not "no override"

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
        calibration = {k: amax_number(v, f"{where}[{k!r}]") for k, v in calibration.items()}  # AmaxState too
    if kv_amax and module.kv_refusal:  # before the spec is resolved: the format is the first thing wrong
        plan_kv(store, kv_amax, format, {}, where=where)
    plans = plan_layers(store, spec, format, recipe=recipe, calibration=calibration)
    config = {}
    if (folder / "config.json").exists() or (folder / "config.json").is_symlink():  # a FIFO: refused by read_json
        config = read_json(folder / "config.json", "config")
        if not isinstance(config, dict):
            raise CheckpointError(f"{folder / 'config.json'}: expected a JSON object")
        if config.get("quantization_config") is not None:
            raise CheckpointError(f"{folder / 'config.json'}: the source already has a quantization_config")
    kv_plans = plan_kv(store, kv_amax, format, plans, recipe=recipe, where=where, config=config)
    kv_by_file: dict[str, list[KVPlan]] = {}
    for k in kv_plans:
        kv_by_file.setdefault(k.file, []).append(k)
    layers = {n: p.quant for n, p in plans.items()}
    unquantized = [m for m in linear_layers(store) if m not in plans]
    if module.config_takes_recipes:  # torchao: MX's ScaleCalculationMode is the recipe's
        options["recipes"] = {n: p.recipe for n, p in plans.items()}
    query = sorted(k.name.rsplit(".", 1)[0] for k in kv_plans if k.name.endswith(".q_scale"))
    if query:  # an attention group quantizing Q (compressed-tensors)
        options["attention"] = module.attention_targets(config, query)
    per_head = any(np.size(k.value) > 1 for k in kv_plans)  # kv_cache_scheme strategy attn_head
    qc = module.quantization_config(layers, unquantized, kv="attn_head" if per_head else bool(kv_plans), **options)
    refuse_collisions(store, qc, module)
    bar = progress_bar(len(store), progress)
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
                for tname, raw in prefetched(f):
                    if tname in by_source:
                        yield from _quantize_layer(store, plans[by_source[tname]], raw).items()
                    else:
                        yield tname, raw
                    bar.update(1)
                for k in kv_by_file.get(fname, []):
                    yield k.name, k.value

            meta = base.with_recipes(f.metadata, {layer: plans[layer].recipe for layer in by_source.values()})
            if hasattr(module, "shard_metadata"):  # torchao: a JSON description per written weight
                meta = module.shard_metadata(meta, {layer: (plans[layer].quant, f.tensors[t].shape, plans[layer].dtype,
                                                            plans[layer].recipe) for t, layer in by_source.items()},
                                             [t for t in f.tensors if t not in by_source])
            total_size += write_shard(tmp, fname, specs, meta, tensors(), weight_map)
        write_metadata(tmp, store.index is not None, weight_map, total_size, config, qc, module)
        if source.is_dir():
            copy_others(folder, tmp, set(store.files) | {INDEX_NAME, "config.json"} | config_files(),
                         symlinks_out=symlinks_out)
    bar.close()
    return Path(output)


def _quantize_layer(store: TensorStore, plan: LayerPlan, raw: np.ndarray) -> dict[str, np.ndarray]:
    """Bytes of the layer's output tensors, by tensor name."""
    roles = {role: (tname, tdtype, shape) for role, tname, tdtype, shape in plan.tensors}
    w = store.file_of(f"{plan.name}.weight").view(f"{plan.name}.weight", raw)
    if plan.quant.weight_strategy in BLOCK_SCALED:
        return _quantize_block_layer(store, plan, w, roles, plan.store_block)
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
    if sdtype != "F32" and STORE_DTYPES[q.scale_dtype] != sdtype:  # widening to F32 is exact, narrowing is not
        raise CheckpointError(f"{plan.name}: recipe {plan.recipe!r} produced {q.scale_dtype} scales, planned {sdtype}")
    values = checked_scale(store.where(plan.name + '.weight'), plan.recipe, name,
                           np.asarray(q.scale).astype(np.float32).reshape(shape))
    out[name] = as_stored(values, sdtype).reshape(shape)
    if "input_scale" in roles:
        out[roles["input_scale"][0]] = plan.input_scale
    return out


def _quantize_block_layer(store: TensorStore, plan: LayerPlan, w: np.ndarray, roles: dict,
                          store_block=None) -> dict[str, np.ndarray]:
    """nvfp4 / mx: element codes (packed two per byte for FP4), E4M3 / E8M0 block-scale bytes, the
    nvfp4 global weight scale of the fused group's amax and the global input scale of the calibrated amax.
    ``store_block(quant, codes, scale_codes)``: the format's own layout of both (torchao: swizzled scales)."""
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
    if store_block is not None:
        stored, scales = store_block(q, codes, np.asarray(res.scale_codes, np.uint8))
        out = {roles["weight"][0]: stored, roles["weight_scale"][0]: scales.reshape(roles["weight_scale"][2])}
    else:
        out = {roles["weight"][0]: pack_codes(codes, q.weight_fmt) if q.packed else codes,
               roles["weight_scale"][0]: np.asarray(res.scale_codes, np.uint8).reshape(roles["weight_scale"][2])}
    if "weight_global" in roles:
        name, _, shape = roles["weight_global"]
        out[name] = np.asarray(res.global_scale, np.float32).reshape(shape)
    if "input_scale" in roles:
        out[roles["input_scale"][0]] = plan.input_scale
    return out
