"""scaled_mm speed against float32 and float64 matmuls of the same shape, measured in the same run.

    python benchmarks/bench_matmul.py [--m 256 --k 4096 --n 4096] [--repeat 7] [--fp32-k K] [--threads T] [--only exact]

Prints time(fp8ref) / time(torch float32 matmul) and time(fp8ref) / time(float64 matmul) (the
faster of torch's and numpy's, on float64 operands already decoded), each the median over rounds
of one timing each, in a rotating order, every callable timed on its second call in a row (so
none pays for the spinning idle threads of a different BLAS called just before it),
for accumulate="exact" (per tensor and per row scales, 1x128 / 128x128 block scales; also bias +
bfloat16 output) and accumulate="fp32". The float64 matmul is the exact mode's floor (one float64 GEMM of the decoded
values, docs/matmul.md "Speed"). Targets (issue #11): exact <= 1.3x float64 with tensor/row
scales, <= 2x with block scales; fp32 <= 2x float32. "b decoded once": b given as a DecodedCodes
record (Fp8RefLinear's weight), whose float64 forms are made on the warm-up call and reused.
--threads also sets numpy's BLAS threads (OPENBLAS_NUM_THREADS, read when numpy loads). --clock cpu
times process CPU time instead of wall time: with one thread it measures the work alone, which
other jobs on a shared machine barely move (with two, a thread that spins at a barrier counts).
The fp32 mode runs the C loop of fp8ref/_csrc/matmul.c (declared sequential order over K, register
tiles over M and N); without the C loops it is a numpy loop over K, far slower: use --fp32-k to time a
shorter K. Other processes on the machine move both timings: repeat runs and report the range
(the per-round range is printed too). On a machine shared with other jobs, --threads 1 gives the
steadier ratio: a two-thread GEMM waits at every barrier for whichever thread was descheduled.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

if "--threads" in sys.argv[:-1]:  # numpy's BLAS (OpenBLAS) reads its thread count when it loads
    os.environ["OPENBLAS_NUM_THREADS"] = sys.argv[sys.argv.index("--threads") + 1]

import _util  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from _util import best_time  # noqa: E402

from fp8ref import encode  # noqa: E402
from fp8ref.matmul import DecodedCodes, scaled_mm  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--m", type=int, default=256)
    p.add_argument("--k", type=int, default=4096)
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--repeat", type=int, default=7, help="rounds; ratios are medians over rounds")
    p.add_argument("--fp32-k", type=int, default=None, help="K for the fp32 mode (default: --k)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (the C loops follow; default: torch's)")
    p.add_argument("--only", default=None, help="run only the cases whose label contains this text, e.g. exact")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="cpu: process CPU time (one thread: the work alone, whatever the machine's load)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.clock == "cpu":
        _util.CLOCK = time.process_time
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

    def torch_mm(k: int, dtype=torch.float32):
        x, y = torch.randn(M, k, dtype=dtype), torch.randn(k, N, dtype=dtype)
        return lambda: torch.mm(x, y)

    def numpy_mm(k: int):
        x, y = rng.standard_normal((M, k)), rng.standard_normal((k, N))
        return lambda: x @ y

    bias = rng.standard_normal(N).astype(np.float32)
    kept = DecodedCodes(b)  # what Fp8RefLinear holds: b's float64 forms kept between calls

    print(f"threads: torch {torch.get_num_threads()}; shape {M}x{K}x{N}; clock {args.clock}; "
          f"load average {os.getloadavg()[0]:.2f}")
    cases = [
        ("exact, per-tensor scales", K, lambda: scaled_mm(a, b, sa, sb)),
        ("exact, row-wise scales", K, lambda: scaled_mm(a, b, row_a, row_b)),
        ("exact, 1x128 / 128x128 block scales", K, lambda: scaled_mm(a, b, blk_a, blk_b)),
        ("exact, row-wise + bias, bfloat16 out", K, lambda: scaled_mm(a, b, row_a, row_b, bias=bias,
                                                                      out_dtype="bfloat16")),
        ("exact, blocks + bias, bfloat16 out", K, lambda: scaled_mm(a, b, blk_a, blk_b, bias=bias,
                                                                    out_dtype="bfloat16")),
        ("exact, per-tensor, b decoded once", K, lambda: scaled_mm(a, kept, sa, sb)),
        ("exact, row-wise, b decoded once", K, lambda: scaled_mm(a, kept, row_a, row_b)),
        ("exact, blocks, b decoded once", K, lambda: scaled_mm(a, kept, blk_a, blk_b)),
        (f"fp32 (sequential), K={args.fp32_k}", args.fp32_k,
         lambda: scaled_mm(a[:, :args.fp32_k], b[:args.fp32_k], sa, sb, accumulate="fp32")),
    ]
    for label, k, fn in cases:
        if args.only and args.only not in label:
            continue
        refs = {"torch f32": torch_mm(k), "torch f64": torch_mm(k, torch.float64), "numpy f64": numpy_mm(k)}
        fn()  # warm: first-call allocations and lazy imports
        timed = {**refs, "fp8ref": fn}
        times = {name: [] for name in timed}
        ratios = {"torch f32": [], "f64": []}
        for r in range(args.repeat):
            # Each callable is timed on its second call in a row, the order rotating per round: none is
            # timed right after another library's BLAS, whose idle threads still spin (OpenBLAS's do
            # for a while after numpy's matmul: fp8ref ran 1.3-1.4x slower right after one here).
            names = list(timed)[r % len(timed):] + list(timed)[:r % len(timed)]
            for name in names:
                timed[name]()
                times[name].append(best_time(timed[name], 1))
            t = times["fp8ref"][-1]
            ratios["torch f32"].append(t / times["torch f32"][-1])
            ratios["f64"].append(t / min(times["torch f64"][-1], times["numpy f64"][-1]))
        best = {name: min(v) for name, v in times.items()}
        f64 = min(("torch f64", "numpy f64"), key=best.get)
        print(f"{label:38s} fp8ref {best['fp8ref']:6.3f} s  torch f32 {best['torch f32']:6.3f} s "
              f"(x{np.median(ratios['torch f32']):4.1f})  {f64} {best[f64]:6.3f} s "
              f"(x{np.median(ratios['f64']):4.2f}, rounds {min(ratios['f64']):4.2f}-{max(ratios['f64']):4.2f})")


if __name__ == "__main__":
    main()
