"""Hugging Face ``quant_method: fp8`` checkpoints (fine-grained FP8, DeepSeek-V3 style, and
legacy AutoFP8), reference §5.5; the config vocabulary is ``fp8ref.producers.hf_fp8``.

Fine-grained: ``weight`` F8_E4M3; ``weight_scale_inv`` F32 (some files BF16) of shape
[ceil(out/r), ceil(in/c)] for ``weight_block_size`` [r, c], or [] per tensor when the block size
is null. Despite its name ``weight_scale_inv`` is a dequantization multiplier (x ~ q * s).
Activations are ``dynamic`` (per 1 x c group for block weights, per tensor otherwise) or
``static`` with an F32 [] ``activation_scale``. Legacy AutoFP8 writes ``weight_scale`` [] and
``input_scale`` [] instead.
"""

from __future__ import annotations

import numpy as np

from ..codec import decode
from ..errors import CheckpointError
from ..io.safetensors import TensorStore
from ..producers import hf_fp8 as hf
from .base import Defaults, ScaleDecl, accept, fp8_weights, infer_block, plain_linears, register
from .forward import _round
from .layout import LayerEntry, LayerQuant

NAME = hf.NAME


def layer_quant(cfg: hf.Config) -> LayerQuant:
    fmt = "ue8m0" if cfg.ue8m0 else "float"
    if cfg.block:
        return LayerQuant("block", cfg.block, "dynamic-group", cfg.block[1], scale_fmt=fmt)
    return LayerQuant("tensor", None, "static" if cfg.static else "dynamic-tensor", scale_fmt=fmt)


def layers(qc, store, where, warnings):
    if qc is None:
        qc = _inferred_config(store)
    cfg = hf.Config(qc, where, warnings)
    entries = []
    for name in fp8_weights(store):
        if cfg.skipped(name):
            raise CheckpointError(f"{store.where(name + '.weight')}: float8 weight, but {where}."
                                  f"modules_to_not_convert lists {name!r}: config and tensors disagree")
        legacy = f"{name}.weight_scale_inv" not in store and f"{name}.weight_scale" in store
        quant = layer_quant(cfg)
        if legacy and quant.weight_strategy == "block":
            raise CheckpointError(f"{store.where(name + '.weight_scale')}: AutoFP8-style per-tensor "
                                  f"weight_scale, but {where}.weight_block_size is {list(cfg.block)}; "
                                  f"block scales are named weight_scale_inv")
        entry = layer_entry(name, quant, legacy)
        if cfg.ue8m0:
            entry.extra_scale_dtypes = ("F8_E8M0",)
            entry.group += " ue8m0"
        elif f"{name}.weight_scale_inv" in store and store.info(f"{name}.weight_scale_inv").dtype == "F8_E8M0":
            raise CheckpointError(f"{store.where(name + '.weight_scale_inv')}: F8_E8M0 scales, but {where}.scale_fmt "
                                  f"is not 'ue8m0'; transformers allocates E8M0 scales only for scale_fmt ue8m0")
        entries.append(accept(store, entry, scale_shapes))
    plain = plain_linears(store, entries, ("weight_scale_inv", "weight_scale"))
    for module in plain:
        if not cfg.skipped(module) and not module.endswith("lm_head"):
            warnings.append(f"{store.where(module + '.weight')}: stored unquantized, but {where}."
                            f"modules_to_not_convert does not list {module!r}; transformers would replace it "
                            f"with an FP8 layer. Fix: add {module!r} to modules_to_not_convert")
    return entries, {}


def _inferred_config(store: TensorStore) -> dict:
    block = infer_block(store, "weight_scale_inv")
    static = any(n.endswith((".activation_scale", ".input_scale")) for n in store)
    return hf.quantization_config(block, static, [])


def layer_entry(name: str, quant: LayerQuant, legacy: bool) -> LayerEntry:
    """``legacy``: AutoFP8 names (``weight_scale``, ``input_scale``) instead of HF's."""
    scale = "weight_scale" if legacy else "weight_scale_inv"
    act = "input_scale" if legacy else "activation_scale"
    return LayerEntry(name, quant, {"weight": f"{name}.weight", "weight_scale": f"{name}.{scale}",
                                    "input_scale": f"{name}.{act}", "bias": f"{name}.bias"}, NAME,
                      group="AutoFP8" if legacy else "fine-grained")


