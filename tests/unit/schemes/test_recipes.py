"""recipes: strict YAML loading, dtype rounding and each step against torch's own arithmetic."""

from __future__ import annotations

import shutil
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch

from fp8ref.errors import RecipeError, SpecError
from fp8ref.formats import FORMATS
from fp8ref.recipes import apply_scaled, compute_scale
from fp8ref.registry import RECIPES_DIR, get_recipe, load_recipes
from fp8ref.rounding import round_to

E4M3 = FORMATS["float8_e4m3fn"]
BUILTIN = ("fp8ref", "compressed-tensors", "auto-round", "hf-fp8", "fbgemm",
           "vllm-dynamic", "vllm-group", "vllm-static", "modelopt-fp8", "modelopt-fp8-pc", "modelopt-fp8-in-memory",
           "compressed-tensors-nvfp4", "compressed-tensors-mx", "modelopt-nvfp4", "modelopt-mxfp8",
           "quark-fp8", "quark-mxfp4", "te-current", "te-current-pow2", "deepgemm-ue8m0", "vllm-group-ue8m0",
           "fbgemm-fp8", "te-nvfp4", "te-nvfp4-2d", "hf-fp8-ue8m0", "gpt-oss-mxfp4", "compressed-tensors-gpu",
           "onnx", "compressed-tensors-mx-0.20", "ggml-mxfp4", "ggml-nvfp4", "torchao-float8", "torchao-mx-floor",
           "torchao-mx-ceil", "torchao-mx-rceil", "torchao-mx-even", "torchao-nvfp4", "torchao-nvfp4-no-tensor-scale",
           "vllm-block-ue8m0")


def test_get_recipe_parses_only_its_own_file_once(monkeypatch):
    """get_recipe parses the named recipe's file, once, however many threads ask at once (verify's two
    layer threads each parsed all 31 files: 0.07 s of CPU each time); the recipe equals load_recipes'."""
    import functools
    from concurrent.futures import ThreadPoolExecutor

    from fp8ref import registry

    parsed = []
    real = registry.load_yaml
    monkeypatch.setattr(registry, "load_yaml", lambda path: parsed.append(path.name) or real(path))
    monkeypatch.setattr(registry, "_parse_recipe_file", functools.cache(registry._parse_recipe_file.__wrapped__))
    monkeypatch.setattr(registry, "_builtin_recipe", functools.cache(registry._builtin_recipe.__wrapped__))
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda _: get_recipe("compressed-tensors"), range(8)))
    assert parsed == ["compressed-tensors.yaml"]
    assert all(r is got[0] for r in got) and got[0] == load_recipes()["compressed-tensors"]
    with pytest.raises(RecipeError, match=r"unknown recipe 'compresed-tensors'.*did you mean 'compressed-tensors'"):
        get_recipe("compresed-tensors")


def test_builtin_recipes_load():
    recipes = load_recipes()
    assert set(recipes) == set(BUILTIN)
    assert get_recipe(None).name == "fp8ref"
    assert get_recipe(recipes["hf-fp8"]) is recipes["hf-fp8"]


def _copy(tmp_path: Path, name: str, edit) -> str:
    src = (RECIPES_DIR / f"{name}.yaml").read_text()
    (tmp_path / f"{name}.yaml").write_text(edit(src))
    return str(tmp_path)


@pytest.mark.parametrize("edit,match", [
    (lambda s: s.replace("  scale:\n", "  scale:\n    colour: red\n"),
     r"compressed-tensors.yaml:\d+: steps.scale.colour: unknown key"),
    (lambda s: s.replace("    clamp: true", "    clamp: yes please"),
     r"compressed-tensors.yaml:\d+: steps.apply.clamp: expected true or false, got 'yes please'"),
    (lambda s: s.replace("    op: divide", "    op: divide_twice"),
     r"compressed-tensors.yaml:\d+: steps.apply.op: expected one of divide, multiply_reciprocal"),
    (lambda s: s.replace("    zero_stored: eps", ""),
     r"compressed-tensors.yaml:\d+: steps.scale: missing key\(s\) zero_stored"),
    (lambda s: s.replace("    min: null\n", "    min: \"1/zero\"\n", 1),
     r"steps.scale.min: expected a number, a fraction like '1/229376' or null"),
    (lambda s: s.replace("name: compressed-tensors", "name: ct"),
     r"compressed-tensors.yaml:\d+: name: expected the file name 'compressed-tensors', got 'ct'"),
    (lambda s: s.replace("granularities: [tensor,", "granularities: [tensors,"),
     r"granularities\[0\]: expected one of tensor"),
    (lambda s: s.replace("formats: [float8_e4m3fn]", "formats: [float8_e4m3]"),
     r"formats\[0\]: unknown format 'float8_e4m3'"),
    (lambda s: s.replace("nonfinite: propagate", "nonfinite: propagate\nnonfinite: error"),
     r"duplicate"),
])
def test_recipe_files_are_validated_strictly(tmp_path, edit, match):
    folder = _copy(tmp_path, "compressed-tensors", edit)
    with pytest.raises(SpecError, match=match):
        load_recipes(folder)


def test_unknown_recipe_suggests():
    with pytest.raises(RecipeError, match=r"recipe: unknown recipe 'hf_fp8'; did you mean 'hf-fp8'"):
        get_recipe("hf_fp8")


def test_every_builtin_recipe_round_trips_through_a_copy(tmp_path):
    for name in BUILTIN:
        shutil.copy(RECIPES_DIR / f"{name}.yaml", tmp_path / f"{name}.yaml")
    assert load_recipes(str(tmp_path)) == load_recipes()


