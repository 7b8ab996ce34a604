"""The names transformers' loader reads a model's MoE experts under, and a warning where a
checkpoint writes them otherwise (transformers then drops them and runs randomly initialised
experts, saying so only in its load report). No transformers import: the table is its
conversion mapping for transformers 5.17, written out."""

from __future__ import annotations

import re

# model_type -> the per-expert projection names transformers 5.17 reads (gate, up, down); the
# Qwen2-MoE family (Qwen3-MoE, DeepSeek-V2/V3, ...) reads gate_proj / up_proj / down_proj
EXPECTED = {"mixtral": ("w1", "w3", "w2"), "minimax": ("w1", "w3", "w2")}
_EXPERT = re.compile(r"\.experts\.\d+\.(\w+)\.weight$")


def name_warnings(config: dict, tensor_names, where: str) -> list[str]:
    """One warning when ``tensor_names`` hold experts that transformers would not load for the
    config's model_type (llm-compressor 0.14 writes Mixtral's w1/w3/w2 as gate/up/down_proj)."""
    expected = EXPECTED.get(config.get("model_type"))
    if expected is None:
        return []
    found = sorted({m.group(1) for n in tensor_names if (m := _EXPERT.search(n))})
    wrong = [p for p in found if p not in expected]
    if not wrong:
        return []
    count = sum(1 for n in tensor_names if (m := _EXPERT.search(n)) and m.group(1) in wrong)
    return [f"{where}: {count} expert weights named {'/'.join(wrong)}, but transformers reads "
            f"{config['model_type']} experts as {'/'.join(expected)}: it would not load these tensors and would run "
            f"randomly initialised experts (its load report lists them as UNEXPECTED). fp8ref maps the names "
            f"(gate_proj=w1, up_proj=w3, down_proj=w2). Fix: rename them to {'/'.join(expected)}"]
