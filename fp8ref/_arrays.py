"""The one numpy/torch boundary: arrays of either library in, numpy inside, the caller's library out.

Core modules compute on numpy; what they accept and return is numpy or a torch CPU tensor.
Everything that looks at which library an array comes from, imports torch, or moves bfloat16
(which numpy has only through ml_dtypes' dtype) lives here. bfloat16 crosses as its uint16 bit
pattern: no cast of another library produces or reads a bfloat16 value.
"""

from __future__ import annotations

import sys

import numpy as np

from .errors import InputTypeError

FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
BITS_DTYPES = {"bfloat16": np.uint16, "float16": np.uint16, "float32": np.uint32, "float64": np.uint64}
"""The unsigned integer type that holds each float dtype's bit pattern."""
_UINT_OF_WIDTH = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def bits_view(a: np.ndarray) -> np.ndarray:
    """The bit patterns of a numeric array: a view as the unsigned integer of the same width."""
    return a.view(_UINT_OF_WIDTH[a.dtype.itemsize])


def torch():
    """The torch module, imported on first use (fp8ref runs without torch)."""
    import torch as _torch
    return _torch


def is_torch(x) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "dtype") and hasattr(x, "device")


def plain_cpu_tensor(x, t) -> bool:
    """``x`` a torch.Tensor itself (no subclass), dense, contiguous and on the CPU (``t``: torch): what
    the fast paths read by address, in few torch calls (5-25 us each on the caches a large pass leaves)."""
    return type(x) is t.Tensor and x.is_cpu and x.layout is t.strided and not x.is_nested and x.is_contiguous()


def tensor_pair(x, out) -> tuple[str, tuple, str, int, int] | None:
    """(x's dtype name, its shape, out's dtype name, x's address, out's address) where ``x`` and ``out``
    are plain CPU tensors (plain_cpu_tensor) of one shape, x of float16 or bfloat16 and ``out`` not
    requiring grad: what quantize's short path writes through; else None."""
    t = sys.modules.get("torch")
    if (t is None or not plain_cpu_tensor(x, t) or not plain_cpu_tensor(out, t) or out.requires_grad
            or out.shape != x.shape or x.dtype not in (t.bfloat16, t.float16)):
        return None
    return (_torch_float_name(t, x.dtype), tuple(x.shape), str(out.dtype).removeprefix("torch."), x.data_ptr(),
            out.data_ptr())


def empty_float32_tensor(shape: tuple):
    """(a new torch float32 tensor of ``shape``, its address): a result a C loop fills"""
    t = torch()
    out = t.empty(shape, dtype=t.float32)
    return out, out.data_ptr()


def check_torch(x, what: str) -> None:
    """A torch tensor fp8ref can read as numpy: dense (strided layout) and on the CPU. Sparse,
    nested, meta and device tensors are refused naming what they are (never copied silently)."""
    if x.device.type != "cpu":
        raise InputTypeError(f"{what}: expected a CPU tensor, got device {x.device}"
                             + (" (a meta tensor has no values)" if x.device.type == "meta" else ""))
    if getattr(x, "is_nested", False):
        raise InputTypeError(f"{what}: expected a dense tensor, got a nested tensor")
    if x.layout != torch().strided:
        raise InputTypeError(f"{what}: expected a dense tensor, got layout {x.layout} (.to_dense() makes one)")


def native_order(a: np.ndarray) -> np.ndarray:
    """``a`` in this machine's byte order: itself when it already is, else a copy with the same
    values (a big-endian '>f4' read from a file or written on another machine). Every numpy input
    passes here before its bytes are viewed as bit patterns or handed to the C loops, which read
    native words."""
    if a.dtype.isnative:
        return a
    width = _UINT_OF_WIDTH.get(a.dtype.itemsize)
    if width is None:  # no bit pattern is viewed for these; numpy converts the values
        return a.astype(a.dtype.newbyteorder("="))
    swapped = np.dtype(width).newbyteorder(a.dtype.byteorder)
    return a.view(swapped).astype(width).view(a.dtype.newbyteorder("="))


def numpy_input(x, what: str) -> np.ndarray:
    """A numpy array (or scalar) as a plain ndarray in native byte order; a masked array is
    refused (its mask would be ignored)."""
    if type(x) is np.ndarray and x.dtype.isnative:  # the common case, kept cheap (small calls matter)
        return x
    if isinstance(x, np.ma.MaskedArray):
        raise InputTypeError(f"{what}: a numpy masked array; fp8ref would ignore its mask: pass "
                             f"{what}.filled(value) or np.asarray({what})")
    return native_order(np.asarray(x))


