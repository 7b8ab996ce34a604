"""fp8ref.hardware speed, as ratios measured in the same run (best of N; the load average is printed:
on a loaded machine say so).

1. Instruction models against MMA-Sim (``mmasim``, the peer): the same operands, one instruction
   call each (wgmma m64n256k32 e4m3 with f32 and f16 accumulators, tcgen05 mxf8f6f4 m128n256k32,
   mxf4 and mxf4nvf4 m128n256k64, every CDNA3 FP8 MFMA), and the same instruction issued over a K
   loop (a 128 x 256 x 1024 wgmma GEMM and a 64 x 128 x 512 MFMA 32x32x16 GEMM: mmasim instruction
   by instruction, fp8ref's kernel model over all tiles). Every result is checked bit for bit against
   mmasim first; mmasim's time is its best with torch's threads and with one thread. An instruction's
   time (either side) is the best of at least --repeat calls and at least 50 ms of calls.
2. The Hopper kernel models (hopper-promoted, hopper-fast-accum) on M x N x K (default 256 x 4096
   x 4096) against a float32 torch matmul of the same shape, interleaved: each round times torch
   (best of 3) and the kernel model (once); the ratios of every round are printed as a range.

    python benchmarks/bench_hardware.py [--shape 256x4096x4096] [--repeat 3] [--rounds 3]
    python benchmarks/bench_hardware.py --accuracy     # docs/accumulation.md's accuracy table
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._util import best_time  # noqa: E402
from fp8ref.hardware import instruction, kernel_mm, mma, native  # noqa: E402

INSTRUCTIONS = [("wgmma", "Hopper", "m64n256k32.f32.e4m3.e4m3"),
                ("wgmma", "Hopper", "m64n256k32.f16.e4m3.e4m3"),
                ("tcgen05.mma", "Blackwell", "m128n256k32.kind::mxf8f6f4.block32.f32.e4m3.e4m3.ue8m0"),
                ("tcgen05.mma", "Blackwell", "m128n256k64.kind::mxf4.block32.f32.e2m1.e2m1.ue8m0"),
                ("tcgen05.mma", "Blackwell", "m128n256k64.kind::mxf4nvf4.block16.f32.e2m1.e2m1.ue4m3")] + \
    [("mfma", "CDNA3", f"f32_{shape}_{a}_{b}") for shape in ("16x16x32", "32x32x16") for a in ("fp8", "bf8")
     for b in ("fp8", "bf8")]


MIN_TOTAL = 0.05  # seconds of calls per instruction timing: a 10 us call's best of 5 is mostly noise


def _peer_best(fn, repeat: int, min_total: float = 0.0) -> float:
    """mmasim's best time over torch's thread count and one thread: on a loaded machine its small
    torch ops lose 10-20x to OpenMP contention with 2 threads, which would inflate the ratio."""
    import torch

    n = torch.get_num_threads()
    best = best_time(fn, repeat, min_total)
    torch.set_num_threads(1)
    try:
        return min(best, best_time(fn, repeat, min_total))
    finally:
        torch.set_num_threads(n)


def _load() -> str:
    return "load average " + " ".join(f"{x:.1f}" for x in os.getloadavg())


def _operands(ins, rng):
    finite = np.array([c for c in range(ins.a_fmt.n_codes) if ins.a_fmt.exact_value(c) is not None], np.uint8)
    A = rng.choice(finite, (ins.m, ins.k))
    B = rng.choice(finite, (ins.k, ins.n))
    C = rng.standard_normal((ins.m, ins.n)).astype(ins.acc)
    SA = SB = None
    if ins.scale_fmt is not None:
        lo, hi = (120, 134) if ins.scale_type == "ue8m0" else (0x20, 0x50)
        SA = rng.integers(lo, hi, (ins.m, ins.k // ins.block)).astype(np.uint8)
        SB = rng.integers(lo, hi, (ins.k // ins.block, ins.n)).astype(np.uint8)
    return A, B, C, SA, SB


def bench_instructions(repeat: int) -> None:
    try:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "hardware"))
        from tests.support.mmasim import run, simulator
    except ImportError as exc:
        print(f"instructions: mmasim not installed ({exc}); pip install mmasim==2.1.1")
        return
    rng = np.random.default_rng(0)
    for op, arch, s in INSTRUCTIONS:
        ins = instruction(op, arch, s)
        A, B, C, SA, SB = _operands(ins, rng)
        sim = simulator(op, arch, s)
        ref = run(sim, op, arch, s, A, B, C, SA, SB)
        mine = mma(op, arch, s, A, B, C, scale_a=SA, scale_b=SB)
        u = np.uint32 if ins.acc == "float32" else np.uint16
        assert np.array_equal(ref.view(u), mine.view(u))
        args = (op, arch, s, A, B, C)
        t_sim = _peer_best(lambda args=args, sim=sim, SA=SA, SB=SB: run(sim, *args, SA, SB), repeat, MIN_TOTAL)
        t_me = best_time(lambda args=args, SA=SA, SB=SB: mma(*args, scale_a=SA, scale_b=SB), repeat, MIN_TOTAL)
        path = "C" if native.applies(ins) else "numpy"
        print(f"instruction {op} {s}: mmasim {t_sim * 1e3:.1f} ms, fp8ref ({path}) {t_me * 1e3:.3f} ms, "
              f"ratio {t_sim / t_me:.0f}x (bit-identical; {_load()})")
    # a K loop of one instruction: mmasim instruction by instruction vs the kernel model over all tiles
    for op, arch, s, kernel, (M, N, K) in (("wgmma", "Hopper", "m64n256k32.f32.e4m3.e4m3", "hopper-fast-accum",
                                            (128, 256, 1024)),
                                           ("mfma", "CDNA3", "f32_32x32x16_fp8_fp8", "cdna3", (64, 128, 512))):
        ins = instruction(op, arch, s)
        finite = np.array([c for c in range(256) if ins.a_fmt.exact_value(c) is not None], np.uint8)
        A, B = rng.choice(finite, (M, K)), rng.choice(finite, (K, N))
        sim = simulator(op, arch, s)

        def looped(sim=sim, ins=ins, op=op, arch=arch, s=s, A=A, B=B, M=M, N=N, K=K):
            D = np.zeros((M, N), np.float32)
            for i in range(0, M, ins.m):
                for j in range(0, N, ins.n):
                    for k0 in range(0, K, ins.k):
                        D[i:i + ins.m, j:j + ins.n] = run(sim, op, arch, s, A[i:i + ins.m, k0:k0 + ins.k],
                                                          B[k0:k0 + ins.k, j:j + ins.n], D[i:i + ins.m, j:j + ins.n])
            return D

        ref = looped()
        mine = kernel_mm(A, B, kernel=kernel)
        assert np.array_equal(ref.view(np.uint32), mine.view(np.uint32))
        t_sim = _peer_best(looped, 1)
        t_me = best_time(lambda A=A, B=B, kernel=kernel: kernel_mm(A, B, kernel=kernel), repeat)
        print(f"K loop {M}x{N}x{K} of {s}: mmasim {t_sim:.2f} s, fp8ref kernel model {kernel} {t_me * 1e3:.1f} ms, "
              f"ratio {t_sim / t_me:.0f}x (bit-identical; {_load()})")


def bench_kernel(shape: str, rounds: int) -> None:
    import torch

    M, N, K = (int(x) for x in shape.split("x"))
    rng = np.random.default_rng(1)
    A = rng.integers(0, 0x7E, (M, K)).astype(np.uint8)
    B = rng.integers(0, 0x7E, (K, N)).astype(np.uint8)
    ta, tb = torch.randn(M, K), torch.randn(K, N)
    for name in ("hopper-promoted", "hopper-fast-accum"):
        ratios, times, torch_times = [], [], []
        for _ in range(rounds):
            t_torch = best_time(lambda: ta @ tb, 3)
            t_me = best_time(lambda name=name: kernel_mm(A, B, kernel=name), 1)
            ratios.append(t_me / t_torch)
            times.append(t_me)
            torch_times.append(t_torch)
        print(f"kernel {name} {M}x{N}x{K}: fp8ref {min(times):.2f}-{max(times):.2f} s, torch float32 matmul "
              f"{min(torch_times) * 1e3:.0f}-{max(torch_times) * 1e3:.0f} ms ({torch.get_num_threads()} threads), "
              f"ratio per round {min(ratios):.1f}-{max(ratios):.1f}x (target: within 10x; {_load()})")


def accuracy() -> None:
    """docs/accumulation.md's table: error against the exact sum, relative to sum |a*b|."""
    from fp8ref import decode, encode

    rng = np.random.default_rng(0)
    M = N = 32
    names = ("hopper-fast-accum", "hopper-promoted", "ada-fast-accum", "blackwell-fp8")
    for K in (4096, 16384):
        for dist in ("signed", "positive"):
            x, w = rng.standard_normal((M, K)), rng.standard_normal((K, N))
            if dist == "positive":
                x, w = np.abs(x), np.abs(w)
            a = encode((x * 64).astype(np.float32), "float8_e4m3fn")
            b = encode((w * 64).astype(np.float32), "float8_e4m3fn")
            A, B = decode(a, "float8_e4m3fn").astype(np.float64), decode(b, "float8_e4m3fn").astype(np.float64)
            exact, l1 = A @ B, np.abs(A) @ np.abs(B)  # exact: multiples of 2**-18 below 2**34 (< 53 bits)
            cells = []
            for name in names:
                err = np.abs(kernel_mm(a, b, kernel=name) - exact) / l1
                cells.append(f"{name} {err.max():.1e}/{err.mean():.1e}")
            acc = np.zeros((M, N), np.float32)
            A32, B32 = A.astype(np.float32), B.astype(np.float32)
            for k in range(K):
                acc = (acc + A32[:, k:k + 1] * B32[k:k + 1, :]).astype(np.float32)
            err = np.abs(acc - exact) / l1
            cells.append(f"fp32-sequential {err.max():.1e}/{err.mean():.1e}")
            print(f"accuracy K={K} {dist}: " + ", ".join(cells))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="256x4096x4096", help="M x N x K of the kernel benchmark")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the kernel benchmark")
    ap.add_argument("--accuracy", action="store_true", help="print the accuracy table instead")
    args = ap.parse_args()
    if args.accuracy:
        accuracy()
        return
    bench_instructions(args.repeat)
    bench_kernel(args.shape, args.rounds)


if __name__ == "__main__":
    main()
