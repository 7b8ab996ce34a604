"""The compressed-tensors vocabulary (llm-compressor, auto-round's ``llm_compressor`` export):
``QuantizationArgs`` <-> ``QuantizationScheme`` and ``quantization_config`` <-> ``LayerConfig``.

One reader and one writer, used by schemes, specs and checkpoints alike. What is written is what
the chosen compressed-tensors version serialises (``version``, default the newest): 0.19.0 writes every
``QuantizationArgs`` key (REFERENCE §5.2; checked against the llm-compressor fixtures under
tests/fixtures/interop/checkpoints), 0.20.1 leaves out the keys nobody set and adds
``moe_sparsity_config`` (checked against its own writer: tests/fixtures/interop/checkpoints/ct020_*);
what is read is either form.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping

from ..errors import SpecError, did_you_mean
from ..scheme import ACT_GRANULARITIES, PRESETS, QuantizationScheme, SchemeFieldError, default_scale_dtype
from ..spec import LayerConfig, Rule, Selector

NAME = "compressed-tensors"
# the config writers fp8ref reproduces, oldest first; the default is the newest
CT_VERSIONS = ("0.19", "0.20")
DEFAULT_CT_VERSION = CT_VERSIONS[-1]
# kv_cache_scheme exactly as compressed-tensors 0.19.0 serialises a static per-tensor FP8 KV cache
# (every QuantizationArgs key, observer null; measured with llm-compressor 0.14 oneshot + save_pretrained).
# The scales it goes with: ``<attn>.k_scale`` / ``<attn>.v_scale``, [1], in the model dtype.
KV_CACHE_SCHEME = {"actorder": None, "block_structure": None, "dynamic": False, "group_size": None, "num_bits": 8,
                   "observer": None, "observer_kwargs": {}, "scale_dtype": None, "strategy": "tensor",
                   "symmetric": True, "type": "float", "zp_dtype": None}


# llm-compressor 0.14.0.1 saves a Mixtral under transformers 5's expert names (gate/up/down_proj) while the
# original checkpoint, and transformers' own loader, name them w1/w3/w2 (w1 = gate, w3 = up, w2 = down):
# (regex on a layer name of its output, replacement) -> the original layer name (verify --original).
ORIGINAL_NAMES = ((r"^(.*\.block_sparse_moe\.experts\.\d+)\.gate_proj$", r"\1.w1"),
                  (r"^(.*\.block_sparse_moe\.experts\.\d+)\.up_proj$", r"\1.w3"),
                  (r"^(.*\.block_sparse_moe\.experts\.\d+)\.down_proj$", r"\1.w2"))


# --- QuantizationArgs ------------------------------------------------------------------------
CT_ARGS_KEYS = ("actorder", "block_structure", "dynamic", "group_size", "num_bits", "observer",
                "observer_kwargs", "scale_dtype", "strategy", "symmetric", "type", "zp_dtype")
# Observers that compute a plain min/max (the only statistic a scheme can express).
_CT_MINMAX = (None, "minmax", "memoryless_minmax", "static_minmax", "memoryless")
_CT_STRATEGY = {"tensor": "tensor", "channel": "channel", "group": "group", "block": "block",
                "tensor_group": "tensor_group", "token": "token"}
_CT_FLOATS = ("float8_e4m3fn", "float6_e2m3fn", "float4_e2m1fn")
_CT_SCALE = {"model": None, "float32": "torch.float32", "bfloat16": "torch.bfloat16", "float16": "torch.float16",
             "float8_e8m0fnu": "torch.uint8", "float8_e4m3fn": "torch.float8_e4m3fn"}


def check_ct_version(version: str) -> str:
    if version not in CT_VERSIONS:
        raise SpecError(f"ct_version: expected one of {', '.join(CT_VERSIONS)}, got {version!r}")
    return version


def to_ct_args(scheme: QuantizationScheme, part: str, version: str = DEFAULT_CT_VERSION) -> dict | None:
    """``QuantizationArgs`` dict of ``part`` ("weights" or "input_activations") as compressed-tensors
    ``version`` writes it: 0.19 every key (REFERENCE §5.2), 0.20 only the keys set (``as_written``);
    None for unquantized activations."""
    s = scheme
    check_ct_version(version)
    if part not in ("weights", "input_activations"):
        raise SpecError(f"part: expected 'weights' or 'input_activations', got {part!r}")
    for field, fmt in (("weight_format", s.weight_format), ("act_format", s.act_format)):
        if fmt is not None and fmt not in _CT_FLOATS:
            raise SchemeFieldError(field, f"compressed-tensors float types are e4m3fn (8 bits), e2m3 (6 bits, "
                                   f"0.20) and e2m1 (4 bits); {fmt} has no equivalent")
        if fmt == "float6_e2m3fn" and version == "0.19":
            raise SchemeFieldError(field, "compressed-tensors 0.19 has no 6-bit floats (MXFP6 came with 0.20)")
    if s.scale_dtype == "float8_e8m0fnu" and s.data_type != "mx_fp":
        raise SchemeFieldError("scale_dtype", "compressed-tensors marks MX by uint8 scales; float8_e8m0fnu "
                               f"scales with data_type {s.data_type!r} would read back as MX")
    if s.rounding != "rne":
        raise SchemeFieldError("rounding", f"compressed-tensors rounds to nearest even only, got {s.rounding!r}")
    if not s.saturate:
        raise SchemeFieldError("saturate", "compressed-tensors always clamps to the format's range, got False")
    if part == "weights":
        gran, size = s.weight_granularity, s.group_size
        args = _ct_args(s.bits, gran, size if gran in ("group", "tensor_group") else None, False,
                        _CT_SCALE[s.scale_dtype])
        args["block_structure"] = list(s.block_shape) if gran == "block" else None
        # llm-compressor 0.14 sets the weight observer; compressed-tensors 0.20's presets leave it unset
        args["observer"] = "memoryless_minmax" if version == "0.19" else None
        return as_written(args, version)
    if not s.quantizes_activations:
        return None
    gran = s.act_granularity
    dynamic = "local" if s.act_data_type == "nv_fp4_with_static_gs" else s.act_dynamic
    # FP8 inputs under MX weights (MXFP4XFP8) keep the model-dtype scales of plain FP8
    act_scale = None if s.data_type == "mx_fp" and s.act_data_type == "fp" else _CT_SCALE[s.scale_dtype]
    args = _ct_args(s.act_bits, gran, s.act_group_size if gran in ("group", "tensor_group") else None, dynamic,
                    act_scale)
    # NVFP4 inputs ("local": calibrated global, run-time blocks): llm-compressor 0.14 writes static_minmax
    # (tests/fixtures/interop/checkpoints/llmc_nvfp4/config.json); so do compressed-tensors 0.20's presets
    args["observer"] = {False: "static_minmax", True: None, "local": "static_minmax"}[dynamic]
    return as_written(args, version)


def _ct_args(bits, gran, group_size, dynamic, scale_dtype) -> dict:
    return {"actorder": None, "block_structure": None, "dynamic": dynamic, "group_size": group_size,
            "num_bits": bits, "observer": None, "observer_kwargs": {}, "scale_dtype": scale_dtype,
            "strategy": _CT_STRATEGY[gran], "symmetric": True, "type": "float", "zp_dtype": None}


def as_written(args: dict, version: str) -> dict:
    """Full 0.19 args as ``version`` serialises them: 0.20.1's ``QuantizationArgs._serialize`` drops
    actorder, block_structure and scale_dtype when None, observer_kwargs when empty, observer when
    unset, and zp_dtype always for symmetric args (its field serializer returns None)."""
    if version == "0.19":
        return args
    out = dict(args)
    for key in ("actorder", "block_structure", "scale_dtype", "observer", "zp_dtype"):
        if out[key] is None:
            del out[key]
    if not out["observer_kwargs"]:
        del out["observer_kwargs"]
    return out


def from_ct_args(weights: Mapping, input_activations: Mapping | None, *,
                 recipe: str = "compressed-tensors") -> QuantizationScheme:
    """compressed-tensors ``weights`` + ``input_activations`` (0.19 all keys, or 0.20.1 with
    null/default keys dropped) -> QuantizationScheme. Observers must be min/max ones (which one
    is not kept: a scheme states the numerics, not the calibration statistic)."""
    w = _ct_parse(weights, "weights")
    fields = {"recipe": recipe, "bits": w["num_bits"], "weight_granularity": w["strategy"]}
    fields["data_type"] = _ct_family(w, "weights")
    if w["strategy"] in ("group", "tensor_group"):
        fields["group_size"] = w["group_size"]
    if w["strategy"] == "block":
        fields["block_shape"] = w["block_structure"]
    if w["dynamic"] is not False:
        raise SchemeFieldError("weights.dynamic", f"fp8ref weights are quantized ahead of time, got {w['dynamic']!r}")
    fields["scale_dtype"] = _ct_scale(w, "weights", fields["data_type"])
    if input_activations is not None:
        a = _ct_parse(input_activations, "input_activations")
        family = _ct_family(a, "input_activations")
        mx_fp8 = fields["data_type"] == "mx_fp" and family == "fp"  # MXFP4XFP8: FP8 inputs, their own scales
        if not mx_fp8 and _ct_scale(a, "input_activations", family) != fields["scale_dtype"]:
            raise SchemeFieldError("input_activations.scale_dtype", "must equal weights.scale_dtype "
                                   "(a scheme has one scale_dtype)")
        fields.update(act_bits=a["num_bits"], act_granularity=a["strategy"], act_data_type=family)
        if a["dynamic"] == "local":
            if family != "nv_fp":
                raise SchemeFieldError("input_activations.dynamic", "'local' is only expressible for NVFP4")
            fields["act_data_type"] = "nv_fp4_with_static_gs"
        else:
            fields["act_dynamic"] = a["dynamic"]
        if a["strategy"] in ("group", "tensor_group"):
            fields["act_group_size"] = a["group_size"]
        if a["strategy"] not in ACT_GRANULARITIES:
            raise SchemeFieldError("input_activations.strategy", f"expected one of {', '.join(ACT_GRANULARITIES)}, "
                                   f"got {a['strategy']!r}")
    return QuantizationScheme(**fields)


def _ct_parse(args: Mapping, part: str) -> dict:
    if not isinstance(args, Mapping):
        raise SpecError(f"{part}: expected a QuantizationArgs mapping, got {type(args).__name__}")
    for key in args:
        if key not in CT_ARGS_KEYS:
            raise SchemeFieldError(f"{part}.{key}", f"not a QuantizationArgs key{did_you_mean(key, CT_ARGS_KEYS)}")
    a = {"num_bits": 8, "type": "int", "symmetric": True, "group_size": None, "strategy": None,
         "block_structure": None, "dynamic": False, "actorder": None, "scale_dtype": None,
         "zp_dtype": None, "observer": None, "observer_kwargs": {}}
    a.update({k: v for k, v in args.items() if v is not None})
    if a["strategy"] is None:
        a["strategy"] = infer_strategy(a["group_size"])
    if a["strategy"] == "block" and a["block_structure"] is not None:
        a["block_structure"] = tuple(a["block_structure"])
    for key, ok, why in (("symmetric", a["symmetric"] is True, "asymmetric float quantization is not modelled"),
                         ("actorder", a["actorder"] is None, "activation reordering is not modelled"),
                         ("zp_dtype", a["zp_dtype"] is None, "symmetric schemes have no zero point"),
                         ("observer", a["observer"] in _CT_MINMAX, "only min/max observers are expressible"),
                         ("observer_kwargs", a["observer_kwargs"] == {}, "observer options are not modelled")):
        if not ok:
            raise SchemeFieldError(f"{part}.{key}", f"{why}, got {a[key]!r}")
    if a["strategy"] not in _CT_STRATEGY:
        raise SchemeFieldError(f"{part}.strategy", f"expected one of {', '.join(_CT_STRATEGY)}, got {a['strategy']!r}")
    return a


def infer_strategy(group_size) -> str:
    """The strategy of args that give none: compressed-tensors' own inference from group_size (REFERENCE §7.3)."""
    return {None: "tensor", -1: "channel"}.get(group_size, "group")


