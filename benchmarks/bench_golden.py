"""Golden generation and torch conformance timings (the issue's speed targets), plus a ratio
against a peer measured in the same run: deriving the formats suite's expected encode outputs
with fp8ref vs casting the same inputs with ml_dtypes (a plain RNE cast, no checks).

    python benchmarks/bench_golden.py [--level 1] [--threads 2]

Set --threads to pin numpy/torch/BLAS threads (the targets are stated for 2 cores).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--level", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(args.threads)
    import numpy as np
    import torch

    torch.set_num_threads(args.threads)
    from fp8ref.conformance import default_xfails, run
    from fp8ref.golden import DEFAULT_SUITES, generate, load_suite, verify
    from fp8ref.golden.ops import OPERATIONS
    from fp8ref.golden.suite import build

    suites = [load_suite(s) for s in DEFAULT_SUITES]
    total_gen = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        for s in suites:
            t0 = time.perf_counter()
            m = generate(s, Path(tmp) / s.name, level=args.level)
            t1 = time.perf_counter()
            verify(Path(tmp) / s.name)
            t2 = time.perf_counter()
            total_gen += t1 - t0
            print(f"golden generate {s.name} level {args.level}: {len(m['cases'])} cases {t1 - t0:.2f} s; "
                  f"verify {t2 - t1:.2f} s")
    print(f"golden generate, default suites, level {args.level}: {total_gen:.2f} s (target < 30 s on 2 cores)")

    total_conf = 0.0
    for s in suites:
        t0 = time.perf_counter()
        r = run("torch", s, level=args.level, xfails=default_xfails("torch"))
        dt = time.perf_counter() - t0
        total_conf += dt
        print(f"conform torch {s.name} level {args.level}: {r.compared()} cases compared, "
              f"{r.unexpected} unexpected, {dt:.2f} s")
    print(f"conform torch, default suites, level {args.level}: {total_conf:.2f} s (target < 60 s on 2 cores)")

    import ml_dtypes

    cases = [c for c in build(suites[0], args.level) if c.op == "encode" and c.params["rounding"] == "rne"
             and not c.params["saturate"] and hasattr(ml_dtypes, c.params["format"])]
    t0 = time.perf_counter()
    for c in cases:
        OPERATIONS["encode"].reference(c.params, c.inputs)
    ours = time.perf_counter() - t0
    t0 = time.perf_counter()
    with np.errstate(all="ignore"):
        for c in cases:
            c.inputs["x"].astype(getattr(ml_dtypes, c.params["format"]))
    peer = time.perf_counter() - t0
    n = sum(c.inputs["x"].size for c in cases)
    print(f"expected-output derivation vs ml_dtypes astype on the same {n} inputs ({len(cases)} cases): "
          f"fp8ref/ml_dtypes time ratio {ours / peer:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
