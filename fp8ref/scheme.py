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

from collections.abc import Iterator, Mapping
from functools import lru_cache

from .codec import ROUNDING_MODES
from .errors import SpecError, did_you_mean
from .formats import FORMATS
from .limits import MAX_GROUP, int_in, shown
from .registry import presets_document, recipe_names

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
KNOWN_RECIPES = recipe_names()
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
        super().__init__(field, f"unknown field{did_you_mean(field, FIELDS)}; valid fields: {', '.join(FIELDS)}")

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


def default_format(family: str, bits: int) -> str:
    """The element format a data_type family (fp, mx_fp, nv_fp) has at ``bits`` unless one is named."""
    return _DEFAULT_FORMAT[(family, bits)]


def default_scale_dtype(family: str) -> str:
    """The scale dtype of a data_type family when none is given."""
    return _SCALE[family][0]


def _one_of(field: str, value, choices, extra: str = "") -> SchemeFieldError:
    shown = ", ".join(str(c) for c in choices)
    return SchemeFieldError(field, f"expected one of {shown}{extra}, got {value!r}{did_you_mean(value, choices)}")


# --- field checks ----------------------------------------------------------------------------
def _check_types(given: dict) -> None:
    """Types and declared ranges (fp8ref.limits) of every given field, before any rule reads them."""
    for name, value in given.items():
        if name in ("bits", "act_bits", "act_group_size"):
            if type(value) is not int:
                raise SchemeFieldError(name, f"expected an integer, got {shown(value)}")
            lo, hi = (-MAX_GROUP, MAX_GROUP) if name == "act_group_size" else (1, 64)  # rules say which
            if not lo <= value <= hi:
                raise SchemeFieldError(name, f"expected an integer in {lo}..{hi}, got {shown(value)}")
        elif name in ("sym", "act_sym", "act_dynamic", "saturate"):
            if type(value) is not bool:
                raise SchemeFieldError(name, f"expected true or false, got {shown(value)}")
        elif name in ("group_size", "block_shape"):
            if name == "group_size" and type(value) is int:
                if not int_in(value, -MAX_GROUP, MAX_GROUP):  # _grouping says which ones mean something
                    raise SchemeFieldError(name, f"expected an integer in -1..{MAX_GROUP}, got {shown(value)}")
                continue
            want = "an integer or [rows, cols]" if name == "group_size" else "[rows, cols]"
            if not (isinstance(value, (list, tuple)) and len(value) == 2
                    and all(type(v) is int and v > 0 for v in value)):
                raise SchemeFieldError(name, f"expected {want} of positive integers, got {shown(value)}")
            if not all(v <= MAX_GROUP for v in value):
                raise SchemeFieldError(name, f"expected {want} of integers in 1..{MAX_GROUP}, got {shown(value)}")
        elif not isinstance(value, str):
            raise SchemeFieldError(name, f"expected a string, got {shown(value)}")
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
    # MX weights with plain FP8 activations (compressed-tensors 0.20 MXFP4XFP8): the activation scales are
    # computed at run time in the model dtype, so they share no scale_dtype with the weights' E8M0
    mx_fp8 = family == "mx_fp" and act_type == "fp"
    if act_family != family and not mx_fp8:
        raise SchemeFieldError("act_data_type", f"must be of the same family as data_type {family!r} "
                               f"(scale_dtype is shared; 'fp' under 'mx_fp' weights, dynamic only), got {act_type!r}")
    if mx_fp8 and not given.get("act_dynamic", True):
        raise SchemeFieldError("act_dynamic", "fp activations under mx_fp weights are dynamic (their scales are "
                               "computed at run time; the scheme's scale_dtype is the weights' E8M0)")
    out["act_data_type"] = act_type
    out["act_bits"], out["act_format"] = _element(given, act_family, "act_", implied, "act_data_type",
                                                  (UNQUANTIZED_ACT_BITS,))
    if given.get("act_sym", True) is not True:
        raise SchemeFieldError("act_sym", "floating-point quantization is symmetric (no zero point), got False")
    out["act_sym"] = True
    out["act_granularity"], out["act_group_size"] = _grouping(
        "act_group_size", "act_granularity", given.get("act_group_size"), given.get("act_granularity"),
        act_family, {0: "tensor", -1: "token"})
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
        hint = did_you_mean(name, names, cutoff=0.5, clause=True, fold=str.upper)
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
    doc = presets_document()
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
