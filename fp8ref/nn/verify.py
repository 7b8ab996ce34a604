"""The engine behind ``fp8ref verify``: re-derive every weight code and weight scale of a checkpoint
from the original weights and the producer's recipe (``fp8ref.quantize`` with the layer's own
scheme, amax from the weight), and compare bytes; the unquantized tensors must equal the
original's bytes. Static input scales come from calibration data, which a checkpoint does not
carry: they are reported as not re-derived. No torch needed."""

from __future__ import annotations

import numpy as np

from ..errors import Fp8RefError, ModelError

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _bits(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.view(_UINT[a.dtype.itemsize])


def _first(mask: np.ndarray) -> list[int] | None:
    idx = np.argwhere(mask)
    return [int(i) for i in idx[0]] if idx.size else None


def verify_layer(layer, weight: np.ndarray, recipe: str | None = None) -> dict:
    from ..quant import as_args, quantize
    from ..scaling import reduce_amax

    qa = as_args(layer.scheme)
    if tuple(weight.shape) != tuple(layer.shape):
        raise ModelError(f"{layer.name}: original weight {list(weight.shape)}, checkpoint {list(layer.shape)}")
    amax = reduce_amax(weight, qa.granularity, group_size=qa.group_size, block_shape=qa.block_shape)
    stored = layer.weight_codes
    try:
        q = quantize(weight, layer.scheme, recipe=recipe, amax=amax)
    except Fp8RefError as exc:  # the recipe cannot have produced this layer: every byte unexplained
        n = int(np.asarray(layer.weight_scale).size)
        return {"name": layer.name, "recipe": recipe or layer.scheme["recipe"], "codes": int(stored.size),
                "code_mismatches": int(stored.size), "first_code_mismatch": None, "scales": n,
                "scale_mismatches": n, "first_scale_mismatch": None, "error": str(exc)}
    codes = np.asarray(q.codes)
    bad_codes = codes != stored
    s_stored = np.asarray(layer.weight_scale)
    s = np.asarray(q.scale)
    widened = s_stored.dtype == np.float32 and s.dtype.itemsize < 4
    if widened:  # a writer may store a bf16/fp16 scale as F32 (exact widening, fp8ref's export does)
        s = s.astype(np.float32)
    out = {"name": layer.name, "recipe": recipe or layer.scheme["recipe"], "codes": int(stored.size),
           "code_mismatches": int(bad_codes.sum()), "first_code_mismatch": _first(bad_codes),
           "scales": int(s_stored.size)}
    if s.dtype != s_stored.dtype or s.size != s_stored.size:
        out.update(scale_mismatches=int(s_stored.size), first_scale_mismatch=None,
                   scale_note=f"derived {s.dtype} {list(s.shape)}, stored {s_stored.dtype} {list(s_stored.shape)}")
    else:
        bad = _bits(s.reshape(s_stored.shape)) != _bits(s_stored)
        out.update(scale_mismatches=int(bad.sum()), first_scale_mismatch=_first(bad))
        if widened:
            out["scale_note"] = f"derived {np.asarray(q.scale).dtype}, compared widened to the stored float32"
    if layer.quant.input == "static":
        out["input_scale"] = "not re-derived (needs the calibration data)"
    return out


def verify(ckpt, original, *, recipe: str | None = None, progress: bool = False) -> dict:
    """Per-layer code and scale mismatch counts of ``ckpt`` against ``original`` (both loaded
    Checkpoints); ``ok`` is False on any mismatch."""
    from tqdm import tqdm

    layers = []
    for name in tqdm(list(ckpt), desc="verify", unit="layer", disable=not progress):
        key = f"{name}.weight"
        if key not in original.store:
            raise ModelError(f"{original.path}: no tensor {key!r} for the quantized layer {name!r}")
        layers.append(verify_layer(ckpt[name], original.tensor(key), recipe))
    plain_bad, plain_missing = [], []
    for name in ckpt.unquantized:
        if name not in original.store:
            plain_missing.append(name)
            continue
        a, b = ckpt.tensor(name), original.tensor(name)
        if a.dtype != b.dtype or a.shape != b.shape or not np.array_equal(_bits(a), _bits(b)):
            plain_bad.append(name)
    bad = [x["name"] for x in layers if x["code_mismatches"] or x["scale_mismatches"]]
    return {"checkpoint": str(ckpt.path), "original": str(original.path), "format": ckpt.format,
            "recipe": recipe, "layers": layers, "mismatched_layers": bad,
            "unquantized": {"checked": len(ckpt.unquantized) - len(plain_missing), "mismatched": plain_bad,
                            "missing_in_original": plain_missing},
            "ok": not bad and not plain_bad}
