"""The shipped 'degenerate' suite: every registered recipe and scheme, crafted inputs that really
have the property their pattern names, expected outputs checked against the Fraction oracles, what
each recipe does on a zero block, and broken backends each caught by the case designed for it."""

from __future__ import annotations

import functools
from fractions import Fraction

import numpy as np
import pytest

from fp8ref import codec, quant
from fp8ref.conformance import run
from fp8ref.formats import get_format
from fp8ref.golden import degenerate, load_suite
from fp8ref.golden.ops import OPERATIONS
from fp8ref.golden.suite import build, cases
from fp8ref.registry import get_recipe, recipe_names
from fp8ref.scaling import expand, reduce_amax
from fp8ref.scheme import PRESETS
from tests.support import broken_backends as bb
from tests.support.matmul_oracle import fraction_oracle, rounded, same
from tests.support.quant_oracle import exact_code, fp32_nearest, oracle_codes

SMALLEST_NORMAL = {"bfloat16": 2.0 ** -126, "float16": 2.0 ** -14, "float32": 2.0 ** -126}


@functools.cache
def suite():
    return load_suite("degenerate")


@functools.cache
def built():
    return tuple(build(suite(), 1))


def of(op, pattern=None):
    return [c for c in built() if c.op == op and (pattern is None or c.params.get("pattern") == pattern)]


def args(c):
    return quant.as_args(PRESETS[c.params["scheme"]], role=c.params.get("role", "weight"))


def blocks(c, x):
    """(block ids, one list of values per block) of a quantize case's x."""
    ids = degenerate.block_ids(x.shape, args(c))
    flat = x.reshape(-1)
    return ids, [flat[ids.reshape(-1) == b] for b in range(int(ids.max()) + 1)]


def f64(x):
    return np.asarray(x).astype(np.float64)


# --- coverage ---------------------------------------------------------------------------------
def test_quantize_cases_cover_every_registered_recipe():
    """'recipes: all' is the registry, so a recipe added to specs/recipes/ is covered unedited."""
    entry = next(e for e in suite().entries if e.op == "quantize")
    assert entry.fields["recipes"] == recipe_names()
    assert {c.params["recipe"] for c in of("quantize")} == set(recipe_names())
    for pattern in degenerate.QUANT_PATTERNS:
        assert of("quantize", pattern), pattern


def test_every_case_has_a_pattern_and_the_random_cases_of_other_suites_are_unchanged():
    assert all("pattern" in c.params and f".{c.params['pattern']}." in c.name for c in built())
    w8a8 = [name for _, _, name, params in cases(load_suite("fp8-static-w8a8"), 1) if "pattern" in params]
    assert w8a8 == []


def test_left_out_cases_are_the_ones_quantize_refuses_or_cannot_reproduce():
    """zero-tensor with ModelOpt's NVFP4 multiplier: 0/0 block scales and no E2M1 NaN: refused.
    vllm-static (no zero-amax rule): scale 0 and 0 * inf = NaN codes whose sign is the machine's."""
    from fp8ref.errors import EncodeError

    x = np.zeros((2, 32), np.float32)
    with pytest.raises(EncodeError, match="no NaN code"):
        quant.quantize(x, PRESETS["NVFP4"], recipe="modelopt-nvfp4")
    q = quant.quantize(x, PRESETS["FP8"], recipe="vllm-static", amax=np.zeros(1))
    assert float(q.scale[0]) == 0.0 and np.isin(q.codes, (0x7F, 0xFF)).all()
    names = {c.name for c in built()}
    assert not any(".modelopt-nvfp4." in n and ".zero-tensor." in n for n in names)
    assert not any(".vllm-static." in n and ".zero-" in n for n in names)
    assert any(".vllm-static." in n and ".denormal-only." in n for n in names)


# --- the crafted inputs have their property ---------------------------------------------------
def test_zero_patterns():
    for c in of("quantize", "zero-tensor"):
        x = f64(c.inputs["x"])
        assert not x.any() and np.signbit(x).any() and not np.signbit(x).all(), c.name
    for c in of("quantize", "zero-blocks"):
        ids, bl = blocks(c, f64(c.inputs["x"]))
        for b, v in enumerate(bl):
            assert (not v.any()) == (b % 3 == 0), (c.name, b)


