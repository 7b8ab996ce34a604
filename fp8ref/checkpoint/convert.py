"""``convert_checkpoint``: a loaded checkpoint written in another format, exactly where the target
can hold its numbers, else requantized by the target producer's recipe with the exact cost.

Per layer the target layout is the source's (NVFP4 globals in the target's vocabulary, ue8m0 scales
only where the target declares them), else the first layout of the target that keeps the weight
element format (``_candidates``). A layer is **exact** when the layout and input mode are the same
and every scale value is exactly representable in the target's scale dtype and meaning (widening,
an E8M0 power of two as a float, a divisor whose reciprocal is exact): codes and block-scale bytes
are copied, scales re-expressed. Otherwise it is **requantized**: the source's dequantized weight
D(decode(q) * s) (the model dtype, what the target tool would be given) goes through
``module.recipe_of(target)``; a static input scale s_in is recomputed from amax = 448 * s_in (an
NVFP4 input global from its amax). The cost is measured against the source's exact dequantized
values: codes changed, scales changed, max |error| and max relative error, each computed exactly
(float64 products where exact, Fractions for the candidates where a divisor makes them inexact).
KV-cache scales follow the same rule (a Quark target stores the larger of K and V for both).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, replace
from fractions import Fraction
from math import prod
from pathlib import Path

import numpy as np

from ..codec import decode
from ..errors import CheckpointError, Fp8RefError, InputTypeError
from ..io.atomic import atomic_folder
from ..io.paths import path_arg
from ..io.safetensors import INDEX_NAME, TensorSpec, pack_codes
from ..quant import QuantArgs, quantize
from ..registry import get_recipe
from ..scaling import expand
from . import base
from .layout import BLOCK_SCALED, D_DTYPES, LayerQuant
from .loader import Checkpoint, load_checkpoint
from .plan import FUSED_SIBLINGS, linear_layers
from .scales import STORE_DTYPES, amax_scale, as_stored, input_scale
from .writer import config_files, copy_others, progress_bar, refuse_collisions, write_metadata, write_shard

_NAMES = {v: k for k, v in D_DTYPES.items()} | {"F8_E8M0": "float8_e8m0fnu"}
_SCALE_ROLES = ("weight_scale", "input_scale", "weight_global")


@dataclass
class LayerCost:
    """What converting one layer changed (all zero for an exact layer)."""

    layer: str
    exact: bool
    source: str  # LayerQuant.describe() of the source and the target
    target: str
    recipe: str | None  # the requantizing recipe (None: exact)
    why: str  # why it is not exact ('' when it is)
    elements: int = 0
    codes_changed: int = 0
    scales: int = 0  # target weight-scale elements (block scales, plus the NVFP4 global)
    scales_changed: int = 0
    input_scale_changed: bool = False
    max_abs_error: float = 0.0  # max |x_target - x_source| over the dequantized weight, exact then rounded
    max_rel_error: float = 0.0  # max |x_target - x_source| / |x_source| over x_source != 0

    @property
    def codes_share(self) -> float:
        return self.codes_changed / self.elements if self.elements else 0.0


@dataclass
class ConvertReport:
    source: str
    output: str
    source_format: str
    format: str
    layers: list[LayerCost]
    kv: list[dict] = field(default_factory=list)  # per KV scale: name, target name, exact, source, target value

    @property
    def exact(self) -> bool:
        return all(c.exact for c in self.layers) and all(k["exact"] for k in self.kv)

    def totals(self) -> dict:
        lossy = [c for c in self.layers if not c.exact]
        elements = sum(c.elements for c in self.layers)
        changed = sum(c.codes_changed for c in self.layers)
        return {"layers": len(self.layers), "exact_layers": len(self.layers) - len(lossy),
                "requantized_layers": len(lossy), "elements": elements, "codes_changed": changed,
                "codes_share": changed / elements if elements else 0.0,
                "scales": sum(c.scales for c in self.layers),
                "scales_changed": sum(c.scales_changed for c in self.layers),
                "input_scales_changed": sum(c.input_scale_changed for c in self.layers),
                "kv_scales_changed": sum(not k["exact"] for k in self.kv),
                "max_abs_error": max((c.max_abs_error for c in self.layers), default=0.0),
                "max_rel_error": max((c.max_rel_error for c in self.layers), default=0.0)}

    def as_dict(self) -> dict:
        return {"source": self.source, "output": self.output, "source_format": self.source_format,
                "format": self.format, "exact": self.exact, "totals": self.totals(),
                "layers": [asdict(c) | {"codes_share": c.codes_share} for c in self.layers], "kv": self.kv}


# --- exact re-expression of scale values ----------------------------------------------------------

def reexpress(values: np.ndarray, dtype: str) -> np.ndarray | None:
    """float32 scale values as ``dtype`` (F32, BF16, F16, F8_E8M0) when every one is exact there, else None."""
    v = np.asarray(values, np.float32)
    if not np.isfinite(v).all():
        return None
    if dtype == "F32":
        return v
    if dtype == "BF16":
        return v if not (v.view(np.uint32) & np.uint32(0xFFFF)).any() else None
    if dtype == "F16":
        with np.errstate(over="ignore"):
            return v if np.array_equal(v.astype(np.float16).astype(np.float32), v) else None
    if dtype == "F8_E8M0":
        m, e = np.frexp(v.astype(np.float64))
        return v if ((m == 0.5) & (e - 1 >= -127) & (e - 1 <= 127)).all() else None
    return None


def _reciprocal(g: np.ndarray) -> np.ndarray | None:
    """1 / g when it is exact in float32 (g a power of two), else None: the NVFP4 divisor <-> multiplier."""
    g = np.asarray(g, np.float32)
    m, _ = np.frexp(g.astype(np.float64))
    if not (np.isfinite(g).all() and (m == 0.5).all()):
        return None
    r = (1.0 / g.astype(np.float64)).astype(np.float32)
    return r if np.array_equal(1.0 / r.astype(np.float64), g.astype(np.float64)) else None


# --- choosing the target layout -------------------------------------------------------------------

def _candidates(q: LayerQuant, module) -> list[LayerQuant]:
    """The target layouts to try, in order: the source's (in the target's NVFP4/ue8m0 vocabulary), the
    same weights with another input mode, then other weight layouts of the same element format."""
    kw = {"weight_fmt": q.weight_fmt}
    first = replace(q, global_scale=(module.nvfp4_global or q.global_scale) if q.global_scale else None,
                    scale_fmt=q.scale_fmt if module.pow2_scale_fmt else "float")
    out = [first]
    inputs = (["static"] if q.input == "static" else []) + ["dynamic-token", "dynamic-tensor", None]
    if q.weight_fmt == "float8_e4m3fn":
        layouts = [(q.weight_strategy, q.block)] if q.weight_strategy not in BLOCK_SCALED else []
        layouts += [w for w in (("tensor", None), ("channel", None), ("block", (128, 128))) if w not in layouts]
        for strategy, block in layouts:
            if strategy == "block":  # block weights take 1 x block-columns input groups (hf-fp8's rule)
                out.append(LayerQuant(strategy, block, "dynamic-group", block[1], **kw))
            out += [LayerQuant(strategy, block, mode, None, **kw) for mode in inputs]
        out += [LayerQuant("mx", None, "mx", **kw), LayerQuant("mx", None, None, **kw)]
    elif module.nvfp4_global:
        out += [LayerQuant("nvfp4", None, i, global_scale=module.nvfp4_global, input_fmt=q.weight_fmt, **kw)
                for i in ("nvfp4", None)]
    if q.weight_fmt == "float4_e2m1fn":
        out += [LayerQuant("mx", None, "mx", input_fmt=q.weight_fmt, **kw), LayerQuant("mx", None, None, **kw)]
    return out


def target_quant(q: LayerQuant, module) -> LayerQuant | None:
    """The first of ``_candidates`` the target format can express (None: none)."""
    return next((c for c in _candidates(q, module) if module.cannot_express(c) is None
                 and not (c.weight_strategy == "nvfp4" and module.nvfp4_global is None)), None)


# --- exact values and the cost --------------------------------------------------------------------

def _numerator(codes: np.ndarray, scale: np.ndarray, q: LayerQuant, shape: tuple,
               g: float | None) -> tuple[np.ndarray, float | None]:
    """(decode(q) * s_b (* multiplier), divisor or None): the value is numerator / divisor. The
    products are exact in float64 (E4M3 x fp32: 28 significant bits; E2M1 x E4M3 x fp32: 30)."""
    vals = decode(codes, q.weight_fmt).astype(np.float64)
    s = np.asarray(scale, np.float64)
    if q.weight_strategy in BLOCK_SCALED:
        s = np.repeat(s.reshape(shape[0], -1), BLOCK_SCALED[q.weight_strategy][0], axis=1)[:, :shape[1]]
    elif q.weight_strategy == "block":
        s = expand(s, shape, "block", block_shape=q.block)[:shape[0], :shape[1]]
    elif q.weight_strategy == "channel":
        s = s.reshape(shape[0], 1)
    else:
        s = s.reshape(())
    num = vals * s
    if g is not None and q.global_scale == "multiplier":
        return num * np.float64(g), None
    return num, g


def _errors(src: tuple, dst: tuple) -> tuple[float, float]:
    """(max |b - a|, max |b - a| / |a| over a != 0) of the dequantized values, exact then rounded once.
    Without divisors a and b are exact float64 values and |b - a| is rounded once, so its float64
    maximum is the exact maximum rounded; otherwise float64 picks the candidates (within 2**-40 of
    its maximum) and Fractions decide, once per distinct (numerator, numerator) pair."""
    (ns, gs), (nd, gd) = src, dst
    ns, nd = ns.reshape(-1), nd.reshape(-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        a = ns if gs is None else ns / gs
        b = nd if gd is None else nd / gd
        d = np.abs(b - a)
        r = np.where(a != 0, d / np.abs(a), 0.0)
    out = []
    for approx, relative in ((d, False), (r, True)):
        top = float(approx.max()) if approx.size else 0.0
        if top == 0 or (not relative and gs is None and gd is None):
            out.append(top)
            continue
        idx = np.flatnonzero(approx >= top * (1 - 2.0**-40))
        best = Fraction(0)
        for x, y in np.unique(np.stack([ns[idx], nd[idx]], axis=1), axis=0):
            ea = Fraction(float(x)) / (Fraction(gs) if gs is not None else 1)
            eb = Fraction(float(y)) / (Fraction(gd) if gd is not None else 1)
            best = max(best, abs(eb - ea) / abs(ea) if relative else abs(eb - ea))
        out.append(float(best))
    return out[0], out[1]


# --- the plan ---------------------------------------------------------------------------------------

@dataclass
class _Layer:
    name: str
    layer: object  # QuantizedLayer
    target: LayerQuant
    plan: list  # (role, name, dtype, shape)
    exact: bool
    why: str
    recipe: str | None
    values: dict = field(default_factory=dict)  # exact path: role -> re-expressed scale values


def _exact_scales(layer, target: LayerQuant, plan: list) -> tuple[dict | None, str]:
    """Role -> the source's scale values re-expressed for ``plan``, or (None, why not)."""
    q = layer.quant
    if (target.weight_strategy, target.block, target.weight_fmt) != (q.weight_strategy, q.block, q.weight_fmt):
        return None, f"the target holds {target.describe()}"
    if (target.input, target.input_group, target.input_fmt if target.input else None) != \
            (q.input, q.input_group, q.input_fmt if q.input else None):
        return None, f"the target quantizes inputs as {target.describe()}"
    values = {}
    for role, _, dtype, shape in plan:
        if role not in _SCALE_ROLES:
            continue
        stored = getattr(layer, role)
        if stored is None:
            return None, f"the source has no {role}"
        v = np.asarray(stored).astype(np.float32)
        if prod(shape) != v.size:
            return None, f"{role} has {v.size} values, the target {prod(shape)}"
        block = role == "weight_scale" and q.weight_strategy in BLOCK_SCALED
        if block:
            values[role] = None  # E4M3 / E8M0 bytes, copied
            continue
        nvfp4_global = q.weight_strategy == "nvfp4" and role in ("weight_global", "input_scale")
        if nvfp4_global and target.global_scale != q.global_scale:
            v = _reciprocal(v)
            if v is None:
                return None, (f"{role}: the {q.global_scale} {float(np.asarray(stored).reshape(-1)[0])!r} has no "
                              f"exact float32 reciprocal")
        r = reexpress(v, dtype)
        if r is None:
            return None, f"{role}: its values are not exact in {dtype}"
        values[role] = r.reshape(shape)
    return values, ""


