"""gguf (llama.cpp's Python package, ``gguf.quants``): MXFP4 quantize and dequantize
(``GGMLQuantizationType.MXFP4``), llama.cpp's reference quantizer in numpy.

Judged against fp8ref's OCP MX recipe (``fp8ref``, mx_rule floor; the differences are xfails) and
against ``ggml-mxfp4``, the recipe that models it (no differences but the uint8 wrap of blocks whose
amax is below 2**-125): gguf's scale byte is
``floor(np.log2(amax)) - 2 + 127`` computed in float32, its elements the nearest doubled e2m1 value
by ``np.argmin`` (ties to the first, smaller-magnitude entry, +0 before -0). Blocks are 32 elements
along the last dimension; a partial last block is refused (gguf needs whole blocks). A gguf block
is 17 bytes: the E8M0 scale byte, then 16 bytes holding element j in the low nibble and element
j + 16 in the high nibble; each nibble is the e2m1 code. The adapter unpacks codes and returns
the scale as 2**(byte - 127) (byte 0xFF: NaN); for dequantize it packs codes and scale bytes
(the exact E8M0 code of each power-of-two scale) the same way; gguf's float32 values are returned
as they are (fp8ref's ``fp8ref`` recipe dequantizes MX to float32 too).
"""

from __future__ import annotations

import numpy as np

from ... import codec
from ..backend import Backend
from ._common import dist_version, missing

_BLOCK = 32
_DTYPES = ("bfloat16", "float16", "float32")


class GgufBackend(Backend):
    name = "gguf"
    default_suites = ("mxfp4", "degenerate")  # MXFP4 only: the default suites have none
    capabilities = {
        "quantize": {"scheme": ("MXFP4",), "recipe": ("fp8ref", "ggml-mxfp4"), "dtype": _DTYPES},
        "dequantize": {"scheme": ("MXFP4",), "recipe": ("fp8ref", "ggml-mxfp4"), "dtype": _DTYPES},
    }

    def unavailable(self) -> str | None:
        return missing("gguf")

    def version(self) -> str:
        return f"{dist_version('gguf')} (gguf.quants MXFP4)"

    def implements(self, op, params):
        reason = super().implements(op, params)
        if reason:
            return reason
        if params["shape"][-1] % _BLOCK:
            return f"gguf MXFP4 quantizes whole blocks of {_BLOCK} only (last dimension {params['shape'][-1]})"
        return None

    @staticmethod
    def _qtype():
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType.MXFP4

    def quantize(self, x, *, scheme, recipe, role, amax=None):
        from gguf import quants

        x = np.asarray(x)
        raw = quants.quantize(x.astype(np.float32), self._qtype())  # exact widening
        blocks = raw.reshape(*x.shape[:-1], x.shape[-1] // _BLOCK, 1 + _BLOCK // 2)
        qs = blocks[..., 1:]
        codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(x.shape)
        scale = codec.decode(blocks[..., 0], "float8_e8m0fnu")  # float32
        return {"codes": codes.astype(np.uint8), "scale": scale}

    def dequantize(self, codes, scale, *, scheme, recipe, role, dtype):
        from gguf import quants

        codes = np.asarray(codes, np.uint8)
        lead, k = codes.shape[:-1], codes.shape[-1]
        halves = codes.reshape(*lead, k // _BLOCK, 2, _BLOCK // 2)
        qs = halves[..., 0, :] | (halves[..., 1, :] << 4)
        e = codec.encode(np.asarray(scale).astype(np.float32), "float8_e8m0fnu", rounding="rne", saturate=True)
        raw = np.concatenate([e[..., None], qs], axis=-1).reshape(*lead, -1)
        return quants.dequantize(raw, self._qtype()).reshape(codes.shape)  # float32, as fp8ref's recipe
