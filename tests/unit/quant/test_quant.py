"""quantize / dequantize / fake_quant: exact-rational oracle, API contract, bad input."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch

from fp8ref import quant
from fp8ref.codec import decode
from fp8ref.errors import EncodeError, Fp8RefError, InputTypeError, RecipeError, ScaleError, ShapeError
from fp8ref.formats import FORMATS
from fp8ref.quant import QuantArgs, QuantResult, dequantize, fake_quant, quantize
from tests.support import oracle
from tests.support.quant_oracle import exact_code, fp32_nearest, oracle_codes

E4M3 = FORMATS["float8_e4m3fn"]
MODES = ("rne", "rna", "rtz", "rup", "rdown", "rto")


def bf16(a) -> torch.Tensor:
    return torch.as_tensor(np.asarray(a, np.float32)).to(torch.bfloat16)


def rng_weights(shape, seed=0, dtype=torch.bfloat16, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


# --- the fp8ref recipe is the exact quotient rounded once ----------------------------------------
@pytest.mark.parametrize("gran,extra", [("tensor", {}), ("channel", {}), ("token", {}),
                                        ("group", {"group_size": 24}), ("block", {"block_shape": (16, 32)})])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fp8ref_codes_are_the_exact_quotient_rounded_once(gran, extra, dtype):
    x = rng_weights((40, 72), seed=3, dtype=dtype)
    q = quantize(x, QuantArgs(granularity=gran, **extra))
    s = quant.expand(q.scale.numpy().astype(np.float64), tuple(x.shape), gran, **extra)
    want = oracle_codes(x.double().numpy(), s, E4M3)
    assert np.array_equal(q.codes.numpy(), want)
    # the scale is fp32(amax / 448) rounded once
    amax = quant.reduce_amax(x.double().numpy(), gran, **extra)
    expect = np.vectorize(lambda a: fp32_nearest(Fraction(float(a)) / 448))(amax)
    assert np.array_equal(q.scale.numpy().astype(np.float64), expect)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("saturate", [True, False])
@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float4_e2m1fn"])
def test_quotients_next_to_decision_points(mode, saturate, fmt):
    """x = d*s*(1 +- tiny) for every midpoint/grid point d: the fp32 quotient snaps onto d, the
    exact one does not (the double rounding fp8ref must avoid), plus exact hits and overflow."""
    f = FORMATS[fmt]
    mags = [float(m) for m in oracle.grid(f).mags]
    points = sorted(set(mags + [(a + b) / 2 for a, b in zip(mags, mags[1:], strict=False)]))
    s = np.float32(0.0029296875 * (1 + 2 ** -20))  # 24 significant bits
    xs = []
    for d in points:
        base = np.float32(d * float(s))
        xs += [base, np.nextafter(base, np.float32(np.inf)), np.nextafter(base, np.float32(-np.inf))]
    x = np.array(xs + [-v for v in xs] + [0.0, -0.0], np.float32).reshape(1, -1)
    q = quantize(x, QuantArgs(format=fmt, granularity="tensor", rounding=mode, saturate=saturate,
                              dynamic=False), scale=np.array([s]))
    assert np.array_equal(q.codes, oracle_codes(x, s, f, saturate=saturate, rounding=mode))


def test_fp32_division_double_rounds_where_fp8ref_does_not():
    """Evidence for the exact path: on bf16 weights torch's fp32 x/s then e4m3 differs from the
    exact quotient; fp8ref agrees with the Fraction oracle on those elements."""
    x = rng_weights((64, 256), seed=1, scale=0.02)
    q = quantize(x, QuantArgs(granularity="channel"))
    s = q.scale
    via_fp32 = (x.float() / s).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    differ = (via_fp32 != q.codes).nonzero().tolist()
    assert differ, "expected some double-rounded elements in the fp32 pipeline"
    for i, j in differ:
        assert q.codes[i, j].item() == exact_code(Fraction(x[i, j].item()) / Fraction(s[i, 0].item()), E4M3)


def test_float64_input_is_rounded_once():
    x = np.array([[1 + 2 ** -4 + 2 ** -30, -431.99999999999994, 3.0, 448.0]])
    q = quantize(x, QuantArgs(granularity="tensor", dynamic=False), scale=np.array([1.0]))
    assert list(decode(q.codes, E4M3)[0]) == [1.125, -416.0, 3.0, 448.0]


# --- numpy and torch, result object -------------------------------------------------------------
def test_numpy_and_torch_give_the_same_bytes_and_library():
    x = rng_weights((8, 64), seed=2)
    qt = quantize(x, QuantArgs(granularity="channel"), recipe="compressed-tensors")
    import ml_dtypes
    xn = x.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    qn = quantize(xn, QuantArgs(granularity="channel"), recipe="compressed-tensors")
    assert isinstance(qt.codes, torch.Tensor) and qt.codes.dtype == torch.uint8
    assert isinstance(qn.codes, np.ndarray) and qn.codes.dtype == np.uint8
    assert np.array_equal(qt.codes.numpy(), qn.codes)
    assert qt.scale.dtype == torch.bfloat16 and qn.scale.dtype.name == "bfloat16"
    assert np.array_equal(qt.scale.view(torch.int16).numpy(), qn.scale.view(np.int16))
    assert (qt.format, qt.granularity, qt.recipe, qt.scale_dtype) == (
        "float8_e4m3fn", "channel", "compressed-tensors", "bfloat16")


def test_result_is_frozen():
    q = quantize(np.ones((2, 2), np.float32), QuantArgs())
    assert isinstance(q, QuantResult)
    with pytest.raises(AttributeError):
        q.scale = None


def test_result_does_not_depend_on_chunking(monkeypatch):
    x = rng_weights((33, 70), seed=5)
    args = QuantArgs(granularity="group", group_size=16)
    whole = quantize(x, args)
    monkeypatch.setattr(quant, "_ROWS_ELEMENTS", 70)  # one row per chunk, threads interleave
    assert torch.equal(quantize(x, args).codes, whole.codes)


def test_dequantize_is_the_exact_product_rounded_once():
    x = rng_weights((8, 32), seed=6, dtype=torch.float32)
    q = quantize(x, QuantArgs(granularity="channel"))
    d64 = dequantize(q, dtype="float64").numpy()
    vals = decode(q.codes.numpy(), E4M3).astype(np.float64)
    for i in np.ndindex(d64.shape):
        assert Fraction(float(d64[i])) == Fraction(float(vals[i])) * Fraction(float(q.scale[i[0], 0]))
    d16 = dequantize(q, dtype="bfloat16")
    assert d16.dtype == torch.bfloat16
    assert torch.equal(d16, torch.from_numpy(d64).to(torch.bfloat16))  # exact product: no double rounding


def test_fake_quant_keeps_the_dtype_and_matches_quantize_dequantize():
    x = rng_weights((4, 64), seed=7)
    args = QuantArgs(granularity="token")
    out = fake_quant(x, args, recipe="compressed-tensors")
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    assert torch.equal(out, dequantize(quantize(x, args, recipe="compressed-tensors"), dtype="bfloat16"))


# --- declared zero / NaN / Inf behaviour ------------------------------------------------------
def test_zero_amax_per_recipe():
    """REFERENCE.md 3.5, each expected scale computed with torch in the producer's dtypes."""
    z = torch.zeros(2, 16, dtype=torch.bfloat16)
    f32 = torch.float32
    expected = {
        "fp8ref": torch.tensor(1.0, dtype=f32),
        "compressed-tensors": torch.tensor(2.0 ** -7, dtype=torch.bfloat16),      # eps(bf16)
        "hf-fp8": torch.tensor(1.0, dtype=f32),                                   # scale_inv 1
        "auto-round": torch.tensor(1 / 229376, dtype=f32).to(torch.bfloat16),    # bf16(fp32 floor)
        "fbgemm": torch.tensor(1.0) / (torch.tensor(448.0) / torch.tensor(1e-12)),  # 1/m, amax >= 1e-12
    }
    for rec, want in expected.items():
        args = QuantArgs(granularity="tensor" if rec == "hf-fp8" else "channel")
        q = quantize(z, args, recipe=rec)
        assert q.scale.dtype == want.dtype, rec
        assert torch.equal(q.scale.reshape(-1), want.expand(q.scale.numel())), rec
        assert not q.codes.any(), rec