def scale_shapes(quant: LayerQuant, out: int, inp: int) -> tuple[tuple[int, ...], ...]:
    if quant.weight_strategy == "tensor":
        return ((), (1,))
    return (quant.scale_shape(out, inp),)


# --- export ----------------------------------------------------------------------------------

def cannot_express(quant: LayerQuant) -> str | None:
    if quant.weight_fmt != "float8_e4m3fn":
        return f"hf fp8 holds float8_e4m3fn weights only, got {quant.weight_fmt}"
    if quant.weight_strategy == "block":
        if quant.input != "dynamic-group" or quant.input_group != quant.block[1]:
            return (f"hf fp8 block weights take dynamic 1x{quant.block[1]} input groups, got "
                    f"{quant.describe()}")
        return None
    if quant.weight_strategy == "tensor" and quant.input in ("static", "dynamic-tensor"):
        return None
    return (f"hf fp8 holds 2-D block weights with dynamic group inputs, or per-tensor weights with static or "
            f"dynamic per-tensor inputs; got {quant.describe()}")


def tensor_plan(name: str, quant: LayerQuant, out: int, inp: int, dtype: str) -> list[tuple[str, str, str, tuple]]:
    """F32 scales (ue8m0: powers of two; export stores them as F8_E8M0 bytes for scale_dtype float8_e8m0fnu)."""
    scale_shape = () if quant.weight_strategy == "tensor" else quant.scale_shape(out, inp)
    plan = [("weight", f"{name}.weight", "F8_E4M3", (out, inp)),
            ("weight_scale", f"{name}.weight_scale_inv", "F32", scale_shape)]
    if quant.input == "static":
        plan.append(("input_scale", f"{name}.activation_scale", "F32", ()))
    return plan


def quantization_config(layers: dict[str, LayerQuant], unquantized: list[str], kv: bool = False) -> dict:
    if kv:
        raise CheckpointError(f"{NAME}: {KV_REFUSAL}")
    quants = set(layers.values())
    if len(quants) > 1:
        raise CheckpointError(f"hf fp8 configs hold one scheme for all layers, got {len(quants)}: "
                              f"{sorted(q.describe() for q in quants)}")
    q = quants.pop() if quants else LayerQuant("block", (128, 128), "dynamic-group", 128)
    return hf.quantization_config(q.block, q.input == "static", unquantized, ue8m0=q.scale_fmt == "ue8m0")


KV_REFUSAL = ("its quantization_config (quant_method 'fp8') has no KV-cache field and its loaders read "
              "no k_scale/v_scale")


