"""``swap_linears``: put an ``Fp8RefLinear`` in place of every quantized ``nn.Linear`` of a model by
name, and the experts of fused MoE modules through ``fp8ref.nn.experts``."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch

from .._arrays import torch_of
from ..errors import ModelError
from .experts import Fp8ExpertLinear, expert_name, original_expert_key, original_expert_weight, place_experts
from .linear import Fp8RefLinear


@dataclass
class SwapReport:
    """What ``swap_linears`` did: layer names swapped and (name, reason) for each it could not place."""

    swapped: list[str] = field(default_factory=list)
    unplaced: list[tuple[str, str]] = field(default_factory=list)

    def raise_unplaced(self, where: str) -> None:
        if self.unplaced:
            shown = "; ".join(f"{n}: {why}" for n, why in self.unplaced[:3])
            more = f" (and {len(self.unplaced) - 3} more)" if len(self.unplaced) > 3 else ""
            raise ModelError(f"{where}: {len(self.unplaced)} quantized layers could not be placed in the model: "
                             f"{shown}{more}")


def swap_linears(model: torch.nn.Module, checkpoint, *, mode="reference", accumulate: str = "exact",
                 backend=None, original=None, keep_decoded: bool = False) -> SwapReport:
    """Replace every ``nn.Linear`` named like a quantized layer of ``checkpoint`` with an
    ``Fp8RefLinear``. original: an unquantized Checkpoint (``load_checkpoint(SRC)``) or a mapping
    tensor name -> tensor, for ``mode="original"`` (a Checkpoint's tensors are read when a layer
    runs in that mode, not held). Layers without a matching ``nn.Linear`` (absent,
    another module type, another shape) are reported, not raised: see ``SwapReport.raise_unplaced``.
    keep_decoded: each layer keeps its decoded weight between exact forwards (``Fp8RefLinear``:
    8 bytes per weight element; default False)."""
    report = SwapReport()
    experts = []
    for name in checkpoint:
        layer = checkpoint[name]
        try:
            module = model.get_submodule(name)
        except AttributeError:
            if expert_name(name) is not None:  # a projection of a fused experts module: placed below
                experts.append(name)
            else:
                report.unplaced.append((name, "no module of that name"))
            continue
        if not isinstance(module, torch.nn.Linear):
            report.unplaced.append((name, f"is a {type(module).__name__}, not an nn.Linear"))
            continue
        if (module.out_features, module.in_features) != tuple(layer.shape):
            report.unplaced.append((name, f"nn.Linear is [{module.out_features}, {module.in_features}], "
                                          f"the checkpoint's weight {list(layer.shape)}"))
            continue
        if (module.bias is not None) != (layer.tensors.get("bias") is not None):
            report.unplaced.append((name, "bias in one of the model and the checkpoint only"))
            continue
        w, b, source = _original(original, name, tuple(layer.shape))
        new = Fp8RefLinear(layer, "reference", accumulate=accumulate, backend=backend, original_weight=w,
                           original_bias=b, keep_decoded=keep_decoded, original_source=source)
        new.mode = mode
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, new)
        report.swapped.append(name)
    if experts:
        place_experts(model, checkpoint, experts, report,
                      lambda layer, name: _expert(layer, name, mode, accumulate, backend, original, keep_decoded))
    return report


def _expert(layer, name, mode, accumulate, backend, original, keep_decoded):
    """One ``Fp8ExpertLinear`` in ``mode``, its original weight under any of its names: from a
    Checkpoint checked by its header now and read on each use (``original_source``), not held."""
    w = source = None
    if original is not None:
        where = getattr(original, "path", "original")
        key = original_expert_key(original, name)
        if key is None:
            raise ModelError(f"{where}: no tensor {name}.weight (nor its other names) for the quantized expert "
                             f"{name!r}")
        if hasattr(original, "store"):
            _check_shape(where, key, tuple(original.store.info(key).shape), tuple(layer.shape))
            source = partial(_read_original, original, key, None)
        else:
            w = original_expert_weight(original, name)
            _check_shape(where, key, tuple(w.shape), tuple(layer.shape))
    new = Fp8ExpertLinear(layer, "reference", accumulate=accumulate, backend=backend, original_weight=w,
                          keep_decoded=keep_decoded, original_source=source)
    new.mode = mode
    return new


def _original(original, name: str, shape: tuple[int, int]):
    """(weight, bias, None) from a mapping, or (None, None, reader) for a Checkpoint (its tensors
    checked now by their headers, read on each use); all None without ``original``."""
    if original is None:
        return None, None, None
    where = getattr(original, "path", "original")
    if hasattr(original, "store"):  # a Checkpoint
        key = f"{name}.weight"
        if key not in original.store:
            raise ModelError(f"{where}: no tensor {key} for the quantized layer {name!r}")
        _check_shape(where, key, tuple(original.store.info(key).shape), shape)
        bias = f"{name}.bias" if f"{name}.bias" in original.store else None
        return None, None, partial(_read_original, original, key, bias)

    def get(key):
        v = original.get(key)
        return None if v is None else (v if isinstance(v, torch.Tensor) else torch_of(np.asarray(v)))

    w = get(f"{name}.weight")
    if w is None:
        raise ModelError(f"{where}: no tensor {name}.weight for the quantized layer {name!r}")
    _check_shape(where, f"{name}.weight", tuple(w.shape), shape)
    return w, get(f"{name}.bias"), None


def _check_shape(where, key: str, got: tuple, shape: tuple) -> None:
    if got != shape:
        raise ModelError(f"{where}: {key} is {list(got)}, the checkpoint's weight {list(shape)}")


def _read_original(ckpt, key: str, bias: str | None):
    return torch_of(ckpt.tensor(key)), None if bias is None else torch_of(ckpt.tensor(bias))