def test_fp8ref_rejects_nan_and_inf_naming_x():
    x = np.ones((3, 4), np.float32)
    x[1, 2] = np.nan
    msg = r"x: recipe 'fp8ref' needs finite values, got 1 NaN/Inf \(first at index \(1, 2\)\)"
    with pytest.raises(EncodeError, match=msg):
        quantize(x, QuantArgs(granularity="channel"))
    x[1, 2] = np.inf
    with pytest.raises(EncodeError, match="first at index"):
        quantize(x, QuantArgs(granularity="mx", format="float8_e4m3fn"))


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_fp8ref_rejects_nan_x_with_a_given_amax(dtype):
    """A calibrated amax says nothing about x: x is still checked (it was encoded as +-448)."""
    x = np.ones((4, 600), dtype)
    x[1, 3] = np.nan
    with pytest.raises(EncodeError, match=r"first at index \(1, 3\)"):
        quantize(x, QuantArgs(dynamic=False), amax=np.array([2.0]))
    with pytest.raises(EncodeError, match=r"first at index \(1, 3\)"):
        quantize(x, QuantArgs(granularity="channel", dynamic=False), amax=np.full((4, 1), 2.0))


def test_producer_recipes_propagate_nan_like_torch():
    """compressed-tensors: a NaN row gets a NaN scale and NaN codes; the other rows are normal."""
    x = rng_weights((3, 8), seed=8)
    x[1, 3] = float("nan")
    q = quantize(x, QuantArgs(granularity="channel"), recipe="compressed-tensors")
    assert torch.isnan(q.scale[1, 0])
    assert set(q.codes[1].tolist()) <= {0x7F, 0xFF}
    scale = x.abs().amax(dim=1, keepdim=True) / 448.0   # the producer's own ops
    ref = (x / scale + 0.0).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(q.codes[[0, 2]], ref[[0, 2]])


