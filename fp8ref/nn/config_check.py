"""A checkpoint's config.json checked before transformers builds a model from it.

transformers trusts its config: ``hidden_size: 2**40`` allocates until the machine gives out,
``num_attention_heads: 0`` divides by zero, ``hidden_act: "x"`` is a KeyError, ``rope_theta: -1``
runs and yields NaN logits. ``check_config`` refuses each with one line naming config.json and
the key, in three steps, none of which allocates in proportion to a number from the file:

1. every dimension and count in ``BOUNDS`` is an integer in its range, activation names are
   transformers' own (``ACT2FN``), dtype names are torch floating dtypes, ``rope_theta`` and the
   norm epsilons are finite (theta > 0), ``num_hidden_layers`` is at most the numbered blocks
   the checkpoint's tensors hold;
2. the model is built on torch's ``meta`` device (shapes, no memory) and every parameter the
   checkpoint also holds must have the stored shape;
3. the model's parameter count must not exceed what the checkpoint's tensors can fill (twice
   their element count: a packed FP4 byte holds two weights).
"""

from __future__ import annotations

import math

import torch

from ..checkpoint.loader import block_indices
from ..errors import ModelError, did_you_mean
from ..limits import int_in, shown

BOUNDS = {
    "hidden_size": 1 << 20, "intermediate_size": 1 << 20, "moe_intermediate_size": 1 << 20,
    "shared_expert_intermediate_size": 1 << 20, "vocab_size": 1 << 24, "head_dim": 1 << 16,
    "num_attention_heads": 1 << 16, "num_key_value_heads": 1 << 16, "num_hidden_layers": 1 << 16,
    "max_position_embeddings": 1 << 30, "num_experts": 1 << 16, "num_local_experts": 1 << 16,
    "n_routed_experts": 1 << 16, "n_shared_experts": 1 << 16, "num_experts_per_tok": 1 << 16,
}
"""config key -> the largest value accepted (the smallest is 1). Real models stay far below:
hidden 16,384 and vocab 262,144 are among the largest; products are bounded by step 3."""

EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts")
SHAPE_KEYS = ("hidden_size", "intermediate_size", "vocab_size", "num_attention_heads", "num_key_value_heads",
              "head_dim")
MOE_SHAPE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size",
                  "shared_expert_intermediate_size", "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim")
"""the config keys that set a parameter's shape, named when one disagrees with the checkpoint (the
MoE / MLA ones where the model's config has them: a router's rows are the expert count)"""
ACTIVATION_KEYS = ("hidden_act", "hidden_activation", "activation_function")
DTYPE_KEYS = ("dtype", "torch_dtype")
EPS_KEYS = ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_eps")
ROPE_KEYS = ("rope_parameters", "rope_scaling")
NESTED = ("text_config",)  # multimodal configs hold the language model's fields here


def check_config(tf, model_type: str, cfg: dict, ckpt, where: str) -> None:
    """Refuse (``ModelError`` naming ``where`` and the key) a config that would make transformers
    allocate without bound, fail, or compute NaN; ``cfg`` is config.json without model_type and
    quantization_config, ``tf`` the transformers module."""
    check_values(cfg, where, blocks_held(ckpt.store))
    model = _meta_model(tf, model_type, cfg, where)
    _check_against_checkpoint(model, ckpt, where)


def check_values(cfg: dict, where: str, held: tuple[int, str | None]) -> None:
    """Step 1 on ``cfg`` and its nested language-model config."""
    for prefix, part in [("", cfg)] + [(f"{k}.", cfg[k]) for k in NESTED if isinstance(cfg.get(k), dict)]:
        _check_part(part, where, prefix, held)


def _check_part(cfg: dict, where: str, prefix: str, held: tuple[int, str | None]) -> None:
    def fail(key: str, text: str):
        raise ModelError(f"{where}: {prefix}{key}: {text}, got {shown(cfg[key])}")

    for key, hi in BOUNDS.items():
        value = cfg.get(key)
        each = value if isinstance(value, list) and value else [value]  # Gemma 3n: one size per layer
        if value is not None and not all(int_in(v, 1, hi) for v in each):
            fail(key, f"expected an integer in 1..{hi}")
    heads, kv = cfg.get("num_attention_heads"), cfg.get("num_key_value_heads")
    if type(heads) is int and type(kv) is int and heads % kv:
        fail("num_key_value_heads", f"expected a divisor of num_attention_heads ({heads})")
    experts = next((cfg[k] for k in EXPERT_COUNTS if cfg.get(k) is not None), None)
    if type(experts) is int and type(cfg.get("num_experts_per_tok")) is int and cfg["num_experts_per_tok"] > experts:
        fail("num_experts_per_tok", f"expected at most the {experts} experts")
    layers, (count, container) = cfg.get("num_hidden_layers"), held
    if type(layers) is int and layers > count:
        fail("num_hidden_layers", f"expected at most the {count} numbered blocks the checkpoint's tensors hold"
                                  + (f" ({container}.N)" if container else ""))
    for key in ACTIVATION_KEYS:
        if cfg.get(key) is not None:
            names = _activations()
            if not isinstance(cfg[key], str) or cfg[key] not in names:
                fail(key, f"expected an activation transformers knows ({', '.join(sorted(names)[:8])}, ...)"
                          f"{did_you_mean(cfg[key], names, clause=True) if isinstance(cfg[key], str) else ''}")
    for key in DTYPE_KEYS:
        if cfg.get(key) is not None and not _float_dtype(cfg[key]):
            fail(key, "expected a torch floating dtype name such as \"bfloat16\", \"float16\" or \"float32\"")
    for key in EPS_KEYS:
        if cfg.get(key) is not None and not (_number(cfg[key]) and math.isfinite(cfg[key]) and cfg[key] >= 0):
            fail(key, "expected a finite number >= 0")
    _check_rope(cfg, where, prefix)


