"""scaled_mm speed against a torch float32 matmul of the same shape, measured in the same run.

    python benchmarks/bench_matmul.py [--m 256 --k 4096 --n 4096] [--repeat 3] [--fp32-k K]

Prints time(fp8ref) / time(torch float32 matmul) for accumulate="exact" (per tensor and per row
scales, 128x128 block scales) and accumulate="fp32". Targets (issue): exact <= 10x, fp32 <= 2x.
The fp32 mode runs the C loop of fp8ref/_kernels_matmul.c (declared sequential order over K, register
tiles over M and N); without the C loops it is a numpy loop over K, far slower: use --fp32-k to time a
shorter K. Other processes on the machine move both timings: repeat runs and report the range.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from _util import best_time

from fp8ref import encode
from fp8ref.matmul import scaled_mm


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--m", type=int, default=256)
    p.add_argument("--k", type=int, default=4096)
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--fp32-k", type=int, default=None, help="K for the fp32 mode (default: --k)")
    args = p.parse_args()
    M, K, N = args.m, args.k, args.n
    args.fp32_k = args.fp32_k or K
    rng = np.random.default_rng(0)
    a = encode(rng.standard_normal((M, K)).astype(np.float32) * 8, "float8_e4m3fn")
    b = encode(rng.standard_normal((K, N)).astype(np.float32) * 8, "float8_e4m3fn")
    sa, sb = np.float32(0.0123), np.float32(0.00077)
    row_a = rng.uniform(0.01, 0.02, (M, 1)).astype(np.float32)
    row_b = rng.uniform(0.01, 0.02, (1, N)).astype(np.float32)
    blk_a = rng.uniform(0.01, 0.02, (M, -(-K // 128))).astype(np.float32)
    blk_b = rng.uniform(0.01, 0.02, (-(-K // 128), -(-N // 128))).astype(np.float32)

    def torch_mm(k: int):
        x, y = torch.randn(M, k), torch.randn(k, N)
        return lambda: torch.mm(x, y)

    print(f"threads: torch {torch.get_num_threads()}; shape {M}x{K}x{N}")
    cases = [
        ("exact, per-tensor scales", K, lambda: scaled_mm(a, b, sa, sb)),
        ("exact, row-wise scales", K, lambda: scaled_mm(a, b, row_a, row_b)),
        ("exact, 1x128 / 128x128 block scales", K, lambda: scaled_mm(a, b, blk_a, blk_b)),
        (f"fp32 (sequential), K={args.fp32_k}", args.fp32_k,
         lambda: scaled_mm(a[:, :args.fp32_k], b[:args.fp32_k], sa, sb, accumulate="fp32")),
    ]
    for label, k, fn in cases:
        ref = torch_mm(k)
        t_ref = best_time(ref, args.repeat)
        t = best_time(fn, args.repeat)
        t_ref = min(t_ref, best_time(ref, args.repeat))  # again after: both see the same machine state
        print(f"{label:40s} fp8ref {t:8.3f} s  torch fp32 mm {t_ref:7.3f} s  ratio {t / t_ref:6.1f}x")


if __name__ == "__main__":
    main()
