"""compressed-tensors ``float-quantized`` checkpoints (llm-compressor, auto-round's
``llm_compressor`` export): config parsing, layer resolution, and the config fp8ref writes.

Layout (reference §5.2): ``weight`` F8_E4M3 [out, in]; ``weight_scale`` in the model dtype D,
shaped [1] (tensor), [out, 1] (channel) or [ceil(out/r), ceil(in/c)] (block); ``input_scale``
D [1] for static inputs; KV-cache ``self_attn.{k,v}_scale`` [1] when ``kv_cache_scheme`` is set,
[n_kv_heads, 1, 1] with its ``attn_head`` strategy; ``self_attn.q_scale`` [1] or [n_heads, 1, 1]
from a config group that quantizes an attention module's input (no weights).
"""

from __future__ import annotations

import numpy as np

from ..codec import decode, encode
from ..errors import CheckpointError
from ..formats import FORMATS as FLOAT_FORMATS
from ..io.safetensors import TensorStore
from ..limits import MAX_GROUP, MAX_NAME, int_in, shown
from ..patterns import Pattern
from ..producers import compressed_tensors as ct
from ..quant import dequantize
from .base import Defaults, ScaleDecl, accept, fp8_weights, infer_block, plain_linears, register, unquantized_linears
from .forward import _round, dynamic_scale, fp32_weight_scale, qdq, quantize_block_input
from .layout import BLOCK_SCALED, D_DTYPES, LayerEntry, LayerQuant, to_scheme

NAME = ct.NAME
FP8_FORMATS = ("float-quantized", "naive-quantized", "mixed-precision")
# CT CompressionFormat names of its packed NVFP4 and MX layouts (FINDINGS-FP4-MX §1, §2; mxfp6: 0.20)
BLOCK_FORMATS = ("nvfp4-pack-quantized", "mxfp4-pack-quantized", "mxfp6-pack-quantized", "mxfp8-quantized")
_ELEMENTS = {4: "float4_e2m1fn", 6: "float6_e2m3fn", 8: "float8_e4m3fn"}
FORMATS = FP8_FORMATS + BLOCK_FORMATS
_ARGS_KEYS = set(ct.CT_ARGS_KEYS)


def _args(args: object, where: str) -> dict:
    if not isinstance(args, dict):
        raise CheckpointError(f"{where}: expected an object of quantization args, got {args!r:.100}")
    unknown = sorted(set(args) - _ARGS_KEYS)
    if unknown:
        raise CheckpointError(f"{where}: unknown keys {unknown} (compressed-tensors forbids extra keys)")
    if args.get("type", "int") != "float" or args.get("num_bits", 8) not in _ELEMENTS:
        raise CheckpointError(f"{where}: type {args.get('type')!r} num_bits {args.get('num_bits')!r}; "
                              f"fp8ref loads float types of 8, 6 or 4 bits (type 'float')")
    if args.get("symmetric", True) is not True:
        raise CheckpointError(f"{where}: symmetric {args.get('symmetric')!r}; FP8 checkpoints are symmetric")
    return args


ATTENTION_STRATEGIES = ("tensor", "attn_head")  # static scales of Q, K, V: one, or one per head


def _attention_input(args: object, where: str) -> bool:
    """Whether a group without weights quantizes an attention module's Q: static FP8 input
    activations of strategy ``attn_head`` (per head, attention only) or ``tensor``."""
    if args is None:
        return False
    a = _args(args, where)
    return _strategy(a) in ATTENTION_STRATEGIES and a.get("dynamic", False) is False and a.get("num_bits") == 8


def _strategy(args: dict) -> str:
    strategy = args.get("strategy")
    return ct.infer_strategy(args.get("group_size")) if strategy is None else strategy


