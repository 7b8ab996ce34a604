"""NVIDIA ModelOpt unified HF export checkpoints (nvidia-modelopt 0.47.0, FINDINGS-2026 §3); the
config vocabulary is ``fp8ref.producers.modelopt``.

Per ``quant_algo`` (every scale a dequantization multiplier):

* FP8: ``weight`` F8_E4M3; ``weight_scale`` F32 [] = fp32(amax/448); static ``input_scale`` F32 [].
  Fused q/k/v and gate/up weight scales are NOT shared (an engine must requantize them).
* FP8_PER_CHANNEL_PER_TOKEN: ``weight_scale`` F32 [out] (1-D); inputs dynamic per token.
* NVFP4: ``weight`` U8 [out, in/2] (packed E2M1, low nibble = even element); ``weight_scale``
  F8_E4M3 [out, in/16]; ``weight_scale_2`` F32 [] = amax/2688 (a multiplier, fused groups share
  it); ``input_scale`` F32 [] = amax_in/2688; per-16 input blocks at run time.
* MXFP8: ``weight`` F8_E4M3; ``weight_scale`` U8 [out, in/32] (E8M0 biased exponents).
* KV cache (``kv_cache_quant_algo: FP8``): ``<attn>.k_proj.k_scale``, ``<attn>.v_proj.v_scale`` F32 [].

No CPU loader exists (transformers 5.14.1 skips ``quant_method: modelopt`` and loads the codes as
bf16 values), so no producer forward is modelled.
"""

from __future__ import annotations

from ..errors import CheckpointError
from ..io.safetensors import TensorStore
from ..producers import modelopt as mo
from .base import Defaults, ScaleDecl, fp8_weights, plain_linears, register
from .layout import LayerEntry, LayerQuant

NAME = mo.NAME
QUANTS = {
    "FP8": LayerQuant("tensor", None, "static"),
    "FP8_PER_CHANNEL_PER_TOKEN": LayerQuant("channel", None, "dynamic-token"),
    "NVFP4": LayerQuant("nvfp4", None, "nvfp4", weight_fmt="float4_e2m1fn", global_scale="multiplier",
                        input_fmt="float4_e2m1fn"),
    "MXFP8": LayerQuant("mx", None, "mx"),
}
RECIPES = {"FP8": "modelopt-fp8", "FP8_PER_CHANNEL_PER_TOKEN": "modelopt-fp8-pc", "NVFP4": "modelopt-nvfp4",
           "MXFP8": "modelopt-mxfp8"}
KV_SUFFIXES = (".k_proj.k_scale", ".v_proj.v_scale")


def algo_of(quant: LayerQuant) -> str | None:
    return next((a for a, q in QUANTS.items() if q == quant), None)


def layer_entry(name: str, quant: LayerQuant) -> LayerEntry:
    tensors = {"weight": f"{name}.weight", "weight_scale": f"{name}.weight_scale",
               "input_scale": f"{name}.input_scale", "bias": f"{name}.bias"}
    if quant.weight_strategy == "nvfp4":
        tensors["weight_global"] = f"{name}.weight_scale_2"
    return LayerEntry(name, quant, tensors, NAME, group=algo_of(quant))


def scale_shapes(quant: LayerQuant, out: int, inp: int) -> tuple[tuple[int, ...], ...]:
    if quant.weight_strategy == "tensor":
        return ((),)
    if quant.weight_strategy == "channel":
        return ((out,),)
    return (quant.scale_shape(out, inp),)


def _quantized(store: TensorStore, algo: str) -> list[str]:
    if algo != "NVFP4":
        return fp8_weights(store)
    return sorted(n[: -len(".weight")] for n in store if n.endswith(".weight") and store.info(n).dtype == "U8"
                  and n[: -len(".weight")] + ".weight_scale_2" in store)


def layers(qc, store, where, warnings):
    if qc is None:
        raise CheckpointError(f"{store.root}: ModelOpt layouts are only read with their quantization_config")
    cfg = mo.Config(qc, where, warnings)
    quant = QUANTS[cfg.algo]
    entries = []
    for name in _quantized(store, cfg.algo):
        if cfg.excluded(name):
            raise CheckpointError(f"{store.where(name + '.weight')}: quantized weight, but {where}.ignore lists "
                                  f"{name!r}: config and tensors disagree")
        entry = layer_entry(name, quant)
        shape = store.info(entry.tensors["weight"]).shape
        if len(shape) == 2:
            out, inp = (shape[0], 2 * shape[1]) if quant.packed else shape
            entry.accepted_scale_shapes = scale_shapes(quant, out, inp)
        entries.append(entry)
    plain = plain_linears(store, entries, ("weight_scale", "weight_scale_2", "input_scale"))
    for module in plain:
        if not cfg.excluded(module):
            warnings.append(f"{store.where(module + '.weight')}: stored unquantized, but {where}.ignore does not "
                            f"list {module!r}; ModelOpt loaders treat every other linear as quantized. Fix: add "
                            f"{module!r} to ignore and to hf_quant_config.json exclude_modules")
    kv = {n: n for n in store if n.endswith(KV_SUFFIXES)}
    if kv and not cfg.kv:
        raise CheckpointError(f"{store.where(sorted(kv)[0])}: a KV-cache scale, but {where} declares no "
                              f"kv_cache_quant_algo")
    if cfg.kv:
        attn = sorted({e.name.rsplit(".", 1)[0] for e in entries if e.name.endswith((".k_proj", ".v_proj"))})
        for a in attn:
            for which in ("k", "v"):
                if f"{a}.{which}_proj.{which}_scale" not in kv:
                    warnings.append(f"{store.root}: kv_cache_quant_algo FP8 but {a}.{which}_proj.{which}_scale is "
                                    f"missing; engines then use 1.0. Fix: calibrate the KV cache")
    return entries, kv


