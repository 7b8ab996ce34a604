"""``Fp8RefLinear``: a checkpoint layer as a torch ``nn.Module``, and ``swap_linears``, which puts
one in place of every quantized ``nn.Linear`` of a model by name."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from .._arrays import check_torch, dtype_name, numpy_of, torch_of
from ..errors import InputTypeError, ModelError
from .modes import Mode, backend_forward, cannot_run, parse_mode


class Fp8RefLinear(torch.nn.Module):
    """``y = layer(x)`` for a ``QuantizedLayer`` in one of the modes of ``fp8ref.nn.modes``.

    accumulate: the accumulation of plain ``mode="reference"``. backend: the backend object of a
    ``backend:NAME`` mode, or a mapping name -> backend for several. original_weight /
    original_bias: the unquantized tensors (torch) that ``mode="original"`` multiplies by.
    The module holds no parameters: its tensors are the checkpoint's, read on first use.

    keep_decoded: the exact reference (accumulate "exact") decodes the weight to float64 on its
    first forward (times the weight's block scales, with their block norms, for block-scaled
    weights) and reuses that form on every later call (``fp8ref.matmul.DecodedCodes``). Memory:
    8 bytes per weight element, plus 1 byte for a private copy of the codes, per layer, for the
    module's lifetime (a 4096 x 4096 layer: 144 MiB). ``keep_decoded=False`` decodes on every call
    instead (big models); ``release_decoded()`` drops what is kept.
    """

    def __init__(self, layer, mode="reference", *, accumulate: str = "exact", backend=None,
                 original_weight=None, original_bias=None, keep_decoded: bool = True):
        from ..checkpoint.loader import QuantizedLayer

        if not isinstance(layer, QuantizedLayer):
            raise InputTypeError(f"layer: expected a QuantizedLayer (checkpoint[name] of fp8ref.load_checkpoint), "
                                 f"got {type(layer).__name__}")
        for what, t in (("original_weight", original_weight), ("original_bias", original_bias)):
            if t is not None:
                _check_input(t, f"{layer.name}: {what}")
        super().__init__()
        self.layer = layer
        self.name = layer.name
        self.out_features, self.in_features = (int(n) for n in layer.shape)
        self.accumulate = accumulate
        if backend is None:
            self.backends = {}
        elif isinstance(backend, dict):
            self.backends = dict(backend)
        else:
            self.backends = {backend.name: backend}
        self.original_weight = original_weight
        self.original_bias = original_bias
        self.last_backend_params: dict | None = None
        self.keep_decoded = keep_decoded
        self._decoded = None
        self.mode = mode

    def decoded_weight(self):
        """The weight's ``DecodedCodes`` record (made on first use), or None with keep_decoded=False."""
        if not self.keep_decoded:
            return None
        if self._decoded is None:
            from ..matmul import DecodedCodes

            self._decoded = DecodedCodes(self.layer.weight_codes, self.layer.quant.weight_fmt)
        return self._decoded

    def release_decoded(self) -> None:
        """Drop the kept decoded weight (it is made again on the next exact forward)."""
        self._decoded = None

    @property
    def mode(self) -> Mode:
        return self._mode

    @mode.setter
    def mode(self, value) -> None:
        self._mode = self.check_mode(value)

    def check_mode(self, value) -> Mode:
        """``value`` parsed, with what it needs present (original weight, backend object)."""
        mode = parse_mode(value, accumulate=self.accumulate)
        if mode.kind == "original" and self.original_weight is None:
            raise ModelError(f"{self.name}: mode 'original' needs the original weights (--original SRC)")
        if mode.kind == "backend" and mode.arg not in self.backends:
            raise ModelError(f"{self.name}: mode {mode} needs its backend object (backend=load_backend("
                             f"{mode.arg!r})); have {sorted(self.backends) or 'none'}")
        why = cannot_run(self.layer, mode)
        if why is not None:
            raise ModelError(f"{self.name}: {why}")
        return mode

    def extra_repr(self) -> str:
        return f"{self.name!r}, in_features={self.in_features}, out_features={self.out_features}, mode={self.mode}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.run(x, self._mode)

    @torch.no_grad()
    def run(self, x: torch.Tensor, mode=None) -> torch.Tensor:
        """The output in ``mode`` (default: the module's), in x's dtype."""
        mode = self._mode if mode is None else self.check_mode(mode)
        _check_input(x, f"{self.name}: input")
        if x.ndim == 0 or x.shape[-1] != self.in_features:
            raise ModelError(f"{self.name}: input of shape {list(x.shape)}, expected (..., {self.in_features})")
        x = x.detach()
        if mode.kind == "original":
            w = self.original_weight.to(x.dtype)
            b = None if self.original_bias is None else self.original_bias.to(x.dtype)
            return torch.nn.functional.linear(x, w, b)
        if mode.kind == "reference":
            if mode.arg == "exact" and self.layer.quant.weight_strategy not in ("nvfp4", "mx"):
                return self.layer.forward(x.contiguous(), mode="reference", accumulate="exact",
                                          weight=self.decoded_weight())
            return self.layer.forward(x.contiguous(), mode="reference", accumulate=mode.arg)
        if mode.kind == "producer":
            return self.layer.forward(x.contiguous(), mode="producer")
        lead = x.shape[:-1]
        x2 = numpy_of(x.reshape(-1, self.in_features))  # the model dtype: a backend's linear quantizes it
        y, self.last_backend_params = backend_forward(self.layer, x2, self.backends[mode.arg], dtype_name(x))
        return torch_of(y).reshape(*lead, self.out_features)


