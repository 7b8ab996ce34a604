"""Every public array function gives the same bytes whatever the memory layout of its inputs.

For each function the result on a native, C-contiguous array is the reference; the same values as
a big-endian array, a strided slice of a larger buffer (filled with 0xA5 bytes around them), a
negative-stride view, a Fortran-order array, and big-endian + strided + reversed at once must give
the same result, compared byte for byte (NaN by its bit pattern, signed zero by its sign bit), or
the same error, type and message. Each example runs with the C loops and with the numpy paths
(``FP8REF_NO_KERNELS=1``, which fp8ref reads at every call); without a built ``_kernels`` both
runs take the numpy paths, and a run with FP8REF_NO_KERNELS already set takes only those.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import fp8ref
from fp8ref import QuantArgs
from fp8ref.codec import ROUNDING_MODES
from fp8ref.formats import FORMATS

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


# --- layouts -------------------------------------------------------------------------------------
def byteswapped(a: np.ndarray) -> np.ndarray:
    """The same values in the other byte order (a copy)."""
    if a.dtype.itemsize == 1:
        return a.copy()
    swapped = a.view(_UINT[a.dtype.itemsize]).byteswap()
    return swapped.view(a.dtype.newbyteorder("S"))


def embedded(a: np.ndarray, step: int) -> np.ndarray:
    """A view with the values of ``a``: every |step|-th element of a larger buffer of 0xA5 bytes,
    walked backwards when step < 0."""
    big = np.empty(tuple(n * abs(step) for n in a.shape), a.dtype)
    big.reshape(-1).view(np.uint8)[...] = 0xA5
    view = big[tuple(slice(None, None, step) for _ in a.shape)]
    view[...] = a
    return view


def layouts(a: np.ndarray) -> dict[str, np.ndarray]:
    """``a`` (native, C-contiguous) in every other layout."""
    out = {"big-endian": byteswapped(a)} if a.dtype.itemsize > 1 else {}
    if a.ndim:
        out["strided"] = embedded(a, 2)
        out["negative-stride"] = embedded(a, -1)
        out["big-endian, strided, reversed"] = embedded(byteswapped(a), -3)
    if a.ndim >= 2:
        out["fortran"] = np.asfortranarray(a)
    for name, v in out.items():  # each holds a's values, bit for bit (tobytes: in its own byte order)
        same_order = byteswapped(a) if "big-endian" in name else a
        assert v.tobytes() == same_order.tobytes(), name
    return out


@contextlib.contextmanager
def kernel_path(path: str):
    """Run the block on the C loops ("c") or on the numpy paths ("numpy")."""
    old = os.environ.pop("FP8REF_NO_KERNELS", None)
    if path == "numpy":
        os.environ["FP8REF_NO_KERNELS"] = "1"
    try:
        yield
    finally:
        os.environ.pop("FP8REF_NO_KERNELS", None)
        if old is not None:
            os.environ["FP8REF_NO_KERNELS"] = old


# --- comparing results ---------------------------------------------------------------------------
def fingerprint(r):
    """What a result is, byte for byte: arrays as (library, dtype, shape, bytes); a QuantResult
    field by field; an error as its type and message."""
    if isinstance(r, BaseException):
        return ("error", type(r).__name__, str(r))
    if isinstance(r, fp8ref.QuantResult):
        return tuple((f.name, fingerprint(getattr(r, f.name))) for f in dataclasses.fields(r) if f.name != "_recipe")
    if type(r).__module__.startswith("torch"):
        from fp8ref._arrays import numpy_of

        a = numpy_of(r)
        return ("torch", str(r.dtype), tuple(r.shape), a.tobytes())
    if isinstance(r, (np.ndarray, np.generic)):
        a = np.asarray(r)
        assert a.dtype.isnative, f"a result in non-native byte order: {a.dtype.str}"
        return ("numpy", a.dtype.str, a.shape, a.tobytes())
    return ("value", r)


def outcome(call, *args):
    try:
        return fingerprint(call(*args))
    except fp8ref.Fp8RefError as exc:
        return fingerprint(exc)


# both paths, unless the run itself is on the numpy paths (FP8REF_NO_KERNELS set: C loops unwanted)
PATHS = ("numpy",) if os.environ.get("FP8REF_NO_KERNELS") else ("c", "numpy")


def check_layouts(call, *arrays: np.ndarray, which: tuple[int, ...] | None = None) -> None:
    """call(*arrays) equals call(...) with each array of ``which`` (default: all) in each other
    layout, on both kernel paths."""
    which = range(len(arrays)) if which is None else which
    for path in PATHS:
        with kernel_path(path):
            expected = outcome(call, *arrays)
            for i in which:
                for name, variant in layouts(arrays[i]).items():
                    args = list(arrays)
                    args[i] = variant
                    got = outcome(call, *args)
                    assert got == expected, f"argument {i} {name} ({path} path) differs from the native array"


# --- values ----------------------------------------------------------------------------------------
def np_dtype(name: str):
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


@st.composite
def float_arrays(draw, dtypes=FLOAT_DTYPES, shape=None, finite=False, min_dims=1):
    """Arrays of a float dtype: any bit pattern (NaN, Inf, subnormals, -0 included) unless
    ``finite``, then values of a few binades around 1 with zeros and subnormals among them."""
    name = draw(st.sampled_from(dtypes))
    shape = shape if shape is not None else draw(hnp.array_shapes(min_dims=min_dims, max_dims=3, max_side=6))
    if finite:
        width = 16 if name == "float16" else 32 if name == "bfloat16" else np_dtype(name).itemsize * 8
        elements = st.one_of(st.floats(-1000, 1000, width=width), st.sampled_from([0.0, -0.0, 2.0 ** -130]))
        wide = draw(hnp.arrays(np.float32 if name == "bfloat16" else np_dtype(name), shape, elements=elements))
        if name == "bfloat16":  # the top half of a float32 is a bfloat16 (truncated: still finite)
            return (wide.view(np.uint32) >> np.uint32(16)).astype(np.uint16).view(ml_dtypes.bfloat16)
        return wide
    bits = draw(hnp.arrays(_UINT[np_dtype(name).itemsize], shape))
    return bits.view(np_dtype(name))


codes_arrays = hnp.arrays(np.uint8, hnp.array_shapes(min_dims=1, max_dims=3, max_side=6))


# --- the codec ---------------------------------------------------------------------------------------
@SETTINGS
@given(float_arrays(), st.sampled_from(list(FORMATS)), st.sampled_from(ROUNDING_MODES[:-1]), st.booleans())
def test_encode(x, fmt, rounding, saturate):
    check_layouts(lambda x: fp8ref.encode(x, fmt, rounding=rounding, saturate=saturate), x)


@SETTINGS
@given(float_arrays(finite=True), st.sampled_from(["float8_e4m3fn", "float4_e2m1fn"]), st.data())
def test_encode_stochastic(x, fmt, data):
    bits = data.draw(hnp.arrays(st.sampled_from([np.uint8, np.uint16, np.uint32]), x.shape))
    check_layouts(lambda x, r: fp8ref.encode(x, fmt, rounding="stochastic", random_bits=r), x, bits)


@SETTINGS
@given(codes_arrays, st.sampled_from(list(FORMATS)))
def test_decode(codes, fmt):
    check_layouts(lambda c: fp8ref.decode(c, fmt), codes)


@SETTINGS
@given(st.sampled_from(FLOAT_DTYPES), st.sampled_from(["own", "float8_e4m3fn", "float4_e2m1fn"]), st.data())
def test_ulp_distance(dtype, grid, data):
    """Values on the grid measured: any finite values of their own dtype, or decoded codes."""
    shape = data.draw(hnp.array_shapes(max_dims=3, max_side=6))
    if grid == "own":
        a, b = (data.draw(float_arrays((dtype,), shape=shape, finite=True)) for _ in range(2))
        grid = dtype
    else:
        top = FORMATS[grid].max_code_magnitude
        codes = hnp.arrays(np.uint8, shape, elements=st.integers(0, 255).filter(lambda c: (c & 0x7F) <= top))
        a, b = (fp8ref.decode(data.draw(codes) & (0xFF if grid[6] == "8" else 0x0F), grid).astype(np_dtype(dtype))
                for _ in range(2))
    check_layouts(lambda a, b: fp8ref.ulp_distance(a, b, grid), a, b)


# --- quantize, dequantize, fake_quant ---------------------------------------------------------------
# (QuantArgs fields, recipe): fp8ref's own recipe on every granularity and producers' recipes,
# scale element and block alike
QUANT_CASES = [
    ({}, None), ({"granularity": "channel"}, None), ({"granularity": "token"}, None),
    ({"granularity": "group", "group_size": 16}, None), ({"granularity": "block", "block_shape": (2, 16)}, None),
    ({"format": "float8_e5m2", "granularity": "channel"}, None),
    ({"format": "float4_e2m1fn", "granularity": "mx"}, None),
    ({"format": "float4_e2m1fn", "granularity": "nvfp4"}, None),
    ({}, "compressed-tensors"), ({"granularity": "channel", "scale_dtype": "bfloat16"}, "auto-round"),
    ({"granularity": "token"}, "vllm-dynamic"), ({"granularity": "block", "block_shape": (2, 16)}, "deepgemm-ue8m0"),
    ({"format": "float4_e2m1fn", "granularity": "nvfp4"}, "compressed-tensors-nvfp4"),
    ({"format": "float4_e2m1fn", "granularity": "nvfp4"}, "te-nvfp4"),
    ({"format": "float8_e4m3fn", "granularity": "mx"}, "modelopt-mxfp8"), ({}, "te-current"), ({}, "quark-fp8"),
]


@st.composite
def quant_inputs(draw):
    kw, recipe = draw(st.sampled_from(QUANT_CASES))
    rows = draw(st.integers(1, 5))
    cols = 16 * draw(st.integers(1, 3))
    lead = draw(st.sampled_from([(), (2,)]))
    x = draw(float_arrays(shape=lead + (rows, cols), finite=draw(st.booleans())))
    return QuantArgs(**kw), recipe, x


@SETTINGS
@given(quant_inputs())
def test_quantize_dequantize_fake_quant(case):
    args, recipe, x = case
    check_layouts(lambda x: fp8ref.quantize(x, args, recipe=recipe), x)
    check_layouts(lambda x: fp8ref.fake_quant(x, args, recipe=recipe), x)
    try:
        q = fp8ref.quantize(x, args, recipe=recipe)
    except fp8ref.Fp8RefError:  # refused (NaN for a recipe that needs finite x): the same in every layout, above
        return

    def dequantize(codes, scale):
        return fp8ref.dequantize(dataclasses.replace(q, codes=codes, scale=scale))

    check_layouts(dequantize, np.asarray(q.codes), np.asarray(q.scale))


@SETTINGS
@given(st.integers(1, 4), st.integers(1, 9), st.sampled_from(["tensor", "channel"]), st.sampled_from(["scale", "amax"]),
       st.data())
def test_static_quantize_scale_and_amax(rows, cols, granularity, kind, data):
    """A calibrated scale= or amax= in each layout (the channel layout is (rows, 1))."""
    x = data.draw(float_arrays(("float32", "bfloat16"), shape=(rows, cols), finite=True))
    shape = (1,) if granularity == "tensor" else (rows, 1)
    s = data.draw(hnp.arrays(np.float32, shape, elements=st.floats(2.0 ** -10, 2.0 ** 10, width=32)))
    args = QuantArgs(granularity=granularity, dynamic=False)
    check_layouts(lambda x, s: fp8ref.quantize(x, args, **{kind: s}), x, s)


# --- scaled_mm, linear -----------------------------------------------------------------------------
@st.composite
def mm_inputs(draw):
    M, K, N = (draw(st.integers(1, 6)) for _ in range(3))
    fmt = draw(st.sampled_from(["float8_e4m3fn", "float8_e5m2"]))
    top = FORMATS[fmt].max_code_magnitude  # codes of finite values: NaN/Inf results say little about layouts
    codes = st.integers(0, 255).filter(lambda c: (c & 0x7F) <= top)
    a = draw(hnp.arrays(np.uint8, (M, K), elements=codes))
    b = draw(hnp.arrays(np.uint8, (K, N), elements=codes))
    scale_shapes = draw(st.sampled_from([((1,), (1,)), ((M, 1), (1, N))]))
    positive = st.floats(2.0 ** -8, 2.0 ** 8, width=32)
    sa, sb = (draw(hnp.arrays(np.float32, s, elements=positive)) for s in scale_shapes)
    bias = draw(hnp.arrays(np.float32, (N,), elements=st.floats(-4, 4, width=32)))
    return fmt, a, b, sa, sb, bias


@SETTINGS
@given(mm_inputs(), st.sampled_from(["exact", "fp32", "fp32-limited", "hopper-fast-accum", "hopper-promoted",
                                      "blackwell-fp8"]), st.sampled_from(["float32", "bfloat16"]))
def test_scaled_mm(case, accumulate, out_dtype):
    fmt, a, b, sa, sb, bias = case

    def mm(a, b, sa, sb, bias):
        return fp8ref.scaled_mm(a, b, sa, sb, bias=bias, fmt_a=fmt, fmt_b=fmt, accumulate=accumulate,
                                out_dtype=out_dtype)

    check_layouts(mm, a, b, sa, sb, bias)


@SETTINGS
@given(mm_inputs(), st.sampled_from([None, "tensor", "token"]), st.sampled_from(["float32", "bfloat16", "float16"]),
       st.data())
def test_linear(case, dynamic, x_dtype, data):
    fmt, _, w, _, ws, bias = case
    w = np.ascontiguousarray(w.T)  # (N, K)
    x = data.draw(float_arrays((x_dtype,), shape=(3, w.shape[1]), finite=True))
    input_scale = np.array([0.5], np.float32)

    def linear(x, w, ws, bias, input_scale):
        return fp8ref.linear(x, w, ws.reshape(-1), bias=bias, fmt=fmt, dynamic=dynamic,
                             input_scale=None if dynamic else input_scale)

    check_layouts(linear, x, w, ws, bias, input_scale)


# --- calibration -----------------------------------------------------------------------------------
@SETTINGS
@given(float_arrays(finite=True, min_dims=2), st.sampled_from(["tensor", "channel"]))
def test_observe(x, granularity):
    def fold(x):
        state = fp8ref.observe(fp8ref.amax_state(granularity), x)
        return state.amax

    check_layouts(fold, x)


def test_the_layouts_are_what_they_say():
    """The helper's variants really are big-endian, strided, reversed and Fortran-order."""
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    v = layouts(a)
    assert v["big-endian"].dtype.byteorder == ">" if np.little_endian else "<"
    assert not v["strided"].flags.c_contiguous and v["strided"].base is not None
    assert all(s < 0 for s in v["negative-stride"].strides)
    assert v["fortran"].flags.f_contiguous and not v["fortran"].flags.c_contiguous
    assert not v["big-endian, strided, reversed"].dtype.isnative
    for name, x in v.items():
        assert np.array_equal(x, a), name


