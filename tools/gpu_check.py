"""What an NVIDIA GPU really computes, against fp8ref on the same machine's CPU (issue #27).

    PYTHONPATH=. python tools/gpu_check.py [--out DIR] [--budget SECONDS] [--parts P,...] [--dry-run]

One prepared run for a short loan of an H200 (docs/hardware-gpu.md says how to start it). Parts:

- ``scaled_mm``: ``torch._scaled_mm`` FP8 on the GPU (per-tensor and row-wise scales, ``use_fast_accum``
  off and on, float32 and bfloat16 outputs, K from 32 to 8192, e4m3 and e5m2, fp8ref's crafted GEMM
  patterns): ``fp8ref probe`` names its accumulation parameters, and every registered accumulation model
  is ranked by the output elements it reproduces bit for bit (``conform --accumulation best``), with the
  first differing element of each case the best model misses.
- ``wgmma``: one raw Hopper ``wgmma.mma_async`` m64n256k32 (e4m3/e5m2 x e4m3/e5m2 -> f32) written in PTX
  (tools/gpu_wgmma.py) on MMA-Sim-style crafted operands and random ones, bit for bit against
  ``fp8ref.hardware.mma``.
- ``casts``: torch's CUDA float8 casts (saturating and not; from float32, bfloat16, float16) on every
  input near each format boundary and on random bit patterns, against ``fp8ref.encode``.
- ``ct_triton``: compressed-tensors' Triton quantize kernel (on CUDA it is what compressed-tensors runs)
  against fp8ref's ``compressed-tensors-gpu`` recipe, bytes compared, and the share of codes where the
  GPU path differs from the CPU (eager) recipe.
- ``not_carried``: the CUDA-only peers too large to carry to the machine, with their wheel sizes.

Each part writes its results into ``OUT/gpu_check.json`` and ``OUT/gpu_check.md`` as soon as it ends,
so a run cut short still leaves a report; a part that would start after ``--budget`` seconds is
recorded as not reached. ``--dry-run`` (also the behaviour without a CUDA device): every step that
needs the GPU reports "skipped: no GPU", and the rest runs, with torch's CPU operations standing in for
the GPU where torch has them (labelled so), so the whole script is exercised on any machine
(tests/tools/test_gpu_check.py runs it in the default suite).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tools")]

import gpu_wgmma  # noqa: E402

from benchmarks._util import cpu_model  # noqa: E402
from fp8ref import encode  # noqa: E402
from fp8ref.formats import get_format  # noqa: E402

FORMATS = ("float8_e4m3fn", "float8_e5m2")
K_SWEEP = (32, 256, 1024, 4096, 8192)
NOT_CARRIED = {  # package: (what it would check, largest x86-64 wheel in MiB on PyPI, 2026-12-05)
    "vllm 0.34.0": ("its CUTLASS / Machete FP8 and block-scaled GEMMs, its load-time requantization", 228),
    "transformer-engine-cu12 2.20.2": ("TE's FP8 GEMM and its delayed-scaling recipe", 695),
    "fbgemm-gpu 1.9.0": ("FBGEMM's row-wise FP8 GEMM and quantize_fp8_per_row", 475),
    "sgl-kernel 0.3.21": ("SGLang's FP8 and block-scaled GEMMs", 511),
    "flashinfer-python 0.7.4": ("FlashInfer's FP8 attention and NVFP4 KV cache (compiles kernels at first use)", 97),
    "deep-gemm 1.0.0": ("DeepGEMM's 1x128 / 128x128 FP8 GEMM (sdist only: built with nvcc at install)", 0),
}


class Run:
    """The report, written after every part; the budget shared by all parts."""

    def __init__(self, out: Path, budget: float, dry_run: bool, quick: bool = False):
        self.out, self.budget, self.t0, self.quick = out, budget, time.monotonic(), quick
        self.gpu = not dry_run and _cuda_available()
        self.report = {"machine": machine(self.gpu), "dry_run": not self.gpu, "budget_s": budget, "parts": {}}
        out.mkdir(parents=True, exist_ok=True)

    def left(self) -> float:
        return self.budget - (time.monotonic() - self.t0)

    def part(self, name: str, fn) -> None:
        t = time.monotonic()
        if self.left() <= 0:
            entry = {"status": "not reached: the budget was spent"}
        else:
            try:
                entry = fn(self)
            except Exception as exc:  # a part that breaks must not lose the others' results
                entry = {"status": f"error: {type(exc).__name__}: {exc}",
                         "traceback": traceback.format_exc(limit=6)}
        entry["seconds"] = round(time.monotonic() - t, 2)
        self.report["parts"][name] = entry
        self.write()
        print(f"[{time.monotonic() - self.t0:7.1f} s] {name}: {entry['status']}", flush=True)

    def write(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        for path, text in ((self.out / "gpu_check.json", json.dumps(self.report, indent=1, default=str) + "\n"),
                           (self.out / "gpu_check.md", markdown(self.report))):
            tmp = path.with_suffix(path.suffix + ".tmp")
            tmp.write_text(text)
            os.replace(tmp, path)


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def machine(gpu: bool) -> dict:
    import torch

    import fp8ref

    info = {"python": platform.python_version(), "torch": torch.__version__, "cpu": cpu_model(),
            "fp8ref_loops": fp8ref.build_info(), "cuda": torch.version.cuda}
    if gpu:
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, capability=f"sm_{p.major}{p.minor}", gpu_memory_gib=round(p.total_memory / 2**30, 1))
    for pkg in ("triton", "compressed_tensors", "transformers"):
        try:
            info[pkg] = __import__(pkg).__version__
        except Exception as exc:
            info[pkg] = f"not importable ({type(exc).__name__})"
    return info


# ---------------------------------------------------------------------------------------------- scaled_mm

def scaled_mm_suite_text(quick: bool = False) -> str:
    """Random operands over the K sweep (K <= 4096: a suite file's limit per dimension; K = 8192 runs in
    long_k()), and fp8ref's crafted GEMM patterns at one shape."""
    ks = (32, 64) if quick else [k for k in K_SWEEP if k <= 4096]
    sweep = [[64, k, 64] for k in ks]
    common = ("    scales: [tensor, row]\n    out_dtypes: [float32, bfloat16]\n    accumulate: [fp32]\n"
              "    scale_order: [epilogue, operands]\n    bias: [false]\n")
    return (f"suite: gpu-scaled-mm\nseed: 27\nlevel: 1\noperations:\n"
            f"  - op: scaled_mm\n    formats: [{', '.join(FORMATS)}]\n    shapes: {{1: {sweep}}}\n{common}"
            f"  - op: scaled_mm\n    formats: [float8_e4m3fn]\n"
            f"    shapes: {{1: [[64, {ks[-1] if quick else 256}, 64]]}}\n"
            f"{common}    patterns: [zero-blocks, single-nonzero, single-outlier, denormal-only, scales]\n")


