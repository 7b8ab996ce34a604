"""NVIDIA ModelOpt unified HF export checkpoints (nvidia-modelopt 0.47.0, FINDINGS-FP4-MX §3); the
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
bf16 values), so ``mode="producer"`` is ModelOpt's in-memory quantized model holding the exported
weights dequantized (``emulate``): recipe ``modelopt-fp8-in-memory`` on those weights and on the
inputs for FP8 and FP8_PER_CHANNEL_PER_TOKEN; for NVFP4 (whose fake-quant kernel runs on CUDA only)
the arithmetic of ModelOpt's ``NVFP4QTensor``, which runs on CPU (``emulate_nvfp4``); MXFP8 has none.
"""

from __future__ import annotations

import numpy as np

from ..errors import CheckpointError
from ..formats import FORMATS
from ..io.safetensors import TensorStore
from ..producers import modelopt as mo
from ..quant import QuantArgs, fake_quant
from ..recipes import compute_scale
from ..registry import get_recipe
from ..rounding import round_to
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


IN_MEMORY = "modelopt-fp8-in-memory"
_CPU_REFUSALS = {  # what ModelOpt 0.47.0's in-memory quantized Linear raises on CPU tensors
    "NVFP4": "AssertionError: amax must be a CUDA tensor for dynamic block quantization.",
    "MXFP8": "RuntimeError: Skipping extension modelopt_cuda_ext_mx because CUDA is not available.",
}
# what mode="producer" models for each: NVFP4 by NVFP4QTensor's CPU arithmetic, MXFP8 not at all
_PRODUCER_ON_CPU = ("NVFP4",)
E2M1_NEGATIVE_ZERO = 0x8  # ModelOpt's e2m1_values table holds +0 at index 8: the code dequantizes to +0.0


def static_input_amax(layer, dtype: str) -> np.ndarray:
    """The calibrated input amax A behind a stored FP8 ``input_scale`` s = fp32(A/448): the D value
    nearest fp32(448·s). Exact for a 16-bit D and a normal s: A is a D value (a max of D activations),
    within 2^-23 relative of fp32(448·s), and D's half-ulp is >= 2^-12 relative; checked by
    re-deriving s. A float32 A is not recoverable (several share one s): refused."""
    if dtype not in ("bfloat16", "float16"):
        raise CheckpointError(f"{layer.name}: mode='producer' for ModelOpt FP8 needs a bfloat16 or float16 model: "
                              f"the in-memory input amax is recovered from input_scale only for 16-bit dtypes, got "
                              f"{dtype}")
    s = np.asarray(layer.input_scale, np.float32).reshape(())
    a = round_to(np.float32(448.0) * s, dtype).astype(np.float64)
    again = compute_scale(a.reshape(1), get_recipe(RECIPES["FP8"]), FORMATS["float8_e4m3fn"], dtype)[0]
    if again.reshape(()) != s:
        raise CheckpointError(f"{layer.name}.input_scale: {float(s)!r} is fp32(amax/448) of no {dtype} amax; "
                              f"it was not written by ModelOpt's exporter from a {dtype} calibration")
    return a


def producer_refusal(quant: LayerQuant) -> str | None:
    """MXFP8 has no producer forward: no CPU loader, and ModelOpt's in-memory fake quantization of it
    runs on CUDA only (NVFP4's too, but its NVFP4QTensor arithmetic runs on CPU: ``emulate_nvfp4``)."""
    algo = algo_of(quant)
    if algo not in _CPU_REFUSALS or algo in _PRODUCER_ON_CPU:
        return None
    return (f"no producer emulation for ModelOpt {algo}: its in-memory fake quantization runs on CUDA only (on "
            f"CPU: {_CPU_REFUSALS[algo]}) and no CPU loader exists; use mode='reference'")


