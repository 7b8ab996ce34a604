"""Mismatch rates between torchao's MX / NVFP4 recipes and fp8ref's other MX / NVFP4 recipes
(docs/checkpoints.md, torchao): percent of codes and of block-scale bytes that differ, on N(0, 0.02)
bf16 weights [512, 2048], seed 0.   python tools/torchao_mismatch_rates.py
"""

import os

import ml_dtypes
import numpy as np

from fp8ref import quantize
from fp8ref.quant import QuantArgs
from fp8ref.registry import get_recipe, load_recipes


def main() -> None:
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((512, 2048)) * 0.02).astype(ml_dtypes.bfloat16)
    print("load average", os.getloadavg())
    recipes = load_recipes()

    def run(name, fmt, gran):
        q = quantize(w, QuantArgs(format=fmt, granularity=gran), recipe=get_recipe(name))
        return np.asarray(q.codes), np.asarray(q.scale_codes)

    def rates(res, t, names):
        return "; ".join(f"{n}: {100 * np.mean(res[t][0] != res[n][0]):.2f}% codes / "
                         f"{100 * np.mean(res[t][1] != res[n][1]):.2f}% scales" for n in names if n != t)

    for fmt in ("float8_e4m3fn", "float4_e2m1fn"):
        names = [n for n, r in recipes.items() if "mx" in r.granularities and fmt in r.formats]
        res = {n: run(n, fmt, "mx") for n in names}
        print(fmt)
        for t in (n for n in names if n.startswith("torchao")):
            print(" ", t, "vs", rates(res, t, names))
    names = [n for n, r in recipes.items() if "nvfp4" in r.granularities]
    res = {n: run(n, "float4_e2m1fn", "nvfp4") for n in names}
    for t in ("torchao-nvfp4", "torchao-nvfp4-no-tensor-scale"):
        print(t, "vs", rates(res, t, names))


if __name__ == "__main__":
    main()
