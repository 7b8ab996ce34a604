"""Tiny valid FP8 checkpoints built in code, in each producer's layout, for the checkpoint tests.

Codes and scales are random but valid (finite codes, positive scales): the loader checks
structure and values, not how the values were produced. ``build`` returns the tensors and
config as plain dicts so a test can break one thing before ``write`` puts them on disk.
"""

from __future__ import annotations

import json
from math import ceil
from pathlib import Path

import ml_dtypes
import numpy as np

from fp8ref.io.safetensors import write_safetensors

BF16 = ml_dtypes.bfloat16
LAYERS = {"model.layers.0.self_attn.q_proj": (48, 32), "model.layers.0.mlp.down_proj": (32, 48)}
CT_PRESETS = {
    "FP8": ({"strategy": "tensor"}, {"strategy": "tensor", "dynamic": False}),
    "FP8_DYNAMIC": ({"strategy": "channel"}, {"strategy": "token", "dynamic": True}),
    "FP8_BLOCK": ({"strategy": "block", "block_structure": [16, 16]},
                  {"strategy": "group", "group_size": 16, "dynamic": True}),
}


def codes(rng: np.random.Generator, shape) -> np.ndarray:
    """Random e4m3fn codes without NaN (0x7F/0xFF)."""
    c = rng.integers(0, 256, size=shape, dtype=np.uint8)
    return np.where((c & 0x7F) == 0x7F, c ^ 0x01, c).astype(np.uint8)


def scales(rng: np.random.Generator, shape, dtype) -> np.ndarray:
    return (rng.uniform(0.5, 2.0, size=shape) * 2.0 ** -8).astype(dtype)


def _plain(rng, tensors) -> None:
    tensors["model.embed_tokens.weight"] = ("BF16", rng.standard_normal((16, 32)).astype(BF16))
    tensors["model.norm.weight"] = ("BF16", np.ones(32, dtype=BF16))
    tensors["lm_head.weight"] = ("BF16", rng.standard_normal((16, 32)).astype(BF16))


def build_ct(preset: str = "FP8", seed: int = 0) -> tuple[dict, dict]:
    rng = np.random.default_rng(seed)
    w_args, a_args = CT_PRESETS[preset]
    tensors: dict = {}
    for name, (out, inp) in LAYERS.items():
        tensors[f"{name}.weight"] = ("F8_E4M3", codes(rng, (out, inp)))
        shape = {"tensor": (1,), "channel": (out, 1), "block": (ceil(out / 16), ceil(inp / 16))}[w_args["strategy"]]
        tensors[f"{name}.weight_scale"] = ("BF16", scales(rng, shape, BF16))
        if not a_args["dynamic"]:
            tensors[f"{name}.input_scale"] = ("BF16", scales(rng, (1,), BF16))
    _plain(rng, tensors)
    base = {"num_bits": 8, "type": "float", "symmetric": True}
    qc = {"config_groups": {"group_0": {"targets": ["Linear"], "weights": {**base, "dynamic": False, **w_args},
                                        "input_activations": {**base, **a_args}, "output_activations": None,
                                        "format": "float-quantized"}},
          "format": "float-quantized", "ignore": ["lm_head"], "kv_cache_scheme": None,
          "quant_method": "compressed-tensors", "quantization_status": "compressed"}
    return tensors, {"model_type": "llama", "dtype": "bfloat16", "quantization_config": qc}


def build_autoround(seed: int = 0) -> tuple[dict, dict]:
    rng = np.random.default_rng(seed)
    tensors: dict = {}
    for name, (out, inp) in LAYERS.items():
        tensors[f"{name}.weight"] = ("F8_E4M3", codes(rng, (out, inp)))
        tensors[f"{name}.weight_scale"] = ("BF16", scales(rng, (out,), BF16))
        tensors[f"{name}.input_scale"] = ("BF16", scales(rng, (1,), BF16))
    _plain(rng, tensors)
    qc = {"act_bits": 8, "act_data_type": "fp", "act_dynamic": False, "act_group_size": 0, "act_sym": True,
          "activation_scheme": "static", "bits": 8, "block_name_to_quantize": "model.layers", "data_type": "fp",
          "fmt": "e4m3", "group_size": -1, "packing_format": "auto_round:fp8_static",
          "quant_method": "auto-round", "sym": True}
    return tensors, {"model_type": "llama", "dtype": "bfloat16", "quantization_config": qc}


def build_hf(seed: int = 0, *, block: int = 16, layers: dict = LAYERS) -> tuple[dict, dict]:
    rng = np.random.default_rng(seed)
    tensors: dict = {}
    for name, (out, inp) in layers.items():
        tensors[f"{name}.weight"] = ("F8_E4M3", codes(rng, (out, inp)))
        tensors[f"{name}.weight_scale_inv"] = ("F32", scales(rng, (ceil(out / block), ceil(inp / block)), np.float32))
    _plain(rng, tensors)
    qc = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [block, block],
          "modules_to_not_convert": ["lm_head"]}
    return tensors, {"model_type": "llama", "dtype": "bfloat16", "quantization_config": qc}


BUILDERS = {"compressed-tensors": build_ct, "auto-round": build_autoround, "hf-fp8": build_hf}


