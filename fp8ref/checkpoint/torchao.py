"""torchao checkpoints (transformers' ``TorchAoConfig``, ``quant_method: torchao``), saved through
torchao's ``flatten_tensor_state_dict``; the vocabulary is ``fp8ref.producers.torchao``.

A Float8Tensor weight ``M.weight`` is stored as ``M._weight_qdata`` F8_E4M3 [out, in] and
``M._weight_scale`` F32 ([out, 1] per row, [1, 1] per tensor), a dequantization multiplier, with its
description (block size, model dtype, activation granularity) as JSON in the shard's
``__metadata__["M.weight"]``. Recipe ``torchao-float8`` (Float8Tensor.from_hp's torch path):
s = D(amax / 448) stored as F32, q = e4m3(fp32(W) / s). An all-zero row (or tensor) stores scale 0
and NaN codes (pytorch/ao #4713): refused at load with that named.
"""

from __future__ import annotations

from ..errors import CheckpointError
from ..io.safetensors import TensorStore
from ..producers import torchao as ta
from .base import Defaults, ScaleDecl, accept, register
from .layout import LayerEntry, LayerQuant
from .layout import check_layer as check_linear

NAME = ta.NAME
RECIPE = "torchao-float8"
QDATA, SCALE = "._weight_qdata", "._weight_scale"


def layers(qc, store: TensorStore, where: str, warnings: list[str]):
    if qc is None:
        raise CheckpointError(f"{store.root}: torchao layouts are only read with their quantization_config")
    ta.check_config(qc, where)
    entries = []
    for f in store.files.values():
        for weight, desc in ta.weight_descriptions(f.metadata, str(f.path)).items():
            module = weight[: -len(".weight")] if weight.endswith(".weight") else None
            if module is None or f"{module}{QDATA}" not in store or f"{module}{SCALE}" not in store:
                raise CheckpointError(f"{f.path}: __metadata__ describes {weight!r} as a Float8Tensor, but "
                                      f"{weight.rpartition('.')[0]}{QDATA} / {SCALE} are not both stored")
            shape = store.info(f"{module}{QDATA}").shape
            out, inp = shape if len(shape) == 2 else (0, 0)  # check_layer names a wrong rank
            strategy = {(1, inp): "channel", (out, inp): "tensor"}.get(desc["block_size"])
            if strategy is None:
                raise CheckpointError(f"{f.path}: tensor {weight!r}: block_size {list(desc['block_size'])} is neither "
                                      f"per row [1, {inp}] nor per tensor [{out}, {inp}]")
            quant = LayerQuant(strategy, None, desc["input"])
            entry = LayerEntry(module, quant, {"weight": f"{module}{QDATA}", "weight_scale": f"{module}{SCALE}",
                                               "bias": f"{module}.bias"}, NAME)
            entries.append(accept(store, entry, scale_shapes))
    stray = [n for n in store if n.endswith((QDATA, SCALE)) and not any(n in e.tensors.values() for e in entries)]
    if stray:
        raise CheckpointError(f"{store.where(stray[0])}: no Float8Tensor description in __metadata__ for it")
    return entries, {}


def scale_shapes(quant: LayerQuant, out: int, inp: int):
    return ((out, 1),) if quant.weight_strategy == "channel" else ((1, 1),)


def check_layer(store: TensorStore, entry: LayerEntry, *, check_values: bool, dtype: str | None = None) -> None:
    """The linear check, with torchao's zero-row NaN named before the generic 'scale is zero'."""
    if check_values:
        import numpy as np

        s = np.asarray(store.get(entry.tensors["weight_scale"])).reshape(-1)
        if (s == 0).any():
            rows = np.flatnonzero(s == 0)
            raise CheckpointError(f"{store.where(entry.tensors['weight_scale'])}: {rows.size} zero scales (first "
                                  f"row {int(rows[0])}): an all-zero row that torchao quantized to scale 0 and NaN "
                                  f"codes (pytorch/ao #4713); the layer cannot be dequantized")
    check_linear(store, entry, check_values=check_values, dtype=dtype)


