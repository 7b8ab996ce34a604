"""quantize throughput and memory against the torch pipeline exporters use; recipe mismatch rates.

    python benchmarks/bench_quantize.py [--rows 8192] [--cols 8192] [--repeat 5] [--mismatch]

Peer: torch (same process, same run): amax per row, divide, clamp, ``.to(torch.float8_e4m3fn)``,
the compressed-tensors / auto-round export pipeline. fp8ref: ``quantize`` per-channel with the
default 'fp8ref' recipe (exact quotient rounded once). Prints the throughput ratio and fp8ref's
peak extra memory (tracemalloc: numpy allocations) as a multiple of the weight's size, then each
granularity's bandwidth against ``copy_``'s, into ``out=`` (target >= 0.8) and into a new array.

``--mismatch`` prints, for pairs of recipes on the same bf16/fp16/fp32 weights, the fraction of
codes that differ (the issue's "mismatch rate between recipes").
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import tracemalloc

# OMP_WAIT_POLICY is left as users leave it: fp8ref's loops run on torch's own OpenMP team
# (fp8ref/_native.py), so torch's spinning workers no longer steal the cores from them.

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402
from _util import cpu_model, load_average  # noqa: E402

from fp8ref import _native  # noqa: E402
from fp8ref.quant import QuantArgs, quantize  # noqa: E402

CHANNEL = QuantArgs(granularity="channel")


def torch_pipeline_fp32(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 scale and division (auto-round style)."""
    amax = w.abs().amax(dim=1, keepdim=True).float()
    scale = amax / 448.0
    q = (w / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q, scale


def torch_pipeline_model_dtype(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """scale and division in the weight's dtype (compressed-tensors style)."""
    scale = w.abs().amax(dim=1, keepdim=True) / 448.0
    q = (w / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q, scale


def best_of(fns: list, repeat: int) -> list[float]:
    """Best time of each function; runs are interleaved so that both face the same load."""
    best = [float("inf")] * len(fns)
    for _ in range(repeat):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - t0)
    return best


def bench(rows: int, cols: int, repeat: int) -> None:
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(0), dtype=torch.float32).to(torch.bfloat16)
    weight_bytes = w.numel() * w.element_size()
    quantize(w[:64], CHANNEL)  # warm up (recipe loading, kernels)
    torch_pipeline_fp32(w[:64])
    t_fp8ref, t_torch, t_torch_d = best_of(
        [lambda: quantize(w, CHANNEL), lambda: torch_pipeline_fp32(w), lambda: torch_pipeline_model_dtype(w)], repeat)
    tracemalloc.start()
    quantize(w, CHANNEL)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    gb = weight_bytes / 1e9
    print(f"cpu: {cpu_model()}, {os.cpu_count()} cores; load average {load_average()}; fp8ref {_native.describe()}")
    print(f"quantize per-channel bf16 {rows}x{cols}, threads: torch {torch.get_num_threads()}")
    print(f"  torch pipeline, fp32 division   : {t_torch * 1e3:8.1f} ms  ({gb / t_torch:.2f} GB/s of weight)")
    print(f"  torch pipeline, bf16 division   : {t_torch_d * 1e3:8.1f} ms  ({gb / t_torch_d:.2f} GB/s of weight)")
    print(f"  fp8ref quantize (exact quotient): {t_fp8ref * 1e3:8.1f} ms  ({gb / t_fp8ref:.2f} GB/s of weight)")
    print(f"  throughput ratio fp8ref/torch: {t_torch / t_fp8ref:.2f}x (fp32 pipeline), "
          f"{t_torch_d / t_fp8ref:.2f}x (bf16 pipeline)  (target >= 2x)")
    print(f"  fp8ref peak extra memory: {peak / 1e6:.1f} MB = {peak / weight_bytes:.2f}x the weight "
          f"(target <= 2x)")
    copy_bandwidth(w, repeat)


def copy_bandwidth(w: torch.Tensor, repeat: int) -> None:
    """quantize's bandwidth, counted as its minimum traffic (bf16 read once + codes written: 3 bytes
    per element), against torch.Tensor.copy_ on the same weight into an existing tensor (read + write:
    4 bytes per element). The target (issue #26) is for quantize into ``out=``, an existing codes
    array as copy_'s is; per tensor needs the global amax before its first code, so it reads x twice
    (5 bytes moved per 3 counted: ~0.6 at copy_'s rate). A new codes array each call is timed too,
    without a target: its pages are new to the process, and the kernel zeroes each before the loop
    writes it."""
    dst = torch.empty_like(w)
    out = torch.empty(w.shape, dtype=torch.uint8)
    grans = {"channel": QuantArgs(granularity="channel"), "tensor": QuantArgs(granularity="tensor"),
             "block 128x128": QuantArgs(granularity="block", block_shape=(128, 128))}
    fns = [lambda: dst.copy_(w)] + [lambda qa=qa: quantize(w, qa, out=out) for qa in grans.values()]
    fns += [lambda qa=qa: quantize(w, qa) for qa in grans.values()]
    t_copy, *t_q = best_of(fns, repeat)
    n = w.numel()
    print(f"  torch copy_ (bf16 -> bf16): {4 * n / t_copy / 1e9:.2f} GB/s (read + write)")
    for name, t in zip(grans, t_q[:len(grans)]):
        target = "no target: it reads x twice, limit ~0.6" if name == "tensor" else "target >= 0.8"
        print(f"  quantize {name:14} into out= (fp8ref recipe): {3 * n / t / 1e9:6.2f} GB/s of minimum traffic = "
              f"{(3 * n / t) / (4 * n / t_copy):.2f} of copy_ ({target})")
    for name, t in zip(grans, t_q[len(grans):]):
        print(f"  quantize {name:14} into a new array: {t * 1e3:6.2f} ms ({3 * n / t / 1e9:6.2f} GB/s; "
              f"no target: the kernel zeroes the new pages first)")


def mismatch() -> None:
    pairs = [("compressed-tensors", "fp8ref"), ("auto-round", "fp8ref"), ("compressed-tensors", "auto-round"),
             ("hf-fp8", "fp8ref"), ("fbgemm", "fp8ref"), ("vllm-dynamic", "fp8ref")]
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(2048, 4096, generator=gen)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        w = (base * 0.02).to(dtype)
        print(f"mismatch rate, 2048x4096 {str(dtype).removeprefix('torch.')} weights (N(0, 0.02^2)), "
              "% of codes that differ:")
        for a, b in pairs:
            gran = "block" if "hf-fp8" in (a, b) else "token" if "vllm-dynamic" in (a, b) else "channel"
            args = QuantArgs(granularity=gran, block_shape=(128, 128) if gran == "block" else None)
            qa, qb = quantize(w, args, recipe=a), quantize(w, args, recipe=b)
            n = int((qa.codes != qb.codes).sum())
            print(f"  {a:>18} vs {b:<18} [{gran:7}] {100 * n / w.numel():6.3f} %  ({n} of {w.numel()})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=8192)
    p.add_argument("--cols", type=int, default=8192)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--mismatch", action="store_true", help="also print recipe-vs-recipe mismatch rates")
    a = p.parse_args()
    bench(a.rows, a.cols, a.repeat)
    if a.mismatch:
        mismatch()


if __name__ == "__main__":
    main()
