"""A single mma() call runs the instruction's cached plan (fp8ref.hardware.native.Plan) once its
arguments are the plain case; every other argument still goes through the checked path: the same
one-line errors as before a plan existed, the same bytes for views, torch tensors and specials."""

from __future__ import annotations

import numpy as np
import pytest

from fp8ref._native import kernels_available
from fp8ref.errors import FormatError, Fp8RefError, InputTypeError, ShapeError
from fp8ref.hardware import instruction, mma, native
from fp8ref.hardware.instructions import _PLANS, dot_add

pytestmark = pytest.mark.skipif(not kernels_available(), reason="C kernels not built")
MFMA = ("mfma", "cdna3", "f32_16x16x32_fp8_fp8")
NVFP4 = ("tcgen05.mma", "blackwell", "m128n8k64.kind::mxf4nvf4.block16.f32.e2m1.e2m1.ue4m3")
F16 = ("wgmma", "hopper", "m64n8k32.f16.e4m3.e4m3")


def _operands(name, rng):
    ins = instruction(*name)
    fin_a = np.array([c for c in range(ins.a_fmt.n_codes) if ins.a_fmt.exact_value(c) is not None], np.uint8)
    A, B = rng.choice(fin_a, (ins.m, ins.k)), rng.choice(fin_a, (ins.k, ins.n))
    C = rng.standard_normal((ins.m, ins.n)).astype(ins.acc)
    S = ()
    if ins.scale_fmt is not None:
        nb = ins.k // ins.block
        S = tuple(rng.integers(0x30, 0x40, shape).astype(np.uint8) for shape in ((ins.m, nb), (nb, ins.n)))
    return ins, A, B, C, S


def _numpy(ins, A, B, C, S):
    return dot_add(ins, A[:, None, :], B.T[None], C, *((S[0][:, None, :], S[1].T[None]) if S else ()))


@pytest.mark.parametrize("name", [MFMA, NVFP4, F16], ids=lambda n: n[0])
def test_the_plan_runs_and_gives_the_models_bytes(name, monkeypatch):
    ins, A, B, C, S = _operands(name, np.random.default_rng(3))
    kw = dict(zip(("scale_a", "scale_b"), S))
    first = mma(*name, A, B, C, **kw)  # the checked path; it leaves the plan
    plan = _PLANS[name]
    calls = []
    run = native.Plan.__call__
    monkeypatch.setattr(native.Plan, "__call__", lambda self, *a: calls.append(1) or run(self, *a))
    second = mma(*name, A, B, C, **kw)
    assert calls  # the second call ran the plan
    u = np.uint32 if ins.acc == "float32" else np.uint16
    want = _numpy(ins, A, B, C, S).view(u)
    assert np.array_equal(first.view(u), want) and np.array_equal(second.view(u), want)
    assert plan(A, B, C, *(S or (None, None))) is not None  # the plain case is the plan's
    # views, Fortran order, a torch tensor: the same bytes (the plan copies views; torch takes the checked path)
    At, Bt, Ct = np.asfortranarray(A), B.T.copy().T, np.asfortranarray(C)
    assert np.array_equal(mma(*name, At, Bt, Ct, **kw).view(u), want)
    assert np.array_equal(mma(*name, A[:, ::-1][:, ::-1], B, C[::-1][::-1], **kw).view(u), want)
    torch = pytest.importorskip("torch")
    got = mma(*name, torch.from_numpy(A), torch.from_numpy(B), C, **kw)
    assert isinstance(got, torch.Tensor) and np.array_equal(got.numpy().view(u), want)


def test_the_switch_off_is_read_at_every_call_after_the_plan_exists(monkeypatch):
    """FP8REF_NO_KERNELS (read from os.environ's store on this path) turns the plan off at once."""
    ins, A, B, C, S = _operands(MFMA, np.random.default_rng(4))
    mma(*MFMA, A, B, C)
    calls = []
    monkeypatch.setattr(native, "chained_matmul", lambda *a: calls.append(1))  # the checked path's C loop
    run = native.Plan.__call__
    monkeypatch.setattr(native.Plan, "__call__", lambda self, *a: calls.append(2) or run(self, *a))
    monkeypatch.setenv("FP8REF_NO_KERNELS", "1")
    off = mma(*MFMA, A, B, C)
    assert calls == [1]  # no plan: the checked path (whose C loop declines: numpy)
    monkeypatch.setenv("FP8REF_NO_KERNELS", "")  # empty: not set, as os.environ.get reads it
    assert mma(*MFMA, A, B, C) is not None and calls == [1, 2]
    assert np.array_equal(off.view(np.uint32), _numpy(ins, A, B, C, S).view(np.uint32))


@pytest.mark.parametrize("name", [MFMA, NVFP4, F16], ids=lambda n: n[0])
def test_bad_input_after_the_plan_exists_is_the_same_one_line_error(name):
    ins, A, B, C, S = _operands(name, np.random.default_rng(4))
    kw = dict(zip(("scale_a", "scale_b"), S))
    mma(*name, A, B, C, **kw)
    assert name in _PLANS
    bad = [
        ((A.astype(np.int8), B, C), kw, InputTypeError, "a: expected a uint8 code array"),
        ((A, B[:, :-1], C), kw, ShapeError, "b: .* takes shape"),
        ((A, B, C.astype(np.float64)), kw, InputTypeError, "c: expected a float"),
        ((A, B, C[:-1]), kw, ShapeError, "c: .* takes shape"),
        ((A.tolist(), B, C), kw, InputTypeError, "a: expected a uint8 code array"),
    ]
    if S:
        bad += [((A, B, C), {}, InputTypeError, "scale_a and scale_b are required"),
                ((A, B, C), {"scale_a": S[0], "scale_b": S[1][:, :-1]}, ShapeError, "scale_b: .* takes shape")]
    else:
        bad.append(((A, B, C), {"scale_a": np.zeros((ins.m, 1), np.uint8)}, InputTypeError, "must be None"))
    if ins.a_fmt.bits < 8:
        A2 = A.copy()
        A2[3, 5] = 0x1F  # past e2m1's 16 codes: the loop flags it, the checked path names it
        bad.append(((A2, B, C), kw, FormatError, "a: float4_e2m1fn has 4-bit codes"))
    for args, kwargs, err, msg in bad:
        with pytest.raises(err, match=msg) as info:
            mma(*name, *args, **kwargs)
        assert isinstance(info.value, Fp8RefError) and "\n" not in str(info.value)


def test_specials_hand_over_to_the_numpy_model():
    ins, A, B, C, S = _operands(MFMA, np.random.default_rng(5))
    mma(*MFMA, A, B, C)
    A[2, 7] = 0x80  # the fnuz NaN
    C[0, 0] = np.inf
    assert _PLANS[MFMA](A, B, C, None, None) is None
    got = mma(*MFMA, A, B, C)
    assert np.array_equal(got.view(np.uint32), _numpy(ins, A, B, C, ()).view(np.uint32))
    assert np.isnan(got[2]).all()