def _check_rope(cfg: dict, where: str, prefix: str) -> None:
    """rope_theta (top level, or in rope_parameters / rope_scaling, which may hold one dict per
    attention type) and a scaling factor must be finite and > 0: -1 gives NaN angles."""
    found = [("rope_theta", cfg)] if "rope_theta" in cfg else []
    for key in ROPE_KEYS:
        value = cfg.get(key)
        if not isinstance(value, dict):
            continue
        parts = [(key, value)] + [(f"{key}.{k}", v) for k, v in value.items() if isinstance(v, dict)]
        found += [(f"{path}.{field}", part) for path, part in parts for field in ("rope_theta", "factor")
                  if field in part]
    for path, part in found:
        value = part[path.rsplit(".", 1)[-1]]
        if value is not None and not (_number(value) and math.isfinite(value) and value > 0):
            raise ModelError(f"{where}: {prefix}{path}: expected a finite number > 0, got {shown(value)}")


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _float_dtype(name: object) -> bool:
    if not isinstance(name, str):
        return False
    dtype = getattr(torch, name.removeprefix("torch."), None)
    return isinstance(dtype, torch.dtype) and dtype.is_floating_point


def _activations() -> set[str]:
    from transformers.activations import ACT2FN

    return set(ACT2FN.keys())


def blocks_held(store) -> tuple[int, str | None]:
    """The most numbered blocks one container of the checkpoint holds (``model.layers.N.``), and
    that container; (number of tensors, None) when no tensor name is numbered."""
    found = block_indices(store)
    if not found:
        return len(list(store)), None
    best = max(found, key=lambda c: len(found[c]))
    return len(found[best]), best


def _meta_model(tf, model_type: str, cfg: dict, where: str):
    """Step 2's model: built with shapes only (torch's meta device allocates nothing)."""
    try:
        config = tf.AutoConfig.for_model(model_type, **cfg)
        with torch.device("meta"):
            return tf.AutoModelForCausalLM.from_config(config)
    except (ValueError, KeyError, TypeError, AttributeError, IndexError, ZeroDivisionError, OverflowError,
            RuntimeError) as exc:
        text = str(exc).splitlines()[0] if str(exc) else ""
        text = text.split(". Should contain one of")[0]  # not transformers' list of ~400 model types
        text = text if len(text) <= 300 else text[:300] + " ..."
        raise ModelError(f"{where}: transformers {tf.__version__} cannot build a {model_type!r} model from it "
                         f"({type(exc).__name__}: {text})") from None


def _check_against_checkpoint(model, ckpt, where: str) -> None:
    """Steps 2 and 3: shapes of the parameters both hold, then the total."""
    store = ckpt.store
    aliases = getattr(model.config, "attribute_map", {})  # Qwen3-MoE's num_experts is num_local_experts
    keys = SHAPE_KEYS + tuple(k for k in MOE_SHAPE_KEYS
                              if k not in aliases and getattr(model.config, k, None) is not None)
    total = 0
    for name, p in model.named_parameters():
        total += p.numel()
        layer, stored = name.removesuffix(".weight"), None
        if layer != name and layer in ckpt:  # a quantized layer: its logical [out, in]
            stored = tuple(ckpt[layer].shape)
        elif name in store:
            stored = tuple(store.info(name).shape)
        if stored is not None and stored != tuple(p.shape):
            raise ModelError(f"{where}: the model it describes has {name} of shape {list(p.shape)}, the "
                             f"checkpoint's is {list(stored)}: {', '.join(keys[:-1])} or {keys[-1]} disagree "
                             f"with the weights")
    held = sum(math.prod(store.info(n).shape) for n in store)
    if total > 2 * held:
        lacking = _unheld(model, store)
        raise ModelError(f"{where}: the model it describes has {total} parameters, more than the checkpoint's "
                         f"{held} stored elements can fill"
                         + (f"; the checkpoint holds nothing for {lacking[0]}"
                            + (f" (and {len(lacking) - 1} more)" if len(lacking) > 1 else "") if lacking else ""))


def _unheld(model, store) -> list[str]:
    """The model's parameters for whose module the checkpoint holds no tensor at all (a layer's
    experts left out, say): what the user would look for. A module counts as held if any stored
    name starts with its path (per-expert tensors fill fused experts; packed tensors a weight)."""
    prefixes = set()
    for n in store:
        parts = n.split(".")
        prefixes.update(".".join(parts[:i]) for i in range(1, len(parts)))
    return [n for n, _ in model.named_parameters() if n not in store and n.rpartition(".")[0] not in prefixes]