def _ct_family(a: dict, part: str) -> str:
    if a["type"] != "float":
        raise SchemeFieldError(f"{part}.type", f"fp8ref covers floating-point formats only, got {a['type']!r}")
    if a["num_bits"] == 8:
        return "mx_fp" if a["scale_dtype"] in ("torch.uint8", "uint8") else "fp"
    if a["num_bits"] == 4:
        return "nv_fp" if a["strategy"] == "tensor_group" else "mx_fp"
    if a["num_bits"] == 6:  # 0.20: E2M3, MX only
        return "mx_fp"
    raise SchemeFieldError(f"{part}.num_bits",
                           f"compressed-tensors float types have 8, 6 or 4 bits, got {a['num_bits']!r}")


def _ct_scale(a: dict, part: str, family: str) -> str:
    if a["scale_dtype"] is None:  # CT's default: model dtype, e8m0 for MX, e4m3 for NVFP4
        return default_scale_dtype(family)
    by_name = {v: k for k, v in _CT_SCALE.items() if v is not None}
    name = str(a["scale_dtype"])
    name = name if name.startswith("torch.") else "torch." + name
    if name not in by_name:
        raise SchemeFieldError(f"{part}.scale_dtype", f"expected one of {', '.join(by_name)} or null, "
                               f"got {a['scale_dtype']!r}")
    return by_name[name]


