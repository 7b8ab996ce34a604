"""A raw Hopper ``wgmma.mma_async`` (m64n256k32, FP8 x FP8 -> f32) written in PTX, for tools/gpu_check.py.

One warpgroup (128 threads) runs one instruction: D = A·B + C, A (64 x 32) and B (32 x 256) FP8 codes
read from shared memory through matrix descriptors, C and D in the 128 f32 registers per thread the
instruction accumulates in. Everything about layouts happens here in Python, where it can be read and
tested: the host writes A and B into shared memory's no-swizzle "core matrix" layout (8 rows x 16 bytes
each, K-major as FP8 operands must be), and C/D travel in register-fragment order (thread t's 128 values
contiguous), so the kernel only copies bytes and issues the instruction.

The PTX is loaded through the CUDA driver (ctypes on libcuda: cuModuleLoadData JIT-compiles it, or
``ptxas -arch=sm_90a`` first where it is on PATH, for its error messages); no nvcc, no torch extension.
The two byte offsets of a no-swizzle descriptor (leading and stride dimension) are easy to swap by
mistake, so the run first tries both on operands whose result every model agrees on (small integers,
exact sums) and keeps the one that reproduces them: a layout error is reported as such, never as a
numerics finding.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

M, N, K = 64, 256, 32
THREADS = 128
CORE = 128  # bytes per core matrix: 8 rows x 16 bytes
TYPES = {"float8_e4m3fn": "e4m3", "float8_e5m2": "e5m2"}
# (leading, stride) byte offsets: between core matrices adjacent along K, and along M/N, as laid out by
# smem_layout(); the second variant is the same memory read with the two fields swapped.
DESCRIPTOR_VARIANTS = {"lbo=K-step,sbo=row-step": (CORE, 2 * CORE), "lbo=row-step,sbo=K-step": (2 * CORE, CORE)}


def smem_layout(x: np.ndarray) -> np.ndarray:
    """(R, 32) K-major codes -> the bytes of shared memory: core matrix (r // 8, k // 16) at
    (r // 8) * 256 + (k // 16) * 128, its 8 rows of 16 bytes contiguous."""
    R = x.shape[0]
    assert x.shape == (R, K) and R % 8 == 0
    return np.ascontiguousarray(x.reshape(R // 8, 8, 2, 16).transpose(0, 2, 1, 3)).reshape(-1)


def fragment_index() -> tuple[np.ndarray, np.ndarray]:
    """(rows, cols), each (128 threads, 128 registers): the element of the 64 x 256 accumulator that
    register i of thread t holds (warp w owns rows 16w..16w+15; lane = 4 * group + thread_in_group)."""
    t = np.arange(THREADS)[:, None]
    i = np.arange(N // 2)[None, :]
    warp, lane = t // 32, t % 32
    rows = 16 * warp + lane // 4 + 8 * ((i >> 1) & 1)
    cols = 8 * (i >> 2) + 2 * (lane % 4) + (i & 1)
    return np.broadcast_to(rows, (THREADS, N // 2)), np.broadcast_to(cols, (THREADS, N // 2))


def to_fragments(c: np.ndarray) -> np.ndarray:
    rows, cols = fragment_index()
    return np.ascontiguousarray(c[rows, cols], dtype=np.float32).reshape(-1)


def from_fragments(d: np.ndarray) -> np.ndarray:
    rows, cols = fragment_index()
    out = np.empty((M, N), np.float32)
    out[rows, cols] = d.reshape(THREADS, N // 2)
    return out


def kernel_name(a_fmt: str, b_fmt: str) -> str:
    return f"wgmma_m64n256k32_f32_{TYPES[a_fmt]}_{TYPES[b_fmt]}"


def ptx(pairs: list[tuple[str, str]]) -> str:
    """One PTX module with a kernel per (A format, B format)."""
    return ".version 8.0\n.target sm_90a\n.address_size 64\n\n" + "\n".join(_kernel(a, b) for a, b in pairs)


def _kernel(a_fmt: str, b_fmt: str) -> str:
    regs = ", ".join(f"%f{i}" for i in range(N // 2))
    loads = "\n".join(f"    ld.global.f32 %f{i}, [%rd_c+{4 * i}];" for i in range(N // 2))
    stores = "\n".join(f"    st.global.f32 [%rd_d+{4 * i}], %f{i};" for i in range(N // 2))
    copy_b = "\n".join(f"""    ld.global.v4.u32 {{%r4, %r5, %r6, %r7}}, [%rd_gb+{2048 * j}];
    st.shared.v4.u32 [%r_sb+{2048 * j}], {{%r4, %r5, %r6, %r7}};""" for j in range(4))
    return f"""
.visible .entry {kernel_name(a_fmt, b_fmt)}(
    .param .u64 p_a, .param .u64 p_b, .param .u64 p_c, .param .u64 p_d, .param .u64 p_fields)
{{
    .reg .pred %p;
    .reg .b32 %r<12>;
    .reg .b32 %r_sa, %r_sb;
    .reg .b64 %rd_ga, %rd_gb, %rd_c, %rd_d, %rd_f, %rd_t, %rd_da, %rd_db, %rd_off;
    .reg .f32 %f<{N // 2}>;
    .shared .align 1024 .b8 sm_a[{M * K}];
    .shared .align 1024 .b8 sm_b[{N * K}];

    mov.u32 %r0, %tid.x;
    ld.param.u64 %rd_ga, [p_a];
    ld.param.u64 %rd_gb, [p_b];
    ld.param.u64 %rd_c, [p_c];
    ld.param.u64 %rd_d, [p_d];
    ld.param.u64 %rd_f, [p_fields];
    cvta.to.global.u64 %rd_ga, %rd_ga;
    cvta.to.global.u64 %rd_gb, %rd_gb;
    cvta.to.global.u64 %rd_c, %rd_c;
    cvta.to.global.u64 %rd_d, %rd_d;
    // A: 2048 bytes, 16 per thread; B: 8192 bytes, 4 x 16 per thread (already in core-matrix order)
    mul.wide.u32 %rd_off, %r0, 16;
    add.u64 %rd_ga, %rd_ga, %rd_off;
    add.u64 %rd_gb, %rd_gb, %rd_off;
    mov.u32 %r_sa, sm_a;
    mov.u32 %r_sb, sm_b;
    shl.b32 %r1, %r0, 4;
    add.u32 %r2, %r_sa, %r1;
    ld.global.v4.u32 {{%r4, %r5, %r6, %r7}}, [%rd_ga];
    st.shared.v4.u32 [%r2], {{%r4, %r5, %r6, %r7}};
    add.u32 %r_sb, %r_sb, %r1;
{copy_b}
    fence.proxy.async.shared::cta;
    bar.sync 0;
    // C: this thread's 128 accumulator registers
    mul.wide.u32 %rd_off, %r0, {4 * N // 2};
    add.u64 %rd_c, %rd_c, %rd_off;
    add.u64 %rd_d, %rd_d, %rd_off;
{loads}
    // descriptors: start address >> 4 in bits 0-13, the offsets' fields from the host (p_fields)
    mov.u32 %r8, sm_a;
    mov.u32 %r9, sm_b;
    shr.u32 %r8, %r8, 4;
    shr.u32 %r9, %r9, 4;
    and.b32 %r8, %r8, 16383;
    and.b32 %r9, %r9, 16383;
    cvt.u64.u32 %rd_da, %r8;
    cvt.u64.u32 %rd_db, %r9;
    or.b64 %rd_da, %rd_da, %rd_f;
    or.b64 %rd_db, %rd_db, %rd_f;
    setp.ne.b32 %p, 1, 0;  // scale-d = 1: D = A*B + C
    wgmma.fence.sync.aligned;
    wgmma.mma_async.sync.aligned.m64n256k32.f32.{TYPES[a_fmt]}.{TYPES[b_fmt]} {{{regs}}}, %rd_da, %rd_db, %p, 1, 1;
    wgmma.commit_group.sync.aligned;
    wgmma.wait_group.sync.aligned 0;
{stores}
    ret;
}}
"""


def descriptor_fields(lbo: int, sbo: int) -> int:
    """Bits 16-29 (leading byte offset >> 4) and 32-45 (stride byte offset >> 4); swizzle 0 (none)."""
    return ((lbo >> 4) & 0x3FFF) << 16 | ((sbo >> 4) & 0x3FFF) << 32


def ptxas_check(text: str, ptxas: str | None = None) -> tuple[bytes | None, str]:
    """(cubin, "") compiled by ptxas for sm_90a, or (None, why) when ptxas is missing or fails."""
    ptxas = ptxas or shutil.which("ptxas")
    if not ptxas:
        return None, "ptxas not on PATH (the driver JIT-compiles the PTX instead)"
    with tempfile.TemporaryDirectory() as d:
        src, out = Path(d) / "wgmma.ptx", Path(d) / "wgmma.cubin"
        src.write_text(text)
        done = subprocess.run([ptxas, "-arch=sm_90a", str(src), "-o", str(out)], capture_output=True, text=True)
        if done.returncode:
            return None, f"ptxas failed: {done.stderr.strip()[-2000:]}"
        return out.read_bytes(), ""


class Driver:
    """The few CUDA driver calls the run needs, on the context torch made current."""

    def __init__(self, image: bytes):
        self.cu = ctypes.CDLL("libcuda.so.1")
        self._ok(self.cu.cuInit(0), "cuInit")
        self.module = ctypes.c_void_p()
        self._ok(self.cu.cuModuleLoadData(ctypes.byref(self.module), ctypes.c_char_p(image)), "cuModuleLoadData")

    def _ok(self, rc: int, what: str) -> None:
        if rc:
            name = ctypes.c_char_p()
            self.cu.cuGetErrorName(rc, ctypes.byref(name))
            raise RuntimeError(f"{what}: CUDA driver error {rc} ({(name.value or b'?').decode()})")

    def launch(self, kernel: str, args: list[int]) -> None:
        fn = ctypes.c_void_p()
        self._ok(self.cu.cuModuleGetFunction(ctypes.byref(fn), self.module, kernel.encode()), "cuModuleGetFunction")
        values = [ctypes.c_uint64(a) for a in args]
        params = (ctypes.c_void_p * len(values))(*[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in values])
        self._ok(self.cu.cuLaunchKernel(fn, 1, 1, 1, THREADS, 1, 1, 0, None, params, None), "cuLaunchKernel")
        self._ok(self.cu.cuCtxSynchronize(), "cuCtxSynchronize")


def run_wgmma(driver: Driver, a_fmt: str, b_fmt: str, a: np.ndarray, b: np.ndarray, c: np.ndarray,
              fields: int) -> np.ndarray:
    """D (64 x 256, float32) of one instruction on the GPU: a (64, 32) and b (32, 256) uint8 codes."""
    import torch

    ta = torch.from_numpy(smem_layout(a)).cuda()
    tb = torch.from_numpy(smem_layout(np.ascontiguousarray(b.T))).cuda()
    tc = torch.from_numpy(to_fragments(c)).cuda()
    td = torch.empty_like(tc)
    driver.launch(kernel_name(a_fmt, b_fmt), [ta.data_ptr(), tb.data_ptr(), tc.data_ptr(), td.data_ptr(), fields])
    return from_fragments(td.cpu().numpy())
