"""``quantize(x, args, out=)`` of torch tensors by its short path (quant._quantize_tensor_into: a cached
plan, the fused C pass run on the tensors' addresses, the scales looked up in C) against the general
path of the same call and the numpy path (``FP8REF_NO_KERNELS``): the same codes and scales byte for
byte, the same result fields, and the same error where the call is refused.
"""

from __future__ import annotations

import numpy as np
import pytest

from fp8ref import _native, _native_quant, quant
from fp8ref.errors import EncodeError, InputTypeError
from fp8ref.quant import QuantArgs, quantize

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not _native.kernels_available(), reason="C loops not built or FP8REF_NO_KERNELS set")

FIELDS = ("format", "granularity", "recipe", "args", "scale_dtype", "dtype")


def weight(shape, dtype, seed=0):
    """N(0, 1) scaled per row and per 32 columns by 2^U(-8, 8): amaxes over many binades."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g)
    w *= torch.exp2(torch.randint(-8, 9, shape[:-1] + (1,), generator=g).float())
    w *= torch.exp2(torch.randint(-8, 9, (-(-shape[-1] // 32),), generator=g).float()).repeat_interleave(32)[:shape[-1]]
    return w.to(dtype)


@pytest.fixture
def runs(monkeypatch):
    """Counts the short path's C runs, and whether the general path ran after it."""
    seen = {"fused": 0, "general": 0}
    real_run, real_general = _native_quant.run_fused, quant._quantize

    def run(*a, **k):
        seen["fused"] += 1
        return real_run(*a, **k)

    def general(*a, **k):
        seen["general"] += 1
        return real_general(*a, **k)

    monkeypatch.setattr(_native_quant, "run_fused", run)
    monkeypatch.setattr(quant, "_quantize", general)
    return seen


def reference(monkeypatch, x, qa, out_dtype, **kw):
    """(general C path, numpy path) results of quantize(x, qa, out=) into fresh outs of out_dtype"""
    results = []
    for env in (None, "1"):
        with monkeypatch.context() as m:
            m.setattr(quant, "_quantize_tensor_into", lambda *a: None)
            if env:
                m.setenv("FP8REF_NO_KERNELS", env)
            out = torch.full(x.shape, 0xAB, dtype=torch.uint8).view(out_dtype)
            results.append(quantize(x, qa, out=out, **kw))
    return results


def raw(t) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def same(a, b):
    assert raw(a.codes) == raw(b.codes)
    assert a.scale.dtype == b.scale.dtype and a.scale.shape == b.scale.shape
    assert raw(a.scale) == raw(b.scale)
    assert all(getattr(a, f) == getattr(b, f) for f in FIELDS)


CASES = [("fp8ref", "channel", {}), ("fp8ref", "block", {"block_shape": (128, 128)}),
         ("fp8ref", "block", {"block_shape": (32, 64)}), ("fp8ref", "group", {"group_size": 128}),
         ("compressed-tensors", "channel", {}), ("compressed-tensors", "group", {"group_size": 64}),
         ("hf-fp8", "block", {"block_shape": (128, 128)}), ("auto-round", "channel", {})]


