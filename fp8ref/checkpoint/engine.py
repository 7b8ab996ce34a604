"""What a serving engine does to a checkpoint at load, and what it costs: ``explain``.

An engine is a YAML file under specs/engines/ (read through ``fp8ref.registry``): its load-time
steps, each naming one operation below that computes the step's exact effect on the stored codes
and on the dequantized values (float64: decode(q) * scale, exact), per layer. Nothing here runs
the engine; the arithmetic is the one its source declares (``source`` per step, ``verified: false``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from ..codec import decode, encode
from ..errors import CheckpointError
from ..registry import engine_document
from ..rounding import round_to
from .plan import FUSED_SIBLINGS

TARGETS = ("cuda", "rocm-mi300")
_STEP_KEYS = ("name", "op", "targets", "summary", "source")


@dataclass(frozen=True)
class Step:
    name: str
    op: str
    targets: tuple[str, ...]
    summary: str
    source: str


@dataclass(frozen=True)
class Effect:
    """One step on one layer: codes whose byte changes, dequantized values that change (of
    ``elements``), the largest |change| of a value, and what happened."""

    step: str
    layer: str
    codes_changed: int
    values_changed: int
    elements: int
    max_abs_change: float
    note: str


def load_engine(name: str) -> tuple[dict, list[Step]]:
    doc = engine_document(name)
    data = doc.data
    if not isinstance(data, dict) or set(data) != {"engine", "source", "verified", "steps"}:
        raise doc.error((), "expected exactly the keys engine, source, verified, steps")
    if data["engine"] != name:
        raise doc.error(("engine",), f"expected the file name {name!r}, got {data['engine']!r}")
    steps = []
    for i, s in enumerate(data["steps"] if isinstance(data["steps"], list) else []):
        if not isinstance(s, dict) or set(s) != set(_STEP_KEYS):
            raise doc.error(("steps", i), f"expected exactly the keys {', '.join(_STEP_KEYS)}")
        if s["op"] not in OPS:
            raise doc.error(("steps", i, "op"), f"expected one of {', '.join(OPS)}, got {s['op']!r}")
        if not isinstance(s["targets"], list) or not set(s["targets"]) <= set(TARGETS):
            raise doc.error(("steps", i, "targets"), f"expected a list of {', '.join(TARGETS)}")
        steps.append(Step(s["name"], s["op"], tuple(s["targets"]), s["summary"], s["source"]))
    if not steps:
        raise doc.error(("steps",), "expected a non-empty list of steps")
    return {k: data[k] for k in ("engine", "source", "verified")}, steps


def explain(ckpt, engine: str = "vllm", *, target: str = "cuda") -> tuple[dict, list[Step], list[Effect]]:
    """(engine metadata, the steps that run on ``target``, their effects on ``ckpt``'s layers)."""
    if target not in TARGETS:
        raise CheckpointError(f"target: {target!r}; expected one of {', '.join(TARGETS)}")
    meta, steps = load_engine(engine)
    steps = [s for s in steps if target in s.targets]
    effects = [e for s in steps for e in OPS[s.op](ckpt, s.name)]
    return meta, steps, effects


# --- the operations ---------------------------------------------------------------------------

def _values(layer, scale) -> np.ndarray:
    return decode(layer.weight_codes, layer.quant.weight_fmt).astype(np.float64) * scale


def _fused_groups(ckpt, keep) -> list[list]:
    """Layers (passing ``keep``) that an engine fuses into one GEMM: q/k/v, gate/up, w1/w3 siblings."""
    groups: dict[tuple, list] = {}
    for name, layer in ckpt.items():
        if not keep(layer):
            continue
        parent, leaf = name.rsplit(".", 1) if "." in name else ("", name)
        group = next((g for g in FUSED_SIBLINGS if leaf in g), None)
        if group is not None:
            groups.setdefault((parent, group), []).append(layer)
    return [v for v in groups.values() if len(v) > 1]


def _e4m3_float_scaled(layer) -> bool:
    return layer.quant.weight_fmt == "float8_e4m3fn" and layer.quant.weight_strategy in ("tensor", "channel", "block")


def fnuz(ckpt, step: str) -> list[Effect]:
    """e4m3fnuz has bias 8 where e4m3fn has 7: every code reads as half its e4m3fn value and the
    doubled scale restores it exactly; only 0x80 (e4m3fn -0, e4m3fnuz NaN) is rewritten, to +0."""
    out = []
    for name, layer in ckpt.items():
        if _e4m3_float_scaled(layer):
            codes = layer.weight_codes
            n = int(np.count_nonzero(codes == 0x80))
            out.append(Effect(step, name, n, 0, codes.size, 0.0, f"{n} codes 0x80 (-0) -> 0x00; scales x 2, "
                                                                  f"values unchanged"))
    return out


def requantize_max(ckpt, step: str) -> list[Effect]:
    out = []
    per_tensor = lambda la: _e4m3_float_scaled(la) and la.quant.weight_strategy == "tensor"  # noqa: E731
    for group in _fused_groups(ckpt, per_tensor):
        scales = [np.float32(np.asarray(la.weight_scale, np.float32).reshape(-1)[0]) for la in group]
        s_max = max(scales)
        if all(s == s_max for s in scales):
            continue  # one shared scale: vLLM skips the requantization
        inv = np.float32(np.float32(1.0) / s_max)
        for layer, s in zip(group, scales):
            old = _values(layer, np.float64(s))
            with np.errstate(over="ignore"):
                v16 = round_to(old, "float16").astype(np.float32)  # fp16(q * s_i): one rounding of the exact product
                x = np.clip(v16 * inv, -448.0, 448.0).astype(np.float32)
            codes = encode(x, "float8_e4m3fn")
            new = decode(codes, "float8_e4m3fn").astype(np.float64) * np.float64(s_max)
            changed = old != new
            out.append(Effect(step, layer.name, int(np.count_nonzero(codes != layer.weight_codes)),
                              int(np.count_nonzero(changed)), old.size,
                              float(np.abs(new - old).max(initial=0.0)),
                              f"scale {float(s):.6g} -> max over {len(group)} shards {float(s_max):.6g}"))
    return out


def nvfp4_global_max(ckpt, step: str) -> list[Effect]:
    out = []
    keep = lambda la: la.quant.weight_strategy == "nvfp4" and la.quant.global_scale == "divisor"  # noqa: E731
    for group in _fused_groups(ckpt, keep):
        gs = [np.float32(np.asarray(la.weight_global, np.float32).reshape(-1)[0]) for la in group]
        g_max = max(gs)
        if all(g == g_max for g in gs):
            continue
        for layer, g in zip(group, gs):
            sb = layer.expanded_scale()
            old, new = _values(layer, sb / np.float64(g)), _values(layer, sb / np.float64(g_max))
            out.append(Effect(step, layer.name, 0, int(np.count_nonzero(old != new)), old.size,
                              float(np.abs(new - old).max(initial=0.0)),
                              f"divisor {float(g):.6g} -> max {float(g_max):.6g}: values x {float(g / g_max):.6g}"))
    return out


_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(.+)$")


def moe_input_merge(ckpt, step: str) -> list[Effect]:
    """Per MoE projection, one input scale for all experts: max of FP8 multipliers, min of NVFP4
    divisors. Codes are untouched; ``values_changed`` counts the experts whose input scale changes."""
    groups: dict[tuple, list] = {}
    for name, layer in ckpt.items():
        m = _EXPERT.match(name)
        if m and layer.quant.input in ("static", "nvfp4") and layer.input_scale is not None:
            groups.setdefault((m.group(1), m.group(3)), []).append(layer)
    out = []
    for (prefix, proj), layers in sorted(groups.items()):
        s = [float(np.asarray(la.input_scale, np.float32).reshape(-1)[0]) for la in layers]
        divisor = layers[0].quant.input == "nvfp4" and layers[0].quant.global_scale == "divisor"
        merged = min(s) if divisor else max(s)
        n = sum(v != merged for v in s)
        out.append(Effect(step, f"{prefix}.*.{proj}", 0, n, len(s), float(max(abs(v - merged) for v in s)),
                          f"{len(s)} experts' input scales -> {'min' if divisor else 'max'} {merged:.6g}"))
    return out


OPS = {"fnuz": fnuz, "requantize_max": requantize_max, "nvfp4_global_max": nvfp4_global_max,
       "moe_input_merge": moe_input_merge}
