"""KV-cache quantized attention: where a checkpoint carries KV-cache scales (compressed-tensors'
``kv_cache_scheme`` with ``<attn>.k_scale`` / ``v_scale``, auto-round's static KV, with a
``q_scale`` where it declares one), the attention of every such module runs as the mode says.
Hooked in through transformers' attention-function registry (``ALL_ATTENTION_FUNCTIONS``),
wrapping the model's own implementation; K and V arrive after RoPE, as a serving engine caches them.

Per mode: ``reference``: ``fp8ref.attention.attention`` (the one reference, also the golden
``attention`` operation's: K, V (and Q) quantized with the stored per-tensor scales, bmm1, softmax
and bmm2 in a declared float64 order, rounded once to the model dtype); ``backend:NAME``: the
backend's ``attention`` when it declares one for the case, else the reference; ``producer``: the
producer's fake-quantize of K and V in the model dtype (compressed-tensors' ``forward_quantize``: D
division, clamp, e4m3, D product; Q too where a q_scale is stored), then transformers' own attention
(unquantized K and V for a format whose reload drops the scales: auto-round's,
``kv_reload_quantizes``); ``original``:
transformers' attention on unquantized K and V.
"""

from __future__ import annotations

import numpy as np
import torch

from .. import attention as ref
from .._arrays import dtype_name, numpy_of, torch_of
from ..attention import quantize_per_tensor
from ..checkpoint import base
from ..checkpoint.forward import qdq
from ..codec import decode
from ..errors import ModelError
from ..rounding import round_to
from .modes import parse_mode

NAME = "fp8ref_kv"
# longest first: ModelOpt's <attn>.k_proj.k_scale also ends with .k_scale
_SUFFIXES = {"k": (".k_proj.k_scale", ".k_scale", ".k_proj.output_scale"),
             "v": (".v_proj.v_scale", ".v_scale", ".v_proj.output_scale"), "q": (".q_scale",)}


def kv_scales(ckpt) -> dict[str, dict[str, np.ndarray]]:
    """attention module name -> {"k": scale, "v": scale[, "q": scale]} from the checkpoint: float32
    scalars, or float32 (heads,) for per-head scales (llm-compressor's attn_head; the loader has
    checked their count against config.json)."""
    out: dict[str, dict[str, np.ndarray]] = {}
    for name in ckpt.kv_scales:
        for which, suffixes in _SUFFIXES.items():
            for suffix in suffixes:
                if name.endswith(suffix):
                    s = np.asarray(ckpt.tensor(name)).astype(np.float32).reshape(-1)
                    out.setdefault(name[: -len(suffix)], {})[which] = s[0] if s.size == 1 else s
                    break
    for attn, d in out.items():
        if not {"k", "v"} <= set(d):
            raise ModelError(f"{ckpt.path}: {attn} has a {'/'.join(d)} KV-cache scale but not both")
    return out


def quantize_kv(x: torch.Tensor, scale: np.float32, mode) -> torch.Tensor:
    """K or V after the mode's KV-cache quantization, in x's dtype (``reference``: the codes of
    ``fp8ref.attention.quantize_per_tensor`` dequantized exactly, rounded once to the dtype)."""
    mode = parse_mode(mode)
    if mode.kind == "original":
        return x
    dtype = dtype_name(x)
    x32 = x.detach().to(torch.float32).numpy()
    # (B, Hkv, T, d): a per-head scale broadcasts over heads, as compressed-tensors' [Hkv, 1, 1] does
    s = np.asarray(scale, np.float32).reshape(-1, 1, 1) if np.ndim(scale) else np.float32(scale)
    if mode.kind == "producer":
        y = qdq(x32, s, dtype, d_division=True, positive_zero=True)
    else:
        codes = quantize_per_tensor(x32, s)
        y = round_to(decode(codes, "float8_e4m3fn").astype(np.float64) * s.astype(np.float64), dtype)
    return torch.from_numpy(np.ascontiguousarray(np.asarray(y, np.float32))).to(x.dtype)


def _allowed(module, attention_mask, tq: int, tk: int):
    """(mask, causal) for the reference from what transformers passes: a bool mask (sdpa), an
    additive one of 0 and the dtype's minimum (eager), or None (sdpa's causal skip)."""
    if attention_mask is None:
        return None, bool(getattr(module, "is_causal", True)) and tq > 1
    m = attention_mask.detach()
    if m.dtype == torch.bool:
        return m.numpy(), False
    low = torch.finfo(m.dtype).min / 2
    if not bool(((m == 0) | (m <= low)).all()):
        raise ModelError("fp8ref_kv attention: an additive attention bias other than a 0 / -inf mask "
                         "is not part of the reference attention")
    return (m == 0).numpy(), False


