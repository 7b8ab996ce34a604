"""compressed-tensors' GPU quantize path (its Triton ``_quantize_kernel``) run on CPU in Triton's interpreter.

Run as a script in a fresh interpreter: ``python ct_triton_quantize.py IN OUT``. IN holds ``{case}.x``
tensors and a JSON list of cases in its metadata (``cases``: name, strategy, group_size, block);
OUT gets ``{case}.codes`` and ``{case}.weight_scale`` as compressed-tensors computes them.
TRITON_INTERPRET=1 must be set before Triton is imported (``triton.jit`` decides at decoration), hence
the subprocess. CPU adaptations, none in compressed-tensors' arithmetic: the dispatcher's device test
(``triton_req``, ``_is_fp8_supported``) answers True, and ``torch.cpu`` gets the ``device`` context
manager ``_quantize_triton`` enters (a no-op on CPU).

One substitution in Triton itself: the interpreter's fp32 -> float8e4nv cast (``_convert_float`` in
triton/runtime/interpreter.py, Triton 3.9.0) is not the GPU's. Its "RTNE" adds the first cut-off bit
(ties go away from zero, not to even) and masks the mantissa without carrying into the exponent, so
127.47 -> 64 and -68.0 -> -72 (the GPU's ``cvt.rn.satfinite.e4m3x2.f32``: 128 and -64). With
``FIXED_CAST`` (the default) that one conversion is ml_dtypes' correctly rounded RNE cast, which is
what the PTX instruction specifies; the division, zero point and clamp still run in the interpreter.
"""

import contextlib
import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"
os.environ["CUDA_VISIBLE_DEVICES"] = ""
os.environ.pop("CT_ENFORCE_EAGER", None)

import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

FIXED_CAST = os.environ.get("CT_TRITON_INTERPRETER_CAST") != "1"


def _fix_fp8_cast() -> None:
    """fp32 -> float8e4nv in the interpreter as RNE (ml_dtypes), every other conversion Triton's own."""
    import ml_dtypes
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    own = interpreter._convert_float

    def convert(data, input_dtype, output_dtype, rounding_mode):
        if input_dtype == tl.float32 and output_dtype == tl.float8e4nv:
            return np.asarray(data, np.float32).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
        return own(data, input_dtype, output_dtype, rounding_mode)

    interpreter._convert_float = convert


def main(src: str, dst: str) -> None:
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle import forward_helpers as fh
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from compressed_tensors.quantization.utils.helpers import calculate_qparams
    from triton.runtime.interpreter import InterpretedFunction

    assert isinstance(fh._quantize_kernel, InterpretedFunction), type(fh._quantize_kernel)
    if FIXED_CAST:
        _fix_fp8_cast()
    fh.triton_req = lambda *a, **k: True
    fh._is_fp8_supported = lambda device: True
    torch.cpu.device = lambda device: contextlib.nullcontext()
    used = []
    for i, (fn, req, prio) in enumerate(fh.ImplBackend._backends["_quantize"]):
        def spy(*a, _fn=fn, **k):
            used.append(_fn.__name__)
            return _fn(*a, **k)
        fh.ImplBackend._backends["_quantize"][i] = (spy, req, prio)

    out = {}
    with safe_open(src, "pt") as f:
        cases = json.loads(f.metadata()["cases"])
        for c in cases:
            x = f.get_tensor(f"{c['name']}.x")
            kw = {"group_size": c["group_size"]} if c["strategy"] == "group" else {}
            if c["strategy"] == "block":
                kw = {"block_structure": c["block"]}
            args = QuantizationArgs(num_bits=8, type="float", strategy=c["strategy"], symmetric=True, **kw)
            rows, cols = x.shape
            if c["strategy"] == "tensor":
                red = x.reshape(1, -1)
            elif c["strategy"] == "channel":
                red = x
            elif c["strategy"] == "group":
                red = x.reshape(rows, cols // c["group_size"], c["group_size"])
            else:
                r, k = c["block"]
                red = x.reshape(rows // r, r, cols // k, k).transpose(1, 2).reshape(rows // r, cols // k, -1)
            lo, hi = red.amin(dim=-1), red.amax(dim=-1)
            if c["strategy"] == "channel":
                lo, hi = lo.unsqueeze(-1), hi.unsqueeze(-1)
            scale, zp = calculate_qparams(lo, hi, args)
            used.clear()
            codes = quantize(x, scale, zp, args, dtype=torch.float8_e4m3fn)
            assert used == ["_quantize_triton"], used  # the GPU path ran, not the eager fallback
            out[f"{c['name']}.codes"] = codes.contiguous()
            out[f"{c['name']}.weight_scale"] = scale.contiguous()
    save_file(out, dst)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
