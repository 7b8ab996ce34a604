"""Strict, safe YAML loading with line numbers for every key path.

PyYAML's ``safe_load`` keeps the last of two duplicate keys and forgets where each value
came from. fp8ref's declarative files (specs, presets, recipes, golden suites) need both:
a duplicate key is an error, and every later validation error must name ``FILE:LINE`` and
the key path. ``load_yaml`` returns a ``YamlDocument`` holding plain Python data (dicts,
lists, scalars built by ``yaml.SafeLoader``) and the line of every key and list item.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ..errors import SpecError
from ..limits import MAX_DEPTH
from .files import read_text

# An alias may point at a large subtree many times ("billion laughs"); cap the expansion.
_MAX_NODES = 1_000_000
_COLLECTION_TAGS = ("tag:yaml.org,2002:map", "tag:yaml.org,2002:seq")
_PLAIN_SEGMENT = re.compile(r"[A-Za-z0-9_-]+")


def format_path(path: Sequence) -> str:
    """``("layer_config", "re:.*k_proj", "act_bits")`` -> ``layer_config."re:.*k_proj".act_bits``."""
    out = ""
    for seg in path:
        if isinstance(seg, int) and not isinstance(seg, bool):
            out += f"[{seg}]"
            continue
        text = str(seg)
        text = text if _PLAIN_SEGMENT.fullmatch(text) else '"' + text.replace('"', '\\"') + '"'
        out += "." + text if out else text
    return out


@dataclass(frozen=True)
class YamlDocument:
    """Loaded data plus ``lines[path] = 1-based line`` for every mapping key and list item."""

    data: object
    source: str
    lines: dict[tuple, int] = field(default_factory=dict)

    def line_of(self, path: Sequence) -> int | None:
        """Line of ``path`` or of its nearest recorded ancestor."""
        path = tuple(path)
        while path:
            if path in self.lines:
                return self.lines[path]
            path = path[:-1]
        return self.lines.get(())

    def where(self, path: Sequence) -> str:
        """``FILE:LINE: key.path`` (``FILE: key.path`` when lines are unknown)."""
        line = self.line_of(path)
        head = f"{self.source}:{line}" if line is not None else self.source
        return f"{head}: {format_path(path)}" if path else head

    def error(self, path: Sequence, message: str) -> SpecError:
        return SpecError(f"{self.where(path)}: {message}")


def load_yaml(path: str | Path) -> YamlDocument:
    """Load one YAML document from a file (strict: see module docstring)."""
    path = Path(path)
    return load_yaml_string(read_text(path, error=SpecError, what="YAML file"), source=str(path))


def load_yaml_string(text: str, *, source: str = "<string>") -> YamlDocument:
    """Load one YAML document from text; ``source`` names it in errors."""
    try:
        loader = StrictSafeLoader(text, source)  # its reader refuses NUL and other control characters
    except yaml.YAMLError as exc:
        raise SpecError(f"{source}: invalid YAML: {' '.join(str(exc).split())}") from None
    try:
        node = loader.get_single_node()
        data = loader.build(node, ()) if node is not None else None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = f":{mark.line + 1}" if mark is not None else ""
        problem = " ".join(str(p) for p in (exc.context, exc.problem) if p)
        raise SpecError(f"{source}{line}: invalid YAML: {problem}") from None
    except yaml.YAMLError as exc:
        raise SpecError(f"{source}: invalid YAML: {' '.join(str(exc).split())}") from None
    finally:
        loader.dispose()
    if node is not None:
        loader.lines[()] = node.start_mark.line + 1
    return YamlDocument(data, source, loader.lines)


class StrictSafeLoader(yaml.SafeLoader):
    """SafeLoader whose ``build`` walks the composed node graph itself: it rejects duplicate
    and merge keys and records the line of every key path, then lets SafeLoader construct
    the scalars (so only YAML's safe types can appear)."""

    def __init__(self, stream, source: str = "<string>"):
        super().__init__(stream)
        self.source, self.lines, self.count, self.depth = source, {}, 0, 0
        self.open: set[int] = set()  # ids of the collection nodes being built (a cycle revisits one)

    def compose_node(self, parent, index):
        # PyYAML composes recursively: refuse deep nesting before Python's recursion limit does
        self.depth += 1
        try:
            if self.depth > MAX_DEPTH:
                line = self.peek_event().start_mark.line + 1
                raise SpecError(f"{self.source}:{line}: nested deeper than {MAX_DEPTH} levels")
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1

    def fail(self, node: yaml.Node, path: tuple, message: str) -> SpecError:
        where = f"{self.source}:{node.start_mark.line + 1}"
        return SpecError(f"{where}: {format_path(path)}: {message}" if path else f"{where}: {message}")

    def build(self, node: yaml.Node, path: tuple):
        self.count += 1
        if self.count > _MAX_NODES:
            raise self.fail(node, path, f"document expands to more than {_MAX_NODES} nodes (alias bomb?)")
        if isinstance(node, (yaml.MappingNode, yaml.SequenceNode)) and node.tag not in _COLLECTION_TAGS:
            raise self.fail(node, path, f"unsupported tag {node.tag!r}; only plain mappings and lists")
        if isinstance(node, (yaml.MappingNode, yaml.SequenceNode)):
            if id(node) in self.open:
                raise self.fail(node, path, "recursive alias: a collection that contains itself")
            if len(path) >= MAX_DEPTH:
                raise self.fail(node, path, f"nested deeper than {MAX_DEPTH} levels")
            self.open.add(id(node))
            try:
                if isinstance(node, yaml.MappingNode):
                    return self.build_mapping(node, path)
                out = []
                for i, item in enumerate(node.value):
                    self.lines[path + (i,)] = item.start_mark.line + 1
                    out.append(self.build(item, path + (i,)))
                return out
            finally:
                self.open.discard(id(node))
        return self.scalar(node, path)

    def scalar(self, node: yaml.Node, path: tuple):
        try:
            return self.construct_object(node, deep=True)
        except ValueError as exc:  # an integer past Python's 4300-digit conversion limit
            raise self.fail(node, path, f"cannot read the value: {exc}") from None

    def build_mapping(self, node: yaml.MappingNode, path: tuple) -> dict:
        out: dict = {}
        first_line: dict = {}
        for key_node, value_node in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                raise self.fail(key_node, path, "merge keys ('<<') are not supported; write the keys out")
            if not isinstance(key_node, yaml.ScalarNode):
                raise self.fail(key_node, path, "mapping keys must be scalars, got a "
                                + ("mapping" if isinstance(key_node, yaml.MappingNode) else "list"))
            key = self.scalar(key_node, path)
            line = key_node.start_mark.line + 1
            if key in out:
                raise self.fail(key_node, path + (key,),
                                f"duplicate key (first defined on line {first_line[key]})")
            first_line[key] = line
            self.lines[path + (key,)] = line
            out[key] = self.build(value_node, path + (key,))
        return out
