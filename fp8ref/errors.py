"""Every error fp8ref raises on bad input is an ``Fp8RefError``.

Subclasses also derive from the builtin a caller would naturally catch (``ValueError``,
``KeyError``, ``TypeError``), so generic code keeps working. Messages say where, what was
given and what was expected.
"""

import difflib


class Fp8RefError(Exception):
    """Base class of every error fp8ref raises on purpose."""


class FormatError(Fp8RefError, ValueError):
    """Unknown format name, impossible format parameters, codes outside a format."""


class UnknownFormatError(FormatError, KeyError):
    """A format name that is not in the registry."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class EncodeError(Fp8RefError, ValueError):
    """A value the requested conversion cannot represent (e.g. NaN into fp4)."""


class InputTypeError(Fp8RefError, TypeError):
    """An array of the wrong dtype, library or shape."""


class SpecError(Fp8RefError, ValueError):
    """A malformed scheme, YAML spec, preset, recipe or suite file."""


class RecipeError(SpecError):
    """Unknown recipe or a recipe that cannot apply to the given scheme."""


class ShapeError(Fp8RefError, ValueError):
    """Shapes, granularities or scales that do not fit together."""


class ScaleError(Fp8RefError, ValueError):
    """A NaN, infinite, zero or negative scale where a positive finite one is required."""


class CheckpointError(Fp8RefError, ValueError):
    """A checkpoint that is missing, malformed, inconsistent or unsafe to read."""


class GoldenError(Fp8RefError, ValueError):
    """A golden folder with missing, extra or modified files, or a bad suite."""


class BackendError(Fp8RefError, LookupError):
    """An unknown or unusable conformance backend."""


class ModelError(Fp8RefError, ValueError):
    """A whole model that cannot be built, swapped or run (missing extra, unplaced layer, bad mode)."""


class OutputError(Fp8RefError, OSError):
    """An output fp8ref refuses to write (an input, a folder it did not write, one another run is
    writing) or could not write (a full disk): the message names the file."""


class Fp8RefWarning(UserWarning):
    """Something fp8ref did or noticed that the user should know (the CLI prints ``fp8ref: warning: ...``)."""


def did_you_mean(value: object, choices, *, n: int = 1, cutoff: float = 0.6, clause: bool = False,
                 fold=None) -> str:
    """The "did you mean" hint every unknown-name message ends with: `` (did you mean 'x'?)``, or
    with ``clause`` ``; did you mean 'x' or 'y'?``; empty when nothing in ``choices`` is close.
    ``fold`` (e.g. ``str.upper``) compares case-insensitively and still names the choice as spelled."""
    fold = fold or (lambda text: text)
    spelled = {fold(str(c)): str(c) for c in reversed(list(choices))}  # the first spelling wins
    matches = difflib.get_close_matches(fold(str(value)), list(spelled)[::-1], n=n, cutoff=cutoff)
    close = [spelled[c] for c in matches]
    if not close:
        return ""
    text = f"did you mean {' or '.join(map(repr, close))}?"
    return f"; {text}" if clause else f" ({text})"
