"""fp8ref/_native.py: the C ABI check, the call-time kernel switch, and the threads the loops run on.

The bytes of every C loop must not depend on how the work is split: one thread, several, torch's
OpenMP team or fp8ref's fallback thread pool. The numpy paths (FP8REF_NO_KERNELS) give the same
bytes again (the fast-path tests compare them in depth; here the switch itself is tested).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

import fp8ref
from fp8ref import _native, decode, encode
from fp8ref.hardware import instruction, kernel_mm
from fp8ref.hardware.native import chained_matmul
from fp8ref.matmul import scaled_mm
from fp8ref.quant import QuantArgs, quantize

needs_c = pytest.mark.skipif(not _native.kernels_available(), reason="C loops not built or FP8REF_NO_KERNELS set")


def run_everything() -> list[np.ndarray]:
    """One call of each parallel C loop, inputs above the threading threshold."""
    rng = np.random.default_rng(3)
    x = (rng.standard_normal(1 << 21) * 300).astype(np.float32)
    w = torch.from_numpy(rng.standard_normal((1100, 1024)).astype(np.float32)).bfloat16()
    out = [encode(x, "float8_e4m3fn"), encode(x, "float8_e5m2", rounding="rtz"), encode(x, "float6_e3m2fn"),
           encode(w, "float8_e4m3fn").numpy()]
    out.append(decode(out[0], "float8_e4m3fn"))
    for gran, extra in (("channel", {}), ("tensor", {}), ("block", {"block_shape": (128, 128)})):
        for recipe in ("fp8ref", "compressed-tensors"):
            q = quantize(w, QuantArgs(granularity=gran, **extra), recipe=recipe)
            out += [q.codes.numpy(), q.scale.float().numpy()]
    a, b = out[0][:96 * 256].reshape(96, 256), out[0][-256 * 160:].reshape(256, 160)
    one = np.ones((1, 1), np.float32)
    out.append(scaled_mm(a, b, one, one, out_dtype="float32", accumulate="fp32"))
    # fp8ref.hardware's fused tensor-core loop (64 x 256 x 512 products: split into column panels)
    a, b = out[0][:64 * 512].reshape(64, 512), out[0][-512 * 256:].reshape(512, 256)
    out.append(kernel_mm(a, b, kernel="hopper-fast-accum"))
    return out


def same(xs, ys) -> bool:
    return all(np.asarray(x).tobytes() == np.asarray(y).tobytes() for x, y in zip(xs, ys, strict=True))


@needs_c
def test_bytes_do_not_depend_on_threads_or_runtime(monkeypatch):
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = run_everything()
        for n in (2, 3):
            torch.set_num_threads(n)
            assert same(run_everything(), single), f"{n} threads on {_native.openmp_runtime()}"
            with monkeypatch.context() as m:
                m.setattr(_native, "openmp_runtime", lambda: None)  # fp8ref's own thread pool
                assert same(run_everything(), single), f"{n} threads on the thread pool"
    finally:
        torch.set_num_threads(saved)
    with monkeypatch.context() as m:
        m.setenv("FP8REF_NO_KERNELS", "1")
        assert same(run_everything(), single), "the numpy paths"


def test_threads_follow_torch():
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert _native.threads() == 1
        torch.set_num_threads(3)
        assert _native.threads() == 3
    finally:
        torch.set_num_threads(saved)


@needs_c
def test_kernel_switch_is_read_at_call_time(monkeypatch):
    x = (np.random.default_rng(1).standard_normal(5000) * 100).astype(np.float32)
    fast = encode(x, "float8_e4m3fn")
    monkeypatch.setenv("FP8REF_NO_KERNELS", "1")
    assert not _native.kernels_available()
    slow = encode(x, "float8_e4m3fn")
    monkeypatch.delenv("FP8REF_NO_KERNELS")
    assert _native.kernels_available()
    assert fast.tobytes() == slow.tobytes()


def _reload_with(monkeypatch, struct) -> None:
    """_native as if its mirror of struct's C type were ``struct``, loaded afresh."""
    monkeypatch.setattr(_native, "_STRUCTS", tuple(struct if s.__name__ == struct.__name__ else s
                                                   for s in _native._STRUCTS))
    monkeypatch.setattr(_native, "_LIB", [])
    monkeypatch.setattr(_native, "_STATE", {})


@needs_c
def test_struct_size_mismatch_refuses_the_kernels(monkeypatch):
    """A ctypes mirror that disagrees with kernels.h must not be called: a warning, numpy paths."""
    _reload_with(monkeypatch, _native._struct("quant_job", _native.quant_job._fields_ + [("extra", ctypes.c_int64)]))
    with pytest.warns(RuntimeWarning, match=r"layout of quant_job \(sizeof: C \d+ bytes, ctypes \d+ bytes\)"):
        assert _native.kernels() is None
    assert _native.build_info() == {"loops": "numpy", "why": _native._STATE["why"]}
    x = np.linspace(-500, 500, 1001, dtype=np.float32)
    assert encode(x, "float8_e4m3fn").tobytes() == encode(x.astype(np.float64), "float8_e4m3fn").tobytes()


