"""What an export will write, settled before anything is: per linear layer the scheme, recipe,
tensors and input scale (``plan_layers``), per attention module the KV-cache scales
(``plan_kv``). Every refusal of the source, the spec or the calibration happens here."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace

import numpy as np

from ..errors import CheckpointError, RecipeError
from ..io.safetensors import TensorStore
from ..recipes import BlockRecipe, store_dtype
from ..registry import DEFAULT_RECIPE, get_recipe
from ..scaling import reduce_amax
from ..spec import LayerConfig, load_spec, load_spec_dict
from . import base
from .layout import BLOCK_SCALED, D_DTYPES, LayerQuant, from_scheme
from .scales import STORE_DTYPES, amax_scale, as_stored, checked_scale, input_scale

_EMBEDDING = ("embed", "wte", "wpe")


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
    input_scale: np.ndarray | None = None  # the stored input scale (or NVFP4 input global), from amax
    store_block: object = None  # the format's store_block(quant, codes, scale_codes) (torchao's swizzle), or None


def layer_config(spec):
    if isinstance(spec, LayerConfig):
        return spec
    if isinstance(spec, Mapping):
        return load_spec_dict(dict(spec))
    if isinstance(spec, (str, os.PathLike)):
        return load_spec(spec)
    raise CheckpointError(f"spec: expected a YAML path, a mapping or a LayerConfig, got {type(spec).__name__}")


def block_default(module, quant: LayerQuant, rec):
    """The recipe of a block-scaled (MX, NVFP4) layer whose scheme names fp8ref's (the presets' default,
    an element-scale recipe with no block arithmetic a format's stored meaning is defined for): the
    format's own block recipe (``recipe_of``: compressed-tensors-mx, modelopt-nvfp4, ...); ``rec`` for
    other layers, or where the format has none."""
    if quant.weight_strategy not in BLOCK_SCALED or isinstance(rec, BlockRecipe):
        return rec
    own = get_recipe(module.recipe_of(quant))
    return own if isinstance(own, BlockRecipe) else rec


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
    module = base.get(fmt)
    config = layer_config(spec)
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
        if recipe is None and rec.name == DEFAULT_RECIPE:
            rec = block_default(module, quant, rec)
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
            own = block_default(module, quant, rec) if block else rec
            hint = (f" (leave --recipe out for the {fmt} format's own, {own.name!r})"
                    if isinstance(own, BlockRecipe) else "")
            raise CheckpointError(f"{where}: recipe {rec.name!r} is not a {quant.weight_strategy} recipe{hint}")
        scale_dtype = "F32"  # block-scaled formats: the format's own scale codes, planned by the format
        if not block:
            try:
                scale_dtype = STORE_DTYPES[store_dtype(rec, dtype, scheme.scale_dtype)]
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
        if getattr(rec, "global_rule", None) == "none" and any(t[0] == "weight_global" for t in tensors):
            if not module.nvfp4_global_optional:
                raise CheckpointError(f"{where}: recipe {rec.name!r} makes no per-tensor scale; the {fmt} format "
                                      f"stores one for every NVFP4 layer")
            tensors = [t for t in tensors if t[0] != "weight_global"]
        amax = None
        if quant.input in ("static", "nvfp4"):
            if calibration is None or name not in calibration:
                raise CheckpointError(f"{where}: static input quantization needs this layer's activation "
                                      f"amax; the calibration statistics have none")
            amax = calibration[name]
        plans[name] = LayerPlan(name, scheme, quant, rec.name, dtype, tensors, amax,
                                store_block=getattr(module, "store_block", None))
    if not plans:
        raise CheckpointError(f"{config.source}: the spec quantizes none of the {len(linear_layers(store))} "
                              f"linear layers of {store.root}")
    if module.fuses_nvfp4_globals:
        _fuse_nvfp4_globals(store, plans)
    for plan in plans.values():
        _plan_input_scale(store, plan)
    clash = [t for p in plans.values() for _, t, _, _ in p.tensors[1:] if t in store]
    if clash:
        raise CheckpointError(f"{store.where(clash[0])}: the source already has a tensor the {fmt} export "
                              f"would write")
    return plans


def _plan_input_scale(store: TensorStore, plan: LayerPlan) -> None:
    """The layer's stored input scale (NVFP4: input global) from its calibrated amax, checked
    before anything is written."""
    role = next((t for t in plan.tensors if t[0] == "input_scale"), None)
    if role is None:
        return
    _, name, sdtype, shape = role
    values = input_scale(plan.amax, get_recipe(plan.recipe), plan.quant, plan.dtype, plan.scheme.scale_dtype)
    stored = values if plan.quant.weight_strategy in BLOCK_SCALED else as_stored(values, sdtype)
    plan.input_scale = checked_scale(store.where(plan.name + ".weight"), plan.recipe, name, stored).reshape(shape)


FUSED_SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("w1", "w3"))


def _fuse_nvfp4_globals(store: TensorStore, plans: dict[str, LayerPlan]) -> None:
    """Per nvfp4 layer, the max weight amax over its fused siblings (and the max input amax)."""
    nv = {n: p for n, p in plans.items() if p.quant.weight_strategy == "nvfp4"}
    amax = {n: float(reduce_amax(np.asarray(store.get(n + ".weight")), "tensor")[0]) for n in nv}
    for name, plan in nv.items():
        parent, leaf = name.rsplit(".", 1) if "." in name else ("", name)
        group = next((g for g in FUSED_SIBLINGS if leaf in g), (leaf,))
        members = [m for m in (f"{parent}.{g}" if parent else g for g in group) if m in nv]
        plan.global_amax = max(amax[m] for m in members)
        if plan.amax is not None:
            plan.amax = max(plans[m].amax for m in members if plans[m].amax is not None)


@dataclass
class KVPlan:
    name: str  # the format's name for <attn>'s K or V scale (compressed-tensors: <attn>.k_scale)
    file: str  # the output file: the one holding <attn>.k_proj.weight (or v_proj)
    dtype: str  # safetensors dtype
    value: np.ndarray  # the stored tensor, in the format's KV shape


def _kv_heads(kv, module, fmt: str, config: Mapping | None, where: str) -> dict[str, int] | None:
    """Heads per scale ({"k": n_kv, "v": n_kv, "q": n_heads}) of per-head amax entries (checked: all per
    head or none, one per head of the config), or None for per-tensor ones."""
    entries = [(which, key, a) for d in kv.values() for which, (key, a) in d.items()]
    per_head = [key for _, key, a in entries if isinstance(a, tuple)]
    if not per_head:
        return None
    if len(per_head) != len(entries):
        other = next(key for _, key, a in entries if not isinstance(a, tuple))
        raise CheckpointError(f"{where}: {per_head[0]!r} holds one amax per head but {other!r} one per tensor; "
                              f"a checkpoint's kv_cache_scheme has one strategy: give every KV amax per head or none")
    if not module.kv_per_head:
        raise CheckpointError(f"{where}: {per_head[0]!r} holds one amax per head; the {fmt} format stores one "
                              f"KV-cache scale per tensor (export to compressed-tensors for per-head scales)")
    text = (config or {}).get("text_config") if isinstance((config or {}).get("text_config"), dict) else (config or {})
    heads = {}
    for which, key in _HEAD_KEYS.items():
        n = text.get(key, text.get("num_attention_heads"))
        if any(w == which for w, _, _ in entries) and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
            raise CheckpointError(f"{where}: {per_head[0]!r} holds one amax per head, but the source's config.json "
                                  f"has no {key} to check the count against")
        heads[which] = n
    for which, key, a in entries:
        if len(a) != heads[which]:
            raise CheckpointError(f"{where}: {key!r} holds {len(a)} amax values; config.json has "
                                  f"{_HEAD_KEYS[which]} {heads[which]}: give one per "
                                  f"{'attention' if which == 'q' else 'KV'} head")
    return heads


# the config key that counts the heads of each per-head scale
_HEAD_KEYS = {"k": "num_key_value_heads", "v": "num_key_value_heads", "q": "num_attention_heads"}


def _check_query(kv, module, fmt: str, where: str) -> bool:
    """Whether the query is quantized (an ``ATTN.q_scale`` amax): then for every attention module,
    beside its K and V, and only where the format stores a query scale."""
    with_q = sorted(a for a, d in kv.items() if "q" in d)
    if not with_q:
        return False
    if not module.kv_query:
        raise CheckpointError(f"{where}: {kv[with_q[0]]['q'][0]!r}: a query amax; the {fmt} format stores no query "
                              f"scale (compressed-tensors does, in an attention config group)")
    without = sorted(a for a in kv if a not in with_q)
    if without:
        raise CheckpointError(f"{where}: a query amax for {len(with_q)} of {len(kv)} attention modules; none for "
                              f"{without[:3]}. compressed-tensors' attention group quantizes Q in every attention "
                              f"module (a missing q_scale would be loaded uninitialised): give {without[0]}.q_scale")
    return True


def plan_kv(store: TensorStore, kv: dict[str, dict[str, tuple[str, float | tuple[float, ...]]]], fmt: str,
            plans: Mapping[str, LayerPlan], *, recipe: str | None = None, where: str = "calibration",
            config: Mapping | None = None) -> list[KVPlan]:
    """KV-cache scales for ``fmt`` from per-attention-module amax; every check runs before writing.

    Scale = the recipe's formula on the amax: the format's own KV rule (``kv_recipe``: ModelOpt
    fp32(fp32(amax)/448), Quark D(fp32(amax)/448)), else the ``recipe=`` override, else the recipe of
    the module's k_proj/v_proj layer, else compressed-tensors'; stored in the format's KV dtype
    (``kv_store``; None: the recipe's, the projection's dtype or float32), name and shape
    (``kv_name``, ``kv_shape``); with ``kv_shared`` (Quark) K and V both hold the larger scale.
    A per-head amax (a tuple, one per KV head of ``config``'s ``num_key_value_heads``) gives a scale
    [n_kv_heads, 1, 1] in a format that stores them (``kv_per_head``: compressed-tensors' attn_head);
    every module then has per-head amax (kv_cache_scheme is one strategy for the whole model).
    """
    if not kv:
        return []
    module = base.get(fmt)
    first = next(iter(kv.values()))
    example = next(iter(first.values()))[0]
    if module.kv_refusal:
        raise CheckpointError(f"{where}: KV-cache amax for {len(kv)} attention module(s) (e.g. {example!r}), but "
                              f"the {fmt} format cannot express KV-cache scales: {module.kv_refusal}. Export to "
                              f"compressed-tensors, modelopt or quark, or drop the KV-cache entries")
    heads = _kv_heads(kv, module, fmt, config, where)
    query = _check_query(kv, module, fmt, where)
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
        for which in ("k", "v") + (("q",) if query else ()):
            if which not in entries:
                raise CheckpointError(f"{where}: {attn!r} has a {'v' if which == 'k' else 'k'} amax but no "
                                      f"{which} amax (key {attn}.{which}_scale); the {fmt} format scales "
                                      f"both K and V, and a missing scale becomes 1.0 in vLLM")
            name = module.kv_name(attn, which)
            if name in store:
                raise CheckpointError(f"{store.where(name)}: the source already has the KV-cache scale the "
                                      f"{fmt} export would write")
            proj = f"{attn}.{which}_proj"  # Q: q_proj's recipe and dtype (k_proj's where Q is fused elsewhere)
            proj = proj if f"{proj}.weight" in store else f"{attn}.k_proj"
            rec = get_recipe(module.kv_recipe or (recipe if recipe is not None else
                                                  plans[proj].recipe if proj in plans else "compressed-tensors"))
            weight = store.info(f"{proj}.weight")
            dtype = {v: k for k, v in D_DTYPES.items()}[weight.dtype]
            store_as = module.kv_store or ("model" if rec.scale_store_dtype == "model" else "F32")
            sdtype = D_DTYPES[dtype] if store_as == "model" else "F32"
            as_dtype = "model" if module.kv_store is None else {v: k for k, v in D_DTYPES.items()}[sdtype]
            pair.append(_scale_plan(name, files[f"{proj}.weight"], entries[which], rec, dtype, sdtype, as_dtype,
                                    (heads[which], 1, 1) if heads else module.kv_shape, where))
        if module.kv_shared:  # K and V both hold the larger scale (the values are exact in their common dtype)
            big = max(pair[:2], key=lambda p: float(np.asarray(p.value, np.float32).reshape(-1)[0]))
            for p in pair[:2]:
                p.value, p.dtype = big.value, big.dtype
        out += pair
    missing = [a for a in attention if a not in kv]
    if query and missing:
        raise CheckpointError(f"{where}: a query amax for {len(kv)} of {len(attention)} attention modules; none for "
                              f"{missing[:3]}: give every attention module's q_scale, k_scale and v_scale")
    if missing:
        raise CheckpointError(f"{where}: KV-cache amax for {len(kv)} of {len(attention)} attention modules; "
                              f"none for {missing[:3]}. The {fmt} format's KV-cache config covers every "
                              f"attention module, and a missing scale becomes 1.0 in vLLM")
    return out


def _scale_plan(name: str, file: str, entry: tuple, rec, dtype: str, sdtype: str, as_dtype: str, shape: tuple,
                where: str) -> KVPlan:
    """One attention scale (K, V or Q) from its (calibration key, amax or per-head amax) entry."""
    key, amax = entry
    stored = (np.concatenate([amax_scale(a, rec, "float8_e4m3fn", dtype, as_dtype) for a in amax])
              if isinstance(amax, tuple) else amax_scale(amax, rec, "float8_e4m3fn", dtype, as_dtype))
    if not (np.isfinite(stored).all() and (stored > 0).all()):
        raise CheckpointError(f"{where}: {key!r} = {amax!r}: recipe {rec.name!r} gives the scale "
                              f"{float(stored.reshape(-1)[0])!r} in {dtype}; a KV-cache scale must be finite and > 0")
    return KVPlan(name, file, sdtype, as_stored(stored, sdtype).reshape(shape))
