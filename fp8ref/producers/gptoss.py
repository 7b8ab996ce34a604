"""The gpt-oss MXFP4 vocabulary (OpenAI gpt-oss checkpoints, transformers 5.17 ``Mxfp4Config``):
``quantization_config: {"quant_method": "mxfp4", "modules_to_not_convert": [...]}``, and the tensor
names of the fused experts it quantizes. One reader (``Config``) and one writer (``quantization_config``).

Tensors of one experts module ``M`` (``model.layers.N.mlp.experts``), for each projection P of
``PROJECTIONS``: ``M.P_blocks`` U8 [E, out, in/32, 16] (two E2M1 codes a byte, low nibble = even
element), ``M.P_scales`` U8 [E, out, in/32] (E8M0: 2**(byte - 127)), ``M.P_bias`` [E, out] in D. The
model's parameter ``M.P`` is [E, in, out]: transformers' loader transposes the dequantized blocks.
gate_up_proj's out columns interleave gate and up (gate = even, up = odd).
"""

from __future__ import annotations

from ..errors import CheckpointError
from ..limits import MAX_PATTERN, shown
from ..patterns import wildcard_prefix

NAME = "gpt-oss"
METHOD = "mxfp4"  # its quant_method (transformers QuantizationMethod.MXFP4)
KNOWN_KEYS = {"quant_method", "modules_to_not_convert", "dequantize"}
PROJECTIONS = ("gate_up_proj", "down_proj")
BLOCKS, SCALES, BIAS = "_blocks", "_scales", "_bias"
# what gpt-oss-20b/120b's config.json lists; fp8ref writes it for the modules it leaves in D
DEFAULT_NOT_CONVERT = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


class Config:
    """A parsed ``quantization_config`` of ``quant_method: mxfp4``."""

    def __init__(self, qc: dict, where: str, warnings: list[str]):
        unknown = sorted(set(qc) - KNOWN_KEYS)
        if unknown:
            warnings.append(f"{where}: keys {unknown} are not part of transformers' Mxfp4Config and were ignored")
        skip = qc.get("modules_to_not_convert")
        skip = [] if skip is None else skip
        if (not isinstance(skip, list) or not all(isinstance(s, str) and 0 < len(s) <= MAX_PATTERN for s in skip)):
            raise CheckpointError(f"{where}.modules_to_not_convert: expected a list of module names or patterns "
                                  f"(strings of 1..{MAX_PATTERN} characters), got {shown(skip)}")
        if qc.get("dequantize") not in (None, False, True):
            raise CheckpointError(f"{where}.dequantize: expected true or false, got {shown(qc.get('dequantize'))}")
        self.not_convert = list(skip)

    def skipped(self, module: str) -> str | None:
        """The ``modules_to_not_convert`` entry that keeps ``module`` unconverted (None: it is converted)."""
        for text in self.not_convert:  # transformers: re.match(key), key + ".", or name.endswith(key)
            if wildcard_prefix(text, module) or module.endswith(text):
                return text
        return None


def quantization_config(not_convert: list[str] | None = None) -> dict:
    """config.json's ``quantization_config`` as gpt-oss ships it (Mxfp4Config.to_dict)."""
    return {"modules_to_not_convert": list(DEFAULT_NOT_CONVERT if not_convert is None else not_convert),
            "quant_method": METHOD}
