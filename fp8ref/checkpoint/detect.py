"""Which producer wrote a checkpoint: from ``quantization_config``, else from tensor names."""

from __future__ import annotations

from ..errors import CheckpointError
from ..io.safetensors import TensorStore
from . import base
from .base import fp8_weights

UNQUANTIZED = "unquantized"


def detect_format(qc: dict | None, store: TensorStore, where: str) -> str:
    """The format name for ``quantization_config`` ``qc`` (None when absent).

    Without a config, a checkpoint with no float8 weights is ``unquantized``; one with float8
    weights is recognised by its scale names, each registered format asked in ``detect_rank``
    order (``weight_scale_inv``: hf-fp8; 1-D per-row ``weight_scale``: auto-round; other
    ``weight_scale``: compressed-tensors).
    """
    if qc is not None:
        if not isinstance(qc, dict):
            raise CheckpointError(f"{where}: quantization_config must be an object, got {type(qc).__name__}")
        method = qc.get("quant_method")
        fmt = base.by_method(method)
        if fmt is None:
            raise CheckpointError(f"{where}.quant_method: unknown {method!r}; fp8ref loads "
                                  f"{', '.join(repr(m) for m in base.methods())}")
        return fmt.name
    layers = fp8_weights(store)
    if not layers:
        return UNQUANTIZED
    return next(f.name for f in base.by_detection() if f.detect(store, layers))