def emulate(layer, w: np.ndarray, x32: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """mode="producer": ModelOpt's in-memory QuantLinear holding the export dequantized, W = D(fp32(q·s))
    (``w``; there is no ModelOpt loader): its weight quantizer takes amax = max|W| per tensor (FP8)
    or per row (FP8_PER_CHANNEL_PER_TOKEN), as max calibration of that weight does, and fake-quantizes
    W by ``modelopt-fp8-in-memory`` (the codes come out as the exported ones, the multiplier
    fp32(1/m) is not the stored scale); the input quantizer uses the calibrated amax behind
    ``input_scale`` (``static_input_amax``) or each token's amax."""
    import torch


    why = producer_refusal(layer.quant)
    if why is not None:
        raise CheckpointError(f"{layer.name}: {why}")
    algo = algo_of(layer.quant)
    if algo == "NVFP4":
        return emulate_nvfp4(layer, w, x32, dtype)
    tdtype = getattr(torch, dtype)
    per_channel = algo == "FP8_PER_CHANNEL_PER_TOKEN"
    amax = None if per_channel else static_input_amax(layer, dtype)  # refuses a float32 model first
    wt = torch.from_numpy(np.ascontiguousarray(w)).to(tdtype)  # w holds D values: exact
    w = fake_quant(wt, QuantArgs(granularity="channel" if per_channel else "tensor"), recipe=IN_MEMORY)
    xt = torch.from_numpy(np.ascontiguousarray(x32)).to(tdtype)
    if per_channel:
        xq = fake_quant(xt, QuantArgs(granularity="token"), recipe=IN_MEMORY)
    else:
        xq = fake_quant(xt, QuantArgs(granularity="tensor", dynamic=False), recipe=IN_MEMORY, amax=amax)
    return w.to(torch.float32).numpy(), xq.to(torch.float32).numpy()


def producer_dequantize(layer, dtype: str) -> np.ndarray:
    """ModelOpt's own dequantization of a stored layer, float32 holding D values: the loaders' D(fp32(q·s))
    (``forward.producer_weight``); NVFP4 as ``NVFP4QTensor.dequantize`` computes it, D(fp32(decode(q) ·
    fp32(weight_scale · weight_scale_2))) with code 0x8 decoded as +0.0 (its e2m1_values table)."""
    from .forward import producer_weight

    w = producer_weight(layer, dtype)
    if layer.quant.weight_strategy == "nvfp4":
        w = np.where(layer.weight_codes == E2M1_NEGATIVE_ZERO, np.float32(0.0), w)
    return w


def emulate_nvfp4(layer, w: np.ndarray, x32: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """mode="producer" of ModelOpt NVFP4, ModelOpt's ``NVFP4QTensor`` arithmetic (nvidia-modelopt 0.47.0
    qtensor/nvfp4_tensor.py; its CUDA fake-quant kernel is not modelled: zero blocks, the 2^-9 clamp):
    the weight as ``producer_dequantize`` gives it; the input per 16 elements of the last axis under the
    stored ``input_scale`` m: s_b = e4m3(clamp(fp32(amax_b) / fp32(6·m), 0 -> 1, [2^-9, 448]))
    (get_weights_scaling_factor), codes e2m1(x / fp32(s_b·m)) with the sign of x < 0 (quantize, _cast_fp4:
    recipe ``modelopt-nvfp4``), then D(fp32(decode · fp32(s_b·m))) with 0x8 -> +0.0 (dequantize)."""
    import torch

    from .._arrays import to_numpy
    from ..codec import decode
    from ..scaling import expand
    from .forward import _round, quantize_block_input

    w = np.where(layer.weight_codes == E2M1_NEGATIVE_ZERO, np.float32(0.0), w)
    xt = torch.from_numpy(np.ascontiguousarray(x32)).to(getattr(torch, dtype))  # x32 holds D values: exact
    qx = quantize_block_input(layer, xt)
    codes = to_numpy(qx.codes)
    m = np.float32(np.asarray(layer.input_scale, np.float32).reshape(-1)[0])
    eff = (expand(np.asarray(to_numpy(qx.scale), np.float32), codes.shape, "nvfp4") * m).astype(np.float32)
    vals = np.where(codes == E2M1_NEGATIVE_ZERO, np.float32(0.0), decode(codes, layer.quant.input_fmt))
    return w, _round(vals.astype(np.float32) * eff, dtype)


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
    kv_producer_refusal = "ModelOpt's own KV-cache fake quantization (k_bmm/v_bmm_quantizer) is not modelled"

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
    emulate = staticmethod(emulate)
    producer_refusal = staticmethod(producer_refusal)
    producer_dequantize = staticmethod(producer_dequantize)

    def kv_name(self, attn: str, which: str) -> str:
        return f"{attn}.{which}_proj.{which}_scale"


register(ModelOpt())
