"""Regular expressions from untrusted files: the one place they are compiled and matched.

Python's ``re`` backtracks, so ``([\\w.]+)+!`` takes time exponential in the name it is matched
against. A checkpoint's ``ignore``/``targets``, an auto-round ``extra_config`` key and a spec's
``re:`` selector are all matched here, bounded three ways:

* statically, at validation: a quantifier applied to something that itself holds an unbounded
  quantifier (the shape of every catastrophic pattern) is refused, as are patterns longer than
  ``limits.MAX_PATTERN``;
* names longer than ``limits.MAX_NAME`` are refused before matching;
* in time: on the main thread a pattern that can still backtrack gets ``BUDGET_S`` seconds of
  matching in all (a SIGALRM interrupts a running match: ``re`` checks for signals while it
  backtracks). Elsewhere (threads, or an alarm the caller set) there is no timer, so a pattern that
  can backtrack exponentially (an alternation under a quantifier, a backreference) is refused
  when it is matched; polynomial ones run, bounded by the name length.

Errors are the caller's ``Fp8RefError`` subclass, one line naming where the pattern came from.
"""

from __future__ import annotations

import re
import signal
import threading
import time

from .errors import Fp8RefError, SpecError
from .limits import MAX_NAME, MAX_PATTERN, shown

BUDGET_S = 1.0

try:
    from re import _constants as _sre
    from re import _parser as _sre_parse
except ImportError:  # Python < 3.11
    import sre_constants as _sre  # type: ignore[no-redef]
    import sre_parse as _sre_parse  # type: ignore[no-redef]

_REPEATS = (_sre.MAX_REPEAT, _sre.MIN_REPEAT, getattr(_sre, "POSSESSIVE_REPEAT", _sre.MAX_REPEAT))


class _Overtime(Exception):
    pass


def _nested_repeat(parsed) -> bool:
    """Does some quantifier (max > 1) apply to a subpattern that holds an unbounded one?"""

    def walk(items, inside: bool) -> bool:
        for op, av in items:
            if op in _REPEATS:
                lo, hi, body = av
                if inside and hi == _sre.MAXREPEAT:
                    return True
                if walk(body, inside or hi > 1):
                    return True
                continue
            for sub in _subpatterns(op, av):
                if walk(sub, inside):
                    return True
        return False

    return walk(parsed, False)


def _subpatterns(op, av):
    if op is _sre.SUBPATTERN:
        return [av[-1]]
    if op is _sre.BRANCH:
        return list(av[1])
    if op in (_sre.ASSERT, _sre.ASSERT_NOT):
        return [av[1]]
    if op is getattr(_sre, "ATOMIC_GROUP", None):
        return [av]
    if op is _sre.GROUPREF_EXISTS:
        return [b for b in av[1:] if b is not None]
    return []


def _risk(parsed) -> str | None:
    """How a pattern that passed the static check can still backtrack: "exponential" (an
    alternation under a quantifier, ``(a|aa)*c``, or a backreference), "polynomial" (two or more
    unbounded quantifiers, ``.*a.*b``) or None (one quantifier: about linear in the name)."""
    count = 0

    def walk(items, repeated: bool) -> bool:
        nonlocal count
        for op, av in items:
            if op in _REPEATS:
                count += av[1] == _sre.MAXREPEAT
                if walk(av[2], repeated or av[1] > 1):
                    return True
            elif op in (_sre.GROUPREF, _sre.GROUPREF_EXISTS) or (op is _sre.BRANCH and repeated):
                return True
            elif any(walk(sub, repeated) for sub in _subpatterns(op, av)):
                return True
        return False

    if walk(parsed, False):
        return "exponential"
    return "polynomial" if count > 1 else None


class Pattern:
    """A compiled untrusted regex. ``where`` names its origin (``FILE: key``) in every error."""

    __slots__ = ("text", "where", "error", "_rx", "_risk", "_spent")

    def __init__(self, text: str, where: str, *, error: type[Fp8RefError] = SpecError):
        self.text, self.where, self.error = text, where, error
        if not isinstance(text, str):
            raise self.fail(f"expected a regular expression (a string), got {shown(text)}")
        if len(text) > MAX_PATTERN:
            raise self.fail(f"regular expression of {len(text)} characters; at most {MAX_PATTERN}")
        try:
            parsed = _sre_parse.parse(text)
            self._rx = re.compile(text)
        except (re.error, RecursionError, OverflowError) as exc:
            raise self.fail(f"invalid regular expression {_quoted(text)}: {exc}") from None
        if _nested_repeat(parsed):
            raise self.fail(f"regular expression {_quoted(text)} repeats a repeated subpattern (like '(a+)+'), "
                            f"which can take exponential time; write it without the nested quantifier")
        self._risk = _risk(parsed)
        self._spent = 0.0

    def fail(self, problem: str) -> Fp8RefError:
        """The error to raise: ``WHERE: PROBLEM``; ``.problem`` holds the part after WHERE."""
        exc = self.error(f"{self.where}: {problem}")
        exc.problem = problem
        return exc

    def match(self, name: str) -> bool:
        """``re.match`` (anchored at the start, as compressed-tensors and specs use it)."""
        return self._run(self._rx.match, name)

    def search(self, name: str) -> bool:
        """``re.search`` (anywhere, as auto-round's extra_config keys are used)."""
        return self._run(self._rx.search, name)

    def _run(self, fn, name: str) -> bool:
        if len(name) > MAX_NAME:
            raise self.fail(f"name {shown(name)} is longer than {MAX_NAME} characters")
        if self._risk is None:
            return fn(name) is not None
        if not _can_alarm():  # no time budget here: only what backtracks polynomially may run
            if self._risk == "exponential":
                raise self.fail(f"regular expression {_quoted(self.text)} has an alternation under a quantifier "
                                f"or a backreference, which can take exponential time, and matching off the main "
                                f"thread has no time budget; simplify it")
            return fn(name) is not None
        left = BUDGET_S - self._spent
        previous = signal.signal(signal.SIGALRM, _overtime)
        start = time.perf_counter()
        try:
            signal.setitimer(signal.ITIMER_REAL, max(left, 1e-3))
            return fn(name) is not None
        except _Overtime:
            raise self.fail(f"regular expression {_quoted(self.text)} took more than {BUDGET_S:g} s of matching "
                            f"(last name: {shown(name)}); simplify it") from None
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
            self._spent += time.perf_counter() - start

    def __repr__(self) -> str:
        return f"Pattern({self.text!r})"


def _quoted(text: str) -> str:
    """The pattern as written in its file (repr would double every backslash), cut to 80 characters."""
    return f"'{text}'" if text.isprintable() and len(text) <= 80 else shown(text)


def _overtime(signum, frame):
    raise _Overtime


def _can_alarm() -> bool:
    """Only the main thread receives signals, and a caller's own alarm is left alone."""
    return (hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
            and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0))


def wildcard_prefix(pattern: str, name: str) -> bool:
    """Whether ``name`` starts with a string that ``pattern`` matches, ``*`` standing for any run of
    characters and every other character for itself (what ``re.match`` does with the pattern's ``*``
    as ``.*``). No regex: each literal piece is found leftmost after the previous one, which is
    optimal because the rest of ``name`` is free, so the time is O(len(pattern) * len(name)) whatever
    the pattern (``*a*a*...*`` compiled to a regex backtracks polynomially without bound)."""
    first, *rest = pattern.split("*")
    if not name.startswith(first):
        return False
    at = len(first)
    for piece in rest:
        found = name.find(piece, at)
        if found < 0:
            return False
        at = found + len(piece)
    return True

