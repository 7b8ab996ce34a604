"""What is in a checkpoint (formats, schemes, scale statistics) and how far each layer is from
the original weights (max abs error, relative RMS error, SNR)."""

from __future__ import annotations

import math
import os

import numpy as np

from ..errors import CheckpointError
from ..io.safetensors import open_store
from .base import get, original_name, original_weight
from .loader import Checkpoint, load_checkpoint


def _stats(values: np.ndarray) -> dict:
    v = np.asarray(values).astype(np.float64).reshape(-1)
    if not v.size:  # the loader refuses empty scales; a caller's array may still be one
        return {"count": 0}
    return {"count": int(v.size), "min": float(v.min()), "max": float(v.max()), "mean": float(v.mean())}


def describe(ckpt: Checkpoint, *, values: bool = True) -> dict:
    """A JSON-ready summary: format, dtype, warnings, and per layer its storage, scheme and
    (``values``) weight/input scale statistics."""
    layers = {}
    for name, layer in ckpt.items():
        entry = {"layout": layer.quant.describe(), "shape": list(layer.shape), "tensors": layer.tensors,
                 "scheme": layer.scheme.to_dict(),
                 "weight_scale": {"dtype": ckpt.store.info(layer.tensors["weight_scale"]).dtype,
                                  "shape": list(ckpt.store.info(layer.tensors["weight_scale"]).shape)}}
        if values:
            entry["weight_scale"].update(_stats(layer.weight_scale))
            if layer.input_scale is not None:
                entry["input_scale"] = float(np.asarray(layer.input_scale).astype(np.float64).reshape(-1)[0])
            if layer.quant.global_scale is not None:  # nvfp4: the global scale and what it means
                entry["global_scale"] = {"meaning": layer.quant.global_scale,
                                         "weight": float(np.asarray(layer.weight_global, np.float64).reshape(-1)[0])}
        layers[name] = entry
    kv = {name: {"dtype": ckpt.store.info(t).dtype, "shape": list(ckpt.store.info(t).shape),
                 **(_stats(ckpt.tensor(t)) if values else {})} for name, t in sorted(ckpt.kv_scales.items())}
    return {"path": str(ckpt.path), "format": ckpt.format, "dtype": ckpt.dtype, "layers": layers,
            "kv_scales": sorted(ckpt.kv_scales), "kv_scale_values": kv, "unquantized_tensors": len(ckpt.unquantized),
            "warnings": list(ckpt.warnings), "tensor_bytes_read": ckpt.store.bytes_read}


def quantization_error(ckpt: Checkpoint, original: str | os.PathLike, *, executor: str = "local",
                       progress: bool = False) -> list[dict]:
    """Per layer, the exact dequantized weight against the original: max |err|, relative RMS
    error ||err|| / ||w||, SNR in dB; sorted worst (lowest SNR) first. Original tensors are found by
    name through the producer's renaming table. executor ``ray``: one task per layer, each reading
    its layer from the two folders (``fp8ref.executor``; same rows)."""
    store = open_store(original)
    for name, layer in ckpt.items():  # every layer checked by its headers before any work
        wname = original_name(get(layer.producer), f"{name}.weight", store) or name  # gpt-oss experts: no .weight
        if wname not in store:
            raise CheckpointError(f"{store.root}: the original has no tensor {name + '.weight'!r} for layer {name!r}")
        if store.info(wname).fmt is not None:
            raise CheckpointError(f"{store.where(wname)}: {store.info(wname).dtype}: the original must hold the "
                                  f"unquantized weights, this is a quantized checkpoint")
    if executor == "local":
        rows = [_error_row(name, layer, _original(layer, store)) for name, layer in ckpt.items()]
    else:
        from ..executor import run_all  # it imports tqdm: `fp8ref --help` loads this module

        rows = run_all(_error_task, ((str(ckpt.path), str(original), name) for name in ckpt), executor=executor,
                       progress=progress, desc="inspect", total=len(ckpt))
    return sorted(rows, key=lambda r: (r["snr_db"], r["layer"]))


def _original(layer, store) -> np.ndarray:
    """``layer``'s original weight in its checkpoint layout ([out, in]; gpt-oss experts stacked)."""
    w = np.asarray(original_weight(layer, store))
    if w.shape != tuple(layer.shape):
        wname = original_name(get(layer.producer), f"{layer.name}.weight", store) or layer.name
        raise CheckpointError(f"{store.where(wname)}: shape {list(store.info(wname).shape)}, the checkpoint "
                              f"layer is {list(layer.shape)}")
    return w


def _error_row(name: str, layer, original_weight: np.ndarray) -> dict:
    w = np.asarray(original_weight).astype(np.float64)
    err = layer.dequantize("float64") - w
    signal, noise = float(np.sum(w * w)), float(np.sum(err * err))
    return {"layer": name, "max_abs": float(np.max(np.abs(err))) if err.size else 0.0,
            "rel_rms": math.sqrt(noise / signal) if signal else (0.0 if noise == 0 else math.inf),
            "snr_db": 10 * math.log10(signal / noise) if noise else math.inf}


def _error_task(ckpt_path: str, original_path: str, name: str) -> dict:
    """``_error_row`` of one layer from the two folders (a task: it may run on another machine)."""
    layer = load_checkpoint(ckpt_path, check_values=False)[name]
    return _error_row(name, layer, _original(layer, open_store(original_path)))
