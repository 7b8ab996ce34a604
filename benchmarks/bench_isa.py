"""quantize into ``out=`` and encode, per instruction-set level, against ``copy_`` in the same run.

    python benchmarks/bench_isa.py [--rows 8192 --cols 8192 | --shapes llama-3-8b] [--n 67108864]
                                   [--repeat 7] [--threads 2,1] [--cpu-rows 512] [--spread 0]

The per-ISA loops (docs/build.md) are bound to each level this CPU runs in turn, in one process
(``fp8ref._native.use_level``, what ``FP8REF_ISA`` does at load), so that one run compares them
under the same load. The levels stand for the CPUs that run them: ``x86-64-v4 + VBMI`` (Ice Lake,
Sapphire Rapids, Zen 4: the bfloat16 table loop's VBMI path), ``x86-64-v4`` (AVX-512 without VBMI:
Skylake-SP, Cascade Lake; ``FP8REF_NO_VBMI=1``), ``x86-64-v3`` (AVX2: Haswell to Alder Lake, Zen 1-3)
and ``x86-64`` (SSE2 only). What the forced levels cannot show is another CPU's memory system.

Rows per level, each ``min / median`` over the rounds (rounds interleave every level and case with
the peer, the order of the levels rotating, so that all face the same load; the copy_ each ratio
divides by is the one timed beside it). Every timed call follows a ``copy_`` of 64 MiB, so that each
starts from the caches another large pass leaves, whatever ran before it: without it a weight that
fits the last-level cache was timed warm after the case before it read it, or cold after a 256 MiB
encode (1024x4096, one thread: blocks, timed after per channel, 0.71-0.85 of copy_; per channel,
after the encode, 0.42-0.46; both 0.32-0.42 from cold caches).

* CPU time per input of each quantize case, one thread, on a cache-resident weight (``--cpu-rows``):
  the loops' own cost whatever the load, against the budget that 0.8 of this run's one-thread
  ``copy_`` allows, and the ratio to ``copy_`` the loops alone would reach (their ceiling: a whole
  call also waits on memory). A level whose ceiling is under 0.8 cannot reach 0.8 on this machine
  whatever its prefetch and streaming choices.
* the per-channel quantize's own time (ms): ``copy_``'s speed moves from process to process on some
  machines (a VM measured 30-48 GB/s with two threads), which moves every ratio with it.
* quantize 8192x8192 bfloat16 into ``out=`` (default 'fp8ref' recipe; per channel, 128x128 blocks,
  per tensor): bandwidth counted as the minimum traffic (the input read once, the codes written:
  3 bytes per element) / ``copy_``'s on the same weight (bf16 into an existing tensor: 4 bytes per
  element). Target >= 0.8. Per tensor needs the global amax before its first code, so it reads the
  input twice (5 bytes moved per 3 counted): its limit is 0.6 unless the input fits in the cache.
* ``--shapes``: weights of other shapes in turn (``RxC``, comma-separated), or ``llama-3-8b``, the
  shapes of that model's linear layers (q and o 4096x4096, k and v 1024x4096, gate and up 14336x4096,
  down 4096x14336); the encode columns are timed with the first shape only.
* ``--spread B``: the weight's rows and 128-column groups each scaled by 2^U(-B/4, B/4), so that its
  row and block amaxes spread over binades as a model's do (8192x8192: the plain N(0, 0.02^2) weight
  has 86 distinct row amaxes and 77 block amaxes, 33 a band; B = 4 gives 336 and 314, 58 a band:
  each amax needs a table of its own).
* encode float32 / bfloat16 -> float8_e4m3fn into ``out=`` (``--n`` elements, bench_codec.py's
  shape): minimum traffic (5 / 3 bytes per element) / ``copy_``'s on the same input; and the float32
  encode against torch's own cast (``f8.copy_(x)``): its time / fp8ref's (> 1: fp8ref faster).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402
from _util import cpu_model, load_average, quantize_tasks  # noqa: E402

from fp8ref import _native, encode  # noqa: E402
from fp8ref.quant import QuantArgs, quantize  # noqa: E402

# (label, level, the VBMI path on)
CONFIGS = [("x86-64-v4 + VBMI", "x86-64-v4", True), ("x86-64-v4", "x86-64-v4", False),
           ("x86-64-v3", "x86-64-v3", False), ("x86-64", "x86-64", False), ("generic", "generic", False)]
QUANTIZE = {"channel": QuantArgs(granularity="channel"),
            "block 128": QuantArgs(granularity="block", block_shape=(128, 128)),
            "tensor": QuantArgs(granularity="tensor")}


EVICT_BYTES = 64 << 20  # each timed call follows a copy_ of this much (twice a 32 MiB last-level cache)
MODEL_SHAPES = {"llama-3-8b": [(4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336)]}


def configs() -> list[tuple[str, str, bool]]:
    """The configurations this CPU runs: the levels built that it runs, VBMI's where it has VBMI."""
    levels = _native.runnable_levels()
    vbmi = "avx512vbmi" in cpu_model()
    return [c for c in CONFIGS if c[1] in levels and (vbmi or not c[2])]


