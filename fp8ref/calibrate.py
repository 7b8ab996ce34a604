"""Static activation calibration: amax observers as pure folds, and a torch hook helper.

An observer is a value, not an object with hidden state:

    state = amax_state("tensor")            # or "channel", or "group" with group_size
    for x in batches: state = observe(state, x)
    scale = finalize(state, "float8_e4m3fn")  # fp32(amax) / fp32(fmt.max), a dequant multiplier

Scales and amax are told apart by type: ``finalize`` returns a ``DequantScale`` array and
``calibrate_input_scales`` a ``CalibratedScales`` mapping (which keeps the amax it came from in
``.amax``), so ``write_calibration``, which stores amax, refuses them instead of writing input
scales 448x too small (docs/matmul.md).

``observe`` is a max, so the fold does not depend on the order of the batches, and ``merge`` of
states observed on separate shards equals observing the concatenation. The same ``merge`` is the
rule for fused projections that share one input (q/k/v, gate/up) and for the input scale of
MoE experts (vLLM keeps the max over shards and over experts; REFERENCE 6.1).

Recipe-specific formulas (auto-round's 1/229376 floor with bf16 storage, compressed-tensors' eps
for a zero scale, bf16 rounding) are not built in: pass ``scale_fn`` to ``finalize``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from ._arrays import float64_values, is_torch
from .errors import InputTypeError, ScaleError, ShapeError, SpecError
from .formats import FloatFormat, get_format

GRANULARITIES = ("tensor", "channel", "group")
_FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")


@dataclass(frozen=True)
class AmaxState:
    """Running amax of |x| over everything observed, per granularity.

    ``amax`` is a read-only float64 array (exact for every float input): shape () for "tensor",
    (K,) for "channel" (K = size of the last axis), (ceil(K / group_size),) for "group"; None
    before the first observation. ``count`` is the number of tensors observed.
    """

    granularity: str = "tensor"
    group_size: int | None = None
    amax: np.ndarray | None = None
    count: int = 0

    def __post_init__(self) -> None:
        if self.granularity not in GRANULARITIES:
            raise InputTypeError(f"granularity: expected one of {', '.join(GRANULARITIES)}, "
                                 f"got {self.granularity!r}")
        if (self.granularity == "group") != (self.group_size is not None):
            raise InputTypeError(f"group_size: required for granularity 'group' and only there, got "
                                 f"{self.group_size!r} with {self.granularity!r}")
        if self.group_size is not None and (type(self.group_size) is not int or self.group_size < 1):
            raise InputTypeError(f"group_size: expected an int >= 1, got {self.group_size!r}")
        if self.amax is not None:
            frozen = np.array(self.amax, dtype=np.float64)
            frozen.setflags(write=False)
            object.__setattr__(self, "amax", frozen)


class DequantScale(np.ndarray):
    """Dequantization scales (amax / fmt.max) that ``finalize`` computed: a numpy array marked as
    scales, so that what stores amax (``write_calibration``) can refuse them. It is an ndarray in
    every other respect. Arithmetic on it gives plain arrays: ``scale * 448`` is no longer a scale."""

    def __array_ufunc__(self, ufunc, method, *inputs, out=None, **kwargs):
        inputs = tuple(np.asarray(x) if isinstance(x, DequantScale) else x for x in inputs)
        if out is not None:
            kwargs["out"] = tuple(np.asarray(o) if isinstance(o, DequantScale) else o for o in out)
        return getattr(ufunc, method)(*inputs, **kwargs)


class CalibratedScales(dict):
    """What ``calibrate_input_scales`` returns: layer name -> ``DequantScale``. ``amax`` holds the
    layer name -> ``AmaxState`` (merged over each ``fuse`` group) the scales were finalized from:
    the values ``write_calibration`` takes."""

    def __init__(self, scales: dict, amax: dict):
        super().__init__(scales)
        self.amax = amax


def amax_state(granularity: str = "tensor", *, group_size: int | None = None) -> AmaxState:
    """The empty state (identity of ``merge``)."""
    return AmaxState(granularity, group_size)


def _abs_max(x, state: AmaxState) -> np.ndarray:
    """amax of |x| reduced to the state's granularity, as float64 (NaN propagates)."""
    if is_torch(x) or isinstance(x, np.ndarray):
        x = float64_values(x, "x", _FLOAT_DTYPES)  # exact for every float dtype
    else:
        raise InputTypeError(f"x: expected a numpy array or torch tensor, got {type(x).__name__}")
    if x.ndim == 0 and state.granularity != "tensor":
        raise ShapeError(f"x: granularity {state.granularity!r} needs at least one axis, got shape ()")
    a = np.abs(x)
    if state.granularity == "tensor":
        return np.max(a, initial=0.0)  # NaN propagates
    per_channel = np.max(a.reshape(-1, x.shape[-1]), axis=0, initial=0.0)
    if state.granularity == "channel":
        return per_channel
    pad = -per_channel.size % state.group_size
    return np.concatenate([per_channel, np.zeros(pad)]).reshape(-1, state.group_size).max(axis=1)


