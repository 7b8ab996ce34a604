"""QuantizationScheme: one frozen, validated, dict-like description of how a layer is quantized.

The scheme speaks two vocabularies at once and keeps them coherent:

* auto-round's nine fields (``bits, group_size, sym, data_type, act_bits, act_group_size,
  act_sym, act_data_type, act_dynamic``), with auto-round's meanings;
* explicit fields a numerics reference must pin down: element formats, granularities with
  2-D block shapes, scale dtype, rounding, saturation and the producer recipe.

Fields left out (or None) are *derived*; fields given on both sides must agree, else
``SchemeFieldError`` (a ``SpecError``) names the field and the rule. The derivation table is in
docs/schemes.md. Translation to and from auto-round dicts and compressed-tensors
``QuantizationArgs`` lives at the bottom of this module; presets come from specs/presets.yaml.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterator, Mapping
from functools import lru_cache

from .codec import ROUNDING_MODES
from .errors import SpecError
from .formats import FORMATS
from .resources import SPECS_DIR

FIELDS = (
    "bits", "group_size", "sym", "data_type",
    "act_bits", "act_group_size", "act_sym", "act_data_type", "act_dynamic",
    "weight_format", "weight_granularity", "block_shape",
    "act_format", "act_granularity",
    "scale_dtype", "rounding", "saturate", "recipe",
)
AUTOROUND_FIELDS = FIELDS[:9]

DATA_TYPES = ("fp", "mx_fp", "nv_fp")
# nv_fp4_with_static_gs: NVFP4 activations whose global scale is calibrated (static) while the
# 16-element block scales are computed at run time (compressed-tensors: dynamic "local").
ACT_DATA_TYPES = DATA_TYPES + ("nv_fp4_with_static_gs",)
# auto-round spellings that also fix the element format.
DATA_TYPE_ALIASES = {"fp8": ("fp", "float8_e4m3fn"), "fp8_e4m3": ("fp", "float8_e4m3fn"),
                     "fp8_e4m3fn": ("fp", "float8_e4m3fn"), "fp8_e5m2": ("fp", "float8_e5m2")}
WEIGHT_GRANULARITIES = ("tensor", "channel", "group", "block", "tensor_group")
ACT_GRANULARITIES = ("tensor", "token", "group", "tensor_group")
SCALE_DTYPES = ("model", "float32", "bfloat16", "float16", "float8_e8m0fnu", "float8_e4m3fn")
# One recipe per file of specs/recipes (fp8ref.recipes loads them; the file name is the recipe name).
KNOWN_RECIPES = tuple(sorted(path.stem for path in (SPECS_DIR / "recipes").glob("*.yaml")))
UNQUANTIZED_ACT_BITS = 16

_ELEMENT_FORMATS = {
    "fp": ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"),
    "mx_fp": ("float8_e4m3fn", "float8_e5m2", "float6_e2m3fn", "float6_e3m2fn", "float4_e2m1fn"),
    "nv_fp": ("float4_e2m1fn",),
}
_DEFAULT_FORMAT = {("fp", 8): "float8_e4m3fn", ("mx_fp", 8): "float8_e4m3fn", ("mx_fp", 6): "float6_e2m3fn",
                   ("mx_fp", 4): "float4_e2m1fn", ("nv_fp", 4): "float4_e2m1fn"}
_BITS = {"fp": (8,), "mx_fp": (4, 6, 8), "nv_fp": (4,)}
# Families whose grouping is fixed by their definition (OCP MX v1.0; NVFP4).
_FIXED_GROUPING = {"mx_fp": ("group", 32, "OCP MX v1.0 scales blocks of 32 elements"),
                   "nv_fp": ("tensor_group", 16, "NVFP4 scales blocks of 16 elements under a global scale")}
_SCALE = {"fp": ("model", "float32", "bfloat16", "float16", "float8_e8m0fnu"),
          "mx_fp": ("float8_e8m0fnu",), "nv_fp": ("float8_e4m3fn",)}

# Setting a field (to a new value) forgets the fields derived from it, so that
# ``replace(group_size=128)`` re-derives the granularity instead of contradicting it.
_DERIVED_FROM = {
    "bits": ("weight_format",),
    "weight_format": ("bits",),
    "data_type": ("weight_format", "scale_dtype", "group_size", "weight_granularity", "block_shape",
                  "act_data_type", "act_format", "act_group_size", "act_granularity"),
    "group_size": ("weight_granularity", "block_shape"),
    "weight_granularity": ("group_size", "block_shape"),
    "block_shape": ("group_size", "weight_granularity"),
    "act_bits": ("act_format",),
    "act_data_type": ("act_format",),
    "act_format": ("act_bits",),
    "act_group_size": ("act_granularity",),
    "act_granularity": ("act_group_size",),
}


class SchemeFieldError(SpecError):
    """A scheme field that breaks a rule; ``field`` and ``rule`` let spec files prefix FILE:LINE."""

    def __init__(self, field: str, rule: str):
        super().__init__(f"{field}: {rule}")
        self.field, self.rule = field, rule


class UnknownFieldError(SchemeFieldError, KeyError):
    """``scheme[name]`` or a constructor keyword that is not a scheme field."""

    def __init__(self, field: str):
        super().__init__(field, f"unknown field{_did_you_mean(field, FIELDS)}; valid fields: {', '.join(FIELDS)}")

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


def _did_you_mean(value, choices) -> str:
    close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _one_of(field: str, value, choices, extra: str = "") -> SchemeFieldError:
    shown = ", ".join(str(c) for c in choices)
    return SchemeFieldError(field, f"expected one of {shown}{extra}, got {value!r}{_did_you_mean(value, choices)}")


# --- field checks ----------------------------------------------------------------------------
def _check_types(given: dict) -> None:
    for name, value in given.items():
        if name in ("bits", "act_bits", "act_group_size"):
            if type(value) is not int:
                raise SchemeFieldError(name, f"expected an integer, got {value!r}")
        elif name in ("sym", "act_sym", "act_dynamic", "saturate"):
            if type(value) is not bool:
                raise SchemeFieldError(name, f"expected true or false, got {value!r}")
        elif name in ("group_size", "block_shape"):
            if name == "group_size" and type(value) is int:
                continue
            if not (isinstance(value, (list, tuple)) and len(value) == 2
                    and all(type(v) is int and v > 0 for v in value)):
                want = "an integer or [rows, cols]" if name == "group_size" else "[rows, cols]"
                raise SchemeFieldError(name, f"expected {want} of positive integers, got {value!r}")
        elif not isinstance(value, str):
            raise SchemeFieldError(name, f"expected a string, got {value!r}")
    enums = {"weight_granularity": WEIGHT_GRANULARITIES, "act_granularity": ACT_GRANULARITIES,
             "scale_dtype": SCALE_DTYPES, "rounding": ROUNDING_MODES, "recipe": KNOWN_RECIPES}
    for name, choices in enums.items():
        if name in given and given[name] not in choices:
            raise _one_of(name, given[name], choices)
    for name in ("weight_format", "act_format"):
        if name in given and given[name] not in FORMATS:
            raise _one_of(name, given[name], FORMATS)


def _family(field: str, value: str, choices: tuple) -> tuple[str, str | None]:
    """data_type / act_data_type -> (canonical name, element format it implies or None)."""
    if value in DATA_TYPE_ALIASES:
        return DATA_TYPE_ALIASES[value]
    if value not in choices:
        raise _one_of(field, value, choices, " (fp8ref covers floating-point formats only)")
    return value, None


def _element(given: dict, family: str, prefix: str, implied: str | None, dt_field: str, unquantized: tuple = ()):
    """Resolve (bits, format) of weights (prefix '') or activations (prefix 'act_')."""
    bits_f, fmt_f = prefix + "bits", ("weight_format" if not prefix else "act_format")
    fmt, bits = given.get(fmt_f), given.get(bits_f)
    allowed_fmt = _ELEMENT_FORMATS[family]
    if implied is not None:
        if fmt is not None and fmt != implied:
            raise SchemeFieldError(fmt_f, f"{dt_field} {given[dt_field]!r} means {implied}, got {fmt!r}")
        fmt = implied
    if fmt is not None:
        if fmt not in allowed_fmt:
            raise SchemeFieldError(fmt_f, f"{dt_field} {family!r} allows {', '.join(allowed_fmt)}; got {fmt!r}")
        held = FORMATS[fmt].bits
        if bits is not None and bits != held:
            raise SchemeFieldError(bits_f, f"{fmt_f} {fmt} holds {held} bits, got {bits}")
        return held, fmt
    choices = _BITS[family]
    bits = choices[-1] if bits is None else bits
    if bits not in choices:
        where = "" if family == "fp" else f" with {dt_field} {family!r}"
        raise _one_of(bits_f, bits, choices + unquantized, where)
    return bits, _DEFAULT_FORMAT[(family, bits)]


def _grouping(field: str, gran_field: str, size, gran, family: str, tensor_like: dict):
    """Reconcile an auto-round group size with an explicit granularity.

    ``tensor_like`` maps the non-positive sizes to granularities: weights {0: tensor,
    -1: channel}, activations {0: tensor, -1: token}.
    """
    grouped = "tensor_group" if family == "nv_fp" else "group"
    if isinstance(size, (list, tuple)):
        implied = "block"
    elif size is None:
        implied = None
    elif size in tensor_like:
        implied = tensor_like[size]
    elif size > 0:
        implied = grouped if gran is None else ("tensor_group" if gran == "tensor_group" else "group")
    else:
        meanings = ", ".join(f"{k} ({v})" for k, v in tensor_like.items())
        raise SchemeFieldError(field, f"expected {meanings}, a positive group size"
                               + (" or [rows, cols]" if "channel" in tensor_like.values() else "")
                               + f", got {size}")
    fixed = _FIXED_GROUPING.get(family)
    gran_given = gran is not None
    if gran is None and implied is None:
        if fixed:
            return fixed[0], fixed[1]
        return ("channel", -1) if "channel" in tensor_like.values() else ("tensor", 0)
    if gran is None:
        gran = implied
    elif implied is not None and implied != gran:
        need = {v: f"{field} {k}" for k, v in tensor_like.items()}
        need.update(group=f"a positive {field}", tensor_group=f"a positive {field}", block="[rows, cols]")
        shown = list(size) if isinstance(size, tuple) else size
        raise SchemeFieldError(field, f"{gran_field} {gran!r} needs {need[gran]}, got {shown!r}")
    if size is None:
        by_gran = {v: k for k, v in tensor_like.items()}
        if gran in by_gran:
            size = by_gran[gran]
        elif fixed and gran == fixed[0]:
            size = fixed[1]
        elif gran != "block":
            raise SchemeFieldError(field, f"{gran_field} {gran!r} needs a positive {field}")
    if fixed and (gran, size) != fixed[:2]:
        bad, shown = (gran_field, gran) if gran_given and gran != fixed[0] else (field, size)
        raise SchemeFieldError(bad, f"{fixed[2]} ({gran_field} {fixed[0]!r}, {field} {fixed[1]}), got {shown!r}")
    if gran == "tensor_group" and family != "nv_fp":
        raise SchemeFieldError(gran_field, f"'tensor_group' is NVFP4's two-level scaling and needs the 'nv_fp' "
                               f"data type, got {family!r}")
    return gran, size


def _normalize(given: dict) -> dict:
    _check_types(given)
    out = dict.fromkeys(FIELDS)
    family, implied = _family("data_type", given.get("data_type", "fp"), DATA_TYPES)
    out["data_type"] = family
    out["bits"], out["weight_format"] = _element(given, family, "", implied, "data_type")
    if given.get("sym", True) is not True:
        raise SchemeFieldError("sym", "floating-point quantization is symmetric (no zero point), got False")
    out["sym"] = True

    # weights: group_size <-> weight_granularity <-> block_shape
    size, block = given.get("group_size"), given.get("block_shape")
    size = tuple(size) if isinstance(size, list) else size
    block = tuple(block) if block is not None else None
    gran = given.get("weight_granularity")
    if size is None and gran is None and block is not None:
        gran = "block"
    gran, size = _grouping("group_size", "weight_granularity", size, gran, family, {0: "tensor", -1: "channel"})
    if gran == "block":
        if block is None and size is None:
            raise SchemeFieldError("block_shape", "weight_granularity 'block' needs block_shape [rows, cols]")
        if block is not None and size is not None and size != block:
            raise SchemeFieldError("block_shape", f"group_size says {list(size)}, block_shape says {list(block)}")
        size = block = size or block
    elif block is not None:
        raise SchemeFieldError("block_shape", f"only valid with weight_granularity 'block', got {gran!r}")
    out["group_size"], out["weight_granularity"], out["block_shape"] = size, gran, block

    scale = given.get("scale_dtype", _SCALE[family][0])
    if scale not in _SCALE[family]:
        raise SchemeFieldError("scale_dtype", f"data_type {family!r} allows {', '.join(_SCALE[family])}; got {scale!r}")
    out["scale_dtype"] = scale

    act_bits = given.get("act_bits", UNQUANTIZED_ACT_BITS)
    if act_bits == UNQUANTIZED_ACT_BITS:  # activations stay in the model dtype: nothing else applies
        if "act_data_type" in given:
            _family("act_data_type", given["act_data_type"], ACT_DATA_TYPES)
        out["act_bits"], out["act_data_type"] = act_bits, family
    else:
        _normalize_activations(given, family, out)

    out["rounding"] = given.get("rounding", "rne")
    out["saturate"] = given.get("saturate", True)
    out["recipe"] = given.get("recipe", "fp8ref")
    return out


def _normalize_activations(given: dict, family: str, out: dict) -> None:
    act_type, implied = _family("act_data_type", given.get("act_data_type", family), ACT_DATA_TYPES)
    act_family = "nv_fp" if act_type == "nv_fp4_with_static_gs" else act_type
    if act_family != family:
        raise SchemeFieldError("act_data_type", f"must be of the same family as data_type {family!r} "
                               f"(scale_dtype is shared), got {act_type!r}")
    out["act_data_type"] = act_type
    out["act_bits"], out["act_format"] = _element(given, family, "act_", implied, "act_data_type",
                                                  (UNQUANTIZED_ACT_BITS,))
    if given.get("act_sym", True) is not True:
        raise SchemeFieldError("act_sym", "floating-point quantization is symmetric (no zero point), got False")
    out["act_sym"] = True
    out["act_granularity"], out["act_group_size"] = _grouping(
        "act_group_size", "act_granularity", given.get("act_group_size"), given.get("act_granularity"),
        family, {0: "tensor", -1: "token"})
    dynamic = given.get("act_dynamic", True)
    if not dynamic and out["act_granularity"] == "token":
        raise SchemeFieldError("act_dynamic", "static activations cannot be per token (a token's scale exists "
                               "only at run time); use act_group_size 0 or act_dynamic true")
    if not dynamic and family != "fp":
        raise SchemeFieldError("act_dynamic", f"act_data_type {act_type!r} computes its block scales at run "
                               "time; static is not supported")
    out["act_dynamic"] = dynamic


# --- the value object -----------------------------------------------------------------------
class QuantizationScheme(Mapping):
    """Frozen, validated, hashable read-only mapping of the ``FIELDS`` (see docs/schemes.md).

    ``QuantizationScheme(**fields)``: omitted fields are derived; contradictions raise
    ``SchemeFieldError``. ``scheme["bits"]``, ``scheme.bits``, ``dict(scheme)``, ``==`` and
    ``hash`` all see the normalized values. Unlike auto-round, ``get`` returns a stored None
    (e.g. ``act_group_size`` of a weight-only scheme) rather than the default.
    """

    __slots__ = ("_values",)

    def __init__(self, **fields):
        for name in fields:
            if name not in FIELDS:
                raise UnknownFieldError(name)
        given = {k: v for k, v in fields.items() if v is not None}
        object.__setattr__(self, "_values", _normalize(given))

    @classmethod
    def from_dict(cls, data: Mapping) -> QuantizationScheme:
        if not isinstance(data, Mapping):
            raise SpecError(f"scheme: expected a mapping of fields, got {type(data).__name__}")
        return cls(**dict(data))

    def to_dict(self) -> dict:
        """Plain dict (lists for shapes) that ``from_dict`` turns back into an equal scheme."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in self._values.items()}

    def replace(self, **changes) -> QuantizationScheme:
        """A new scheme with ``changes``; fields derived from a changed field are re-derived."""
        values = dict(self._values)
        for name, value in changes.items():
            if name not in FIELDS:
                raise UnknownFieldError(name)
            if value != values[name]:
                for derived in _DERIVED_FROM.get(name, ()):
                    if derived not in changes:
                        values[derived] = None
        values.update(changes)
        return QuantizationScheme(**values)

    @property
    def quantizes_activations(self) -> bool:
        return self._values["act_bits"] != UNQUANTIZED_ACT_BITS

    # Mapping protocol
    def __getitem__(self, key):
        try:
            return self._values[key]
        except (KeyError, TypeError):
            raise UnknownFieldError(str(key)) from None

    def __iter__(self) -> Iterator[str]:
        return iter(FIELDS)

    def __len__(self) -> int:
        return len(FIELDS)

    def __contains__(self, key) -> bool:
        return key in self._values

    def __getattr__(self, name):
        values = object.__getattribute__(self, "_values")
        if name in values:
            return values[name]
        raise AttributeError(f"QuantizationScheme has no attribute {name!r}; fields: {', '.join(FIELDS)}")

    def __setattr__(self, name, value):
        raise AttributeError("QuantizationScheme is frozen; use replace(...)")

    def __eq__(self, other):
        if not isinstance(other, QuantizationScheme):
            return NotImplemented
        return self._values == other._values

    def __hash__(self) -> int:
        return hash(tuple(self._values.values()))

    def __repr__(self) -> str:
        return "QuantizationScheme(" + ", ".join(f"{k}={v!r}" for k, v in self._values.items()) + ")"

    def __reduce__(self):  # copy/deepcopy support (fp8ref never pickles to disk)
        return (_from_values, (self.to_dict(),))


