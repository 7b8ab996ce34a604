"""The optional C loops (fp8ref/_csrc/*.c): their ABI (ctypes mirrors of fp8ref/_csrc/kernels.h,
checked field by field at load), the instruction-set level they run at, the kernel switch, and the
threads they run on.

``FP8REF_NO_KERNELS=1`` (read at every call) switches them off: the numpy paths then run.
``FP8REF_ISA=x86-64-v3`` (read at load) forces the per-ISA loops of one level the CPU runs
(docs/build.md). :func:`build_info` says which loops run and why.

Threads: every parallel loop is a C task ``f(args, lo, hi)``. Once torch is imported, the tasks run
on the OpenMP runtime torch loaded (its ``GOMP_parallel``: threadpoolctl finds the runtime among the
process's loaded libraries, on Linux, macOS and Windows alike, and it is handed to the C side): one team
of workers serves torch's ops and fp8ref's loops, so neither spins against the other. Without torch
(or threadpoolctl, or with a runtime that has no GOMP entry points) a thread pool runs the tasks
(ctypes releases the GIL). The number of threads follows ``torch.get_num_threads()``, else
``OMP_NUM_THREADS``, else the cores. Units are independent: the bytes never depend on it.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import sys
import warnings
from concurrent.futures import ThreadPoolExecutor

_PARALLEL_MIN = 1 << 20  # elements below which one C call beats the thread hand-off
_vp, _sz, _i32, _i64, _u32, _f32 = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int32, ctypes.c_int64,
                                    ctypes.c_uint32, ctypes.c_float)


# --- the ABI: one ctypes mirror per struct of fp8ref/_csrc/kernels.h (sizes checked in _load) ---------------
def _struct(name: str, fields: list[tuple[str, type]]) -> type:
    return type(name, (ctypes.Structure,), {"_fields_": fields, "__doc__": f"The layout of {name} in _csrc/kernels.h."})


enc_params = _struct("enc_params", [(n, _i32) for n in ("M", "emin", "bias", "mode")] + [
    (n, _u32) for n in ("maxmag", "signbit", "nan_pos", "nan_neg", "inf_pos", "inf_neg", "ovf_pos", "ovf_neg",
                        "zero_neg")])
rne_params = _struct("rne_params", [(n, _u32) for n in (
    "S", "H", "B", "emin_bits", "magic_bits", "maxmag", "signbit", "nan_pos", "nan_neg", "inf_pos", "inf_neg",
    "ovf_pos", "ovf_neg", "zero_neg")])
ew_job = _struct("ew_job", [("src", _vp), ("dst", _vp), ("arg", _vp)])
amax_job = _struct("amax_job", [("src", _vp), ("out", _vp), ("K", _i64), ("g", _i64)])
quant_job = _struct("quant_job", [(n, _vp) for n in ("src", "dst", "s", "s_off", "table", "amax", "p", "rne")]
                    + [(n, _i64) for n in ("K", "g", "r2", "bh")]
                    + [(n, _i32) for n in ("kind", "exact", "op", "model", "cast16")]
                    + [("addend", _f32), ("clampv", _f32), ("neg0", _u32), ("stream", _i32), ("tab_slots", _u32),
                       ("bound", _u32), ("stored", _vp), ("final", _vp), ("scale", _vp), ("not_final", _i64)])
mm_job = _struct("mm_job", [(n, _vp) for n in ("A", "B", "tab_a", "tab_b", "sa", "sb", "total", "part", "scratch")]
                 + [(n, _sz) for n in ("M", "K", "N", "L", "bk", "KB", "step", "scratch_stride", "fused")])
hw_job = _struct("hw_job", [(n, _vp) for n in ("A", "B", "SA", "SB", "va", "vb", "xa", "xb", "xs", "ss", "ia", "ib",
                                                "fa", "fb", "fs", "psa", "psb", "D", "acc")]
                 + [(n, _sz) for n in ("M", "N", "K", "L", "chunks", "promote", "np", "G", "block")]
                 + [(n, _i64) for n in ("F", "out_bits", "e_zero", "zero_in", "fma", "unit", "smb", "f16", "bad")])
dec_job = _struct("dec_job", [(n, _vp) for n in ("src", "dst", "lut", "flags", "scale", "norm2")]
                  + [(n, _i64) for n in ("src_rs", "src_cs", "dst_rs", "rows", "cols", "unit", "s_rs", "s_rb", "s_cb",
                                         "n_rs", "n_rb", "n_cb", "stream")])
epi_job = _struct("epi_job", [(n, _vp) for n in ("t", "out", "unsure", "sa", "sb", "bias", "norm")]
                  + [("slack", ctypes.c_double), ("max", ctypes.c_double)]
                  + [(n, _i64) for n in ("M", "N", "ldt", "sa_s", "sb_s", "mode", "precision", "emin", "parts",
                                         "part_stride")])
bsum_job = _struct("bsum_job", [(n, _vp) for n in ("a", "aT", "b", "va", "vb", "mi", "ni", "sums")]
                   + [(n, _i64) for n in ("M", "K", "E", "bk", "b_rs", "b_cs")])
dot_job = _struct("dot_job", [(n, _vp) for n in ("a", "w", "lut", "t", "flags")]
                  + [(n, _i64) for n in ("M", "K", "N", "w_rs", "sym", "bk")])
_STRUCTS = (enc_params, rne_params, ew_job, amax_job, quant_job, mm_job, hw_job, dec_job, epi_job, bsum_job,
            dot_job)

_ISA_TASKS = ("fp8ref_encode_f32", "fp8ref_encode_f32_rne", "fp8ref_gather_u16", "fp8ref_gather_f32_rto16",
              "fp8ref_decode_f32", "fp8ref_quant", "fp8ref_quant_fused", "fp8ref_amax_u16", "fp8ref_amax_u32",
              "fp8ref_hw_fused", "fp8ref_hw_pairwise", "fp8ref_hw_grouped")  # one per level (kernels.h)
_TASKS = _ISA_TASKS + ("fp8ref_mm_seq_f32", "fp8ref_decode_f64", "fp8ref_exact_epilogue", "fp8ref_block_sums",
                       "fp8ref_lut_dot")
_SIGNATURES = {**{name: [_vp, _sz, _sz] for name in _TASKS if name not in _ISA_TASKS},
               "fp8ref_parallel": [_vp, _vp, _sz, _sz, _sz], "fp8ref_bind_openmp": [_vp, _vp, _vp]}
# the per-ISA levels setup.py builds, best first: (name, symbol suffix, x86-64 level the CPU must run)
_LEVELS = (("x86-64-v4", "x86_64_v4", 4), ("x86-64-v3", "x86_64_v3", 3), ("x86-64", "x86_64", 1),
           ("generic", "generic", 0))


class _Field(ctypes.Structure):
    _fields_ = [("type", ctypes.c_char_p), ("field", ctypes.c_char_p), ("offset", _sz), ("size", _sz)]


def _layout_errors(lib) -> list[str]:
    """Where the ctypes mirrors disagree with the C structs: fp8ref_layout() (offsetof, sizeof) compared
    field by field, by name, offset and size, and each struct's sizeof."""
    lib.fp8ref_layout.argtypes, lib.fp8ref_layout.restype = [ctypes.POINTER(_sz)], ctypes.POINTER(_Field)
    n = _sz()
    table = lib.fp8ref_layout(ctypes.byref(n))
    c_side: dict[str, list[tuple[str, int, int]]] = {}
    for i in range(n.value):
        f = table[i]
        c_side.setdefault(f.type.decode(), []).append((f.field.decode(), f.offset, f.size))
    def say(f):
        return "none" if f is None else f"{f[2]} bytes" if not f[0] else f"{f[0]} at {f[1]} ({f[2]} bytes)"

    wrong = []
    for s in _STRUCTS:
        mine = [("", 0, ctypes.sizeof(s))] + [(name, getattr(s, name).offset, getattr(s, name).size)
                                              for name, _ in s._fields_]
        theirs = c_side.get(s.__name__, [])
        first = next((i for i, (m, t) in enumerate(itertools.zip_longest(mine, theirs)) if m != t), None)
        if first is not None:
            m, t = (x[first] if first < len(x) else None for x in (mine, theirs))
            what = "sizeof" if first == 0 else f"field {first - 1}"
            wrong.append(f"{s.__name__} ({what}: C {say(t)}, ctypes {say(m)})")
    return wrong