def test_single_nonzero_and_single_outlier_blocks():
    for c in of("quantize", "single-nonzero"):
        _, bl = blocks(c, f64(c.inputs["x"]))
        assert all(np.count_nonzero(v) == 1 for v in bl), c.name
    for c in of("quantize", "single-outlier"):
        _, bl = blocks(c, f64(c.inputs["x"]))
        for v in bl:
            top = np.abs(v) == degenerate.OUTLIER
            assert top.sum() == 1 and np.abs(v[~top]).max(initial=0) <= degenerate.OUTLIER * 2.0 ** -11, c.name


def test_denormal_only_blocks_hold_input_dtype_subnormals_only():
    for c in of("quantize", "denormal-only"):
        _, bl = blocks(c, f64(c.inputs["x"]))
        tiny = SMALLEST_NORMAL[c.params["dtype"]]
        for b, v in enumerate(bl):
            sub = (v != 0) & (np.abs(v) < tiny)
            assert sub.all() if b % 2 == 0 else not sub.all(), (c.name, b)  # odd blocks: heavy-tailed


# k-tail cases where a row's block before the tail draws a heavy-tailed value as large as the boosted
# tail, so both get one scale: case -> how many rows (row 4 here: amax 567.3 beside the tail's 666.3,
# both scale 2^7 for E2M3 under EVEN's rounding)
COINCIDENT_TAILS = {"quantize.MXFP6A8.torchao-mx-even.weight.float32.k-tail.8x200": 1}


def test_k_tail_cases_have_a_partial_last_block_far_from_the_previous_one():
    assert of("quantize", "k-tail") and of("linear", "k-tail")
    for c in of("quantize", "k-tail"):
        qa, x = args(c), f64(c.inputs["x"])
        g = degenerate.k_block(qa)
        K = x.shape[-1]
        assert K % g != 0 and K > g, c.name
        out = OPERATIONS["quantize"].reference(c.params, c.inputs)
        s = f64(out["scale"])
        if s.ndim == 2 and s.shape[-1] >= 2:  # the tail's scale is not its neighbour's
            assert int((s[..., -1] == s[..., -2]).sum()) == COINCIDENT_TAILS.get(c.name, 0), c.name
    for c in of("linear", "k-tail"):
        assert c.params["scheme"] == "FP8_BLOCK" and c.params["shape"][1] % 128 != 0


def test_nan_scale_pattern_and_what_each_nvfp4_recipe_stores_for_its_zero_blocks():
    """The tensor amax A is 0.5: substituting a zero block's amax (1.0) gives the block scale
    1 / (6 A / 2688) = 448 / A = 896 >= 480, which a non-saturating E4M3 cast makes NaN (0x7F; 0xFF
    for its negative); a saturating one 448 (0x7E). No registered recipe does that: their zero-block
    scales are the values the tools were measured to write (tests/fixtures/interop/FINDINGS-FP4-MX.md:
    0.125 and 1.0; FINDINGS writes 0.125 as 0x30, which is 0.5: the E4M3 byte of 0.125 is 0x20)."""
    e4m3 = get_format("float8_e4m3fn")
    A = degenerate.NAN_SCALE_AMAX
    assert Fraction(448) / Fraction(A) == 896 >= 480
    assert int(codec.encode(np.float32(896), e4m3, saturate=False)) == 0x7F
    assert int(codec.encode(np.float32(-896), e4m3, saturate=False)) == 0xFF
    assert int(codec.encode(np.float32(896), e4m3, saturate=True)) == 0x7E
    # zero-block scale (an E4M3 value) per recipe: CT 0.125 (0x30) and ModelOpt 1.0 (0x38) measured
    # on the tools; fp8ref's exact quotient 0 / (6 * A / 2688) = 0 (0x00)
    measured = {"compressed-tensors-nvfp4": 0x20, "modelopt-nvfp4": 0x38, "fp8ref": 0x00,
                "te-nvfp4": 0x00, "te-nvfp4-2d": 0x00,  # TE: its declared model, not measured
                "ggml-nvfp4": 0x00,  # llama.cpp's C (tests/fixtures/gguf/nvfp4.gguf)
                "torchao-nvfp4": 0x08, "torchao-nvfp4-no-tensor-scale": 0x08}  # 2^-6: tests/fixtures/torchao/nvfp4*
    assert [float(e4m3.exact_value(b)) for b in (0x20, 0x38, 0x30)] == [0.125, 1.0, 0.5]
    seen = set()
    for c in of("quantize", "nan-scale"):
        x = f64(c.inputs["x"])
        assert np.abs(x).max() == A and args(c).granularity == "nvfp4", c.name
        ids, bl = blocks(c, x)
        zero = np.array([not v.any() for v in bl])
        assert (zero == (np.arange(len(bl)) % 4 == 0)).all()
        s = f64(OPERATIONS["quantize"].reference(c.params, c.inputs)["scale"]).reshape(-1)
        want = float(e4m3.exact_value(measured[c.params["recipe"]]))
        assert (s[zero] == want).all() and not np.isnan(s).any(), c.name
        seen.add(c.params["recipe"])
    assert seen == {r for r in recipe_names() if "nvfp4" in get_recipe(r).granularities}


