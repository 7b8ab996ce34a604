"""fp8ref inside a torch pipeline: encode and quantize alternating with torch ops, beside the same
calls run alone. Every ratio is against a torch peer measured in the same run.

    python benchmarks/bench_pipeline.py [--n 67108864] [--rows 8192 --cols 8192] [--repeat 7]

A pipeline calls a layer's torch ops, then fp8ref, then torch again. After each op torch's OpenMP
workers keep spinning for a while (OMP_WAIT_POLICY is left unset, as users leave it); a second
thread pool would fight them for the cores. fp8ref's loops run on torch's own OpenMP team
(fp8ref._native), so "interleaved" should match "alone".

Rows:
* encode float32 / bfloat16 -> e4m3fn: torch's cast (``f8.copy_(x)``) time / fp8ref's (> 1: fp8ref faster).
* quantize an ROWSxCOLS bf16 weight (per-channel, per-tensor, 128x128 blocks; default 'fp8ref'
  recipe and compressed-tensors): bandwidth counted as the minimum traffic (input read once + codes
  written: 3 bytes per element) against ``torch.Tensor.copy_``'s on the same weight (bf16 -> bf16
  into an existing tensor: read + write, 4 bytes per element). Two columns: ``out=`` (the codes
  written into an existing buffer, as copy_ writes into one) and ``fresh`` (a new array per call,
  whose pages the kernel zeroes on first touch; ``clone()`` shows what the same costs a copy).
  Per-tensor needs the global amax before any code, so it reads the input twice (5 bytes per
  element moved, 3 counted): its limit is below the others'.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

from fp8ref import _native, encode  # noqa: E402
from fp8ref.quant import QuantArgs, quantize  # noqa: E402


def timed(fns: dict, repeat: int, between=None) -> dict:
    """Best time of each function; rounds interleave the functions so that all face the same load.
    ``between``: a torch op run before every timed call (the pipeline), not timed."""
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeat):
        for name, fn in fns.items():
            if between is not None:
                between()
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=64 * 2**20, help="elements for encode")
    p.add_argument("--rows", type=int, default=8192)
    p.add_argument("--cols", type=int, default=8192)
    p.add_argument("--repeat", type=int, default=7)
    a = p.parse_args()
    gen = torch.Generator().manual_seed(0)
    x32 = torch.randn(a.n, generator=gen) * 100
    xbf = x32.bfloat16()
    f8 = torch.empty(a.n, dtype=torch.float8_e4m3fn)
    codes = torch.empty(a.n, dtype=torch.uint8)
    w = (torch.randn(a.rows, a.cols, generator=gen) * 0.02).bfloat16()
    w_copy = torch.empty_like(w)
    h = torch.randn(4096, 4096, generator=gen)  # the layer's activations
    lin = torch.randn(4096, 1024, generator=gen)

    def layer():  # a layer's worth of multi-threaded torch work: elementwise ops and a matmul
        torch.tanh(h, out=h)
        h.mul_(1.5)
        torch.mm(h[:512], lin)

    print(f"torch {torch.__version__}, torch threads {torch.get_num_threads()}, cpu {os.cpu_count()}, "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')}, fp8ref C loops "
          f"{'on' if _native.kernels_available() else 'off'}, runtime {_native.openmp_runtime() or 'thread pool'}")
    quantize(w[:256], QuantArgs(granularity="channel"))  # warm up: recipes, tables, the runtime binding
    encode(x32[:1 << 21], "float8_e4m3fn", out=codes[:1 << 21])

    print(f"\nencode {a.n:,} elements -> float8_e4m3fn; ratio = torch f8.copy_(x) time / fp8ref time")
    print(f"  {'input':10} {'alone':>22} {'interleaved with torch':>30}")
    for label, x in (("float32", x32), ("bfloat16", xbf)):
        fns = {"fp8ref": lambda x=x: encode(x, "float8_e4m3fn", out=codes), "torch": lambda x=x: f8.copy_(x)}
        alone, mixed = timed(fns, a.repeat), timed(fns, a.repeat, between=layer)
        print(f"  {label:10} {alone['torch'] / alone['fp8ref']:8.2f}x ({alone['fp8ref'] * 1e3:6.1f} ms) "
              f"{mixed['torch'] / mixed['fp8ref']:14.2f}x ({mixed['fp8ref'] * 1e3:6.1f} ms)")

    n = w.numel()
    codes_out = torch.zeros(a.rows, a.cols, dtype=torch.uint8)
    print(f"\nquantize bf16 {a.rows}x{a.cols} -> e4m3fn; copy_ moves {4 * n / 1e6:.0f} MB, quantize's minimum "
          f"{3 * n / 1e6:.0f} MB; ratio = quantize GB/s / copy_ GB/s (same run)")
    cases = {
        "channel fp8ref": (QuantArgs(granularity="channel"), "fp8ref"),
        "channel compressed-tensors": (QuantArgs(granularity="channel"), "compressed-tensors"),
        "block 128 fp8ref": (QuantArgs(granularity="block", block_shape=(128, 128)), "fp8ref"),
        "block 128 hf-fp8": (QuantArgs(granularity="block", block_shape=(128, 128)), "hf-fp8"),
        "tensor fp8ref": (QuantArgs(granularity="tensor"), "fp8ref"),
        "tensor compressed-tensors": (QuantArgs(granularity="tensor"), "compressed-tensors"),
    }
    fns = {"copy_": lambda: w_copy.copy_(w), "clone": lambda: w.clone()}
    for name, (qa, r) in cases.items():
        fns[name] = lambda qa=qa, r=r: quantize(w, qa, recipe=r)
        fns[name + " out="] = lambda qa=qa, r=r: quantize(w, qa, recipe=r, out=codes_out)
    alone, mixed = timed(fns, a.repeat), timed(fns, a.repeat, between=layer)
    for ref in ("copy_", "clone"):
        print(f"  {ref:28} alone {4 * n / alone[ref] / 1e9:6.2f} GB/s, interleaved {4 * n / mixed[ref] / 1e9:6.2f} GB/s"
              + ("   (into a fresh tensor)" if ref == "clone" else ""))
    print(f"  {'':28} {'alone: out=':>16} {'fresh':>14}   {'interleaved: out=':>22} {'fresh':>14}")
    for name in cases:
        cells = []
        for t in (alone, mixed):
            for key in (name + " out=", name):
                cells.append(f"{(3 * n / t[key]) / (4 * n / t['copy_']):5.2f} ({3 * n / t[key] / 1e9:5.2f} GB/s)")
        print(f"  {name:28} {cells[0]:>16} {cells[1]:>18}   {cells[2]:>18} {cells[3]:>18}")


if __name__ == "__main__":
    main()
