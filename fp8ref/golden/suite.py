"""Golden suite files: YAML declaring operations, formats, modes, shapes, a seed and a level.

```yaml
suite: formats                 # name, used in tensor names and reports
description: free text
seed: 1                        # every random value derives from it
level: 1                       # default level (1 quick, 2 thorough); --level overrides
operations:
  - op: encode                 # one entry per operation; fields depend on the operation
    formats: all
    rounding: [rne, rtz]
    random: {1: 256, 2: 4096}  # per-level counts: the entry for the largest key <= level
```
Validation is strict: unknown operations or fields, wrong types and bad values raise
SpecError naming ``FILE:LINE: key.path``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from .. import registry
from ..errors import SpecError
from ..io.files import read_text
from ..io.yaml import YamlDocument, load_yaml_string

LEVELS = (1, 2)
_TOP = {"suite": True, "description": False, "seed": True, "level": False, "operations": True}


@dataclass(frozen=True)
class OpEntry:
    """One validated ``operations`` item: the operation name and its typed fields."""

    op: str
    fields: Mapping[str, object]
    index: int


@dataclass(frozen=True)
class Suite:
    name: str
    description: str
    seed: int
    level: int
    entries: tuple[OpEntry, ...]
    text: str  # the YAML as written; stored in golden folders and hashed
    source: str

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()


# A field checker takes (document, key path, value) and returns the typed value or raises.
Checker = Callable[[YamlDocument, tuple, object], object]


def load_suite(path: str | Path) -> Suite:
    """Load a suite from a path, or a bare name of a shipped suite (``formats``)."""
    resolved = resolve_suite_path(path)
    return parse_suite(read_text(resolved, error=SpecError), source=str(resolved))


def resolve_suite_path(path: str | Path) -> Path:
    p = Path(path)
    if p.is_file():
        return p
    shipped = registry.suite_path(str(path))
    if shipped is not None:
        return shipped
    known = ", ".join(registry.suite_names())
    raise SpecError(f"suite {str(path)!r}: no such file and no shipped suite of that name (shipped: {known})")


def parse_suite(text: str, *, source: str = "<string>") -> Suite:
    from .ops import OPERATIONS  # ops import this module for the checkers

    doc = load_yaml_string(text, source=source)
    data = doc.data
    if not isinstance(data, dict):
        raise doc.error((), f"a suite must be a mapping with keys {sorted(_TOP)}, got {type(data).__name__}")
    _check_keys(doc, (), data, _TOP)
    name = check_str(doc, ("suite",), data["suite"])
    seed = data["seed"]
    if type(seed) is not int or not 0 <= seed < 2 ** 63:
        raise doc.error(("seed",), f"expected an integer in [0, 2**63), got {seed!r}")
    level = check_level(doc, ("level",), data.get("level", 1))
    ops = data["operations"]
    if not isinstance(ops, list) or not ops:
        raise doc.error(("operations",), f"expected a non-empty list of operations, got {ops!r}")
    entries = []
    for i, item in enumerate(ops):
        path = ("operations", i)
        if not isinstance(item, dict) or "op" not in item:
            raise doc.error(path, f"expected a mapping with an 'op' key, got {item!r}")
        op = item["op"]
        if op not in OPERATIONS:
            raise doc.error(path + ("op",), f"unknown operation {op!r}; expected one of {sorted(OPERATIONS)}")
        schema = OPERATIONS[op].fields
        _check_keys(doc, path, item, {"op": True, **{k: d is None for k, (_, d) in schema.items()}})
        fields = {k: (check(doc, path + (k,), item[k]) if k in item else default)
                  for k, (check, default) in schema.items()}
        entries.append(OpEntry(op, fields, i))
    description = data.get("description", "")
    return Suite(name, check_str(doc, ("description",), description) if description else "", seed, level,
                 tuple(entries), text, source)


def _check_keys(doc: YamlDocument, path: tuple, data: dict, allowed: dict[str, bool]) -> None:
    for key in data:
        if key not in allowed:
            raise doc.error(path + (key,), f"unknown field {key!r}; expected one of {sorted(allowed)}")
    for key, required in allowed.items():
        if required and key not in data:
            raise doc.error(path, f"missing required field {key!r}")


# --- field checkers shared by the operations --------------------------------------------------
def check_str(doc: YamlDocument, path: tuple, value) -> str:
    if not isinstance(value, str) or not value:
        raise doc.error(path, f"expected a non-empty string, got {value!r}")
    return value


def check_level(doc: YamlDocument, path: tuple, value) -> int:
    if value not in LEVELS or type(value) is not int:
        raise doc.error(path, f"expected a level in {list(LEVELS)}, got {value!r}")
    return value


def choices(options: tuple, *, allow_all: bool = True, kind: type = str, allow_empty: bool = False) -> Checker:
    """A list drawn from ``options`` (or the word ``all``), kept in the written order."""

    def check(doc: YamlDocument, path: tuple, value):
        if allow_all and value == "all":
            return tuple(options)
        if not isinstance(value, list) or not (value or allow_empty):
            raise doc.error(path, f"expected a {'' if allow_empty else 'non-empty '}list from {list(options)}"
                            + (" or 'all'" if allow_all else "") + f", got {value!r}")
        for i, v in enumerate(value):
            if type(v) is not kind or v not in options:
                raise doc.error(path + (i,), f"expected one of {list(options)}, got {v!r}")
        if len(set(value)) != len(value):
            raise doc.error(path, f"duplicate entries in {value!r}")
        return tuple(value)

    return check


def per_level(item: Checker) -> Checker:
    """``{level: value}``; the value for level L is the one under the largest key <= L."""

    def check(doc: YamlDocument, path: tuple, value):
        if not isinstance(value, dict) or not value:
            raise doc.error(path, f"expected a mapping from level {list(LEVELS)} to a value, got {value!r}")
        out = {}
        for key, v in value.items():
            out[check_level(doc, path + (key,), key)] = item(doc, path + (key,), v)
        if min(out) != 1:
            raise doc.error(path, "level 1 must be given (higher levels inherit from lower ones)")
        return out

    return check


def count(limit: int) -> Checker:
    def check(doc: YamlDocument, path: tuple, value):
        if type(value) is not int or not 0 <= value <= limit:
            raise doc.error(path, f"expected an integer count in [0, {limit}], got {value!r}")
        return value

    return check


def shapes(rank: int, limit: int = 4096) -> Checker:
    """A list of shapes, each a list of ``rank`` positive integers."""

    def check(doc: YamlDocument, path: tuple, value):
        if not isinstance(value, list) or not value:
            raise doc.error(path, f"expected a non-empty list of shapes [{', '.join('d' * rank)}], got {value!r}")
        for i, s in enumerate(value):
            if (not isinstance(s, list) or len(s) != rank
                    or any(type(d) is not int or not 1 <= d <= limit for d in s)):
                raise doc.error(path + (i,), f"expected {rank} integers in [1, {limit}], got {s!r}")
        return tuple(tuple(s) for s in value)

    return check


def at_level(table: Mapping[int, object], level: int):
    return table[max(k for k in table if k <= level)]
