"""The ways one quantized layer can run inside a model (``--modes``).

- ``original``: the unquantized weight (from ``--original``) in the model dtype, torch's matmul.
- ``reference`` / ``reference:ACC``: what a correct W8A8 backend computes from the stored bytes
  (``QuantizedLayer.forward``), accumulation ``ACC`` (default ``exact``; any registered model of
  ``fp8ref.matmul.ACCUMULATION_MODELS``: exact, fp32, fp32-limited and the hardware kernels).
  NVFP4 / MX layers: exact, fp32 and the kernels whose instruction applies their block scales
  (``fp8ref.matmul.block_scaled``); ``cannot_run`` names the reason for any other pair.
- ``producer``: the producer's own reload arithmetic (``QuantizedLayer.forward(mode="producer")``:
  compressed-tensors, auto-round, hf-fp8, Quark; ModelOpt FP8: its in-memory quantized model).
- ``backend:NAME``: a conformance backend's ``linear`` where it declares the layer's case, else its
  ``scaled_mm`` on the reference's quantized input, so a kernel author runs a whole model through
  their kernel. NVFP4 / MX layers: its ``scaled_mm`` where it declares ``scales: block16`` /
  ``block32`` (a float32 scale per 1 x 16 / 1 x 32 block of K on both operands: a (M, KB), b (KB, N))
  with ``out_dtype: float32`` and no bias; fp8ref applies the globals (alpha) and the bias in the
  kernels' epilogue, as ``reference:ACC`` does. The backend object is passed in (the CLI
  loads it with ``fp8ref.conformance.backend.load_backend``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .._arrays import to_numpy
from ..checkpoint import base
from ..checkpoint.forward import quantize_block_input
from ..errors import Fp8RefError, ModelError
from ..matmul import ACCUMULATIONS, SCALE_ORDERS
from ..matmul import SCALE_BLOCK as BLOCK
from ..matmul import quantize_input as linear_input
from ..scheme import PRESETS

KINDS = ("original", "reference", "producer", "backend")
BLOCK_INPUTS = ("nvfp4", "mx")  # inputs quantized per block at run time (fp8ref.matmul.block_scaled)


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
    from ..matmul import ACCUMULATION_MODELS as ACCUMULATIONS

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


def cannot_run(layer, mode: Mode) -> str | None:
    """Why ``layer`` cannot run in ``mode`` (None: it can), known before any forward: an
    accumulation model without a definition for the layer's operands (``reference:ACC``), a
    weight-only NVFP4 / MX layer in a backend (no case takes 16-bit activations), ``producer`` where
    the format has no producer forward for the layer (ModelOpt NVFP4 / MXFP8)."""
    if mode.kind == "producer":
        return base.get(layer.producer).producer_refusal(layer.quant)
    q = layer.quant
    if q.weight_strategy not in BLOCK_INPUTS:
        return _fp8_refusal(layer, mode.arg) if mode.kind == "reference" else None
    if mode.kind == "reference" and mode.arg != "exact":
        from ..checkpoint.forward import block_accumulation_refusal

        why = block_accumulation_refusal(layer, mode.arg)
        return None if why is None else f"mode {mode}: {why}"
    if mode.kind == "backend" and q.input is None:
        return (f"backend {mode.arg!r} cannot run this layer ({q.describe()}): weight-only, its inputs are 16-bit "
                f"values, not codes; the scaled_mm a backend declares takes FP8/FP4 codes on both sides")
    return None


def _fp8_refusal(layer, acc: str) -> str | None:
    """Why a per-tensor / per-channel / 128-block FP8 layer has no ``acc`` model: a hardware kernel
    whose instruction takes other operands or applies its scales where the layer's cannot go."""
    from ..hardware import KERNELS

    k = KERNELS.get(acc)
    if k is None:  # exact, fp32, fp32-limited
        return None
    q, ins = layer.quant, k.ins
    where = f"mode reference:{acc}: {ins.name}"
    if k.scales == "instruction":
        return f"{where} applies {ins.scale_type} block-scale codes (NVFP4 / MX layers); this layer has float32 scales"
    if q.input is not None and (ins.a_fmt.name, ins.b_fmt.name) != (q.input_fmt, q.weight_fmt):
        return f"{where} takes {ins.a_fmt.name} x {ins.b_fmt.name}; this layer has {q.input_fmt} x {q.weight_fmt}"
    blocked = q.weight_strategy == "block" or q.input == "dynamic-group"
    k_block = q.block[1] if q.block else q.input_group
    if k.scales == "epilogue" and blocked:
        return f"{where} scales once in the epilogue; this layer's scales change every {k_block} elements of K"
    if k.scales == "promotion" and blocked and k_block != k.promote_every:
        return f"{where} promotes every {k.promote_every} elements; this layer's K-blocks are {k_block}"
    return None


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


