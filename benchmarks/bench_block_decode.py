"""The exact reference's per-call cost at M = 1 (a decode step) on block-scaled layers, and how much of
it is decoding the whole weight.

    python benchmarks/bench_block_decode.py [--out N] [--in K] [--repeat R]

One linear layer of [N, K] (default 2048 x 8192, the 1B model's down_proj) with random bf16 weights,
quantized by fp8ref's export as FP8_BLOCK (128x128 blocks), MXFP8, MXFP4 and NVFP4; an
``Fp8RefLinear`` of it (keep_decoded False, the default) called on one bf16 token. Printed per scheme
(best of R, in the same run):
* the call (``reference``, exact accumulation);
* the whole-weight decode: NVFP4 / MX: what the call does (the stored codes read, unpacked and
  decoded to float32 element values; ``block_scaled_linear`` then sums each block of products by a
  BLAS matmul, exact, and applies the scales to K/16 or K/32 terms per output); FP8_BLOCK: what a
  whole decode times the block scales in float64 would cost (the call itself decodes nothing whole
  at M <= 8), and its share of the call;
* the peer: torch's float64 ``F.linear`` of the same shapes (the call's lower limit), and the ratio.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._util import best_time, cpu_model  # noqa: E402

SCHEMES = ("MXFP8", "MXFP4", "NVFP4", "FP8_BLOCK")
NAME = "model.layers.0.mlp.down_proj"


def _checkpoint(work: Path, scheme: str, n: int, k: int):
    import torch

    import fp8ref
    from fp8ref.io.safetensors import write_safetensors

    src = work / "orig"
    if not src.exists():
        src.mkdir()
        g = torch.Generator().manual_seed(0)
        w = (torch.randn(n, k, generator=g) * 0.02).to(torch.bfloat16)
        write_safetensors(src / "model.safetensors", {f"{NAME}.weight": ("BF16", w.view(torch.int16).numpy())})
    out = work / scheme
    calibration = {NAME: 4.0} if scheme == "NVFP4" else None  # NVFP4's static input global scale
    recipe = {"MXFP8": "compressed-tensors-mx", "MXFP4": "compressed-tensors-mx",
              "NVFP4": "compressed-tensors-nvfp4"}.get(scheme)  # compressed-tensors' own, as llm-compressor writes
    fp8ref.export_checkpoint(src, out, {"scheme": scheme}, calibration=calibration, recipe=recipe)
    return fp8ref.load_checkpoint(out)[NAME]


def _whole_decode(layer, lin) -> np.ndarray:
    """The weight decoded whole, as the call's path would: codes to float64 times the block scales."""
    from fp8ref.codec import decode

    q = layer.quant
    if q.weight_strategy in ("nvfp4", "mx"):  # what the call decodes: the stored codes read, unpacked, decoded
        return decode(layer.weight_codes, q.weight_fmt)
    # FP8 blocks: the call decodes nothing whole at M <= 8; this is what a whole decode with its scales costs
    return decode(lin.decoded_weight().codes, q.weight_fmt).astype(np.float64) * layer.expanded_scale()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=int, default=2048)
    ap.add_argument("--in", dest="inp", type=int, default=8192)
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args(argv)
    import torch

    from fp8ref.nn import Fp8RefLinear

    print(f"# bench_block_decode: [{a.out}, {a.inp}] at M = 1; CPU: {cpu_model()}; {os.cpu_count()} cores; "
          f"torch threads {torch.get_num_threads()}; load {os.getloadavg()[0]:.1f}")
    x = (torch.randn(1, a.inp, generator=torch.Generator().manual_seed(1))).to(torch.bfloat16)
    w64 = torch.randn(a.out, a.inp, dtype=torch.float64)
    x64 = x.double()
    peer = best_time(lambda: torch.nn.functional.linear(x64, w64), a.repeat)
    print(f"peer torch float64 F.linear: {peer * 1e3:.2f} ms")
    print(f"{'scheme':10} {'call ms':>9} {'decode ms':>10} {'decode share':>13} {'call / peer':>12}")
    with tempfile.TemporaryDirectory() as tmp:
        for scheme in SCHEMES:
            layer = _checkpoint(Path(tmp), scheme, a.out, a.inp)
            lin = Fp8RefLinear(layer)
            lin(x)  # first call reads and checks the codes
            call = best_time(lambda lin=lin: lin(x), a.repeat)
            dec = best_time(lambda layer=layer, lin=lin: _whole_decode(layer, lin), a.repeat)
            print(f"{scheme:10} {call * 1e3:9.2f} {dec * 1e3:10.2f} {dec / call:13.2f} {call / peer:12.2f}")
    print(f"# load at the end {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
