"""Share of E4M3 codes on which compressed-tensors' GPU (Triton) and CPU (eager) paths differ.

Recipes compressed-tensors-gpu and compressed-tensors on synthetic bf16 weights (seeded: Gaussian,
Student-t with 3 degrees of freedom, Gaussian with per-row magnitudes spread over 2^-6..2^0), per
channel and per tensor. Usage: PYTHONPATH=. python tools/ct_gpu_mismatch.py [rows cols]
"""

from __future__ import annotations

import sys

import ml_dtypes
import numpy as np

from fp8ref import QuantArgs, quantize


def weights(kind: str, rows: int, cols: int) -> np.ndarray:
    rng = np.random.default_rng(0)
    if kind == "gaussian":
        x = rng.standard_normal((rows, cols))
    elif kind == "student-t3":
        x = rng.standard_t(3, (rows, cols))
    else:
        x = rng.standard_normal((rows, cols)) * np.exp2(rng.uniform(-6, 0, (rows, 1)))
    return (0.02 * x).astype(np.float32).astype(ml_dtypes.bfloat16)


def main(rows: int = 1024, cols: int = 1024) -> None:
    print(f"bf16 weights [{rows}, {cols}]: codes of compressed-tensors-gpu != compressed-tensors")
    for kind in ("gaussian", "student-t3", "row-spread"):
        x = weights(kind, rows, cols)
        shares = []
        for g in ("channel", "tensor"):
            gpu = quantize(x, QuantArgs(granularity=g), recipe="compressed-tensors-gpu").codes
            eager = quantize(x, QuantArgs(granularity=g), recipe="compressed-tensors").codes
            shares.append(f"{g} {100 * np.mean(np.asarray(gpu) != np.asarray(eager)):.2f} %")
        print(f"  {kind:11s} " + ", ".join(shares))


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:3]))