def _from_values(values: dict) -> QuantizationScheme:
    return QuantizationScheme.from_dict(values)


# --- presets --------------------------------------------------------------------------------
PRESETS_PATH = SPECS_DIR / "presets.yaml"


class _Presets(Mapping):
    """name -> QuantizationScheme | None (None: left unquantized), loaded once from presets.yaml.

    Lookups are case-insensitive (as in auto-round) and follow ``aliases``; a miss suggests
    the closest name.
    """

    def __getitem__(self, name):
        table, aliases = _load_presets()
        key = str(name).upper()
        key = {a.upper(): t.upper() for a, t in aliases.items()}.get(key, key)
        for canonical in table:
            if canonical.upper() == key:
                return table[canonical]
        names = list(table) + list(aliases)
        close = difflib.get_close_matches(str(name).upper(), [n.upper() for n in names], n=1, cutoff=0.5)
        hint = ""
        if close:
            hint = f"; did you mean {next(n for n in names if n.upper() == close[0])!r}?"
        raise SchemeFieldError("scheme", f"unknown preset {name!r}{hint} (known: {', '.join(names)})")

    def __contains__(self, name) -> bool:
        try:
            self[name]
        except SpecError:
            return False
        return True

    def __iter__(self):
        return iter(_load_presets()[0])

    def __len__(self):
        return len(_load_presets()[0])


