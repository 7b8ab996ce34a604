"""fp8ref.calibrate: observers as folds (order independence, shard merging), finalize, torch hooks."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from fp8ref.calibrate import (
    AmaxState,
    amax_state,
    calibrate_input_scales,
    finalize,
    merge,
    observe,
    observe_linear_inputs,
)
from fp8ref.errors import InputTypeError, ScaleError, ShapeError, SpecError

K = 6
arrays = hnp.arrays(np.float32, st.tuples(st.integers(0, 4), st.just(K)),
                    elements=st.floats(-(2.0 ** 100), 2.0 ** 100, width=32, allow_subnormal=True))
GRANS = [("tensor", None), ("channel", None), ("group", 4)]


def fold(state, xs):
    for x in xs:
        state = observe(state, x)
    return state


@settings(max_examples=60, deadline=None)
@given(st.lists(arrays, min_size=1, max_size=5), st.sampled_from(GRANS), st.randoms())
def test_fold_is_order_independent_and_merge_equals_concatenation(xs, gran, rnd):
    empty = amax_state(gran[0], group_size=gran[1])
    whole = observe(empty, np.concatenate(xs))
    shuffled = list(xs)
    rnd.shuffle(shuffled)
    assert np.array_equal(fold(empty, xs).amax, whole.amax)
    assert np.array_equal(fold(empty, shuffled).amax, whole.amax)
    cut = rnd.randint(0, len(xs))
    shards = merge(fold(empty, xs[:cut]), fold(empty, xs[cut:]))
    assert np.array_equal(shards.amax, whole.amax) and shards.count == len(xs)


def test_amax_per_granularity_against_python():
    x = np.array([[1.0, -7.0, 2.0, 0.5, 3.0], [-4.0, 1.0, 0.0, -9.0, 2.5]], np.float32)
    assert observe(amax_state(), x).amax == 9.0
    assert list(observe(amax_state("channel"), x).amax) == [4.0, 7.0, 2.0, 9.0, 3.0]
    assert list(observe(amax_state("group", group_size=2), x).amax) == [7.0, 9.0, 3.0]


def test_state_is_immutable_and_observe_returns_a_new_state():
    s0 = amax_state()
    s1 = observe(s0, np.ones(3, np.float32))
    assert s0.amax is None and s1.amax == 1.0
    with pytest.raises(ValueError):
        s1.amax[...] = 5.0
    with pytest.raises(AttributeError):
        s1.count = 3


def test_bf16_torch_input_is_exact():
    x = torch.tensor([1.0, -3.015625, 2.0], dtype=torch.bfloat16)  # 3.015625 is a bf16 value
    assert observe(amax_state(), x).amax == 3.015625


@pytest.mark.parametrize("amax", [448.0, 1.0, 3.0e-5, 2.0 ** -140])
def test_finalize_is_one_correctly_rounded_fp32_division(amax):
    got = finalize(AmaxState("tensor", None, np.float64(amax), 1))
    exact = Fraction(amax) / 448
    lo = np.float32(float(exact))
    candidates = [np.nextafter(lo, np.float32(-1)), lo, np.nextafter(lo, np.float32(1))]
    best = min(candidates, key=lambda c: (abs(Fraction(float(c)) - exact), int(np.float32(c).view(np.uint32)) & 1))
    assert got.dtype == np.float32 and got == best


def test_finalize_scale_fn_and_errors():
    s = observe(amax_state(), np.zeros(3, np.float32))
    with pytest.raises(ScaleError, match="amax is 0"):
        finalize(s)
    floor = np.float32(1 / 229376)
    got = finalize(s, scale_fn=lambda amax, fmt: np.maximum((amax / fmt.max).astype(np.float32), floor))
    assert got == floor
    with pytest.raises(ScaleError, match="no tensor"):
        finalize(amax_state())
    with pytest.raises(ScaleError, match="nan"):
        finalize(observe(s, np.array([np.nan], np.float32)))
    with pytest.raises(InputTypeError, match="dtype"):
        finalize(observe(amax_state(), np.ones(2, np.float32)), dtype="bfloat16")


def test_bad_states_and_inputs():
    with pytest.raises(InputTypeError, match="granularity.*'row'"):
        amax_state("row")
    with pytest.raises(InputTypeError, match="group_size"):
        amax_state("group")
    with pytest.raises(InputTypeError, match="x: .*int32"):
        observe(amax_state(), np.ones(3, np.int32))
    with pytest.raises(ShapeError, match=r"\(4,\).*\(3,\)"):
        observe(observe(amax_state("channel"), np.ones((2, 4), np.float32)), np.ones((2, 3), np.float32))
    with pytest.raises(ShapeError, match="states\\[1\\]"):
        merge(amax_state("tensor"), amax_state("channel"))


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.q = torch.nn.Linear(4, 4)
        self.k = torch.nn.Linear(4, 4)
        self.out = torch.nn.Linear(4, 2)

    def forward(self, x, gain=1.0):
        return self.out(torch.relu(self.q(x) * gain + self.k(x)))


class Config:
    """Stands in for a LayerConfig: resolve(name) -> scheme or None."""

    def resolve(self, name):
        return {"scheme": "FP8_STATIC"} if name in ("q", "out") else None


def test_hooks_observe_selected_linears_and_leave_the_model_untouched():
    model = Tiny()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    batches = [torch.randn(3, 4), (torch.randn(2, 4),), {"x": torch.randn(5, 4), "gain": 2.0}]
    states = observe_linear_inputs(model, batches, Config())
    assert set(states) == {"q", "out"}
    inputs = {"q": [], "out": []}
    for b in batches:
        x, gain = (b["x"], b["gain"]) if isinstance(b, dict) else ((b[0] if isinstance(b, tuple) else b), 1.0)
        inputs["q"].append(x)
        with torch.no_grad():
            inputs["out"].append(torch.relu(model.q(x) * gain + model.k(x)))
    for name, xs in inputs.items():
        assert states[name].amax == max(float(x.abs().max()) for x in xs)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not any(m._forward_pre_hooks for m in model.modules())


def test_calibrate_input_scales_fuses_shards():
    model = Tiny()
    batches = [torch.randn(3, 4)]
    scales = calibrate_input_scales(model, batches, ["q", "k", "out"], fuse=[["q", "k"]])
    states = observe_linear_inputs(model, batches, lambda n: n in ("q", "k"))
    assert scales["q"] == scales["k"] == finalize(merge(states["q"], states["k"]))
    with pytest.raises(SpecError, match="'nope'"):
        calibrate_input_scales(model, batches, ["q", "nope"])
    with pytest.raises(ScaleError, match="saw no input.*'q'"):
        calibrate_input_scales(model, [], ["q"])