def dtype_name(x) -> str:
    """'float32', 'bfloat16', 'uint8', ... of a numpy array or torch tensor."""
    return str(x.dtype).removeprefix("torch.") if is_torch(x) else np.dtype(x.dtype).name


# --- bfloat16 bits ----------------------------------------------------------------------------
def bf16_bits_to_f32(bits: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """float32 values of bfloat16 bit patterns (uint16): exact. ``out``: optional float32 buffer."""
    u = np.left_shift(bits, 16, dtype=np.uint32, out=None if out is None else out.view(np.uint32))
    return u.view(np.float32)


def f32_to_bf16_bits(values: np.ndarray) -> np.ndarray:
    """uint16 bit patterns of float32 values that bfloat16 holds exactly (the low half is zero)."""
    return (np.ascontiguousarray(values, np.float32).view(np.uint32) >> np.uint32(16)).astype(np.uint16)


def numpy_bf16(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns viewed as numpy's bfloat16 dtype (ml_dtypes' dtype, no cast)."""
    import ml_dtypes
    return np.asarray(bits, np.uint16).view(ml_dtypes.bfloat16)


_TORCH_FLOATS: dict = {}  # torch's float dtypes -> their names, filled on first use (fp8ref runs without torch)


def _torch_float_name(t, dtype) -> str | None:
    if not _TORCH_FLOATS:
        _TORCH_FLOATS.update({getattr(t, n): n for n in FLOAT_DTYPES})
    return _TORCH_FLOATS.get(dtype)


# --- inputs -----------------------------------------------------------------------------------
def float_input(x, what: str = "x") -> tuple[np.ndarray, str, bool]:
    """(contiguous numpy array of x's shape, dtype name, is_torch) of a float16/bfloat16/float32/
    float64 array or torch CPU tensor; bfloat16 comes back as its uint16 bit pattern."""
    t = sys.modules.get("torch")
    if t is not None and plain_cpu_tensor(x, t) and (name := _torch_float_name(t, x.dtype)):
        # the common case in fewer torch calls than below
        return (x.detach().view(t.int16).numpy().view(np.uint16) if name == "bfloat16" else x.detach().numpy(),
                name, True)
    if is_torch(x):
        t = torch()
        check_torch(x, what)
        name = dtype_name(x)
        if name not in FLOAT_DTYPES:
            raise InputTypeError(f"{what}: expected float16, bfloat16, float32 or float64, got torch.{name}")
        c = x.detach().contiguous()
        arr = c.view(t.int16).numpy().view(np.uint16) if name == "bfloat16" else c.numpy()
        return arr, name, True
    if isinstance(x, (np.ndarray, np.generic)):
        arr = np.ascontiguousarray(numpy_input(x, what))
        name = arr.dtype.name
        if name not in FLOAT_DTYPES:
            raise InputTypeError(f"{what}: expected float16, bfloat16, float32 or float64, got numpy {name}")
        return (arr.view(np.uint16) if name == "bfloat16" else arr), name, False
    raise InputTypeError(f"{what}: expected a numpy array or a torch CPU tensor, got {type(x).__name__}")


def bits_input(arr: np.ndarray, dtype: str, what: str = "x") -> tuple[np.ndarray, str, bool]:
    """``float_input`` of numpy values whose dtype is named apart: ``dtype`` 'bfloat16' takes ``arr``
    as its uint16 bit patterns (what ``TensorStore.get(bf16_bits=True)`` reads: no ml_dtypes import),
    any other float dtype must be ``arr``'s own."""
    if dtype not in FLOAT_DTYPES:
        raise InputTypeError(f"{what}: expected float16, bfloat16, float32 or float64, got numpy {dtype}")
    want = np.uint16 if dtype == "bfloat16" else np.dtype(dtype)
    if not isinstance(arr, np.ndarray) or arr.dtype != want:
        raise InputTypeError(f"{what}: {dtype} values expected as numpy {np.dtype(want).name}, got "
                             f"{getattr(arr, 'dtype', type(arr).__name__)}")
    return np.ascontiguousarray(numpy_input(arr, what)), dtype, False


def float64_values(x, what: str, dtypes: tuple[str, ...]) -> np.ndarray:
    """float64 numpy copy (exact) of a numpy/torch float array whose dtype is one of ``dtypes``;
    a Python number where float32 is allowed must be a float32 value."""
    if is_torch(x):
        name = dtype_name(x)
        if name not in dtypes:
            raise InputTypeError(f"{what}: expected dtype {' or '.join(dtypes)}, got torch {name}")
        check_torch(x, what)
        return x.detach().to(dtype=torch().float64).numpy()
    if type(x) in (float, int) and "float32" in dtypes:
        if float(np.float32(x)) != float(x):
            raise InputTypeError(f"{what}: the Python number {x!r} is not a float32 value; pass a float32 array")
        return np.asarray(float(x), dtype=np.float64)
    if isinstance(x, (np.ndarray, np.generic)):
        if x.dtype.name not in dtypes:
            raise InputTypeError(f"{what}: expected dtype {' or '.join(dtypes)}, got numpy {x.dtype.name}")
        return np.asarray(numpy_input(x, what), dtype=np.float64)
    raise InputTypeError(f"{what}: expected a numpy array or torch tensor, got {type(x).__name__}")


def code_input(x, what: str) -> tuple[np.ndarray, str | None, bool]:
    """(numpy uint8 codes, the torch float8 dtype's name or None, is_torch) of uint8 codes or a
    torch float8 tensor (viewed, not converted)."""
    if is_torch(x):
        t = torch()
        check_torch(x, what)
        named = None
        if x.dtype != t.uint8 and x.element_size() == 1 and x.dtype.is_floating_point:
            named, x = dtype_name(x), x.view(t.uint8)
        elif x.dtype != t.uint8:
            raise InputTypeError(f"{what}: expected uint8 codes or a torch float8 tensor, got torch {x.dtype}")
        return x.detach().contiguous().numpy(), named, True
    if isinstance(x, np.ndarray):
        if x.dtype != np.uint8:
            raise InputTypeError(f"{what}: expected uint8 codes, got numpy {x.dtype}")
        return numpy_input(x, what), None, False
    raise InputTypeError(f"{what}: expected a numpy uint8 array or a torch tensor, got {type(x).__name__}")


def to_numpy(a, what: str = "array") -> np.ndarray:
    """A numpy array (native byte order) of an array, torch or numpy: bfloat16 as exact float32 values."""
    if is_torch(a):
        check_torch(a, what)
        if a.dtype == torch().bfloat16:
            return bf16_bits_to_f32(a.detach().contiguous().view(torch().int16).numpy().view(np.uint16))
        return a.detach().contiguous().numpy()
    a = numpy_input(a, what)
    if a.dtype.name == "bfloat16":
        return bf16_bits_to_f32(np.ascontiguousarray(a).view(np.uint16))
    return a


def torch_of(a: np.ndarray):
    """A torch tensor (a copy) with the same dtype and bytes as numpy array ``a``: checkpoint tensors
    into a torch model (bfloat16 and float16 cross as bits; float8 stays uint8 codes); a big-endian
    array becomes a native tensor of the same values (torch has no byte order)."""
    a = np.ascontiguousarray(native_order(a))
    if a.dtype.name in ("bfloat16", "float16"):
        return torch().from_numpy(a.view(np.int16).copy()).view(getattr(torch(), a.dtype.name))
    return torch().from_numpy(a.copy())


def numpy_of(t) -> np.ndarray:
    """A numpy array with the same dtype and bytes as torch tensor ``t`` (bfloat16 as ml_dtypes' dtype)."""
    t = t.detach().contiguous()
    if t.dtype == torch().bfloat16:
        return numpy_bf16(t.view(torch().int16).numpy().view(np.uint16))
    return t.numpy()


# --- outputs ----------------------------------------------------------------------------------
def deliver(values: np.ndarray, dtype: str, as_torch: bool):
    """float values that ``dtype`` (float16, bfloat16, float32, float64) holds exactly -> an array
    of that dtype in the caller's library. Every conversion is exact; bfloat16 is built from bits."""
    if dtype == "bfloat16":
        v = np.asarray(values)
        if as_torch and v.dtype in (np.float32, np.float64) and v.dtype.isnative and v.size >= _TORCH_CONVERT:
            return _torch_bf16(v)
        bits = f32_to_bf16_bits(v.astype(np.float32))
        if as_torch:
            return torch().from_numpy(bits.view(np.int16)).view(torch().bfloat16)
        return numpy_bf16(bits)
    v = np.ascontiguousarray(np.asarray(values).astype(dtype))
    return torch().from_numpy(v) if as_torch else v


_TORCH_CONVERT = 1 << 16  # elements from which torch's threads convert deliver's bfloat16


def _torch_bf16(v: np.ndarray):
    """f32_to_bf16_bits(v.astype(float32)) as a torch bfloat16 tensor, by torch's threads: the same
    IEEE float64 -> float32 conversion (NaN keeps its sign and high payload bits), then the high
    half of each float32's bits, the low half dropped."""
    t = torch()
    f32 = t.from_numpy(np.ascontiguousarray(v)).reshape(-1).to(t.float32)
    pairs = f32.view(t.int16).reshape(-1, 2)
    high = pairs[:, 1] if sys.byteorder == "little" else pairs[:, 0]
    return high.contiguous().view(t.bfloat16).reshape(v.shape)


def same_library(arr: np.ndarray, as_torch: bool):
    """A numpy array as is, or as a torch tensor sharing its memory."""
    return torch().from_numpy(np.ascontiguousarray(arr)) if as_torch else arr


def output_buffer(out, shape: tuple, as_torch: bool, np_dtype, what: str, float8: str | None = None):
    """(user-facing output, flat numpy view to write): ``out`` checked, or a new array. ``float8``:
    the torch float8 dtype a uint8 output may also be given as (the format's own: its bits are the
    codes)."""
    if out is None:
        if as_torch:
            t = torch()
            tdtype = {np.dtype(np.uint8): t.uint8, np.dtype(np.float32): t.float32,
                      np.dtype(np.float64): t.float64}[np.dtype(np_dtype)]
            out = t.empty(shape, dtype=tdtype)
        else:
            out = aligned_empty(shape, np_dtype)
    if is_torch(out) != as_torch:
        raise InputTypeError(f"out: expected a {'torch tensor' if as_torch else 'numpy array'} like the input")
    if not as_torch and not isinstance(out, np.ndarray):
        raise InputTypeError(f"out: expected a numpy array for {what}, got {type(out).__name__}")
    flat = _torch_out(out, np_dtype, what, float8) if as_torch else out
    if not flat.dtype.isnative:
        raise InputTypeError(f"out: a byte-swapped array ({flat.dtype.str}) for {what}; fp8ref writes this "
                             f"machine's byte order: pass a native {np.dtype(np_dtype).name} array")
    if flat.dtype != np_dtype or tuple(flat.shape) != tuple(shape) or not flat.flags.c_contiguous:
        raise InputTypeError(f"out: expected a contiguous {np.dtype(np_dtype).name} array of shape "
                             f"{tuple(shape)} for {what}, got {flat.dtype.name} {tuple(flat.shape)}")
    if not flat.flags.writeable:
        raise InputTypeError(f"out: the array for {what} is read-only")
    return out, flat.reshape(-1)


def _torch_out(out, np_dtype, what: str, float8: str | None) -> np.ndarray:
    """A torch ``out`` as the numpy array that shares its memory, or a one-line error."""
    check_torch(out, f"out (for {what})")
    if out.requires_grad:
        raise InputTypeError(f"out: the tensor for {what} requires grad; pass one that does not")
    if out.element_size() == 1 and out.dtype.is_floating_point:
        if float8 is None or dtype_name(out) != float8:
            raise InputTypeError(f"out: expected torch.uint8{f' or torch.{float8}' if float8 else ''} codes for "
                                 f"{what}, got {out.dtype}")
        out = out.view(torch().uint8)
    try:
        return out.numpy()
    except TypeError:  # a dtype numpy has no counterpart for
        raise InputTypeError(f"out: expected a torch {np.dtype(np_dtype).name} tensor for {what}, "
                             f"got {out.dtype}") from None


# Outputs of the C loops are written around the cache (whole aligned lines, by non-temporal stores)
# into buffers whose pages are already touched (an out= given, a reused workspace) where a pass
# moves this much (its output; quantize: its input and codes together): they cannot stay in a
# last-level cache of the machines measured (48 MiB shared), and a normal store first reads each
# line from memory; smaller ones stay in the cache for whatever reads them next. A fresh buffer is
# not streamed: the kernel has just zeroed its pages through the cache, and streaming over those
# lines costs more than it saves (measured: docs/quantize.md).
STREAM_BYTES = 32 << 20


def aligned_empty(shape: tuple, np_dtype) -> np.ndarray:
    """np.empty starting on a 64-byte cache line (numpy's large arrays start 16 bytes into one), so
    that the C loops can write whole lines around the cache (torch's CPU tensors are aligned so)."""
    dt = np.dtype(np_dtype)
    n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
    raw = np.empty(n + 64, np.uint8)
    start = -raw.ctypes.data % 64
    return raw[start:start + n].view(dt).reshape(shape)
