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

TARGETS = ("cuda", "rocm-mi300", "cpu")
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
    ``elements``), the largest |change| of a value (None where the new values are not defined: random
    initialisation, a load that raises), and what happened."""

    step: str
    layer: str
    codes_changed: int
    values_changed: int
    elements: int
    max_abs_change: float | None  # None: not a number (the values are random, or never loaded)
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


def explain(ckpt, engine: str = "vllm", *, target: str | None = None) -> tuple[dict, list[Step], list[Effect]]:
    """(engine metadata, the steps that run on ``target``, their effects on ``ckpt``'s layers).
    target None: the target most of its steps name (``default_target``)."""
    meta, steps = load_engine(engine)
    if target is None:
        target = default_target(steps)
    if target not in TARGETS:
        raise CheckpointError(f"target: {target!r}; expected one of {', '.join(TARGETS)}")
    steps = [s for s in steps if target in s.targets]
    effects = [e for s in steps for e in OPS[s.op](ckpt, s.name)]
    return {**meta, "target": target}, steps, effects


def default_target(steps: list[Step]) -> str:
    """The target most of the engine's steps name (ties: the first of TARGETS): vllm cuda, transformers cpu."""
    return max(TARGETS, key=lambda t: (sum(t in s.targets for s in steps), -TARGETS.index(t)))


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


# --- transformers 5.17 on CPU (specs/engines/transformers.yaml) ------------------------------------

def _expert_blocks(ckpt) -> dict[str, list]:
    """MoE block -> its quantized expert projection layers (``BLOCK.experts.N.PROJ``)."""
    groups: dict[str, list] = {}
    for name, layer in ckpt.items():
        m = _EXPERT.match(name)
        if m:
            groups.setdefault(m.group(1), []).append(layer)
    return groups


def unloaded_experts(ckpt, step: str) -> list[Effect]:
    """Experts stored under names transformers does not read for the config's model_type
    (``expert_names.EXPECTED``: llm-compressor writes Mixtral's w1/w3/w2 as gate/up/down_proj): their
    tensors are UNEXPECTED keys of the load report, the model keeps its random initialisation, so
    every value of those experts changes. ``codes_changed`` counts the unexpected tensors."""
    from .expert_names import EXPECTED

    expected = EXPECTED.get(ckpt.config.get("model_type"))
    if expected is None:
        return []
    names = list(ckpt.store)
    out = []
    for block in sorted(_expert_blocks(ckpt) | _unquantized_blocks(ckpt)):
        prefix = block + "."
        wrong = [n for n in names if n.startswith(prefix) and n[len(prefix):].split(".")[1] not in expected]
        if not wrong:
            continue
        elements = sum(int(np.prod(ckpt.store.info(n).shape)) for n in wrong if n.endswith(".weight"))
        projs = "/".join(sorted({n[len(prefix):].split(".")[1] for n in wrong}))
        out.append(Effect(step, block, len(wrong), elements, elements, None,
                          f"{len(wrong)} tensors named {projs} are UNEXPECTED (transformers reads "
                          f"{'/'.join(expected)}): the experts run on randomly initialised weights; the load "
                          f"report says so on stderr only"))
    return out


def _unquantized_blocks(ckpt) -> dict[str, list]:
    blocks: dict[str, list] = {}
    for name in ckpt.unquantized:
        m = _EXPERT.match(name)
        if m:
            blocks.setdefault(m.group(1), [])
    return blocks


def row_blocks(ckpt, step: str) -> list[Effect]:
    """hf-fp8 block weights whose rows (or columns) are not a multiple of the declared block but
    divide evenly by the scale grid: transformers' ``Fp8Dequantize`` takes the block as the weight
    shape over the scale grid (a [160, 128] weight with 2 scale rows: 80-row blocks). Values: the
    exact q * s under transformers' blocks against the format's (the last block cropped)."""
    from .hf_fp8 import transformers_block_quirk

    out = []
    for name, layer in ckpt.items():
        q = layer.quant
        if layer.producer != "hf-fp8" or q.weight_strategy != "block":
            continue
        quirk = transformers_block_quirk(*layer.shape, q.block)
        if quirk is None:
            continue
        s = np.asarray(layer.weight_scale).astype(np.float64)
        rows, cols = layer.shape
        mine = np.repeat(np.repeat(s, quirk[0], axis=0), quirk[1], axis=1)[:rows, :cols]
        old, new = _values(layer, layer.expanded_scale()), _values(layer, mine)
        out.append(Effect(step, name, 0, int(np.count_nonzero(old != new)), old.size,
                          float(np.abs(new - old).max(initial=0.0)),
                          f"{quirk[0]}x{quirk[1]} blocks where the format declares {q.block[0]}x{q.block[1]}"))
    return out


def experts_unquantized_inputs(ckpt, step: str) -> list[Effect]:
    """MoE experts after transformers' load: each expert's weight dequantized to bfloat16 at load
    (compressed-tensors ``DecompressExperts``: bf16(fp32(q) * fp32(s)); hf-fp8 ``Fp8Dequantize``) and
    run by the fused experts forward, which no quantized linear wraps: W8A16, stored input scales
    ignored. Values: the bf16 weight against the exact q * s."""
    from ..rounding import round_to

    out = []
    for block, layers in sorted(_expert_blocks(ckpt).items()):
        changed = elements = 0
        worst = 0.0
        for layer in layers:
            if layer.producer not in ("compressed-tensors", "hf-fp8"):
                continue
            exact = _values(layer, layer.expanded_scale())
            with np.errstate(over="ignore"):
                bf16 = round_to(exact.astype(np.float32), "bfloat16").astype(np.float64)
            changed += int(np.count_nonzero(bf16 != exact))
            elements += exact.size
            worst = max(worst, float(np.abs(bf16 - exact).max(initial=0.0)))
        if not elements:
            continue
        inputs = sorted({la.quant.input or "none" for la in layers})
        ignored = sum(la.input_scale is not None for la in layers)
        out.append(Effect(step, block, 0, changed, elements, worst,
                          f"{len(layers)} expert projections run W8A16 (declared inputs: {', '.join(inputs)}; "
                          f"{ignored} stored input scales ignored)"))
    return out


def experts_broadcast(ckpt, step: str) -> list[Effect]:
    """compressed-tensors FP8 experts: ``DecompressExperts`` multiplies q [out, in] by the stored
    weight_scale as it stands (torch broadcasting): a block-scaled expert of more than one block per
    row and column does not broadcast and the load raises. One row per such expert."""
    out = []
    for _, layers in sorted(_expert_blocks(ckpt).items()):
        for layer in layers:
            if layer.producer != "compressed-tensors" or layer.quant.weight_strategy != "block":
                continue
            s_shape = tuple(np.asarray(layer.weight_scale).shape)
            try:
                np.broadcast_shapes(tuple(layer.shape), s_shape)
            except ValueError:
                out.append(Effect(step, layer.name, 0, int(np.prod(layer.shape)), int(np.prod(layer.shape)),
                                  None, f"weight {list(layer.shape)} x weight_scale {list(s_shape)} does not "
                                                f"broadcast: transformers' load raises"))
    return out


OPS = {"fnuz": fnuz, "requantize_max": requantize_max, "nvfp4_global_max": nvfp4_global_max,
       "moe_input_merge": moe_input_merge, "unloaded_experts": unloaded_experts, "row_blocks": row_blocks,
       "experts_unquantized_inputs": experts_unquantized_inputs, "experts_broadcast": experts_broadcast}