def part_scaled_mm(run: Run) -> dict:
    from fp8ref.cli.probe import backend_gemm
    from fp8ref.conformance import run as conform_run
    from fp8ref.conformance.adapters.torch_backend import TorchBackend, TorchCudaBackend, TorchCudaFastAccumBackend
    from fp8ref.golden import load_suite
    from fp8ref.hardware.probe import matching_models, probe

    suite_path = run.out / "gpu-scaled-mm.yaml"
    suite_path.write_text(scaled_mm_suite_text(run.quick))
    suite = load_suite(str(suite_path))
    backends = [TorchCudaBackend(), TorchCudaFastAccumBackend()] if run.gpu else [TorchBackend()]
    results = {}
    for backend in backends:
        if run.left() < 20:
            results[backend.name] = {"status": "not reached: the budget was spent"}
            continue
        entry = {}
        found = probe(backend_gemm(backend))
        entry["probe"] = {k: v for k, v in found.items()}
        entry["probe"]["matches"] = matching_models(found)
        r = conform_run(backend, suite, accumulation="best")
        judge = r.accumulation
        entry["ranking"] = judge.to_json()
        entry["ranking_text"] = judge.report_lines()
        entry["cases"] = {status: sum(c.status == status for c in r.results)
                          for status in sorted({c.status for c in r.results})}
        entry["not_implemented"] = sorted({c.reason for c in r.results if c.status == "not-implemented"})[:10]
        entry["errors"] = sorted({f"{c.name}: {c.reason}" for c in r.results if c.status == "error"})[:20]
        entry["mismatched_cases"] = [{"case": c.name, "detail": [str(m) for m in c.mismatches][:2]}
                                     for c in r.results if c.status == "mismatch"][:20]
        entry["k8192" if not run.quick else "k128"] = long_k(backend, 128 if run.quick else K_SWEEP[-1])
        results[backend.name] = entry
    status = "ran on the GPU" if run.gpu else "skipped: no GPU (torch's CPU _scaled_mm stood in, to exercise the run)"
    return {"status": status, "suite": scaled_mm_suite_text(run.quick), "backends": results}