PRESETS: Mapping[str, QuantizationScheme | None] = _Presets()


@lru_cache(maxsize=1)
def _load_presets() -> tuple[dict, dict]:
    from .io.yaml import load_yaml

    doc = load_yaml(PRESETS_PATH)
    data = doc.data
    if not isinstance(data, dict) or set(data) != {"presets", "aliases"}:
        raise doc.error((), "expected a mapping with exactly the keys 'presets' and 'aliases'")
    table = {}
    for name, entry in data["presets"].items():
        path = ("presets", name)
        if not isinstance(entry, dict) or set(entry) != {"defined_by", "description", "fields"}:
            raise doc.error(path, "expected keys defined_by, description, fields")
        fields = entry["fields"]
        try:
            table[name] = None if fields is None else QuantizationScheme.from_dict(fields)
        except SchemeFieldError as exc:
            raise doc.error(path + ("fields", exc.field), exc.rule) from None
    aliases = {}
    for alias, target in data["aliases"].items():
        if target not in table:
            raise doc.error(("aliases", alias), f"unknown preset {target!r}")
        aliases[str(alias)] = target
    return table, aliases



def preset_name(scheme: QuantizationScheme | None) -> str | None:
    """The first preset equal to ``scheme`` (for display), or None."""
    for name, value in _load_presets()[0].items():
        if value == scheme:
            return name
    return None


