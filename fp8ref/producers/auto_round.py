"""The auto-round vocabulary: its scheme fields (``to_autoround`` / ``from_autoround``, the nine
fields of its presets and ``layer_config`` values) and the ``quantization_config`` its
``auto_round:fp8_static`` export writes (reference §5.3, auto-round 0.16.1): scheme fields at the
top level, per-layer overrides in ``extra_config`` (exact names win over regexes at load time),
layers outside ``block_name_to_quantize`` unquantized unless ``extra_config`` names them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from ..errors import CheckpointError, SpecError, did_you_mean
from ..limits import MAX_GROUP, int_in, shown
from ..patterns import Pattern
from ..scheme import (
    AUTOROUND_FIELDS,
    PRESETS,
    UNQUANTIZED_ACT_BITS,
    QuantizationScheme,
    SchemeFieldError,
    default_format,
    default_scale_dtype,
)

NAME = "auto-round"
PACKING = "auto_round:fp8_static"
FIELDS = ("bits", "group_size", "sym", "data_type", "act_bits", "act_group_size", "act_sym", "act_data_type",
          "act_dynamic", "super_bits", "super_group_size", "rotation_config")
FP8_STATIC = {"bits": 8, "group_size": -1, "sym": True, "data_type": "fp", "act_bits": 8, "act_group_size": 0,
              "act_sym": True, "act_data_type": "fp", "act_dynamic": False, "super_bits": None,
              "super_group_size": None, "rotation_config": None}
_FP_NAMES = ("fp", "fp8", "fp8_e4m3")
KV_NAMES = ("q_scale", "k_scale", "v_scale")


def is_fp8_static(s: dict) -> bool:
    return (s.get("bits") == 8 and s.get("group_size") == -1 and s.get("sym") is True
            and s.get("data_type") in _FP_NAMES and s.get("act_bits") == 8 and s.get("act_group_size") == 0
            and s.get("act_sym") in (True, None) and s.get("act_data_type") in _FP_NAMES
            and s.get("act_dynamic") is False and not s.get("super_bits") and not s.get("rotation_config"))


def unquantized(s: dict) -> bool:
    return (s.get("bits") or 16) >= 16


# The types and ranges of the scheme fields a config or an extra_config entry may give (None: unset).
_INT_RANGES = {"bits": (1, 64), "act_bits": (1, 64), "super_bits": (1, 64), "group_size": (-1, MAX_GROUP),
               "act_group_size": (-1, MAX_GROUP), "super_group_size": (-1, MAX_GROUP)}
_BOOLS = ("sym", "act_sym", "act_dynamic")
_STRINGS = ("data_type", "act_data_type")


def check_fields(fields: dict, where: str) -> None:
    """Refuse a scheme field of the wrong type or out of range before any rule compares it
    (``bits: "8"`` would otherwise meet ``>= 16``; a 2**64 group size would reach the C loops)."""
    for key, value in fields.items():
        if value is None:
            continue
        if key in _INT_RANGES:
            lo, hi = _INT_RANGES[key]
            block = key == "group_size" and isinstance(value, list) and len(value) == 2
            if not (int_in(value, lo, hi) or block and all(int_in(v, 1, MAX_GROUP) for v in value)):
                raise CheckpointError(f"{where}.{key}: expected an integer in {lo}..{hi}"
                                      f"{' or [rows, cols]' if key == 'group_size' else ''}, got {shown(value)}")
        elif key in _BOOLS and type(value) is not bool:
            raise CheckpointError(f"{where}.{key}: expected true, false or null, got {shown(value)}")
        elif key in _STRINGS and not isinstance(value, str):
            raise CheckpointError(f"{where}.{key}: expected a string or null, got {shown(value)}")


class Config:
    """A parsed ``quantization_config`` of ``quant_method: auto-round``; ``resolve`` gives a layer's
    scheme fields and where they came from."""

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
        check_fields(self.scheme, where)
        extra = qc.get("extra_config") or {}
        if not isinstance(extra, dict) or not all(isinstance(v, dict) for v in extra.values()):
            raise CheckpointError(f"{where}.extra_config: expected an object of per-layer objects")
        for key, value in extra.items():
            check_fields(value, f"{where}.extra_config[{shown(key)}]")
        self.extra = extra
        # every key is also tried as a regex (re.search), as auto-round's loader does; bounded matching
        self.regexes = [(key, Pattern(key, f"{where}.extra_config[{shown(key)}]", error=CheckpointError))
                        for key in extra]
        blocks = qc.get("block_name_to_quantize")
        if isinstance(blocks, str):
            blocks = [b for b in blocks.split(",") if b]
        if blocks is not None and not (isinstance(blocks, list) and all(isinstance(b, str) for b in blocks)):
            raise CheckpointError(f"{where}.block_name_to_quantize: expected a string or list, got {blocks!r:.100}")
        self.blocks = blocks or []
        skip = qc.get("modules_to_not_convert") or []
        if not (isinstance(skip, list) and all(isinstance(m, str) for m in skip)):
            raise CheckpointError(f"{where}.modules_to_not_convert: expected a list of module names, "
                                  f"got {shown(skip, 100)}")
        self.not_convert = skip

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


# --- scheme fields ---------------------------------------------------------------------------
# auto-round layer_config dicts may also carry these (REFERENCE §7.1/§7.2).
_AR_UNSUPPORTED = ("super_bits", "super_group_size", "rotation_config")
_AR_SCALE_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
_AR_KEYS = AUTOROUND_FIELDS + _AR_UNSUPPORTED + ("scale_dtype", "fixed_by_user", "scheme")


def to_autoround(scheme: QuantizationScheme) -> dict:
    """auto-round's nine fields (``group_size`` (r, c) for blocks; activations of a weight-only
    scheme as in its FPW8A16 preset: act_bits 16, act_data_type = data_type, the rest None).
    ``scale_dtype`` is added only when it is not the family default. Fields auto-round cannot
    express raise ``SchemeFieldError``."""
    s = scheme
    if s.rounding != "rne":
        raise SchemeFieldError("rounding", f"auto-round rounds to nearest even only, got {s.rounding!r}")
    if not s.saturate:
        raise SchemeFieldError("saturate", "auto-round always clamps to the format's range, got False")
    out = {k: s[k] for k in AUTOROUND_FIELDS}
    out["data_type"] = _ar_data_type(s, "data_type", "weight_format", s.bits)
    if s.quantizes_activations:
        out["act_data_type"] = _ar_data_type(s, "act_data_type", "act_format", s.act_bits)
    if s.scale_dtype != default_scale_dtype(s.data_type):
        names = {v: k for k, v in _AR_SCALE_DTYPES.items()}
        if s.scale_dtype not in names:
            raise SchemeFieldError("scale_dtype", f"auto-round has no {s.scale_dtype} scales for data_type "
                                   f"{s.data_type!r}")
        out["scale_dtype"] = names[s.scale_dtype]
    return out


def _ar_data_type(s: QuantizationScheme, dt_field: str, fmt_field: str, bits: int) -> str:
    family = "nv_fp" if s[dt_field] == "nv_fp4_with_static_gs" else s[dt_field]
    if s[fmt_field] == default_format(family, bits):
        return s[dt_field]
    if family == "fp" and s[fmt_field] == "float8_e5m2":
        return "fp8_e5m2"
    raise SchemeFieldError(fmt_field, f"auto-round has no data_type for {s[fmt_field]} "
                           f"(with {dt_field} {s[dt_field]!r})")


def from_autoround(value, *, base: QuantizationScheme | None = None,
                   recipe: str | None = None) -> QuantizationScheme | None:
    """auto-round scheme or ``layer_config`` value -> QuantizationScheme (None: unquantized).

    ``value``: a preset name; a dict of auto-round fields, optionally with ``"scheme": PRESET``
    whose fields the others override; or a QuantizationScheme. A dict without ``scheme`` overrides
    ``base`` (auto-round: "missing fields come from the global scheme") or, without a base, the
    scheme defaults. ``recipe`` defaults to the base's recipe, else "auto-round".
    """
    if isinstance(value, QuantizationScheme):
        return value if recipe is None else value.replace(recipe=recipe)
    if isinstance(value, str):
        preset = PRESETS[value]
        return preset if preset is None or recipe is None else preset.replace(recipe=recipe)
    if not isinstance(value, Mapping):
        raise SpecError(f"auto-round scheme: expected a preset name, a dict or a QuantizationScheme, "
                        f"got {type(value).__name__}")
    fields = dict(value)
    for key in fields:
        if key not in _AR_KEYS:
            raise SchemeFieldError(str(key), f"not an auto-round field{did_you_mean(key, _AR_KEYS)}; "
                                   f"valid: {', '.join(_AR_KEYS)}")
    for key in _AR_UNSUPPORTED:
        if fields.pop(key, None) is not None:
            raise SchemeFieldError(key, "GGUF double quantization and rotations have no fp8ref equivalent")
    fields.pop("fixed_by_user", None)  # tuning bookkeeping, no numerics
    if "scale_dtype" in fields and fields["scale_dtype"] is not None:
        dtype = str(fields["scale_dtype"]).removeprefix("torch.")
        fields["scale_dtype"] = _AR_SCALE_DTYPES.get(dtype, dtype)
    if "group_size" in fields and isinstance(fields["group_size"], list):
        fields["group_size"] = tuple(fields["group_size"])
    if type(fields.get("act_bits")) is int and fields["act_bits"] >= UNQUANTIZED_ACT_BITS:
        # auto-round ignores the other act fields then (its __eq__ does too); so does fp8ref.
        fields = {k: v for k, v in fields.items() if not k.startswith("act_")}
        fields["act_bits"] = UNQUANTIZED_ACT_BITS
    if "scheme" in fields:
        base = PRESETS[fields.pop("scheme")]
        if base is None:
            raise SchemeFieldError("scheme", "a preset that leaves the layer unquantized takes no overrides")
    fields = {k: v for k, v in fields.items() if v is not None}
    if recipe is not None:
        fields["recipe"] = recipe
    elif base is None:
        fields["recipe"] = "auto-round"
    return base.replace(**fields) if base is not None else QuantizationScheme(**fields)


# --- quantization_config writer ---------------------------------------------------------------
def _block_of(name: str) -> str | None:
    """``model.layers`` for ``model.layers.3.mlp.up_proj``: the container of numbered blocks."""
    parts = name.split(".")
    for i, p in enumerate(parts):
        if p.isdigit() and i:
            return ".".join(parts[:i])
    return None


def quantization_config(layers: Iterable[str], unquantized: Iterable[str]) -> dict:
    """The config auto-round 0.16.1 writes for FP8_STATIC ``layers``, with ``extra_config`` entries
    for quantized layers outside the blocks and ``unquantized`` linear layers inside them."""
    layers = list(layers)
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