def long_k(backend, K: int) -> dict:
    """Past a suite's size limit: one 32 x K x 32 GEMM per format, scale kind and output dtype, every
    registered accumulation model counted by the elements it reproduces bit for bit."""
    from fp8ref.errors import Fp8RefError
    from fp8ref.matmul import ACCUMULATION_MODELS, scaled_mm

    rng = np.random.default_rng(8192)
    out = {}
    for fmt in FORMATS:
        a = encode((rng.standard_normal((32, K)) * 4).astype(np.float32), fmt, saturate=True)
        b = encode((rng.standard_normal((K, 32)) * 4).astype(np.float32), fmt, saturate=True)
        for scales in ("tensor", "row"):
            sa = np.float32(rng.uniform(0.5, 2, (1, 1) if scales == "tensor" else (32, 1)))
            sb = np.float32(rng.uniform(0.5, 2, (1, 1) if scales == "tensor" else (1, 32)))
            for od in ("float32", "bfloat16"):
                try:
                    got = np.asarray(backend.scaled_mm(a, b, sa, sb, bias=None, fmt=fmt, out_dtype=od,
                                                       accumulate="fp32", scale_order="epilogue"))
                except Exception as exc:
                    out[f"{fmt} {scales} {od}"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
                    continue
                counts = {}
                for model in ACCUMULATION_MODELS:
                    try:
                        want = scaled_mm(a, b, sa, sb, out_dtype=od, accumulate=model, fmt_a=fmt, fmt_b=fmt)
                    except Fp8RefError:
                        continue
                    counts[model] = int(np.sum(_bits(got) == _bits(want)))
                best = max(counts, key=counts.get)
                out[f"{fmt} {scales} {od}"] = {"elements": int(got.size), "best": best, "matched": counts}
    return out


def _bits(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x)
    return x.view(np.uint16) if x.dtype.itemsize == 2 else x.astype(np.float32).view(np.uint32)


# -------------------------------------------------------------------------------------------------- wgmma

def part_wgmma(run: Run) -> dict:
    from fp8ref.hardware import instruction, mma
    from tests.support.mma_cases import crafted, random_case

    pairs = [(a, b) for a in FORMATS for b in FORMATS]
    text = gpu_wgmma.ptx(pairs)
    (run.out / "wgmma.ptx").write_text(text)
    cubin, why = gpu_wgmma.ptxas_check(text)
    entry = {"ptxas": "compiled for sm_90a" if cubin else why}
    rng = np.random.default_rng(27)
    cases = {}
    for a_fmt, b_fmt in pairs:
        shape = f"m64n256k32.f32.{gpu_wgmma.TYPES[a_fmt]}.{gpu_wgmma.TYPES[b_fmt]}"
        ins = instruction("wgmma", "Hopper", shape)
        todo = [("crafted", *crafted(ins, rng))] + [(f"random{i}", *random_case(ins, rng, specials=i == 2))
                                                   for i in range(1 if run.quick else 3)]
        cases[(a_fmt, b_fmt)] = [(name, A, B, C, mma("wgmma", "Hopper", shape, A, B, C)) for name, A, B, C in todo]
    entry["reference"] = {f"{a} x {b}": len(v) for (a, b), v in cases.items()}
    if not run.gpu:
        entry["status"] = "skipped: no GPU (the PTX was generated and fp8ref's expected results computed)"
        return entry
    if platform.machine() != "x86_64" or _capability() != (9, 0):
        entry["status"] = f"skipped: wgmma needs sm_90 (this GPU is sm_{''.join(map(str, _capability()))})"
        return entry
    import torch

    torch.zeros(1, device="cuda")  # the primary context, current in this thread
    driver = gpu_wgmma.Driver(cubin if cubin is not None else text.encode() + b"\0")
    entry["layout"] = variant = _descriptor_variant(driver)
    if variant is None:
        entry["status"] = "error: no descriptor layout reproduced the exact small-integer product (see layout)"
        return entry
    fields = gpu_wgmma.descriptor_fields(*gpu_wgmma.DESCRIPTOR_VARIANTS[variant])
    out = {}
    for (a_fmt, b_fmt), todo in cases.items():
        for name, A, B, C, want in todo:
            got = gpu_wgmma.run_wgmma(driver, a_fmt, b_fmt, A, B, C, fields)
            out[f"{gpu_wgmma.TYPES[a_fmt]}x{gpu_wgmma.TYPES[b_fmt]} {name}"] = compare_f32(got, want)
    entry["cases"] = out
    bad = [k for k, v in out.items() if v["differ"]]
    entry["status"] = (f"ran on the GPU: {len(out) - len(bad)} of {len(out)} cases bit for bit"
                       + (f"; differ: {', '.join(bad)}" if bad else ""))
    return entry


def _capability() -> tuple[int, int]:
    import torch

    return torch.cuda.get_device_capability(0)


def _descriptor_variant(driver) -> str | None:
    """The descriptor variant that reproduces an exact product of small integers (every model agrees)."""
    rng = np.random.default_rng(5)
    fmt = "float8_e4m3fn"
    vals_a, vals_b = rng.integers(-3, 4, (gpu_wgmma.M, gpu_wgmma.K)), rng.integers(-3, 4, (gpu_wgmma.K, gpu_wgmma.N))
    A, B = encode(vals_a.astype(np.float32), fmt), encode(vals_b.astype(np.float32), fmt)
    C = rng.integers(-8, 9, (gpu_wgmma.M, gpu_wgmma.N)).astype(np.float32)
    want = (vals_a @ vals_b + C).astype(np.float32)
    for name, (lbo, sbo) in gpu_wgmma.DESCRIPTOR_VARIANTS.items():
        got = gpu_wgmma.run_wgmma(driver, fmt, fmt, A, B, C, gpu_wgmma.descriptor_fields(lbo, sbo))
        if np.array_equal(got, want):
            return name
    return None


def compare_f32(got: np.ndarray, want: np.ndarray) -> dict:
    """Bits compared; any NaN equals any NaN (reported apart); the first differing element."""
    g, w = got.astype(np.float32).view(np.uint32), want.astype(np.float32).view(np.uint32)
    both_nan = np.isnan(got) & np.isnan(want)
    differ = (g != w) & ~both_nan
    first = None
    if differ.any():
        idx = tuple(int(i) for i in np.argwhere(differ)[0])
        first = {"index": idx, "got": f"{got[idx]!r} (0x{int(g[idx]):08x})",
                 "want": f"{want[idx]!r} (0x{int(w[idx]):08x})"}
    return {"elements": int(g.size), "differ": int(differ.sum()),
            "nan_payloads_differ": int(((g != w) & both_nan).sum()),
            "first": first}


# -------------------------------------------------------------------------------------------------- casts

def boundary_inputs(fmt: str, dtype: str) -> np.ndarray:
    """Every code's value and every midpoint between neighbouring codes (and past the largest), both
    signs, with their 3 nearest neighbours each way in ``dtype``'s own bits; zeros, Infs and NaN."""
    import ml_dtypes

    f = get_format(fmt)
    vals = sorted({float(f.exact_value(c)) for c in range(f.n_codes)
                   if f.exact_value(c) is not None and f.exact_value(c) >= 0})
    mids = [(x + y) / 2 for x, y in zip(vals, vals[1:])]
    top = vals[-1] + (vals[-1] - vals[-2]) / 2  # the overflow threshold of round-to-nearest
    anchors = np.array(vals + mids + [top, 2 * vals[-1], vals[1] / 2, vals[1] / 4], np.float64)
    np_dtype = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}[dtype]
    uint = {"float32": np.uint32, "float16": np.uint16, "bfloat16": np.uint16}[dtype]
    with np.errstate(over="ignore"):  # anchors past float16's range become Inf, which is kept
        bits = anchors.astype(np.float32).astype(np_dtype).view(uint).astype(np.int64)
    near = (bits[:, None] + np.arange(-3, 4)[None, :]).reshape(-1)
    near = near[(near >= 0) & (near < (1 << (8 * np.dtype(uint).itemsize - 1)))]
    sign = 1 << (8 * np.dtype(uint).itemsize - 1)
    allbits = np.unique(np.concatenate([near, near | sign])).astype(uint)
    x = allbits.view(np_dtype)
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan], np.float32).astype(np_dtype)
    return np.concatenate([x, special])


