"""YAML layer specs -> LayerConfig: which layers are quantized, and how.

A spec (see docs/schemes.md and specs/examples/)::

    name: llama-w8a8            # optional metadata
    description: ...
    strict: false               # optional; see below
    scheme: FP8_STATIC          # default scheme: preset name or mapping (required)
    layer_config:               # selector -> preset name | mapping of overrides
      model.layers.0.mlp.down_proj: BF16
      "re:.*k_proj": {scheme: FP8_DYNAMIC, rounding: rtz}
    ignore: [lm_head]           # selectors left unquantized

Resolution of a layer name (deterministic, independent of the order names are asked in):

1. a matching ``ignore`` selector -> None (not quantized);
2. an exact ``layer_config`` key -> its scheme;
3. the matching ``re:`` keys: the **last declared** one wins (strict mode: matches that
   resolve to different schemes are an error);
4. the default ``scheme``.

``re:PATTERN`` matches with ``re.match`` (anchored at the start only), as compressed-tensors
does, so selectors translate to its ``targets`` unchanged. A mapping value overrides the default
scheme (or the preset named by its ``scheme`` key; or the field defaults when the default is
unquantized); fields derived from an overridden field are re-derived (``QuantizationScheme.replace``).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from .errors import SpecError, did_you_mean
from .io.paths import path_arg
from .io.yaml import YamlDocument, load_yaml, load_yaml_string
from .limits import MAX_NAME
from .patterns import Pattern
from .scheme import FIELDS, PRESETS, QuantizationScheme, SchemeFieldError, preset_name

SPEC_KEYS = ("name", "description", "strict", "scheme", "layer_config", "ignore")


class SpecWarning(UserWarning):
    """A selector that matches no layer of the model (an error in strict mode)."""


@dataclass(frozen=True)
class Selector:
    """A layer name, or ``re:PATTERN`` matched with ``re.match`` (bounded: ``fp8ref.patterns``).
    ``source`` names the file (and key) the selector came from in errors."""

    text: str
    line: int | None = None
    source: str = field(default="selector", compare=False)

    @property
    def is_regex(self) -> bool:
        return self.text.startswith("re:")

    @cached_property
    def pattern(self) -> Pattern:
        where = f"{self.source}:{self.line}" if self.line is not None else self.source
        return Pattern(self.text[3:], f"{where}: selector {self.text!r}")

    def matches(self, layer: str) -> bool:
        if self.is_regex:
            return self.pattern.match(layer)
        return layer == self.text

    def __str__(self) -> str:
        return self.text if self.line is None else f"{self.text!r} (line {self.line})"


@dataclass(frozen=True)
class Rule:
    selector: Selector
    scheme: QuantizationScheme | None


class LayerConfig:
    """A validated spec: default scheme, ordered ``layer_config`` rules and ``ignore`` selectors."""

    def __init__(self, default: QuantizationScheme | None, rules: Iterable[Rule] = (),
                 ignore: Iterable[Selector] = (), *, strict: bool = False, name: str | None = None,
                 description: str | None = None, source: str = "<dict>"):
        self.default, self.rules, self.ignore = default, tuple(rules), tuple(ignore)
        self.strict, self.name, self.description, self.source = strict, name, description, source
        self._exact = {r.selector.text: r for r in self.rules if not r.selector.is_regex}
        self._regex = tuple(r for r in self.rules if r.selector.is_regex)

    def resolve(self, layer: str) -> QuantizationScheme | None:
        """The scheme of ``layer``, or None when it stays unquantized."""
        if any(sel.matches(layer) for sel in self.ignore):
            return None
        if layer in self._exact:
            return self._exact[layer].scheme
        matched = [r for r in self._regex if r.selector.matches(layer)]
        if not matched:
            return self.default
        if self.strict and len({r.scheme for r in matched}) > 1:
            names = ", ".join(str(r.selector) for r in matched)
            raise SpecError(f"{self.source}: layer {layer!r} is matched by regexes that disagree: {names} "
                            "(strict mode)")
        return matched[-1].scheme

    def resolve_all(self, layers: Iterable[str]) -> dict[str, QuantizationScheme | None]:
        """{layer: scheme or None}; selectors matching none of ``layers`` warn (strict: raise)."""
        layers = list(layers)
        out = {layer: self.resolve(layer) for layer in layers}
        unmatched = self.unmatched_selectors(layers)
        if unmatched:
            message = (f"{self.source}: selectors match no layer of the model: "
                       + ", ".join(str(s) for s in unmatched))
            if self.strict:
                raise SpecError(message + " (strict mode)")
            warnings.warn(message, SpecWarning, stacklevel=2)
        return out

    def unmatched_selectors(self, layers: Iterable[str]) -> list[Selector]:
        layers = list(layers)
        selectors = [r.selector for r in self.rules] + list(self.ignore)
        return [s for s in selectors if not any(s.matches(layer) for layer in layers)]

    def to_dict(self) -> dict:
        """A spec mapping that ``load_spec_dict`` turns back into an equal LayerConfig."""
        out = {k: v for k, v in (("name", self.name), ("description", self.description)) if v is not None}
        out["strict"] = self.strict
        out["scheme"] = _dump_scheme(self.default)
        out["layer_config"] = {r.selector.text: _dump_scheme(r.scheme) for r in self.rules}
        out["ignore"] = [s.text for s in self.ignore]
        return out

    def _key(self):
        return (self.default, tuple((r.selector.text, r.scheme) for r in self.rules),
                tuple(s.text for s in self.ignore), self.strict, self.name, self.description)

    def __eq__(self, other):
        return self._key() == other._key() if isinstance(other, LayerConfig) else NotImplemented

    def __hash__(self):
        return hash(self._key())

    def __repr__(self):
        return (f"LayerConfig(source={self.source!r}, default={preset_name(self.default) or self.default!r}, "
                f"rules={len(self.rules)}, ignore={[s.text for s in self.ignore]})")


def _dump_scheme(scheme: QuantizationScheme | None):
    name = preset_name(scheme)
    if name is not None:
        return name
    return {"scheme": "BF16"} if scheme is None else {k: v for k, v in scheme.to_dict().items() if v is not None}


# --- loading --------------------------------------------------------------------------------
def load_spec(path: str | Path, *, strict: bool | None = None) -> LayerConfig:
    """Load and validate a YAML spec file; ``strict`` overrides the file's ``strict`` key."""
    return _build(load_yaml(path_arg(path)), strict)


