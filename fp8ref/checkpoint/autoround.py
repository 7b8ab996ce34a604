"""auto-round ``auto_round:fp8_static`` checkpoints (reference §5.3, auto-round 0.16.1).

Tensors: ``weight`` F8_E4M3 [out, in]; ``weight_scale`` in the model dtype, shape [out] (1-D);
``input_scale`` [1]. The config carries auto-round's scheme fields at the top level, per-layer
overrides in ``extra_config`` (exact names win over regexes at load time), and no ignore list:
layers outside ``block_name_to_quantize`` stay unquantized unless ``extra_config`` names them.
auto-round's own loader loads only the FP8_STATIC scheme from this packing format.
"""

from __future__ import annotations

import re

from ..errors import CheckpointError
from .layout import D_DTYPES, LayerEntry, LayerQuant

NAME = "auto-round"
PACKING = "auto_round:fp8_static"
FIELDS = ("bits", "group_size", "sym", "data_type", "act_bits", "act_group_size", "act_sym", "act_data_type",
          "act_dynamic", "super_bits", "super_group_size", "rotation_config")
FP8_STATIC = {"bits": 8, "group_size": -1, "sym": True, "data_type": "fp", "act_bits": 8, "act_group_size": 0,
              "act_sym": True, "act_data_type": "fp", "act_dynamic": False, "super_bits": None,
              "super_group_size": None, "rotation_config": None}
_FP_NAMES = ("fp", "fp8", "fp8_e4m3")
KV_NAMES = ("q_scale", "k_scale", "v_scale")


def _is_fp8_static(s: dict) -> bool:
    return (s.get("bits") == 8 and s.get("group_size") == -1 and s.get("sym") is True
            and s.get("data_type") in _FP_NAMES and s.get("act_bits") == 8 and s.get("act_group_size") == 0
            and s.get("act_sym") in (True, None) and s.get("act_data_type") in _FP_NAMES
            and s.get("act_dynamic") is False and not s.get("super_bits") and not s.get("rotation_config"))


def _unquantized(s: dict) -> bool:
    return (s.get("bits") or 16) >= 16


class Config:
    """A parsed ``quantization_config`` of ``quant_method: auto-round``."""

    def __init__(self, qc: dict, where: str, warnings: list[str]):
        self.where = where
        packing = qc.get("packing_format")
        if packing is None:
            warnings.append(f"{where}: no 'packing_format'; auto-round's loader fails without it "
                            f"(intel/auto-round PR #1452). Fix: add \"packing_format\": \"{PACKING}\"")
        elif packing != PACKING:
            raise CheckpointError(f"{where}.packing_format: {packing!r}; fp8ref loads auto-round FP8 as "
                                  f"{PACKING!r} (the llm_compressor export is loaded as compressed-tensors)")
        self.scheme = {k: qc.get(k) for k in FIELDS}
        extra = qc.get("extra_config") or {}
        if not isinstance(extra, dict) or not all(isinstance(v, dict) for v in extra.values()):
            raise CheckpointError(f"{where}.extra_config: expected an object of per-layer objects")
        self.extra = extra
        self.regexes = []
        for key in extra:
            try:
                self.regexes.append((key, re.compile(key)))
            except re.error as exc:
                raise CheckpointError(f"{where}.extra_config: key {key!r} is not a valid regex: {exc}") from None
        blocks = qc.get("block_name_to_quantize")
        if isinstance(blocks, str):
            blocks = [b for b in blocks.split(",") if b]
        if blocks is not None and not (isinstance(blocks, list) and all(isinstance(b, str) for b in blocks)):
            raise CheckpointError(f"{where}.block_name_to_quantize: expected a string or list, got {blocks!r:.100}")
        self.blocks = blocks or []
        skip = qc.get("modules_to_not_convert") or []
        self.not_convert = skip if isinstance(skip, list) else []

    def resolve(self, name: str) -> tuple[dict, str]:
        """The layer's 12 scheme fields and where they came from (exact key, regex, global)."""
        scheme = dict(self.scheme)
        if name in self.extra:
            scheme.update({k: v for k, v in self.extra[name].items() if k in FIELDS})
            return scheme, f"extra_config[{name!r}]"
        for key, rx in self.regexes:
            if rx.search(name):
                scheme.update({k: v for k, v in self.extra[key].items() if k in FIELDS})
                return scheme, f"extra_config[{key!r}]"
        in_block = not self.blocks or any(name.startswith(b + ".") for b in self.blocks)
        if not in_block or any(name == m or name.endswith("." + m) for m in self.not_convert):
            return {**scheme, "bits": 16, "act_bits": 16}, "outside block_name_to_quantize"
        return scheme, "global scheme"

    def layer_quant(self, name: str, where: str) -> LayerQuant | None:
        scheme, source = self.resolve(name)
        if _unquantized(scheme):
            return None
        if not _is_fp8_static(scheme):
            diff = {k: scheme[k] for k in FIELDS if scheme.get(k) != FP8_STATIC[k]}
            want = {k: FP8_STATIC[k] for k in diff}
            raise CheckpointError(f"{where}: layer {name!r} ({source}) has {diff}; the {PACKING} format "
                                  f"holds FP8_STATIC only, which needs {want}")
        return LayerQuant("channel", None, "static")


