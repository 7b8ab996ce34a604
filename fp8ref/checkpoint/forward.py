"""A checkpoint layer's forward pass, two ways.

``mode="reference"`` (default): what a correct W8A8 backend computes from the stored bytes:
the input quantized to float8_e4m3fn with the stored ``input_scale`` (static) or a scale
computed from ``x`` (dynamic: per tensor, per token or per 1 x group), then
``fp8ref.matmul.linear`` (scaled_mm with declared accumulation) on the stored codes and scales.

``mode="producer"``: what the producer's own loader computes when it reloads the checkpoint
(reference §4.1 step 6/7, §4.2 "checkpoint inference", §6.2): weights dequantized to the model
dtype D, inputs fake-quantized with the producer's D arithmetic, then the D matmul of torch
(``torch.nn.functional.linear``, the op those loaders call; this mode needs torch). ModelOpt has
no loader: its producer forward is its in-memory quantized model holding the dequantized export
(``fp8ref.checkpoint.modelopt.emulate``).
"""

from __future__ import annotations

import numpy as np

from .._arrays import deliver, float64_values, float_input, is_torch, to_numpy
from ..codec import decode, encode
from ..errors import CheckpointError, Fp8RefError
from ..formats import FORMATS
from ..matmul import linear
from ..matmul.global_scaled import global_scaled_linear
from ..quant import QuantArgs, quantize
from ..rounding import eps_of, round_to
from . import base

MODES = ("reference", "producer")


def layer_forward(layer, x, *, mode: str = "reference", out_dtype=None, accumulate: str = "exact",
                  weight=None, **mm_options):
    """y = layer(x) for a ``QuantizedLayer``; numpy in -> numpy out, torch in -> torch out.
    weight: the layer's weight codes as a ``fp8ref.matmul.DecodedCodes`` record (what the exact
    model derives from them is then kept between calls); None: the stored codes."""
    if mode not in MODES:
        raise CheckpointError(f"mode: {mode!r}; expected one of {MODES}")
    if mode == "producer":
        return _producer_forward(layer, x)
    if layer.quant.weight_strategy in ("nvfp4", "mx"):
        if mm_options:
            raise CheckpointError(f"{layer.name}: {layer.quant.weight_strategy} layers take no scaled_mm options, "
                                  f"got {sorted(mm_options)}")
        if accumulate != "exact":
            return _block_scaled_accumulated(layer, x, out_dtype, accumulate)
        return _block_scaled_forward(layer, x, out_dtype)

    q = layer.quant
    block_n, block_k = q.block if q.block else (128, q.input_group or 128)
    if q.input == "dynamic-group" and q.input_group != block_k:
        raise CheckpointError(f"{layer.name}: input groups of {q.input_group} with weight blocks {q.block}: "
                              f"scaled_mm needs the input group to equal the block's column count")
    if q.input is None:
        raise CheckpointError(f"{layer.name}: weight-only layer; a W8A8 forward needs quantized inputs")
    static = q.input == "static"
    if weight is not None and weight.codes.shape != tuple(layer.shape):
        raise CheckpointError(f"{layer.name}: weight codes of shape {list(weight.codes.shape)}, the layer's "
                              f"{list(layer.shape)}")
    # the layer's scales, bias and input recipe: read once per record (a decode step calls every layer
    # once per token: re-reading them from the file was a fixed cost of every call), else per call
    parts = _linear_parts(layer) if weight is None else weight.noted("layer_parts", lambda: _linear_parts(layer))
    weight_scale, input_scale, bias, recipe = parts
    if recipe is not None:
        mm_options = {"input_recipe": recipe, **mm_options}
    return linear(x, layer.weight_codes if weight is None else weight, weight_scale, input_scale=input_scale,
                  dynamic=None if static else q.input.removeprefix("dynamic-"),
                  bias=bias, fmt=q.weight_fmt, out_dtype=out_dtype, block_k=block_k, block_n=block_n,
                  accumulate=accumulate, **mm_options)


def _linear_parts(layer) -> tuple:
    """(float32 weight scale, float32 input scale or None, bias, input recipe or None) of an FP8 layer's
    reference forward, read from the checkpoint (read-only arrays)."""
    static = layer.quant.input == "static"
    recipe = None if static else base.get(layer.producer).input_recipe(layer.entry)
    parts = (np.asarray(layer.weight_scale).astype(np.float32),
             np.asarray(layer.input_scale).astype(np.float32) if static else None, layer.bias)
    for a in parts:
        if isinstance(a, np.ndarray):
            a.setflags(write=False)
    return (*parts, recipe)


