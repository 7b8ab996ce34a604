"""Hugging Face ``quant_method: fp8`` checkpoints (fine-grained FP8, DeepSeek-V3 style, and
legacy AutoFP8), reference §5.5.

Fine-grained: ``weight`` F8_E4M3; ``weight_scale_inv`` F32 (some files BF16) of shape
[ceil(out/r), ceil(in/c)] for ``weight_block_size`` [r, c], or [] per tensor when the block size
is null. Despite its name ``weight_scale_inv`` is a dequantization multiplier (x ~ q * s).
Activations are ``dynamic`` (per 1 x c group for block weights, per tensor otherwise) or
``static`` with an F32 [] ``activation_scale``. Legacy AutoFP8 writes ``weight_scale`` [] and
``input_scale`` [] instead.
"""

from __future__ import annotations

from ..errors import CheckpointError
from .layout import LayerEntry, LayerQuant

NAME = "hf-fp8"
KNOWN_KEYS = {"quant_method", "activation_scheme", "weight_block_size", "fmt", "scale_fmt", "dequantize",
              "modules_to_not_convert", "ignored_layers", "kv_cache_scheme"}


class Config:
    """A parsed ``quantization_config`` of ``quant_method: fp8``."""

    def __init__(self, qc: dict, where: str, warnings: list[str]):
        unknown = sorted(set(qc) - KNOWN_KEYS)
        if unknown:
            warnings.append(f"{where}: keys {unknown} are not part of the fp8 config and were ignored")
        scheme = qc.get("activation_scheme", "dynamic")
        if scheme not in ("dynamic", "static"):
            raise CheckpointError(f"{where}.activation_scheme: {scheme!r}; expected 'dynamic' or 'static'")
        fmt = qc.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise CheckpointError(f"{where}.fmt: {fmt!r}; fp8ref loads e4m3 (float8_e4m3fn) weights")
        block = qc.get("weight_block_size")
        if block is not None and not (isinstance(block, list) and len(block) == 2
                                      and all(type(b) is int and b > 0 for b in block)):
            raise CheckpointError(f"{where}.weight_block_size: expected null or [rows, cols], got {block!r}")
        self.block = tuple(block) if block else None
        self.static = scheme == "static"
        if self.static and self.block:
            raise CheckpointError(f"{where}: static activations with weight_block_size {block} are not a "
                                  f"combination any producer writes; expected dynamic")
        skip = qc.get("modules_to_not_convert") or qc.get("ignored_layers") or []
        if not isinstance(skip, list) or not all(isinstance(s, str) for s in skip):
            raise CheckpointError(f"{where}.modules_to_not_convert: expected a list of strings, got {skip!r:.100}")
        self.not_convert = skip
        self.scale_fmt = qc.get("scale_fmt")

    def quant(self) -> LayerQuant:
        if self.block:
            return LayerQuant("block", self.block, "dynamic-group", self.block[1])
        return LayerQuant("tensor", None, "static" if self.static else "dynamic-tensor")

    def skipped(self, name: str) -> bool:
        return any(name == m or name.endswith("." + m) or name.startswith(m + ".") for m in self.not_convert)


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
    scale_shape = () if quant.weight_strategy == "tensor" else quant.scale_shape(out, inp)
    plan = [("weight", f"{name}.weight", "F8_E4M3", (out, inp)),
            ("weight_scale", f"{name}.weight_scale_inv", "F32", scale_shape)]
    if quant.input == "static":
        plan.append(("input_scale", f"{name}.activation_scale", "F32", ()))
    return plan


def quantization_config(layers: dict[str, LayerQuant], unquantized: list[str]) -> dict:
    quants = set(layers.values())
    if len(quants) > 1:
        raise CheckpointError(f"hf fp8 configs hold one scheme for all layers, got {len(quants)}: "
                              f"{sorted(q.describe() for q in quants)}")
    q = quants.pop() if quants else LayerQuant("block", (128, 128), "dynamic-group", 128)
    return {"activation_scheme": "static" if q.input == "static" else "dynamic", "fmt": "e4m3",
            "modules_to_not_convert": sorted(unquantized), "quant_method": "fp8",
            "weight_block_size": list(q.block) if q.block else None}
