"""The NVIDIA ModelOpt unified Hugging Face export vocabulary (nvidia-modelopt 0.47.0
``export_hf_checkpoint``): ``config.json`` ``quantization_config`` with ``quant_method: modelopt``
and its twin ``hf_quant_config.json``. One reader (``Config``) and one writer
(``quantization_config``, ``hf_quant_config``), checked against tests/fixtures/interop/checkpoints/modelopt_*.
"""

from __future__ import annotations

from fnmatch import fnmatchcase

from .. import __version__
from ..errors import CheckpointError

NAME = "modelopt"
METHOD = "modelopt"
HF_QUANT_CONFIG = "hf_quant_config.json"
ALGOS = ("FP8", "FP8_PER_CHANNEL_PER_TOKEN", "NVFP4", "MXFP8")
GROUP_SIZE = {"NVFP4": 16, "MXFP8": 32}
KNOWN_KEYS = {"quant_method", "quant_algo", "ignore", "exclude_modules", "producer", "config_groups",
              "kv_cache_scheme", "kv_cache_quant_algo", "group_size"}
# config_groups as ModelOpt 0.47.0 writes them into config.json (only for these algorithms)
_ARGS = {"FP8": {"dynamic": False, "num_bits": 8, "type": "float"},
         "NVFP4": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16}}
KV_SCHEME = {"dynamic": False, "num_bits": 8, "type": "float"}


class Config:
    """A parsed ``quantization_config`` of ``quant_method: modelopt``."""

    def __init__(self, qc: dict, where: str, warnings: list[str]):
        unknown = sorted(set(qc) - KNOWN_KEYS)
        if unknown:
            warnings.append(f"{where}: keys {unknown} are not part of ModelOpt's export config and were ignored")
        algo = qc.get("quant_algo")
        if algo not in ALGOS:
            raise CheckpointError(f"{where}.quant_algo: {algo!r}; fp8ref reads {', '.join(ALGOS)}")
        self.algo = algo
        ignore = qc.get("ignore", qc.get("exclude_modules", []))
        if not isinstance(ignore, list) or not all(isinstance(i, str) for i in ignore):
            raise CheckpointError(f"{where}.ignore: expected a list of module names or patterns, got {ignore!r:.100}")
        self.ignore = ignore
        size = qc.get("group_size", GROUP_SIZE.get(algo))
        if algo in GROUP_SIZE and size != GROUP_SIZE[algo]:
            raise CheckpointError(f"{where}.group_size: {size!r}; ModelOpt {algo} blocks are {GROUP_SIZE[algo]}")
        kv = qc.get("kv_cache_quant_algo", "FP8" if qc.get("kv_cache_scheme") else None)
        if kv not in (None, "FP8"):
            raise CheckpointError(f"{where}.kv_cache_quant_algo: {kv!r}; fp8ref reads FP8 KV-cache scales or none")
        self.kv = kv == "FP8"

    def excluded(self, name: str) -> bool:
        """``exclude_modules`` entries are module names or fnmatch patterns (``*lm_head*``)."""
        return any(name == p or fnmatchcase(name, p) for p in self.ignore)


def quantization_config(algo: str, ignore: list[str], kv: bool) -> dict:
    """config.json's ``quantization_config`` as ModelOpt 0.47.0 writes it, producer fp8ref."""
    qc: dict = {}
    if algo in _ARGS:
        qc["config_groups"] = {"group_0": {"input_activations": dict(_ARGS[algo]), "weights": dict(_ARGS[algo]),
                                           "targets": ["Linear"]}}
    qc.update(ignore=list(ignore), quant_algo=algo)
    if kv:
        qc["kv_cache_scheme"] = dict(KV_SCHEME)
    qc.update(producer={"name": "fp8ref", "version": __version__}, quant_method=METHOD)
    return qc


def hf_quant_config(qc: dict) -> dict:
    """``hf_quant_config.json`` (what TensorRT-LLM and vLLM's ModelOpt loader read) for ``qc``."""
    q = {"quant_algo": qc["quant_algo"], "kv_cache_quant_algo": "FP8" if qc.get("kv_cache_scheme") else None}
    if qc["quant_algo"] in GROUP_SIZE:
        q["group_size"] = GROUP_SIZE[qc["quant_algo"]]
    q["exclude_modules"] = list(qc.get("ignore", []))
    return {"producer": qc["producer"], "quantization": q}