def cannot_express(quant: LayerQuant) -> str | None:
    if algo_of(quant) is None:
        return (f"ModelOpt's export holds FP8 (tensor W, static input), FP8_PER_CHANNEL_PER_TOKEN, NVFP4 "
                f"(multiplier globals) or MXFP8 layers; got {quant.describe()}")
    return None


def tensor_plan(name: str, quant: LayerQuant, out: int, inp: int, dtype: str) -> list[tuple[str, str, str, tuple]]:
    algo = algo_of(quant)
    if algo == "NVFP4":
        return [("weight", f"{name}.weight", "U8", (out, inp // 2)),
                ("weight_scale", f"{name}.weight_scale", "F8_E4M3", quant.scale_shape(out, inp)),
                ("weight_global", f"{name}.weight_scale_2", "F32", ()),
                ("input_scale", f"{name}.input_scale", "F32", ())]
    plan = [("weight", f"{name}.weight", "F8_E4M3", (out, inp))]
    if algo == "MXFP8":
        return plan + [("weight_scale", f"{name}.weight_scale", "U8", quant.scale_shape(out, inp))]
    plan.append(("weight_scale", f"{name}.weight_scale", "F32", () if algo == "FP8" else (out,)))
    if algo == "FP8":
        plan.append(("input_scale", f"{name}.input_scale", "F32", ()))
    return plan


def quantization_config(layers: dict[str, LayerQuant], unquantized: list[str], kv: bool = False) -> dict:
    algos = {algo_of(q) for q in layers.values()}
    if len(algos) != 1 or None in algos:
        raise CheckpointError(f"ModelOpt configs hold one quant_algo for all layers, got "
                              f"{sorted(q.describe() for q in set(layers.values()))}")
    algo = algos.pop()
    if kv and algo != "FP8":
        raise CheckpointError(f"{NAME}: fp8ref writes ModelOpt KV-cache scales with FP8 layers only "
                              f"(the combination the fixtures verify), got {algo}")
    return mo.quantization_config(algo, sorted(unquantized), kv)


class ModelOpt(Defaults):
    name = NAME
    scales = (
        ScaleDecl("tensor (FP8)", "weight_scale", "multiplier", "F32", "[]"),
        ScaleDecl("tensor (FP8)", "input_scale", "multiplier", "F32", "[]"),
        ScaleDecl("channel (FP8_PER_CHANNEL_PER_TOKEN)", "weight_scale", "multiplier", "F32", "[out]"),
        ScaleDecl("nvfp4 (NVFP4)", "weight_scale", "multiplier", "F8_E4M3", "[out, in/16]",
                  "hf_quant_config.json group_size 16"),
        ScaleDecl("nvfp4 (NVFP4)", "weight_scale_2", "multiplier", "F32", "[]", "-", "fp32(amax) / 2688"),
        ScaleDecl("nvfp4 (NVFP4)", "input_scale", "multiplier", "F32", "[]", "group_size 16",
                  "global; block scales at run time"),
        ScaleDecl("mx (MXFP8)", "weight_scale", "E8M0 exponent", "U8", "[out, in/32]", "group_size 32"),
        ScaleDecl("KV cache (kv_cache_quant_algo FP8)", "self_attn.{k_proj.k,v_proj.v}_scale", "multiplier",
                  "F32", "[]"),
    )
    methods = (mo.METHOD,)
    detect_rank = 3  # never guessed: a ModelOpt export always carries its config
    scheme_scale_dtype = "float32"
    scales_follow_recipe = False
    kv_refusal = None
    # KV: k_bmm_quantizer / v_bmm_quantizer amax -> fp32(fp32(amax) / 448), F32 [] (quant_utils.py
    # _postprocess_single_tensor: value.float() / maxbound; no clamp to 1.0 in the HF export)
    kv_shape = ()
    kv_store = "F32"
    kv_recipe = "modelopt-fp8"

    config_files = (mo.HF_QUANT_CONFIG,)
    nvfp4_global = "multiplier"

    def detect(self, store: TensorStore, fp8_layers: list[str]) -> bool:
        return False

    def recipe_of(self, quant: LayerQuant) -> str:
        return RECIPES.get(algo_of(quant), "fp8ref")

    def extra_files(self, qc: dict) -> dict[str, dict]:
        return {mo.HF_QUANT_CONFIG: mo.hf_quant_config(qc)}

    layers = staticmethod(layers)
    cannot_express = staticmethod(cannot_express)
    tensor_plan = staticmethod(tensor_plan)
    quantization_config = staticmethod(quantization_config)

    def kv_name(self, attn: str, which: str) -> str:
        return f"{attn}.{which}_proj.{which}_scale"


register(ModelOpt())