# --- bad input ------------------------------------------------------------------------------
def test_static_quantization_needs_a_scale():
    with pytest.raises(ScaleError, match="scale: static quantization"):
        quantize(np.ones((2, 4), np.float32), QuantArgs(dynamic=False))


@pytest.mark.parametrize("bad", [0.0, -1.0, np.nan, np.inf])
def test_bad_scale_values(bad):
    with pytest.raises(ScaleError, match=r"scale: expected positive finite scales, got .* at index \(1, 0\)"):
        quantize(np.ones((2, 4), np.float32), QuantArgs(granularity="channel", dynamic=False),
                 scale=np.array([[1.0], [bad]]))


def test_scale_of_the_wrong_shape_names_given_and_expected():
    with pytest.raises(ShapeError, match=r"scale: expected shape \(2, 1\) .* got \(3, 1\)"):
        quantize(np.ones((2, 4), np.float32), QuantArgs(granularity="channel", dynamic=False),
                 scale=np.ones((3, 1)))


def test_producer_scale_shapes_are_accepted():
    """auto-round's [out] and HF's [] load like (out, 1) and (1,)."""
    x = np.ones((3, 4), np.float32)
    a = quantize(x, QuantArgs(granularity="channel", dynamic=False), scale=np.ones(3))
    b = quantize(x, QuantArgs(granularity="tensor", dynamic=False), scale=np.float32(1.0))
    assert a.scale.shape == (3, 1) and b.scale.shape == (1,)


def test_non_divisible_where_the_recipe_requires_it():
    with pytest.raises(ShapeError, match=r"x: recipe 'hf-fp8' requires the block \(128, 128\) to divide the shape; "
                                         r"got shape \(64, 256\)"):
        quantize(np.ones((64, 256), np.float32), QuantArgs(granularity="block", block_shape=(128, 128)),
                 recipe="hf-fp8")


def test_unknown_recipe_and_unsupported_granularity():
    with pytest.raises(RecipeError, match=r"unknown recipe 'compresed-tensors'; did you mean 'compressed-tensors'"):
        quantize(np.ones(4, np.float32), QuantArgs(), recipe="compresed-tensors")
    with pytest.raises(RecipeError, match=r"recipe 'hf-fp8': granularity 'channel'"):
        quantize(np.ones((2, 4), np.float32), QuantArgs(granularity="channel"), recipe="hf-fp8")
    with pytest.raises(RecipeError, match=r"format 'float8_e5m2' is not one the producer writes"):
        quantize(np.ones((2, 4), np.float32), QuantArgs(format="float8_e5m2"), recipe="auto-round")


