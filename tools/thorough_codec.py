"""Thorough mode: every one of the 2**32 float32 inputs, two independent encoders, zero differences.

Encoder A is the general C loop (integer arithmetic on the float32 bit pattern, fp8ref/_csrc/codec.c).
Encoder B is the numpy path: bfloat16 round-to-odd of x, then a 65,536-entry table computed by
the float64 frexp/ldexp reference (_encode_exact). They share no rounding code. For rne, the C
fast path (bit-pattern carry + the FPU's own rounding for subnormals), which encode() uses, is
compared as well.

    python tools/thorough_codec.py                       # float8_e4m3fn, rne, saturating
    python tools/thorough_codec.py --format float8_e5m2 --rounding rtz --no-saturate
    python tools/thorough_codec.py --all                 # every applicable format x mode x saturate
Exit status 1 on any difference (the first ones are printed as hex repros).
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
from tqdm import tqdm

from fp8ref.codec import _c_encode_params, _c_rne_params, _encode_f32_via_table, _kernels, _run_c
from fp8ref.formats import FORMATS

CHUNK = 1 << 24


def sweep(fmt, rounding: str, saturate: bool) -> int:
    params = _c_encode_params(fmt, saturate, rounding)
    if params is None:
        print(f"skip {fmt.name} {rounding}: the C loop does not cover it (no second implementation)")
        return 0
    rne = _c_rne_params(fmt, saturate) if rounding == "rne" else None
    a = np.empty(CHUNK, np.uint8)
    b = np.empty(CHUNK, np.uint8)
    c = np.empty(CHUNK, np.uint8)
    bad = 0
    label = f"{fmt.name} {rounding} {'sat' if saturate else 'nonsat'}"
    for lo in tqdm(range(0, 1 << 32, CHUNK), desc=label, unit="chunk", leave=False):
        bits = np.arange(lo, lo + CHUNK, dtype=np.uint64).astype(np.uint32)
        _run_c("fp8ref_encode_f32", bits, a, params)
        _encode_f32_via_table(bits, b, fmt, saturate, rounding, use_c=False)
        pairs = [("C", a)]
        if rne is not None:
            _run_c("fp8ref_encode_f32_rne", bits, c, rne)
            pairs.append(("C-rne", c))
        for name, got in pairs:
            diff = np.nonzero(got != b)[0]
            for i in diff[:5]:
                print(f"  MISMATCH {label}: x=0x{int(bits[i]):08x} ({bits[i:i+1].view(np.float32)[0]!r}) "
                      f"{name}={int(got[i]):#04x} table={int(b[i]):#04x}")
            bad += diff.size
    print(f"{label}: {bad} differences over 2**32 inputs")
    return bad


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--format", default="float8_e4m3fn")
    p.add_argument("--rounding", default="rne", choices=["rne", "rna", "rtz", "rup", "rdown", "rto"])
    p.add_argument("--no-saturate", dest="saturate", action="store_false")
    p.add_argument("--all", action="store_true", help="every format x mode x saturate the C loop covers")
    args = p.parse_args(argv)
    if _kernels() is None:
        print("the C kernels are not built (pip install -e . with a C compiler); nothing to compare")
        return 1
    start = time.perf_counter()
    if args.all:
        runs = [(f, m, s) for f in FORMATS.values() for m in ("rne", "rna", "rtz", "rup", "rdown", "rto")
                for s in (True, False)]
    else:
        runs = [(FORMATS[args.format], args.rounding, args.saturate)]
    bad = sum(sweep(*run) for run in runs)
    print(f"total differences: {bad}; {time.perf_counter() - start:.0f} s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