def bind(config: tuple[str, str, bool]) -> None:
    _native.use_level(config[1])
    if config[2]:
        os.environ.pop("FP8REF_NO_VBMI", None)
    else:
        os.environ["FP8REF_NO_VBMI"] = "1"  # read at each call by quant.c


def weight(rows: int, cols: int, spread: float, gen: torch.Generator) -> torch.Tensor:
    """N(0, 0.02^2) bfloat16; spread > 0: each row and each 128-column group scaled by
    2^U(-spread/4, spread/4)."""
    w = torch.randn(rows, cols, generator=gen) * 0.02
    if spread:
        per_row = torch.rand(rows, 1, generator=gen) * spread / 2 - spread / 4
        per_group = torch.rand(1, -(-cols // 128), generator=gen) * spread / 2 - spread / 4
        w *= torch.exp2(per_row + per_group.repeat_interleave(128, dim=1)[:, :cols])
    return w.bfloat16()


def spread_note(spread: float) -> str:
    return f" (scales spread over {spread:g} binades)" if spread else ""


def shapes(text: str) -> list[tuple[int, int]]:
    """``--shapes``: a model's name or comma-separated RxC"""
    if text in MODEL_SHAPES:
        return MODEL_SHAPES[text]
    try:
        out = [tuple(int(d) for d in part.lower().split("x")) for part in text.split(",")]
    except ValueError:
        out = []
    if not out or any(len(s) != 2 or min(s) < 1 for s in out):
        raise argparse.ArgumentTypeError(f"expected RxC[,RxC...] or one of {', '.join(MODEL_SHAPES)}, got {text!r}")
    return out


def run(threads: int, rows: int, cols: int, n: int, repeat: int, spread: float, with_encode: bool = True) -> float:
    """Prints the table of ratios; returns the best ``copy_`` of the weight over every level and round (GB/s)"""
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    w = weight(rows, cols, spread, gen)
    w_copy = torch.empty_like(w)
    codes_w = torch.zeros(rows, cols, dtype=torch.uint8)  # touched: out= is an existing buffer
    cases = {name: (lambda qa=qa: quantize(w, qa, out=codes_w)) for name, qa in QUANTIZE.items()}
    peers = {"copy_ w": lambda: w_copy.copy_(w)}
    if with_encode:
        x32 = torch.randn(n, generator=gen) * 100
        xbf = x32.bfloat16()
        x32_copy, xbf_copy = torch.empty_like(x32), torch.empty_like(xbf)
        codes_x = torch.zeros(n, dtype=torch.uint8)
        f8 = torch.zeros(n, dtype=torch.float8_e4m3fn)
        cases["encode f32"] = lambda: encode(x32, "float8_e4m3fn", out=codes_x)
        cases["encode bf16"] = lambda: encode(xbf, "float8_e4m3fn", out=codes_x)
        peers.update({"copy_ f32": lambda: x32_copy.copy_(x32), "copy_ bf16": lambda: xbf_copy.copy_(xbf),
                      "torch cast": lambda: f8.copy_(x32)})
    evict_src = torch.ones(EVICT_BYTES, dtype=torch.uint8)
    evict_dst = torch.empty_like(evict_src)
    chosen = configs()
    times = {c[0]: {k: [] for k in [*cases, *peers]} for c in chosen}
    for config in chosen:  # warm up: recipes, tables, the runtime binding, every page
        bind(config)
        for fn in [*cases.values(), *peers.values()]:
            fn()
    for r in range(repeat):
        for config in chosen[r % len(chosen):] + chosen[:r % len(chosen)]:
            bind(config)
            for key, fn in [*peers.items(), *cases.items()]:
                evict_dst.copy_(evict_src)
                t0 = time.perf_counter()
                fn()
                times[config[0]][key].append(time.perf_counter() - t0)
    os.environ.pop("FP8REF_NO_VBMI", None)
    _native.use_level(_native.runnable_levels()[0])

    def cell(t: dict, key: str, peer: str, own_bytes: int, peer_bytes: int) -> str:
        mn = (own_bytes / min(t[key])) / (peer_bytes / min(t[peer]))
        md = (own_bytes / statistics.median(t[key])) / (peer_bytes / statistics.median(t[peer]))
        return f"{mn:.2f} / {md:.2f}"

    wn = w.numel()
    enc = f", encode {n:,} elements into out=" if with_encode else ""
    print(f"\n{threads} thread{'s' if threads > 1 else ''}: quantize bf16 {rows}x{cols}{spread_note(spread)} "
          f"into out={enc}; each cell min / median over the rounds")
    head = ["copy_ w GB/s", "channel ms", *(f"{k} of copy_" for k in QUANTIZE)]
    head += ["enc f32 of copy_", "enc bf16 of copy_", "enc f32 vs cast"] if with_encode else []
    print(f"  {'level':18}" + "".join(f"{h:>19}" for h in head))
    for label, t in times.items():
        cells = [f"{4 * wn / min(t['copy_ w']) / 1e9:.1f} / {4 * wn / statistics.median(t['copy_ w']) / 1e9:.1f}",
                 f"{min(t['channel']) * 1e3:.2f} / {statistics.median(t['channel']) * 1e3:.2f}"]
        cells += [cell(t, k, "copy_ w", 3 * wn, 4 * wn) for k in QUANTIZE]
        if with_encode:
            cells += [cell(t, "encode f32", "copy_ f32", 5 * n, 8 * n),
                      cell(t, "encode bf16", "copy_ bf16", 3 * n, 4 * n),
                      f"{min(t['torch cast']) / min(t['encode f32']):.2f} / "
                      f"{statistics.median(t['torch cast']) / statistics.median(t['encode f32']):.2f}"]
        print(f"  {label:18}" + "".join(f"{c:>19}" for c in cells))
    return max(4 * wn / min(t["copy_ w"]) / 1e9 for t in times.values())


def cpu_per_input(rows: int, cols: int, repeat: int, spread: float) -> tuple[dict, int]:
    """CPU time (``time.process_time``: robust to other processes' load) per input of the C tasks of
    each quantize case (_util.quantize_tasks: without the call's own cost, ~90 us at 512x8192 on
    Zen 4, ~50 us of it Python: 0.02 ns per input there, 0.001 at 8192x8192) on one thread, on a
    weight that stays in the last-level cache (``--cpu-rows`` x ``--cols`` bfloat16: 8 MiB by default
    inside a 32 MiB L3), so that the loops' own cost is measured, not the memory's; the codes streamed
    as they are at 8192x8192. Returns the times (ns per input, per level and case) and the calls per
    cell, which print_cpu prints."""
    torch.set_num_threads(1)
    w = weight(rows, cols, spread, torch.Generator().manual_seed(0))
    codes = torch.zeros(rows, cols, dtype=torch.uint8)
    chosen = configs()
    calls = max(1, int(2e8 // w.numel()))  # ~0.05 s of work per cell
    times = {c[0]: {k: [] for k in QUANTIZE} for c in chosen}
    tasks = {}
    for config in chosen:
        bind(config)
        tasks[config[0]] = {name: quantize_tasks(w, qa, codes) for name, qa in QUANTIZE.items()}
    for r in range(repeat):
        for config in chosen[r % len(chosen):] + chosen[:r % len(chosen)]:
            bind(config)
            for name, again in tasks[config[0]].items():
                t0 = time.process_time()
                for _ in range(calls):
                    again()
                times[config[0]][name].append((time.process_time() - t0) / calls / w.numel() * 1e9)
    os.environ.pop("FP8REF_NO_VBMI", None)
    _native.use_level(_native.runnable_levels()[0])
    return times, calls


def print_cpu(times: dict, calls: int, rows: int, cols: int, spread: float, rate: float | None, of: str) -> None:
    """cpu_per_input's table, against a one-thread ``copy_`` of R GB/s (`of` says which; None where
    the run timed none): 0.8 of it allows 3 / (0.8 R) ns per input (3 bytes per input), and t ns per
    input reaches at most 3 / (t R)."""
    print(f"\n1 thread, CPU time per input (ns) of the C tasks of quantize bf16 {rows}x{cols}{spread_note(spread)} "
          f"into out= (cache-resident, codes streamed), {calls} calls per cell; each cell min / median over the "
          f"rounds, then the ratio to copy_ the min allows")
    if rate is None:
        print("  no one-thread copy_ timed (--threads without 1): no ceilings")
    else:
        print(f"  one-thread copy_ {of}: {rate:.1f} GB/s; 0.8 of it allows {3 / (0.8 * rate):.3f} ns per input")
    print(f"  {'level':18}" + "".join(f"{k:>26}" for k in QUANTIZE))
    for label, t in times.items():
        cells = [f"{min(v):.3f} / {statistics.median(v):.3f}" + (f" (<= {3 / (min(v) * rate):.2f})" if rate else "")
                 for v in t.values()]
        print(f"  {label:18}" + "".join(f"{c:>26}" for c in cells))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=8192)
    p.add_argument("--cols", type=int, default=8192)
    p.add_argument("--n", type=int, default=64 * 2**20, help="elements to encode")
    p.add_argument("--repeat", type=int, default=7, help="rounds")
    p.add_argument("--threads", default=f"{torch.get_num_threads()},1", help="thread counts, comma-separated")
    p.add_argument("--cpu-rows", type=int, default=512, help="rows of the cache-resident CPU-time weight (0: skip)")
    p.add_argument("--spread", type=float, default=0.0, help="binades the rows' and blocks' scales spread over")
    p.add_argument("--shapes", type=shapes, default=None,
                   help=f"weights RxC[,RxC...] in turn, or a model's: {', '.join(MODEL_SHAPES)} "
                        "(default: --rows x --cols)")
    a = p.parse_args()
    if not _native.kernels_available():
        raise SystemExit(f"the C loops are not available: {_native.describe()}")
    info = _native.build_info()
    print(f"cpu: {cpu_model()}, {os.cpu_count()} cores; load average {load_average()} (start)")
    print(f"torch {torch.__version__}; fp8ref {_native.describe()}; levels compared: "
          f"{', '.join(c[0] for c in configs())} (this CPU's best: {info['isa']})")
    cpu = cpu_per_input(a.cpu_rows, a.cols, a.repeat, a.spread) if a.cpu_rows else None
    rate = None  # the best one-thread copy_ of the first shape, from its table
    first = (a.shapes or [(a.rows, a.cols)])[0]
    for threads in dict.fromkeys(int(t) for t in a.threads.split(",") if t):
        for i, (rows, cols) in enumerate(a.shapes or [(a.rows, a.cols)]):
            best = run(threads, rows, cols, a.n, a.repeat, a.spread, with_encode=i == 0)
            rate = best if threads == 1 and i == 0 else rate
    if cpu:
        print_cpu(*cpu, a.cpu_rows, a.cols, a.spread, rate, f"of {first[0]}x{first[1]} bf16, best in its table above")
    print(f"\nload average {load_average()} (end)")


if __name__ == "__main__":
    main()
