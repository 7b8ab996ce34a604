"""Builds fp8ref's optional C loops (fp8ref/_csrc) into fp8ref._kernels; docs/build.md explains the design.

The hot files (PER_ISA) are compiled once per instruction-set level (x86-64-v4, -v3 and plain x86-64 on
x86-64; once, generic, elsewhere) and fp8ref/_native.py binds the best level the CPU runs; the other
files are compiled once. The compiles run in parallel (FP8REF_BUILD_JOBS, default: the cores), print
their progress, and are cached by content in build/fp8ref-objects/, so a second `pip install -e`
(pip rebuilds an editable project every time) only links. A failed compile is one loud warning and an
install without the C loops (fp8ref then runs its numpy paths and says so at first use); a level the
compiler cannot target is dropped alone.
"""

from __future__ import annotations

import hashlib
import os
import platform
import re
import sys
import sysconfig
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from setuptools import Extension, find_namespace_packages, setup
from setuptools.command.build_ext import build_ext

CSRC = os.path.join("fp8ref", "_csrc")
HEADERS = ["kernels.h"]
PER_ISA = ["quant.c", "hw.c", "codec.c"]  # longest first: the parallel compiles finish together
ONCE = ["exact.c", "matmul.c", "hw_avx512.c", "module.c"]
# -O2 with the vectorizer's `cheap` cost model, -g0: -O3 made quant.c 7x slower to compile (its loop
# versioning and unswitching copy each loop of the 60 inlined arms of fp8ref_quant again: a 5.4x larger
# object) for no speed. -O2's own `very-cheap` model leaves loops of unknown trip count scalar (the exact
# quotient and hw.c's wide fused loop 3-4x slower); `dynamic` (-O3's) versions them for alias and
# alignment at 10x the compile; docs/build.md has the figures. -ffp-contract=off: no fused multiply-add
# the model did not ask for.
CFLAGS = ["-O2", "-fvect-cost-model=cheap", "-g0", "-std=gnu11", "-ffp-contract=off", "-Wno-psabi"]
X86_LEVELS = [("x86_64_v4", ["-march=x86-64-v4"]), ("x86_64_v3", ["-march=x86-64-v3"]), ("x86_64", [])]
GENERIC = [("generic", [])]


def isa_levels() -> list[tuple[str, list[str]]]:
    """The levels to build: x86-64's three where the target is x86-64 alone (a macOS universal2 build
    names two -arch in ARCHFLAGS: generic then), else one generic build."""
    target = os.environ.get("_PYTHON_HOST_PLATFORM") or sysconfig.get_platform()
    archflags = os.environ.get("ARCHFLAGS", "").split()
    x86 = target.endswith(("x86_64", "amd64")) or (target == sysconfig.get_platform()
                                                   and platform.machine().lower() in ("x86_64", "amd64"))
    if not x86 or sys.platform == "win32" or archflags.count("-arch") > 1:
        return GENERIC
    return X86_LEVELS


def warn(message: str) -> None:
    bar = "=" * 100
    print(f"\n{bar}\nWARNING: {message}\n{bar}\n", file=sys.stderr, flush=True)


