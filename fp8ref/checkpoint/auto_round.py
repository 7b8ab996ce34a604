"""auto-round ``auto_round:fp8_static`` checkpoints (reference §5.3, auto-round 0.16.1); the
config vocabulary is ``fp8ref.producers.auto_round``.

Tensors: ``weight`` F8_E4M3 [out, in]; ``weight_scale`` in the model dtype, shape [out] (1-D);
``input_scale`` [1]. auto-round's own loader loads only the FP8_STATIC scheme from this packing format.
"""

from __future__ import annotations

import numpy as np

from ..codec import decode
from ..errors import CheckpointError
from ..io.safetensors import TensorStore
from ..producers import auto_round as ar
from .base import Defaults, ScaleDecl, accept, fp8_weights, plain_linears, register, unquantized_linears
from .forward import _round, fp32_weight_scale, qdq
from .layout import D_DTYPES, LayerEntry, LayerQuant

NAME = ar.NAME
FP8_STATIC_QUANT = LayerQuant("channel", None, "static")


def layer_quant(cfg: ar.Config, name: str, where: str) -> LayerQuant | None:
    scheme, source = cfg.resolve(name)
    if ar.unquantized(scheme):
        return None
    if not ar.is_fp8_static(scheme):
        diff = {k: scheme[k] for k in ar.FIELDS if scheme.get(k) != ar.FP8_STATIC[k]}
        want = {k: ar.FP8_STATIC[k] for k in diff}
        raise CheckpointError(f"{where}: layer {name!r} ({source}) has {diff}; the {ar.PACKING} format "
                              f"holds FP8_STATIC only, which needs {want}")
    return FP8_STATIC_QUANT


def layers(qc, store, where, warnings):
    if qc is None:  # inferred: what is stored unquantized is meant to be
        plain = unquantized_linears(store, set(fp8_weights(store)))
        qc = {"quant_method": ar.NAME, "packing_format": ar.PACKING, **ar.FP8_STATIC,
              "extra_config": {m: {"bits": 16, "act_bits": 16} for m in plain}}
    cfg = ar.Config(qc, where, warnings)
    entries = []
    for name in fp8_weights(store):
        quant = layer_quant(cfg, name, where)
        if quant is None:
            raise CheckpointError(f"{store.where(name + '.weight')}: float8 weight, but {where} leaves "
                                  f"{name!r} unquantized ({cfg.resolve(name)[1]})")
        scheme, source = cfg.resolve(name)
        entries.append(accept(store, layer_entry(name, quant, source), scale_shapes))
    _check_extra_held(cfg, store, where, len(entries))
    plain = plain_linears(store, entries, ("weight_scale", "input_scale"))
    for module in plain:
        scheme, source = cfg.resolve(module)
        if not ar.unquantized(scheme):
            warnings.append(f"{store.where(module + '.weight')}: stored unquantized, but {where} quantizes "
                            f"{module!r} ({source}); auto-round's loader would build an FP8 layer without "
                            f"scales. Fix: add extra_config[{module!r}] = {{\"bits\": 16, \"act_bits\": 16}}")
    kv = {}
    if qc.get("static_kv_dtype") or qc.get("static_attention_dtype"):
        kv = {n: n for n in store if n.rsplit(".", 1)[-1] in ar.KV_NAMES}
    return entries, kv


def _check_extra_held(cfg: ar.Config, store: TensorStore, where: str, found: int) -> None:
    """An extra_config entry that quantizes a layer matching no module of the checkpoint is a layer
    the config declares and no shard holds (an incomplete index or a wrong key)."""
    modules = {n.rsplit(".", 1)[0] for n in store if "." in n}
    for key, rx in cfg.regexes:
        scheme = {**cfg.scheme, **{k: v for k, v in cfg.extra[key].items() if k in ar.FIELDS}}
        if ar.unquantized(scheme) or key in modules:
            continue
        if not any(rx.search(m) for m in modules):
            raise CheckpointError(f"{where}.extra_config[{key!r}]: quantizes a layer no shard of {store.root} "
                                  f"holds ({found} quantized layers found): a shard or index entry is missing, "
                                  f"or the key is wrong")


def validate(store: TensorStore, entries: list[LayerEntry], warnings: list[str]) -> None:
    for e in entries:
        name = e.tensors["input_scale"]
        if name in store and np.all(store.float_values(name) == 1.0):
            warnings.append(f"{store.where(e.tensors['input_scale'])}: exactly 1.0, the value auto-round "
                            f"writes for a layer that saw no calibration data (intel/auto-round #1390). "
                            f"Fix: calibrate this layer or re-export with its activation amax")


