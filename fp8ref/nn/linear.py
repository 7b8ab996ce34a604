"""``Fp8RefLinear``: a checkpoint layer as a torch ``nn.Module``; ``set_mode`` switches every fp8ref
module of a model (``fp8ref.nn.swap`` puts them in place by name)."""

from __future__ import annotations

import torch

from .._arrays import check_torch, dtype_name, numpy_of, torch_of
from ..checkpoint.loader import QuantizedLayer
from ..errors import InputTypeError, ModelError
from ..matmul import DecodedCodes
from .modes import Mode, backend_forward, cannot_run, parse_mode


class Fp8RefLinear(torch.nn.Module):
    """``y = layer(x)`` for a ``QuantizedLayer`` in one of the modes of ``fp8ref.nn.modes``.

    accumulate: the accumulation of plain ``mode="reference"``. backend: the backend object of a
    ``backend:NAME`` mode, or a mapping name -> backend for several. original_weight /
    original_bias: the unquantized tensors (torch) that ``mode="original"`` multiplies by, or
    original_source: a function returning (weight, bias), called on each use (the tensors are read
    from the original checkpoint when needed, not held). The module holds no parameters: its
    tensors are the checkpoint's, read on each use.

    The exact reference (accumulate "exact") reads the weight's codes on its first forward and
    holds them (1 byte per element: the checkpoint's bytes, read and checked once).
    keep_decoded: it also keeps the weight's float64 form (times the block scales, with their
    block norms, for block-scaled weights: ``fp8ref.matmul.DecodedCodes``) between calls: 8 bytes
    more per weight element for the module's lifetime (a 4096 x 4096 layer: 128 MiB). The default
    (False) keeps no float64: a call with a few rows (M <= 8: a decode step) looks each code up as
    it reads it, a larger one decodes the weight into a reused workspace, which costs little
    beside its GEMM; ``release_decoded()`` drops what is held.
    """

    def __init__(self, layer, mode="reference", *, accumulate: str = "exact", backend=None,
                 original_weight=None, original_bias=None, keep_decoded: bool = False, original_source=None):
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
        self.original_source = original_source
        self.last_backend_params: dict | None = None
        self.keep_decoded = keep_decoded
        self._decoded = None
        self.mode = mode

    def decoded_weight(self):
        """The weight's ``DecodedCodes`` record, made on first use: the codes read (and checked)
        once and held (1 byte per element: the checkpoint's own bytes), with their float64 form
        too when keep_decoded."""
        if self._decoded is None:
            self._decoded = DecodedCodes(self.layer.weight_codes, self.layer.quant.weight_fmt, keep=self.keep_decoded)
        return self._decoded

    def original_tensors(self):
        """(weight, bias) of mode 'original': as given, or read now from ``original_source``."""
        if self.original_source is not None:
            return self.original_source()
        return self.original_weight, self.original_bias

    def release_decoded(self) -> None:
        """Drop the held codes and decoded weight (read again on the next exact forward)."""
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
        if mode.kind == "original" and self.original_weight is None and self.original_source is None:
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
            w, b = self.original_tensors()
            return torch.nn.functional.linear(x, w.to(x.dtype), None if b is None else b.to(x.dtype))
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