def _refuse(path: str, why: str) -> None:
    _STATE["why"] = f"{path} {why}"
    warnings.warn(f"fp8ref: {path} {why}; rebuild it with `pip install -e .`. Using the numpy paths.",
                  RuntimeWarning, stacklevel=5)  # the caller of kernels()


def _bind_level(lib, path: str, forced: str | None = None) -> str | None:
    """Binds each per-ISA task name to the best level built that the CPU runs (``forced``, default
    FP8REF_ISA: that one). Returns the level's name, or None after a warning (no level fits)."""
    cpu = lib.fp8ref_cpu_level()
    built = [lv for lv in _LEVELS if all(hasattr(lib, f"{t}_{lv[1]}") for t in _ISA_TASKS)]
    runnable = [lv for lv in built if (lv[2] == 0) == (cpu == 0) and lv[2] <= cpu]
    forced = (os.environ.get("FP8REF_ISA", "") if forced is None else forced).strip()
    if forced:
        pick = [lv for lv in runnable if lv[0] == forced]
        if not pick:
            warnings.warn(f"fp8ref: FP8REF_ISA={forced} is not one of the levels built that this CPU runs "
                          f"({', '.join(lv[0] for lv in runnable) or 'none'}); using the best of them",
                          RuntimeWarning, stacklevel=5)
        runnable = pick or runnable
    if not runnable:
        _refuse(path, f"holds loops for {', '.join(lv[0] for lv in built) or 'no level'}, none of which this CPU "
                      f"runs (x86-64 level {cpu})")
        return None
    name, suffix, _ = runnable[0]
    for task in _ISA_TASKS:
        fn = getattr(lib, f"{task}_{suffix}")
        fn.argtypes, fn.restype = [_vp, _sz, _sz], None
        setattr(lib, task, fn)  # getattr(lib, task) now returns this level's loop
    _STATE.update(level=name, levels=[lv[0] for lv in built], cpu_level=cpu, forced=bool(forced and pick))
    return name


