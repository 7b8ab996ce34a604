"""Codes that vLLM's load-time steps change on the NVFP4, MX, ModelOpt and Quark fixtures.

Not fp8ref code; evidence for tests/fixtures/interop/FINDINGS-FP4-MX.md section 8. Models two steps read in
vllm-project/vllm vllm/model_executor/layers/quantization/utils/w8a8_utils.py:
  requantize_with_max_scale: q' = e4m3_sat(fp32(fp16(fp16(q) * s_i)) * fp32(1/s_max)) for each fused shard
  normalize_e4m3fn_to_e4m3fnuz: code 0x80 -> 0x00, same bits read as e4m3fnuz, scales x 2.
Usage: /work/main/.venv/bin/python tools/vllm_load_cost.py
"""

from pathlib import Path

import ml_dtypes
import numpy as np
import torch
from safetensors.torch import load_file

D = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "interop" / "checkpoints"
L = "model.layers.0."
FUSED = {"qkv": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
         "gate_up": ["mlp.gate_proj", "mlp.up_proj"]}


def main() -> None:
    for name in ("modelopt_fp8", "quark_fp8"):
        sd = load_file(str(D / name / "model.safetensors"))
        for group, shards in FUSED.items():
            s = {n: np.float32(sd[L + n + ".weight_scale"].float().item()) for n in shards}
            s_max = max(s.values())
            for n in shards:
                codes = sd[L + n + ".weight"].view(torch.uint8).numpy()
                deq16 = (codes.view(ml_dtypes.float8_e4m3fn).astype(np.float16) * np.float16(s[n])).astype(np.float16)
                x = deq16.astype(np.float32) * np.float32(np.float32(1.0) / s_max)
                new = np.clip(x, -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
                diff = np.abs(new.view(ml_dtypes.float8_e4m3fn).astype(np.float64) * s_max
                              - codes.view(ml_dtypes.float8_e4m3fn).astype(np.float64) * s[n])
                changed, zeroed = int((diff > 0).sum()), int(((new & 0x7F) == 0).sum() - ((codes & 0x7F) == 0).sum())
                print(f"{name} {group} {n}: s={s[n]:.6g} s_max={s_max:.6g} requant: dequantized values changed "
                      f"{changed}/{codes.size} ({100 * changed / codes.size:.2f} %), newly zero {zeroed}, "
                      f"max |change| {diff.max():.3g}, "
                      f"fnuz: 0x80 codes -> 0x00: {int((codes == 0x80).sum())}")


if __name__ == "__main__":
    main()
