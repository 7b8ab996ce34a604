"""auto-round ``auto_round:fp8_static`` checkpoints (reference §5.3, auto-round 0.16.1); the
config vocabulary is ``fp8ref.producers.auto_round``.

Tensors: ``weight`` F8_E4M3 [out, in]; ``weight_scale`` in the model dtype, shape [out] (1-D);
``input_scale`` [1]. auto-round's own loader loads only the FP8_STATIC scheme from this packing format.
"""

from __future__ import annotations

from ..errors import CheckpointError
from ..producers import auto_round as ar
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


def quantization_config(layers: dict[str, LayerQuant], unquantized: list[str]) -> dict:
    return ar.quantization_config(layers, unquantized)