# --- dtype rounding against torch's conversions -------------------------------------------
def _float32_sample() -> np.ndarray:
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2 ** 32, 200_000, dtype=np.uint64).astype(np.uint32)
    ties = (rng.integers(0, 2 ** 16, 5000, dtype=np.uint64).astype(np.uint32) << 16) | 0x8000  # exact bf16 ties
    special = np.array([0x7F7FFFFF, 0x7F7F8000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x80000000, 1, 0x8000],
                       np.uint32)
    return np.concatenate([bits, ties, special]).view(np.float32)


@pytest.mark.parametrize("dtype,tdtype", [("bfloat16", torch.bfloat16), ("float16", torch.float16)])
def test_round_float32_to_16_bits_matches_torch(dtype, tdtype):
    x = _float32_sample()
    got = round_to(x, dtype)
    want = torch.from_numpy(x).to(tdtype).float().numpy()
    assert np.array_equal(got, want, equal_nan=True)


def _bf16_oracle(v: float) -> float:
    """RNE of a float64 to bfloat16 with Fractions (8 significant bits, emin -126)."""
    if v == 0 or not np.isfinite(v):
        return v
    r = Fraction(v)
    e = max(abs(r).numerator.bit_length() - abs(r).denominator.bit_length(), -126)
    e = e if Fraction(2) ** e <= abs(r) or e == -126 else e - 1
    q = Fraction(2) ** (e - 7)
    n = r / q
    f = n.__floor__()
    rem = n - f
    f = f + (1 if rem > Fraction(1, 2) or (rem == Fraction(1, 2) and f % 2) else 0)
    out = f * q
    return float("inf") * (1 if v > 0 else -1) if abs(out) >= 2 ** 128 else float(out)


def test_round_float64_to_bfloat16_is_a_single_rounding():
    rng = np.random.default_rng(2)
    v = np.concatenate([rng.standard_normal(3000) * 10.0 ** rng.integers(-40, 38, 3000),
                        [1 + 2 ** -8 + 2 ** -40, 1 + 2 ** -8, 3.3895313892515355e38, 1e-40, -2.0 ** -133]])
    got = round_to(v, "bfloat16")
    want = np.array([_bf16_oracle(float(t)) for t in v], np.float32)
    assert np.array_equal(got, want)
    assert got[-5 + 0] == np.float32(1 + 2 ** -7)  # 1 + 2**-8 + tiny rounds up (not a tie any more)


# --- each step against the producer's torch arithmetic --------------------------------------
@pytest.mark.parametrize("tdtype,dtype", [(torch.bfloat16, "bfloat16"), (torch.float16, "float16"),
                                          (torch.float32, "float32")])
def test_compressed_tensors_scale_and_division_are_model_dtype_ops(tdtype, dtype):
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(64, 128, generator=g) * 0.05).to(tdtype)
    w[5] = 0
    amax = torch.maximum(-torch.minimum(w.min(dim=1, keepdim=True).values, torch.zeros(())),
                         w.max(dim=1, keepdim=True).values)
    s_torch = amax / 448.0
    s_torch = torch.where(s_torch == 0, torch.tensor(torch.finfo(tdtype).eps, dtype=tdtype), s_torch)
    rec = get_recipe("compressed-tensors")
    stored, operand = compute_scale(amax.double().numpy(), rec, E4M3, dtype)
    assert torch.equal(torch.from_numpy(stored).to(tdtype), s_torch)
    y_torch = (w / s_torch + torch.zeros((), dtype=tdtype)).clamp(-448, 448)
    y = apply_scaled(w.float().numpy(), operand, rec, E4M3, dtype)
    assert np.array_equal(y, y_torch.float().numpy())
    assert np.array_equal(np.signbit(y), np.signbit(y_torch.float().numpy()))


def test_hf_multiplier_is_torch_scalar_over_tensor():
    """`448.0 / t` in torch is reciprocal(t) * 448 (differs from 448/t for ~1/4 of values)."""
    rng = np.random.default_rng(4)
    amax = rng.uniform(1e-3, 1e3, 5000).astype(np.float32)
    t = torch.from_numpy(amax)
    m_torch = 448.0 / t
    assert (m_torch != torch.tensor(448.0) / t).any()          # the two forms really differ
    stored, m = compute_scale(amax.astype(np.float64), get_recipe("hf-fp8"), E4M3, "bfloat16")
    assert torch.equal(torch.from_numpy(m), m_torch)
    assert torch.equal(torch.from_numpy(stored), (1.0 / m_torch).to(torch.float32))


def test_auto_round_floor_and_divisor():
    amax = np.array([[0.0], [1e-9], [3.0]])
    stored, s32 = compute_scale(amax, get_recipe("auto-round"), E4M3, "bfloat16")
    floor = np.float32(1 / 229376)
    assert floor.view(np.uint32) == 0x36924925
    want = np.maximum(amax.astype(np.float32) / np.float32(448), floor)
    assert np.array_equal(s32, want)
    assert np.array_equal(stored, round_to(want, "bfloat16"))


def test_vllm_static_multiplies_by_the_reciprocal():
    x = np.random.default_rng(5).standard_normal((4, 64)).astype(np.float32) * 30
    s = np.array([[0.0371]], np.float32)
    y = apply_scaled(x, s, get_recipe("vllm-static"), E4M3, "float32")
    want = torch.clamp(torch.from_numpy(x) * (1.0 / torch.from_numpy(s)), -448, 448).numpy()
    assert np.array_equal(y, want)
