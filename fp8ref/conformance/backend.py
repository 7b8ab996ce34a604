"""The Backend protocol and how backends are found by name.

A backend is an object with a ``name``, a ``capabilities`` declaration and one method per
operation it implements. Methods take and return numpy arrays (adapters convert to and
from their library). Anything not declared is reported as "not implemented", never run
and never counted as a pass.

```python
class MyCast(Backend):
    name = "mycast"
    capabilities = {"encode": {"format": ["float8_e4m3fn"], "rounding": ["rne"],
                               "saturate": [True], "dtype": ["float32"]}}
    def encode(self, x, fmt, *, rounding, saturate, random_bits=None): ...  # -> uint8 codes
```

The protocol is derived from the operations table (``fp8ref.golden.ops.OPERATIONS``): an
operation's row gives its method's signature (``OPERATIONS[op].signature``, listed by
``protocol()``) and the case parameters a capability may restrict (``OPERATIONS[op].params``).
``check_capabilities`` rejects an unknown operation or parameter, or a declared operation
without its method, when the backend is loaded or run.

Backends are found by built-in name, by the ``fp8ref.backends`` entry point group (the entry
point loads a Backend subclass, a factory or an instance), or as ``module:object``.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import re
import signal
import threading
from collections.abc import Collection, Mapping
from contextlib import contextmanager
from importlib import metadata
from typing import Protocol, runtime_checkable

from ..errors import BackendError

ENTRY_POINT_GROUP = "fp8ref.backends"
BUILTIN = {
    "torch": "fp8ref.conformance.adapters.torch_backend:TorchBackend",
    "torch_cuda": "fp8ref.conformance.adapters.torch_backend:TorchCudaBackend",
    "torch_cuda_fast_accum": "fp8ref.conformance.adapters.torch_backend:TorchCudaFastAccumBackend",
    "ml_dtypes": "fp8ref.conformance.adapters.ml_dtypes_backend:MlDtypesBackend",
    "gfloat": "fp8ref.conformance.adapters.gfloat_backend:GfloatBackend",
    "compressed_tensors": "fp8ref.conformance.adapters.compressed_tensors_backend:CompressedTensorsBackend",
    "auto_round": "fp8ref.conformance.adapters.auto_round_backend:AutoRoundBackend",
    "onnxruntime": "fp8ref.conformance.adapters.onnxruntime_backend:OnnxRuntimeBackend",
    "onnx_reference": "fp8ref.conformance.adapters.onnx_reference_backend:OnnxReferenceBackend",
    "gguf": "fp8ref.conformance.adapters.gguf_backend:GgufBackend",
    "openvino": "fp8ref.conformance.adapters.openvino_backend:OpenVinoBackend",
    "openvino_fakeconvert": "fp8ref.conformance.adapters.openvino_backend:OpenVinoFakeConvertBackend",
    "naive_block": "fp8ref.conformance.adapters.naive_block_backend:NaiveBlockBackend",
}


class BackendUnavailable(BackendError):
    """A known backend whose peer library is not installed or not usable here."""


@runtime_checkable
class BackendProtocol(Protocol):
    name: str

    def implements(self, op: str, params: Mapping) -> str | None: ...


class Backend:
    """Convenience base: declarative capabilities and availability."""

    name: str = ""
    # op -> {param name -> allowed values}; a case runs only if every listed param matches.
    capabilities: Mapping[str, Mapping[str, Collection]] = {}
    # the shipped suites ``fp8ref conform`` runs without --suite (empty: fp8ref.golden.DEFAULT_SUITES)
    default_suites: tuple[str, ...] = ()

    def version(self) -> str:
        return ""

    def implements(self, op: str, params: Mapping) -> str | None:
        """None when this backend implements ``op`` with ``params``; else the reason it does not."""
        caps = self.capabilities.get(op)
        if caps is None:
            return f"{self.name} does not implement {op}"
        for key, allowed in caps.items():
            if params.get(key) not in allowed:
                return f"{self.name} {op} does not implement {key}={params.get(key)!r}"
        return None


def known_backends() -> dict[str, str]:
    """Name -> 'module:object' for the built-ins and every installed entry point."""
    names = dict(BUILTIN)
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        names.setdefault(ep.name, ep.value)
    return names


def _normalise(name: str) -> str:
    return name.replace("-", "_")


def load_backend(name: str):
    """The backend called ``name`` (built-in, entry point, or ``module:object``), ready to use.

    Raises BackendError for unknown names (listing the known ones) and BackendUnavailable
    when the backend's peer library is missing (with the reason)."""
    if not isinstance(name, str) or not name:
        raise BackendError(f"backend: expected a name or 'module:object', got {name!r}")
    known = known_backends()
    target = known.get(_normalise(name))
    if target is None and ":" not in name:
        close = difflib.get_close_matches(_normalise(name), known, n=2)
        hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
        raise BackendError(f"unknown backend {name!r}{hint} (known: {', '.join(sorted(known))}; "
                           f"or give 'module:object', or register an entry point in {ENTRY_POINT_GROUP!r})")
    backend = _instantiate(target or name, name)
    if not isinstance(backend, BackendProtocol):
        raise BackendError(f"backend {name!r}: {type(backend).__name__} has no 'name' and 'implements' "
                           "(subclass fp8ref.conformance.Backend)")
    reason = guarded(name, "unavailable()", getattr(backend, "unavailable", lambda: None))
    if reason:
        raise BackendUnavailable(f"backend {name!r} is unavailable: {reason}")
    check_capabilities(backend)
    return backend