def plan_conversion(ckpt, fmt: str) -> list[_Layer]:
    module = base.get(fmt)
    out = []
    for name, layer in ckpt.items():
        base.refuse_fused(ckpt, layer, module)
        target = target_quant(layer.quant, module)
        if target is None:
            raise CheckpointError(f"{ckpt.path}: layer {name!r} ({layer.quant.describe()}): the {fmt} format has no "
                                  f"layout for {layer.quant.weight_fmt} weights: "
                                  f"{module.cannot_express(_candidates(layer.quant, module)[0])}")
        o, i = layer.shape
        plan = module.tensor_plan(name, target, o, i, ckpt.dtype)
        if fmt == ckpt.format:  # the same format: the source's own scale dtypes (write_checkpoint's rule)
            own = {r: ckpt.store.info(t).dtype for r, t in layer.tensors.items() if r in _SCALE_ROLES}
            plan = [(r, n, own.get(r, d), s) for r, n, d, s in plan]
        values, why = _exact_scales(layer, target, plan)
        recipe = None if values is not None else module.recipe_of(target)
        out.append(_Layer(name, layer, target, plan, values is not None, why, recipe, values or {}))
    return out


# --- requantization ---------------------------------------------------------------------------------

def _requantize(ckpt, p: _Layer, global_amax: float | None) -> tuple[dict, LayerCost]:
    """Output tensors (name -> array) of a lossy layer, and its cost."""
    layer, t, dtype = p.layer, p.target, ckpt.dtype
    roles = {r: (n, d, s) for r, n, d, s in p.plan}
    w = layer.dequantize(dtype)
    rec = get_recipe(p.recipe)
    block = t.weight_strategy in BLOCK_SCALED
    try:
        if block:
            res = quantize(w, QuantArgs(format=t.weight_fmt, granularity=t.weight_strategy), recipe=rec,
                           **({"amax": global_amax} if t.weight_strategy == "nvfp4" and global_amax else {}))
        else:
            res = quantize(w, QuantArgs(format=t.weight_fmt, granularity=t.weight_strategy, block_shape=t.block),
                           recipe=rec)
    except Fp8RefError as exc:
        raise CheckpointError(f"{layer.name}: requantizing with recipe {rec.name!r}: {exc}") from None
    codes = np.asarray(res.codes)
    tensors = {roles["weight"][0]: pack_codes(codes, t.weight_fmt) if t.packed else codes}
    name, sdtype, shape = roles["weight_scale"]
    scale = np.asarray(res.scale, np.float32)
    if block:
        tensors[name] = np.asarray(res.scale_codes, np.uint8).reshape(shape)
    else:
        if sdtype != "F32" and STORE_DTYPES[res.scale_dtype] != sdtype:
            raise CheckpointError(f"{layer.name}: recipe {rec.name!r} stores {res.scale_dtype} scales, the target "
                                  f"{sdtype}")
        tensors[name] = as_stored(scale, sdtype).reshape(shape)
    g = None
    if "weight_global" in roles:
        g = np.float32(np.asarray(res.global_scale, np.float32).reshape(-1)[0])
        name, _, shape = roles["weight_global"]
        tensors[name] = np.asarray(res.global_scale, np.float32).reshape(shape)
    in_changed = False
    if "input_scale" in roles:
        src_in = float(np.asarray(layer.input_scale, np.float32).reshape(-1)[0])
        name, sdtype, shape = roles["input_scale"]
        if t.weight_strategy == "nvfp4":  # the input amax the source global encodes
            amax = 2688.0 / src_in if layer.quant.global_scale == "divisor" else src_in * 2688.0
            new = input_scale(amax, rec, t, dtype)
            in_changed = float(new[0]) != (src_in if t.global_scale == layer.quant.global_scale else 1 / src_in)
        else:
            new = input_scale(src_in * 448.0, rec, t, dtype)
            in_changed = float(new[0]) != src_in
        tensors[name] = as_stored(new, sdtype).reshape(shape)
    q = layer.quant
    src = _numerator(layer.weight_codes, np.asarray(layer.weight_scale).astype(np.float32), q, layer.shape,
                     None if layer.weight_global is None else float(np.asarray(layer.weight_global).reshape(-1)[0]))
    dst = _numerator(codes, scale, t, layer.shape, None if g is None else float(g))
    abs_err, rel_err = _errors(src, dst)
    old_scale = np.asarray(layer.weight_scale).astype(np.float32).reshape(-1)
    changed = scale.size if old_scale.size != scale.size else int(np.count_nonzero(old_scale != scale.reshape(-1)))
    n_scales = scale.size
    if g is not None:
        n_scales += 1
        old_g = float(np.asarray(layer.weight_global).reshape(-1)[0])
        same_meaning = t.global_scale == q.global_scale
        changed += int(float(g) != (old_g if same_meaning else 1 / old_g))
    cost = LayerCost(layer.name, False, q.describe(), t.describe(), rec.name, p.why, codes.size,
                     int(np.count_nonzero(codes != layer.weight_codes)), n_scales, changed, in_changed,
                     abs_err, rel_err)
    return tensors, cost