@pytest.mark.parametrize("x,match", [
    (np.ones(4, np.int32), "x: expected float16, bfloat16, float32 or float64, got numpy int32"),
    ([1.0, 2.0], "x: expected a numpy array or a torch CPU tensor, got list"),
    (torch.ones(4, dtype=torch.int8), "got torch.int8")])
def test_wrong_input_types(x, match):
    with pytest.raises(InputTypeError, match=match):
        quantize(x, QuantArgs())


@pytest.mark.parametrize("kw,match", [
    ({"granularity": "row"}, "granularity: expected one of"),
    ({"granularity": "group"}, "group_size: granularity 'group' needs a positive int, got None"),
    ({"granularity": "block", "block_shape": (128,)}, "block_shape: expected two positive ints"),
                                      ({"rounding": "stochastic"}, "stochastic rounding: use fp8ref.encode"),
                                      ({"format": "float8_e4m3"}, "unknown format"),
                                      ({"mx_rule": "ceil"}, "mx_rule: expected one of floor, rceil")])
def test_bad_args(kw, match):
    with pytest.raises(Fp8RefError, match=match):
        QuantArgs(**kw)


def test_scale_and_amax_together_is_an_error():
    with pytest.raises(InputTypeError, match="scale, amax: give one of them"):
        quantize(np.ones(4, np.float32), QuantArgs(), scale=np.ones(1), amax=np.ones(1))


# --- schemes --------------------------------------------------------------------------------
def test_quantize_accepts_a_quantization_scheme():
    from fp8ref.scheme import PRESETS
    x = rng_weights((4, 256), seed=9)
    w = quantize(x, PRESETS["FP8_DYNAMIC"])
    assert (w.granularity, w.recipe) == ("channel", PRESETS["FP8_DYNAMIC"]["recipe"])
    a = quantize(x[None], PRESETS["FP8_DYNAMIC"], role="activation")
    assert a.granularity == "token" and tuple(a.scale.shape) == (1, 4, 1)
    s = PRESETS["FP8_STATIC"]
    with pytest.raises(ScaleError, match="static quantization"):
        quantize(x, s, role="activation")


# --- MX and NVFP4 ---------------------------------------------------------------------------
def test_mx_floor_rule_clips_like_microxcaling():
    """microxcaling test_fp8_e4m3_fix: 485 -> 448, 475 -> 448, 400 -> 416 (ties away), -450 -> -448."""
    x = np.zeros((1, 32), np.float32)
    x[0, :4] = [485, 475, 400, -450]
    q = quantize(x, QuantArgs(granularity="mx", rounding="rna"))
    assert q.scale_codes[0, 0] == 127 and q.scale[0, 0] == 1.0
    assert list(decode(q.codes, E4M3)[0, :4]) == [448, 448, 416, -448]


def _floor_log2(v: Fraction) -> int:
    e = v.numerator.bit_length() - v.denominator.bit_length()
    return e if Fraction(2) ** e <= v else e - 1


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2", "float6_e2m3fn", "float6_e3m2fn", "float4_e2m1fn"])
@pytest.mark.parametrize("rule", ["floor", "rceil"])
def test_mx_against_the_definition(fmt, rule):
    f = FORMATS[fmt]
    x = rng_weights((3, 70), seed=10, dtype=torch.float32).numpy() * 3
    x[2, 32:64] = 0.0                                   # a zero block -> 2**-127
    q = quantize(x, QuantArgs(format=fmt, granularity="mx", mx_rule=rule))
    for r in range(3):
        for b in range(3):
            blk = x[r, 32 * b:32 * b + 32]
            amax = Fraction(float(np.abs(blk).max()))
            if amax == 0:
                e = -127
            elif rule == "floor":                       # OCP: floor(log2 amax) - emax_elem
                e = _floor_log2(amax) - f.emax
            else:                                       # smallest 2**e with amax / 2**e <= max_elem
                e = _floor_log2(amax / Fraction(f.max))
                e = e if amax / Fraction(2) ** e <= Fraction(f.max) else e + 1
                assert amax / Fraction(2) ** (e - 1) > Fraction(f.max)  # nothing clips, and e is minimal
            assert q.scale_codes[r, b] == e + 127, (r, b)
            assert q.scale[r, b] == 2.0 ** e
            assert np.array_equal(q.codes[r, 32 * b:32 * b + 32], oracle_codes(blk, np.float64(2.0 ** e), f))