def layer_entry(name: str, quant: LayerQuant, source: str) -> LayerEntry:
    return LayerEntry(name, quant, {"weight": f"{name}.weight", "weight_scale": f"{name}.weight_scale",
                                    "input_scale": f"{name}.input_scale", "bias": f"{name}.bias"}, NAME,
                      group=source)


def scale_shapes(quant: LayerQuant, out: int, inp: int) -> tuple[tuple[int, ...], ...]:
    return ((out,),)  # auto-round's loader multiplies by weight_scale[:, None]


# --- export ----------------------------------------------------------------------------------

def cannot_express(quant: LayerQuant) -> str | None:
    if quant != FP8_STATIC_QUANT:
        return (f"{ar.PACKING} holds only FP8_STATIC (per-channel float8_e4m3fn weights, static per-tensor "
                f"inputs), got {quant.describe()}")
    return None


def tensor_plan(name: str, quant: LayerQuant, out: int, inp: int, dtype: str) -> list[tuple[str, str, str, tuple]]:
    d = D_DTYPES[dtype]
    return [("weight", f"{name}.weight", "F8_E4M3", (out, inp)), ("weight_scale", f"{name}.weight_scale", d, (out,)),
            ("input_scale", f"{name}.input_scale", d, (1,))]


def quantization_config(layers: dict[str, LayerQuant], unquantized: list[str], kv: bool = False) -> dict:
    if kv:
        raise CheckpointError(f"{NAME}: {KV_REFUSAL}")
    return ar.quantization_config(layers, unquantized)


KV_REFUSAL = ("fp8ref does not write auto-round's KV-cache form (static_kv_dtype with {q,k,v}_scale "
              "tensors), which is not verified against auto-round's exporter")


def emulate(layer, w: np.ndarray, x32: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """mode="producer": auto-round 0.16.1's reload (``auto_round/experimental/qmodules/fp8_static.py``,
    ``WeightFP8ActFP8StaticQuantLinear``) holds weight, weight_scale and input_scale as bfloat16 (its
    ``dtype`` default, whatever the model dtype D or the stored dtype: an F32 or F16 stored scale is
    rounded to bf16 on load). W = bf16(q * s_w); the input x (D) / s_in in D's promotion with bf16
    (bf16 for a bf16 model, else fp32), clamp, e4m3, bf16(q * s_in); both then converted to D."""
    bf = "bfloat16"
    s_w = _round(fp32_weight_scale(layer), bf)
    w = _round(_round(decode(layer.weight_codes, layer.quant.weight_fmt) * s_w, bf), dtype)
    s_in = _round(np.asarray(layer.input_scale).astype(np.float32).reshape(-1)[:1], bf)[0]
    x = qdq(x32, np.float32(s_in), bf, d_division=dtype == bf, positive_zero=False)
    return w, _round(x, dtype)


class AutoRound(Defaults):
    name = NAME
    scales = (
        ScaleDecl("channel", "weight_scale", "multiplier", "D", "[out] (1-D)"),
        ScaleDecl("channel, static input", "input_scale", "multiplier", "D", "[1]"),
    )
    methods = ("auto-round", "intel/auto-round")
    detect_rank = 1
    scheme_scale_dtype = "model"
    scales_follow_recipe = True
    kv_refusal = KV_REFUSAL
    # transformers + auto-round 0.16.1 reload {k,v}_scale as unexpected keys and drop them: K and V stay in
    # D (auto_round/inference has no KV code; tests/interop/test_autoround_static_kv.py)
    kv_reload_quantizes = False
    config_files = ("quantization_config.json",)

    def detect(self, store: TensorStore, fp8_layers: list[str]) -> bool:
        """1-D per-row ``weight_scale`` tensors are auto-round's."""
        first = f"{fp8_layers[0]}.weight_scale"
        return first in store and len(store.info(first).shape) == 1 and store.info(first).shape[0] > 1

    layers = staticmethod(layers)
    validate = staticmethod(validate)
    cannot_express = staticmethod(cannot_express)
    tensor_plan = staticmethod(tensor_plan)
    quantization_config = staticmethod(quantization_config)
    emulate = staticmethod(emulate)

    def extra_files(self, qc: dict) -> dict[str, dict]:
        return {"quantization_config.json": qc}  # auto-round writes the config twice


register(AutoRound())