@needs_c
def test_reordered_field_of_the_same_size_refuses_the_kernels(monkeypatch):
    """Two int32 fields swapped keep the struct's size: only the field-by-field check (offsetof in
    C) sees it."""
    fields = list(_native.quant_job._fields_)
    i, k = [n for n, _ in fields].index("op"), [n for n, _ in fields].index("model")
    fields[i], fields[k] = fields[k], fields[i]
    swapped = _native._struct("quant_job", fields)
    assert ctypes.sizeof(swapped) == ctypes.sizeof(_native.quant_job)
    _reload_with(monkeypatch, swapped)
    want = r"layout of quant_job \(field \d+: C op at (\d+) \(4 bytes\), ctypes model at \1 \(4 bytes\)\)"
    with pytest.warns(RuntimeWarning, match=want):
        assert _native.kernels() is None


@needs_c
def test_a_renamed_field_refuses_the_kernels(monkeypatch):
    fields = [("stride" if n == "K" else n, t) for n, t in _native.amax_job._fields_]
    _reload_with(monkeypatch, _native._struct("amax_job", fields))
    want = r"layout of amax_job \(field 2: C K at 16 \(8 bytes\), ctypes stride at 16 \(8 bytes\)\)"
    with pytest.warns(RuntimeWarning, match=want):
        assert _native.kernels() is None


@needs_c
def test_hardware_loop_splits_by_batch_and_by_panel(monkeypatch):
    """fp8ref.hardware's fused loop above the threshold (by batches when there are enough, else by
    column blocks of every batch: the units are (batch, 128 columns)) gives the bytes of one call per
    slice below it."""
    ins = instruction("wgmma", "Hopper", "m64n8k32.f32.e4m3.e4m3")
    rng = np.random.default_rng(5)
    fin = np.array([c for c in range(256) if c & 0x7F != 0x7F], np.uint8)  # finite e4m3fn codes
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        for shape_a, shape_b in (((8, 64, 256), (8, 256, 40)), ((1, 64, 512), (1, 512, 200))):
            A, B = rng.choice(fin, shape_a), rng.choice(fin, shape_b)
            C = rng.standard_normal((shape_a[0], 64, shape_b[2])).astype(np.float32)
            want = np.stack([np.concatenate([chained_matmul(ins, A[i], B[i, :, j:j + 8], C[i, :, j:j + 8])
                                             for j in range(0, shape_b[2], 8)], axis=1) for i in range(shape_a[0])])
            assert chained_matmul(ins, A, B, C).tobytes() == want.tobytes(), f"{shape_a} on {_native.openmp_runtime()}"
            with monkeypatch.context() as m:
                m.setattr(_native, "openmp_runtime", lambda: None)
                assert chained_matmul(ins, A, B, C).tobytes() == want.tobytes(), f"{shape_a} on the thread pool"
    finally:
        torch.set_num_threads(saved)


@needs_c
def test_every_mirror_matches_the_header():
    assert _native._layout_errors(_native.kernels()) == []


def test_ci_shares_torchs_openmp_runtime():
    """CI (FP8REF_REQUIRE_KERNELS=1) must run the loops on torch's own OpenMP runtime, not fall back
    to a second thread pool that competes with torch's workers."""
    if os.environ.get("FP8REF_REQUIRE_KERNELS") != "1":
        pytest.skip("set FP8REF_REQUIRE_KERNELS=1 to require the compiled loops (CI does)")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        path = _native.openmp_runtime()
    assert path is not None and os.path.basename(path).startswith(("libgomp", "libiomp5", "libomp"))
    with open("/proc/self/maps") as f:
        runtimes = {line.split()[-1] for line in f if os.path.basename(line.split()[-1]).startswith("libgomp")}
    assert len(runtimes) <= 1, f"two OpenMP runtimes loaded: {runtimes}"


@needs_c
def test_without_torch_a_thread_pool_runs_the_loops(monkeypatch):
    """Before torch is imported (or without it) the loops run on fp8ref's own thread pool, with
    OMP_NUM_THREADS threads, and give the same bytes."""
    x = (np.random.default_rng(2).standard_normal(1 << 21) * 300).astype(np.float32)
    want = encode(x, "float8_e4m3fn")
    monkeypatch.delitem(sys.modules, "torch")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert _native.threads() == 3 and _native.openmp_runtime() is None
    assert encode(x, "float8_e4m3fn").tobytes() == want.tobytes()


@needs_c
def test_loops_start_no_threads_beside_torchs_team():
    """One team: once a torch op has started torch's OpenMP workers, a large encode, quantize and
    fp32 matmul run on them and start no thread of their own (a second pool would)."""
    if _native.openmp_runtime() is None:
        pytest.skip("torch's OpenMP runtime was not found (the thread pool runs the loops)")
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        torch.ones(1 << 22).mul_(2)  # torch's team is up
        before = set(os.listdir("/proc/self/task"))
        run_everything()
        after = set(os.listdir("/proc/self/task"))
    finally:
        torch.set_num_threads(saved)
    assert after <= before, f"{len(after - before)} new threads"