def reference_attention(module, query, key, value, attention_mask, scaling, state, backend=None):
    """(B, Tq, H, d) in query's dtype: ``fp8ref.attention.attention`` (or ``backend.attention``)."""
    dtype = dtype_name(query)
    q, k, v = (numpy_of(t).astype(np.float32) for t in (query, key, value))
    mask, causal = _allowed(module, attention_mask, q.shape[2], k.shape[2])
    q_scale = state.get("q")
    if backend is not None and mask is None:
        f32 = np.float32
        out = backend.attention(numpy_of(query), numpy_of(key), numpy_of(value), np.array(state["k"], f32).reshape(-1),
                                np.array(state["v"], f32).reshape(-1),
                                q_scale=None if q_scale is None else np.array(q_scale, f32).reshape(-1),
                                fmt="float8_e4m3fn", causal=causal)
        out = np.asarray(out).astype(np.float32)
    else:
        out = ref.attention(q, k, v, state["k"], state["v"], dtype=dtype, q_scale=q_scale, causal=causal,
                            mask=mask, sm_scale=scaling)
    return torch_of(np.ascontiguousarray(out, np.float32)).to(query.dtype).transpose(1, 2).contiguous()


def _backend_for(state, module, query, attention_mask):
    """The backend object that runs this attention in a backend:NAME mode, or None for the reference."""
    mode = state["mode"]
    if mode.kind != "backend" or attention_mask is not None:
        return None  # a backend's attention takes a causal flag, not a mask
    if any(np.ndim(state[w]) for w in "kvq" if w in state):
        return None  # the backend protocol passes one scale per tensor; per-head scales run the reference
    be = state["backends"].get(mode.arg)
    if be is None:
        raise ModelError(f"mode {mode} needs its backend object; have {sorted(state['backends']) or 'none'}")
    params = {"format": "float8_e4m3fn", "dtype": dtype_name(query), "quantize": "qkv" if "q" in state else "kv",
              "causal": bool(getattr(module, "is_causal", True)) and query.shape[2] > 1}
    return be if be.implements("attention", params) is None else None


def _attention(module, query, key, value, attention_mask=None, *args, **kwargs):
    state = module.fp8ref_kv
    mode = state["mode"]
    if mode.kind in ("reference", "backend"):
        for k in ("sliding_window", "softcap"):
            if kwargs.get(k) is not None:
                raise ModelError(f"fp8ref_kv attention: {k}={kwargs[k]!r} is not part of the reference attention")
        if kwargs.get("dropout", 0.0) and module.training:
            raise ModelError("fp8ref_kv attention: dropout is not part of the reference attention")
        return reference_attention(module, query, key, value, attention_mask, kwargs.get("scaling"), state,
                                   _backend_for(state, module, query, attention_mask)), None
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    refusal = state.get("producer_refusal")
    if mode.kind == "producer" and refusal:
        raise ModelError(f"mode 'producer' with this checkpoint's KV cache: {refusal}; build the model with "
                         f"kv_cache=False (unquantized attention) or use mode 'reference'")
    if mode.kind != "producer" or state.get("producer_quantizes", True):
        key = quantize_kv(key, state["k"], mode)
        value = quantize_kv(value, state["v"], mode)
        if "q" in state:  # compressed-tensors' QuantizedAttentionImpl: the same forward_quantize of Q
            query = quantize_kv(query, state["q"], mode)
    return ALL_ATTENTION_FUNCTIONS[state["impl"]](module, query, key, value, attention_mask, *args, **kwargs)


def install_kv_attention(model, ckpt, mode, backend=None) -> list[str]:
    """Run every attention module the checkpoint has KV scales for as ``mode`` says; returns their
    names. backend: the backend object (or mapping name -> backend) of ``backend:NAME`` modes."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    scales = kv_scales(ckpt)
    if not scales:
        return []

    impl = model.config._attn_implementation
    fmt = base.get(ckpt.format) if ckpt.format in base.names() else None
    producer_quantizes = fmt is None or fmt.kv_reload_quantizes
    refusal = None if fmt is None else fmt.kv_producer_refusal
    backends = {} if backend is None else dict(backend) if isinstance(backend, dict) else {backend.name: backend}
    if impl == NAME:
        raise ModelError("install_kv_attention: the model's attention is already fp8ref's")
    for attn, s in scales.items():
        try:
            module = model.get_submodule(attn)
        except AttributeError:
            raise ModelError(f"{ckpt.path}: KV-cache scales for {attn!r}, which the model does not have") from None
        module.fp8ref_kv = {**s, "mode": parse_mode(mode), "impl": impl, "backends": backends,
                            "producer_quantizes": producer_quantizes, "producer_refusal": refusal}
    ALL_ATTENTION_FUNCTIONS.register(NAME, _attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS[impl])
    model.set_attn_implementation(NAME)
    return sorted(scales)
