"""torchao's vocabulary (``TorchAoConfig`` in transformers 5.17; torchao 0.18.0's
``prototype/safetensors/safetensors_support.py``): the per-weight JSON that
``flatten_tensor_state_dict`` stores in the safetensors ``__metadata__`` under the weight's name.

A quantized weight ``M.weight`` is stored as ``M._weight_<name>`` for each of its
``_tensor_data_names`` and described by ``{"_type": SUBCLASS, "_data": {...}, "_tensor_data_names":
[...]}``; plain tensors as ``{"_type": "Tensor"}``. The JSON is untrusted data: names in it are
compared with a fixed list, nothing it names is imported or run. Float8Tensor is read (``block_size``
[1, in] per row, [out, in] per tensor; ``act_quant_kwargs.granularity`` PerRow / PerTensor or null);
MXTensor (``prototype/mx_formats/mx_tensor.py``: elem_dtype, block_size 32, the activation's
ScaleCalculationMode, is_swizzled_scales) and NVFP4Tensor (``nvfp4_tensor.py``: block_size 16, an
optional ``per_tensor_scale``, is_swizzled_scales) are read too.

Swizzled block scales (``to_blocked`` / ``from_blocked`` in ``prototype/mx_formats/utils.py``: cuBLAS's
block-scaling-factor layout) are the [rows, cols] scale matrix zero-padded to 128-row x 4-column
tiles, each tile stored as 512 contiguous bytes: row r = 32 i + j, column c at byte 16 j + 4 i + c.
"""

from __future__ import annotations

import json

from ..errors import CheckpointError

NAME = "torchao"
METHOD = "torchao"
FLOAT8 = "Float8Tensor"
MX = "MXTensor"
NVFP4 = "NVFP4Tensor"
# MXTensor elem_dtype (a torch.dtype, or a plain string for the FP6 kinds) -> fp8ref format
MX_ELEMS = {"float8_e4m3fn": "float8_e4m3fn", "float8_e5m2": "float8_e5m2", "float4_e2m1fn_x2": "float4_e2m1fn",
            "fp6_e2m3": "float6_e2m3fn", "fp6_e3m2": "float6_e3m2fn"}
MX_MODES = ("FLOOR", "CEIL", "RCEIL", "EVEN")  # ScaleCalculationMode -> recipe torchao-mx-<mode>
KERNEL_PREFERENCES = ("AUTO", "TORCH", "EMULATED", "FBGEMM", "MSLK")
DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float32"}
INPUTS = {"PerRow": "dynamic-token", "PerTensor": "dynamic-tensor"}


def weight_descriptions(metadata: dict | None, where: str) -> dict[str, dict]:
    """weight name -> its parsed description, for every metadata entry whose ``_type`` is not Tensor."""
    out = {}
    for key, raw in (metadata or {}).items():
        if key in ("format", "tensor_names", "fp8ref_recipes"):
            continue
        try:
            doc = json.loads(raw)
        except ValueError as exc:
            raise CheckpointError(f"{where}: __metadata__[{key!r}]: malformed JSON ({exc.msg}): {raw[:80]!r}") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("_type"), str):
            raise CheckpointError(f"{where}: __metadata__[{key!r}]: expected a JSON object with a '_type' string, "
                                  f"got {raw[:80]!r}")
        if doc["_type"] in ("Tensor", "torch.Tensor"):
            continue
        parse = {FLOAT8: float8, MX: mx, NVFP4: nvfp4}.get(doc["_type"])
        if parse is None:
            raise CheckpointError(f"{where}: tensor {key!r}: unknown torchao tensor subclass {doc['_type'][:60]!r}; "
                                  f"fp8ref reads {FLOAT8}, {MX} and {NVFP4} (never imports what the metadata names)")
        out[key] = parse(doc, f"{where}: tensor {key!r}")
    return out


def _typed(value, want: str, where: str):
    if not isinstance(value, dict) or value.get("_type") != want or "_data" not in value:
        raise CheckpointError(f"{where}: expected {{'_type': {want!r}, '_data': ...}}, got {str(value)[:80]!r}")
    return value["_data"]