def _check_input(x, what: str) -> None:
    """A dense float CPU tensor (a meta or sparse tensor has no values fp8ref can read)."""
    if not isinstance(x, torch.Tensor):
        raise InputTypeError(f"{what}: expected a torch tensor, got {type(x).__name__}")
    check_torch(x, what)
    if not x.dtype.is_floating_point or x.element_size() == 1:
        raise InputTypeError(f"{what}: expected a float16, bfloat16, float32 or float64 tensor, got {x.dtype}")


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
                 backend=None, original=None, keep_decoded: bool = True) -> SwapReport:
    """Replace every ``nn.Linear`` named like a quantized layer of ``checkpoint`` with an
    ``Fp8RefLinear``. original: an unquantized Checkpoint (``load_checkpoint(SRC)``) or a mapping
    tensor name -> tensor, for ``mode="original"``. Layers without a matching ``nn.Linear`` (absent,
    another module type, another shape) are reported, not raised: see ``SwapReport.raise_unplaced``.
    keep_decoded: each layer keeps its decoded weight between exact forwards (``Fp8RefLinear``:
    8 bytes per weight element); False for models whose float64 weights would not fit in memory."""
    from .experts import expert_name, place_experts

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
        w, b = _original(original, name, tuple(layer.shape))
        new = Fp8RefLinear(layer, "reference", accumulate=accumulate, backend=backend, original_weight=w,
                           original_bias=b, keep_decoded=keep_decoded)
        new.mode = mode
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, new)
        report.swapped.append(name)
    if experts:
        place_experts(model, checkpoint, experts, report,
                      lambda layer, name: _expert(layer, name, mode, accumulate, backend, original, keep_decoded))
    return report


def _expert(layer, name, mode, accumulate, backend, original, keep_decoded):
    """One ``Fp8ExpertLinear`` in ``mode``, its original weight under any of its names."""
    from .experts import Fp8ExpertLinear, original_expert_weight

    w = None
    if original is not None:
        w = original_expert_weight(original, name)
        if w is None:
            raise ModelError(f"{getattr(original, 'path', 'original')}: no tensor {name}.weight (nor its other "
                             f"names) for the quantized expert {name!r}")
        if tuple(w.shape) != tuple(layer.shape):
            raise ModelError(f"{getattr(original, 'path', 'original')}: {name}.weight is {list(w.shape)}, the "
                             f"checkpoint's weight {list(layer.shape)}")
    new = Fp8ExpertLinear(layer, "reference", accumulate=accumulate, backend=backend, original_weight=w,
                          keep_decoded=keep_decoded)
    new.mode = mode
    return new


def _original(original, name: str, shape: tuple[int, int]):
    if original is None:
        return None, None

    def get(key):
        if hasattr(original, "store"):  # a Checkpoint
            return torch_of(original.tensor(key)) if key in original.store else None
        v = original.get(key)
        return None if v is None else (v if isinstance(v, torch.Tensor) else torch_of(np.asarray(v)))

    w = get(f"{name}.weight")
    if w is None:
        raise ModelError(f"{getattr(original, 'path', 'original')}: no tensor {name}.weight for the "
                         f"quantized layer {name!r}")
    if tuple(w.shape) != shape:
        raise ModelError(f"{getattr(original, 'path', 'original')}: {name}.weight is {list(w.shape)}, the "
                         f"checkpoint's weight {list(shape)}")
    return w, get(f"{name}.bias")


def fp8ref_layers(model: torch.nn.Module) -> dict[str, Fp8RefLinear]:
    """Name -> Fp8RefLinear of every swapped layer, in module order."""
    return {m.name: m for m in model.modules() if isinstance(m, Fp8RefLinear)}


def set_mode(model: torch.nn.Module, mode) -> None:
    """Put every Fp8RefLinear of ``model`` in ``mode`` (checked for every layer before any changes),
    and the KV-cache quantization of its attention modules (``fp8ref.nn.attention``) too."""
    layers = list(fp8ref_layers(model).values()) + [m for m in model.modules() if getattr(m, "fp8ref_experts", 0)]
    parsed = [m.check_mode(mode) for m in layers]
    for m, p in zip(layers, parsed):
        m._mode = p
    for m in model.modules():
        if hasattr(m, "fp8ref_kv"):
            m.fp8ref_kv["mode"] = parse_mode(mode)