@pytest.mark.parametrize("dtype", [">f4", ">f2", ">f8"])
def test_the_reported_big_endian_encode(dtype):
    """The issue's case: [1, 2, 448, -3.5] in big-endian encodes like the native array."""
    x = np.array([1.0, 2.0, 448.0, -3.5], dtype=dtype)
    assert fp8ref.encode(x, "float8_e4m3fn").tolist() == [56, 64, 126, 198]


# --- torch: no byte order, but strided and transposed views --------------------------------------------
@SETTINGS
@given(float_arrays(("float32", "bfloat16", "float16"), finite=True, min_dims=2), st.data())
def test_torch_views(x, data):
    """A transposed or sliced torch tensor gives what its contiguous copy gives."""
    torch = pytest.importorskip("torch")
    from fp8ref._arrays import numpy_of, torch_of

    t = torch_of(x)
    views = {"transposed": t.transpose(-1, -2).contiguous().transpose(-1, -2),
             "sliced": torch.repeat_interleave(t, 2, dim=-1)[..., ::2]}
    for name, v in views.items():  # each holds t's values, bit for bit
        assert numpy_of(v).tobytes() == numpy_of(t).tobytes(), name
    for path in PATHS:
        with kernel_path(path):
            for name, v in views.items():
                assert not v.is_contiguous() or min(t.shape) == 1, name
                for call in (lambda y: fp8ref.encode(y, "float8_e4m3fn"),
                             lambda y: fp8ref.quantize(y, QuantArgs(granularity="channel")),
                             lambda y: fp8ref.fake_quant(y, QuantArgs())):
                    assert outcome(call, v) == outcome(call, t), f"{name} ({path} path)"


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
def test_numpy_arrays_into_torch_keep_their_values_in_any_byte_order(dtype):
    """torch_of (original weights of swap_linears, checkpoint tensors into a model): torch has no
    byte order, and torch.from_numpy refuses a big-endian array; the tensor holds the same values."""
    from fp8ref._arrays import numpy_of, torch_of

    a = np.array([[1.5, -2.0, 0.0], [-0.0, 3.0e-3, 65504.0]], np.float32).astype(np_dtype(dtype))
    for name, v in layouts(a).items():
        assert numpy_of(torch_of(v)).tobytes() == a.tobytes(), name
