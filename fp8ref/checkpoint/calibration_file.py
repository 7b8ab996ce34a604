"""The calibration file an export reads: per linear layer the activation amax, per attention
module the KV-cache amax, in a file that says it holds amax (``write_calibration``,
``load_calibration``), and the checks that refuse scales given where amax is due."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from .. import __version__
from ..calibrate import AmaxState, CalibratedScales, DequantScale
from ..errors import CheckpointError
from ..io.files import read_json, write_bytes
from ..io.paths import path_arg
from ..io.safetensors import open_store
from ..limits import shown

CALIBRATION_FORMAT = "fp8ref-calibration/1"
_CALIBRATION_KEYS = ("format", "holds", "fp8ref_version", "input_amax", "kv_amax")
_NOT_CALIBRATION = (f"not an fp8ref calibration file (expected a JSON object with \"format\": "
                    f"{CALIBRATION_FORMAT!r} and \"holds\": \"amax\"); write it with "
                    "fp8ref.write_calibration(path, amax), from observe_linear_inputs' states or amax values. "
                    "calibrate_input_scales returns scales, not amax: an input scale from them would be "
                    "448x too small for float8_e4m3fn")


def amax_number(value, where: str) -> float:
    """One activation amax: a finite number >= 0 (an AmaxState of tensor granularity, a one-element
    array or a Python number)."""
    if isinstance(value, AmaxState):
        if value.amax is None:
            raise CheckpointError(f"{where}: this layer saw no input (its AmaxState has no amax)")
        value = value.amax
    if isinstance(value, np.ndarray) or isinstance(value, np.generic):
        if np.size(value) != 1 or not np.issubdtype(np.asarray(value).dtype, np.number):
            raise CheckpointError(f"{where}: an activation amax is one number (tensor granularity), got an array "
                                  f"of shape {list(np.shape(value))}")
        value = np.asarray(value).reshape(-1)[0].item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CheckpointError(f"{where}: expected a number (activation amax), got {type(value).__name__}")
    try:
        amax = float(value)
    except OverflowError:  # a 5,000-digit integer
        raise CheckpointError(f"{where}: expected a number (activation amax), got {shown(value)}") from None
    if not np.isfinite(amax) or amax < 0:
        raise CheckpointError(f"{where}: activation amax must be finite and >= 0, got {amax!r}")
    return amax


def refuse_scales(amax, where: str) -> Mapping:
    """``amax`` (a mapping of name -> activation amax) as it is, or one CheckpointError when it is,
    or holds, scales from ``calibrate_input_scales``/``finalize``: stored as amax they would give
    input scales 448x too small (float8_e4m3fn)."""
    if isinstance(amax, CalibratedScales):
        raise CheckpointError(f"{where}: these are calibrate_input_scales' scales (amax / format max), not amax; "
                              "pass their .amax (calibrate_input_scales(...).amax), the amax they came from")
    if not isinstance(amax, Mapping):
        raise CheckpointError(f"{where}: expected a mapping of name -> activation amax, got {type(amax).__name__}")
    for k, v in amax.items():
        if isinstance(v, DequantScale):
            raise CheckpointError(f"{where}[{k!r}]: a scale (amax / format max, from finalize or "
                                  "calibrate_input_scales), not an amax; pass the AmaxState that "
                                  "observe_linear_inputs returns (or calibrate_input_scales(...).amax[layer])")
    return amax


def amax_values(amax: Mapping, where: str) -> dict[str, float]:
    """name -> activation amax as numbers (see ``amax_number``), or one CheckpointError; scales are
    refused (``refuse_scales``)."""
    return {str(k): amax_number(v, f"{where}[{k!r}]") for k, v in refuse_scales(amax, where).items()}


def write_calibration(path: str | os.PathLike, input_amax: Mapping, *, kv_amax: Mapping | None = None) -> Path:
    """Write the calibration file ``export_checkpoint``/``fp8ref quantize --calibration`` read: per
    layer the activation amax (numbers, one-element arrays, or the ``AmaxState`` values
    ``observe_linear_inputs`` returns), and per attention module the KV-cache amax under
    ``ATTN.k_scale``/``ATTN.v_scale`` or ``ATTN.{k,v}_proj.output_amax`` and the query's under
    ``ATTN.q_scale``: a number, or a list of them, one per head (attn_head). The file says what it
    holds (amax, with this fp8ref's version), so a file of scales is never taken for one. Scales
    (``calibrate_input_scales``' result, ``finalize``'s ``DequantScale``) are refused: pass
    ``calibrate_input_scales(...).amax``."""
    path = path_arg(path)
    layers = amax_values(input_amax, f"{path}: input_amax")
    kv = _kv_values(refuse_scales(kv_amax or {}, f"{path}: kv_amax"), f"{path}: kv_amax")
    _check_kv_split(path, layers, kv)
    doc = {"format": CALIBRATION_FORMAT, "holds": "amax", "fp8ref_version": __version__,
           "input_amax": dict(sorted(layers.items())), "kv_amax": dict(sorted(kv.items()))}
    write_bytes(path, (json.dumps(doc, indent=1) + "\n").encode())
    return path


def _kv_values(kv: Mapping, where: str) -> dict[str, float | list[float]]:
    """KV-cache (and Q) amax by key: one number (see ``amax_number``), or a list of numbers, one per
    head (a list, or an array of more than one element)."""
    out = {}
    for k, v in kv.items():
        per_head = isinstance(v, (list, tuple)) or (isinstance(v, np.ndarray) and v.size > 1)
        out[str(k)] = (list(_kv_amax(str(k), v, where)) if per_head else amax_number(v, f"{where}[{k!r}]"))
    return out


def _check_kv_split(where, layers: Mapping, kv: Mapping) -> None:
    not_kv = [k for k in kv if k in split_calibration({k: kv[k]}, str(where))[0]]
    if not_kv:
        raise CheckpointError(f"{where}: kv_amax[{not_kv[0]!r}]: expected a KV-cache key (ATTN.k_scale, ATTN.v_scale, "
                              "ATTN.k_proj.output_amax, ATTN.v_proj.output_amax) or the query's ATTN.q_scale")
    is_kv = [k for k in layers if not split_calibration({k: layers[k]}, str(where))[0]]
    if is_kv:
        raise CheckpointError(f"{where}: input_amax[{is_kv[0]!r}]: a KV-cache key; put it under kv_amax")


def load_calibration(path: str | os.PathLike) -> dict[str, float]:
    """The activation amax (and KV-cache amax) of a file ``write_calibration`` wrote: JSON with
    ``"format": "fp8ref-calibration/1"``, ``"holds": "amax"``, ``"input_amax"`` and ``"kv_amax"``, or
    safetensors whose metadata has the same ``format`` and ``holds`` (one-element tensors named
    ``layer`` or a KV-cache key). Anything else, a bare ``{layer: value}`` object included, is refused:
    nothing says whether it holds amax or scales."""
    path = path_arg(path)
    if path.suffix == ".safetensors":
        store = open_store(path)
        meta = next(iter(store.files.values())).metadata or {}
        if meta.get("format") != CALIBRATION_FORMAT or meta.get("holds") != "amax":
            raise CheckpointError(f"{path}: safetensors metadata {dict(meta)!r:.120}: {_NOT_CALIBRATION}")
        raw = {}
        for name in store:
            values = np.asarray(store.get(name)).astype(np.float64).reshape(-1)
            if values.size > 1 and not split_calibration({name: 0.0}, str(path))[0]:  # a KV/Q amax per head
                raw[name] = list(_kv_amax(name, values.tolist(), store.where(name)))
                continue
            if values.size != 1:
                raise CheckpointError(f"{store.where(name)}: an activation amax is one number, got shape "
                                      f"{list(store.info(name).shape)}")
            raw[name] = amax_number(float(values[0]), store.where(name))
        return raw
    data = read_json(path, "calibration file")
    if not isinstance(data, dict) or data.get("format") != CALIBRATION_FORMAT:
        raise CheckpointError(f"{path}: {_NOT_CALIBRATION}")
    unknown = sorted(set(data) - set(_CALIBRATION_KEYS))
    if unknown:
        raise CheckpointError(f"{path}: unknown key {unknown[0]!r}; a calibration file has {list(_CALIBRATION_KEYS)}")
    if data.get("holds") != "amax":
        raise CheckpointError(f"{path}: \"holds\": expected \"amax\", got {shown(data.get('holds'))}; "
                              "fp8ref computes scales from amax itself (the recipe decides how)")
    sections = {}
    for key, required in (("input_amax", True), ("kv_amax", False)):
        value = data.get(key, None if required else {})
        if not isinstance(value, dict):
            raise CheckpointError(f"{path}: \"{key}\": expected an object of name -> amax, got {shown(value)}")
        sections[key] = (_kv_values(value, f"{path}: {key}") if key == "kv_amax"
                         else {k: amax_number(v, f"{path}: {key}[{k!r}]") for k, v in value.items()})
    _check_kv_split(path, sections["input_amax"], sections["kv_amax"])
    return {**sections["input_amax"], **sections["kv_amax"]}


# Calibration keys that carry the amax of an attention module's cached keys/values: the
# compressed-tensors tensor names, or the k/v projection's output amax (the ``.input_amax`` convention
# applied to outputs; what a forward hook on k_proj/v_proj records). vLLM and compressed-tensors
# quantize K after RoPE, so the amax of the rotated keys is the faithful value for ``k``. ``ATTN.q_scale``
# is the query's amax (after RoPE, as compressed-tensors' attention hook sees it; compressed-tensors only).
KV_KEYS = (("k_scale", "k"), ("v_scale", "v"), ("k_proj.output_amax", "k"), ("v_proj.output_amax", "v"),
           ("q_scale", "q"))

def _kv_amax(key: str, value, where: str) -> float | tuple[float, ...]:
    """A KV-cache amax: one number, or a list of them (one per KV head: a per-head scale)."""
    per_head = isinstance(value, (list, tuple, np.ndarray)) and not isinstance(value, (str, bytes))
    items = list(np.asarray(value, dtype=object).reshape(-1)) if per_head else [value]
    if per_head and not items:
        raise CheckpointError(f"{where}: {key!r}: an empty list; a per-head KV-cache amax has one number per KV head")
    out = []
    for v in items:
        if (isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating))
                or (type(v) is int and abs(v) > 2**1024)):
            raise CheckpointError(f"{where}: {key!r}: expected a number (KV-cache amax) or a list of them (one "
                                  f"per KV head), got {shown(value)}")
        if not np.isfinite(float(v)) or float(v) < 0:
            raise CheckpointError(f"{where}: {key!r}: a KV-cache amax must be a finite number >= 0, got {v!r:.80}")
        out.append(float(v))
    return tuple(out) if per_head else out[0]


def split_calibration(calibration: Mapping[str, float], where: str = "calibration"
                      ) -> tuple[dict[str, float], dict[str, dict[str, tuple[str, float]]]]:
    """(layer -> input amax, attention module -> {"k"|"v"|"q": (calibration key, amax)})."""
    layers: dict[str, float] = {}
    kv: dict[str, dict[str, tuple[str, float]]] = {}
    for key, value in calibration.items():
        if not isinstance(key, str):
            raise CheckpointError(f"{where}: key {key!r}: expected a layer or KV-cache name (str)")
        match = next(((key[: -len(suffix) - 1], which) for suffix, which in KV_KEYS
                      if key.endswith("." + suffix)), None)
        if match is None:
            layers[key] = value
            continue
        amax = _kv_amax(key, value, where)
        attn, which = match
        old = kv.setdefault(attn, {}).setdefault(which, (key, amax))
        if old[1] != amax:
            raise CheckpointError(f"{where}: {old[0]!r} = {old[1]!r} and {key!r} = {amax!r} give the same "
                                  f"KV-cache amax ({attn}.{which}_scale) two values")
    return layers, kv
