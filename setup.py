"""Builds the optional C loops of fp8ref.codec; without a compiler fp8ref uses numpy."""

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class OptionalBuildExt(build_ext):
    """A failed compile is a warning: fp8ref falls back to its numpy codec."""

    def run(self):
        try:
            super().run()
        except Exception as exc:  # noqa: BLE001 - any compiler failure means "no C loops"
            print(f"WARNING: fp8ref C kernels not built ({exc}); using the numpy codec")

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001
            print(f"WARNING: fp8ref C kernels not built ({exc}); using the numpy codec")


setup(
    # No -fopenmp: the loops run on the OpenMP runtime torch loads, bound at run time (fp8ref/_native.py).
    ext_modules=[Extension("fp8ref._kernels",
                           ["fp8ref/_kernels.c", "fp8ref/_kernels_quant.c", "fp8ref/_kernels_matmul.c",
                            "fp8ref/_kernels_hw.c", "fp8ref/_kernels_hw_avx512.c",
                            "fp8ref/_kernels_exact.c"],
                           depends=["fp8ref/_kernels.h"], libraries=["m"],
                           extra_compile_args=["-O3", "-std=gnu11", "-ffp-contract=off"])],
    cmdclass={"build_ext": OptionalBuildExt},
)
