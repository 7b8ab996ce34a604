"""What a serving engine does to a checkpoint at load, and what it costs: ``explain``.

An engine is a YAML file under specs/engines/ (read through ``fp8ref.registry``): its load-time
steps, each naming one operation below that computes the step's exact effect on the stored codes
and on the dequantized values (float64: decode(q) * scale, exact), per layer. Nothing here runs
the engine; the arithmetic is the one its source declares (``source`` per step, ``verified: false``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import partial

import numpy as np

from ..codec import decode, encode
from ..errors import CheckpointError
from ..quant import QuantArgs, requantize
from ..registry import engine_document
from ..rounding import round_to
from ..scaling import ceil_to_ue8m0, expand
from .plan import FUSED_SIBLINGS

# cuda: any NVIDIA GPU; hopper (sm90) and blackwell (sm100/sm120 families) are CUDA targets too, so a
# step declared for cuda also runs there, and a step declared for one of them runs only there.
TARGETS = ("cuda", "hopper", "blackwell", "rocm-mi300", "cpu")
CUDA_TARGETS = ("hopper", "blackwell")
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
    figures: dict = field(default_factory=dict)  # a step's own measures (rel RMS, factors), for --json


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
    steps = [s for s in steps if runs_on(s, target)]
    effects = [e for s in steps for e in
               (OPS[s.op](ckpt, s.name, target) if s.op in TARGET_AWARE else OPS[s.op](ckpt, s.name))]
    return {**meta, "target": target}, steps, effects


def runs_on(step: Step, target: str) -> bool:
    return target in step.targets or (target in CUDA_TARGETS and "cuda" in step.targets)


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
        s_max = max(scales)  # equal scales too: vLLM skips only a checkpoint that stores the fused weight
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


# --- DeepGEMM's UE8M0 block scales (specs/engines/vllm.yaml, sglang.yaml) ------------------------

DEEPGEMM_BLOCK = (128, 128)
# vLLM 0.33.0 vllm/utils/deep_gemm.py _DEEPGEMM_BLACKWELL_EXCLUDED_MODEL_TYPES ("Accuracy"): no DeepGEMM
# for these text model types on the sm100/sm120 families, hence no requantization.
VLLM_NO_DEEPGEMM_ON_BLACKWELL = ("qwen3_5_text", "qwen3_5_moe_text")


def _model_type(ckpt) -> str | None:
    text = ckpt.config.get("text_config")
    return (text if isinstance(text, dict) else ckpt.config).get("model_type")


def _fused_rows(ckpt, name: str, layer) -> int:
    """Output rows of the GEMM this layer is part of: q/k/v and gate/up shards fuse into one weight."""
    parent, leaf = name.rsplit(".", 1) if "." in name else ("", name)
    group = next((g for g in FUSED_SIBLINGS if leaf in g), (leaf,))
    prefix = parent + "." if parent else ""
    return sum(ckpt[prefix + g].shape[0] for g in group if (prefix + g) in ckpt) or layer.shape[0]


def _rel_rms(new: np.ndarray, old: np.ndarray) -> float:
    norm = float(np.sqrt(np.sum(old * old)))
    return 0.0 if norm == 0 else float(np.sqrt(np.sum((new - old) ** 2)) / norm)


def kept_codes_cost(layer) -> dict:
    """A block-FP8 layer whose codes are kept while each float32 scale is rounded up to a power of two
    (DeepGEMM's ``ceil_to_ue8m0``, transformers' ``_ceil_to_ue8m0``: what transformers <= 5.16 did on
    SM100, #47030): every value of a block x ceil(s)/s in [1, 2). The largest factor (over non-zero
    scales: a zero scale stays a zero block) and the relative RMS against the stored q * s."""
    s = np.asarray(layer.weight_scale, np.float64)
    up = ceil_to_ue8m0(s.astype(np.float32)).astype(np.float64)
    block = tuple(layer.quant.block)
    old = _values(layer, expand(s, layer.weight_codes.shape, "block", block_shape=block))
    kept = _values(layer, expand(up, layer.weight_codes.shape, "block", block_shape=block))
    return {"kept_rel_rms": _rel_rms(kept, old), "kept_max_factor": float(np.max(up[s > 0] / s[s > 0], initial=1.0))}


def ue8m0_costs(layer, recipe: str, via: tuple[str, ...]) -> dict:
    """One 128x128 block-FP8 layer under DeepGEMM's UE8M0 scales, two ways, against the stored
    q * s (float64, exact): requantized as the engine does (``quant.requantize``: new codes and
    power-of-two scales), and with the codes kept (``kept_codes_cost``)."""
    codes = layer.weight_codes
    s = np.asarray(layer.weight_scale, np.float64)
    args = QuantArgs(granularity="block", block_shape=DEEPGEMM_BLOCK)
    old = _values(layer, expand(s, codes.shape, "block", block_shape=DEEPGEMM_BLOCK))
    res = requantize(codes, s.astype(np.float32), args, recipe=recipe, via=via)
    new_scale = np.asarray(res.scale, np.float64)
    new = decode(np.asarray(res.codes), "float8_e4m3fn").astype(np.float64) * \
        expand(new_scale, codes.shape, "block", block_shape=DEEPGEMM_BLOCK)
    return {"codes": np.asarray(res.codes), "scale": new_scale, "values": new, "old": old,
            "codes_changed": int(np.count_nonzero(np.asarray(res.codes) != codes)),
            "scales_changed": int(np.count_nonzero(new_scale != s)), "blocks": int(s.size),
            "requant_rel_rms": _rel_rms(new, old), **kept_codes_cost(layer)}


def transformers_sm100_fp8(ckpt, step: str) -> list[Effect]:
    """transformers 5.17's FP8Linear on SM100 (hf-fp8 block layers): DeepGEMM with the checkpoint's own
    UE8M0 scales (``scale_fmt: ue8m0``, loaded as float8_e8m0fnu), exact; float32 scales make
    ``_assert_sm100_requirements`` raise, ``fp8_linear`` falls back to the Triton kernel, which uses
    them as stored: nothing changes. The figures say what 5.12 did with them (#47030: codes kept, scales
    rounded up)."""
    out = []
    for name, layer in ckpt.items():
        q = layer.quant
        if layer.producer != "hf-fp8" or q.weight_strategy != "block":
            continue
        size = int(np.prod(layer.shape))
        if q.scale_fmt == "ue8m0":
            out.append(Effect(step, name, 0, 0, size, 0.0, "UE8M0 scales: DeepGEMM with the stored scales, exact"))
            continue
        c = kept_codes_cost(layer)
        out.append(Effect(step, name, 0, 0, size, 0.0,
                          f"float32 scales: DeepGEMM declined, Triton with the stored scales (unchanged); "
                          f"transformers 5.12 kept the codes and rounded the scales up: values x up to "
                          f"{c['kept_max_factor']:.4g}, rel RMS {c['kept_rel_rms']:.3g}", c))
    return out


def _ue8m0_reason(ckpt, name: str, layer, target: str, engine: str) -> str | None:
    """Why the engine's DeepGEMM path does not take this layer (its scales stay float32), or None."""
    if tuple(layer.quant.block) != DEEPGEMM_BLOCK:
        return f"{layer.quant.block[0]}x{layer.quant.block[1]} blocks (DeepGEMM takes 128x128 only)"
    if engine == "vllm" and target == "blackwell" and _model_type(ckpt) in VLLM_NO_DEEPGEMM_ON_BLACKWELL:
        return f"model_type {_model_type(ckpt)}: vLLM turns DeepGEMM off on Blackwell for accuracy"
    if _EXPERT.match(name):
        return None  # grouped MoE GEMM: no N/K condition
    n, k = _fused_rows(ckpt, name, layer), layer.shape[1]
    if n % 64 or k % 128:
        return f"GEMM {n}x{k}: DeepGEMM needs N % 64 == 0 and K % 128 == 0 (CUTLASS/Triton keep fp32 scales)"
    return None