def load_spec_string(text: str, *, source: str = "<string>", strict: bool | None = None) -> LayerConfig:
    return _build(load_yaml_string(text, source=source), strict)


def load_spec_dict(data, *, source: str = "<dict>", strict: bool | None = None) -> LayerConfig:
    """Validate a spec given as a Python dict (values may also be QuantizationScheme objects)."""
    return _build(YamlDocument(data, source), strict)


class _Errors:
    def __init__(self, doc: YamlDocument):
        self.doc, self.messages = doc, []

    def add(self, path, message: str) -> None:
        self.messages.append(f"{self.doc.where(path)}: {message}")

    def raise_if_any(self) -> None:
        if self.messages:
            exc = SpecError("\n".join(self.messages))
            exc.errors = list(self.messages)
            raise exc


def _build(doc: YamlDocument, strict: bool | None) -> LayerConfig:
    errors = _Errors(doc)
    data = doc.data
    if not isinstance(data, Mapping):
        got = "an empty document" if data is None else type(data).__name__
        errors.add((), f"expected a mapping with keys {', '.join(SPEC_KEYS)}, got {got}")
        errors.raise_if_any()
    for key in data:
        if key not in SPEC_KEYS:
            errors.add((key,), f"unknown key{did_you_mean(key, SPEC_KEYS)}; expected one of {', '.join(SPEC_KEYS)}")
    meta = {}
    for key in ("name", "description"):
        if data.get(key) is not None and not isinstance(data[key], str):
            errors.add((key,), f"expected a string, got {data[key]!r}")
        meta[key] = data.get(key)
    file_strict = data.get("strict", False)
    if type(file_strict) is not bool:
        errors.add(("strict",), f"expected true or false, got {file_strict!r}")
    strict = bool(file_strict) if strict is None else strict

    default, default_ok = None, False
    if "scheme" not in data:
        errors.add((), "scheme: required (a preset name such as FP8_STATIC, or a mapping of fields)")
    else:
        default, default_ok = _scheme_value(data["scheme"], ("scheme",), None, errors)

    rules = []
    layer_config = data.get("layer_config", {})
    if layer_config is None or not isinstance(layer_config, Mapping):
        errors.add(("layer_config",), f"expected a mapping of selector -> preset or overrides, "
                                      f"got {type(layer_config).__name__}")
        layer_config = {}
    for key, value in layer_config.items():
        path = ("layer_config", key)
        selector = _selector(key, path, errors)
        if selector is None:
            continue
        if isinstance(value, Mapping) and "scheme" not in value and not default_ok:
            continue  # the default is broken; its error is already reported
        scheme, ok = _scheme_value(value, path, default, errors)
        if ok:
            rules.append(Rule(selector, scheme))

    ignore = []
    ignore_list = data.get("ignore", [])
    if not isinstance(ignore_list, list):
        errors.add(("ignore",), f"expected a list of layer names or 're:' patterns, got {type(ignore_list).__name__}")
        ignore_list = []
    configured = {r.selector.text: r.selector for r in rules if not r.selector.is_regex}
    seen = {}
    for i, item in enumerate(ignore_list):
        selector = _selector(item, ("ignore", i), errors)
        if selector is None:
            continue
        if selector.text in seen:
            errors.add(("ignore", i), f"duplicate selector {selector.text!r} (first at ignore[{seen[selector.text]}])")
        elif selector.text in configured:
            errors.add(("ignore", i), f"{selector.text!r} is also configured in layer_config"
                                      + (f" (line {configured[selector.text].line})"
                                         if configured[selector.text].line else ""))
        seen.setdefault(selector.text, i)
        ignore.append(selector)
    errors.raise_if_any()
    return LayerConfig(default, rules, ignore, strict=strict, source=doc.source, **meta)


