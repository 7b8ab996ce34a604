"""Rewrite a committed MoE fixture into a variant (tensors renamed or dropped, config edited), for the
MoE tests: the tools' own reload with Mixtral's names mapped back, and the bad-input cases."""

from __future__ import annotations

import json
from pathlib import Path

from fp8ref.io.safetensors import SafetensorsFile, write_safetensors

CKPTS = Path(__file__).resolve().parents[1] / "fixtures" / "interop" / "checkpoints"
# llm-compressor writes Mixtral's experts as gate/up/down_proj; transformers 5.17 reads w1/w3/w2
MIXTRAL_NAMES = {".gate_proj.": ".w1.", ".up_proj.": ".w3.", ".down_proj.": ".w2."}


def rewrite(src: Path, dst: Path, *, rename=None, drop=None, copy: dict[str, str] | None = None,
            config: dict | None = None) -> Path:
    """``src`` copied to ``dst`` with each tensor name passed through ``rename``, the names ``drop``
    accepts left out, the tensors under each prefix ``copy`` maps to also written under its key
    (e.g. an expert duplicated as one more), and ``config`` merged into config.json."""
    f = SafetensorsFile(src / "model.safetensors")
    tensors = {(rename(n) if rename else n): (f.info(n).dtype, f.get(n)) for n in f.tensors
               if not (drop and drop(n))}
    for new, old in (copy or {}).items():
        tensors.update({new + n[len(old):]: (f.info(n).dtype, f.get(n)) for n in f.tensors if n.startswith(old)})
    dst.mkdir(parents=True, exist_ok=True)
    write_safetensors(dst / "model.safetensors", tensors)
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(config or {})
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    return dst


def mixtral_names(name: str) -> str:
    """An llm-compressor Mixtral expert name as transformers 5.17 reads it."""
    if ".experts." in name:
        for new, old in MIXTRAL_NAMES.items():
            name = name.replace(new, old)
    return name