def _load():
    try:
        from . import _kernels
    except ImportError as exc:
        _STATE["why"] = (f"fp8ref._kernels is not built ({exc}): the install did not compile the C loops "
                         "(reinstall with `pip install -v` to see why), or this is a source tree that was never built")
        warnings.warn(f"fp8ref: the C loops are not built, so fp8ref runs its numpy paths (17-33x slower to encode "
                      f"and quantize); fp8ref --version says why ({_STATE['why']})", RuntimeWarning, stacklevel=4)
        return None
    lacking = [name for name in ("hw_call",) if not hasattr(_kernels, name)]
    lib = _open(_kernels.__file__, lacking=lacking)
    if lib is not None:
        _STATE["path"] = _kernels.__file__
    return lib


def _open(path: str, level: str | None = None, lacking: list[str] = ()):
    """The C library at ``path``, its signatures set and checked against this module's mirror of the
    header, its per-ISA tasks bound to ``level`` (default: FP8REF_ISA, else the best this CPU runs); or
    None after a warning. ``lacking``: names the caller found missing elsewhere (the module's)."""
    lib = ctypes.CDLL(path)
    missing = [name for name in (*_SIGNATURES, "fp8ref_layout", "fp8ref_cpu_level") if not hasattr(lib, name)]
    if missing or lacking:  # a build older than this source tree: run the numpy paths rather than crash
        return _refuse(path, f"lacks {', '.join([*missing, *lacking])}")
    for name, argtypes in _SIGNATURES.items():
        getattr(lib, name).argtypes = argtypes
        getattr(lib, name).restype = None
    lib.fp8ref_cpu_level.argtypes, lib.fp8ref_cpu_level.restype = [], ctypes.c_int
    wrong = _layout_errors(lib)
    if wrong:  # the header and its mirror above disagree: calling would corrupt memory
        return _refuse(path, f"disagrees with fp8ref/_native.py on the layout of {', '.join(wrong)}")
    if _bind_level(lib, path, level) is None:
        return None
    return lib


_LIB: list = []  # [library or None], loaded on first use
_STATE: dict = {}  # what _load found: the library's path and level, or why there is none


def kernels():
    """The compiled C loops, or None: not built, refused at load, or ``FP8REF_NO_KERNELS`` set now."""
    if os.environ.get("FP8REF_NO_KERNELS"):
        return None
    if not _LIB:
        _LIB.append(_load())
    return _LIB[0]


def runnable_levels() -> list[str]:
    """The per-ISA levels built that this CPU runs, best first ([] without the C loops)."""
    lib = kernels()
    if lib is None:
        return []
    cpu = lib.fp8ref_cpu_level()
    return [lv[0] for lv in _LEVELS if lv[0] in _STATE["levels"] and (lv[2] == 0) == (cpu == 0) and lv[2] <= cpu]