def _zero_block_scale(recipe, scheme, role, dtype="bfloat16", pattern="zero-blocks"):
    c = next(c for c in of("quantize", pattern) if c.params["recipe"] == recipe
             and c.params["scheme"] == scheme and c.params["role"] == role and c.params["dtype"] == dtype)
    out = OPERATIONS["quantize"].reference(c.params, c.inputs)
    s = f64(out["scale"]).reshape(-1)
    return float(s[0]), out["codes"]  # block 0 is a zero block (the whole tensor per tensor)


def _bf16(v) -> float:
    import ml_dtypes

    return float(np.float32(v).astype(ml_dtypes.bfloat16))


# recipe -> (scheme, role, zero-block scale of a bfloat16 model, why): docs/golden.md's table
ZERO_BLOCK = {
    "auto-round": ("FP8_STATIC", "weight", _bf16(np.float32(1 / 229376)), "bf16 of the fp32 floor 1/229376"),
    "compressed-tensors": ("FP8_STATIC", "weight", 2.0 ** -7, "stored 0 -> eps(bf16)"),
    "compressed-tensors-gpu": ("FP8_STATIC", "weight", 2.0 ** -7, "the eager path's scales: stored 0 -> eps(bf16)"),
    "compressed-tensors-mx": ("MXFP8", "weight", 2.0 ** -127, "byte 0 (FINDINGS 2.3)"),
    "compressed-tensors-mx-0.20": ("MXFP6A16", "weight", 2.0 ** -127, "byte 0, as 0.19 (ct020 fixtures)"),
    "compressed-tensors-nvfp4": ("NVFP4", "weight", 0.125, "0x20 (FINDINGS 1.4 writes 0x30, which is 0.5)"),
    "fbgemm": ("FP8_DYNAMIC", "weight", float(np.float32(1 / np.float32(448 / np.float32(1e-12)))),
               "amax floor 1e-12"),
    "fp8ref": ("FP8_STATIC", "weight", 1.0, "zero amax -> 1"),
    "onnx": ("FP8_STATIC", "weight", 1.0, "fp8ref's scale (an input to QuantizeLinear): zero amax -> 1"),
    "hf-fp8": ("FP8", "weight", 1.0, "m = 1 for amax 0"),
    "modelopt-fp8": ("FP8", "weight", 1.0, "maxbound substitution"),
    "modelopt-fp8-pc": ("FP8_STATIC", "weight", 1.0, "maxbound substitution (FINDINGS 3.2)"),
    "modelopt-fp8-in-memory": ("FP8", "weight", float(np.float32(1 / np.float32(448))),
                               "amax <= 2^-24 -> m = 448, scale fp32(1/m)"),
    "modelopt-mxfp8": ("MXFP8", "weight", 2.0 ** -127, "byte 0 (FINDINGS 3.4)"),
    "modelopt-nvfp4": ("NVFP4", "weight", 1.0, "0x38 (FINDINGS 3.3)"),
    "quark-fp8": ("FP8", "weight", 2.0 ** -23, "masked 0 -> eps(fp32), exact in bf16"),
    "quark-mxfp4": ("MXFP4", "weight", 2.0 ** -126, "byte 1 (FINDINGS 4.2)"),
    "ggml-mxfp4": ("MXFP4", "weight", 2.0 ** -127, "byte 0 for amax 0 (gguf 0.19.0 quants.MXFP4)"),
    "ggml-nvfp4": ("NVFP4", "weight", 0.0, "byte 0 for amax 0 (llama.cpp ggml_fp32_to_ue4m3: !(x > 0) -> 0)"),
    "gpt-oss-mxfp4": ("MXFP4", "weight", 2.0 ** -127, "byte 0: the bits of d = 0 round up to 0"),
    "vllm-dynamic": ("FP8_DYNAMIC", "activation", float(np.float32(1 / 229376)), "scale floor 1/(448*512)"),
    "vllm-group": ("FP8_BLOCK", "activation", float(np.float32(np.float32(1e-10) / np.float32(448))),
                   "amax floor 1e-10"),
    "deepgemm-ue8m0": ("FP8_BLOCK", "weight", 2.0 ** -22, "its amax floor, ceil to a power of two"),
    "fbgemm-fp8": ("FP8_DYNAMIC", "weight", float(np.float32(1 / 229376)), "scale floor 1/(448*512)"),
    "hf-fp8-ue8m0": ("FP8", "weight", 1.0, "m = 1 for amax 0, byte 127"),
    "te-current": ("FP8", "weight", 1.0, "zero amax -> 1"),
    "te-current-pow2": ("FP8", "weight", 1.0, "zero amax -> 1"),
    "te-nvfp4": ("NVFP4", "weight", 0.0, "E4M3 of 0: 0x00"),
    # 16x16 tiles: zero-blocks' 1x16 zero rows are not zero tiles; the all-zero tensor is
    "te-nvfp4-2d": ("NVFP4", "weight", 0.0, "E4M3 of 0: 0x00", "zero-tensor"),
    "vllm-group-ue8m0": ("FP8_BLOCK", "activation", 2.0 ** -42, "amax floor 1e-10, ceil to a power of two"),
    **{f"torchao-mx-{m}": ("MXFP8", "weight", 2.0 ** -127, "byte 0 (tests/fixtures/torchao/mx*: a zero block)")
       for m in ("floor", "ceil", "rceil", "even")},
    "torchao-nvfp4": ("NVFP4", "weight", 2.0 ** -6, "clamped below at 2^-6: 0x08 (tests/fixtures/torchao/nvfp4)"),
    "torchao-nvfp4-no-tensor-scale": ("NVFP4", "weight", 2.0 ** -6, "clamped below at 2^-6: 0x08"),
    "vllm-block-ue8m0": ("FP8_BLOCK", "weight", 2.0 ** -22, "its amax floor 1e-4, float32 log2 ceil"),
}