def ue8m0_requant(ckpt, step: str, target: str, *, engine: str, recipe: str, via: tuple[str, ...]) -> list[Effect]:
    """Block-FP8 layers that the engine runs on DeepGEMM with UE8M0 scales: every code requantized to
    power-of-two block scales at load (``ue8m0_costs``). A layer DeepGEMM does not take keeps its
    float32 scales (one row saying why, nothing changed)."""
    out = []
    for name, layer in ckpt.items():
        q = layer.quant
        if q.weight_fmt != "float8_e4m3fn" or q.weight_strategy != "block":
            continue
        size = int(np.prod(layer.shape))
        why = _ue8m0_reason(ckpt, name, layer, target, engine)
        if why is not None:
            out.append(Effect(step, name, 0, 0, size, 0.0, f"kept: {why}"))
            continue
        c = ue8m0_costs(layer, recipe, via)
        changed = int(np.count_nonzero(c["values"] != c["old"]))
        figures = {k: c[k] for k in ("scales_changed", "blocks", "requant_rel_rms", "kept_rel_rms",
                                     "kept_max_factor")}
        out.append(Effect(step, name, c["codes_changed"], changed, size,
                          float(np.abs(c["values"] - c["old"]).max(initial=0.0)),
                          f"scales {c['scales_changed']}/{c['blocks']} blocks -> powers of two, requantized "
                          f"(rel RMS {c['requant_rel_rms']:.3g}); codes kept instead: values x up to "
                          f"{c['kept_max_factor']:.4g}, rel RMS {c['kept_rel_rms']:.3g}", figures))
    return out


# --- NVFP4 MoE: one global scale for the fused gate/up (w13) -----------------------------------

# policy -> (who, what). Multipliers m: ModelOpt weight_scale_2, or 1/g of a compressed-tensors divisor.
W13_POLICIES = {
    "gate": "the gate's (w1, shard 0) global for both halves: up dequantizes as q * s_b * m_gate",
    "max": "max(m_gate, m_up) for both halves, block scales not rescaled: the smaller half x max/own",
    "split": "each half its own global (separate GEMM1 alphas): exact",
}