def _selector(key, path: tuple, errors: _Errors) -> Selector | None:
    if not isinstance(key, str) or not key:
        errors.add(path, f"expected a layer name or 're:PATTERN', got {key!r}")
        return None
    selector = Selector(key, errors.doc.line_of(path) if path in errors.doc.lines else None, errors.doc.source)
    if key.startswith("re:"):
        if not key[3:]:
            errors.add(path, "empty regular expression")
            return None
        try:
            selector.pattern  # noqa: B018  (compiled and checked now: `spec validate` refuses what would hang)
        except SpecError as exc:
            errors.add(path, exc.problem)
            return None
    elif len(key) > MAX_NAME:
        errors.add(path, f"layer name of {len(key)} characters; at most {MAX_NAME}")
        return None
    return selector


def _scheme_value(value, path: tuple, base: QuantizationScheme | None, errors: _Errors):
    """A preset name or mapping -> (scheme or None, ok)."""
    if isinstance(value, QuantizationScheme):
        return value, True
    try:
        if isinstance(value, str):
            return PRESETS[value], True
        if not isinstance(value, Mapping):
            got = "null" if value is None else f"{type(value).__name__} {value!r}"
            errors.add(path, f"expected a preset name or a mapping of scheme fields, got {got}")
            return None, False
        overrides = dict(value)
        if "scheme" in overrides:
            preset = overrides.pop("scheme")
            if not isinstance(preset, str):
                errors.add(path + ("scheme",), f"expected a preset name, got {preset!r}")
                return None, False
            base = PRESETS[preset]
            if base is None and overrides:
                errors.add(path + ("scheme",), f"preset {preset!r} leaves the layer unquantized and takes no "
                                               f"overrides, got {', '.join(map(str, overrides))}")
                return None, False
            if not overrides:
                return base, True
        for key in overrides:
            if key not in FIELDS:
                errors.add(path + (key,), f"unknown field{did_you_mean(key, FIELDS + ('scheme',))}; "
                                          f"valid fields: scheme, {', '.join(FIELDS)}")
                return None, False
        if base is None:
            return QuantizationScheme(**overrides), True
        return base.replace(**overrides), True
    except SchemeFieldError as exc:
        field_path = path + (exc.field,) if exc.field != "scheme" or isinstance(value, Mapping) else path
        errors.add(field_path, exc.rule)
        return None, False
