"""The transformers ``quant_method: fbgemm_fp8`` vocabulary (``FbgemmFp8Config``, transformers 5.17
``utils/quantization_config.py``): ``activation_scale_ub`` (default 1200.0, the cap on a dynamic
per-token activation amax) and ``modules_to_not_convert``. One reader (``Config``), one writer
(``quantization_config``).

transformers refuses this method without a CUDA/XPU device (``FbgemmFp8HfQuantizer.
validate_environment``: "Using fbgemm fp8 quantization requires a GPU or XPU"; on CUDA it also
needs fbgemm-gpu and compute capability >= 9.0), so there is no CPU loader to check it against.
"""

from __future__ import annotations

import math

from ..errors import CheckpointError

NAME = "fbgemm-fp8"
METHOD = "fbgemm_fp8"
DEFAULT_UB = 1200.0  # FbgemmFp8Config.activation_scale_ub
KNOWN_KEYS = {"quant_method", "activation_scale_ub", "modules_to_not_convert"}


class Config:
    """A parsed ``quantization_config`` of ``quant_method: fbgemm_fp8``."""

    def __init__(self, qc: dict, where: str, warnings: list[str]):
        unknown = sorted(set(qc) - KNOWN_KEYS)
        if unknown:
            warnings.append(f"{where}: keys {unknown} are not part of FbgemmFp8Config and were ignored")
        ub = qc.get("activation_scale_ub", DEFAULT_UB)
        if isinstance(ub, bool) or not isinstance(ub, (int, float)) or not (math.isfinite(ub) and ub > 0):
            raise CheckpointError(f"{where}.activation_scale_ub: expected a positive finite number, got {ub!r:.80}")
        self.ub = float(ub)
        skip = qc.get("modules_to_not_convert") or []
        if not isinstance(skip, list) or not all(isinstance(s, str) for s in skip):
            raise CheckpointError(f"{where}.modules_to_not_convert: expected a list of strings, got {skip!r:.100}")
        self.not_convert = skip

    def skipped(self, name: str) -> bool:
        """transformers' should_convert_module: a listed name, or one it ends with / starts."""
        return any(name == m or name.endswith("." + m) or name.startswith(m + ".") for m in self.not_convert)


def quantization_config(unquantized: list[str], ub: float = DEFAULT_UB) -> dict:
    """config.json's ``quantization_config`` as ``FbgemmFp8Config.to_dict`` writes it."""
    return {"activation_scale_ub": float(ub), "modules_to_not_convert": sorted(unquantized), "quant_method": METHOD}
