"""KV-cache quantized attention: where a checkpoint carries KV-cache scales (compressed-tensors'
``kv_cache_scheme`` with ``<attn>.k_scale`` / ``v_scale``, auto-round's static KV), the keys and
values (after RoPE, as a serving engine caches them) are quantized with the stored per-tensor
scales before the attention of transformers runs on them. Hooked in through transformers'
attention-function registry (``ALL_ATTENTION_FUNCTIONS``), wrapping the model's own implementation.

Per mode: ``reference`` / ``backend:NAME``: q = encode(fp32(x / s)) (RNE, saturating), then
decode(q) * s exactly, rounded once to the model dtype; ``producer``: the producer's fake-quantize
in the model dtype (compressed-tensors' ``forward_quantize``: D division, clamp, e4m3, D product:
the arithmetic of its input activations); ``original``: K and V unquantized. The attention matmuls
and softmax themselves are transformers', in the model dtype: not a computation fp8ref defines.
"""

from __future__ import annotations

import numpy as np
import torch

from .._arrays import dtype_name
from ..errors import ModelError
from .modes import parse_mode

NAME = "fp8ref_kv"
_SUFFIXES = {"k": (".k_scale", ".k_proj.output_scale"), "v": (".v_scale", ".v_proj.output_scale")}


def kv_scales(ckpt) -> dict[str, dict[str, np.ndarray]]:
    """attention module name -> {"k": scale, "v": scale} (float32 scalars) from the checkpoint."""
    out: dict[str, dict[str, np.ndarray]] = {}
    for name in ckpt.kv_scales:
        for which, suffixes in _SUFFIXES.items():
            for suffix in suffixes:
                if name.endswith(suffix):
                    s = np.asarray(ckpt.tensor(name)).astype(np.float32).reshape(-1)
                    if s.size != 1:
                        raise ModelError(f"{ckpt.store.where(name)}: {s.size} KV-cache scales; the reference "
                                         f"attention takes one per tensor")
                    out.setdefault(name[: -len(suffix)], {})[which] = s[0]
    for attn, d in out.items():
        if set(d) != {"k", "v"}:
            raise ModelError(f"{ckpt.path}: {attn} has a {'/'.join(d)} KV-cache scale but not both")
    return out


def quantize_kv(x: torch.Tensor, scale: np.float32, mode) -> torch.Tensor:
    """K or V after the mode's KV-cache quantization, in x's dtype."""
    from ..codec import decode, encode
    from ..formats import FORMATS
    from ..rounding import round_to

    mode = parse_mode(mode)
    if mode.kind == "original":
        return x
    dtype = dtype_name(x)
    x32 = x.detach().to(torch.float32).numpy()
    if mode.kind == "producer":
        from ..checkpoint.forward import qdq

        y = qdq(x32, np.float32(scale), dtype, d_division=True, positive_zero=True)
    else:
        fmt = FORMATS["float8_e4m3fn"]
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            codes = encode((x32 / np.float32(scale)).astype(np.float32), fmt)
        y = round_to(decode(codes, fmt).astype(np.float64) * np.float64(scale), dtype)
    return torch.from_numpy(np.ascontiguousarray(np.asarray(y, np.float32))).to(x.dtype)


def _attention(module, query, key, value, *args, **kwargs):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    state = module.fp8ref_kv
    key = quantize_kv(key, state["k"], state["mode"])
    value = quantize_kv(value, state["v"], state["mode"])
    return ALL_ATTENTION_FUNCTIONS[state["impl"]](module, query, key, value, *args, **kwargs)


def install_kv_attention(model, ckpt, mode) -> list[str]:
    """Quantize K and V of every attention module the checkpoint has KV scales for; returns their names."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    scales = kv_scales(ckpt)
    if not scales:
        return []
    impl = model.config._attn_implementation
    if impl == NAME:
        raise ModelError("install_kv_attention: the model's attention is already fp8ref's")
    for attn, s in scales.items():
        try:
            module = model.get_submodule(attn)
        except AttributeError:
            raise ModelError(f"{ckpt.path}: KV-cache scales for {attn!r}, which the model does not have") from None
        module.fp8ref_kv = {"k": s["k"], "v": s["v"], "mode": parse_mode(mode), "impl": impl}
    ALL_ATTENTION_FUNCTIONS.register(NAME, _attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS[impl])
    model.set_attn_implementation(NAME)
    return sorted(scales)