# --- quantization_config ---------------------------------------------------------------------
def to_ct_config(config: LayerConfig, layer_names: Iterable[str] | None = None, *,
                 version: str = DEFAULT_CT_VERSION) -> dict:
    """compressed-tensors ``quantization_config`` of a spec as ``version`` writes it (see ``quantization_config``).

    Without ``layer_names`` only a spec without ``layer_config`` rules can be written (one group
    targeting ``Linear``; ``ignore`` selectors copied, ``re:`` has the same meaning in CT). With
    ``layer_names`` the layers are resolved first (``config_for_layers``).
    """
    if layer_names is not None:
        resolved = config.resolve_all(layer_names)
        if not any(s is not None for s in resolved.values()):
            raise SpecError("layer_names: no layer is quantized; nothing to write")
        return config_for_layers(resolved, version=version)
    if config.rules:
        raise SpecError("layer_names: needed to write layer_config rules as exact compressed-tensors targets")
    if config.default is None:
        raise SpecError("scheme: the default scheme leaves every layer unquantized; nothing to write")
    return quantization_config([group(config.default, ["Linear"], version)], [s.text for s in config.ignore],
                               version=version)


def config_for_layers(resolved: Mapping[str, QuantizationScheme | None], *, kv: bool | str = False,
                      version: str = DEFAULT_CT_VERSION, attention: list[str] | None = None) -> dict:
    """``quantization_config`` for ``{layer: scheme or None (unquantized)}``: one distinct group
    becomes a single ``Linear`` group plus an ``ignore`` list of the unquantized layers (what
    llm-compressor writes), several become groups of exact layer names, so the result does not
    depend on how compressed-tensors orders overlapping targets."""
    ignore = [name for name, s in resolved.items() if s is None]
    by_group: dict[str, tuple[QuantizationScheme, list[str]]] = {}
    for name, s in resolved.items():
        if s is not None:
            key = json.dumps(group(s, [], version), sort_keys=True)  # schemes CT cannot tell apart share a group
            by_group.setdefault(key, (s, []))[1].append(name)
    if len(by_group) == 1:
        groups = [group(next(iter(by_group.values()))[0], ["Linear"], version)]
    else:
        groups = [group(s, names, version) for s, names in by_group.values()]
    return quantization_config(groups, ignore, kv=kv, version=version, attention=attention)