def quantize_input(layer, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The layer's input codes and float32 scales exactly as its reference forward makes them for
    (M, K) activations in the model dtype: FP8 layers by ``fp8ref.matmul.quantize_input``
    (linear's activation rule); NVFP4 / MX layers by ``checkpoint.forward.quantize_block_input``
    (element codes, and the per-16 / per-32 block scales; NVFP4's global input scale aside)."""
    q = layer.quant
    if q.input is None:
        raise ModelError(f"{layer.name}: weight-only layer; its inputs are not quantized")
    if q.input in BLOCK_INPUTS:
        qx = quantize_block_input(layer, x)  # in the model dtype: the recipe's D steps depend on it
        return to_numpy(qx.codes), np.asarray(to_numpy(qx.scale), np.float32)
    x32 = np.asarray(x, np.float32)
    try:
        if q.input == "static":
            return linear_input(x32, input_scale=np.asarray(layer.input_scale).astype(np.float32))
        return linear_input(x32, dynamic=q.input.removeprefix("dynamic-"), block_k=q.input_group or 128)
    except Fp8RefError as exc:  # the matmul layer knows no layer names
        raise ModelError(f"{layer.name}: input quantization ({q.describe()}): {exc}") from None


# (weight strategy, input) -> the scheme of the golden ``linear`` operation a layer is a case of
_LINEAR_SCHEMES = {("channel", "static"): "FP8_STATIC", ("tensor", "static"): "FP8",
                   ("channel", "dynamic-token"): "FP8_DYNAMIC"}


def _linear_forward(layer, x2: np.ndarray, backend) -> tuple[np.ndarray, dict] | None:
    """y from ``backend.linear`` (the whole W8A8 layer: the backend quantizes the input itself)
    when the layer is a case of the golden linear operation the backend declares, else None."""
    q = layer.quant
    scheme = _LINEAR_SCHEMES.get((q.weight_strategy, q.input))
    if (scheme is None or q.weight_fmt != "float8_e4m3fn" or layer.bias is not None
            or not callable(getattr(backend, "linear", None))):
        return None
    x = x2
    for acc in ACCUMULATIONS:
        params = {"scheme": scheme, "dtype": x.dtype.name, "accumulate": acc,
                  "shape": [x.shape[0], x.shape[1], layer.shape[0]]}
        if backend.implements("linear", params) is None:
            static = q.input == "static"
            y = backend.linear(x, layer.weight_codes, np.asarray(layer.weight_scale),
                               input_scale=np.asarray(layer.input_scale).astype(np.float32) if static else None,
                               dynamic=None if static else PRESETS[scheme]["act_granularity"], accumulate=acc)
            return np.asarray(y), {"op": "linear", **params}
    return None


def _block_scales(layer, s_a: np.ndarray, M: int, K: int, N: int) -> tuple[np.ndarray, np.ndarray]:
    """The scales of a block-scaled layer in the golden scaled_mm's ``block128`` layout: a (M, KB)
    per 1x128 group, b (KB, NB) per 128x128 block (KB = ceil(K/128), NB = ceil(N/128)). A per-tensor
    or per-token input scale and a per-tensor weight scale repeat over the blocks: the same scales
    of every product, so the same result in every accumulation model."""
    q = layer.quant
    if (q.block or (BLOCK, BLOCK)) != (BLOCK, BLOCK) or (q.input == "dynamic-group" and q.input_group != BLOCK):
        raise ModelError(f"{layer.name}: weight blocks {list(q.block or [BLOCK, BLOCK])}, input groups "
                         f"{q.input_group}; a backend's block-scaled scaled_mm (scales block128) takes "
                         f"{BLOCK}x{BLOCK} weight blocks and 1x{BLOCK} input groups only")
    kb, nb = -(-K // BLOCK), -(-N // BLOCK)
    s_w = np.asarray(layer.weight_scale).astype(np.float32)
    if q.weight_strategy == "block":
        s_b = np.ascontiguousarray(s_w.reshape(nb, kb).T)
    elif s_w.size == 1:
        s_b = np.full((kb, nb), s_w.reshape(-1)[0], np.float32)
    else:
        raise ModelError(f"{layer.name}: per-channel weight scales with 1x{BLOCK} input groups have no block128 "
                         f"layout (a weight scale per 128 columns); no backend scaled_mm case covers them")
    s_a = np.asarray(s_a, np.float32)
    s_a = s_a if s_a.shape == (M, kb) else np.broadcast_to(s_a.reshape(-1, 1), (M, kb))
    return np.ascontiguousarray(s_a), s_b


def backend_forward(layer, x2: np.ndarray, backend, out_dtype: str) -> tuple[np.ndarray, dict]:
    """y (M, N) from ``backend.linear`` when it declares the layer's case of the golden linear
    operation (``x2`` in the model dtype), else ``backend.scaled_mm`` on the reference's quantized
    input and the stored weight codes: per-tensor and per-row/per-channel scales, and for
    block-scaled layers (128x128 weight blocks, 1x128 input groups) the golden scaled_mm's
    ``block128`` case. Returns y and the parameters of the operation the backend ran."""
    why = cannot_run(layer, Mode("backend", backend.name))
    if why is not None:
        raise ModelError(f"{layer.name}: {why}")
    if layer.quant.weight_strategy in BLOCK_INPUTS:
        return _block_backend_forward(layer, x2, backend, out_dtype)
    done = _linear_forward(layer, x2, backend)
    if done is not None:
        return done
    q = layer.quant
    codes, s_a = quantize_input(layer, x2)
    M, K, N = x2.shape[0], x2.shape[1], layer.shape[0]
    s_w = np.asarray(layer.weight_scale).astype(np.float32)
    if q.weight_strategy == "block" or q.input == "dynamic-group":
        scales = "block128"
        s_a, s_b = _block_scales(layer, s_a, M, K, N)
    elif s_a.size == 1 and s_w.size == 1:
        scales = "tensor"
        s_a, s_b = s_a.reshape(1), s_w.reshape(1)
    else:
        scales = "row"
        s_a = np.broadcast_to(s_a.reshape(-1, 1), (M, 1)).copy()
        s_b = np.broadcast_to(s_w.reshape(1, -1), (1, N)).copy()
    bias = layer.bias
    p = _first_implemented(layer, backend, {"format": q.weight_fmt, "scales": scales, "out_dtype": out_dtype,
                                            "bias": bias is not None})
    y = backend.scaled_mm(codes, np.ascontiguousarray(layer.weight_codes.T), s_a, s_b, bias=bias,
                          fmt=q.weight_fmt, out_dtype=out_dtype, accumulate=p["accumulate"],
                          scale_order=p["scale_order"])
    return np.asarray(y), p


def _first_implemented(layer, backend, params: dict) -> dict:
    """``params`` with the first accumulation and scale order the backend's ``scaled_mm`` implements."""
    from ..matmul import ACCUMULATIONS

    reasons = []
    for acc in ACCUMULATIONS:
        for order in SCALE_ORDERS:
            p = {**params, "accumulate": acc, "scale_order": order}
            why = backend.implements("scaled_mm", p)
            if why is None:
                return p
            reasons.append(why)
    raise ModelError(f"{layer.name}: backend {backend.name!r} cannot run this layer ({reasons[0]})")


def _block_backend_forward(layer, x2: np.ndarray, backend, out_dtype: str) -> tuple[np.ndarray, dict]:
    """An NVFP4 / MX layer through ``backend.scaled_mm``'s ``block16`` / ``block32`` case: the input
    codes and float32 block scales the reference makes, the stored weight codes (K, N) and block
    scales (KB, N), accumulated by the backend to float32; then the kernels' epilogue here (the
    globals' alpha, the bias, one rounding to the model dtype: ``fp8ref.matmul.block_scaled``)."""
    from .._arrays import deliver, to_numpy
    from ..checkpoint.forward import quantize_block_input
    from ..checkpoint.layout import BLOCK_SCALED
    from ..matmul.block_scaled import alpha_of, kernel_epilogue

    q = layer.quant
    if q.input_fmt != q.weight_fmt:
        raise ModelError(f"{layer.name}: backend {backend.name!r} cannot run this layer: input {q.input_fmt} and "
                         f"weight {q.weight_fmt}; a backend's scaled_mm takes one format")
    block = BLOCK_SCALED[q.weight_strategy][0]
    qx = quantize_block_input(layer, x2)
    codes = np.ascontiguousarray(to_numpy(qx.codes))
    s_a = np.ascontiguousarray(np.asarray(to_numpy(qx.scale), np.float32).reshape(codes.shape[0], -1))
    s_b = np.ascontiguousarray(np.asarray(layer.weight_scale, np.float32).reshape(layer.shape[0], -1).T)
    g_w = None if q.global_scale is None else float(np.asarray(layer.weight_global, np.float32).reshape(-1)[0])
    g_x = None if q.input != "nvfp4" else float(np.asarray(to_numpy(qx.global_scale), np.float32).reshape(-1)[0])
    p = _first_implemented(layer, backend, {"format": q.weight_fmt, "scales": f"block{block}",
                                            "out_dtype": "float32", "bias": False})
    acc32 = np.asarray(backend.scaled_mm(codes, np.ascontiguousarray(layer.weight_codes.T), s_a, s_b, bias=None,
                                         fmt=q.weight_fmt, out_dtype="float32", accumulate=p["accumulate"],
                                         scale_order=p["scale_order"]), np.float32)
    if acc32.shape != (codes.shape[0], layer.shape[0]):
        raise ModelError(f"{layer.name}: backend {backend.name!r} scaled_mm returned shape "
                         f"{list(acc32.shape)}, expected {[codes.shape[0], layer.shape[0]]}")
    bias = None if layer.bias is None else np.asarray(layer.bias).astype(np.float32)
    y = kernel_epilogue(acc32, alpha_of(g_w, g_x, q.global_scale), bias, out_dtype)
    return deliver(y, out_dtype, False), {**p, "epilogue": "fp8ref"}