# --- auto-round vocabulary ------------------------------------------------------------------
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
    if s.scale_dtype != _SCALE[s.data_type][0]:
        names = {v: k for k, v in _AR_SCALE_DTYPES.items()}
        if s.scale_dtype not in names:
            raise SchemeFieldError("scale_dtype", f"auto-round has no {s.scale_dtype} scales for data_type "
                                   f"{s.data_type!r}")
        out["scale_dtype"] = names[s.scale_dtype]
    return out


def _ar_data_type(s: QuantizationScheme, dt_field: str, fmt_field: str, bits: int) -> str:
    family = "nv_fp" if s[dt_field] == "nv_fp4_with_static_gs" else s[dt_field]
    if s[fmt_field] == _DEFAULT_FORMAT[(family, bits)]:
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
            raise SchemeFieldError(str(key), f"not an auto-round field{_did_you_mean(key, _AR_KEYS)}; "
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


# --- compressed-tensors vocabulary ----------------------------------------------------------
CT_ARGS_KEYS = ("actorder", "block_structure", "dynamic", "group_size", "num_bits", "observer",
                "observer_kwargs", "scale_dtype", "strategy", "symmetric", "type", "zp_dtype")
# Observers that compute a plain min/max (the only statistic a scheme can express).
_CT_MINMAX = (None, "minmax", "memoryless_minmax", "static_minmax", "memoryless")
_CT_STRATEGY = {"tensor": "tensor", "channel": "channel", "group": "group", "block": "block",
                "tensor_group": "tensor_group", "token": "token"}
_CT_SCALE = {"model": None, "float32": "torch.float32", "bfloat16": "torch.bfloat16", "float16": "torch.float16",
             "float8_e8m0fnu": "torch.uint8", "float8_e4m3fn": "torch.float8_e4m3fn"}


def to_ct_args(scheme: QuantizationScheme, part: str) -> dict | None:
    """``QuantizationArgs`` dict of ``part`` ("weights" or "input_activations") with every key
    compressed-tensors 0.19.0 writes (REFERENCE §5.2); None for unquantized activations."""
    s = scheme
    if part not in ("weights", "input_activations"):
        raise SpecError(f"part: expected 'weights' or 'input_activations', got {part!r}")
    for field, fmt in (("weight_format", s.weight_format), ("act_format", s.act_format)):
        if fmt is not None and fmt not in ("float8_e4m3fn", "float4_e2m1fn"):
            raise SchemeFieldError(field, f"compressed-tensors float types are e4m3fn (8 bits) and e2m1 "
                                   f"(4 bits); {fmt} has no equivalent")
    if s.scale_dtype == "float8_e8m0fnu" and s.data_type != "mx_fp":
        raise SchemeFieldError("scale_dtype", "compressed-tensors marks MX by uint8 scales; float8_e8m0fnu "
                               f"scales with data_type {s.data_type!r} would read back as MX")
    if s.rounding != "rne":
        raise SchemeFieldError("rounding", f"compressed-tensors rounds to nearest even only, got {s.rounding!r}")
    if not s.saturate:
        raise SchemeFieldError("saturate", "compressed-tensors always clamps to the format's range, got False")
    if part == "weights":
        gran, size = s.weight_granularity, s.group_size
        args = _ct_args(s.bits, gran, size if gran in ("group", "tensor_group") else None, False, s)
        args["block_structure"] = list(s.block_shape) if gran == "block" else None
        args["observer"] = "memoryless_minmax"
        return args
    if not s.quantizes_activations:
        return None
    gran = s.act_granularity
    dynamic = "local" if s.act_data_type == "nv_fp4_with_static_gs" else s.act_dynamic
    args = _ct_args(s.act_bits, gran, s.act_group_size if gran in ("group", "tensor_group") else None, dynamic, s)
    args["observer"] = {False: "static_minmax", True: None, "local": "minmax"}[dynamic]
    return args


def _ct_args(bits, gran, group_size, dynamic, s) -> dict:
    return {"actorder": None, "block_structure": None, "dynamic": dynamic, "group_size": group_size,
            "num_bits": bits, "observer": None, "observer_kwargs": {}, "scale_dtype": _CT_SCALE[s.scale_dtype],
            "strategy": _CT_STRATEGY[gran], "symmetric": True, "type": "float", "zp_dtype": None}


def from_ct_args(weights: Mapping, input_activations: Mapping | None, *,
                 recipe: str = "compressed-tensors") -> QuantizationScheme:
    """compressed-tensors ``weights`` + ``input_activations`` (0.19 all keys, or 0.20.1 with
    null/default keys dropped) -> QuantizationScheme. Observers must be min/max ones (which one
    is not kept: a scheme states the numerics, not the calibration statistic)."""
    w = _ct_parse(weights, "weights")
    fields = {"recipe": recipe, "bits": w["num_bits"], "weight_granularity": w["strategy"]}
    fields["data_type"] = _ct_family(w, "weights")
    if w["strategy"] in ("group", "tensor_group"):
        fields["group_size"] = w["group_size"]
    if w["strategy"] == "block":
        fields["block_shape"] = w["block_structure"]
    if w["dynamic"] is not False:
        raise SchemeFieldError("weights.dynamic", f"fp8ref weights are quantized ahead of time, got {w['dynamic']!r}")
    fields["scale_dtype"] = _ct_scale(w, "weights", fields["data_type"])
    if input_activations is not None:
        a = _ct_parse(input_activations, "input_activations")
        family = _ct_family(a, "input_activations")
        if _ct_scale(a, "input_activations", family) != fields["scale_dtype"]:
            raise SchemeFieldError("input_activations.scale_dtype", "must equal weights.scale_dtype "
                                   "(a scheme has one scale_dtype)")
        fields.update(act_bits=a["num_bits"], act_granularity=a["strategy"], act_data_type=family)
        if a["dynamic"] == "local":
            if family != "nv_fp":
                raise SchemeFieldError("input_activations.dynamic", "'local' is only expressible for NVFP4")
            fields["act_data_type"] = "nv_fp4_with_static_gs"
        else:
            fields["act_dynamic"] = a["dynamic"]
        if a["strategy"] in ("group", "tensor_group"):
            fields["act_group_size"] = a["group_size"]
        if a["strategy"] not in ACT_GRANULARITIES:
            raise SchemeFieldError("input_activations.strategy", f"expected one of {', '.join(ACT_GRANULARITIES)}, "
                                   f"got {a['strategy']!r}")
    return QuantizationScheme(**fields)


def _ct_parse(args: Mapping, part: str) -> dict:
    if not isinstance(args, Mapping):
        raise SpecError(f"{part}: expected a QuantizationArgs mapping, got {type(args).__name__}")
    for key in args:
        if key not in CT_ARGS_KEYS:
            raise SchemeFieldError(f"{part}.{key}", f"not a QuantizationArgs key{_did_you_mean(key, CT_ARGS_KEYS)}")
    a = {"num_bits": 8, "type": "int", "symmetric": True, "group_size": None, "strategy": None,
         "block_structure": None, "dynamic": False, "actorder": None, "scale_dtype": None,
         "zp_dtype": None, "observer": None, "observer_kwargs": {}}
    a.update({k: v for k, v in args.items() if v is not None})
    if a["strategy"] is None:  # CT's own inference (REFERENCE §7.3)
        a["strategy"] = {None: "tensor", -1: "channel"}.get(a["group_size"], "group")
    if a["strategy"] == "block" and a["block_structure"] is not None:
        a["block_structure"] = tuple(a["block_structure"])
    for key, ok, why in (("symmetric", a["symmetric"] is True, "asymmetric float quantization is not modelled"),
                         ("actorder", a["actorder"] is None, "activation reordering is not modelled"),
                         ("zp_dtype", a["zp_dtype"] is None, "symmetric schemes have no zero point"),
                         ("observer", a["observer"] in _CT_MINMAX, "only min/max observers are expressible"),
                         ("observer_kwargs", a["observer_kwargs"] == {}, "observer options are not modelled")):
        if not ok:
            raise SchemeFieldError(f"{part}.{key}", f"{why}, got {a[key]!r}")
    if a["strategy"] not in _CT_STRATEGY:
        raise SchemeFieldError(f"{part}.strategy", f"expected one of {', '.join(_CT_STRATEGY)}, got {a['strategy']!r}")
    return a


def _ct_family(a: dict, part: str) -> str:
    if a["type"] != "float":
        raise SchemeFieldError(f"{part}.type", f"fp8ref covers floating-point formats only, got {a['type']!r}")
    if a["num_bits"] == 8:
        return "mx_fp" if a["scale_dtype"] in ("torch.uint8", "uint8") else "fp"
    if a["num_bits"] == 4:
        return "nv_fp" if a["strategy"] == "tensor_group" else "mx_fp"
    raise SchemeFieldError(f"{part}.num_bits",
                           f"compressed-tensors float types have 8 or 4 bits, got {a['num_bits']!r}")


def _ct_scale(a: dict, part: str, family: str) -> str:
    if a["scale_dtype"] is None:  # CT's default: model dtype, e8m0 for MX, e4m3 for NVFP4
        return _SCALE[family][0]
    by_name = {v: k for k, v in _CT_SCALE.items() if v is not None}
    name = str(a["scale_dtype"])
    name = name if name.startswith("torch.") else "torch." + name
    if name not in by_name:
        raise SchemeFieldError(f"{part}.scale_dtype", f"expected one of {', '.join(by_name)} or null, "
                               f"got {a['scale_dtype']!r}")
    return by_name[name]
