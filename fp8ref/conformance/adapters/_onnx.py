"""Single-node ONNX graphs (built in memory with ``onnx.helper``) shared by the onnxruntime and
onnx-reference adapters: ``Cast`` to and from the float8 / E8M0 / FP4 element types.

Opset 25 (the highest onnxruntime 1.32's CPU provider implements; onnx 1.23.2 defines 28): its
``Cast`` has ``saturate`` (float8 outputs) and ``round_mode`` (E8M0 outputs only: ``up``, ``down``,
``nearest`` = ties up). ONNX's float8 rounding is round-to-nearest-even only.
"""

from __future__ import annotations

import math

OPSET = 25
IR_VERSION = 11  # the IR version of opset 25 (onnx 1.18+)

# fp8ref format -> onnx.TensorProto element type name
ELEMENT_TYPES = {"float8_e4m3fn": "FLOAT8E4M3FN", "float8_e5m2": "FLOAT8E5M2",
                 "float8_e4m3fnuz": "FLOAT8E4M3FNUZ", "float8_e5m2fnuz": "FLOAT8E5M2FNUZ",
                 "float8_e8m0fnu": "FLOAT8E8M0", "float4_e2m1fn": "FLOAT4E2M1"}
INPUT_TYPES = {"float32": "FLOAT", "float64": "DOUBLE", "float16": "FLOAT16", "bfloat16": "BFLOAT16"}
# fp8ref rounding mode -> Cast round_mode for E8M0 (an unsigned format: ties up = ties away = rna;
# "down" = toward zero); ONNX has no ties-to-even E8M0 mode.
E8M0_ROUND_MODES = {"rup": "up", "rdown": "down", "rtz": "down", "rna": "nearest"}
FP8_FORMATS = ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")


def element_type(name: str) -> int:
    from onnx import TensorProto

    return getattr(TensorProto, name)