def quantize_block_input(layer, x):
    """The NVFP4 / MX input of ``layer`` as its reference quantizes it (``fp8ref.quant.QuantResult``,
    in x's library): per 16 (NVFP4, under the stored global input scale) or per 32 (MX) elements of
    the last axis, with the block-scale rule of the layer's producer recipe, the scales a backend
    computes at run time. One function for every caller (the reference forward, ``compare``'s code
    counts, an expert of a MoE layer), so they all quantize the same way; errors name the layer."""
    q = layer.quant
    if q.input not in ("nvfp4", "mx"):
        raise CheckpointError(f"{layer.name}: input {q.input or 'not quantized'}; NVFP4 / MX layers only")
    if x.shape[-1] != layer.shape[1]:
        raise CheckpointError(f"{layer.name}: x has {x.shape[-1]} features, the weight {layer.shape[1]}")
    from . import base

    given = {"scale": np.asarray(layer.input_scale, np.float32)} if q.input == "nvfp4" else {}
    recipe = base.get(layer.producer).block_input_recipe(q)
    try:
        return quantize(x, QuantArgs(format=q.input_fmt, granularity=q.input), recipe=recipe, **given)
    except Fp8RefError as exc:
        raise type(exc)(f"{layer.name}: input: {exc}") from None


def _block_input_shape(layer, x, out_dtype) -> tuple[str, tuple, int]:
    """(output dtype, leading shape, K) of x for an nvfp4 / mx layer; x's K checked against the weight's."""
    arr, dtype, _ = float_input(x, "x")
    out = out_dtype or (dtype if dtype in ("bfloat16", "float16", "float32") else "float32")
    lead, k = arr.shape[:-1], arr.shape[-1]
    if k != layer.shape[1]:
        raise CheckpointError(f"{layer.name}: x has {k} features, the weight {layer.shape[1]}")
    return out, lead, k


def _block_scaled_forward(layer, x, out_dtype):
    """nvfp4 / mx reference: the input quantized by ``quantize_block_input``, then the exact sum
    of the exact products, times the global multipliers or divided by the global divisors,
    rounded once (``fp8ref.matmul.global_scaled``: ``block_scaled_linear`` from the element values
    and block scales kept apart). Weight-only layers take x as it is (``global_scaled_linear``)."""
    from ..codec import decode

    q = layer.quant
    out, lead, k = _block_input_shape(layer, x, out_dtype)
    g = 1.0 if q.global_scale is None else float(np.asarray(layer.weight_global, np.float32).reshape(-1)[0])
    bias = None if layer.bias is None else np.asarray(layer.bias).astype(np.float64)
    if q.input == "dynamic-group":  # MX weights, FP8 inputs per 1 x group (compressed-tensors 0.20 MXFP4XFP8)
        from ..matmul.api import quantize_input
        from ..scaling import expand

        x2 = float64_values(x, "x", ("bfloat16", "float16", "float32", "float64")).reshape(-1, k).astype(np.float32)
        codes, s = quantize_input(x2, dynamic="group", block_k=q.input_group)
        xv = decode(codes, "float8_e4m3fn").astype(np.float64) * expand(
            np.asarray(s, np.float64), codes.shape, "group", group_size=q.input_group)
        wv = decode(layer.weight_codes, q.weight_fmt).astype(np.float64) * layer.expanded_scale()
        y = global_scaled_linear(xv, wv, g, q.global_scale or "multiplier", bias=bias, out_dtype=out)
        return deliver(y.reshape(*lead, layer.shape[0]), out, is_torch(x))
    if q.input is not None:  # W4A4 / W8A8: block sums of element products, then the scales (same bits, faster)
        from ..checkpoint.layout import BLOCK_SCALED
        from ..formats import FORMATS
        from ..matmul.global_scaled import block_scaled_linear

        qx = quantize_block_input(layer, x)
        codes = to_numpy(qx.codes).reshape(-1, k)
        sx = np.asarray(to_numpy(qx.scale), np.float64).reshape(codes.shape[0], -1)
        if q.input == "nvfp4":
            g *= float(np.asarray(to_numpy(qx.global_scale), np.float32).reshape(-1)[0])  # exact: two float32
        sw = np.asarray(layer.weight_scale, np.float64).reshape(layer.shape[0], -1)
        y = block_scaled_linear(decode(codes, q.input_fmt), sx, decode(layer.weight_codes, q.weight_fmt), sw,
                                BLOCK_SCALED[q.weight_strategy][0], FORMATS[q.input_fmt], FORMATS[q.weight_fmt], g,
                                q.global_scale or "multiplier", bias=bias, out_dtype=out)
        return deliver(y.reshape(*lead, layer.shape[0]), out, is_torch(x))
    wv = decode(layer.weight_codes, q.weight_fmt).astype(np.float64) * layer.expanded_scale()
    xv = float64_values(x, "x", ("bfloat16", "float16", "float32", "float64")).reshape(-1, k)  # weight-only
    y = global_scaled_linear(xv, wv, g, q.global_scale or "multiplier", bias=bias, out_dtype=out)
    return deliver(y.reshape(*lead, layer.shape[0]), out, is_torch(x))