def group(s: QuantizationScheme, targets: list[str], version: str = DEFAULT_CT_VERSION) -> dict:
    """One ``config_groups`` entry (the five keys compressed-tensors writes, 0.19 and 0.20 alike)."""
    return {"format": _ct_format(s), "input_activations": to_ct_args(s, "input_activations", version),
            "output_activations": None, "targets": targets, "weights": to_ct_args(s, "weights", version)}


def quantization_config(groups: list[dict], ignore: list[str], *, kv: bool | str = False,
                        version: str = DEFAULT_CT_VERSION, attention: list[str] | None = None) -> dict:
    """The ONE compressed-tensors ``quantization_config`` writer: the top-level keys compressed-tensors
    ``version`` writes (0.19.0: nine; 0.20.1 adds ``moe_sparsity_config``; ``version`` itself left out:
    fp8ref is not compressed-tensors), groups named ``group_0``... in order, ``kv_cache_scheme`` static
    FP8 when ``kv``: per tensor (True), or ``kv="attn_head"``: one scale per KV head.

    ``attention`` (targets: the attention class or modules): Q is quantized too, as llm-compressor
    0.14 writes an attention group (tools/make_kvhead_fixture.py, fixture llmc_fp8_attn_head_q): it
    comes first (compressed-tensors names groups in module order, and an attention module precedes its
    projections), ``format: dense``, no weights, the KV args as input activations with the observer
    llm-compressor fills in ("minmax"), and ``kv_cache_scheme`` is those same args. The top-level
    format leaves the dense group out (compressed-tensors' ``infer_model_format``)."""
    check_ct_version(version)
    args = dict(KV_CACHE_SCHEME, observer_kwargs={}, strategy="attn_head" if kv == "attn_head" else "tensor")
    if attention:
        args["observer"] = "minmax"
        groups = [{"format": "dense", "input_activations": as_written(args, version), "output_activations": None,
                   "targets": list(attention), "weights": None}] + list(groups)
    formats = {g["format"] for g in groups if g["format"] != "dense"} or {"dense"}
    out = {"config_groups": {f"group_{i}": g for i, g in enumerate(groups)},
           "format": formats.pop() if len(formats) == 1 else "mixed-precision",
           "global_compression_ratio": None, "ignore": list(ignore),
           "kv_cache_scheme": as_written(args, version) if kv or attention else None,
           "quant_method": NAME, "quantization_status": "compressed",
           "sparsity_config": {}, "transform_config": {}}
    if version != "0.19":
        out["moe_sparsity_config"] = None
    return out