def write(folder: Path, tensors: dict, config: dict | None, *, shards: int = 1) -> Path:
    """Write a checkpoint folder: config.json (unless None) and one file or ``shards`` shards."""
    folder.mkdir(parents=True, exist_ok=True)
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config, indent=1))
    if shards == 1:
        write_safetensors(folder / "model.safetensors", tensors, {"format": "pt"})
        return folder
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        part = names[i::shards]
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        write_safetensors(folder / fname, {n: tensors[n] for n in part}, {"format": "pt"})
        weight_map.update(dict.fromkeys(part, fname))
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    return folder


def snapshot(root: Path) -> dict:
    """Every path under ``root`` with its size and mtime, to prove nothing was written."""
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*")) if p.is_file()}


# --- gpt-oss (fused MXFP4 experts) and Mixtral-named originals -------------------------------------
GPTOSS_NOT_CONVERT = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def build_gptoss_original(seed: int = 0, *, experts: int = 4, hidden: int = 64, inter: int = 32,
                          spread: float = 3.0) -> tuple[dict, dict]:
    """An unquantized gpt-oss-style checkpoint: one layer's experts in the model's layout
    (``gate_up_proj`` [E, hidden, 2 * inter], ``down_proj`` [E, inter, hidden], biases [E, out]), bf16,
    rows of random magnitude (``spread``: the log2 standard deviation of a row's scale)."""
    rng = np.random.default_rng(seed)
    tensors: dict = {}
    m = "model.layers.0.mlp.experts"
    for proj, (k, n) in (("gate_up_proj", (hidden, 2 * inter)), ("down_proj", (inter, hidden))):
        w = rng.standard_normal((experts, k, n)) * 2.0 ** np.clip(rng.normal(0, spread, (experts, 1, n)), -120, 120)
        tensors[f"{m}.{proj}"] = ("BF16", w.astype(BF16))
        tensors[f"{m}.{proj}_bias"] = ("BF16", rng.standard_normal((experts, n)).astype(BF16))
    tensors["model.layers.0.mlp.router.weight"] = ("BF16", rng.standard_normal((experts, hidden)).astype(BF16))
    tensors["model.layers.0.mlp.router.bias"] = ("BF16", rng.standard_normal(experts).astype(BF16))
    tensors["model.norm.weight"] = ("BF16", np.ones(hidden, dtype=BF16))
    return tensors, {"model_type": "gpt_oss", "dtype": "bfloat16", "num_hidden_layers": 1,
                     "num_local_experts": experts, "hidden_size": hidden, "intermediate_size": inter}


def gptoss_quantized(original: dict, config: dict, encode) -> tuple[dict, dict]:
    """The gpt-oss MXFP4 checkpoint of ``original`` with ``encode(rows [R, K] float64) -> (E2M1 codes
    [R, K], E8M0 bytes [R, K/32])`` applied to each expert projection's [E * out, in] rows (a test's own
    rule), packed as gpt-oss stores them (low nibble = even element)."""
    tensors = {}
    for name, (dtype, value) in original.items():
        if name.rpartition(".")[2] in ("gate_up_proj", "down_proj"):
            e, k, n = value.shape
            rows = np.swapaxes(value.astype(np.float64), 1, 2).reshape(e * n, k)
            c, s = encode(rows)
            packed = (c[:, 0::2] | (c[:, 1::2] << 4)).astype(np.uint8)
            tensors[f"{name}_blocks"] = ("U8", packed.reshape(e, n, k // 32, 16))
            tensors[f"{name}_scales"] = ("U8", np.asarray(s, np.uint8).reshape(e, n, k // 32))
        else:
            tensors[name] = (dtype, value)
    qc = {"modules_to_not_convert": list(GPTOSS_NOT_CONVERT), "quant_method": "mxfp4"}
    return tensors, {**config, "quantization_config": qc}


MIXTRAL_EXPERT = "model.layers.0.block_sparse_moe.experts.{e}.{w}"
LLMC_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}  # what llm-compressor 0.14 writes


def build_mixtral_original(seed: int = 0, *, experts: int = 2, hidden: int = 32, inter: int = 64) -> tuple[dict, dict]:
    """An unquantized Mixtral-named checkpoint (experts' w1/w3 [inter, hidden], w2 [hidden, inter])."""
    rng = np.random.default_rng(seed)
    tensors: dict = {}
    for e in range(experts):
        for w, shape in (("w1", (inter, hidden)), ("w3", (inter, hidden)), ("w2", (hidden, inter))):
            tensors[MIXTRAL_EXPERT.format(e=e, w=w) + ".weight"] = ("BF16", rng.standard_normal(shape).astype(BF16))
    gate = rng.standard_normal((experts, hidden)).astype(BF16)
    tensors["model.layers.0.block_sparse_moe.gate.weight"] = ("BF16", gate)
    tensors["model.norm.weight"] = ("BF16", np.ones(hidden, dtype=BF16))
    return tensors, {"model_type": "mixtral", "dtype": "bfloat16", "num_hidden_layers": 1}


def without_recipe_record(path: Path) -> bytes:
    """The bytes of a safetensors file fp8ref exported, with the recipe record it adds to the header
    (``__metadata__.fp8ref_recipes``) taken out as fp8ref's writer would lay the header out without
    it: equal to a producer tool's file where fp8ref reproduced every other byte. The record must be
    there (an export that forgot it fails here)."""
    from fp8ref.checkpoint.base import RECIPE_METADATA

    raw = Path(path).read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    meta = header["__metadata__"]
    json.loads(meta.pop(RECIPE_METADATA))
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + raw[8 + n:]