def random_inputs(dtype: str, n: int, rng) -> np.ndarray:
    """n random float32 bit patterns; for the 16-bit types every pattern (n >= 2^16) or n random ones."""
    import ml_dtypes

    if dtype == "float32":
        return rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32).view(np.float32)
    np_dtype = np.float16 if dtype == "float16" else ml_dtypes.bfloat16
    bits = np.arange(2**16, dtype=np.uint16) if n >= 2**16 else rng.integers(0, 2**16, n).astype(np.uint16)
    return bits.view(np_dtype)


def part_casts(run: Run) -> dict:
    from fp8ref.conformance.adapters.torch_backend import TorchBackend, TorchCudaBackend

    backend = TorchCudaBackend() if run.gpu else TorchBackend()
    rng = np.random.default_rng(27)
    out = {}
    for fmt in FORMATS:
        for dtype in ("float32", "bfloat16", "float16"):
            x = np.concatenate([boundary_inputs(fmt, dtype), random_inputs(dtype, 1 << (12 if run.quick else 20), rng)])
            for saturate in (False, True):
                got = backend.encode(x, fmt, rounding="rne", saturate=saturate)
                want = encode(x, fmt, saturate=saturate)
                out[f"{fmt} from {dtype} saturate={saturate}"] = compare_codes(x, got, want, fmt)
    bad = [k for k, v in out.items() if v["differ"]]
    where = "ran on the GPU" if run.gpu else "skipped: no GPU (torch's CPU casts stood in, to exercise the run)"
    return {"status": f"{where}: {len(out) - len(bad)} of {len(out)} cast sets agree with fp8ref.encode"
                      + (f"; differ: {', '.join(bad)}" if bad else ""), "inputs_per_set": "boundaries + random",
            "sets": out}


