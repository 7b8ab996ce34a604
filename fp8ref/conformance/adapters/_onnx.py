"""Single-node ONNX graphs (built in memory with ``onnx.helper``) shared by the onnxruntime and
onnx-reference adapters: ``Cast`` to and from the float8 / E8M0 / FP4 element types.

Opset 25 (the highest onnxruntime 1.32's CPU provider implements; onnx 1.23.2 defines 28): its
``Cast`` has ``saturate`` (float8 outputs) and ``round_mode`` (E8M0 outputs only: ``up``, ``down``,
``nearest`` = ties up). ONNX's float8 rounding is round-to-nearest-even only.
"""

from __future__ import annotations

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
# weight = axis 0, or per block of 32 along the last axis = blocked with block_size 32)
DEQUANTIZE_SCHEMES = ("FP8", "FP8_STATIC", "FP8_DYNAMIC", "MXFP8", "MXFP4")


def dequantize_model(fmt: str, shape, scale_shape):
    """An opset-25 model ``y = DequantizeLinear(x: fmt, scale: float32) -> float32`` (recipe fp8ref
    dequantizes to float32 whatever the model dtype) for 2-D codes ``shape`` and the case's
    ``scale_shape``: (1,) per tensor, (N, 1) per row (axis 0, scale fed 1-D), (N, ceil(K / B)) per
    block of B along axis 1 (block_size B). Returns the model and the shape the scale is fed in."""
    from onnx import helper

    n, k = shape
    attrs = {}
    if tuple(scale_shape) == (1,):
        fed = [1]
    elif tuple(scale_shape) == (n, 1):
        fed, attrs["axis"] = [n], 0
    else:
        fed, attrs["axis"], attrs["block_size"] = list(scale_shape), 1, -(-k // scale_shape[1])
    node = helper.make_node("DequantizeLinear", ["x", "scale"], ["y"], **attrs)
    graph = helper.make_graph([node], "fp8ref_dequantize",
                              [helper.make_tensor_value_info("x", element_type(ELEMENT_TYPES[fmt]), list(shape)),
                               helper.make_tensor_value_info("scale", element_type("FLOAT"), fed)],
                              [helper.make_tensor_value_info("y", element_type("FLOAT"), list(shape))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR_VERSION)
    return model, fed