@pytest.mark.parametrize("recipe,gran,extra", CASES)
@pytest.mark.parametrize("shape", [(256, 512), (200, 448), (3, 130, 256)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_short_path_gives_the_general_paths_bytes(monkeypatch, runs, recipe, gran, extra, shape, dtype):
    qa = QuantArgs(granularity=gran, recipe=recipe, **extra)
    x = weight(shape, dtype)
    try:
        c_general, numpy_path = reference(monkeypatch, x, qa, torch.uint8)
    except Exception as exc:  # a shape the recipe refuses: the short path must refuse it the same way
        with pytest.raises(type(exc), match=str(exc)[:40].replace("(", r"\(").replace(")", r"\)")):
            quantize(x, qa, out=torch.empty(shape, dtype=torch.uint8))
        return
    same(c_general, numpy_path)
    runs.update(fused=0, general=0)
    out = torch.full(shape, 0xAB, dtype=torch.uint8)
    fast = quantize(x, qa, out=out)
    assert fast.codes is out
    same(fast, c_general)
    assert runs == {"fused": 1, "general": 0}  # the short path alone


def test_float8_out_and_a_repeated_plan(monkeypatch, runs):
    qa = QuantArgs(granularity="block", block_shape=(128, 128))
    for seed in range(3):  # the plan cached by the first call serves the others
        x = weight((256, 384), torch.bfloat16, seed)
        ref, _ = reference(monkeypatch, x, qa, torch.float8_e4m3fn)
        runs.update(fused=0, general=0)
        out = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
        same(quantize(x, qa, out=out), ref)
        assert runs == {"fused": 1, "general": 0}


@pytest.mark.parametrize("recipe", ["fp8ref", "compressed-tensors"])
@pytest.mark.parametrize("gran,extra", [("channel", {}), ("block", {"block_shape": (128, 128)})])
def test_zero_blocks_give_the_general_paths_bytes(monkeypatch, runs, recipe, gran, extra):
    qa = QuantArgs(granularity=gran, recipe=recipe, **extra)
    x = weight((256, 256), torch.bfloat16)
    x[:128, :128] = 0  # an amax of 0
    x[200] = -0.0
    c_general, numpy_path = reference(monkeypatch, x, qa, torch.uint8)
    same(c_general, numpy_path)
    runs.update(fused=0, general=0)
    same(quantize(x, qa, out=torch.empty(x.shape, dtype=torch.uint8)), c_general)
    assert runs == {"fused": 1, "general": 0}  # both recipes' loops take a zero amax's operand


def test_nonfinite_input_refused_or_coded_as_the_general_path(monkeypatch, runs):
    x = weight((128, 256), torch.bfloat16)
    x[5, 7] = float("nan")
    with pytest.raises(EncodeError, match=r"first at index \(5, 7\)"):
        quantize(x, QuantArgs(granularity="channel"), out=torch.empty(x.shape, dtype=torch.uint8))
    assert runs == {"fused": 2, "general": 1}  # an amax the recipe refuses: the general path says so
    qa = QuantArgs(granularity="channel", recipe="compressed-tensors")
    c_general, numpy_path = reference(monkeypatch, x, qa, torch.uint8)
    same(c_general, numpy_path)
    runs.update(fused=0, general=0)
    same(quantize(x, qa, out=torch.empty(x.shape, dtype=torch.uint8)), c_general)
    assert runs == {"fused": 1, "general": 0}  # a recipe that codes NaN


def test_calls_the_short_path_does_not_take_are_checked_as_before(runs):
    x = weight((128, 256), torch.bfloat16)
    qa = QuantArgs(granularity="channel")
    with pytest.raises(InputTypeError, match="overlaps x"):
        quantize(x, qa, out=x.view(torch.uint8).view(-1)[128:128 * 257].view(128, 256))
    with pytest.raises(InputTypeError, match="shape"):
        quantize(x, qa, out=torch.empty((128, 255), dtype=torch.uint8))
    with pytest.raises(InputTypeError, match="requires grad"):
        quantize(x, qa, out=torch.empty(x.shape, dtype=torch.float8_e4m3fn, requires_grad=True))
    runs.update(fused=0, general=0)
    want = quantize(x, qa).codes  # no out=: the general path
    runs.update(fused=0, general=0)
    for x2 in [torch.nn.Parameter(x.clone()), x.t().contiguous().t(), x.clone().requires_grad_()]:
        assert torch.equal(quantize(x2, qa, out=torch.empty(x.shape, dtype=torch.uint8)).codes, want)
    assert runs == {"fused": 3, "general": 2}  # a subclass and a non-contiguous input; requires_grad is read as is


def test_the_loops_scales_and_count_of_codes_not_final():
    """run_fused against the tables it reads: scale = stored[amax bits], the count = groups not final"""
    rec, fmt = quant.get_recipe("fp8ref"), quant.get_format("float8_e4m3fn")
    qa = QuantArgs(granularity="block", block_shape=(64, 64))
    x = weight((256, 256), torch.bfloat16)
    x[:64, :128] = 0  # two blocks of amax 0
    x[70, 3], x[200, 255] = float("inf"), float("-nan")
    plan = _native_quant.fused_plan("bfloat16", qa, rec, fmt, (256, 256), *quant._modes("bfloat16", qa, rec, fmt))
    out = torch.empty(x.shape, dtype=torch.uint8)
    bits, scale = np.empty(plan.groups, np.uint16), np.empty(plan.groups, np.float32)
    not_final = _native_quant.run_fused(plan, x.data_ptr(), out.data_ptr(), scale.ctypes.data, bits.ctypes.data,
                                        x.numel(), False, (x, out, bits, scale))
    _, final, stored, _ = plan.tables
    assert scale.tobytes() == stored[bits].tobytes()
    assert not_final == int(np.count_nonzero(final[bits] == 0)) >= 2  # the two non-finite blocks at least