def block_accumulation_refusal(layer, accumulate: str) -> str | None:
    """Why an NVFP4 / MX layer has no ``accumulate`` model (``fp8ref.matmul.block_scaled.refusal``)."""
    from ..checkpoint.layout import BLOCK_SCALED
    from ..matmul.block_scaled import refusal

    q = layer.quant
    if q.input == "dynamic-group":
        return (f"accumulate={accumulate!r}: MX weights with FP8 group inputs (compressed-tensors' MXFP4XFP8) "
                "have the exact reference only")
    block, _, scale_fmt = BLOCK_SCALED[q.weight_strategy]
    return refusal(accumulate, fmt_a=q.input_fmt if q.input else None, fmt_b=q.weight_fmt, scale_fmt=scale_fmt,
                   block=block)


def _block_scaled_accumulated(layer, x, out_dtype, accumulate: str):
    """nvfp4 / mx under an accumulation model other than exact (``fp8ref.matmul.block_scaled``): the
    input quantized as ``quantize_block_input`` does, the stored codes and block-scale codes, the
    globals folded into the kernel's float32 alpha (``alpha_of``); rounded by the kernel epilogue."""
    from ..codec import decode, encode
    from ..matmul.block_scaled import alpha_of, block_scaled_mm, values_mm
    from .layout import BLOCK_SCALED

    why = block_accumulation_refusal(layer, accumulate)
    if why is not None:
        raise CheckpointError(f"{layer.name}: {why}")
    q = layer.quant
    out, lead, k = _block_input_shape(layer, x, out_dtype)
    block, _, scale_fmt = BLOCK_SCALED[q.weight_strategy]
    g_w = None if q.global_scale is None else float(np.asarray(layer.weight_global, np.float32).reshape(-1)[0])
    bias = None if layer.bias is None else np.asarray(layer.bias).astype(np.float32)
    if q.input is None:  # weight-only: x as it is, times each weight element x its block scale (exact in fp32)
        xv = float64_values(x, "x", ("bfloat16", "float16", "float32", "float64")).reshape(-1, k)
        w = decode(layer.weight_codes, q.weight_fmt) * np.asarray(layer.expanded_scale(), np.float32)
        y = values_mm(xv.astype(np.float32), w, alpha=alpha_of(g_w, None, q.global_scale), bias=bias,
                      out_dtype=out)
    else:
        qx = quantize_block_input(layer, x)
        codes = to_numpy(qx.codes).reshape(-1, k)
        sx = np.asarray(to_numpy(qx.scale), np.float32).reshape(codes.shape[0], -1)
        g_x = None if q.input != "nvfp4" else float(np.asarray(to_numpy(qx.global_scale), np.float32).reshape(-1)[0])
        sw = np.asarray(layer.weight_scale, np.float32).reshape(layer.shape[0], -1)  # checked: no NaN (0xFF)
        y = block_scaled_mm(codes, np.ascontiguousarray(layer.weight_codes.T), encode(sx, scale_fmt),
                            np.ascontiguousarray(encode(sw, scale_fmt).T),
                            fmt_a=q.input_fmt, fmt_b=q.weight_fmt, scale_fmt=scale_fmt, block=block,
                            accumulate=accumulate, alpha=alpha_of(g_w, g_x, q.global_scale), bias=bias,
                            out_dtype=out)
    return deliver(y.reshape(*lead, layer.shape[0]), out, is_torch(x))


# --- producer emulation -----------------------------------------------------------------------