def float8(doc: dict, where: str) -> dict:
    """{'block_size': [r, c], 'dtype': D, 'input': fp8ref input mode or None} of a Float8Tensor."""
    data = doc.get("_data")
    if not isinstance(data, dict) or doc.get("_tensor_data_names") != ["qdata", "scale"]:
        raise CheckpointError(f"{where}: a Float8Tensor needs '_data' and _tensor_data_names ['qdata', 'scale']")
    block = data.get("block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(type(b) is int and b > 0 for b in block)):
        raise CheckpointError(f"{where}: block_size: expected [rows, cols] positive integers, got {block!r:.60}")
    dtype = _typed(data.get("dtype"), "torch.dtype", f"{where}: dtype")
    if dtype not in DTYPES:
        raise CheckpointError(f"{where}: dtype {dtype!r:.40}; expected one of {', '.join(DTYPES)}")
    act = data.get("act_quant_kwargs")
    mode = None
    if act is not None:
        kw = _typed(act, "QuantizeTensorToFloat8Kwargs", f"{where}: act_quant_kwargs")
        gran = kw.get("granularity") if isinstance(kw, dict) else None
        kind = gran.get("_type") if isinstance(gran, dict) else None
        if kind not in INPUTS:
            raise CheckpointError(f"{where}: act_quant_kwargs.granularity {str(gran)[:60]!r}: expected PerRow or "
                                  f"PerTensor")
        if _typed(kw.get("float8_dtype"), "torch.dtype", f"{where}: act_quant_kwargs.float8_dtype") != "float8_e4m3fn":
            raise CheckpointError(f"{where}: act_quant_kwargs.float8_dtype: fp8ref reads float8_e4m3fn inputs")
        mode = INPUTS[kind]
    return {"kind": "float8", "block_size": tuple(block), "dtype": DTYPES[dtype], "input": mode}


def _fields(data, keys: tuple, where: str) -> dict:
    """``data`` as an object holding exactly ``keys`` (what torchao 0.18 writes), else a one-line error."""
    if not isinstance(data, dict) or set(data) != set(keys):
        got = sorted(data) if isinstance(data, dict) else type(data).__name__
        raise CheckpointError(f"{where}: expected an object with the keys {list(keys)}, got {str(got)[:120]}")
    return data


def _flag(value, where: str) -> bool:
    if not isinstance(value, bool):
        raise CheckpointError(f"{where}: expected true or false, got {value!r:.40}")
    return value


def _int(value, want: int, where: str) -> int:
    if type(value) is not int or value != want:
        raise CheckpointError(f"{where}: expected {want}, got {value!r:.40}")
    return value


def _enum(value, kind: str, allowed: tuple, where: str) -> str:
    v = _typed(value, kind, where)
    if v not in allowed:
        raise CheckpointError(f"{where}: {v!r:.40}; expected one of {', '.join(allowed)}")
    return v


def _elem(value, where: str) -> str:
    name = value if isinstance(value, str) else _typed(value, "torch.dtype", where)
    if name not in MX_ELEMS:
        raise CheckpointError(f"{where}: element dtype {name!r:.40}; expected one of {', '.join(MX_ELEMS)}")
    return MX_ELEMS[name]


def _orig_dtype(value, where: str) -> str:
    dtype = _typed(value, "torch.dtype", where)
    if dtype not in DTYPES:
        raise CheckpointError(f"{where}: {dtype!r:.40}; expected one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


MX_KEYS = ("elem_dtype", "block_size", "orig_dtype", "kernel_preference", "act_quant_kwargs", "is_swizzled_scales")
MX_ACT_KEYS = ("elem_dtype", "block_size", "scaling_mode", "kernel_preference", "is_swizzled_scales")


def mx(doc: dict, where: str) -> dict:
    """{'kind': 'mx', 'fmt', 'dtype', 'swizzled', 'mode' (ScaleCalculationMode of the activations: the
    weights' own, as torchao's handler passes one config to both; None without act_quant_kwargs),
    'input' (the activation element format or None)} of an MXTensor."""
    if doc.get("_tensor_data_names") != ["qdata", "scale"]:
        raise CheckpointError(f"{where}: an MXTensor needs _tensor_data_names ['qdata', 'scale']")
    data = _fields(doc.get("_data"), MX_KEYS, f"{where}: _data")
    fmt = _elem(data["elem_dtype"], f"{where}: elem_dtype")
    _int(data["block_size"], 32, f"{where}: block_size")
    _enum(data["kernel_preference"], "KernelPreference", KERNEL_PREFERENCES, f"{where}: kernel_preference")
    out = {"kind": "mx", "fmt": fmt, "dtype": _orig_dtype(data["orig_dtype"], f"{where}: orig_dtype"),
           "swizzled": _flag(data["is_swizzled_scales"], f"{where}: is_swizzled_scales"), "mode": None, "input": None}
    act = data["act_quant_kwargs"]
    if act is not None:
        w = f"{where}: act_quant_kwargs"
        kw = _fields(_typed(act, "QuantizeTensorToMXKwargs", w), MX_ACT_KEYS, w)
        out["input"] = _elem(kw["elem_dtype"], f"{w}.elem_dtype")
        _int(kw["block_size"], 32, f"{w}.block_size")
        out["mode"] = _enum(kw["scaling_mode"], "ScaleCalculationMode", MX_MODES, f"{w}.scaling_mode")
        _enum(kw["kernel_preference"], "KernelPreference", KERNEL_PREFERENCES, f"{w}.kernel_preference")
        _flag(kw["is_swizzled_scales"], f"{w}.is_swizzled_scales")
    return out


NVFP4_KEYS = ("is_swizzled_scales", "use_triton_kernel", "act_quant_kwargs", "block_size", "orig_dtype")
NVFP4_ACT_KEYS = ("block_size", "is_swizzled_scales", "use_triton_kernel", "use_dynamic_per_tensor_scale")
NVFP4_DATA_NAMES = (["qdata", "scale"], ["per_tensor_scale", "qdata", "scale"])


def nvfp4(doc: dict, where: str) -> dict:
    """{'kind': 'nvfp4', 'dtype', 'swizzled', 'tensor_scale' (a per_tensor_scale is stored), 'input'
    ('dynamic' when activations are quantized with a per-tensor scale taken at run time, 'blocks' with
    block scales only, None for none)} of an NVFP4Tensor. A static activation scale
    (``act_per_tensor_scale``) is refused: fp8ref does not read it yet."""
    names = doc.get("_tensor_data_names")
    if names not in NVFP4_DATA_NAMES:
        raise CheckpointError(f"{where}: an NVFP4Tensor needs _tensor_data_names {NVFP4_DATA_NAMES[0]} or "
                              f"{NVFP4_DATA_NAMES[1]}, got {str(names)[:80]} (a static act_per_tensor_scale is not "
                              f"read by fp8ref)")
    data = _fields(doc.get("_data"), NVFP4_KEYS, f"{where}: _data")
    _int(data["block_size"], 16, f"{where}: block_size")
    _flag(data["use_triton_kernel"], f"{where}: use_triton_kernel")
    out = {"kind": "nvfp4", "dtype": _orig_dtype(data["orig_dtype"], f"{where}: orig_dtype"),
           "swizzled": _flag(data["is_swizzled_scales"], f"{where}: is_swizzled_scales"),
           "tensor_scale": "per_tensor_scale" in names, "input": None}
    act = data["act_quant_kwargs"]
    if act is not None:
        w = f"{where}: act_quant_kwargs"
        kw = _fields(_typed(act, "QuantizeTensorToNVFP4Kwargs", w), NVFP4_ACT_KEYS, w)
        _int(kw["block_size"], 16, f"{w}.block_size")
        _flag(kw["is_swizzled_scales"], f"{w}.is_swizzled_scales")
        _flag(kw["use_triton_kernel"], f"{w}.use_triton_kernel")
        out["input"] = "dynamic" if _flag(kw["use_dynamic_per_tensor_scale"], f"{w}.use_dynamic_per_tensor_scale") \
            else "blocks"
    return out


# --- swizzled block scales (cuBLAS's 128x4 tiles) ----------------------------------------------------

def swizzled_shape(rows: int, cols: int) -> tuple[int, int]:
    """The stored [32 * row tiles, 16 * column tiles] of a [rows, cols] scale matrix."""
    return 32 * -(-rows // 128), 16 * -(-cols // 4)


def unswizzle(stored, rows: int, cols: int):
    """The [rows, cols] scale matrix of torchao's swizzled bytes (``from_blocked``), and whether every
    padding byte is 0 (torchao pads with zeros)."""
    import numpy as np

    r, c = -(-rows // 128), -(-cols // 4)
    full = (np.asarray(stored).reshape(r * c, 32, 4, 4).transpose(0, 2, 1, 3).reshape(r, c, 128, 4)
            .transpose(0, 2, 1, 3).reshape(r * 128, c * 4))
    pad = full.copy()
    pad[:rows, :cols] = 0
    return full[:rows, :cols], not pad.any()


def swizzle(scales):
    """torchao's ``to_blocked(scales)`` viewed as ``swizzled_shape``: zero padding, then 128x4 tiles."""
    import numpy as np

    rows, cols = scales.shape
    r, c = -(-rows // 128), -(-cols // 4)
    full = np.zeros((r * 128, c * 4), scales.dtype)
    full[:rows, :cols] = scales
    tiles = full.reshape(r, 128, c, 4).transpose(0, 2, 1, 3).reshape(r * c, 4, 32, 4).transpose(0, 2, 1, 3)
    return np.ascontiguousarray(tiles).reshape(swizzled_shape(rows, cols))


def check_config(qc: dict, where: str) -> None:
    """The TorchAoConfig dict: ``quant_type`` an object (its ``_type`` names are data, never resolved)."""
    qt = qc.get("quant_type")
    if not isinstance(qt, (dict, str)):
        raise CheckpointError(f"{where}.quant_type: expected an object or a string, got {type(qt).__name__}")


# --- writing: the JSON torchao 0.18.0 and transformers 5.17 write (key order as theirs) -----------

def _granularity(input_mode: str | None, strategy: str) -> dict:
    kind = {"dynamic-token": "PerRow", "dynamic-tensor": "PerTensor"}.get(input_mode) or (
        "PerRow" if strategy == "channel" else "PerTensor")
    return {"_type": kind, "_data": {"dim": -1}} if kind == "PerRow" else {"_type": kind, "_data": {}}


def float8_description(block_size: tuple[int, int], dtype: str, input_mode: str | None, strategy: str) -> str:
    """``__metadata__["M.weight"]`` of a Float8Tensor as flatten_tensor_state_dict writes it."""
    auto = {"_type": "KernelPreference", "_data": "AUTO"}
    act = None
    if input_mode is not None:
        act = {"_type": "QuantizeTensorToFloat8Kwargs", "_data": {
            "float8_dtype": {"_type": "torch.dtype", "_data": "float8_e4m3fn"},
            "granularity": _granularity(input_mode, strategy), "mm_config": None, "hp_value_lb": None,
            "hp_value_ub": None, "kernel_preference": auto}}
    return json.dumps({"_type": FLOAT8, "_data": {"block_size": list(block_size), "mm_config": None,
                                                  "act_quant_kwargs": act, "kernel_preference": auto,
                                                  "dtype": {"_type": "torch.dtype", "_data": dtype}},
                       "_tensor_data_names": ["qdata", "scale"]})


def _dtype(name: str) -> dict:
    return {"_type": "torch.dtype", "_data": name}


AUTO = {"_type": "KernelPreference", "_data": "AUTO"}
ELEM_NAMES = {v: k for k, v in MX_ELEMS.items()}  # fp8ref format -> torchao elem_dtype name


def _mx_elem(fmt: str):
    name = ELEM_NAMES[fmt]
    return name if name.startswith("fp6") else _dtype(name)  # torchao writes its FP6 kinds as plain strings


def mx_description(fmt: str, dtype: str, mode: str) -> str:
    """``__metadata__["M.weight"]`` of an MXTensor as MXDynamicActivationMXWeightConfig's handler and
    flatten_tensor_state_dict write it (swizzled scales, activations of the same element dtype)."""
    act = {"_type": "QuantizeTensorToMXKwargs", "_data": {
        "elem_dtype": _mx_elem(fmt), "block_size": 32, "scaling_mode": {"_type": "ScaleCalculationMode", "_data": mode},
        "kernel_preference": AUTO, "is_swizzled_scales": True}}
    data = {"elem_dtype": _mx_elem(fmt), "block_size": 32, "orig_dtype": _dtype(dtype), "kernel_preference": AUTO,
            "act_quant_kwargs": act, "is_swizzled_scales": True}
    return json.dumps({"_type": MX, "_data": data, "_tensor_data_names": ["qdata", "scale"]})


def nvfp4_description(dtype: str, per_tensor_scale: bool = True) -> str:
    """``__metadata__["M.weight"]`` of an NVFP4Tensor as NVFP4DynamicActivationNVFP4WeightConfig() writes it
    (``per_tensor_scale=False``: with use_dynamic_per_tensor_scale=False, no per_tensor_scale tensor)."""
    act = {"_type": "QuantizeTensorToNVFP4Kwargs", "_data": {"block_size": 16, "is_swizzled_scales": True,
                                                            "use_triton_kernel": True,
                                                            "use_dynamic_per_tensor_scale": per_tensor_scale}}
    data = {"is_swizzled_scales": True, "use_triton_kernel": True, "act_quant_kwargs": act, "block_size": 16,
            "orig_dtype": _dtype(dtype)}
    names = ["per_tensor_scale", "qdata", "scale"] if per_tensor_scale else ["qdata", "scale"]
    return json.dumps({"_type": NVFP4, "_data": data, "_tensor_data_names": names})


def _wrap(config: dict) -> dict:
    return {"quant_method": METHOD, "quant_type": {"default": config}, "modules_to_not_convert": None,
            "include_input_output_embeddings": False, "untie_embedding_weights": False}


def mx_quantization_config(fmt: str, mode: str) -> dict:
    """TorchAoConfig(MXDynamicActivationMXWeightConfig(activation_dtype=weight_dtype=fmt,
    scaling_mode=mode)).to_dict()."""
    return _wrap({"_type": "MXDynamicActivationMXWeightConfig", "_version": 1, "_data": {
        "block_size": 32, "activation_dtype": _mx_elem(fmt), "weight_dtype": _mx_elem(fmt), "kernel_preference": AUTO,
        "scaling_mode": {"_type": "ScaleCalculationMode", "_data": mode}}})


def nvfp4_quantization_config(per_tensor_scale: bool = True) -> dict:
    """TorchAoConfig(NVFP4DynamicActivationNVFP4WeightConfig(use_dynamic_per_tensor_scale=...)).to_dict()."""
    return _wrap({"_type": "NVFP4DynamicActivationNVFP4WeightConfig", "_version": 1,
                  "_data": {"use_triton_kernel": True, "use_dynamic_per_tensor_scale": per_tensor_scale,
                            "step": None}})


def quantization_config(strategy: str, input_mode: str | None) -> dict:
    """TorchAoConfig(Float8DynamicActivationFloat8WeightConfig(granularity=...)).to_dict()."""
    g = _granularity(input_mode, strategy)
    g = {"_type": g["_type"], "_version": 1, "_data": g["_data"]}
    return {"quant_method": METHOD, "quant_type": {"default": {
        "_type": "Float8DynamicActivationFloat8WeightConfig", "_version": 2, "_data": {
            "activation_dtype": {"_type": "torch.dtype", "_data": "float8_e4m3fn"},
            "weight_dtype": {"_type": "torch.dtype", "_data": "float8_e4m3fn"},
            "granularity": [g, dict(g)],
            "packing_format": {"_type": "Float8PackingFormat", "_data": "PLAIN"},
            "mm_config": {"_type": "Float8MMConfig", "_version": 1,
                          "_data": {"emulate": False, "use_fast_accum": True, "pad_inner_dim": False}},
            "activation_value_lb": None, "activation_value_ub": None,
            "kernel_preference": {"_type": "KernelPreference", "_data": "AUTO"},
            "set_inductor_config": True, "alg_id": 0}}},
        "modules_to_not_convert": None, "include_input_output_embeddings": False, "untie_embedding_weights": False}
