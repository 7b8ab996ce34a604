"""AMD Quark checkpoints (amd-quark 0.13 ``export_safetensors``, FINDINGS-FP4-MX §4); the config
vocabulary is ``fp8ref.producers.quark``.

* FP8 per tensor: ``weight`` F8_E4M3; ``weight_scale`` and ``input_scale`` **BF16 0-dim** (the
  model dtype, although the config says ``scale_type: float``), multipliers; KV cache:
  ``k_proj.output_scale`` / ``v_proj.output_scale`` D [] (``export.kv_cache_group``: one shared value).
* MXFP4: ``weight`` U8 [out, in/2] (packed E2M1, low nibble = even element, no -0 nibble);
  ``weight_scale`` U8 [out, in/32] E8M0 biased exponents ("even" rule, zero blocks byte 1);
  inputs MXFP4, dynamic.

Producer forward: transformers' quark integration reloads into ``QParamsLinear`` on CPU: W =
D(q * s); the input fake-quantized with the stored scale (FP8: D(e4m3(clamp(D(x / s))) * s); MXFP4:
the quark-mxfp4 recipe at run time); ``F.linear`` in D; then the output quantizer (k/v with FP8
KV: the same fake quantization with ``output_scale``).
"""

from __future__ import annotations

import numpy as np

from ..errors import CheckpointError
from ..io.safetensors import TensorStore
from ..producers import quark as qk
from ..quant import dequantize
from .base import Defaults, ScaleDecl, plain_linears, register
from .forward import qdq, quantize_block_input
from .layout import D_DTYPES, LayerEntry, LayerQuant

NAME = qk.NAME
QUANTS = {"fp8": LayerQuant("tensor", None, "static"),
          "mxfp4": LayerQuant("mx", None, "mx", weight_fmt="float4_e2m1fn", input_fmt="float4_e2m1fn")}
WEIGHT_ONLY = {"fp8": LayerQuant("tensor", None, None),
               "mxfp4": LayerQuant("mx", None, None, weight_fmt="float4_e2m1fn")}
RECIPES = {"tensor": "quark-fp8", "mx": "quark-mxfp4"}
KV_SUFFIXES = (".k_proj.output_scale", ".v_proj.output_scale")


def scheme_of(quant: LayerQuant) -> str | None:
    """The Quark scheme fp8ref writes for ``quant`` (weight-only layers are read, not written)."""
    return next((s for s, q in QUANTS.items() if q == quant), None)


def _quantized(store: TensorStore) -> list[str]:
    """Modules whose ``weight`` is F8_E4M3, or U8 beside a U8 ``weight_scale`` (packed MXFP4)."""
    out = []
    for n in store:
        if not n.endswith(".weight"):
            continue
        m, dt = n[: -len(".weight")], store.info(n).dtype
        if dt.startswith("F8_") or (dt == "U8" and f"{m}.weight_scale" in store):
            out.append(m)
    return sorted(out)


def layers(qc, store, where, warnings):
    if qc is None:
        raise CheckpointError(f"{store.root}: Quark layouts are only read with their quantization_config")
    cfg = qk.Config(qc, where, warnings)
    entries, outputs = [], []
    for name in _quantized(store):
        if cfg.excluded(name):
            raise CheckpointError(f"{store.where(name + '.weight')}: quantized weight, but {where}.exclude lists "
                                  f"{name!r}: config and tensors disagree")
        group, scheme = cfg.scheme_of(name)
        quant = (QUANTS if scheme.input else WEIGHT_ONLY)[scheme.weight]
        tensors = {"weight": f"{name}.weight", "weight_scale": f"{name}.weight_scale",
                   "input_scale": f"{name}.input_scale", "bias": f"{name}.bias"}
        if scheme.output:
            tensors["output_scale"] = f"{name}.output_scale"
        entry = LayerEntry(name, quant, tensors, NAME, group=group)
        shape = store.info(entry.tensors["weight"]).shape
        if len(shape) == 2:
            out, inp = (shape[0], 2 * shape[1]) if quant.packed else shape
            entry.accepted_scale_shapes = ((),) if quant.weight_strategy == "tensor" else (quant.scale_shape(out, inp),)
        entries.append(entry)
        if scheme.output:
            outputs.append(name)
    plain = plain_linears(store, entries, ("weight_scale", "input_scale", "output_scale"))
    for module in plain:
        if not cfg.excluded(module):
            warnings.append(f"{store.where(module + '.weight')}: stored unquantized, but {where}.exclude does not "
                            f"list {module!r}; Quark's loader quantizes every other linear. Fix: add {module!r} "
                            f"to exclude")
    kv = {n: n for n in store if n.endswith(".output_scale")}
    for n in sorted(kv):
        module = n[: -len(".output_scale")]
        if module not in outputs:
            raise CheckpointError(f"{store.where(n)}: an output scale, but {where} gives {module!r} no "
                                  f"output_tensors quantization")
        if not n.endswith(KV_SUFFIXES):
            raise CheckpointError(f"{store.where(n)}: fp8ref reads Quark output scales on k_proj / v_proj (KV cache)")
    missing = [m for m in outputs if f"{m}.output_scale" not in kv]
    if missing:
        raise CheckpointError(f"{store.root}: {where} quantizes the output of {missing[0]!r}, but "
                              f"{missing[0]}.output_scale is missing")
    return entries, kv