def _global_amax(ckpt, plans: list[_Layer]) -> dict[str, float]:
    """nvfp4 targets: the max dequantized-weight amax over each layer's fused siblings (as export fuses)."""
    nv = {p.name: p for p in plans if not p.exact and p.target.weight_strategy == "nvfp4"}
    amax = {n: float(np.max(np.abs(p.layer.dequantize(ckpt.dtype).astype(np.float64)))) for n, p in nv.items()}
    out = {}
    for n in nv:
        parent, leaf = n.rsplit(".", 1) if "." in n else ("", n)
        group = next((g for g in FUSED_SIBLINGS if leaf in g), (leaf,))
        out[n] = max(amax[m] for m in (f"{parent}.{x}" if parent else x for x in group) if m in amax)
    return out


# --- KV-cache scales --------------------------------------------------------------------------------

def _kv_strategy(ckpt, kv: bool) -> bool | str:
    """The ``kv`` argument of a config writer: "attn_head" where the KV-cache scales are per head."""
    per_head = any(int(np.prod(ckpt.store.info(n).shape)) > 1 for n in ckpt.kv_scales.values())
    return "attn_head" if kv and per_head else kv


def _attention_option(ckpt, module, options: dict) -> None:
    """Where the checkpoint holds query scales: the target format's attention group targets."""
    query = sorted(n.rsplit(".", 1)[0] for n in ckpt.kv_scales.values() if n.endswith(".q_scale"))
    if query:
        options["attention"] = module.attention_targets(ckpt.config, query, ckpt.quantization_config)