def _combine(old: np.ndarray | None, new: np.ndarray, what: str) -> np.ndarray:
    if old is None:
        return new
    if old.shape != new.shape:
        raise ShapeError(f"{what}: amax of shape {old.shape} cannot combine with shape {new.shape} "
                         "(channel/group states need the same last-axis size)")
    return np.maximum(old, new)  # NaN propagates whatever the order


def observe(state: AmaxState, x) -> AmaxState:
    """The state after also seeing ``x`` (numpy array or torch tensor; the last axis is K)."""
    if not isinstance(state, AmaxState):
        raise InputTypeError(f"state: expected an AmaxState, got {type(state).__name__}")
    amax = _combine(state.amax, _abs_max(x, state), "x")
    return AmaxState(state.granularity, state.group_size, amax, state.count + 1)


def merge(*states: AmaxState) -> AmaxState:
    """One state for fused shards (q/k/v, gate/up) or MoE experts: the elementwise max."""
    if not states:
        raise InputTypeError("merge: expected at least one AmaxState")
    first = states[0]
    amax, count = None, 0
    for i, s in enumerate(states):
        if not isinstance(s, AmaxState):
            raise InputTypeError(f"states[{i}]: expected an AmaxState, got {type(s).__name__}")
        if (s.granularity, s.group_size) != (first.granularity, first.group_size):
            raise ShapeError(f"states[{i}]: granularity {s.granularity!r}/{s.group_size} differs from "
                             f"states[0] {first.granularity!r}/{first.group_size}")
        if s.amax is not None:
            amax = _combine(amax, s.amax, f"states[{i}]")
        count += s.count
    return AmaxState(first.granularity, first.group_size, amax, count)


def finalize(state: AmaxState, fmt: FloatFormat | str = "float8_e4m3fn", *, dtype: str = "float32",
             scale_fn: Callable[[np.ndarray, FloatFormat], np.ndarray] | None = None) -> np.ndarray:
    """Dequantization scale from a state: ``dtype(amax) / dtype(fmt.max)``, one correctly rounded
    division in ``dtype`` ("float32" or "float64"). ``scale_fn(amax, fmt)`` replaces that formula
    (a recipe's floor, eps or storage rounding) and gets the float64 amax array.

    Errors: a state that saw nothing, a NaN/Inf amax, or (default formula) a zero amax, which
    would give a zero scale: each recipe has its own rule for that, so pass ``scale_fn``.
    """
    if not isinstance(state, AmaxState):
        raise InputTypeError(f"state: expected an AmaxState (amax_state, observe), got {type(state).__name__}")
    fmt = get_format(fmt)
    if dtype not in ("float32", "float64"):
        raise InputTypeError(f"dtype: expected 'float32' or 'float64', got {dtype!r}")
    if state.amax is None:
        raise ScaleError("state: no tensor was observed, so there is no amax to turn into a scale")
    if not np.isfinite(state.amax).all():
        raise ScaleError(f"state: amax is {state.amax[~np.isfinite(state.amax)].reshape(-1)[0]} "
                         "(a NaN or Inf was observed); expected finite activations")
    if scale_fn is not None:
        scale = scale_fn(state.amax, fmt)
        return np.asarray(scale).view(DequantScale) if isinstance(scale, (np.ndarray, np.generic)) else scale
    if (state.amax == 0).any():
        raise ScaleError("state: amax is 0 (only zeros observed), which gives a zero scale; pass scale_fn "
                         "with your recipe's rule for it (CT: eps of the scale dtype, auto-round: 1/229376)")
    t = np.dtype(dtype).type
    return np.asarray(state.amax.astype(t) / t(fmt.max), t).view(DequantScale)


