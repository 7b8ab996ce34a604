"""The ways one quantized layer can run inside a model (``--modes``).

- ``original``: the unquantized weight (from ``--original``) in the model dtype, torch's matmul.
- ``reference`` / ``reference:ACC``: what a correct W8A8 backend computes from the stored bytes
  (``QuantizedLayer.forward``), accumulation ``ACC`` (default ``exact``; any of
  ``fp8ref.matmul.ACCUMULATIONS``).
- ``producer``: the producer's own reload arithmetic (``QuantizedLayer.forward(mode="producer")``:
  compressed-tensors, auto-round, hf-fp8).
- ``backend:NAME``: a conformance backend's ``scaled_mm`` on the reference's quantized input, so a
  kernel author runs a whole model through their kernel. The backend object is passed in (the CLI
  loads it with ``fp8ref.conformance.backend.load_backend``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import ModelError

KINDS = ("original", "reference", "producer", "backend")


@dataclass(frozen=True)
class Mode:
    kind: str
    arg: str | None = None  # the accumulation of "reference", the backend name of "backend"

    def __str__(self) -> str:
        if self.kind == "reference" and self.arg == "exact":
            return "reference"
        return self.kind if self.arg is None else f"{self.kind}:{self.arg}"


def parse_mode(text, *, accumulate: str = "exact") -> Mode:
    """``reference``, ``reference:fp32``, ``producer``, ``original`` or ``backend:NAME``; plain
    ``reference`` takes ``accumulate``."""
    from ..matmul import ACCUMULATIONS

    if isinstance(text, Mode):
        return text
    if not isinstance(text, str):
        raise ModelError(f"mode: expected a string such as 'reference', got {text!r}")
    kind, sep, arg = text.strip().partition(":")
    if kind not in KINDS:
        raise ModelError(f"mode {text!r}: expected one of original, reference[:ACCUMULATION], producer, "
                         f"backend:NAME")
    if kind == "reference":
        arg = arg if sep else accumulate
        if arg not in ACCUMULATIONS:
            raise ModelError(f"mode {text!r}: accumulation {arg!r}; expected one of {', '.join(ACCUMULATIONS)}")
        return Mode(kind, arg)
    if kind == "backend":
        if not arg:
            raise ModelError(f"mode {text!r}: name the backend, e.g. backend:torch")
        return Mode(kind, arg)
    if sep:
        raise ModelError(f"mode {text!r}: {kind} takes no ':' argument")
    return Mode(kind)


def parse_modes(text: str) -> list[Mode]:
    """A comma-separated list of modes, each at most once."""
    modes = [parse_mode(t) for t in text.split(",") if t.strip()]
    if not modes:
        raise ModelError(f"modes: expected a comma-separated list such as 'reference,producer', got {text!r}")
    seen = set()
    for m in modes:
        if str(m) in seen:
            raise ModelError(f"modes: {m} given twice")
        seen.add(str(m))
    return modes


def quantize_input(layer, x32: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The layer's input quantization as ``fp8ref.matmul.linear`` defines it (docs/matmul.md):
    q = encode(fp32(x / s)) with the stored static scale, or s = fp32(amax / 448) (1 where amax is
    0) per tensor, per row or per 1 x group. x32: (M, K) float32. Returns (codes, scale (M|1, G|1))."""
    from ..codec import encode
    from ..formats import FORMATS

    q = layer.quant
    fmt = FORMATS["float8_e4m3fn"]
    M, K = x32.shape
    if q.input is None:
        raise ModelError(f"{layer.name}: weight-only layer; its inputs are not quantized")
    if q.input == "static":
        s = np.asarray(layer.input_scale).astype(np.float32).reshape(1, 1)
    else:
        a = np.abs(x32).astype(np.float64)
        if q.input == "dynamic-tensor":
            amax = np.asarray(a.max() if a.size else 0.0).reshape(1, 1)
        elif q.input == "dynamic-token":
            amax = a.max(axis=1, keepdims=True) if a.size else np.zeros((M, 1))
        else:
            g = q.input_group
            padded = np.concatenate([a, np.zeros((M, -K % g))], axis=1)
            amax = padded.reshape(M, -1, g).max(axis=2)
        s = (amax.astype(np.float32) / np.float32(fmt.max)).astype(np.float32)
        s = np.where(amax == 0, np.float32(1.0), s).astype(np.float32)
    cols = s if s.shape[1] == 1 else np.repeat(s, q.input_group, axis=1)[:, :K]
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        return encode((x32 / cols).astype(np.float32), fmt), s


def backend_forward(layer, x2: np.ndarray, backend, out_dtype: str) -> tuple[np.ndarray, dict]:
    """y (M, N) from ``backend.scaled_mm`` on the reference's quantized input and the stored weight
    codes; per-tensor and per-row/per-channel scales (block scales need a block scaled_mm, which no
    backend declares today). Returns y and the scaled_mm parameters the backend ran with."""
    from ..matmul import ACCUMULATIONS, SCALE_ORDERS

    q = layer.quant
    if q.weight_strategy == "block" or q.input == "dynamic-group":
        raise ModelError(f"{layer.name}: block-scaled layer; backend {backend.name!r} would need a block-scaled "
                         f"scaled_mm, which the conformance operations do not define yet")
    codes, s_a = quantize_input(layer, x2.astype(np.float32))
    M, N = x2.shape[0], layer.shape[0]
    s_w = np.asarray(layer.weight_scale).astype(np.float32)
    tensor = s_a.size == 1 and s_w.size == 1
    if tensor:
        s_a, s_b = s_a.reshape(1), s_w.reshape(1)
    else:
        s_a = np.broadcast_to(s_a.reshape(-1, 1), (M, 1)).copy()
        s_b = np.broadcast_to(s_w.reshape(1, -1), (1, N)).copy()
    bias = layer.bias
    params = {"format": q.weight_fmt, "scales": "tensor" if tensor else "row", "out_dtype": out_dtype,
              "bias": bias is not None}
    reasons = []
    for acc in ACCUMULATIONS:
        for order in SCALE_ORDERS:
            p = {**params, "accumulate": acc, "scale_order": order}
            why = backend.implements("scaled_mm", p)
            if why is None:
                y = backend.scaled_mm(codes, np.ascontiguousarray(layer.weight_codes.T), s_a, s_b, bias=bias,
                                      fmt=q.weight_fmt, out_dtype=out_dtype, accumulate=acc, scale_order=order)
                return np.asarray(y), p
            reasons.append(why)
    raise ModelError(f"{layer.name}: backend {backend.name!r} cannot run this layer ({reasons[0]})")