@pytest.mark.parametrize("x,why", [(np.zeros((2, 32), np.float32), r"the tensor amax is 0, and 0/0 is NaN"),
                                   (np.array([[np.nan] + [1.0] * 31, [1.0] * 32], np.float32), "x holds NaN or Inf")])
def test_nvfp4_nan_block_scales_are_refused_with_their_cause(x, why):
    """ModelOpt's NVFP4 global scale of a zero amax is 0/0, so every block scale is NaN, and FP4 has
    no NaN code: the error says so (it said "x holds 64 NaN value(s)" of an all-zero x)."""
    with pytest.raises(EncodeError, match=rf"recipe 'modelopt-nvfp4' gives 4 of 4 block scale\(s\) that are "
                                          rf"non-finite \(.*{why}.*float4_e2m1fn has no NaN code"):
        quantize(x, QuantArgs(granularity="nvfp4", format="float4_e2m1fn"), recipe="modelopt-nvfp4")


def test_nvfp4_two_levels():
    e2m1 = FORMATS["float4_e2m1fn"]
    x = rng_weights((2, 48), seed=11, dtype=torch.float32).numpy()
    x[1, 16:32] = 1e-30                                  # its block scale rounds to 0: codes are +0
    q = quantize(x, QuantArgs(format="float4_e2m1fn", granularity="nvfp4"))
    amax_t = float(np.abs(x).max())
    assert q.global_scale[0] == fp32_nearest(Fraction(amax_t) / 2688)
    g = Fraction(float(q.global_scale[0]))
    for r in range(2):
        for b in range(3):
            blk = x[r, 16 * b:16 * b + 16]
            sc = exact_code(Fraction(float(np.abs(blk).max())) / (6 * g), E4M3)
            assert q.scale_codes[r, b] == sc
            s_blk = Fraction(float(decode(np.array([sc], np.uint8), E4M3)[0]))
            want = [0 if s_blk == 0 else exact_code(Fraction(float(v)) / (s_blk * g), e2m1) for v in blk]
            assert list(q.codes[r, 16 * b:16 * b + 16]) == want


def test_a_given_scale_is_returned_in_its_own_dtype_and_nan_x_still_rejected():
    x = np.ones((2, 4), np.float32)
    q = quantize(x, QuantArgs(dynamic=False), recipe="compressed-tensors", scale=np.array([0.0123], np.float32))
    assert q.scale_dtype == "float32" and q.scale[0] == np.float32(0.0123)  # not cut to the model dtype
    x[0, 1] = np.inf
    with pytest.raises(EncodeError, match=r"first at index \(0, 1\)"):
        quantize(x, QuantArgs(dynamic=False), scale=np.array([1.0]))


@pytest.mark.parametrize("scale_dtype", ["float32", "bfloat16", "float16"])
def test_scheme_scale_dtype_decides_the_stored_scale(scale_dtype):
    """compressed-tensors stores its scale in the model dtype by default; a scheme's scale_dtype
    replaces that: the same float32 scale, rounded once (RNE) to the asked dtype."""
    import ml_dtypes

    from fp8ref.scheme import PRESETS

    x = np.linspace(-3.3, 5.7, 64, dtype=np.float32).reshape(4, 16).astype(ml_dtypes.bfloat16)
    base = PRESETS["FP8_DYNAMIC"].replace(scale_dtype="float32")
    s32 = np.asarray(quantize(x, base, recipe="compressed-tensors").scale, np.float32)
    q = quantize(x, PRESETS["FP8_DYNAMIC"].replace(scale_dtype=scale_dtype), recipe="compressed-tensors")
    want = {"float32": s32, "bfloat16": s32.astype(ml_dtypes.bfloat16).astype(np.float32),
            "float16": s32.astype(np.float16).astype(np.float32)}[scale_dtype]
    assert q.scale_dtype == scale_dtype
    assert np.asarray(q.scale).astype(np.float32).tobytes() == want.tobytes()