def validate(store: TensorStore, entries: list[LayerEntry], warnings: list[str]) -> None:
    """KV scales: Quark's kv_cache_group gives k and v one value; FP8 scales are stored in D."""
    kv = sorted(n for n in store if n.endswith(KV_SUFFIXES))
    by_attn: dict[str, list[float]] = {}
    for n in kv:
        value = np.asarray(store.float_values(n), np.float32).reshape(-1)[0]
        by_attn.setdefault(n.rsplit(".", 2)[0], []).append(float(value))
    for attn, values in by_attn.items():
        if len(set(values)) > 1:
            warnings.append(f"{store.root}: {attn}.k_proj.output_scale and v_proj.output_scale differ ({values}); "
                            f"Quark's export.kv_cache_group writes one shared value, and engines that keep one KV "
                            f"scale per layer use the max")


def cannot_express(quant: LayerQuant) -> str | None:
    if scheme_of(quant) is None:
        return (f"fp8ref writes Quark FP8 (tensor W, static input) or MXFP4 (mx E2M1 W, mx E2M1 input) layers, "
                f"the schemes the fixtures verify; got {quant.describe()}")
    return None


def tensor_plan(name: str, quant: LayerQuant, out: int, inp: int, dtype: str) -> list[tuple[str, str, str, tuple]]:
    if quant.weight_strategy == "mx":
        return [("weight", f"{name}.weight", "U8", (out, inp // 2)),
                ("weight_scale", f"{name}.weight_scale", "U8", quant.scale_shape(out, inp))]
    d = D_DTYPES[dtype]
    plan = [("weight", f"{name}.weight", "F8_E4M3", (out, inp)), ("weight_scale", f"{name}.weight_scale", d, ())]
    if quant.input == "static":
        plan.append(("input_scale", f"{name}.input_scale", d, ()))
    return plan


def quantization_config(layers: dict[str, LayerQuant], unquantized: list[str], kv: bool = False) -> dict:
    schemes = {scheme_of(q) for q in layers.values()}
    if len(schemes) != 1 or None in schemes:
        raise CheckpointError(f"fp8ref writes Quark configs with one scheme for all layers (FP8 W8A8 or MXFP4 "
                              f"W4A4), got {sorted(q.describe() for q in set(layers.values()))}")
    scheme = schemes.pop()
    if kv and scheme != "fp8":
        raise CheckpointError(f"{NAME}: fp8ref writes Quark KV-cache scales with FP8 layers only, got {scheme}")
    return qk.quantization_config(scheme, sorted(unquantized), kv)


def emulate(layer, w: np.ndarray, x32: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """mode="producer": QParamsLinear's weight is D(q * s) (``w`` as given: one rounding of an
    exact product); the input quantizer fake-quantizes with the stored scale, dividing in D."""
    q = layer.quant
    if q.input == "static":
        s = np.float32(np.asarray(layer.input_scale, np.float32).reshape(-1)[0])
        x32 = qdq(x32, s, dtype, d_division=True, positive_zero=False)
    elif q.input == "mx":
        import torch


        xt = torch.from_numpy(np.ascontiguousarray(x32)).to(getattr(torch, dtype))  # x32 holds D values: exact
        x32 = dequantize(quantize_block_input(layer, xt), dtype=dtype).to(torch.float32).numpy()
    return w, x32


def emulate_output(layer, y32: np.ndarray, dtype: str) -> np.ndarray:
    """The output quantizer of k_proj / v_proj with FP8 KV: D(e4m3(clamp(D(y / s_out))) * s_out)."""
    s = layer.output_scale
    if s is None:
        return y32
    return qdq(y32, np.float32(np.asarray(s, np.float32).reshape(-1)[0]), dtype, d_division=True, positive_zero=False)


class Quark(Defaults):
    name = NAME
    scales = (
        ScaleDecl("tensor (FP8)", "weight_scale", "multiplier", "D (BF16 for bf16 models)", "[]", "-",
                  "config says scale_type float; D(fp32(amax) / 448)"),
        ScaleDecl("tensor (FP8)", "input_scale", "multiplier", "D", "[]"),
        ScaleDecl("mx (MXFP4)", "weight_scale", "E8M0 exponent", "U8", "[out, in/32]", "weight.group_size 32",
                  "rule even; zero block byte 1"),
        ScaleDecl("KV cache (output_tensors fp8 on *k_proj, *v_proj)", "{k,v}_proj.output_scale", "multiplier",
                  "D", "[]", "-", "export.kv_cache_group: k and v share one value"),
    )
    methods = (qk.METHOD,)
    detect_rank = 3  # never guessed: a Quark export always carries its config
    scheme_scale_dtype = "model"
    scales_follow_recipe = False  # the plan's D scales (the quark-fp8 recipe stores D too)
    kv_refusal = None
    # KV: the k_proj / v_proj output quantizers' scales D(fp32(amax) / 448) (quark-fp8's rule), then
    # export.kv_cache_group gives both the larger one (model_post_process.py _build_kv_scale: max, then
    # max with min_kv_scale 0.0)
    kv_shape = ()
    kv_store = "model"
    kv_recipe = "quark-fp8"
    kv_shared = True

    def detect(self, store: TensorStore, fp8_layers: list[str]) -> bool:
        return False

    def recipe_of(self, quant: LayerQuant) -> str:
        return RECIPES[quant.weight_strategy]

    layers = staticmethod(layers)
    validate = staticmethod(validate)
    cannot_express = staticmethod(cannot_express)
    tensor_plan = staticmethod(tensor_plan)
    quantization_config = staticmethod(quantization_config)

    def kv_name(self, attn: str, which: str) -> str:
        return f"{attn}.{which}_proj.output_scale"
    emulate = staticmethod(emulate)
    emulate_output = staticmethod(emulate_output)


register(Quark())