def layer_entry(name: str, quant: LayerQuant, source: str) -> LayerEntry:
    return LayerEntry(name, quant, {"weight": f"{name}.weight", "weight_scale": f"{name}.weight_scale",
                                    "input_scale": f"{name}.input_scale", "bias": f"{name}.bias"}, NAME,
                      group=source)


def scale_shapes(quant: LayerQuant, out: int, inp: int) -> tuple[tuple[int, ...], ...]:
    return ((out,),)  # auto-round's loader multiplies by weight_scale[:, None]


# --- export ----------------------------------------------------------------------------------

def cannot_express(quant: LayerQuant) -> str | None:
    if quant != LayerQuant("channel", None, "static"):
        return (f"{PACKING} holds only FP8_STATIC (per-channel float8_e4m3fn weights, static per-tensor "
                f"inputs), got {quant.describe()}")
    return None


def tensor_plan(name: str, quant: LayerQuant, out: int, inp: int, dtype: str) -> list[tuple[str, str, str, tuple]]:
    d = D_DTYPES[dtype]
    return [("weight", f"{name}.weight", "F8_E4M3", (out, inp)), ("weight_scale", f"{name}.weight_scale", d, (out,)),
            ("input_scale", f"{name}.input_scale", d, (1,))]


def _block_of(name: str) -> str | None:
    """``model.layers`` for ``model.layers.3.mlp.up_proj``: the container of numbered blocks."""
    parts = name.split(".")
    for i, p in enumerate(parts):
        if p.isdigit() and i:
            return ".".join(parts[:i])
    return None


def quantization_config(layers: dict[str, LayerQuant], unquantized: list[str]) -> dict:
    """The config auto-round 0.16.1 writes for FP8_STATIC, with ``extra_config`` entries for
    quantized layers outside the blocks and unquantized linear layers inside them."""
    blocks = sorted({b for b in map(_block_of, layers) if b})
    extra = {}
    for name in sorted(layers):
        if not any(name.startswith(b + ".") for b in blocks):
            extra[name] = dict(FP8_STATIC)
    for name in sorted(unquantized):
        if any(name.startswith(b + ".") for b in blocks):
            extra[name] = {"bits": 16, "act_bits": 16, "data_type": "float", "act_data_type": "float"}
    qc = {"act_bits": 8, "act_data_type": "fp", "act_dynamic": False, "act_group_size": 0, "act_sym": True,
          "activation_scheme": "static", "bits": 8, "block_name_to_quantize": ",".join(blocks),
          "data_type": "fp", "fmt": "e4m3", "group_size": -1, "packing_format": PACKING,
          "quant_method": NAME, "sym": True}
    if extra:
        qc["extra_config"] = extra
    return qc