def use_level(name: str) -> None:
    """Binds the per-ISA loops to level ``name`` (one of runnable_levels()) in this process, as
    FP8REF_ISA does at load: for benchmarks that compare the levels in one run (benchmarks/bench_isa.py)."""
    if name not in runnable_levels():
        raise ValueError(f"level {name!r} is not one of the levels built that this CPU runs: "
                         f"{', '.join(runnable_levels()) or 'none'}")
    _bind_level(kernels(), _STATE["path"], name)


def build_info() -> dict:
    """Which loops run and why: ``loops`` is ``"C"`` or ``"numpy"``; with C, ``isa`` the level of the
    per-ISA loops (``levels``: the levels built, ``cpu_level``: the x86-64 level of this CPU, 0 off
    x86-64; ``forced``: chosen by ``FP8REF_ISA``), ``library`` its path and ``openmp`` the runtime it
    shares with torch (None: its own thread pool); with numpy, ``why``."""
    if os.environ.get("FP8REF_NO_KERNELS"):
        return {"loops": "numpy", "why": "FP8REF_NO_KERNELS is set"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the answer says it; no warning on top
        lib = kernels()
    if lib is None:
        return {"loops": "numpy", "why": _STATE.get("why", "unknown")}
    return {"loops": "C", "isa": _STATE["level"], "levels": _STATE["levels"], "cpu_level": _STATE["cpu_level"],
            "forced": _STATE["forced"], "library": _STATE["path"], "openmp": openmp_runtime()}


def describe() -> str:
    """build_info() in one line (fp8ref --version)."""
    info = build_info()
    if info["loops"] == "numpy":
        return f"loops: numpy ({info['why']})"
    forced = ", forced by FP8REF_ISA" if info["forced"] else ""
    threads = f"torch's OpenMP ({os.path.basename(info['openmp'])})" if info["openmp"] else "fp8ref's thread pool"
    return (f"loops: C, {info['isa']}{forced} (built: {', '.join(info['levels'])}; "
            f"{'no torch imported: ' if 'torch' not in sys.modules else ''}threads: {threads})")


def hw_call():
    """_kernels.hw_call (a Python function: see fp8ref/_csrc/module.c), or None without the C loops."""
    if kernels() is None:
        return None
    from . import _kernels
    return _kernels.hw_call


def kernels_available() -> bool:
    """True when the compiled C loops are in use (else the numpy paths run)."""
    return kernels() is not None


# --- threads -------------------------------------------------------------------------------------------
def threads() -> int:
    """How many threads a parallel loop uses: torch's intra-op count once torch is imported, else
    OMP_NUM_THREADS, else the cores."""
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "get_num_threads"):
        return max(1, torch.get_num_threads())
    env = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    return int(env) if env.isdigit() and int(env) > 0 else os.cpu_count() or 1


_OPENMP: dict = {}  # "path": the runtime bound to the C loops (None: none usable), once torch is imported


def _find_openmp(torch) -> str | None:
    """The path of the OpenMP runtime torch's ATen runs on, among the libraries loaded into this process
    (threadpoolctl: Linux, macOS, Windows), or None: no OpenMP backend, no threadpoolctl, or not one
    runtime (two OpenMP runtimes loaded: the one in torch's own folder, if any, is torch's)."""
    try:
        if "ATen parallel backend: OpenMP" not in torch.__config__.parallel_info():
            return None
        from threadpoolctl import threadpool_info
    except (ImportError, AttributeError, RuntimeError):
        return None
    found = sorted({i["filepath"] for i in threadpool_info() if i.get("user_api") == "openmp"})
    home = os.path.realpath(os.path.dirname(torch.__file__)) + os.sep
    own = [p for p in found if os.path.realpath(p).startswith(home)]
    return (own or found)[0] if len(own) == 1 or len(found) == 1 else None


_OMP_NAMES = ("GOMP_parallel", "omp_get_thread_num", "omp_get_num_threads")


def bind_openmp(lib, omp) -> None:
    """Points the C library's parallel loop at the OpenMP runtime ``omp`` (a loaded ctypes.CDLL)."""
    lib.fp8ref_bind_openmp(*(ctypes.cast(getattr(omp, name), _vp) for name in _OMP_NAMES))


