"""Accumulation models: a registry of name -> model object with one interface.

A model is called with the checked operands (uint8 codes, formats, the canonical (M, KB) / (KB, N)
float64 scales and the K-block length) and an ``Accumulation`` record, and returns either the result
already rounded once to the output (``rounds_once``: the exact model; bias included; values on the
output's grid in any float dtype that holds them, or CodeOut representatives) or a float32
accumulator without the bias (the fp32 models: scaled_mm adds the bias and rounds to the output).
A model with ``takes_decoded = True`` may get b as an ``operands.DecodedCodes`` record (codes in
``.codes``) where the caller gave one; the others always get the codes.
A new hardware model is one class and one ``register_accumulation`` call; nothing dispatches on names.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from ..codec import decode
from ..errors import InputTypeError, ShapeError
from ..limits import MAX_GROUP, shown
from .exact import _exact
from .exact_fast import _fast_exact
from .fp32 import _fp32, _fp32_limited

SCALE_ORDERS = ("epilogue", "operands")


@dataclass(frozen=True)
class Accumulation:
    """How the products are summed: the ``model`` (a registered name) and its options.

    block_k: fp32 K-blocks whose scaled sums are added to the fp32 total (None: the scale blocks);
    scale_order: "epilogue" scales each block sum, "operands" scales a and b first (torch's CPU path);
    promote_every / mantissa_bits: fp32-limited's promotion interval and accumulator fraction bits.
    """

    model: str = "exact"
    block_k: int | None = None
    scale_order: str = "epilogue"
    promote_every: int = 128
    mantissa_bits: int = 13

    def __post_init__(self) -> None:
        if self.model not in _MODELS:
            raise InputTypeError(f"accumulate: expected one of {', '.join(_MODELS)}, got {self.model!r}")
        if self.scale_order not in SCALE_ORDERS:
            raise InputTypeError(f"scale_order: expected one of {', '.join(SCALE_ORDERS)}, got {self.scale_order!r}")
        for name, v, lo in (("block_k", self.block_k, 1), ("promote_every", self.promote_every, 1),
                            ("mantissa_bits", self.mantissa_bits, 0)):
            if v is not None and (type(v) is not int or v < lo):
                raise InputTypeError(f"{name}: expected an int >= {lo}, got {shown(v)}")
            if v is not None and v > MAX_GROUP:  # the C loop takes it as a size_t and divides by it
                raise InputTypeError(f"{name}: expected at most {MAX_GROUP}, got {shown(v)}")
        if self.mantissa_bits > 23:
            raise InputTypeError(f"mantissa_bits: at most 23 (fp32), got {self.mantissa_bits}")


class ExactModel:
    """The exact sum, rounded once to the output (bias included): the GEMM fast path where its
    proof applies (exact_fast.py), else the general path (exact.py)."""

    name = "exact"
    rounds_once = True
    takes_decoded = True  # cb may be a DecodedCodes record (scaled_mm passes one through)

    def __call__(self, ca, cb, fa, fb, sa, sb, bk, bias, out, acc: Accumulation):
        result = _fast_exact(ca, cb, fa, fb, sa, sb, bk, bias, out)
        if result is None:
            result = _exact(ca, getattr(cb, "codes", cb), fa, fb, sa, sb, bk, bias, out)
        return result


class Fp32Model:
    """fp32 accumulation in the declared sequential order, fp32 K-block totals."""

    name = "fp32"
    rounds_once = False

    def __call__(self, ca, cb, fa, fb, sa, sb, bk, bias, out, acc: Accumulation):
        return _fp32(ca, cb, fa, fb, sa, sb, bk, acc.block_k if acc.block_k is not None else bk, acc.scale_order)


class Fp32LimitedModel:
    """A ``mantissa_bits`` accumulator (truncating) promoted to fp32 every ``promote_every`` products."""

    name = "fp32-limited"
    rounds_once = False

    def __call__(self, ca, cb, fa, fb, sa, sb, bk, bias, out, acc: Accumulation):
        if bk % acc.promote_every and sa.shape[1] > 1:
            raise ShapeError(f"promote_every: {acc.promote_every} must divide the scale block length {bk}")
        return _fp32_limited(decode(ca, fa), decode(cb, fb), sa, sb, bk, acc.promote_every, acc.mantissa_bits)


_MODELS: dict[str, object] = {}
ACCUMULATION_MODELS: Mapping[str, object] = MappingProxyType(_MODELS)


def register_accumulation(model) -> None:
    """Add a model (an object with ``name``, ``rounds_once`` and the call above); names are unique."""
    if not isinstance(getattr(model, "name", None), str) or not callable(model):
        raise InputTypeError(f"model: expected a callable with a str name, got {model!r}")
    if model.name in _MODELS:
        raise InputTypeError(f"accumulation model {model.name!r} is already registered")
    _MODELS[model.name] = model


for _model in (ExactModel(), Fp32Model(), Fp32LimitedModel()):
    register_accumulation(_model)
ACCUMULATIONS = tuple(_MODELS)  # the built-in models (golden suites' "all" means these)