def transformers_weight(layer, dtype: str) -> np.ndarray:
    """The weight transformers 5.x's CPU reload (``Fp8Dequantize``, ``dequantize=True``) gives the model:
    D(fp32(q * s)) with the block size taken as the weight shape over the scale grid, rows // scale_rows
    by cols // scale_cols (a grid that does not divide the weight raises there, and here). Where the
    weight's rows or columns are not a multiple of the declared block but the grid divides them (a
    [160, 128] kv_a_proj_with_mqa with 2 scale rows: 80-row blocks), this is not what the format
    declares (128-row blocks, the last one cropped; ``validate`` warns): producer mode computes it."""
    s = np.asarray(layer.weight_scale).astype(np.float32)
    rows, cols = layer.shape
    sr, sc = s.shape if s.ndim == 2 else (1, 1)
    if rows % sr or cols % sc:
        raise CheckpointError(f"{layer.name}: weight {list(layer.shape)} is not divisible by the scale grid "
                              f"{list(s.shape)}; transformers' Fp8Dequantize raises here")
    q = decode(layer.weight_codes, layer.quant.weight_fmt).astype(np.float32).reshape(sr, rows // sr, sc, cols // sc)
    return _round((q * s.reshape(sr, 1, sc, 1)).reshape(rows, cols), dtype)


def transformers_block_quirk(rows: int, cols: int, block: tuple[int, int]) -> tuple[int, int] | None:
    """The (rows, cols) block transformers' Fp8Dequantize uses for a [rows, cols] weight with ``block``
    scales where it differs from ``block`` and the grid divides the weight (else None)."""
    r, c = block
    sr, sc = -(-rows // r), -(-cols // c)
    if rows % sr or cols % sc or (rows // sr, cols // sc) == (r, c):
        return None
    if rows // sr == min(r, rows) and cols // sc == min(c, cols):
        return None  # a weight smaller than one block: the same single block
    return rows // sr, cols // sc


def emulate(layer, w: np.ndarray, x32: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """mode="producer": transformers 5.x without CUDA/XPU loads quant_method fp8 with
    ``dequantize=True`` (``Fp8Dequantize``): W = ``transformers_weight`` (its block geometry, not
    necessarily the format's); the input is not quantized, then nn.Linear's D matmul."""
    return transformers_weight(layer, dtype), x32


def emulate_experts(layer, dtype: str) -> np.ndarray:
    """mode="producer" of an MoE expert: transformers' Fp8Dequantize runs per expert before the merge
    into the fused parameter, the same D weight as a linear's; the fused experts run unquantized."""
    return transformers_weight(layer, dtype)


def validate(store: TensorStore, entries: list[LayerEntry], warnings: list[str]) -> None:
    """scale_fmt ue8m0: every weight_scale_inv must be a power of two (engines' UE8M0 kernels read
    only the exponent; DeepGEMM rounds others up). Block layers whose blocks transformers' CPU reload
    takes otherwise than the format declares (``transformers_block_quirk``) get a warning."""
    for e in entries:
        if e.quant.block:
            rows, cols = store.info(e.tensors["weight"]).shape
            alt = transformers_block_quirk(rows, cols, tuple(e.quant.block))
            if alt is not None:
                r, c = e.quant.block
                warnings.append(f"{store.where(e.tensors['weight'])}: a [{rows}, {cols}] weight with {r}x{c} blocks "
                                f"({-(-rows // r)}x{-(-cols // c)} scales): transformers' CPU reload "
                                f"(Fp8Dequantize) dequantizes it in {alt[0]}x{alt[1]} blocks (the weight shape over "
                                f"the scale grid), not the declared ones: its logits are not the checkpoint's. "
                                f"fp8ref's reference uses the declared blocks; its producer mode what transformers "
                                f"computes")
    for e in entries:
        if not e.extra_scale_dtypes:
            continue
        name = e.tensors["weight_scale"]
        if store.info(name).dtype == "F8_E8M0":
            continue
        s = np.asarray(store.get(name), np.float64)
        m, _ = np.frexp(s)
        off = int(np.count_nonzero((m != 0.5) & np.isfinite(s) & (s > 0)))
        if off:
            warnings.append(f"{store.where(name)}: scale_fmt ue8m0 but {off} of {s.size} scales are not powers of "
                            f"two; a UE8M0 engine keeps only their exponent (rounded up by DeepGEMM). Fix: requantize "
                            f"with power-of-two scales or drop scale_fmt")


class HfFp8(Defaults):
    name = NAME
    scales = (
        ScaleDecl("block", "weight_scale_inv", "multiplier", "F32 (BF16 read)",
                  "[ceil(out/r), ceil(in/c)]", "weight_block_size [r, c]", "a multiplier despite its name"),
        ScaleDecl("tensor", "weight_scale_inv", "multiplier", "F32", "[]", "-", "a multiplier despite its name"),
        ScaleDecl("tensor, static input", "activation_scale", "multiplier", "F32", "[]"),
        ScaleDecl("tensor (AutoFP8 names)", "weight_scale / input_scale", "multiplier", "F32", "[]"),
    )
    methods = (hf.METHOD,)
    detect_rank = 0
    scheme_scale_dtype = "float32"
    scales_follow_recipe = False  # weight_scale_inv / activation_scale are F32 whatever the recipe
    kv_refusal = KV_REFUSAL
    emulate = staticmethod(emulate)  # the CPU loader's dequantized path; CUDA loaders run FP8 kernels
    emulate_experts = staticmethod(emulate_experts)

    def detect(self, store: TensorStore, fp8_layers: list[str]) -> bool:
        return any(f"{n}.weight_scale_inv" in store for n in fp8_layers)

    pow2_scale_fmt = "ue8m0"  # what a power-of-two recipe (hf-fp8-ue8m0) makes of its layers

    layers = staticmethod(layers)
    validate = staticmethod(validate)
    cannot_express = staticmethod(cannot_express)
    tensor_plan = staticmethod(tensor_plan)
    quantization_config = staticmethod(quantization_config)


register(HfFp8())
