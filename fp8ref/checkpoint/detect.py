"""Which producer wrote a checkpoint: from ``quantization_config``, else from tensor names."""

from __future__ import annotations

from ..errors import CheckpointError
from . import autoround, compressed_tensors, hf_fp8
from ..io.safetensors import TensorStore

FORMAT_NAMES = (compressed_tensors.NAME, autoround.NAME, hf_fp8.NAME)
_METHODS = {"compressed-tensors": compressed_tensors.NAME, "auto-round": autoround.NAME,
            "intel/auto-round": autoround.NAME, "fp8": hf_fp8.NAME}
UNQUANTIZED = "unquantized"


def fp8_weights(store: TensorStore) -> list[str]:
    """Module names whose ``.weight`` is stored in a float8 dtype."""
    return sorted(n[: -len(".weight")] for n in store
                  if n.endswith(".weight") and store.info(n).dtype.startswith("F8_"))


def detect_format(qc: dict | None, store: TensorStore, where: str) -> str:
    """The format name for ``quantization_config`` ``qc`` (None when absent).

    Without a config, a checkpoint with no float8 weights is ``unquantized``; one with float8
    weights is recognised by its scale names (``weight_scale_inv``: hf-fp8; ``weight_scale``:
    1-D per-row scales are auto-round's, others compressed-tensors').
    """
    if qc is not None:
        if not isinstance(qc, dict):
            raise CheckpointError(f"{where}: quantization_config must be an object, got {type(qc).__name__}")
        method = qc.get("quant_method")
        if method not in _METHODS:
            raise CheckpointError(f"{where}.quant_method: unknown {method!r}; fp8ref loads "
                                  f"{', '.join(repr(m) for m in _METHODS)}")
        return _METHODS[method]
    layers = fp8_weights(store)
    if not layers:
        return UNQUANTIZED
    if any(f"{n}.weight_scale_inv" in store for n in layers):
        return hf_fp8.NAME
    first = f"{layers[0]}.weight_scale"
    if first in store and len(store.info(first).shape) == 1 and store.info(first).shape[0] > 1:
        return autoround.NAME
    return compressed_tensors.NAME


def is_float(store: TensorStore, name: str) -> bool:
    return store.info(name).dtype in ("F32", "BF16", "F16", "F64")

