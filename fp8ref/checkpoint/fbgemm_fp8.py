"""transformers ``quant_method: fbgemm_fp8`` checkpoints (``FbgemmFp8HfQuantizer``, transformers
5.17 ``integrations/fbgemm_fp8.py``); the config vocabulary is ``fp8ref.producers.fbgemm_fp8``.

Per linear layer (``FbgemmFp8Linear``): ``weight`` F8_E4M3 [out, in]; ``weight_scale`` F32 [out, 1],
a per-row (per output channel) dequantization multiplier, as FBGEMM's CUDA ``quantize_fp8_per_row``
returns it: s = fp32(max(amax_row / 448, 1/(448*512))), q = e4m3(x / s) (the ``fbgemm-fp8`` recipe);
``bias`` (FbgemmFp8Linear allocates it in float32). Activations are quantized per token at every
forward by the same op with ``scale_ub = activation_scale_ub`` (the amax capped at it; the buffer
``input_scale_ub`` is not saved), then ``f8f8bf16_rowwise(use_fast_accum=True)``.

No CPU loader exists (transformers raises without CUDA/XPU, and needs fbgemm-gpu on CUDA), so no
producer forward is modelled; ``mode="reference"`` quantizes the input with the ``fbgemm-fp8``
recipe capped at the checkpoint's ``activation_scale_ub``, then the exact scaled matmul.
"""

from __future__ import annotations

from ..errors import CheckpointError
from ..io.safetensors import TensorStore
from ..producers import fbgemm_fp8 as fb
from ..recipes import with_amax_ub
from ..registry import get_recipe
from .base import Defaults, ScaleDecl, accept, fp8_weights, plain_linears, register
from .layout import LayerEntry, LayerQuant

NAME = fb.NAME
QUANT = LayerQuant("channel", None, "dynamic-token")
RECIPE = "fbgemm-fp8"


def layers(qc, store, where, warnings):
    if qc is None:
        raise CheckpointError(f"{store.root}: FBGEMM fp8 layouts are only read with their quantization_config")
    cfg = fb.Config(qc, where, warnings)
    entries = []
    for name in fp8_weights(store):
        if cfg.skipped(name):
            raise CheckpointError(f"{store.where(name + '.weight')}: float8 weight, but {where}."
                                  f"modules_to_not_convert lists {name!r}: config and tensors disagree")
        entry = LayerEntry(name, QUANT, {"weight": f"{name}.weight", "weight_scale": f"{name}.weight_scale",
                                         "bias": f"{name}.bias"}, NAME, group="fbgemm_fp8",
                           input_amax_ub=cfg.ub)
        entries.append(accept(store, entry, scale_shapes))
    for module in plain_linears(store, entries, ("weight_scale",)):
        if not cfg.skipped(module):
            warnings.append(f"{store.where(module + '.weight')}: stored unquantized, but {where}."
                            f"modules_to_not_convert does not list {module!r}; transformers would replace it "
                            f"with an FbgemmFp8Linear without its scale. Fix: add {module!r} to modules_to_not_convert")
    return entries, {}


def scale_shapes(quant: LayerQuant, out: int, inp: int) -> tuple[tuple[int, ...], ...]:
    return ((out, 1),)  # FbgemmFp8Linear.weight_scale is [out, 1]; a 1-D [out] would not load


def cannot_express(quant: LayerQuant) -> str | None:
    if quant != QUANT:
        return (f"fbgemm_fp8 holds per-channel float8_e4m3fn weights with dynamic per-token inputs, got "
                f"{quant.describe()}")
    return None


def tensor_plan(name: str, quant: LayerQuant, out: int, inp: int, dtype: str) -> list[tuple[str, str, str, tuple]]:
    return [("weight", f"{name}.weight", "F8_E4M3", (out, inp)),
            ("weight_scale", f"{name}.weight_scale", "F32", (out, 1))]


KV_REFUSAL = "its quantization_config (quant_method 'fbgemm_fp8') has no KV-cache field"


def quantization_config(layers: dict[str, LayerQuant], unquantized: list[str], kv: bool = False) -> dict:
    if kv:
        raise CheckpointError(f"{NAME}: {KV_REFUSAL}")
    for q in layers.values():
        why = cannot_express(q)
        if why:
            raise CheckpointError(f"{NAME}: {why}")
    return fb.quantization_config(unquantized)


class FbgemmFp8(Defaults):
    name = NAME
    scales = (
        ScaleDecl("channel, dynamic-token input", "weight_scale", "multiplier", "F32", "[out, 1]", "-",
                  "fp32(max(amax_row/448, 1/229376)); inputs per token, amax capped at activation_scale_ub"),
    )
    methods = (fb.METHOD,)
    detect_rank = 3  # never guessed: [out, 1] F32 scales without a config read as compressed-tensors
    scheme_scale_dtype = "float32"
    scales_follow_recipe = False  # weight_scale is F32 whatever the recipe
    kv_refusal = KV_REFUSAL

    def detect(self, store: TensorStore, fp8_layers: list[str]) -> bool:
        return False

    def recipe_of(self, quant: LayerQuant) -> str:
        return RECIPE

    def input_recipe(self, entry: LayerEntry):
        """The activations' recipe: FBGEMM's per-row quantizer with scale_ub = activation_scale_ub."""
        return with_amax_ub(get_recipe(RECIPE), entry.input_amax_ub or fb.DEFAULT_UB)

    def carry_config(self, source: dict | None, qc: dict) -> dict:
        if isinstance(source, dict) and "activation_scale_ub" in source:
            return {**qc, "activation_scale_ub": source["activation_scale_ub"]}
        return qc

    layers = staticmethod(layers)
    cannot_express = staticmethod(cannot_express)
    tensor_plan = staticmethod(tensor_plan)
    quantization_config = staticmethod(quantization_config)


register(FbgemmFp8())