def _round(v: np.ndarray, dtype: str) -> np.ndarray:
    """A torch CPU op in ``dtype`` on float32 data: computed in float32, rounded once to dtype."""
    return round_to(np.asarray(v, np.float32), dtype).astype(np.float32)


def qdq(x32: np.ndarray, s32: np.ndarray, dtype: str, *, d_division: bool, positive_zero: bool) -> np.ndarray:
    """Fake-quantize: q = e4m3(clamp(x / s)) with the division rounded to D (compressed-tensors,
    auto-round's loader) or kept in fp32; then D(decode(q) * s)."""
    fmt = FORMATS["float8_e4m3fn"]
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        y = x32 / s32
    if d_division:
        y = _round(y, dtype)
    y = np.clip(y, -fmt.max, fmt.max).astype(np.float32)
    if positive_zero:
        y = y + np.float32(0.0)
    codes = encode(y, fmt)
    return _round(decode(codes, fmt) * s32, dtype)


def dynamic_scale(x32: np.ndarray, mode: str, group: int | None, dtype: str) -> np.ndarray:
    """compressed-tensors' dynamic input scale: D(amax / 448), eps(D) where that is 0."""
    a = np.abs(x32)
    if mode == "dynamic-tensor":
        amax = a.max(keepdims=True) if a.size else np.zeros((1,) * a.ndim, np.float32)
    elif mode == "dynamic-token":
        amax = a.max(axis=-1, keepdims=True)
    else:
        k = a.shape[-1]
        pad = -k % group
        padded = np.concatenate([a, np.zeros(a.shape[:-1] + (pad,), a.dtype)], axis=-1)
        amax = padded.reshape(a.shape[:-1] + (-1, group)).max(axis=-1)
        amax = np.repeat(amax, group, axis=-1)[..., :k]
    s = _round(amax.astype(np.float32) / np.float32(448.0), dtype)
    return np.where(s == 0, np.float32(eps_of(dtype)), s).astype(np.float32)


def producer_weight(layer, dtype: str) -> np.ndarray:
    """The producer-side dequantization step, named because it rounds twice: decode(q) * s as a
    float32 product (what the transformers / compressed-tensors / auto-round loaders compute),
    then rounded to the model dtype D. ``QuantizedLayer.dequantize`` rounds the exact product once."""
    s_w = fp32_weight_scale(layer)
    return _round(decode(layer.weight_codes, layer.quant.weight_fmt) * s_w, dtype)  # D(fp32(q * s))


def fp32_weight_scale(layer) -> np.ndarray:
    """The weight scale a producer's loader multiplies by, float32 [out, in]: the stored scale, or
    for nvfp4 fp32(s_b / g) (a divisor global) or fp32(s_b * m) (a multiplier), rounded once."""
    s = np.asarray(layer.expanded_scale(), np.float32)
    q = layer.quant
    if q.global_scale is not None:
        g = np.float32(np.asarray(layer.weight_global, np.float32).reshape(-1)[0])
        s = (s / g if q.global_scale == "divisor" else s * g).astype(np.float32)
    return s


def _producer_forward(layer, x):
    import torch


    fmt = base.get(layer.producer)
    why = fmt.producer_refusal(layer.quant)
    if why is not None:
        raise CheckpointError(f"{layer.name}: {why}")
    emulate = fmt.emulate
    if not isinstance(x, torch.Tensor):
        raise CheckpointError(f"{layer.name}: mode='producer' takes a torch tensor in the model dtype")
    dtype = str(x.dtype).removeprefix("torch.")
    if dtype not in ("bfloat16", "float16", "float32"):
        raise CheckpointError(f"{layer.name}: x dtype {dtype}; expected bfloat16, float16 or float32")
    w, x32 = emulate(layer, producer_weight(layer, dtype), x.detach().to(torch.float32).numpy(), dtype)
    tdtype = getattr(torch, dtype)
    xt = torch.from_numpy(np.ascontiguousarray(x32)).to(tdtype)
    wt = torch.from_numpy(np.ascontiguousarray(w)).to(tdtype)
    bias = layer.bias
    bt = None if bias is None else torch.from_numpy(np.asarray(bias).astype(np.float32)).to(tdtype)
    with torch.no_grad():
        y = torch.nn.functional.linear(xt, wt, bt)
    post = base.get(layer.producer).emulate_output
    if post is None:
        return y
    return torch.from_numpy(np.ascontiguousarray(post(layer, y.to(torch.float32).numpy(), dtype))).to(tdtype)