def _block_kind(args: dict, where: str) -> tuple[str, str] | None:
    """('nvfp4' | 'mx', element format) for NVFP4 (tensor_group 16, E4M3 scales) and MX (group 32,
    uint8 E8M0 scales; 4, 6 (0.20) or 8 bits) args; None for FP8 args. Anything else 4- or 6-bit is refused."""
    strategy, bits, size = _strategy(args), args.get("num_bits", 8), args.get("group_size")
    sdt = args.get("scale_dtype")
    elem = _ELEMENTS[bits]
    if strategy == "tensor_group" and bits == 4 and size == 16 and sdt in (None, "torch.float8_e4m3fn"):
        return "nvfp4", elem
    if strategy == "group" and size == 32 and sdt in ("torch.uint8", "uint8"):
        return "mx", elem
    if bits in (4, 6) or strategy == "tensor_group":
        raise CheckpointError(f"{where}: {bits}-bit {strategy} group_size {size!r} scale_dtype {sdt!r}; fp8ref "
                              f"reads NVFP4 (tensor_group, 16, float8_e4m3fn) and MX (group, 32, uint8)")
    return None


def _block_quant(kind: str, elem: str, inputs: dict | None, where: str) -> LayerQuant:
    if inputs is None:
        return LayerQuant(kind, None, None, weight_fmt=elem, global_scale="divisor" if kind == "nvfp4" else None)
    a = _args(inputs, f"{where}.input_activations")
    a_kind = _block_kind(a, f"{where}.input_activations")
    if kind == "mx" and a_kind is None and a.get("dynamic") is True and _strategy(a) == "group":
        # MXFP4XFP8 (0.20): FP8 inputs per 1 x group_size, float scales computed at run time
        gs = a.get("group_size")
        if not int_in(gs, 1, MAX_GROUP):
            raise CheckpointError(f"{where}.input_activations.group_size: expected an integer in 1..{MAX_GROUP}, "
                                  f"got {shown(gs)}")
        return LayerQuant(kind, None, "dynamic-group", gs, weight_fmt=elem)
    want = {"nvfp4": "local", "mx": True}[kind]
    if a_kind is None or a_kind[0] != kind or a.get("dynamic") != want:
        raise CheckpointError(f"{where}.input_activations: {kind} weights take {kind} inputs with dynamic "
                              f"{want!r}{' or dynamic FP8 groups' if kind == 'mx' else ''}, got {a!r:.200}")
    return LayerQuant(kind, None, kind, weight_fmt=elem, global_scale="divisor" if kind == "nvfp4" else None,
                      input_fmt=a_kind[1])


def weight_quant(weights: dict, inputs: dict | None, where: str) -> LayerQuant:
    w = _args(weights, f"{where}.weights")
    kind = _block_kind(w, f"{where}.weights")
    if kind is not None:
        if w.get("dynamic", False) is not False:
            raise CheckpointError(f"{where}.weights.dynamic: {w.get('dynamic')!r}; stored weights are static")
        return _block_quant(*kind, inputs, where)
    strategy = _strategy(w)
    if w.get("dynamic", False) is not False:
        raise CheckpointError(f"{where}.weights.dynamic: {w.get('dynamic')!r}; stored weights are static")
    if strategy not in ("tensor", "channel", "block"):
        raise CheckpointError(f"{where}.weights.strategy: {strategy!r}; expected tensor, channel or block")
    block = None
    if strategy == "block":
        bs = w.get("block_structure")
        if not (isinstance(bs, list) and len(bs) == 2 and all(int_in(b, 1, MAX_GROUP) for b in bs)):
            raise CheckpointError(f"{where}.weights.block_structure: expected [rows, cols] of integers in "
                                  f"1..{MAX_GROUP}, got {shown(bs)}")
        block = (bs[0], bs[1])
    if inputs is None:
        return LayerQuant(strategy, block, None)
    a = _args(inputs, f"{where}.input_activations")
    a_strategy, dynamic = _strategy(a), a.get("dynamic", False)
    if dynamic is False:
        if a_strategy != "tensor":
            raise CheckpointError(f"{where}.input_activations: static strategy {a_strategy!r}; "
                                  f"a stored input_scale is per tensor")
        return LayerQuant(strategy, block, "static")
    if dynamic is not True:
        raise CheckpointError(f"{where}.input_activations.dynamic: {dynamic!r}; expected true or false")
    if a_strategy == "group":
        gs = a.get("group_size")
        if not int_in(gs, 1, MAX_GROUP):
            raise CheckpointError(f"{where}.input_activations.group_size: expected an integer in 1..{MAX_GROUP}, "
                                  f"got {shown(gs)}")
        return LayerQuant(strategy, block, "dynamic-group", gs)
    if a_strategy not in ("token", "tensor"):
        raise CheckpointError(f"{where}.input_activations.strategy: {a_strategy!r}; expected token, tensor "
                              f"or group for dynamic inputs")
    return LayerQuant(strategy, block, f"dynamic-{a_strategy}")


