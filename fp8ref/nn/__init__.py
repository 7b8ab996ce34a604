"""Whole models, torch at the edge: ``Fp8RefLinear`` (a checkpoint layer as an ``nn.Module``),
``swap_linears`` (put them in a model by name), ``build_model`` (a transformers model from a
checkpoint folder, no hub download), the modes each layer runs in, and the engines behind
``fp8ref compare``, ``eval`` and ``verify``. The names below are imported on first use (PEP 562),
and torch with them; ``fp8ref.nn.verify`` needs no torch, so ``fp8ref verify`` does not load it."""

from __future__ import annotations

import importlib

_EXPORTS = {
    "linear": ("Fp8RefLinear", "fp8ref_layers", "set_mode"),
    "model": ("build_model", "load_unquantized"),
    "modes": ("Mode", "parse_mode", "parse_modes"),
    "swap": ("SwapReport", "swap_linears"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'fp8ref.nn' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
