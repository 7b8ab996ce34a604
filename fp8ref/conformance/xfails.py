"""Known, documented differences of a backend: its xfails file.

One entry per line: a case-name glob, then optionally tags a mismatch must all carry,
then a ``#`` comment saying why (a link to the upstream decision)::

    # torch >= 2.12 saturates e4m3fn casts (pytorch/pytorch PR #178817)
    encode.float8_e4m3fn.rne.nosat.* overflow
    encode.float8_e4m3fn.rne.nosat.* inf-input

Tags come from the mismatch:

- ``overflow``: |x| > max; ``inf-input``; ``nan-input``;
- ``zero``: x == 0 (quantize: fp8ref's code is +-0; dequantize: the code is +-0);
- ``subnormal``: 0 < |x| < the format's min normal; ``tie``: x (quantize, MX: x / 2**k) halfway between neighbours;
- ``double-rounding``: a float64 input whose float32 rounding (a float32 input whose float16 rounding)
  changes the result or lands on a tie;
- ``negative``: x < 0 into an unsigned format;
- fake_quant only, each given where it reproduces the backend's value bit for bit (fp8ref.fakeconvert's
  deviations): ``double-rounding`` (the value rounded to float16 before the conversion), ``reciprocal``
  (multiplied by 1 / scale instead of divided by scale), ``zero`` (-0 + a zero shift kept as -0);
- ``input-subnormal``: x is subnormal in its own dtype (float64: in float32);
- ``nan-code``: both NaN, codes differ (only under the exact or sign NaN rule);
- ``error``: the backend raised on the case, or returned a wrong dtype or shape.
An entry whose glob names a case that ran, yet excused nothing, is reported as stale (an entry for
cases the run left out, e.g. another suite's, is not judged).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import SpecError
from ..io.files import read_text

TAGS = ("overflow", "inf-input", "nan-input", "subnormal", "tie", "double-rounding", "reciprocal", "zero", "negative",
        "input-subnormal", "nan-code", "error")
XFAILS_DIR = Path(__file__).resolve().parent / "xfails"


@dataclass
class Entry:
    pattern: str
    tags: tuple[str, ...]
    line: int
    text: str
    hits: int = 0
    reason: str = ""  # the comment block above the entry (shared by consecutive entries), joined


@dataclass
class Xfails:
    source: str
    entries: list[Entry] = field(default_factory=list)
    ran: set[str] = field(default_factory=set)  # the cases recorded

    def matching(self, case: str, tags) -> list[Entry]:
        return [e for e in self.entries if fnmatch.fnmatchcase(case, e.pattern) and set(e.tags) <= set(tags)]

    def match(self, case: str, tags) -> bool:
        return bool(self.matching(case, tags))

    def record(self, results) -> None:
        """Count each entry's hits and note the cases that ran (accumulating over runs)."""
        for r in results:
            self.ran.add(r.case)
            hits = self.matching(r.case, ("error",)) if r.status == "error" else []
            for m in r.mismatches:
                hits += self.matching(m.case, m.tags)
            for e in hits:
                e.hits += 1

    def stale(self) -> list[Entry]:
        """The entries with no hit whose glob names some case that ran."""
        return [e for e in self.entries if e.hits == 0 and any(fnmatch.fnmatchcase(c, e.pattern) for c in self.ran)]


def parse_xfails(text: str, source: str = "<xfails>") -> Xfails:
    out = Xfails(source)
    comment: list[str] = []  # the comment lines since the last blank line or entry group
    after_entry = False
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            stripped = raw.strip()
            if after_entry or not stripped:
                comment, after_entry = [], False
            if stripped.startswith("#"):
                comment.append(stripped.lstrip("#").strip())
            continue
        after_entry = True
        pattern, *tags = line.split()
        for t in tags:
            if t not in TAGS:
                raise SpecError(f"{source}:{n}: unknown tag {t!r}; expected one of {list(TAGS)}")
        out.entries.append(Entry(pattern, tuple(tags), n, raw.strip(), reason=" ".join(comment)))
    return out


def load_xfails(path: str | Path) -> Xfails:
    path = Path(path)
    return parse_xfails(read_text(path, error=SpecError), str(path))


def default_xfails(backend_name: str, profile: str = "fp8ref") -> Xfails | None:
    """The xfails file shipped for a built-in backend, if any: ``NAME.txt``, or under a compatibility
    profile (``conform --profile``) ``NAME.PROFILE.txt``."""
    path = XFAILS_DIR / (f"{backend_name}.txt" if profile == "fp8ref" else f"{backend_name}.{profile}.txt")
    return load_xfails(path) if path.is_file() else None