def _matches(target: str | Pattern, name: str) -> str | None:
    """How ``target`` (a ``re:`` target compiled) matches layer ``name``: 'name', 'regex', 'class' or
    None. Class names (``Linear``) cannot be checked against a checkpoint and match every quantized layer."""
    if isinstance(target, Pattern):
        return "regex" if target.match(name) else None
    if target == name:
        return "name"
    if "." not in target and target[:1].isupper():
        return "class"
    return None


class Config:
    """A parsed ``quantization_config`` of ``quant_method: compressed-tensors``."""

    def __init__(self, qc: dict, where: str):
        self.where = where
        fmt = qc.get("format")
        if fmt is not None and not isinstance(fmt, str):  # a group's own format may shadow it: check it anyway
            raise CheckpointError(f"{where}.format: expected a compression format name, got {shown(fmt)}")
        self.groups: dict[str, tuple[list[str | Pattern], LayerQuant]] = {}
        self.attention_groups: list[str] = []  # groups quantizing an attention module's Q (q_scale)
        self.kv = qc.get("kv_cache_scheme")
        groups = qc.get("config_groups")
        # llm-compressor writes "config_groups": {} for a checkpoint whose only scheme is the KV cache's
        if not isinstance(groups, dict) or (not groups and self.kv is None):
            raise CheckpointError(f"{where}.config_groups: expected a non-empty object, got {groups!r:.100}")
        for gname, g in groups.items():
            at = f"{where}.config_groups.{gname}"
            if not isinstance(g, dict):
                raise CheckpointError(f"{at}: expected an object, got {g!r:.100}")
            unknown = sorted(set(g) - {"targets", "weights", "input_activations", "output_activations", "format"})
            if unknown:
                raise CheckpointError(f"{at}: unknown keys {unknown}")
            targets = g.get("targets")
            if not (isinstance(targets, list) and targets and all(isinstance(t, str) for t in targets)):
                raise CheckpointError(f"{at}.targets: expected a non-empty list of strings, got {targets!r:.100}")
            if g.get("weights") is None and _attention_input(g.get("input_activations"), f"{at}.input_activations"):
                self.attention_groups.append(gname)
                continue
            if g.get("weights") is None:
                raise CheckpointError(f"{at}.weights: missing; fp8ref loads weight-quantized FP8 layers")
            if g.get("output_activations") is not None:
                raise CheckpointError(f"{at}.output_activations: output quantization is not supported")
            gfmt = g.get("format") or fmt
            if gfmt not in FORMATS:
                raise CheckpointError(f"{at}.format: {gfmt!r}; expected one of {FORMATS} for FP8")
            compiled = [_pattern(t, f"{at}.targets[{i}]") for i, t in enumerate(targets)]
            self.groups[gname] = (compiled, weight_quant(g["weights"], g.get("input_activations"), at))
        ignore = qc.get("ignore", [])
        if not isinstance(ignore, list) or not all(isinstance(i, str) for i in ignore):
            raise CheckpointError(f"{where}.ignore: expected a list of strings, got {shown(ignore, 100)}")
        # a bare "re:" ignores nothing (compressed-tensors skips empty patterns)
        self.ignore = [_pattern(t, f"{where}.ignore[{i}]") for i, t in enumerate(ignore) if t != "re:"]
        status = qc.get("quantization_status", "compressed")
        if status != "compressed":
            raise CheckpointError(f"{where}.quantization_status: {status!r}; only 'compressed' checkpoints "
                                  f"store FP8 codes")
        if self.kv is not None:
            kv = _args(self.kv, f"{where}.kv_cache_scheme")
            if _strategy(kv) not in ATTENTION_STRATEGIES or kv.get("dynamic", False) is not False:
                raise CheckpointError(f"{where}.kv_cache_scheme: expected static per-tensor or per-head "
                                      f"(attn_head), got {self.kv!r:.200}")

    def ignored(self, name: str) -> bool:
        return any(i.match(name) if isinstance(i, Pattern) else i == name for i in self.ignore)

    def resolve(self, name: str) -> tuple[str, LayerQuant, str] | None:
        """The group whose targets match ``name`` best (exact name > regex > class name), its
        quantization, and how it matched."""
        best: dict[str, list[str]] = {}
        for gname, (targets, _) in self.groups.items():
            for t in targets:
                how = _matches(t, name)
                if how:
                    best.setdefault(how, []).append(gname)
        for how in ("name", "regex", "class"):
            names = sorted(set(best.get(how, [])))
            if names:
                quants = {self.groups[g][1] for g in names}
                if len(quants) > 1:
                    raise CheckpointError(f"{self.where}.config_groups: layer {name!r} is matched by "
                                          f"{how} in groups {names} with different schemes")
                return names[0], self.groups[names[0]][1], how
        return None


