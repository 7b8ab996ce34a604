"""verify's mismatch bookkeeping, before and after it became lazy (same run, same checkpoint).

Builds an original of LAYERS bf16 DIM x DIM linears (default 8 x 2048 x 2048, random), exports it
FP8_DYNAMIC with fp8ref, then times ``fp8ref.nn.verify.verify`` (recipe given, local executor):

* after:  the bookkeeping as it is (count the mismatches; search for the first only when there is one);
* before: the old bookkeeping patched back in (``mask.sum()`` and ``np.argwhere(mask)[0]`` on every mask);
* read:   reading every tensor of both files once (the floor verify cannot go below).

Prints the CPU model, each best-of-N time, before/after and verify/read ratios.

Usage: python benchmarks/bench_verify.py [--layers 8] [--dim 2048] [--repeat 3]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import ml_dtypes
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._util import best_time  # noqa: E402
from fp8ref.io.safetensors import write_safetensors  # noqa: E402


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        import platform

        return platform.processor() or "unknown CPU"


def old_mismatches(mask: np.ndarray) -> tuple[int, list[int] | None]:
    """The bookkeeping before: a full sum and a full argwhere of every mask, clean or not."""
    idx = np.argwhere(mask)
    return int(mask.sum()), ([int(i) for i in idx[0]] if idx.size else None)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)

    import fp8ref
    import fp8ref.nn.verify as v
    from fp8ref.io.safetensors import open_store

    print(f"CPU: {cpu_model()}; {args.layers} layers of {args.dim} x {args.dim} bf16, FP8_DYNAMIC")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        rng = np.random.default_rng(0)
        tensors = {f"model.layers.{i}.mlp.down_proj.weight":
                   ("BF16", rng.standard_normal((args.dim, args.dim), np.float32).astype(ml_dtypes.bfloat16))
                   for i in range(args.layers)}
        (tmp / "orig").mkdir()
        write_safetensors(tmp / "orig" / "model.safetensors", tensors, {"format": "pt"})
        fp8ref.export_checkpoint(tmp / "orig", tmp / "q", {"scheme": "FP8_DYNAMIC"})
        ckpt, orig = fp8ref.load_checkpoint(tmp / "q"), fp8ref.load_checkpoint(tmp / "orig")

        def run():
            assert v.verify(ckpt, orig, recipe="compressed-tensors")["ok"]

        def read():
            for path in (tmp / "q", tmp / "orig"):
                store = open_store(path)
                for name in store:
                    np.array(store.get(name), copy=True)  # every byte touched once

        t_read = best_time(read, args.repeat)
        t_after = best_time(run, args.repeat)
        new = v._mismatches
        v._mismatches = old_mismatches
        try:
            t_before = best_time(run, args.repeat)
        finally:
            v._mismatches = new
    print(f"read both files: {t_read:.3f} s")
    print(f"verify, bookkeeping before: {t_before:.3f} s ({t_before / t_read:.2f}x read)")
    print(f"verify, bookkeeping after:  {t_after:.3f} s ({t_after / t_read:.2f}x read)")
    print(f"ratio before/after: {t_before / t_after:.2f}x (bookkeeping was {1 - t_after / t_before:.0%} of verify)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