def compare_codes(x, got, want, fmt: str) -> dict:
    f = get_format(fmt)
    nan = np.array(sorted(f.nan_codes), np.uint8)
    both_nan = np.isin(got, nan) & np.isin(want, nan)
    differ = (got != want) & ~both_nan
    first = [{"input": repr(x[i].item()), "got": f"0x{int(got[i]):02x}", "want": f"0x{int(want[i]):02x}"}
             for i in np.flatnonzero(differ)[:5]]
    return {"inputs": int(x.size), "differ": int(differ.sum()),
            "nan_codes_differ": int(((got != want) & both_nan).sum()),
            "first": first}


# ---------------------------------------------------------------------------------------------- ct_triton

CT_CASES = (("tensor", None, None), ("channel", None, None), ("group", 64, None), ("block", None, (32, 64)))


def ct_weights(torch, dtype, seed: int):
    """The interop test's weights (tests/interop/test_ct_gpu_recipe.py): zero rows, underflow, outliers."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(256, 512, generator=g) * torch.logspace(-3, 0, 256).unsqueeze(1)
    x[3] = 0.0
    x[5, :8] = torch.tensor([1e-7, -1e-7, 0.0, -0.0, 3.0e-6, -3.0e-6, 1.0, -1.0])
    x[7, 0] = 40.0
    return x.to(dtype)


def part_ct_triton(run: Run) -> dict:
    import torch

    from fp8ref.quant import QuantArgs, quantize

    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    if run.quick:
        dtypes = {"bf16": torch.bfloat16}
    out = {}
    for di, (dname, dtype) in enumerate(dtypes.items()):
        for ci, (strategy, group, block) in enumerate(CT_CASES):
            x = ct_weights(torch, dtype, 10 * di + ci)
            args = (QuantArgs(granularity="group", group_size=group) if strategy == "group" else
                    QuantArgs(granularity="block", block_shape=block) if strategy == "block" else
                    QuantArgs(granularity=strategy))
            gpu_recipe = quantize(x, args, recipe="compressed-tensors-gpu")
            cpu_recipe = quantize(x, args, recipe="compressed-tensors")
            a = gpu_recipe.codes.reshape(-1).view(torch.uint8)
            b = cpu_recipe.codes.reshape(-1).view(torch.uint8)
            entry = {"codes": a.numel(), "gpu_vs_cpu_recipe_differ": int((a != b).sum())}
            if run.gpu:
                codes, scale = _ct_triton_on_gpu(torch, x, strategy, group, block)
                entry["kernel_vs_gpu_recipe_differ"] = int((codes.reshape(-1).view(torch.uint8) != a).sum())
                entry["scales_equal"] = bool(torch.equal(scale.reshape(-1).float(),
                                                         gpu_recipe.scale.reshape(-1).float()))
            out[f"{dname} {strategy}"] = entry
    if not run.gpu:
        return {"status": "skipped: no GPU (fp8ref's two compressed-tensors recipes compared on CPU)", "cases": out}
    bad = [k for k, v in out.items() if v["kernel_vs_gpu_recipe_differ"] or not v["scales_equal"]]
    return {"status": f"ran on the GPU: {len(out) - len(bad)} of {len(out)} cases byte for byte"
                      + (f"; differ: {', '.join(bad)}" if bad else ""), "cases": out}


def _ct_triton_on_gpu(torch, x, strategy, group, block):
    """compressed-tensors' own quantize on CUDA (its Triton kernel: checked that it ran)."""
    os.environ.pop("CT_ENFORCE_EAGER", None)
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle import forward_helpers as fh
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    used = []
    for i, (fn, req, prio) in enumerate(fh.ImplBackend._backends["_quantize"]):
        def spy(*a, _fn=fn, **k):
            used.append(_fn.__name__)
            return _fn(*a, **k)
        fh.ImplBackend._backends["_quantize"][i] = (spy, req, prio)
    kw = ({"group_size": group} if strategy == "group" else
          {"block_structure": list(block)} if strategy == "block" else {})
    args = QuantizationArgs(num_bits=8, type="float", strategy=strategy, symmetric=True, **kw)
    xc = x.cuda()
    rows, cols = xc.shape
    if strategy == "tensor":
        red = xc.reshape(1, -1)
    elif strategy == "channel":
        red = xc
    elif strategy == "group":
        red = xc.reshape(rows, cols // group, group)
    else:
        r, k = block
        red = xc.reshape(rows // r, r, cols // k, k).transpose(1, 2).reshape(rows // r, cols // k, -1)
    lo, hi = red.amin(dim=-1), red.amax(dim=-1)
    if strategy == "channel":
        lo, hi = lo.unsqueeze(-1), hi.unsqueeze(-1)
    scale, zp = calculate_qparams(lo, hi, args)
    codes = quantize(xc, scale, zp, args, dtype=torch.float8_e4m3fn)
    if "_quantize_triton" not in used:
        raise RuntimeError(f"compressed-tensors ran {used or 'no registered'} quantize, not its Triton kernel")
    return codes.cpu(), scale.cpu()


def part_not_carried(run: Run) -> dict:
    return {"status": "listed", "limit_mib": 64,
            "packages": {k: {"checks": v[0], "wheel_mib": v[1] or "sdist only"} for k, v in NOT_CARRIED.items()}}


PARTS = {"scaled_mm": part_scaled_mm, "wgmma": part_wgmma, "casts": part_casts, "ct_triton": part_ct_triton,
         "not_carried": part_not_carried}


def markdown(report: dict) -> str:
    m = report["machine"]
    lines = ["# fp8ref gpu_check", "",
             f"{m.get('gpu', 'no GPU (dry run)')} {m.get('capability', '')}; torch {m['torch']} (CUDA {m['cuda']}); "
             f"CPU {m['cpu']}; fp8ref loops: {m['fp8ref_loops'].get('loops')} {m['fp8ref_loops'].get('isa') or ''}", "",
             "| part | status | seconds |", "|---|---|---|"]
    for name, p in report["parts"].items():
        lines.append(f"| {name} | {p['status']} | {p.get('seconds', '')} |")
    sm = report["parts"].get("scaled_mm", {}).get("backends", {})
    for name, b in sm.items():
        if "ranking_text" in b:
            lines += ["", f"## {name}", "", f"probe matches: {', '.join(b['probe']['matches']) or 'no preset model'}",
                      "", "```", *b["ranking_text"], "```"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu_check_out")))
    ap.add_argument("--budget", type=float, default=420.0, help="seconds; parts that would start later are skipped")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    ap.add_argument("--dry-run", action="store_true", help="touch no GPU even where one is present")
    ap.add_argument("--quick", action="store_true", help="small sizes (the test suite's run of the dry run)")
    args = ap.parse_args(argv)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    if unknown := [p for p in parts if p not in PARTS]:
        ap.error(f"unknown part(s): {', '.join(unknown)} (known: {', '.join(PARTS)})")
    run = Run(args.out, args.budget, args.dry_run, args.quick)
    print(f"gpu_check: {'GPU' if run.gpu else 'dry run (no GPU)'}; report in {args.out}", flush=True)
    for name in parts:
        run.part(name, PARTS[name])
    return 0


if __name__ == "__main__":
    sys.exit(main())