def _pattern(target: str, where: str) -> str | Pattern:
    """A ``re:`` target or ignore entry compiled (bounded matching, fp8ref.patterns); names as they are."""
    if not target.startswith("re:"):
        if len(target) > MAX_NAME:
            raise CheckpointError(f"{where}: name of {len(target)} characters; at most {MAX_NAME}")
        return target
    return Pattern(target[3:], where, error=CheckpointError)


def layer_entry(name: str, quant: LayerQuant, group: str) -> LayerEntry:
    tensors = {"weight": f"{name}.weight_packed" if quant.packed else f"{name}.weight",
               "weight_scale": f"{name}.weight_scale", "input_scale": f"{name}.input_scale", "bias": f"{name}.bias"}
    if quant.weight_strategy == "nvfp4":  # divisors: x ~ q * weight_scale / weight_global_scale
        tensors.update(weight_global=f"{name}.weight_global_scale", input_scale=f"{name}.input_global_scale")
    return LayerEntry(name, quant, tensors, NAME, group=group)


def scale_shapes(quant: LayerQuant, out: int, inp: int) -> tuple[tuple[int, ...], ...]:
    """Shapes compressed-tensors reads correctly: [out, 1] broadcasts over rows, [out] would not."""
    if quant.weight_strategy == "tensor":
        return ((1,), ())
    return (quant.scale_shape(out, inp),)


def quantized_weights(store: TensorStore) -> list[str]:
    """Modules with a float8 ``.weight`` or a packed FP4 ``.weight_packed`` (U8)."""
    packed = [n[: -len(".weight_packed")] for n in store
              if n.endswith(".weight_packed") and store.info(n).dtype == "U8"]
    return sorted(set(fp8_weights(store)) | set(packed))


KV_NAMES = ("k_scale", "v_scale")


# --- load ------------------------------------------------------------------------------------

