"""Compare builds of fp8ref's C loops (fp8ref/_kernels*.so) on quantize, in one process.

    python tools/ab_kernels.py A.so B.so [...] [--gran channel|block|group|tensor] [--level x86-64-v3]
                               [--no-vbmi] [--threads 1] [--rounds 8] [--rows 8192 --cols 8192]
    python tools/ab_kernels.py A.so B.so --replay [--rows 512] [--calls 20] ...

Build each variant with ``python setup.py build_ext --inplace`` and copy the library aside. For an
``#ifdef NAME`` experiment keep the flags Python adds to every compile, which a bare ``CFLAGS=-DNAME``
replaces (a loop ran at 0.082 and 0.124 ns per input built the two ways; the cache keys on the flags)::

    PYFLAGS="$(python -c 'import sysconfig; print(sysconfig.get_config_var("CFLAGS"))')"
    CFLAGS="$PYFLAGS -DNAME" python setup.py build_ext --inplace

Whole calls (default): each round runs every library in turn (the order rotating), each quantize right
after a ``copy_`` of the weight, as benchmarks/bench_isa.py times it, and checks that all libraries
wrote the same codes; it prints min / median ms per library and the ratio to ``copy_`` (3 bytes per
element counted against its 4). ``--replay``: the C tasks of one quantize call, captured and run
again ``--calls`` times on one thread with nothing between: the loops' own cost in ns per input
(on a weight that fits the last-level cache with the default ``--rows 512``; the codes streamed, as
large weights' are, unless ``--no-stream``). Differences of a few
percent need several runs: the machine's memory speed moves from process to process.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

import torch  # noqa: E402
from _util import cpu_model, quantize_tasks  # noqa: E402 - the benchmarks' helpers

from fp8ref import _native  # noqa: E402
from fp8ref.quant import QuantArgs, quantize  # noqa: E402

GRANS = {"channel": QuantArgs(granularity="channel"), "tensor": QuantArgs(granularity="tensor"),
         "block": QuantArgs(granularity="block", block_shape=(128, 128)),
         "group": QuantArgs(granularity="group", group_size=128)}


def load(path: str, level: str):
    """The library at path, checked and bound to `level` as fp8ref binds its own, on torch's OpenMP runtime."""
    _native.openmp_runtime()  # finds the runtime (once): else only the library current at the first call is bound
    lib = _native._open(os.path.abspath(path), level)
    if lib is None:
        raise SystemExit(f"{path}: refused (the warning above says why)")
    if _native._OPENMP.get("handle") is not None:
        _native.bind_openmp(lib, _native._OPENMP["handle"])
    return lib


def whole_calls(libs: dict, qa: QuantArgs, w: torch.Tensor, rounds: int) -> None:
    w_copy, codes = torch.empty_like(w), torch.zeros(w.shape, dtype=torch.uint8)
    ref = None
    for path, lib in libs.items():  # warm up, and the codes must agree
        _native._LIB[:] = [lib]
        quantize(w, qa, out=codes)
        if ref is None:
            ref = codes.clone()
        elif not torch.equal(ref, codes):
            raise SystemExit(f"{path} wrote other codes than {next(iter(libs))}")
    times, copies = {p: [] for p in libs}, []
    order = list(libs.items())
    for r in range(rounds):
        for path, lib in order[r % len(order):] + order[:r % len(order)]:
            _native._LIB[:] = [lib]
            t0 = time.perf_counter()
            w_copy.copy_(w)
            t1 = time.perf_counter()
            quantize(w, qa, out=codes)
            times[path].append(time.perf_counter() - t1)
            copies.append(t1 - t0)
    gbs = 4 * w.numel() / min(copies) / 1e9
    print(f"copy_ {gbs:.1f} GB/s (min), {4 * w.numel() / statistics.median(copies) / 1e9:.1f} (median)")
    for path, t in times.items():
        print(f"  {os.path.basename(path):24} min {min(t) * 1e3:7.2f} ms  median {statistics.median(t) * 1e3:7.2f} ms"
              f"  of copy_ {3 * w.numel() / min(t) / 1e9 / gbs:.3f}")


def replay(libs: dict, qa: QuantArgs, w: torch.Tensor, calls: int, rounds: int, stream: bool) -> None:
    out = torch.zeros(w.shape, dtype=torch.uint8)  # the tasks write into it: alive while they are replayed
    runs = {path: quantize_tasks(w, qa, out, stream, lib) for path, lib in libs.items()}
    ns = {p: [] for p in libs}
    for _ in range(rounds):
        for path, again in runs.items():
            t0 = time.perf_counter()
            for _ in range(calls):
                again()
            ns[path].append((time.perf_counter() - t0) / calls / w.numel() * 1e9)
    print(f"the C tasks of one quantize call, one thread, {calls} calls a round: ns per input")
    for path, t in ns.items():
        print(f"  {os.path.basename(path):24} min {min(t):.4f}  median {statistics.median(t):.4f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("libs", nargs="+")
    p.add_argument("--gran", choices=sorted(GRANS), default="channel")
    p.add_argument("--level", default=None, help="default: this CPU's best level")
    p.add_argument("--no-vbmi", action="store_true", help="x86-64-v4 without its VBMI loop (FP8REF_NO_VBMI)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--rows", type=int, default=None, help="default 8192 (512 with --replay)")
    p.add_argument("--cols", type=int, default=8192)
    p.add_argument("--replay", action="store_true")
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--no-stream", action="store_true",
                   help="--replay: normal stores (default: the codes written around the cache, as on large weights)")
    a = p.parse_args()
    if not _native.kernels_available():
        raise SystemExit(f"the C loops are not available: {_native.describe()}")
    if a.no_vbmi:
        os.environ["FP8REF_NO_VBMI"] = "1"
    level = a.level or _native.runnable_levels()[0]
    torch.set_num_threads(1 if a.replay else a.threads)
    _native.openmp_runtime()
    libs = {path: load(path, level) for path in a.libs}
    rows = a.rows or (512 if a.replay else 8192)
    w = (torch.randn(rows, a.cols, generator=torch.Generator().manual_seed(0)) * 0.02).bfloat16()

    print(f"cpu: {cpu_model()}; {level}{' without VBMI' if a.no_vbmi else ''}; {a.gran} {rows}x{a.cols} bfloat16")
    if a.replay:
        replay(libs, GRANS[a.gran], w, a.calls, a.rounds, not a.no_stream)
    else:
        print(f"{a.threads} thread(s), each call after a copy_ of the weight, {a.rounds} rounds")
        whole_calls(libs, GRANS[a.gran], w, a.rounds)


if __name__ == "__main__":
    main()
