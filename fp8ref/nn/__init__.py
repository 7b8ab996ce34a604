"""Whole models, torch at the edge: ``Fp8RefLinear`` (a checkpoint layer as an ``nn.Module``),
``swap_linears`` (put them in a model by name), ``build_model`` (a transformers model from a
checkpoint folder, no hub download), the modes each layer runs in, and the engines behind
``fp8ref compare``, ``eval`` and ``verify``. Importing this package imports torch."""

from .linear import Fp8RefLinear, fp8ref_layers, set_mode
from .model import build_model, load_unquantized
from .modes import Mode, parse_mode, parse_modes
from .swap import SwapReport, swap_linears

__all__ = ["Fp8RefLinear", "Mode", "SwapReport", "build_model", "fp8ref_layers", "load_unquantized", "parse_mode",
           "parse_modes", "set_mode", "swap_linears"]