def layers(qc, store, where, warnings):
    if qc is None:
        qc = _inferred_config(store)
    cfg = Config(qc, where)
    entries = []
    for name in quantized_weights(store):
        if cfg.ignored(name):
            raise CheckpointError(f"{store.where(name + '.weight')}: float8 weight, but {where}.ignore lists "
                                  f"{name!r}: config and tensors disagree")
        match = cfg.resolve(name)
        if match is None:
            raise CheckpointError(f"{store.where(name + '.weight')}: float8 weight, but no config group in "
                                  f"{where}.config_groups targets {name!r}")
        group, quant, _ = match
        entries.append(accept(store, layer_entry(name, quant, group), scale_shapes))
    modules = {n.rsplit(".", 1)[0] for n in store if "." in n}
    for gname, (targets, _) in cfg.groups.items():
        for i, t in enumerate(targets):  # an exact target is a layer the config says is quantized
            if isinstance(t, str) and _matches(t, "") != "class" and t not in modules:
                raise CheckpointError(f"{where}.config_groups.{gname}.targets[{i}]: {t!r} is a layer no shard "
                                      f"of {store.root} holds ({len(entries)} quantized layers found): a shard or "
                                      f"index entry is missing, or the target is wrong")
    plain = plain_linears(store, entries, ("weight_scale", "input_scale", "weight_global_scale",
                                           "input_global_scale"))
    for module in plain:
        if cfg.ignored(module):
            continue
        match = cfg.resolve(module)
        if match is None:
            continue
        if match[2] != "class":
            raise CheckpointError(f"{store.where(module + '.weight')}: stored unquantized "
                                  f"({store.info(module + '.weight').dtype}), but config group {match[0]!r} "
                                  f"targets {module!r} by name or regex")
        warnings.append(f"{store.where(module + '.weight')}: stored unquantized, but {where}.ignore does not "
                        f"list {module!r}, so compressed-tensors loaders treat it as quantized (transformers "
                        f"initialises missing scales: NaN or huge outputs). Fix: add {module!r} to ignore")
    kv = {}
    if cfg.attention_groups:
        kv.update((n, n) for n in store if n.endswith(".q_scale"))
    if cfg.kv is not None:
        for n in store:
            if n.endswith((".k_scale", ".v_scale", ".k_proj.output_scale", ".v_proj.output_scale")):
                kv[n] = n
        attn = sorted({e.name.rsplit(".", 1)[0] for e in entries if e.name.endswith((".k_proj", ".v_proj"))})
        for a in attn:
            for which in ("k", "v"):
                if f"{a}.{which}_scale" not in kv and f"{a}.{which}_proj.output_scale" not in kv:
                    warnings.append(f"{store.root}: kv_cache_scheme is set but {a}.{which}_scale is missing; "
                                    f"vLLM then uses 1.0 (vllm-project/llm-compressor #2176). Fix: calibrate "
                                    f"the KV cache or drop kv_cache_scheme")
    return entries, kv


def _inferred_config(store: TensorStore) -> dict:
    layers = {}
    block = infer_block(store, "weight_scale")
    for name in fp8_weights(store):
        w = store.info(name + ".weight")
        s = store.info(name + ".weight_scale") if name + ".weight_scale" in store else None
        if s is None or len(w.shape) != 2:
            layers[name] = LayerQuant("tensor", None, "static")  # check_layer reports what is missing
            continue
        out, inp = w.shape
        if s.shape in ((), (1,)):
            quant = LayerQuant("tensor")
        elif s.shape == (out, 1):
            quant = LayerQuant("channel")
        else:
            quant = LayerQuant("block", block)
        has_input = name + ".input_scale" in store
        mode = "static" if has_input else "dynamic-group" if quant.block else "dynamic-token"
        group = block[1] if mode == "dynamic-group" else None
        layers[name] = LayerQuant(quant.weight_strategy, quant.block, mode, group)
    # what is stored unquantized is meant to be: the writer's ignore list says so
    return quantization_config(layers, unquantized_linears(store, set(layers)))


# --- export ----------------------------------------------------------------------------------

def cannot_express(quant: LayerQuant) -> str | None:
    if quant.global_scale == "multiplier":
        return ("compressed-tensors stores NVFP4 global scales as divisors (2688/amax); this layer's are "
                "multipliers (amax/2688), and inverting one is not exact in float32")
    if quant.weight_strategy in BLOCK_SCALED:
        if quant.weight_strategy == "mx" and quant.input == "dynamic-group":
            return None  # MXFP4XFP8 (0.20): FP8 inputs per group, computed at run time
        if (quant.input or quant.weight_strategy) != quant.weight_strategy:
            return (f"compressed-tensors {quant.weight_strategy} layers take {quant.weight_strategy} inputs"
                    f"{', dynamic FP8 groups' if quant.weight_strategy == 'mx' else ''} or none")
        if quant.input == "mx" and (quant.weight_fmt, quant.input_fmt) not in MX_INPUTS:
            return (f"compressed-tensors' MX presets pair {quant.weight_fmt} weights with "
                    f"{' or '.join(i for w, i in MX_INPUTS if w == quant.weight_fmt) or 'no'} MX inputs")
        return None
    if quant.weight_fmt != "float8_e4m3fn":
        return f"compressed-tensors FP8 is float8_e4m3fn only, got {quant.weight_fmt}"
    return None