def protocol() -> dict[str, str]:
    """Operation -> the backend method's signature, from the operations table."""
    from ..golden.ops import OPERATIONS  # the table imports the core: the pytest plugin stays light

    return {name: op.signature for name, op in OPERATIONS.items()}


def check_capabilities(backend) -> None:
    """BackendError when ``capabilities`` names an operation or a parameter the operations
    table does not have, or an operation whose method the backend lacks."""
    from ..golden.ops import OPERATIONS

    declared = guarded(getattr(backend, "name", "?"), "reading capabilities",
                       lambda: dict(getattr(backend, "capabilities", None) or {}))
    for op, caps in declared.items():
        where = f"backend {backend.name!r}: capabilities[{op!r}]"
        if op not in OPERATIONS:
            raise BackendError(f"{where}: unknown operation; expected one of {sorted(OPERATIONS)}")
        row = OPERATIONS[op]
        for key in caps:
            if key not in row.params:
                raise BackendError(f"{where}: unknown parameter {key!r}; {op} cases have {list(row.params)}")
        if not callable(getattr(backend, op, None)):
            raise BackendError(f"{where}: declared but the backend has no method {row.signature}")
        for key, allowed in caps.items():
            if isinstance(allowed, (str, bytes)) or not isinstance(allowed, Collection):
                raise BackendError(f"{where}[{key!r}]: expected a list of accepted values, got {allowed!r:.80} "
                                   "(omit the key to accept every value)")
        _check_method(backend, op, row.signature)
        for kw, (param, values) in getattr(row, "conditional_keywords", {}).items():
            if param in caps and any(v in caps[param] for v in values):
                _check_keyword(backend, op, kw, f"{param} {'/'.join(v for v in values if v in caps[param])}")


def capability_suites(backend) -> tuple[list[str], list[str]]:
    """(the capability suites ``backend`` declares, a line per one it does not: why it is skipped).
    A backend without a ``capabilities`` mapping is given every one (its ``implements`` decides)."""
    from ..golden import CAPABILITY_SUITES  # the golden package imports the core: keep this module light

    caps = getattr(backend, "capabilities", None)
    run, skipped = [], []
    for name, (op, param, wanted) in CAPABILITY_SUITES.items():
        declared = None if caps is None else caps.get(op)
        if caps is None or (declared is not None and (param not in declared
                                                      or any(v in declared[param] for v in wanted))):
            run.append(name)
        else:
            skipped.append(f"suite {name} skipped: backend {backend.name!r} declares no {op} with "
                           f"{param} {' or '.join(wanted)}")
    return run, skipped


def suites_for(backend, asked=None) -> tuple[list[str], list[str]]:
    """(the suites a run against ``backend`` uses, a line per capability suite it skips and why).

    ``asked`` (``--suite`` / ``--fp8ref-suite``) is used as given. Without it: the backend's
    ``default_suites`` (else fp8ref.golden.DEFAULT_SUITES), then the capability suites it declares
    (``capability_suites``). ``fp8ref conform`` and the pytest plugin both choose through here."""
    if asked:
        return list(asked), []
    from ..golden import DEFAULT_SUITES

    name = getattr(backend, "name", "?")
    own = guarded(name, "reading default_suites", lambda: getattr(backend, "default_suites", None))
    if own and (isinstance(own, (str, bytes)) or not isinstance(own, Collection)
                or not all(isinstance(s, str) and s for s in own)):
        raise BackendError(f"backend {name!r}: default_suites: expected a list of suite names, got {own!r:.80}")
    extra, skipped = capability_suites(backend)
    return list(dict.fromkeys([*(own or DEFAULT_SUITES), *extra])), skipped