def _digest_of_everything() -> str:
    return hashlib.sha256(b"".join(np.ascontiguousarray(x).tobytes() for x in run_everything())).hexdigest()


@needs_c
def test_every_isa_level_gives_the_same_bytes():
    """Each level of the per-ISA loops (codec.c, quant.c, hw.c compiled with its -march), forced by
    FP8REF_ISA in a fresh process, writes the bytes of the level chosen here."""
    info = _native.build_info()
    others = [lv for lv in info["levels"] if lv != info["isa"] and (lv == "generic") == (info["cpu_level"] == 0)
              and {"x86-64-v4": 4, "x86-64-v3": 3}.get(lv, 1) <= info["cpu_level"]]
    if not others:
        pytest.skip(f"one level runs here ({info['isa']})")
    want = _digest_of_everything()
    code = ("import json, sys; sys.path.insert(0, 'tests/unit/quant'); import fp8ref, test_native; "
            "print(json.dumps([fp8ref.build_info()['isa'], test_native._digest_of_everything()]))")
    for level in others:
        env = {**os.environ, "FP8REF_ISA": level}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                             cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__)))))
        isa, digest = json.loads(out.stdout.splitlines()[-1])
        assert isa == level, out.stderr
        assert digest == want, f"{level} differs from {info['isa']}"


@needs_c
def test_an_unknown_isa_level_warns_and_runs_the_best(monkeypatch):
    best = _native.runnable_levels()[0]  # not build_info()'s: a forced FP8REF_ISA may have bound another
    monkeypatch.setenv("FP8REF_ISA", "x86-64-v9")
    monkeypatch.setattr(_native, "_LIB", [])
    monkeypatch.setattr(_native, "_STATE", {})
    with pytest.warns(RuntimeWarning, match=r"FP8REF_ISA=x86-64-v9 is not one of the levels built that this CPU runs"):
        assert _native.kernels() is not None
    assert _native.build_info()["isa"] == best and not _native.build_info()["forced"]


def test_without_the_library_the_numpy_paths_run_and_say_why(monkeypatch):
    """An install whose C build failed: a warning at first use, build_info() names the numpy paths."""
    monkeypatch.setitem(sys.modules, "fp8ref._kernels", None)  # import fp8ref._kernels raises ImportError
    monkeypatch.delattr(fp8ref, "_kernels", raising=False)
    monkeypatch.setattr(_native, "_LIB", [])
    monkeypatch.setattr(_native, "_STATE", {})
    monkeypatch.delenv("FP8REF_NO_KERNELS", raising=False)
    with pytest.warns(RuntimeWarning, match=r"the C loops are not built, so fp8ref runs its numpy paths"):
        assert _native.kernels() is None
    info = _native.build_info()
    assert info["loops"] == "numpy" and "fp8ref._kernels is not built" in info["why"]
    x = np.linspace(-500, 500, 1001, dtype=np.float32)
    assert encode(x, "float8_e4m3fn").tobytes() == encode(x.astype(np.float64), "float8_e4m3fn").tobytes()


@needs_c
def test_use_level_rebinds_the_loops_and_refuses_a_level_the_cpu_does_not_run():
    """_native.use_level (benchmarks/bench_isa.py) binds each level this CPU runs in turn, as
    FP8REF_ISA does at load, and gives the same bytes at each."""
    bound = _native.build_info()["isa"]
    levels = _native.runnable_levels()
    assert bound in levels
    want = _digest_of_everything()
    try:
        for level in levels:
            _native.use_level(level)
            assert _native.build_info()["isa"] == level
            assert _digest_of_everything() == want, f"{level} differs from {bound}"
        with pytest.raises(ValueError, match="x86-64-v9"):
            _native.use_level("x86-64-v9")
    finally:
        _native.use_level(bound)


@needs_c
@pytest.mark.parametrize("qa", [QuantArgs(granularity="channel"), QuantArgs(granularity="tensor"),
                                QuantArgs(granularity="block", block_shape=(128, 128))], ids=str)
def test_replayed_quantize_tasks_write_the_call_s_codes(qa):
    """benchmarks/_util.quantize_tasks (bench_isa.py's CPU-time table, tools/ab_kernels.py --replay):
    the captured C tasks, run again into a cleared buffer, write the codes the quantize call wrote."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "benchmarks"))
    try:
        from _util import quantize_tasks
    finally:
        sys.path.pop(0)
    w = (torch.randn(256, 1024, generator=torch.Generator().manual_seed(3)) * 0.02).bfloat16()
    want = quantize(w, qa).codes
    out = torch.zeros(w.shape, dtype=torch.uint8)
    again = quantize_tasks(w, qa, out)
    assert torch.equal(out, want.view(torch.uint8))
    out.zero_()
    again()
    assert torch.equal(out, want.view(torch.uint8))