def _multiplier(layer) -> float:
    g = float(np.asarray(layer.weight_global, np.float32).reshape(-1)[0])
    if layer.quant.global_scale == "divisor":
        return float(np.float32(np.float32(1.0) / np.float32(g)))  # 1.0 / w13_weight_global_scale in fp32
    return g


def _moe_w13_pairs(ckpt) -> dict[str, list[tuple]]:
    """MoE block -> [(expert, gate layer, up layer)] of NVFP4 experts."""
    pairs: dict[str, dict] = {}
    for name, layer in ckpt.items():
        m = _EXPERT.match(name)
        if m and layer.quant.weight_strategy == "nvfp4":
            leaf = m.group(3)
            half = "gate" if leaf in ("gate_proj", "w1") else "up" if leaf in ("up_proj", "w3") else None
            if half:
                pairs.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[half] = layer
    return {b: [(e, h["gate"], h["up"]) for e, h in sorted(ex.items()) if len(h) == 2] for b, ex in pairs.items()}


def moe_w13_global(ckpt, step: str, *, policy: str) -> list[Effect]:
    """Per NVFP4 MoE block and policy (the engine's first, marked): the gate/up halves' dequantized
    values under one w13 global scale against each half's own, over the experts whose gate and up
    globals differ. codes_changed is 0 (codes and block scales are kept); figures: the experts that
    differ, the up half's and the whole w13's relative RMS error, the range of factors."""
    out = []
    for block, pairs in sorted(_moe_w13_pairs(ckpt).items()):
        differ = [(e, g, u) for e, g, u in pairs if _multiplier(g) != _multiplier(u)]
        if not differ:
            out.append(Effect(step, block, 0, 0, 0, 0.0, f"{len(pairs)} experts: gate and up share one global"))
            continue
        for name in [policy] + [p for p in W13_POLICIES if p != policy]:
            out.append(_w13_effect(step, block, name, name == policy, pairs, differ))
    return out


def _w13_effect(step, block, policy, own, pairs, differ) -> Effect:
    changed = elements = 0
    worst, factors = 0.0, []
    err2 = {"gate": 0.0, "up": 0.0}
    ref2 = {"gate": 0.0, "up": 0.0}
    for _, gate, up in pairs:
        mg, mu = _multiplier(gate), _multiplier(up)
        used = {"gate": mg, "up": mg} if policy == "gate" else \
            {"gate": max(mg, mu), "up": max(mg, mu)} if policy == "max" else {"gate": mg, "up": mu}
        for half, layer, m in (("gate", gate, mg), ("up", up, mu)):
            sb = layer.expanded_scale()
            right = _values(layer, sb * np.float64(m))
            got = _values(layer, sb * np.float64(used[half]))
            d = got - right
            changed += int(np.count_nonzero(d))
            elements += d.size
            worst = max(worst, float(np.abs(d).max(initial=0.0)))
            err2[half] += float(np.sum(d * d))
            ref2[half] += float(np.sum(right * right))
            if used[half] != m:
                factors.append(used[half] / m)
    rel = {h: (np.sqrt(err2[h] / ref2[h]) if ref2[h] else 0.0) for h in err2}
    whole = np.sqrt((err2["gate"] + err2["up"]) / (ref2["gate"] + ref2["up"])) if ref2["up"] else 0.0
    span = f"x {min(factors):.4g}..{max(factors):.4g}" if factors else "exact"
    figures = {"policy": policy, "engine_policy": own, "experts": len(pairs), "experts_differ": len(differ),
               "gate_rel_rms": float(rel["gate"]), "up_rel_rms": float(rel["up"]), "w13_rel_rms": float(whole),
               "min_factor": min(factors, default=1.0), "max_factor": max(factors, default=1.0)}
    return Effect(step, f"{block} [{policy}{', this engine' if own else ''}]", 0, changed, elements, worst,
                  f"{len(differ)}/{len(pairs)} experts' gate and up globals differ; {W13_POLICIES[policy]}: "
                  f"values {span}, up half rel RMS {rel['up']:.3g}, gate half {rel['gate']:.3g}", figures)


OPS = {"fnuz": fnuz, "requantize_max": requantize_max, "nvfp4_global_max": nvfp4_global_max,
       "moe_input_merge": moe_input_merge, "unloaded_experts": unloaded_experts, "row_blocks": row_blocks,
       "experts_unquantized_inputs": experts_unquantized_inputs, "experts_broadcast": experts_broadcast,
       # vLLM 0.33.0: fp32(q) * fp32(s), then its own per_block_cast_to_fp8 (float32 log2)
       "ue8m0_requant": partial(ue8m0_requant, engine="vllm", recipe="vllm-block-ue8m0", via=("float32",)),
       # SGLang 0.5.23: (q.float() * s).to(bfloat16), then DeepGEMM's per_block_cast_to_fp8 (exact bit rule)
       "ue8m0_requant_bf16": partial(ue8m0_requant, engine="sglang", recipe="deepgemm-ue8m0",
                                     via=("float32", "bfloat16")),
       "moe_w13_gate_global": partial(moe_w13_global, policy="gate"),
       "transformers_sm100_fp8": transformers_sm100_fp8}
TARGET_AWARE = ("ue8m0_requant", "ue8m0_requant_bf16")