def cast_model(src: str, dst: str, *, saturate: bool | None = None, round_mode: str | None = None):
    """An opset-25 model ``y = Cast(x, to=dst)``: x of type ``src``, 1-D, both element type names."""
    from onnx import helper

    attrs = {"to": element_type(dst)}
    if saturate is not None:
        attrs["saturate"] = int(saturate)
    if round_mode is not None:
        attrs["round_mode"] = round_mode
    node = helper.make_node("Cast", ["x"], ["y"], **attrs)
    graph = helper.make_graph([node], "fp8ref_cast", [helper.make_tensor_value_info("x", element_type(src), [None])],
                              [helper.make_tensor_value_info("y", element_type(dst), [None])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR_VERSION)


def encode_model(x_dtype: str, fmt: str, rounding: str, saturate: bool):
    """Cast from the input dtype to ``fmt``: saturate for the float8 formats, round_mode (and
    saturate) for E8M0, plain for FP4 (no saturate attribute: FP4 has no Inf or NaN)."""
    dst = ELEMENT_TYPES[fmt]
    if fmt == "float8_e8m0fnu":
        return cast_model(INPUT_TYPES[x_dtype], dst, saturate=saturate, round_mode=E8M0_ROUND_MODES[rounding])
    return cast_model(INPUT_TYPES[x_dtype], dst, saturate=saturate if fmt in FP8_FORMATS else None)


def decode_model(fmt: str):
    return cast_model(ELEMENT_TYPES[fmt], "FLOAT")


# DequantizeLinear: the schemes whose scale ONNX can take as is (float32, per tensor, per row of the
# weight = axis 0, or blocked along the last axis: groups, MX blocks, 2-D blocks with the scale repeated)
DEQUANTIZE_SCHEMES = ("FP8", "FP8_STATIC", "FP8_DYNAMIC", "FP8_BLOCK", "MXFP8", "MXFP4")
# QuantizeLinear with a float32 y_scale: the granularities ONNX expresses (per tensor, per axis, blocked
# along one axis; fp8ref's 2-D blocks as blocks along axis 1 with the scale repeated over the rows)
QUANTIZE_GRANULARITIES = ("tensor", "channel", "token", "group", "block")


def scale_input(scale, shape, qa):
    """fp8ref's scale for 2-D ``shape`` as ONNX's ``y_scale`` / ``x_scale`` input, with the node's
    attributes: per tensor a 1-element vector; per row (channel, token) a vector along axis 0; per
    group, per MX block or per 2-D block a blocked scale along axis 1 (``block_size`` the group's
    width; a 2-D block's scale repeated over its rows, which ONNX's blocked layout then holds as is)."""
    import numpy as np

    n, k = shape
    scale = np.asarray(scale, np.float32)
    if qa.granularity == "tensor":
        return scale.reshape(1), {}
    if qa.granularity in ("channel", "token"):
        return scale.reshape(n), {"axis": 0}
    if qa.granularity == "block":
        bh, bw = qa.block_shape
        return np.repeat(scale.reshape(-(-n // bh), -(-k // bw)), bh, axis=0)[:n], {"axis": 1, "block_size": bw}
    width = {"group": qa.group_size, "mx": 32, "nvfp4": 16}[qa.granularity]
    return scale.reshape(n, -(-k // width)), {"axis": 1, "block_size": width}


def _model(node, inputs, output, initializers=()):
    from onnx import helper

    graph = helper.make_graph([node], f"fp8ref_{node.op_type.lower()}", inputs, [output],
                              initializer=list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR_VERSION)


def quantize_model(x_dtype: str, fmt: str, shape, scale_shape, attrs: dict, saturate: bool):
    """``y = QuantizeLinear(x: x_dtype, y_scale: float32, y_zero_point: fmt 0)`` at opset 25, 2-D x of
    ``shape``; the zero point (an initializer of ``scale_shape``, every code 0x00 = +0) gives the output
    type, as in exported QDQ models; ``saturate`` for the float8 outputs (no effect on FP4)."""
    from onnx import helper

    size = math.prod(scale_shape)
    nbytes = (size + 1) // 2 if fmt == "float4_e2m1fn" else size
    zero = helper.make_tensor("zero", element_type(ELEMENT_TYPES[fmt]), list(scale_shape), vals=bytes(nbytes),
                              raw=True)
    if fmt in FP8_FORMATS:
        attrs = {**attrs, "saturate": int(saturate)}
    node = helper.make_node("QuantizeLinear", ["x", "scale", "zero"], ["y"], **attrs)
    return _model(node, [helper.make_tensor_value_info("x", element_type(INPUT_TYPES[x_dtype]), list(shape)),
                         helper.make_tensor_value_info("scale", element_type("FLOAT"), list(scale_shape))],
                  helper.make_tensor_value_info("y", element_type(ELEMENT_TYPES[fmt]), list(shape)), [zero])


def dequantize_model(fmt: str, shape, scale_shape, attrs: dict):
    """``y = DequantizeLinear(x: fmt, x_scale: float32) -> float32`` at opset 25 (recipe fp8ref
    and onnx dequantize to float32 whatever the model dtype) for 2-D codes ``shape``; ``scale_shape``
    and ``attrs`` from ``scale_input``."""
    from onnx import helper

    node = helper.make_node("DequantizeLinear", ["x", "scale"], ["y"], **attrs)
    return _model(node, [helper.make_tensor_value_info("x", element_type(ELEMENT_TYPES[fmt]), list(shape)),
                         helper.make_tensor_value_info("scale", element_type("FLOAT"), list(scale_shape))],
                  helper.make_tensor_value_info("y", element_type("FLOAT"), list(shape)))


def layout_reason(op: str, qa, params) -> str | None:
    """None when the adapters can express the case as one QuantizeLinear / DequantizeLinear node with
    a float32 scale; else why not."""
    node = {"quantize": "QuantizeLinear", "dequantize": "DequantizeLinear"}[op]
    if len(params["shape"]) != 2:
        return f"the ONNX adapters build 2-D {node} graphs only (shape {params['shape']})"
    if qa.granularity not in QUANTIZE_GRANULARITIES + (("mx",) if op == "dequantize" else ()):
        return f"ONNX {node} with a float32 scale has no {qa.granularity!r} layout here"
    return None