@pytest.mark.parametrize("recipe", recipe_names())
def test_what_each_recipe_stores_for_a_zero_block(recipe):
    """Every registered recipe has a row (a new recipe fails here until its row says what it does);
    vllm-static and torchao-float8 have no zero-amax rule: their zero-block cases are left out (above;
    torchao stores scale 0 and NaN codes there, pytorch/ao #4713)."""
    if recipe in ("vllm-static", "torchao-float8"):
        assert not any(c.params["recipe"] == recipe for c in of("quantize", "zero-blocks"))
        return
    scheme, role, want, _, *pattern = ZERO_BLOCK[recipe]
    got, codes = _zero_block_scale(recipe, scheme, role, pattern=(pattern or ["zero-blocks"])[0])
    assert got == want
    assert not np.isin(codes, (0x7F, 0xFF)).any()


def test_docs_table_lists_every_recipe():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "golden.md").read_text()
    table = text[text.index("### What each recipe does on degenerate inputs"):]
    for recipe in recipe_names():
        assert f"| `{recipe}` |" in table, recipe


def test_scales_pattern_scales_are_neither_one_nor_powers_of_two():
    checked = 0
    for c in of("scaled_mm", "scales"):
        M, K, N = c.params["shape"]
        assert M == N, c.name  # a swap keeps the shapes
        sa, sb = f64(c.inputs["scale_a"]).reshape(-1), f64(c.inputs["scale_b"]).reshape(-1)
        for s in (sa, sb, f64(c.inputs.get("scale_result", [3.0]))):
            assert (np.frexp(s)[0] != 0.5).all() and (s != 1).all(), c.name
        assert not np.array_equal(sa, sb)
        checked += "scale_result" in c.inputs
    assert checked