def _check_method(backend, op: str, signature: str) -> None:
    """The method must accept the call the contract makes (``fp8ref.golden.ops`` signatures):
    its positional arguments and its keyword-only ones, by name."""
    args = re.match(r"\w+\((.*?)\)", signature).group(1)
    positional, _, keywords = args.partition("*")
    pos = [a.strip() for a in positional.split(",") if a.strip()]
    kw = [a.split("=")[0].strip() for a in keywords.split(",") if a.strip()]
    try:
        sig = inspect.signature(getattr(backend, op))
    except (TypeError, ValueError):  # a builtin or C function: nothing to check
        return
    try:
        sig.bind(*pos, **dict.fromkeys(kw))
    except TypeError as exc:
        raise BackendError(f"backend {backend.name!r}: method {op}{sig} cannot take the contract's call "
                           f"{signature.split(' ->')[0]}: {exc}") from None


def _check_keyword(backend, op: str, kw: str, cases: str) -> None:
    """The method must take keyword ``kw``, which the contract passes to the ``cases`` it declares."""
    try:
        sig = inspect.signature(getattr(backend, op))
    except (TypeError, ValueError):
        return
    takes = kw in sig.parameters or any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
    if not takes:
        raise BackendError(f"backend {backend.name!r}: declares {op} cases with {cases}, which pass {kw}=, "
                           f"but method {op}{sig} does not take it")


def describe_failure(exc: BaseException) -> str:
    if isinstance(exc, SystemExit):
        return f"called sys.exit({exc.code!r})"
    if isinstance(exc, KeyboardInterrupt):
        return f"raised KeyboardInterrupt{f': {exc}' if str(exc) else ''} (no Ctrl-C reached fp8ref)"
    return f"{type(exc).__name__}: {exc}"


_STOP_SIGNALS = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, n))


@contextmanager
def signals_seen():
    """Within the block, a list of the stop signals (SIGINT, SIGTERM, SIGHUP) that reached the
    process. Each signal with a Python handler (SIGINT's raises KeyboardInterrupt) keeps that
    handler, which is called as before; the list only records that it ran. So a KeyboardInterrupt or
    SystemExit raised while the list is empty came from the code that raised it (a backend calling
    sys.exit), not from the user's Ctrl-C or a kill. Outside the main thread no handler runs in this
    thread: the list stays empty."""
    seen: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield seen
        return
    previous = {}
    for sig in _STOP_SIGNALS:
        handler = signal.getsignal(sig)
        if callable(handler):
            def recorder(signum, frame, handler=handler):
                seen.append(signum)
                return handler(signum, frame)
            previous[sig] = handler
            signal.signal(sig, recorder)
    try:
        yield seen
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class BackendExit(BackendError):
    """A backend's own code raised SystemExit or KeyboardInterrupt (no signal reached the process):
    its failure, not a request to end fp8ref. ``exc``: what it raised."""

    def __init__(self, message: str, exc: BaseException):
        super().__init__(message)
        self.exc = exc


def call_backend(name: str, what: str, call, *args):
    """``call(*args)`` (a backend's code): SystemExit and KeyboardInterrupt that it raises itself
    become ``BackendExit``; those raised by a signal that reached the process during the call (the
    user's Ctrl-C, a kill with a handler) propagate, so that the run still stops. Other exceptions
    propagate unchanged."""
    with signals_seen() as seen:
        try:
            return call(*args)
        except (SystemExit, KeyboardInterrupt) as exc:
            if seen:
                raise
            raise BackendExit(f"backend {name!r}: {what}: {describe_failure(exc)}", exc) from None


def guarded(name: str, what: str, call, *args):
    """``call(*args)`` with anything it raises, ``sys.exit`` included, turned into one BackendError
    naming the backend and the step (a backend is user code: its failure is not fp8ref's traceback)."""
    try:
        return call_backend(name, what, call, *args)
    except BackendExit as exc:
        raise BackendError(f"backend {name!r}: {what} failed: {describe_failure(exc.exc)}") from None
    except BackendError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise BackendError(f"backend {name!r}: {what} failed: {describe_failure(exc)}") from None


def _instantiate(spec: str, name: str):
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise BackendError(f"backend {name!r}: cannot import module {module_name!r} ({exc})") from None
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - the module's own code failed
        raise BackendError(f"backend {name!r}: importing module {module_name!r} failed: "
                           f"{describe_failure(exc)}") from None
    obj = module
    for part in attr.split(".") if attr else []:
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise BackendError(f"backend {name!r}: module {module_name!r} has no attribute {attr!r}") from None
    if isinstance(obj, type) or (callable(obj) and not isinstance(obj, BackendProtocol)):
        return guarded(name, f"constructing {spec}", obj)  # a class or a factory
    return obj