def tensor_plan(name: str, quant: LayerQuant, out: int, inp: int, dtype: str) -> list[tuple[str, str, str, tuple]]:
    d = D_DTYPES[dtype]
    if quant.weight_strategy in BLOCK_SCALED:
        _, scale_dtype, _ = BLOCK_SCALED[quant.weight_strategy]
        plan = [("weight", f"{name}.weight_packed", "U8", (out, quant.packed_width(inp))) if quant.packed else
                ("weight", f"{name}.weight", "F8_E4M3", (out, inp)),
                ("weight_scale", f"{name}.weight_scale", scale_dtype, quant.scale_shape(out, inp))]
        if quant.weight_strategy == "nvfp4":
            plan.append(("weight_global", f"{name}.weight_global_scale", "F32", (1,)))
            if quant.input == "nvfp4":
                plan.append(("input_scale", f"{name}.input_global_scale", "F32", (1,)))
        return plan
    plan = [("weight", f"{name}.weight", "F8_E4M3", (out, inp)),
            ("weight_scale", f"{name}.weight_scale", d, quant.scale_shape(out, inp))]
    if quant.input == "static":
        plan.append(("input_scale", f"{name}.input_scale", d, (1,)))
    return plan


# (weight, input) element formats of compressed-tensors' MX presets with MX inputs: MXFP4, MXFP8, MXFP6A8 (0.20)
MX_INPUTS = (("float4_e2m1fn", "float4_e2m1fn"), ("float8_e4m3fn", "float8_e4m3fn"),
             ("float6_e2m3fn", "float8_e4m3fn"))


def quantization_config(layers: dict[str, LayerQuant], ignore: list[str], kv: bool | str = False,
                        version: str = ct.DEFAULT_CT_VERSION, attention: list[str] | None = None) -> dict:
    """``quantization_config`` of stored layers, written by the one compressed-tensors writer as
    compressed-tensors ``version`` writes it; ``attention``: the attention group's targets where Q
    is quantized (``attention_targets``)."""
    resolved = {name: to_scheme(q, NAME) for name, q in layers.items()} | dict.fromkeys(ignore)
    return ct.config_for_layers(resolved, kv=kv, version=version, attention=attention)


def attention_targets(config: dict, modules: list[str], source_qc: dict | None = None) -> list[str]:
    """Targets of the attention group that quantizes Q: those of the source's own attention groups
    (a compressed-tensors checkpoint written again), else the attention class llm-compressor's
    examples target, ``<Arch>Attention`` of ``architectures: [<Arch>ForCausalLM]``, else the
    attention modules by name (compressed-tensors matches both narrowly)."""
    if isinstance(source_qc, dict) and source_qc.get("quant_method") == NAME:
        cfg = Config(source_qc, "quantization_config")
        targets = [t for g in cfg.attention_groups for t in source_qc["config_groups"][g]["targets"]]
        if targets:
            return list(dict.fromkeys(targets))
    arch = config.get("architectures") if isinstance(config, dict) else None
    if isinstance(arch, list) and len(arch) == 1 and isinstance(arch[0], str) and arch[0].endswith("ForCausalLM"):
        return [arch[0].removesuffix("ForCausalLM") + "Attention"]
    return sorted(modules)


