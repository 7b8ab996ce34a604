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
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .. import registry
from ..errors import SpecError
from ..io.files import read_text
from ..io.yaml import YamlDocument, load_yaml_string
from .case import Case, OpEntry, Operation
from .fields import check_level, check_str
from .ops import OPERATIONS

_TOP = {"suite": True, "description": False, "seed": True, "level": False, "operations": True}


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


def load_suite(path: str | Path) -> Suite:
    """Load a suite from a path, or a bare name of a shipped suite (``formats``)."""
    resolved = resolve_suite_path(path)
    return parse_suite(read_text(resolved, error=SpecError), source=str(resolved))


def resolve_suite_path(path: str | Path) -> Path:
    p = Path(path)
    if (p.exists() and not p.is_dir()) or p.is_symlink():  # a FIFO or device: refused by read_text
        return p
    shipped = registry.suite_path(str(path))
    if shipped is not None:
        return shipped
    known = ", ".join(registry.suite_names())
    raise SpecError(f"suite {str(path)!r}: no such file and no shipped suite of that name (shipped: {known})")


def parse_suite(text: str, *, source: str = "<string>") -> Suite:
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


def cases(suite: Suite, level: int) -> Iterator[tuple[Operation, OpEntry, str, dict]]:
    """Every (operation, entry, case name, params) of a suite at a level, without inputs."""
    seen = set()
    for entry in suite.entries:
        op = OPERATIONS[entry.op]
        for name, params in op.expand(entry, level):
            if name in seen:  # two entries may overlap; the first one wins
                continue
            seen.add(name)
            yield op, entry, name, params


def build(suite: Suite, level: int) -> Iterator[Case]:
    for op, entry, name, params in cases(suite, level):
        yield op.make_case(name, params, entry, suite, level)


def count_cases(suite: Suite, level: int) -> int:
    return sum(1 for _ in cases(suite, level))
