"""fp8ref.matmul's records and registry: Accumulation / Output records give the bytes of the keyword
form, a registered model plugs in by name, and linear's activations go through a recipe."""

from __future__ import annotations

import numpy as np
import pytest

from fp8ref import FORMATS, encode
from fp8ref.errors import EncodeError, InputTypeError
from fp8ref.matmul import (
    ACCUMULATION_MODELS,
    ACCUMULATIONS,
    Accumulation,
    Output,
    linear,
    register_accumulation,
    scaled_mm,
)
from fp8ref.matmul import models as mm_models

E4M3 = FORMATS["float8_e4m3fn"]
f32 = np.float32


def operands(seed=0, M=5, K=300, N=7):
    rng = np.random.default_rng(seed)
    a = encode(rng.standard_normal((M, K)).astype(f32), E4M3)
    b = encode(rng.standard_normal((K, N)).astype(f32), E4M3)
    return a, b, rng.uniform(0.5, 2, (M, 3)).astype(f32), rng.uniform(0.5, 2, (3, 1)).astype(f32)


def test_builtin_models_registered():
    assert ACCUMULATIONS == ("exact", "fp32", "fp32-limited")
    assert set(ACCUMULATIONS) <= set(ACCUMULATION_MODELS)


@pytest.mark.parametrize("acc, kw", [
    (Accumulation("exact"), {}),
    (Accumulation("fp32", block_k=64, scale_order="operands"), {"accumulate": "fp32", "scale_order": "operands"}),
    (Accumulation("fp32-limited", promote_every=32, mantissa_bits=10),
     {"accumulate": "fp32-limited", "promote_every": 32, "mantissa_bits": 10}),
])
def test_accumulation_record_equals_keywords(acc, kw):
    a, b, _, _ = operands()
    rng = np.random.default_rng(9)
    sa, sb = rng.uniform(0.5, 2, (a.shape[0], 1)).astype(f32), rng.uniform(0.5, 2, (1, b.shape[1])).astype(f32)
    block = {"block_k": acc.block_k} if acc.block_k else {}  # per-row scales: block_k is the fp32 K-block only
    by_record = scaled_mm(a, b, sa, sb, accumulate=acc, out_dtype="bfloat16")
    by_keywords = scaled_mm(a, b, sa, sb, out_dtype="bfloat16", **block, **kw)
    np.testing.assert_array_equal(by_record.view(np.uint16), by_keywords.view(np.uint16))


@pytest.mark.parametrize("model", ACCUMULATIONS)
def test_output_record_equals_keywords(model):
    a, b, sa, sb = operands(1)
    out = Output("float8_e5m2", saturate=False, rounding="rtz", scale_result=f32(3.0), scale_result_op="multiply")
    by_record = scaled_mm(a, b, sa, sb, accumulate=model, output=out)
    by_keywords = scaled_mm(a, b, sa, sb, accumulate=model, out_dtype="float8_e5m2", saturate=False, rounding="rtz",
                            scale_result=f32(3.0), scale_result_op="multiply")
    np.testing.assert_array_equal(by_record, by_keywords)


def test_record_and_keyword_together_refused():
    a, b, sa, sb = operands()
    with pytest.raises(InputTypeError, match="scale_order: give it in the Accumulation record"):
        scaled_mm(a, b, sa, sb, accumulate=Accumulation("fp32"), scale_order="operands")
    with pytest.raises(InputTypeError, match="out_dtype: give it in the Output record"):
        scaled_mm(a, b, sa, sb, output=Output("float16"), out_dtype="bfloat16")
    with pytest.raises(InputTypeError, match="accumulate: expected one of"):
        Accumulation("fp64")


def test_registered_model_plugs_in():
    calls = []

    class Doubled:  # a toy model: twice the exact result (rounded once: exact * 2 is exact)
        name = "test-doubled"
        rounds_once = True

        def __call__(self, ca, cb, fa, fb, sa, sb, bk, bias, out, acc):
            calls.append(acc)
            return 2 * ACCUMULATION_MODELS["exact"](ca, cb, fa, fb, sa, sb, bk, bias, out, acc)

    register_accumulation(Doubled())
    try:
        a, b, sa, sb = operands(2)
        got = scaled_mm(a, b, sa, sb, accumulate="test-doubled")
        np.testing.assert_array_equal(got, 2 * scaled_mm(a, b, sa, sb))
        assert calls and calls[0].model == "test-doubled"
        with pytest.raises(InputTypeError, match="already registered"):
            register_accumulation(Doubled())
    finally:
        mm_models._MODELS.pop("test-doubled")
    assert "test-doubled" not in ACCUMULATION_MODELS


