"""linear's edges in a bfloat16 model: a torch bfloat16 input is quantized from its own bits (no
float32 or float64 copy) and a bfloat16 output is built by torch's threads. Both must give the bytes
of the plain route they replace: the float32 values of the input through the same recipe, and
``f32_to_bf16_bits(values.astype(float32))`` for the output, checked on every bfloat16 pattern."""

from __future__ import annotations

import numpy as np
import pytest

from fp8ref import FORMATS
from fp8ref._arrays import deliver, f32_to_bf16_bits, numpy_bf16
from fp8ref.matmul import linear
from fp8ref.matmul.api import ACTIVATION_RECIPE, _activations, _input_recipe, _quantize_input
from fp8ref.recipes import Recipe, model_dtype_free
from fp8ref.registry import load_recipes

torch = pytest.importorskip("torch")

E4M3 = FORMATS["float8_e4m3fn"]
ALL = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)  # every bfloat16 bit pattern


def finite_rows(width: int = 256) -> np.ndarray:
    """Every finite bfloat16 pattern, in rows of ``width`` consecutive patterns (so the rows' amaxes
    run over every binade), plus an all-zero row and a row of -0."""
    exp = (ALL >> 7) & 0xFF
    bits = ALL[exp != 0xFF]
    bits = np.concatenate([bits, np.zeros(width, np.uint16), np.full(width, 0x8000, np.uint16)])
    return bits[: bits.size - bits.size % width].reshape(-1, width)


def as_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def quantized(x2, dynamic, recipe, input_scale=None):
    codes, scale = _quantize_input(x2, input_scale, dynamic, E4M3, 128, recipe)
    return np.asarray(codes), np.asarray(scale, np.float32)


def same_bytes(a, b):
    a, b = (np.ascontiguousarray(np.asarray(x)) for x in (a, b))
    assert a.dtype == b.dtype and a.shape == b.shape
    assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize("dynamic", ["token", "tensor", "group"])
def test_bfloat16_bits_quantize_as_their_float32_values(dynamic):
    """Every finite bfloat16 value, dynamic per token / tensor / 1x128 group: codes and scales of
    the bits (the fused 16-bit loop) equal those of the float32 values (the float32 loop)."""
    rows = finite_rows()
    recipe = _input_recipe(None, E4M3, True)
    assert model_dtype_free(recipe)
    codes_b, scale_b = quantized(numpy_bf16(rows), dynamic, recipe)
    codes_f, scale_f = quantized(as_f32(rows), dynamic, recipe)
    same_bytes(codes_b, codes_f)
    same_bytes(scale_b, scale_f)


def test_bfloat16_bits_static_scale_with_nan_and_inf():
    """Static input scale: every bfloat16 pattern (NaN and Inf too, which a static scale passes on)."""
    rows = ALL.reshape(-1, 256)
    recipe = _input_recipe(None, E4M3, False)
    scale = np.float32(0.0625)
    for s in (scale, np.float32(3.0)):
        same_bytes(quantized(numpy_bf16(rows), None, recipe, s)[0], quantized(as_f32(rows), None, recipe, s)[0])


def test_every_model_dtype_free_recipe_quantizes_bits_as_values():
    """Every built-in recipe the predicate admits (for E4M3 per token) gives the bits' codes and
    scales from their float32 values; and the predicate is not vacuous: a recipe that rounds to the
    model dtype does differ on some input, so it must say False there."""
    rows = finite_rows()
    admitted = differs = 0
    for name, rec in sorted(load_recipes().items()):
        if not isinstance(rec, Recipe) or "token" not in rec.granularities or E4M3.name not in rec.formats:
            continue
        b = quantized(numpy_bf16(rows), "token", rec)
        f = quantized(as_f32(rows), "token", rec)
        equal = all(x.tobytes() == y.tobytes() for x, y in zip(b, f))
        if model_dtype_free(rec):
            admitted += 1
            assert equal, name
        differs += not equal
    assert admitted and model_dtype_free(ACTIVATION_RECIPE)
    assert differs, "no built-in recipe depends on the model dtype: the test above shows nothing"


@pytest.mark.parametrize("M", [3, 40])  # the on-the-fly product (M <= 8) and the GEMM
@pytest.mark.parametrize("dynamic", ["token", "tensor"])
def test_linear_on_bfloat16_tensor_equals_float32_route(M, dynamic):
    """linear on a torch bfloat16 input (bits quantized, output by torch's threads) equals linear
    on the same values as a float32 numpy array (the float64 route), byte for byte, bfloat16 out."""
    rng = np.random.default_rng(M)
    K, N = 512, 300
    x = torch.from_numpy(rng.standard_normal((2, M, K)).astype(np.float32)).to(torch.bfloat16)
    w = rng.integers(0, 256, (N, K)).astype(np.uint8)
    w[(w & 0x7F) == 0x7F] = 0  # no NaN codes
    ws = rng.uniform(0.001, 0.01, N).astype(np.float32)
    y_t = linear(x, w, ws, dynamic=dynamic)
    y_n = linear(x.float().numpy(), w, ws, dynamic=dynamic, out_dtype="bfloat16")
    assert y_t.dtype == torch.bfloat16 and tuple(y_t.shape) == (2, M, N)
    same_bytes(y_t.view(torch.int16).numpy().view(np.uint16), np.asarray(y_n).view(np.uint16))


def test_activations_keep_bits_only_when_the_recipe_allows():
    x = torch.tensor([[1.5, -2.25]], dtype=torch.bfloat16)
    assert _activations(x, keep_bfloat16=True).dtype.name == "bfloat16"
    kept = _activations(x, keep_bfloat16=False)
    assert kept.dtype == np.float32 and kept.tolist() == [[1.5, -2.25]]


def f64_sweep() -> np.ndarray:
    """float64 values: every bfloat16 value exactly (NaNs with every payload and sign, +-Inf, +-0,
    subnormals), float64 NaNs with low payloads and both signs, signalling NaNs, and random values
    off the bfloat16 grid (rounded by the float64 -> float32 step, as before)."""
    on_grid = as_f32(ALL).astype(np.float64)
    nans = np.array([0x7FF8000000000001, 0xFFF8000000000000, 0x7FF0000000000001, 0xFFF4000000000000,
                     0x7FFFFFFFFFFFFFFF, 0xFFF0000020000000], np.uint64).view(np.float64)
    rng = np.random.default_rng(5)
    off = rng.standard_normal(1 << 16) * np.exp2(rng.integers(-140, 140, 1 << 16))
    return np.concatenate([on_grid, nans, off, -off])


@pytest.mark.filterwarnings("ignore:overflow encountered in cast", "ignore:invalid value encountered in cast")
def test_deliver_bfloat16_by_torch_equals_bits_formula():
    v = f64_sweep()
    expected = f32_to_bf16_bits(v.astype(np.float32))
    for arr in (v, v.reshape(-1, 2), v.astype(np.float32)):
        got = deliver(arr, "bfloat16", True)
        assert got.dtype == torch.bfloat16 and tuple(got.shape) == arr.shape
        same_bytes(got.view(torch.int16).numpy().view(np.uint16).reshape(-1), expected)
    small = deliver(v[:7], "bfloat16", True)  # below the threshold: the numpy route
    same_bytes(small.view(torch.int16).numpy().view(np.uint16), expected[:7])
