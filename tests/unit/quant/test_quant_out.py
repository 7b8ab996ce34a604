"""quantize(..., out=): the codes written into a caller's buffer are the codes quantize returns
otherwise, on every path (table loop, written around the cache at any alignment, numpy); bad
buffers are refused with one line before anything is written."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

from fp8ref import _arrays
from fp8ref.errors import InputTypeError
from fp8ref.quant import QuantArgs, quantize

ARGS = {"tensor": QuantArgs(), "channel": QuantArgs(granularity="channel"),
        "group": QuantArgs(granularity="group", group_size=128),
        "block": QuantArgs(granularity="block", block_shape=(128, 128))}


def _weights(shape, dtype, seed=0):
    rng = np.random.default_rng(seed)
    span = 6 if dtype == "float16" else 20  # float16 overflows past 2**16
    x = rng.standard_normal(shape) * 2.0 ** rng.integers(-span, span, size=shape[:-1] + (1,))
    return x.astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)


@pytest.fixture
def v3_level():
    """The x86-64-v3 object's loops for one test (bound as FP8REF_ISA=x86-64-v3 binds them), the
    level before it bound again after it."""
    from fp8ref import _native

    if "x86-64-v3" not in _native.runnable_levels():
        pytest.skip("the x86-64-v3 loops are not built or this CPU does not run them")
    bound = _native.build_info()["isa"]
    _native.use_level("x86-64-v3")
    yield
    _native.use_level(bound)


def _numpy_codes(monkeypatch, x, args, recipe):
    with monkeypatch.context() as m:
        m.setenv("FP8REF_NO_KERNELS", "1")
        return np.asarray(quantize(x, args, recipe=recipe).codes)


@pytest.mark.parametrize("gran", list(ARGS))
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("recipe", ["fp8ref", "compressed-tensors"])
def test_out_is_the_result_and_holds_the_codes(monkeypatch, gran, dtype, recipe):
    x = _weights((256, 384), dtype)
    out = np.full(x.shape, 0xAB, np.uint8)
    res = quantize(x, ARGS[gran], recipe=recipe, out=out)
    assert res.codes is out
    assert np.array_equal(out, _numpy_codes(monkeypatch, x, ARGS[gran], recipe))
    plain = quantize(x, ARGS[gran], recipe=recipe)
    assert np.array_equal(np.asarray(plain.scale, np.float64), np.asarray(res.scale, np.float64))


@pytest.mark.parametrize("offset", [0, 1, 15, 16, 33, 63])
@pytest.mark.parametrize("gran", ["channel", "block", "tensor"])
@pytest.mark.parametrize("cols", [1100, 1024])
@pytest.mark.parametrize("loop", ["vbmi", "portable", "avx2"])
def test_streamed_codes_at_every_alignment(monkeypatch, request, offset, gran, cols, loop):
    """Written around the cache (threshold lowered to 0): whole aligned lines streamed, the partial
    lines at each piece's ends stored normally, whatever the buffer's offset from a line. Rows of
    1,100 codes are no multiple of 64 (through a buffer); rows of 1,024 go by band rows, which
    stream their own codes at offset 0 (with tiny inputs handed back to the segment loop: normal
    stores into streamed lines) and at other offsets each row through a buffer; the portable loop
    (FP8REF_NO_VBMI, what CPUs without VBMI run) and the x86-64-v3 object's AVX2 loop run them
    without VBMI. 1,024 rows run on every thread."""
    monkeypatch.setattr(_arrays, "STREAM_BYTES", 0)
    if loop != "vbmi":
        monkeypatch.setenv("FP8REF_NO_VBMI", "1")
    if loop == "avx2":
        request.getfixturevalue("v3_level")
    x = _weights((1024, cols), "bfloat16", seed=offset)
    x[3, :500] = 0.0
    x[5, 7:200:9] = x[5, 7:200:9] * 2.0 ** -40  # codes 0 and, at 2**-16, subnormal codes: below the
    x[5, 8:200:9] = x[5, 8:200:9] * 2.0 ** -16  # table's binades, the segment loop's
    raw = np.full(x.size + 128, 0xAB, np.uint8)
    start = -raw.ctypes.data % 64 + offset
    out = raw[start:start + x.size].reshape(x.shape)
    quantize(x, ARGS[gran], out=out)
    assert np.array_equal(out, _numpy_codes(monkeypatch, x, ARGS[gran], "fp8ref"))
    assert (raw[:start] == 0xAB).all() and (raw[start + x.size:] == 0xAB).all()  # nothing outside out



@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_codes_stream_where_input_and_codes_together_pass_the_threshold(monkeypatch, dtype):
    """A pass streams its codes where x and the codes together reach STREAM_BYTES (a 4096x4096
    bfloat16 weight's 16 MiB of codes follow 32 MiB of input through the cache), only into an
    out= (a fresh array's pages were just zeroed through the cache), and the codes are the same
    either way."""
    import fp8ref.quant as quant_mod

    x = _weights((64, 1024), dtype)
    seen = []
    real = quant_mod._quantize_scaled

    def spy(*args, **kwargs):
        seen.append(kwargs["stream"])
        return real(*args, **kwargs)

    monkeypatch.setattr(quant_mod, "_quantize_scaled", spy)
    traffic = x.nbytes + x.size  # x read, one byte of code written per element
    want = _numpy_codes(monkeypatch, x, ARGS["block"], "fp8ref")
    for threshold, streamed in ((traffic, True), (traffic + 1, False), (x.size, True)):
        monkeypatch.setattr(_arrays, "STREAM_BYTES", threshold)
        out = np.zeros(x.shape, np.uint8)
        quantize(x, ARGS["block"], out=out)
        assert seen[-1] is streamed and np.array_equal(out, want)
    quantize(x, ARGS["block"])  # a fresh result: never streamed
    assert seen[-1] is False

def test_torch_out_uint8_and_float8():
    x = torch.randn(64, 512, dtype=torch.bfloat16)
    want = quantize(x, ARGS["channel"]).codes
    for dt in (torch.uint8, torch.float8_e4m3fn):
        out = torch.zeros(64, 512, dtype=dt)
        res = quantize(x, ARGS["channel"], out=out)
        assert res.codes is out
        assert torch.equal(out.view(torch.uint8), want)


def _bad_outs():
    x = np.linspace(-3, 3, 4 * 256, dtype=np.float32).reshape(4, 256)
    ro = np.zeros(x.shape, np.uint8)
    ro.setflags(write=False)
    overlap = x.view(np.uint8).reshape(-1)[: x.size].reshape(x.shape)
    return x, {
        "shape": (np.zeros((4, 255), np.uint8), "shape"),
        "dtype": (np.zeros(x.shape, np.int8), "uint8"),
        "strided": (np.zeros((4, 512), np.uint8)[:, ::2], "contiguous"),
        "read-only": (ro, "read-only"),
        "overlap": (overlap, "overlaps x"),
        "torch for numpy": (torch.zeros(4, 256, dtype=torch.uint8), "numpy array"),
        "a list": ([0] * 1024, "numpy array"),
    }


@pytest.mark.parametrize("case", list(_bad_outs()[1]))
def test_bad_out_is_refused_and_left_as_it_was(case):
    x, cases = _bad_outs()
    out, words = cases[case]
    before = out.clone() if isinstance(out, torch.Tensor) else out.copy()
    with pytest.raises(InputTypeError, match=words) as e:
        quantize(x, ARGS["channel"], out=out)
    assert "\n" not in str(e.value) and str(e.value).startswith("out:")
    assert torch.equal(out, before) if isinstance(out, torch.Tensor) else np.array_equal(out, before)


def test_torch_out_for_torch_x_is_checked_too():
    x = torch.randn(4, 256)
    for out, words in ((np.zeros((4, 256), np.uint8), "torch tensor"), (torch.zeros(4, 256, dtype=torch.int8), "uint8"),
                       (torch.zeros(4, 256, dtype=torch.uint8, requires_grad=False).t(), "contiguous"),
                       (torch.zeros(4, 256, requires_grad=True), "requires grad")):
        with pytest.raises(InputTypeError, match=words):
            quantize(x, ARGS["channel"], out=out)


def test_torch_out_of_another_float8_and_packed_granularities_are_refused():
    x = torch.randn(32, 64)
    with pytest.raises(InputTypeError, match="float8_e4m3fn"):
        quantize(x, ARGS["channel"], out=torch.zeros(32, 64, dtype=torch.float8_e5m2))
    with pytest.raises(InputTypeError, match="granularity 'mx'"):
        quantize(x, QuantArgs(format="float8_e4m3fn", granularity="mx"), out=torch.zeros(32, 64, dtype=torch.uint8))
