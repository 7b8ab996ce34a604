"""The engine behind ``fp8ref verify``: re-derive every weight code and weight scale of a checkpoint
from the original weights and the producer's recipe (``fp8ref.quantize`` with the layer's own
scheme, amax from the weight), and compare bytes; the unquantized tensors must equal the
original's bytes. Static input scales come from calibration data, which a checkpoint does not
carry: given the per-layer activation amax (``fp8ref.checkpoint.load_calibration``'s mapping) they
are re-derived with the recipe's scale rule in the model dtype, else reported as not re-derived.
No torch needed."""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from .._arrays import bits_view
from ..errors import Fp8RefError, ModelError


def _bits(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return bits_view(a)


def _first(mask: np.ndarray) -> list[int] | None:
    idx = np.argwhere(mask)
    return [int(i) for i in idx[0]] if idx.size else None


def _compare_scales(derived: np.ndarray, stored: np.ndarray) -> dict:
    """Mismatch count and first index of two scale arrays, bit for bit; a bf16/fp16 derived scale
    is compared widened to a float32 stored one (exact: a writer may store it so, fp8ref's export does)."""
    orig_dtype = derived.dtype
    widened = stored.dtype == np.float32 and derived.dtype.itemsize < 4
    if widened:
        derived = derived.astype(np.float32)
    if derived.dtype != stored.dtype or derived.size != stored.size:
        return {"mismatches": int(stored.size), "first": None,
                "note": f"derived {orig_dtype} {list(derived.shape)}, stored {stored.dtype} {list(stored.shape)}"}
    bad = _bits(derived.reshape(stored.shape)) != _bits(stored)
    out = {"mismatches": int(bad.sum()), "first": _first(bad)}
    if widened:
        out["note"] = f"derived {orig_dtype}, compared widened to the stored float32"
    return out


def _input_scale(layer, amax: float, recipe: str, model_dtype: str) -> str:
    """The recipe's stored scale for activation amax ``amax`` (exact in the model dtype, as the
    export writes it) against the stored input_scale, compared as float32 values (both exact)."""
    from ..formats import FORMATS
    from ..recipes import compute_scale
    from ..registry import get_recipe

    derived, _ = compute_scale(np.array([amax], np.float64), get_recipe(recipe), FORMATS[layer.quant.weight_fmt],
                               model_dtype)
    stored = np.asarray(layer.input_scale).astype(np.float32).reshape(-1)
    same = _bits(np.asarray(derived, np.float32).reshape(-1)) == _bits(stored)
    return "ok" if stored.size == 1 and bool(same.all()) else (
        f"mismatch: stored {float(stored[0])!r}, derived {float(np.asarray(derived).reshape(-1)[0])!r}")


def verify_layer(layer, weight: np.ndarray, recipe: str | None = None, input_amax: float | None = None,
                 model_dtype: str = "bfloat16") -> dict:
    from ..quant import as_args, quantize
    from ..scaling import reduce_amax

    qa = as_args(layer.scheme)
    if tuple(weight.shape) != tuple(layer.shape):
        raise ModelError(f"{layer.name}: original weight {list(weight.shape)}, checkpoint {list(layer.shape)}")
    amax = reduce_amax(weight, qa.granularity, group_size=qa.group_size, block_shape=qa.block_shape)
    stored = layer.weight_codes
    from ..checkpoint import base

    scheme = layer.scheme
    if not base.get(layer.producer).scales_follow_recipe:  # the format's fixed scale dtype (hf-fp8: F32) says
        scheme = scheme.replace(scale_dtype="model")      # how it stores, not how the recipe rounds
    try:
        q = quantize(weight, scheme, recipe=recipe, amax=amax)
    except Fp8RefError as exc:  # the recipe cannot have produced this layer: every byte unexplained
        n = int(np.asarray(layer.weight_scale).size)
        return {"name": layer.name, "recipe": recipe or layer.scheme["recipe"], "codes": int(stored.size),
                "code_mismatches": int(stored.size), "first_code_mismatch": None, "scales": n,
                "scale_mismatches": n, "first_scale_mismatch": None, "error": str(exc)}
    codes = np.asarray(q.codes)
    bad_codes = codes != stored
    c = _compare_scales(np.asarray(q.scale), np.asarray(layer.weight_scale))
    out = {"name": layer.name, "recipe": recipe or layer.scheme["recipe"], "codes": int(stored.size),
           "code_mismatches": int(bad_codes.sum()), "first_code_mismatch": _first(bad_codes),
           "scales": int(np.asarray(layer.weight_scale).size), "scale_mismatches": c["mismatches"],
           "first_scale_mismatch": c["first"], **({"scale_note": c["note"]} if "note" in c else {})}
    if layer.quant.input == "static":
        if input_amax is None:
            out["input_scale"] = "not re-derived (needs the calibration data)"
        else:
            out["input_scale"] = _input_scale(layer, input_amax, out["recipe"], model_dtype)
            out["scale_mismatches"] += out["input_scale"] != "ok"
    return out


@lru_cache(maxsize=4)
def _load(path: str):
    """A worker's checkpoint, headers only: the driver checked the values, each layer read checks its own."""
    from ..checkpoint import load_checkpoint

    return load_checkpoint(path, check_values=False)


def _verify_task(ckpt_path: str, original_path: str, name: str, recipe, amax) -> dict:
    """One layer, from the two folders (a task of ``fp8ref.nn.executor``: it may run on another machine)."""
    ckpt, original = _load(ckpt_path), _load(original_path)
    return verify_layer(ckpt[name], original.tensor(f"{name}.weight"), recipe, amax, ckpt.dtype)


def verify(ckpt, original, *, recipe: str | None = None, calibration=None, progress: bool = False,
           executor: str = "local") -> dict:
    """Per-layer code and scale mismatch counts of ``ckpt`` against ``original`` (both loaded
    Checkpoints); ``ok`` is False on any mismatch. calibration: layer name -> activation amax
    (``fp8ref.checkpoint.load_calibration``), to re-derive static input scales too. executor:
    ``local`` or ``ray`` (one task per layer, same report)."""
    from .executor import run_all

    items = []
    for name in ckpt:
        key = f"{name}.weight"
        if key not in original.store:
            raise ModelError(f"{original.path}: no tensor {key!r} for the quantized layer {name!r}")
        items.append((str(ckpt.path), str(original.path), name, recipe,
                      None if calibration is None else calibration.get(name)))
    if executor == "local":  # the loaded checkpoints, not a second load by path
        def task(_c, _o, name, rec, amax):
            return verify_layer(ckpt[name], original.tensor(f"{name}.weight"), rec, amax, ckpt.dtype)
    else:
        task = _verify_task
    layers = run_all(task, items, executor=executor, progress=progress, desc="verify")
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