def _ct_format(s: QuantizationScheme) -> str:
    # REFERENCE §7.3: float-quantized iff float weights and input activations; CT's packed 4-bit
    # and MXFP8 formats carry their own names (CompressionFormat enum).
    if s.data_type == "nv_fp":
        return "nvfp4-pack-quantized"
    if s.data_type == "mx_fp":
        return {4: "mxfp4-pack-quantized", 6: "mxfp6-pack-quantized"}.get(s.bits, "mxfp8-quantized")
    return "float-quantized" if s.quantizes_activations else "naive-quantized"


def from_ct_config(config: Mapping, *, recipe: str = "compressed-tensors",
                   source: str = "quantization_config") -> LayerConfig:
    """compressed-tensors ``quantization_config`` -> LayerConfig. A group targeting ``Linear``
    becomes the default scheme; other targets (names, ``re:``) become rules in group order."""
    if not isinstance(config, Mapping):
        raise SpecError(f"{source}: expected a mapping, got {type(config).__name__}")
    if config.get("quant_method", "compressed-tensors") != "compressed-tensors":
        raise SpecError(f"{source}: quant_method: expected 'compressed-tensors', got {config['quant_method']!r}")
    if config.get("kv_cache_scheme") is not None:
        raise SpecError(f"{source}: kv_cache_scheme: KV-cache quantization is not part of a LayerConfig")
    groups = config.get("config_groups")
    if not isinstance(groups, Mapping) or not groups:
        raise SpecError(f"{source}: config_groups: expected a non-empty mapping")
    default, rules = None, []
    for gname, group in groups.items():
        where = f"{source}: config_groups.{gname}"
        scheme, targets = _ct_group(gname, group, where, recipe)
        for target in targets:
            if target == "Linear":
                if default is not None:
                    raise SpecError(f"{where}.targets: a second group targets 'Linear'")
                default = scheme
            elif target.startswith("re:") or not (target[:1].isupper() and target.isidentifier()):
                rules.append(Rule(_selector(target, f"{where}.targets"), scheme))
            else:  # CT matches CamelCase identifiers against module classes
                raise SpecError(f"{where}.targets: class name {target!r} is not expressible; only 'Linear', "
                                "layer names and 're:' patterns are")
    ignore = config.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(i, str) for i in ignore):
        raise SpecError(f"{source}: ignore: expected a list of strings, got {ignore!r}")
    return LayerConfig(default, rules, [_selector(i, f"{source}: ignore") for i in ignore], source=source)


def _selector(target: str, where: str) -> Selector:
    """A target or ignore entry as a spec selector; a ``re:`` one is compiled and checked now."""
    selector = Selector(target, source=where)
    if selector.is_regex and target != "re:":
        selector.pattern  # noqa: B018  (fp8ref.patterns refuses what could hang)
    return selector


def _ct_group(gname, group, where: str, recipe: str):
    if isinstance(group, list):  # {"FP8_DYNAMIC": ["Linear"]}: a preset name as the key expands
        scheme = PRESETS[gname] if gname in PRESETS else None
        if scheme is None:
            raise SpecError(f"{where}: {gname!r} is not a quantizing preset fp8ref knows")
        return scheme.replace(recipe=recipe), group
    if not isinstance(group, Mapping):
        raise SpecError(f"{where}: expected a mapping or a list of targets, got {type(group).__name__}")
    allowed = ("targets", "weights", "input_activations", "output_activations", "format")
    for key in group:
        if key not in allowed:
            raise SpecError(f"{where}.{key}: not a QuantizationScheme key; expected one of {', '.join(allowed)}")
    if group.get("output_activations") is not None:
        raise SpecError(f"{where}.output_activations: output quantization is not modelled")
    targets = group.get("targets")
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise SpecError(f"{where}.targets: expected a non-empty list of strings, got {targets!r}")
    if group.get("weights") is None:
        raise SpecError(f"{where}.weights: activation-only quantization is not modelled")
    try:
        scheme = from_ct_args(group["weights"], group.get("input_activations"), recipe=recipe)
    except SchemeFieldError as exc:
        raise SpecError(f"{where}.{exc}") from None
    return scheme, targets
