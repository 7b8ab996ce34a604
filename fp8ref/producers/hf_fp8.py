"""The Hugging Face ``quant_method: fp8`` vocabulary (transformers' FineGrainedFP8 / DeepSeek-V3
style, legacy AutoFP8), reference §5.5: the ``quantization_config`` it reads and writes."""

from __future__ import annotations

from ..errors import CheckpointError
from ..limits import MAX_GROUP, int_in, shown

NAME = "hf-fp8"
METHOD = "fp8"  # its quant_method
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
                                      and all(int_in(b, 1, MAX_GROUP) for b in block)):
            raise CheckpointError(f"{where}.weight_block_size: expected null or [rows, cols] of integers in "
                                  f"1..{MAX_GROUP}, got {shown(block)}")
        self.block = tuple(block) if block else None
        self.static = scheme == "static"
        if self.static and self.block:
            raise CheckpointError(f"{where}: static activations with weight_block_size {block} are not a "
                                  f"combination any producer writes; expected dynamic")
        skip = qc.get("modules_to_not_convert") or qc.get("ignored_layers") or []
        if not isinstance(skip, list) or not all(isinstance(s, str) for s in skip):
            raise CheckpointError(f"{where}.modules_to_not_convert: expected a list of strings, got {skip!r:.100}")
        self.not_convert = skip
        scale_fmt = qc.get("scale_fmt", "float")
        if scale_fmt not in ("float", "ue8m0", None):
            raise CheckpointError(f"{where}.scale_fmt: {scale_fmt!r}; expected 'float' or 'ue8m0'")
        # ue8m0 (DeepSeek V3.1, transformers' FineGrainedFP8 scale_fmt): power-of-two weight_scale_inv,
        # stored as F8_E8M0 bytes (transformers' Fp8Quantize) or as F32 powers of two
        self.ue8m0 = scale_fmt == "ue8m0"

    def skipped(self, name: str) -> bool:
        return any(name == m or name.endswith("." + m) or name.startswith(m + ".") for m in self.not_convert)


def quantization_config(block: tuple[int, int] | None, static: bool, unquantized: list[str], *,
                        ue8m0: bool = False) -> dict:
    """The config for one scheme: ``weight_block_size`` (None: per tensor) and static or dynamic inputs;
    ``ue8m0``: power-of-two weight scales (``scale_fmt: ue8m0``, as transformers 5.17 writes it)."""
    qc = {"activation_scheme": "static" if static else "dynamic", "fmt": "e4m3",
          "modules_to_not_convert": sorted(unquantized), "quant_method": METHOD}
    if ue8m0:
        qc["scale_fmt"] = "ue8m0"
    qc["weight_block_size"] = list(block) if block else None
    return qc