def _emulate_block(layer, w: np.ndarray, x32: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """NVFP4 / MX (compressed-tensors 0.19.0 _quantize_dequantize, CPU): the decompressed D weight
    is fake-quantized again with its stored scales (eff = fp32(s_b / g), or 2**k): codes of
    clamp(R(w / eff) + 0), R = fp32 for NVFP4 and D for MX (exact), then D(fp32(decode * eff)); the
    input is quantized at run time by the same recipe (NVFP4: with the stored input_global_scale
    divisor; MX: its round_to_power_2 exponents)."""
    import torch


    q = layer.quant
    fmt = FLOAT_FORMATS[q.weight_fmt]
    eff = fp32_weight_scale(layer)
    with np.errstate(divide="ignore", invalid="ignore"):
        y = w / eff
    y = (_round(y, dtype) if q.weight_strategy == "mx" else y.astype(np.float32)) + np.float32(0.0)
    codes = encode(np.clip(y, -fmt.max, fmt.max).astype(np.float32), fmt)
    w = _round(decode(codes, fmt) * eff, dtype)
    if q.input == "dynamic-group":  # MXFP4XFP8: CT's dynamic FP8 group quantization, as for FP8 weights
        _check_groups(layer, x32)
        x32 = qdq(x32, dynamic_scale(x32, q.input, q.input_group, dtype), dtype, d_division=True,
                  positive_zero=True)
    elif q.input is not None:
        xt = torch.from_numpy(np.ascontiguousarray(x32)).to(getattr(torch, dtype))  # x32 holds D values: exact
        x32 = dequantize(quantize_block_input(layer, xt), dtype=dtype).to(torch.float32).numpy()
    return w, x32


def _check_groups(layer, x32: np.ndarray) -> None:
    if x32.shape[-1] % layer.quant.input_group:
        raise CheckpointError(f"{layer.name}: compressed-tensors' dynamic group quantization needs the "
                              f"input width {x32.shape[-1]} to be a multiple of {layer.quant.input_group} (its "
                              f"loader raises here); mode='reference' pads the last group")


def emulate(layer, w: np.ndarray, x32: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """mode="producer": transformers decompresses to D, then CT's forward fake-quantizes the weight
    again with the same scale (a no-op on the codes, but rounded to D once more) and the input."""
    if layer.quant.weight_strategy in BLOCK_SCALED:
        return _emulate_block(layer, w, x32, dtype)
    s_w = np.asarray(layer.expanded_scale(), np.float32)
    w = qdq(w, s_w, dtype, d_division=True, positive_zero=True)
    q = layer.quant
    if q.input == "static":
        x32 = qdq(x32, np.float32(np.asarray(layer.input_scale).astype(np.float32).reshape(-1)[0]), dtype,
                  d_division=True, positive_zero=True)
    elif q.input is not None:
        if q.input == "dynamic-group":
            _check_groups(layer, x32)
        x32 = qdq(x32, dynamic_scale(x32, q.input, q.input_group, dtype), dtype, d_division=True,
                  positive_zero=True)
    return w, x32


def emulate_experts(layer, dtype: str) -> np.ndarray:
    """mode="producer" of an MoE expert (transformers 5.17's ``DecompressExperts``): each expert's FP8
    weight becomes ``bfloat16(fp32(q) * fp32(s))``, the stored scale broadcast as it stands (so block
    scales only broadcast where a weight is a single block, or one block per row or column), always
    bfloat16, then copied into the model's fused parameter in D. The fused experts are no nn.Linear:
    compressed-tensors never wraps them, so their inputs are not quantized."""
    q = layer.quant
    if q.weight_fmt != "float8_e4m3fn" or q.weight_strategy not in ("tensor", "channel", "block"):
        raise CheckpointError(f"{layer.name}: producer mode models compressed-tensors' FP8 experts only "
                              f"(transformers' DecompressExperts FP8 path); this expert is {q.weight_strategy} "
                              f"{q.weight_fmt}")
    codes = decode(layer.weight_codes, q.weight_fmt).astype(np.float32)
    s = np.asarray(layer.weight_scale).astype(np.float32)
    try:
        np.broadcast_shapes(codes.shape, s.shape)
    except ValueError:
        raise CheckpointError(f"{layer.name}: transformers' DecompressExperts multiplies the expert's weight "
                              f"{list(codes.shape)} by its weight_scale {list(s.shape)} by broadcasting, which "
                              f"fails: transformers cannot reload this checkpoint (use mode='reference')") from None
    return _round(_round(codes * s, "bfloat16"), dtype)


class CompressedTensors(Defaults):
    name = NAME
    scales = (
        ScaleDecl("tensor", "weight_scale", "multiplier", "D", "[1] ([] read)", "-"),
        ScaleDecl("channel", "weight_scale", "multiplier", "D", "[out, 1]", "-"),
        ScaleDecl("block", "weight_scale", "multiplier", "D", "[ceil(out/r), ceil(in/c)]",
                  "weights.block_structure [r, c]"),
        ScaleDecl("tensor/channel/block, static input", "input_scale", "multiplier", "D", "[1]"),
        ScaleDecl("nvfp4", "weight_scale", "multiplier", "F8_E4M3", "[out, in/16]",
                  "weights.group_size 16 (strategy tensor_group)", "x ~ q * weight_scale / weight_global_scale"),
        ScaleDecl("nvfp4", "weight_global_scale", "divisor", "F32", "[1]", "-", "fp32(D(D(1 / amax) * 2688))"),
        ScaleDecl("nvfp4, nvfp4 input", "input_global_scale", "divisor", "F32", "[1]",
                  "input_activations.group_size 16", "dynamic local: block scales at run time"),
        ScaleDecl("mx", "weight_scale", "E8M0 exponent", "U8", "[out, in/32]", "weights.group_size 32 "
                  "(strategy group, scale_dtype torch.uint8)"),
        ScaleDecl("KV cache", "self_attn.{k,v}_scale", "multiplier", "D", "[1]", "-"),
        ScaleDecl("KV cache, attn_head", "self_attn.{k,v}_scale", "multiplier", "D", "[n_kv_heads, 1, 1]",
                  "kv_cache_scheme.strategy attn_head", "one scale per KV head"),
        ScaleDecl("attention input (Q)", "self_attn.q_scale", "multiplier", "D", "[1] or [n_heads, 1, 1]",
                  "input_activations.strategy tensor / attn_head of a group without weights"),
    )
    methods = ("compressed-tensors",)
    original_names = ct.ORIGINAL_NAMES  # llm-compressor's Mixtral expert renaming
    detect_rank = 2  # the fallback: float8 weights with plain weight_scale tensors
    scheme_scale_dtype = "model"
    scales_follow_recipe = True
    kv_refusal = None
    kv_per_head = True  # kv_cache_scheme strategy attn_head: self_attn.{k,v}_scale [n_kv_heads, 1, 1]
    kv_query = True  # self_attn.q_scale from an attention group ([1], or [n_heads, 1, 1] per head)
    nvfp4_global = "divisor"
    config_versions = ct.CT_VERSIONS

    def detect(self, store: TensorStore, fp8_layers: list[str]) -> bool:
        return True

    def block_input_recipe(self, quant: LayerQuant) -> str:
        """MX inputs go through compressed-tensors' dynamic fake quantization in every version: the zero point
        is added and E4M3 / E2M1 take the 1.75 rule, also under MXFP6 weights (MXFP6A8)."""
        return "compressed-tensors-mx" if quant.input == "mx" else self.recipe_of(quant)

    def config_version_of(self, source: dict | None) -> str | None:
        """0.20 writes ``moe_sparsity_config`` (null or not), 0.19 does not (fp8ref's writers as well)."""
        if not isinstance(source, dict):
            return None
        return "0.20" if "moe_sparsity_config" in source else "0.19"

    def recipe_of(self, quant: LayerQuant) -> str:
        if quant.weight_strategy == "mx" and quant.weight_fmt == "float6_e2m3fn":
            return "compressed-tensors-mx-0.20"  # MXFP6 exists from 0.20 on; 0.20's MXFP4 bytes are 0.19's
        return {"nvfp4": "compressed-tensors-nvfp4", "mx": "compressed-tensors-mx"}.get(quant.weight_strategy, NAME)

    layers = staticmethod(layers)
    cannot_express = staticmethod(cannot_express)
    tensor_plan = staticmethod(tensor_plan)
    quantization_config = staticmethod(quantization_config)
    attention_targets = staticmethod(attention_targets)
    emulate = staticmethod(emulate)
    emulate_experts = staticmethod(emulate_experts)


register(CompressedTensors())
