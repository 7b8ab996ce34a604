"""Mismatch rates between neighbouring producer recipes on the same random inputs (docs/checkpoints.md,
"TransformerEngine, DeepGEMM, vLLM UE8M0, FBGEMM"): % of element codes and of scales that differ.

    python tools/recipe_mismatch.py

Deterministic (numpy seed 2026), main venv only. Weights: 64 bf16 matrices 256x512 of N(0, s^2),
s = 0.02 * 2^U(-3, 3) (LLM-like; 64 tensor amax values for the per-tensor rules); activations: 512
bf16 tokens of 1024, student-t(3) times 2^U(-6, 11) per token (amax about 2^-3 .. 2^15, so some
tokens exceed FBGEMM's activation_scale_ub of 1200).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

from fp8ref.quant import QuantArgs, quantize  # noqa: E402
from fp8ref.recipes import with_amax_ub  # noqa: E402
from fp8ref.registry import get_recipe  # noqa: E402
from tests.support.producer_tools import native_recipes  # noqa: E402

RNG = np.random.default_rng(2026)
WEIGHTS = [(RNG.standard_normal((256, 512)) * 0.02 * 2.0 ** RNG.uniform(-3, 3)).astype(ml_dtypes.bfloat16)
           for _ in range(64)]
ACTS = (RNG.standard_t(3, (512, 1024)) * 2.0 ** RNG.integers(-6, 12, (512, 1))).astype(ml_dtypes.bfloat16)


def _scale_bits(q) -> np.ndarray:
    s = q.scale_codes if q.scale_codes is not None else np.asarray(q.scale, np.float32).view(np.uint32)
    return np.asarray(s).reshape(-1)


def rates(xs, args, a, b) -> tuple[float, float]:
    codes = scales = n_codes = n_scales = 0
    for x in xs:
        qa, qb = quantize(x, args, recipe=a), quantize(x, args, recipe=b)
        codes += int((qa.codes != qb.codes).sum())
        n_codes += qa.codes.size
        sa, sb = _scale_bits(qa), _scale_bits(qb)
        scales += int((sa != sb).sum())
        n_scales += sa.size
    return 100 * codes / n_codes, 100 * scales / n_scales


def main() -> None:
    tensor, group = QuantArgs(granularity="tensor"), QuantArgs(granularity="group", group_size=128)
    block, channel = QuantArgs(granularity="block", block_shape=(128, 128)), QuantArgs(granularity="channel")
    token, nvfp4 = QuantArgs(granularity="token"), QuantArgs(format="float4_e2m1fn", granularity="nvfp4")
    ub = with_amax_ub(get_recipe("fbgemm-fp8"), 1200.0)
    # vLLM's QuantFP8.forward_native, as tests/interop/test_producer_tools_cpu.py checks it against vLLM 0.33.0
    native = native_recipes()
    native_token, native_group = native["token"], native["group"]
    rows = [
        ("te-current vs hf-fp8 (per tensor)", WEIGHTS, tensor, "te-current", "hf-fp8"),
        ("te-current vs fp8ref (per tensor)", WEIGHTS, tensor, "te-current", "fp8ref"),
        ("te-current-pow2 vs te-current", WEIGHTS, tensor, "te-current-pow2", "te-current"),
        ("deepgemm-ue8m0 vs vllm-group (1x128, fp32 scales)", [ACTS], group, "deepgemm-ue8m0", "vllm-group"),
        ("deepgemm-ue8m0 vs vllm-group-ue8m0 (1x128)", [ACTS], group, "deepgemm-ue8m0", "vllm-group-ue8m0"),
        ("deepgemm-ue8m0 vs hf-fp8 (128x128 weight blocks)", WEIGHTS, block, "deepgemm-ue8m0", "hf-fp8"),
        ("fbgemm-fp8 (CUDA op) vs fbgemm (Triton) per row", WEIGHTS, channel, "fbgemm-fp8", "fbgemm"),
        ("fbgemm-fp8 vs compressed-tensors per channel", WEIGHTS, channel, "fbgemm-fp8", "compressed-tensors"),
        ("fbgemm-fp8 activations: ub 1200 vs none", [ACTS], token, ub, "fbgemm-fp8"),
        ("vLLM forward_native vs vllm-dynamic (per token)", [ACTS], token, native_token, "vllm-dynamic"),
        ("vLLM forward_native vs vllm-group (1x128)", [ACTS], group, native_group, "vllm-group"),
        ("FBGEMM quantize_fp8_row on CPU vs fbgemm (Triton) per row", WEIGHTS, channel, native["fbgemm-cpu"],
         "fbgemm"),
        ("te-nvfp4 vs compressed-tensors-nvfp4", WEIGHTS[:16], nvfp4, "te-nvfp4", "compressed-tensors-nvfp4"),
        ("te-nvfp4 vs modelopt-nvfp4", WEIGHTS[:16], nvfp4, "te-nvfp4", "modelopt-nvfp4"),
        ("te-nvfp4-2d vs te-nvfp4 (16x16 tiles vs 1x16)", WEIGHTS[:16], nvfp4, "te-nvfp4-2d", "te-nvfp4"),
    ]
    print("| comparison | element codes | scales |\n|---|---|---|")
    for label, xs, args, a, b in rows:
        c, s = rates(xs, args, a, b)
        print(f"| {label} | {c:.3f} % | {s:.2f} % |")


if __name__ == "__main__":
    main()
