"""torchao's vocabulary (``TorchAoConfig`` in transformers 5.17; torchao 0.18.0's
``prototype/safetensors/safetensors_support.py``): the per-weight JSON that
``flatten_tensor_state_dict`` stores in the safetensors ``__metadata__`` under the weight's name.

A quantized weight ``M.weight`` is stored as ``M._weight_<name>`` for each of its
``_tensor_data_names`` and described by ``{"_type": SUBCLASS, "_data": {...}, "_tensor_data_names":
[...]}``; plain tensors as ``{"_type": "Tensor"}``. The JSON is untrusted data: names in it are
compared with a fixed list, nothing it names is imported or run. Float8Tensor is read (``block_size``
[1, in] per row, [out, in] per tensor; ``act_quant_kwargs.granularity`` PerRow / PerTensor or null);
MXTensor and NVFP4Tensor are recognised and refused with a reason.
"""

from __future__ import annotations

import json

from ..errors import CheckpointError

NAME = "torchao"
METHOD = "torchao"
FLOAT8 = "Float8Tensor"
NOT_READ = ("MXTensor", "NVFP4Tensor")  # recognised, not read yet (swizzled block scales)
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
        if doc["_type"] in NOT_READ:
            raise CheckpointError(f"{where}: tensor {key!r}: torchao {doc['_type']} is not read by fp8ref yet "
                                  f"(Float8Tensor is)")
        if doc["_type"] != FLOAT8:
            raise CheckpointError(f"{where}: tensor {key!r}: unknown torchao tensor subclass {doc['_type'][:60]!r}; "
                                  f"fp8ref reads {FLOAT8} (never imports what the metadata names)")
        out[key] = float8(doc, f"{where}: tensor {key!r}")
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
    return {"block_size": tuple(block), "dtype": DTYPES[dtype], "input": mode}


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