# --------------------------------------------------------------------------------------------
# torch helper
# --------------------------------------------------------------------------------------------
def _selector(select) -> Callable[[str], bool]:
    """An object with resolve(name) -> scheme-or-None, a predicate, or a collection of names."""
    if hasattr(select, "resolve"):
        return lambda name: select.resolve(name) is not None
    if callable(select):
        return lambda name: bool(select(name))
    if isinstance(select, Iterable) and not isinstance(select, (str, bytes)):
        names = set(select)
        return names.__contains__
    raise InputTypeError(f"select: expected an object with resolve(name), a predicate or a list of names, "
                         f"got {type(select).__name__}")


def observe_linear_inputs(model, batches: Iterable, select, *, granularity: str = "tensor",
                          group_size: int | None = None) -> dict[str, AmaxState]:
    """Run ``batches`` through ``model`` and fold the input of every selected ``nn.Linear``.

    A batch that is a tuple/list is called as ``model(*batch)``, a dict as ``model(**batch)``, anything
    else as ``model(batch)``, under ``torch.no_grad()``. Forward pre-hooks are removed afterwards;
    nothing in the model is written (set eval mode yourself if your model needs it).
    """
    import torch

    if not isinstance(model, torch.nn.Module):
        raise InputTypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    pick = _selector(select)
    linears = {name: m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and pick(name)}
    if not hasattr(select, "resolve") and not callable(select):
        missing = sorted(set(select) - set(linears))
        if missing:
            raise SpecError(f"select: {missing} are not nn.Linear layers of the model")
    states = {name: amax_state(granularity, group_size=group_size) for name in linears}

    def hook_for(name):
        def hook(_module, args, kwargs):
            states[name] = observe(states[name], args[0] if args else kwargs["input"])
        return hook

    handles = [m.register_forward_pre_hook(hook_for(name), with_kwargs=True) for name, m in linears.items()]
    try:
        with torch.no_grad():
            for batch in batches:
                if isinstance(batch, dict):
                    model(**batch)
                elif isinstance(batch, (tuple, list)):
                    model(*batch)
                else:
                    model(batch)
    finally:
        for h in handles:
            h.remove()
    return states


def calibrate_input_scales(model, batches: Iterable, select, *, fmt: FloatFormat | str = "float8_e4m3fn",
                           granularity: str = "tensor", group_size: int | None = None,
                           fuse: Iterable[Iterable[str]] = (), dtype: str = "float32",
                           scale_fn=None) -> CalibratedScales:
    """Static input scales of the selected linear layers: observe, merge each group in ``fuse``
    (e.g. the q/k/v projections of one attention block: every member gets the merged scale), then
    ``finalize``. Layers that saw no input raise ScaleError naming them. The result maps layer ->
    ``DequantScale``; its ``.amax`` (layer -> AmaxState) is what ``write_calibration`` stores."""
    states = observe_linear_inputs(model, batches, select, granularity=granularity, group_size=group_size)
    for group in fuse:
        group = list(group)
        unknown = [n for n in group if n not in states]
        if unknown:
            raise SpecError(f"fuse: {unknown} are not selected linear layers")
        merged = merge(*(states[n] for n in group))
        states.update({n: merged for n in group})
    silent = sorted(n for n, s in states.items() if s.amax is None)
    if silent:
        raise ScaleError(f"model: selected layers saw no input during calibration: {silent}")
    return CalibratedScales({name: finalize(s, fmt, dtype=dtype, scale_fn=scale_fn) for name, s in states.items()},
                            states)