def _plan_kv(ckpt, module) -> dict[str, tuple[str, str, tuple, np.ndarray, dict]]:
    """Source KV tensor -> (target name, dtype, shape, values, report row)."""
    if not ckpt.kv_scales:
        return {}
    names = sorted(ckpt.kv_scales.values())
    if module.kv_refusal:
        raise CheckpointError(f"{ckpt.store.where(names[0])}: a KV-cache scale, but the {module.name} format cannot "
                              f"express it: {module.kv_refusal}")
    out = {}
    by_attn: dict[str, dict] = {}
    for n in names:
        attn, which = base.kv_parts(n)
        tname, shape = module.kv_tensor(n, ckpt.store.info(n).shape)
        value = np.asarray(ckpt.store.get(n)).astype(np.float32).reshape(-1)  # one, or one per head
        by_attn.setdefault(attn, {})[which] = (n, tname, shape, value)
    for pair in by_attn.values():
        shared = max(float(v[3].max()) for v in pair.values()) if module.kv_shared else None
        for n, tname, shape, value in pair.values():
            want = value if shared is None else np.full_like(value, shared)
            store_as = module.kv_store or "model"
            dtype = D_DTYPES[ckpt.dtype] if store_as == "model" else store_as
            if module.name == ckpt.format:
                dtype = ckpt.store.info(n).dtype
            r = reexpress(want, dtype)
            exact = bool(r is not None and np.array_equal(want, value))
            if r is None:  # requantize: the KV rule of the target on amax = 448 * s
                rec = get_recipe(module.kv_recipe or "compressed-tensors")
                r = np.concatenate([amax_scale(float(w) * 448.0, rec, "float8_e4m3fn", ckpt.dtype,
                                               "model" if module.kv_store is None else _NAMES[dtype]) for w in want])
            one = value.size == 1
            row = {"name": n, "target": tname, "exact": exact,
                   "source_value": float(value[0]) if one else value.tolist(),
                   "target_value": float(r.reshape(-1)[0]) if one else r.reshape(-1).tolist()}
            out[n] = (tname, dtype, tuple(shape), as_stored(r.astype(np.float32), dtype).reshape(shape), row)
    return out


