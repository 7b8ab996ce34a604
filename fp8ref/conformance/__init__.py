"""Conformance harness: run golden suites live against backends callable from Python.

``load_backend(name)`` finds a backend (built-in adapter, ``fp8ref.backends`` entry point or
``module:object``); ``run(backend, suite)`` compares it case by case with fp8ref's core.
Importing this package imports no peer library.
"""

from .backend import Backend, BackendUnavailable, known_backends, load_backend
from .runner import RunResult, run
from .xfails import Xfails, default_xfails, load_xfails

__all__ = ["Backend", "BackendUnavailable", "RunResult", "Xfails", "default_xfails", "known_backends",
           "load_backend", "load_xfails", "run"]
