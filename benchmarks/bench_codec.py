"""Codec throughput and memory against torch, measured in the same run.

    python benchmarks/bench_codec.py [--n 67108864]

Prints fp8ref's throughput relative to (a) torch's own cast into a preallocated float8 tensor,
(b) the exporters' pipeline ``(x / s).clamp(-448, 448).to(torch.float8_e4m3fn)`` and (c) torch's
float8 -> float32 cast for decode. Ratios > 1 mean fp8ref is faster. Each call runs alone;
benchmarks/bench_pipeline.py times the same casts interleaved with torch ops, as in a pipeline.
"""

from __future__ import annotations

import argparse

import torch
from _util import best_time, cpu_model, load_average, peak_extra_rss

from fp8ref import _native, decode, encode
from fp8ref.codec import kernels_available


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=64 * 2**20)
    args = p.parse_args()
    n = args.n
    torch.manual_seed(0)
    x32 = torch.randn(n) * 100
    xbf = x32.bfloat16()
    scale = torch.tensor(0.5)
    f8 = torch.empty(n, dtype=torch.float8_e4m3fn)
    codes = torch.empty(n, dtype=torch.uint8)
    y = torch.empty(n)
    print(f"cpu: {cpu_model()}; load average {load_average()}; fp8ref {_native.describe()}")
    print(f"n = {n:,} elements, torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"fp8ref C loops {'on' if kernels_available() else 'off (numpy)'}")

    rows = []
    for label, x in (("float32", x32), ("bfloat16", xbf)):
        t_ref = best_time(lambda x=x: encode(x, "float8_e4m3fn", out=codes))
        t_cast = best_time(lambda x=x: f8.copy_(x))
        t_pipe = best_time(lambda x=x: (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn))
        rows.append((f"encode {label} -> e4m3fn (sat, rne)", t_ref, "torch .copy_ into float8", t_cast))
        rows.append((f"encode {label} -> e4m3fn (sat, rne)", t_ref, "exporter pipeline x/s,clamp,.to", t_pipe))
    f8.copy_(x32)
    encode(x32, "float8_e4m3fn", out=codes)
    if not torch.equal(codes, f8.view(torch.uint8)):  # in-range data: both must be exact RNE
        raise SystemExit("fp8ref and torch disagree on in-range float32 data")
    t_dec = best_time(lambda: decode(codes, "float8_e4m3fn", out=y))
    t_tdec = best_time(lambda: y.copy_(f8))
    rows.append(("decode e4m3fn -> float32", t_dec, "torch float8 .copy_ into float32", t_tdec))

    print(f"{'operation':38} {'fp8ref':>9} {'peer':34} {'peer s':>9} {'ratio':>7}")
    for op, t, peer, tp in rows:
        print(f"{op:38} {t:9.4f} {peer:34} {tp:9.4f} {tp / t:6.2f}x  ({n / t / 1e9:.2f} Gelem/s)")

    extra = peak_extra_rss(lambda: encode(x32, "float8_e4m3fn", out=codes))
    print(f"peak extra RSS of encode(float32, out=...): {extra / 2**20:.1f} MiB "
          f"(input {x32.nbytes / 2**20:.0f} MiB)")


if __name__ == "__main__":
    main()