class ParallelBuildExt(build_ext):
    """Compiles every (file, level) unit in parallel with a content-keyed object cache, then links."""

    def build_extension(self, ext: Extension) -> None:
        started = time.perf_counter()
        units = [(src, level, flags) for src in PER_ISA for level, flags in isa_levels()]
        units += [(src, None, []) for src in ONCE]
        jobs = int(os.environ.get("FP8REF_BUILD_JOBS") or os.cpu_count() or 1)
        print(f"fp8ref: compiling the C loops: {len(units)} objects, {jobs} at a time", flush=True)
        done, lock = [0], threading.Lock()

        def say(line: str) -> None:
            with lock:  # one whole line at a time from the compiling threads
                sys.stdout.write(line + "\n")
                sys.stdout.flush()

        def compile_unit(unit):
            src, level, flags = unit
            try:
                obj, cached, seconds = self._compile_one(ext, src, level, flags)
            except Exception as exc:  # noqa: BLE001 - a compiler failure of any kind drops the unit
                status = re.search(r"exit (?:status|code) -?\d+", str(exc))  # the command itself is printed above
                say(f"fp8ref: {src} ({level or 'any CPU'}) failed: {status.group(0) if status else exc}")
                return unit, None
            with lock:
                done[0] += 1
                count = done[0]
            how = "cached" if cached else f"{seconds:.1f} s"
            say(f"fp8ref: [{count}/{len(units)}] {src} ({level or 'any CPU'}) {how}")
            return unit, obj

        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            results = list(pool.map(compile_unit, units))
        failed = [(src, level) for (src, level, _), obj in results if obj is None]
        dropped = {level for src, level in failed if level is not None}
        if any(level is None for _, level in failed) or dropped >= {level for _, level, _ in units if level}:
            src = next(s for s, lv in failed if lv is None or lv in dropped)
            raise RuntimeError(f"{src} did not compile (its errors are above)")
        for level in sorted(dropped):
            warn(f"fp8ref: the {level} loops did not compile (errors above); the other levels are built")
        objects = [obj for (src, level, _), obj in results if obj is not None and level not in dropped]
        # nothing left to compile: distutils links the objects. Always: a cached object (say, of a source
        # edited and then reverted) can be older than the library it must replace, so mtimes cannot decide.
        ext.depends, ext.sources, ext.extra_objects = ext.sources + ext.depends, [], objects
        force = self.force, self.compiler.force
        self.force = self.compiler.force = True
        try:
            super().build_extension(ext)
        finally:
            self.force, self.compiler.force = force
        print(f"fp8ref: C loops built in {time.perf_counter() - started:.1f} s", flush=True)

    def _compile_one(self, ext: Extension, src: str, level: str | None, flags: list[str]):
        """(object path, reused from the cache, seconds): the object of src for level, cached under
        build/fp8ref-objects/ by a hash of the compiler command, flags and every input byte."""
        macros = [("FP8REF_ISA", level)] if level else []
        args = CFLAGS + flags
        path = os.path.join(CSRC, src)
        command = getattr(self.compiler, "compiler_so", None)
        key = hashlib.sha256(repr((command, args, macros, sysconfig.get_paths()["include"], sys.version)).encode())
        for name in [src] + HEADERS:
            with open(os.path.join(CSRC, name), "rb") as f:
                key.update(f.read())
        out_dir = os.path.join("build", "fp8ref-objects", key.hexdigest()[:24])
        obj = os.path.join(out_dir, CSRC, src[:-2] + self.compiler.obj_extension)
        if os.path.exists(obj):
            return obj, True, 0.0
        t0 = time.perf_counter()
        tmp_dir = out_dir + f".tmp{os.getpid()}-{level}-{src}"
        (built,) = self.compiler.compile([path], output_dir=tmp_dir, macros=macros, extra_postargs=args,
                                         depends=[os.path.join(CSRC, h) for h in HEADERS])
        os.makedirs(os.path.dirname(obj), exist_ok=True)
        os.replace(built, obj)  # atomic: a cancelled build never leaves half an object in the cache
        return obj, False, time.perf_counter() - t0

    def run(self):
        try:
            super().run()
        except Exception as exc:  # noqa: BLE001 - any compiler failure means "no C loops", loudly
            warn(f"fp8ref's C loops were not built ({exc}).\nfp8ref will run its numpy paths (correct, "
                 "17-33x slower to encode and quantize) and warns at first use; fp8ref --version says "
                 "which loops run.\nFix the compiler (a C11 compiler: gcc or clang) and reinstall with "
                 "`pip install -v` to see its messages.")


# specs/ (presets, recipes, suites, engines' steps, examples) stays at the repository's top, where its readers
# look for it, and installs as the package data fp8ref/specs: package_dir maps the one onto the other
# (fp8ref/registry.py finds it with importlib.resources). The packages are listed here, not in
# pyproject.toml, because that mapping needs them spelt out: pyproject's `find` sees only folders.
SPECS = ["fp8ref.specs"] + [f"fp8ref.specs.{name}" for name in find_namespace_packages(where="specs")]
PACKAGE_DATA = {"fp8ref": ["_csrc/*.c", "_csrc/*.h", "conformance/xfails/*.txt"], **{p: ["*.yaml"] for p in SPECS}}

setup(
    packages=find_namespace_packages(include=["fp8ref*"]) + SPECS,
    package_dir={"fp8ref.specs": "specs"},
    package_data=PACKAGE_DATA,
    # No -fopenmp: the loops run on the OpenMP runtime torch loads, bound at run time (fp8ref/_native.py).
    ext_modules=[Extension("fp8ref._kernels", [os.path.join(CSRC, s) for s in PER_ISA + ONCE],
                           depends=[os.path.join(CSRC, h) for h in HEADERS], libraries=["m"])],
    cmdclass={"build_ext": ParallelBuildExt},
)