# --- the conversion ---------------------------------------------------------------------------------

def convert_checkpoint(checkpoint, output: str | os.PathLike, *, format: str, exact_only: bool = False,
                       force: bool = False, progress: bool = False, symlinks_out: bool = False,
                       config_version: str | None = None) -> ConvertReport:
    """Write ``checkpoint`` (a loaded Checkpoint or a path) in ``format`` at ``output``; return what it cost.

    Exact layers keep their codes and scale values; the others are requantized by the target's recipe
    (see the module doc). ``exact_only``: refuse (CheckpointError, nothing written) if any layer or KV
    scale would change. The output is written atomically; an existing ``output`` needs ``force``.
    ``config_version``: the producer version whose config writer to follow (compressed-tensors 0.19 or
    0.20; None: the newest)."""
    module = base.get(format)
    options = base.config_options(module, config_version)
    ckpt = checkpoint if hasattr(checkpoint, "store") else load_checkpoint(checkpoint, symlinks_out=symlinks_out)
    if not len(ckpt):
        raise CheckpointError(f"{ckpt.path}: no quantized layers to convert (to quantize original weights: "
                              f"fp8ref quantize)")
    if hasattr(module, "layer_plan"):  # fused experts (gpt-oss): their own format's checkpoints, rewritten
        return _rewrite_fused(ckpt, output, format, force=force, symlinks_out=symlinks_out,
                              config_version=config_version)
    plans = plan_conversion(ckpt, format)
    kv = _plan_kv(ckpt, module)
    _attention_option(ckpt, module, options)
    lossy = [p for p in plans if not p.exact]
    lossy_kv = [row for *_, row in kv.values() if not row["exact"]]
    if exact_only and (lossy or lossy_kv):
        what = (f"layer {lossy[0].name!r}: {lossy[0].why}" if lossy else
                f"KV-cache scale {lossy_kv[0]['name']!r}: {lossy_kv[0]['source_value']!r} is not exact in the target")
        raise CheckpointError(f"{ckpt.path}: converting to {format} is not exact ({len(lossy)} layer(s), "
                              f"{len(lossy_kv)} KV scale(s) would change; {what}); nothing written")
    layers = {p.name: p.target for p in plans}
    qc = module.quantization_config(layers, [m for m in linear_layers(ckpt.store) if m not in layers],
                                    kv=_kv_strategy(ckpt, bool(kv)), **options)
    store = ckpt.store
    refuse_collisions(store, qc, module)
    by_weight = {p.layer.tensors["weight"]: p for p in plans}
    owned = {t for p in plans for r, t in p.layer.tensors.items() if r != "bias"}
    amax = _global_amax(ckpt, plans)
    costs: dict[str, LayerCost] = {}
    bar = progress_bar(len(plans), progress, desc="convert", unit="layer")

    def layer_items(p: _Layer):
        if p.exact:
            src = p.layer.tensors
            for role, name, dtype, shape in p.plan:
                value = p.values.get(role)
                raw = store.file_of(src[role]).read_bytes(src[role]) if value is None else None
                yield name, raw if value is None else as_stored(value, dtype).reshape(shape)
            costs[p.name] = LayerCost(p.name, True, p.layer.quant.describe(), p.target.describe(), None, "",
                                      prod(p.layer.shape), scales=sum(prod(s) for r, _, _, s in p.plan
                                                                      if r in ("weight_scale", "weight_global")))
        else:
            tensors, costs[p.name] = _requantize(ckpt, p, amax.get(p.name))
            for _, name, _, _ in p.plan:
                yield name, tensors[name]
        bar.update(1)

    with atomic_folder(output, force=force, protect=[ckpt.path]) as tmp:
        weight_map, total_size = {}, 0
        for fname, f in store.files.items():
            specs, order = [], []
            for n, info in f.tensors.items():
                if n in by_weight:
                    p = by_weight[n]
                    specs += [TensorSpec(name, dtype, tuple(shape)) for _, name, dtype, shape in p.plan]
                    order.append(("layer", p))
                elif n in kv:
                    tname, dtype, shape, _, _ = kv[n]
                    specs.append(TensorSpec(tname, dtype, shape))
                    order.append(("kv", n))
                elif n not in owned:
                    specs.append(TensorSpec(n, info.dtype, info.shape))
                    order.append(("copy", n))

            def items(f=f, order=order):
                for kind, what in order:
                    if kind == "layer":
                        yield from layer_items(what)
                    elif kind == "kv":
                        yield kv[what][0], kv[what][3]
                    else:
                        yield what, f.read_bytes(what)

            total_size += write_shard(tmp, fname, specs, f.metadata, items(), weight_map)
        config = {k: v for k, v in ckpt.config.items() if k != "quantization_config"}
        write_metadata(tmp, store.index is not None, weight_map, total_size, config, qc, module)
        if ckpt.path.is_dir():
            copy_others(ckpt.path, tmp, set(store.files) | {INDEX_NAME, "config.json"} | config_files(),
                         symlinks_out=symlinks_out)
    bar.close()
    return ConvertReport(str(ckpt.path), str(output), ckpt.format, format, [costs[p.name] for p in plans],
                         [row for *_, row in kv.values()])


