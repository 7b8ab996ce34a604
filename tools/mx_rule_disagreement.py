"""On how many MX blocks the E8M0 scale rules disagree with transformers' ROUND_UP (gpt-oss), measured:
random bf16 blocks (Gaussian, and Gaussian times a log-uniform magnitude), every positive bf16 amax,
and the experts of tests/fixtures/gptoss. Prints a markdown table (docs/checkpoints.md).

    python tools/mx_rule_disagreement.py [--blocks 200000]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import ml_dtypes
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RULES = ("ocp-floor", "rceil", "even")


def amax_of(x: np.ndarray) -> np.ndarray:
    return np.abs(x.astype(ml_dtypes.bfloat16).astype(np.float64)).reshape(-1, 32).max(-1)


def main(argv=None) -> int:
    from fp8ref import load_checkpoint
    from fp8ref.formats import FORMATS
    from fp8ref.scaling import mx_scale_exponent

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=200_000)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    n = args.blocks
    gauss = rng.standard_normal((n, 32))
    sets = {
        f"Gaussian blocks ({n:,})": amax_of(gauss),
        f"Gaussian x 2^U(-20, 20) per block ({n:,})": amax_of(gauss * 2.0 ** rng.uniform(-20, 20, (n, 1))),
        "every positive finite bf16 amax (32,639)": (np.arange(1, 0x7F80, dtype=np.uint32) << 16)
        .view(np.float32).astype(np.float64),
    }
    fixture = ROOT / "tests/fixtures/gptoss/original_bf16"
    if fixture.exists():
        orig = load_checkpoint(fixture)
        rows = [np.swapaxes(np.asarray(orig.tensor(t), np.float64), 1, 2).reshape(-1, 32)
                for t in orig.store if t.endswith(("experts.gate_up_proj", "experts.down_proj"))]
        amax = np.abs(np.concatenate(rows)).max(-1)
        sets[f"tests/fixtures/gptoss experts ({amax.size:,})"] = amax
    elem = FORMATS["float4_e2m1fn"]
    print("| blocks | " + " | ".join(f"ROUND_UP vs {r}" for r in RULES) + " |")
    print("|---|" + "---|" * len(RULES))
    for name, a in sets.items():
        up = mx_scale_exponent(a, elem, "round-up")
        cells = []
        for r in RULES:
            other = mx_scale_exponent(a, elem, r)
            d = int(np.count_nonzero(up != other))
            cells.append(f"{d / a.size:.1%} ({d:,})")
        print(f"| {name} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