# --- expected outputs against the Fraction oracles ---------------------------------------------
def test_fp8ref_recipe_quantize_matches_the_fraction_oracle():
    """The ideal recipe on every FP8 granularity and pattern (bfloat16): s = fp32(amax / 448) (1 for a
    zero amax, 2**-126 at least), codes = the exact quotient x / s rounded once."""
    n = 0
    for c in of("quantize"):
        p = c.params
        qa = args(c)
        if p["recipe"] != "fp8ref" or p["dtype"] != "bfloat16" or qa.granularity in ("mx", "nvfp4"):
            continue
        x = f64(c.inputs["x"])
        out = OPERATIONS["quantize"].reference(p, c.inputs)
        amax = f64(c.inputs["amax"]) if "amax" in c.inputs else None
        if amax is None:
            amax = reduce_amax(c.inputs["x"], qa.granularity, group_size=qa.group_size, block_shape=qa.block_shape)
        want = np.vectorize(lambda a: 1.0 if a == 0 else max(fp32_nearest(Fraction(a) / 448), 2.0 ** -126))(amax)
        assert np.array_equal(f64(out["scale"]), want), c.name
        s = expand(want, x.shape, qa.granularity, group_size=qa.group_size, block_shape=qa.block_shape)
        assert np.array_equal(out["codes"], oracle_codes(x, np.broadcast_to(s, x.shape), get_format(qa.format))), c.name
        n += 1
    assert n >= 30


def test_scaled_mm_exact_cases_match_the_fraction_oracle():
    n = 0
    for c in of("scaled_mm"):
        p = c.params
        if p["accumulate"] != "exact":
            continue
        fmt = get_format(p["format"])
        a, b = c.inputs["a"], c.inputs["b"]
        exact = fraction_oracle(a, b, c.inputs["scale_a"].reshape(-1, 1) if c.inputs["scale_a"].size > 1
                                else c.inputs["scale_a"], c.inputs["scale_b"], fa=fmt, fb=fmt)
        got = OPERATIONS["scaled_mm"].reference(p, c.inputs)["out"]
        if p["out_dtype"] == "float8_e4m3fn":
            sr = Fraction(float(c.inputs["scale_result"][0]))
            want = np.vectorize(lambda v, sr=sr: exact_code(v / sr, get_format("float8_e4m3fn"), saturate=True),
                                otypes=[np.uint8])(exact)
            assert np.array_equal(got, want), c.name
        else:
            assert same(got.astype(np.float64), rounded(exact, p["out_dtype"])), c.name
        n += 1
    assert n >= 20


# --- broken backends, each caught by its case ------------------------------------------------
def _failing(backend, select):
    r = run(backend, suite(), select=select)
    assert r.compared() > 0
    return {c.case for c in r.results if c.mismatches or c.status == "error"}, {c.case for c in r.results
                                                                              if c.status == "compared"}


def test_reference_backends_pass_the_cases_they_run():
    """Without their fault the wrappers pass: a failure below is the fault's."""
    class Exact(bb._ExactMM):
        name = "mm-exact"

    class Quant(bb._Quant):
        name = "quant-ok"

        def breaks(self, x, qa, q, out):
            return out

    assert _failing(Exact(), lambda n: n.startswith("scaled_mm."))[0] == set()
    assert _failing(Quant(), lambda n: ".fp8ref." in n or ".compressed-tensors" in n)[0] == set()


def test_swapped_scales_are_caught_by_the_scales_case():
    bad, ran = _failing(bb.SwapScalesMM(), lambda n: n.startswith("scaled_mm."))
    assert bad and all(".row." in n and ".scales." in n for n in bad)
    assert {n for n in ran if ".row." in n and ".scales." in n} == bad


