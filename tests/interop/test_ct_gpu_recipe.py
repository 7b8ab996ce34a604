"""Recipe ``compressed-tensors-gpu`` against compressed-tensors' own Triton ``_quantize_kernel``.

The kernel is the one compressed-tensors dispatches to on CUDA (sm90+) and XPU; here it runs in Triton's
CPU interpreter in a fresh process (tests/support/ct_triton_quantize.py: TRITON_INTERPRET=1 must be set
before Triton is imported). Every code byte and every scale element is compared, on bf16, fp16 and fp32
weights with zero rows, values that underflow to zero (both signs) and outliers near 448 * scale.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("compressed_tensors")
pytest.importorskip("triton")
from safetensors.torch import load_file, save_file  # noqa: E402

from fp8ref.quant import QuantArgs, quantize  # noqa: E402

pytestmark = pytest.mark.interop
HELPER = Path(__file__).resolve().parents[1] / "support" / "ct_triton_quantize.py"
CASES = [("tensor", None, None), ("channel", None, None), ("group", 64, None), ("block", None, [32, 64])]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _weights(dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 128, generator=g) * torch.logspace(-3, 0, 64).unsqueeze(1)
    x[3] = 0.0                                        # an all-zero channel: scale eps(D)
    x[5, :8] = torch.tensor([1e-7, -1e-7, 0.0, -0.0, 3.0e-6, -3.0e-6, 1.0, -1.0])  # underflow, both signs
    x[7, 0] = 40.0                                    # a single outlier
    return x.to(dtype)


def _args(strategy, group, block):
    if strategy == "group":
        return QuantArgs(granularity="group", group_size=group)
    if strategy == "block":
        return QuantArgs(granularity="block", block_shape=tuple(block))
    return QuantArgs(granularity=strategy)


@pytest.fixture(scope="module")
def triton_run(tmp_path_factory):
    """{(dtype, strategy): (x, codes, scale)} from one interpreter run over every case."""
    tmp = tmp_path_factory.mktemp("ct_triton")
    tensors, cases = {}, []
    for di, (dname, dtype) in enumerate(DTYPES.items()):
        for ci, (strategy, group, block) in enumerate(CASES):
            name = f"{dname}_{strategy}"
            tensors[f"{name}.x"] = _weights(dtype, 10 * di + ci)
            cases.append({"name": name, "strategy": strategy, "group_size": group, "block": block})
    save_file(tensors, str(tmp / "in.safetensors"), metadata={"cases": json.dumps(cases)})
    env = {k: v for k, v in __import__("os").environ.items() if k != "CT_ENFORCE_EAGER"}
    done = subprocess.run([sys.executable, str(HELPER), str(tmp / "in.safetensors"), str(tmp / "out.safetensors")],
                          capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    out = load_file(str(tmp / "out.safetensors"))
    return {(c["name"].split("_")[0], c["strategy"]): (tensors[f"{c['name']}.x"], out[f"{c['name']}.codes"],
                                                       out[f"{c['name']}.weight_scale"]) for c in cases}


@pytest.mark.parametrize("dname", list(DTYPES))
@pytest.mark.parametrize("strategy,group,block", CASES, ids=[c[0] for c in CASES])
def test_gpu_recipe_reproduces_the_triton_kernel(triton_run, dname, strategy, group, block):
    x, codes, scale = triton_run[(dname, strategy)]
    q = quantize(x, _args(strategy, group, block), recipe="compressed-tensors-gpu")
    assert q.scale.dtype == scale.dtype and q.scale.numel() == scale.numel()
    assert torch.equal(q.scale.reshape(-1).view(torch.int16 if scale.element_size() == 2 else torch.int32),
                       scale.reshape(-1).contiguous().view(torch.int16 if scale.element_size() == 2 else torch.int32))
    got, want = q.codes.reshape(-1).view(torch.uint8), codes.reshape(-1).view(torch.uint8)
    bad = (got != want).nonzero().flatten()
    assert bad.numel() == 0, f"{bad.numel()} of {got.numel()} codes differ, first at {bad[:5].tolist()}"


def test_the_two_paths_differ_on_bf16(triton_run):
    """The Triton kernel is not the eager path: the eager recipe misses codes the GPU recipe reproduces."""
    x, codes, _ = triton_run[("bf16", "channel")]
    eager = quantize(x, _args("channel", None, None), recipe="compressed-tensors")
    assert (eager.codes.reshape(-1).view(torch.uint8) != codes.reshape(-1).view(torch.uint8)).sum() > 0
