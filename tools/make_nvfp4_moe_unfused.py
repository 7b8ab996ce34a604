"""Write tests/fixtures/interop/checkpoints/fp8ref_nvfp4_moe_unfused: a ModelOpt NVFP4 MoE checkpoint
whose experts' gate and up projections carry their own global scales (weight_scale_2), as ModelOpt
checkpoints in the wild do (vllm#54974: 69 % of the gate/up pairs of one, ratios up to 10x). It is what
``fp8ref explain`` measures the engines' w13 global-scale policies on.

fp8ref's export shares one global over fused gate/up siblings (llm-compressor's rule), so the checkpoint
is exported first (recipe modelopt-nvfp4, from the committed moe_qwen3_moe_bf16 weights, activation amax
4.0 everywhere) and then every expert's gate_proj and up_proj are quantized again each on its own: the
same recipe on the same original weight, its own amax -> its own weight_scale_2, block scales and codes.

    python tools/make_nvfp4_moe_unfused.py [OUT]
"""

from __future__ import annotations

import json
import re
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fp8ref import __version__  # noqa: E402
from fp8ref.checkpoint.calibration_file import CALIBRATION_FORMAT  # noqa: E402
from fp8ref.checkpoint.export import export_checkpoint  # noqa: E402
from fp8ref.codec import encode  # noqa: E402
from fp8ref.io.safetensors import open_store, pack_nibbles, write_safetensors  # noqa: E402
from fp8ref.quant import QuantArgs, quantize  # noqa: E402

SOURCE = ROOT / "tests" / "fixtures" / "interop" / "checkpoints" / "moe_qwen3_moe_bf16"
OUT = ROOT / "tests" / "fixtures" / "interop" / "checkpoints" / "fp8ref_nvfp4_moe_unfused"
SPEC = """name: nvfp4-moe
description: NVFP4 everywhere except the router gates and lm_head
scheme: NVFP4
ignore:
  - lm_head
  - "re:.*mlp\\\\.gate$"
"""
UNFUSED = re.compile(r"^(.*\.experts\.\d+\.(?:gate|up)_proj)\.weight$")


def main(out: Path = OUT) -> None:
    src = open_store(SOURCE / "model.safetensors")
    with tempfile.TemporaryDirectory() as tmp:
        spec, cal = Path(tmp) / "spec.yaml", Path(tmp) / "cal.json"
        spec.write_text(SPEC)
        linears = [n[: -len(".weight")] for n in src if n.endswith("_proj.weight")]
        cal.write_text(json.dumps({"format": CALIBRATION_FORMAT, "holds": "amax", "fp8ref_version": __version__,
                                   "input_amax": {n: 4.0 for n in linears}, "kv_amax": {}}))
        exported = Path(tmp) / "out"
        export_checkpoint(SOURCE, exported, spec, format="modelopt", recipe="modelopt-nvfp4", calibration=cal)
        store = open_store(exported / "model.safetensors")
        tensors = {n: (store.info(n).dtype, np.array(store.get(n))) for n in store}
        for name in src:
            m = UNFUSED.match(name)
            if not m:
                continue
            q = quantize(np.asarray(src.get(name)), QuantArgs(format="float4_e2m1fn", granularity="nvfp4"),
                         recipe="modelopt-nvfp4")
            layer = m.group(1)
            tensors[layer + ".weight"] = ("U8", pack_nibbles(np.asarray(q.codes)))
            tensors[layer + ".weight_scale"] = ("F8_E4M3", encode(np.asarray(q.scale), "float8_e4m3fn"))
            tensors[layer + ".weight_scale_2"] = ("F32", np.asarray(q.global_scale, np.float32).reshape(()))
        if out.exists():
            shutil.rmtree(out)
        shutil.copytree(exported, out, ignore=shutil.ignore_patterns(".fp8ref-output.json"))  # not an output now
        write_safetensors(out / "model.safetensors", tensors, {"format": "pt"})
        (out / "fixture.json").write_text(json.dumps({
            "function": "tools/make_nvfp4_moe_unfused.py: fp8ref export (format modelopt, recipe modelopt-nvfp4, "
                        "input amax 4.0) of moe_qwen3_moe_bf16, then each expert's gate_proj and up_proj "
                        "quantized on its own (its own weight_scale_2)",
            "versions": {"fp8ref": __version__}, "source": "moe_qwen3_moe_bf16"}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else OUT)