def openmp_runtime() -> str | None:
    """The path of the OpenMP runtime fp8ref's loops share with torch, or None (thread pool)."""
    lib = kernels()
    torch = sys.modules.get("torch")
    if lib is None or torch is None:
        return None
    if "path" not in _OPENMP:
        path = _find_openmp(torch)
        if path is not None:
            omp = ctypes.CDLL(path)  # already loaded by torch: the same instance, not a second runtime
            if all(hasattr(omp, name) for name in _OMP_NAMES):  # LLVM's libomp exports them too; vcomp does not
                _OPENMP["handle"] = omp
                bind_openmp(lib, omp)
            else:
                path = None
        _OPENMP["path"] = path
    return _OPENMP["path"]


_POOL: list = []


def _pool() -> ThreadPoolExecutor:
    if not _POOL:
        _POOL.append(ThreadPoolExecutor(max_workers=os.cpu_count() or 1, thread_name_prefix="fp8ref"))
    return _POOL[0]


def parallel(task: str, job: ctypes.Structure, n: int, *, work: int | None = None, split: int | None = None,
             keep=None, min_work: int | None = None) -> None:
    """Run the C task ``task(job, lo, hi)`` over units [0, n), in ``split`` pieces (default: one per
    thread) once ``work`` (default n) reaches ``min_work`` (default _PARALLEL_MIN, read at the call);
    below it on the calling thread. ``keep``: arrays the job points into."""
    lib = kernels()
    w = threads() if (n if work is None else work) >= (_PARALLEL_MIN if min_work is None else min_work) else 1
    pieces = max(1, min(n, split or w))
    fn = getattr(lib, task)
    if w > 1 and pieces > 1 and openmp_runtime() is not None:
        lib.fp8ref_parallel(ctypes.cast(fn, _vp), ctypes.byref(job), n, pieces, w)
    elif w > 1 and pieces > 1:
        bounds = [n * i // pieces for i in range(pieces + 1)]
        for f in [_pool().submit(fn, ctypes.byref(job), lo, hi) for lo, hi in zip(bounds, bounds[1:]) if hi > lo]:
            f.result()
    elif n:
        fn(ctypes.byref(job), 0, n)


def run_c(task: str, src, dst, arg) -> None:
    """An elementwise C loop over flat contiguous arrays: dst[i] = f(src[i]); ``arg`` is a ctypes
    Structure (parameters) or a numpy array (table)."""
    arg_ptr = ctypes.addressof(arg) if isinstance(arg, ctypes.Structure) else arg.ctypes.data
    parallel(task, ew_job(src.ctypes.data, dst.ctypes.data, arg_ptr), src.size, keep=(src, dst, arg))


_MM_KC, _MM_NR = 256, 32  # k chunk and widest register panel of _csrc/matmul.c


def seq_acc_f32(A, B, tab_a, tab_b, sa, sb, block: int, bk: int, fused: bool = False):
    """The declared-order fp32 model of fp8ref.matmul (see _csrc/matmul.c): A (M, K) and B (K, N)
    are float32 values, or uint8 codes when their value table ``tab_*`` (256 float32) is given;
    sa (M, KB) / sb (KB, N) float32 epilogue scales, or both None (blocks added unscaled); ``block``
    is the accumulation block length, ``bk`` the scale block length. ``fused``: the caller has
    proved every product exact in fp32, so a fused multiply-add gives the same bits. Column panels
    are split across threads; each output still adds in k order."""
    import numpy as np

    M, K = A.shape
    N = B.shape[1]
    total = np.empty((M, N), np.float32)
    part = np.empty((M, N), np.float32)
    KB = 1 if sa is None else sa.shape[1]
    w = threads() if M * N * max(K, 1) >= _PARALLEL_MIN else 1
    step = max(_MM_NR, -(-N // (w * _MM_NR)) * _MM_NR)  # whole register panels per cut
    cuts = max(1, -(-N // step))
    # per cut: packed A block (256 rows), packed B chunk (whole register panels), alignment slack
    stride = 256 * _MM_KC + _MM_KC * step + 16
    scratch = np.empty(cuts * stride, np.float32)
    keep = [A, B, tab_a, tab_b, sa, sb]

    def ptr(x):
        return None if x is None else x.ctypes.data

    job = mm_job(*map(ptr, keep), total.ctypes.data, part.ctypes.data, scratch.ctypes.data,
                 M, K, N, block, bk, KB, step, stride, int(fused))
    parallel("fp8ref_mm_seq_f32", job, cuts, work=M * N * max(K, 1), keep=(keep, total, part, scratch))
    return total