__all__ = ["ConvertReport", "LayerCost", "convert_checkpoint", "reexpress", "target_quant"]


def _rewrite_fused(ckpt, output, fmt: str, **options) -> ConvertReport:
    """A format of fused [E, out, in] experts (gpt-oss): a checkpoint of it written again exactly
    (``write_checkpoint``); per-expert linear layers of another format are not fused into it."""
    if ckpt.format != fmt:
        raise CheckpointError(f"{ckpt.path}: a {ckpt.format} checkpoint; the {fmt} format holds fused experts, so "
                              f"convert --format {fmt} rewrites {fmt} checkpoints only (from the original weights: "
                              f"fp8ref quantize --format {fmt})")
    write_checkpoint(ckpt, output, **options)
    store = ckpt.store
    costs = [LayerCost(n, True, layer.quant.describe(), layer.quant.describe(), None, "", prod(layer.shape),
                       scales=prod(store.info(layer.tensors["weight_scale"]).shape)) for n, layer in ckpt.items()]
    return ConvertReport(str(ckpt.path), str(output), ckpt.format, fmt, costs)


def write_checkpoint(checkpoint, output: str | os.PathLike, *, format: str | None = None,
                     force: bool = False, symlinks_out: bool = False, config_version: str | None = None) -> Path:
    """Write a loaded ``Checkpoint`` again, in its own format or another one that can express
    every layer: codes and scale values are copied bit for bit (scales keep their dtype and
    are only reshaped/renamed to the target layout); other tensors and files are copied
    (``symlinks_out``: also files that are symlinks out of the checkpoint folder).
    ``config_version``: as in ``convert_checkpoint``; None: in its own format, the version that wrote it."""
    if not isinstance(checkpoint, Checkpoint):
        raise InputTypeError(f"checkpoint: expected a Checkpoint (fp8ref.load_checkpoint(path)), got "
                             f"{type(checkpoint).__name__}")
    output = path_arg(output, "output")
    fmt = format or checkpoint.format
    module = base.get(fmt)
    if config_version is None and fmt == checkpoint.format:  # written again: as the same writer wrote it
        config_version = module.config_version_of(checkpoint.quantization_config)
    options = base.config_options(module, config_version)
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
        if module.kv_refusal:
            raise CheckpointError(f"{store.where(kname)}: a KV-cache scale, but the {fmt} format cannot express "
                                  f"it: {module.kv_refusal}")
        try:
            renames[kname] = module.kv_tensor(kname, store.info(kname).shape)
        except CheckpointError as exc:
            raise CheckpointError(f"{store.where(kname)}: {str(exc).removeprefix(kname + ': ')}") from None
    _attention_option(checkpoint, module, options)
    layers = {n: layer.quant for n, layer in checkpoint.items()}
    unquantized = [m for m in linear_layers(store) if m not in layers]
    qc = module.quantization_config(layers, unquantized, kv=_kv_strategy(checkpoint, bool(checkpoint.kv_scales)),
                                    **options)
    if fmt == checkpoint.format:
        qc = module.carry_config(checkpoint.quantization_config, qc)
    folder = checkpoint.path if checkpoint.path.is_dir() else checkpoint.path.parent
    refuse_collisions(store, qc, module)
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
            total_size += write_shard(tmp, fname, specs, f.metadata, items, weight_map)
        config = {k: v for k, v in checkpoint.config.items() if k != "quantization_config"}
        write_metadata(tmp, store.index is not None, weight_map, total_size, config, qc, module)
        if checkpoint.path.is_dir():
            copy_others(folder, tmp, set(store.files) | {INDEX_NAME, "config.json"} | config_files(),
                         symlinks_out=symlinks_out)
    return Path(output)
