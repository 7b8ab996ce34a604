"""Conformance harness: run golden suites live against backends callable from Python.

``load_backend(name)`` finds a backend (built-in adapter, ``fp8ref.backends`` entry point or
``module:object``); ``run(backend, suite)`` compares it case by case with fp8ref's core.
Importing this package imports no peer library, and the runner (with the golden suites)
only on first use, so the pytest plugin stays cheap when inactive.
"""

from .backend import Backend, BackendUnavailable, known_backends, load_backend
from .xfails import Xfails, default_xfails, load_xfails

__all__ = ["Backend", "BackendUnavailable", "RunResult", "Xfails", "default_xfails", "known_backends",
           "load_backend", "load_xfails", "run"]


def __getattr__(name: str):
    if name in ("run", "RunResult"):
        from . import runner

        return getattr(runner, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