def test_an_ignored_scale_result_is_caught_by_the_scales_case():
    bad, ran = _failing(bb.IgnoresScaleResultMM(), lambda n: n.startswith("scaled_mm."))
    scales_fp8 = {n for n in ran if ".scales." in n and ".float8_e4m3fn.exact." in n}
    assert scales_fp8 and scales_fp8 <= bad
    assert all(".float8_e4m3fn.exact." in n for n in bad)


def test_zero_blocks_as_nan_are_caught_by_the_zero_cases():
    bad, ran = _failing(bb.ZeroBlockNaN(), lambda n: n.startswith("quantize.") and ".fp8ref." in n)
    zero = {n for n in ran if ".zero-" in n}
    assert zero and zero <= bad
    assert all(".zero-" in n or ".nan-scale." in n for n in bad)  # nan-scale has zero blocks too


def test_a_mishandled_k_tail_is_caught_by_the_k_tail_case():
    bad, ran = _failing(bb.KTailPreviousScale(), lambda n: n.startswith("quantize.") and (
        ".fp8ref." in n or ".compressed-tensors" in n))
    tails = {n for n in ran if ".k-tail." in n}
    assert tails and bad == tails
    bad, ran = _failing(bb.KTailLinear(), lambda n: n.startswith("linear."))
    assert bad == {n for n in ran if ".k-tail." in n} and bad


def test_a_substituted_zero_block_amax_is_caught_by_the_nan_scale_case():
    backend = bb.SubstitutesBlockAmax()
    bad, ran = _failing(backend, lambda n: n.startswith("quantize.NVFP4."))
    nan_scale = {n for n in ran if ".nan-scale." in n}
    assert nan_scale and nan_scale <= bad
    c = next(c for c in of("quantize", "nan-scale") if c.params["recipe"] == "fp8ref")
    got = backend.quantize(c.inputs["x"], scheme="NVFP4", recipe="fp8ref", role=c.params["role"])["scale"]
    assert np.isnan(f64(got)).any()  # the 896 block scale became the E4M3 NaN


def floor_log2(r: Fraction) -> int:
    e = r.numerator.bit_length() - r.denominator.bit_length()
    return e - 1 if Fraction(2) ** e > r else e


def test_fp8ref_recipe_mx_and_nvfp4_quantize_match_the_fraction_oracle():
    """MX (ocp-floor): s = 2**(floor(log2 amax) - emax) (2**-127 for a zero block), codes = the exact
    x / s, saturating. NVFP4: g = fp32(A / 2688) (1 for A = 0), s_b = E4M3 of the exact amax_b / (6 g),
    codes = the exact x / (s_b g), a zero divisor giving the zero of x's sign."""
    n = 0
    for c in of("quantize"):
        p, qa = c.params, args(c)
        if p["recipe"] != "fp8ref" or p["dtype"] != "bfloat16" or qa.granularity not in ("mx", "nvfp4"):
            continue
        x, fmt = f64(c.inputs["x"]), get_format(qa.format)
        out = OPERATIONS["quantize"].reference(p, c.inputs)
        amax = reduce_amax(c.inputs["x"], qa.granularity)
        if qa.granularity == "mx":
            s = np.vectorize(lambda a, fmt=fmt: 2.0 ** max(-127, floor_log2(Fraction(a)) - fmt.emax) if a
                             else 2.0 ** -127)(amax)
        else:
            A = float(amax.max())
            g = fp32_nearest(Fraction(A) / 2688) if A > 0 else 1.0
            e4m3 = get_format("float8_e4m3fn")
            s = np.vectorize(lambda a, g=g, e4m3=e4m3: float(
                e4m3.exact_value(exact_code(Fraction(a) / (6 * Fraction(g)), e4m3))))(amax)
            s = s * g
        assert np.array_equal(f64(out["scale"]) * (1 if qa.granularity == "mx" else g), s), c.name
        full = np.broadcast_to(expand(s, x.shape, qa.granularity), x.shape)
        nonzero = full > 0
        want = oracle_codes(np.where(nonzero, x, 1.0), np.where(nonzero, full, 1.0), fmt)
        want = np.where(nonzero, want, np.where(np.signbit(x), fmt.sign_mask, 0))
        assert np.array_equal(out["codes"], want), c.name
        n += 1
    assert n >= 10