def cannot_express(quant: LayerQuant) -> str | None:
    if (quant.weight_strategy not in ("channel", "tensor") or quant.weight_fmt != "float8_e4m3fn"
            or quant.input not in (None, "dynamic-token", "dynamic-tensor")):
        return (f"torchao's Float8Tensor holds per-row or per-tensor float8_e4m3fn weights with dynamic "
                f"per-token / per-tensor inputs or none; got {quant.describe()}")
    return None


def tensor_plan(name: str, quant: LayerQuant, out: int, inp: int, dtype: str):
    scale = (out, 1) if quant.weight_strategy == "channel" else (1, 1)
    return [("weight", f"{name}{QDATA}", "F8_E4M3", (out, inp)), ("weight_scale", f"{name}{SCALE}", "F32", scale)]


def quantization_config(layers: dict[str, LayerQuant], unquantized: list[str], kv: bool = False) -> dict:
    if kv:
        raise CheckpointError(f"{NAME}: {KV_REFUSAL}")
    kinds = {(q.weight_strategy, q.input) for q in layers.values()}
    if len(kinds) != 1:
        raise CheckpointError(f"{NAME}: TorchAoConfig holds one Float8 config for every layer; got "
                              f"{sorted(map(str, kinds))}")
    for q in layers.values():
        why = cannot_express(q)
        if why:
            raise CheckpointError(f"{NAME}: {why}")
    return ta.quantization_config(*kinds.pop())


def shard_metadata(metadata: dict | None, layers: dict, plain: list[str]) -> dict:
    """A shard's __metadata__ with each written layer's Float8Tensor description (``layers``: name ->
    (LayerQuant, [out, in], model dtype)), ``{"_type": "Tensor"}`` for each ``plain`` tensor and
    torchao's ``tensor_names``, as flatten_tensor_state_dict writes them."""
    import json

    out = dict(metadata or {})
    for name in plain:
        out.setdefault(name, json.dumps({"_type": "Tensor"}))
    for name, (quant, (rows, cols), dtype) in layers.items():
        block = (1, cols) if quant.weight_strategy == "channel" else (rows, cols)
        out[f"{name}.weight"] = ta.float8_description(block, dtype, quant.input, quant.weight_strategy)
    names = json.loads(out.get("tensor_names", "[]")) if isinstance(out.get("tensor_names"), str) else []
    new = [f"{n}.weight" for n in layers] + list(plain)
    out["tensor_names"] = json.dumps(names + [n for n in new if n not in names])
    return out


KV_REFUSAL = "TorchAoConfig has no KV-cache scale field"


class TorchAo(Defaults):
    name = NAME
    scales = (
        ScaleDecl("channel (Float8Tensor PerRow)", "_weight_scale", "multiplier", "F32", "[out, 1]", "-",
                  "D(amax/448) stored as fp32; 0 for an all-zero row (NaN codes, pytorch/ao #4713)"),
        ScaleDecl("tensor (Float8Tensor PerTensor)", "_weight_scale", "multiplier", "F32", "[1, 1]", "-",
                  "D(amax/448) stored as fp32; description JSON in __metadata__[M.weight]"),
    )
    methods = (ta.METHOD,)
    detect_rank = 6
    scheme_scale_dtype = "float32"
    scales_follow_recipe = False
    kv_refusal = KV_REFUSAL
    known_recipes = (RECIPE,)

    def detect(self, store: TensorStore, fp8_layers: list[str]) -> bool:
        return False

    def recipe_of(self, quant: LayerQuant) -> str:
        return RECIPE

    def producer_refusal(self, quant: LayerQuant) -> str | None:
        return "no producer emulation for torchao checkpoints (its CPU path quantizes activations only on GPU)"

    def original_weight(self, layer, store: TensorStore):
        key = f"{layer.name}.weight"
        if key not in store:
            raise CheckpointError(f"{store.root}: no tensor {key!r} for the quantized layer {layer.name!r}")
        return store.get(key)

    layers = staticmethod(layers)
    check_layer = staticmethod(check_layer)
    cannot_express = staticmethod(cannot_express)
    tensor_plan = staticmethod(tensor_plan)
    quantization_config = staticmethod(quantization_config)
    shard_metadata = staticmethod(shard_metadata)


register(TorchAo())