def test_linear_activations_follow_the_given_recipe():
    # vllm-dynamic: s = max(fp32(amax / 448), 1/229376), q = e4m3(clamp(fp32(x / s))), written out here
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((4, 16)) * np.array([[1.0], [1e-5], [3.0], [1e-6]])).astype(f32)
    w = encode(rng.standard_normal((3, 16)).astype(f32), E4M3)
    ws = rng.uniform(0.01, 0.1, (3, 1)).astype(f32)
    got = linear(x, w, ws, dynamic="token", input_recipe="vllm-dynamic")
    amax = np.abs(x).max(axis=1, keepdims=True)
    s = np.maximum((amax / f32(448)).astype(f32), f32(1 / 229376))
    assert (s == f32(1 / 229376)).any()  # the floor is exercised
    q = encode(np.clip((x / s).astype(f32), -448, 448), E4M3)
    want = scaled_mm(q, np.ascontiguousarray(w.T), s, ws.reshape(1, 3))
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    default = linear(x, w, ws, dynamic="token")  # no floor: differs where the floor applied
    assert not np.array_equal(default.view(np.uint32), got.view(np.uint32))


def test_linear_dynamic_nonfinite_activations_refused():
    x = np.array([[1.0, np.nan, 2.0, 3.0]], f32)
    w = np.zeros((2, 4), np.uint8)
    with pytest.raises(EncodeError, match="x: recipe 'fp8ref-linear' needs finite values"):
        linear(x, w, f32(1), dynamic="tensor")
    y = linear(x, w, f32(1), input_scale=f32(1))  # static: NaN reaches the product, as torch's would
    assert np.isnan(y).all()


def test_activation_recipe_is_a_valid_recipe():
    # declared in code, so checked here against the vocabulary the YAML loader enforces
    from dataclasses import fields

    from fp8ref import recipes
    from fp8ref.matmul import ACTIVATION_RECIPE
    for f in fields(ACTIVATION_RECIPE):
        if f.name in recipes._CHOICES:
            assert getattr(ACTIVATION_RECIPE, f.name) in recipes._CHOICES[f.name], f.name
    assert set(ACTIVATION_RECIPE.formats) <= set(FORMATS)


@pytest.mark.parametrize("dynamic", ["tensor", "token", "group"])
def test_linear_default_activation_rule_written_out(dynamic):
    # s = fp32(amax) / fp32(448) per tensor / row / 1x8 group, 1.0 where amax == 0; q = e4m3(fp32(x / s))
    rng = np.random.default_rng(4)
    x = rng.standard_normal((3, 20)).astype(f32)
    x[1] = 0.0  # a zero row: its token/group scales are 1
    w = encode(rng.standard_normal((4, 20)).astype(f32), E4M3)
    ws = rng.uniform(0.01, 0.1, (4,)).astype(f32)
    got = linear(x, w, ws, dynamic=dynamic, block_k=8)
    ax = np.abs(x)
    if dynamic == "tensor":
        amax = ax.max().reshape(1, 1)
    elif dynamic == "token":
        amax = ax.max(axis=1, keepdims=True)
    else:
        amax = np.pad(ax, ((0, 0), (0, 4))).reshape(3, 3, 8).max(axis=2)
    s = np.where(amax == 0, f32(1), (amax / f32(448)).astype(f32)).astype(f32)
    s_full = s if dynamic != "group" else np.repeat(s, 8, axis=1)[:, :20]
    q = encode((x / s_full).astype(f32), E4M3)
    want = scaled_mm(q, np.ascontiguousarray(w.T), s.reshape(1) if dynamic == "tensor" else s, ws.reshape(1, 4),
                     block_k=8)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
