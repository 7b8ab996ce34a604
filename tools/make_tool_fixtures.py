"""Regenerate tests/fixtures/interop/tools/producer_tools.safetensors: what the producer tools' own CPU
code writes for one small bf16 input, so the default test run checks fp8ref's recipes against the tools'
bytes without the tools (tests/interop/test_producer_tools_fixture.py). Needs the tox -e tools venv
(tools/README.md); loaders and stubs: tests/support/producer_tools.py.

    TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES= python tools/make_tool_fixtures.py [--out FILE]

Deterministic (torch seed 7, CPU); the tool versions go in the file's metadata. Two runs write the same bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from tests.support import producer_tools  # noqa: E402

OUT = ROOT / "tests" / "fixtures" / "interop" / "tools" / "producer_tools.safetensors"


def make_input() -> torch.Tensor:
    """32 x 256 bf16: N(0, 1) rows times 2^U(-14, 9), an all-zero group with a -0.0, a subnormal-only
    group, group amaxes exactly 448 * 2^j and just above."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(32, 256, generator=g) * torch.exp2(torch.randint(-14, 10, (32, 1), generator=g).float())
    x[1, :128] = 0.0
    x[1, 5] = -0.0
    x[2, 128:] = 2.0 ** -133 * torch.randint(-3, 4, (128,), generator=g)
    for r in range(3, 15):
        x[r, 0], x[r, 128] = 448 * 2.0 ** (r - 9) * (1 + 2 ** -7), 448 * 2.0 ** (r - 9)
    return x.to(torch.bfloat16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") != "1" or os.environ.get("CUDA_VISIBLE_DEVICES") != "":
        sys.exit("set TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES= (see the docstring)")
    torch.manual_seed(0)
    x = make_input()
    out = {"x": x}
    cs = producer_tools.te_reference("reference_current_scaling")
    for fmt in ("float8_e4m3fn", "float8_e5m2"):
        for pow2 in (False, True):
            r = cs.CurrentScalingQuantizerRef(dtype=getattr(torch, fmt), rowwise=True, columnwise=False,
                                              pow_2_scales=pow2).quantize(x)
            key = f"te_current{'_pow2' if pow2 else ''}.{fmt}"
            out[key + ".codes"], out[key + ".scale_inv"] = r.data.view(torch.uint8), r.scale.float()
    nv = producer_tools.te_reference("reference_nvfp4")
    for tile, key in (((1, 16), "te_nvfp4"), ((16, 16), "te_nvfp4_2d")):
        r = nv.NVFP4QuantizerRef(dtype=nv.reference_utils.Fp4Formats.E2M1, rowwise=True, columnwise=False,
                                 quant_tile_shape=tile).quantize(x)
        out[key + ".packed"], out[key + ".scale"] = r.data, r.scale.view(torch.uint8)
    dg = producer_tools.deepgemm_math("vllm")
    for fn, key in ((dg.per_token_cast_to_fp8, "deepgemm.token"), (dg.per_block_cast_to_fp8, "deepgemm.block")):
        q, sf = fn(x, use_ue8m0=True)
        out[key + ".codes"], out[key + ".scale"] = q.view(torch.uint8), sf.float()
    v = producer_tools.vllm_modules()
    with v["context"]():
        token = v["QuantFP8"](static=False, group_shape=v["GroupShape"].PER_TOKEN)
        group = v["QuantFP8"](static=False, group_shape=v["GroupShape"](1, 128), use_ue8m0=False)
    for ub, key in ((None, "vllm_native.token"), (1.0, "vllm_native.token_ub1")):
        q, s = token.forward_native(x, scale_ub=None if ub is None else torch.tensor([ub]))
        out[key + ".codes"], out[key + ".scale"] = q.view(torch.uint8), s.float()
    q, s = group.forward_native(x)
    out["vllm_native.group.codes"], out["vllm_native.group.scale"] = q.view(torch.uint8), s.float()
    _, s = v["fp8_utils"].per_token_group_quant_fp8(x, 128, use_ue8m0=True)
    out["vllm_triton.group_ue8m0.scale"] = s.float()           # scales only: the interpreter's fp8 cast is wrong
    fb = producer_tools.fbgemm_fp8_gemm()
    for ub, key in ((None, "fbgemm_cpu.row"), (1.0, "fbgemm_cpu.row_ub1")):
        q, s = fb.quantize_fp8_row(x, scale_ub=None if ub is None else torch.tensor([ub]))
        out[key + ".codes"], out[key + ".scale"] = q.view(torch.uint8), s.float()
    meta = {"transformer_engine": version("transformer_engine"), "vllm": version("vllm"),
            "triton": version("triton"), "fbgemm_gpu_genai": version("fbgemm_gpu_genai"), "torch": torch.__version__,
            "deepgemm": "vllm/third_party/deep_gemm (vllm's bundled copy)"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: t.contiguous() for k, t in sorted(out.items())}, str(args.out), metadata={"tools": json.dumps(meta)})
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes): {meta}")


if __name__ == "__main__":
    main()
