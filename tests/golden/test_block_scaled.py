"""The block-scaled scaled_mm cases (NVFP4 block16, MX block32: fp8ref.golden.ops.block_gemm) against
independent evidence: a Fraction oracle of the block-scaled dot products (exact), a scalar float32
loop written from the models' definitions (fp32 epilogue / operands orders), exhaustive code pairs
at small K; the shipped suite's coverage; the naive backend judged, broken variants caught."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest

from fp8ref.conformance import report
from fp8ref.conformance.adapters.naive_block_backend import NaiveBlockBackend
from fp8ref.conformance.adapters.torch_backend import TorchBackend
from fp8ref.conformance.backend import capability_suites
from fp8ref.conformance.runner import run
from fp8ref.formats import get_format
from fp8ref.golden import load_suite, parse_suite
from fp8ref.golden.accumulation import model_outputs
from fp8ref.golden.ops import OPERATIONS
from fp8ref.golden.ops.block_gemm import BLOCK_SCALES
from fp8ref.golden.suite import build, cases
from tests.support.broken_backends import BlockIgnoresAlpha, BlockScaleShifted
from tests.support.matmul_oracle import round_fraction

OP = OPERATIONS["scaled_mm"]
SUITE = load_suite("block-scaled")
CASES = list(build(SUITE, 1))


def _value(fmt, code) -> float:
    """A code's value by the format's own table (Fraction), as a float (NaN/Inf included)."""
    f = get_format(fmt)
    mag = int(code) & (f.sign_mask - 1)
    if f.specials == "ieee" and mag > f.max_code_magnitude:
        inf = mag == f.max_code_magnitude + 1
        return (-1.0 if int(code) & f.sign_mask else 1.0) * (math.inf if inf else math.nan)
    if f.specials == "fn" and mag > f.max_code_magnitude:
        return math.nan
    return float(f.exact_value(int(code)))


def _block_scales(inputs, params):
    block = BLOCK_SCALES[params["scales"]][0]
    return block, inputs["scale_a"].astype(np.float64), inputs["scale_b"].astype(np.float64)


def fraction_oracle(params, inputs) -> np.ndarray:
    """alpha * sum_k a_k b_k sa(m, k // block) sb(k // block, n) + bias as a Fraction, rounded once;
    with a NaN or Inf operand, the IEEE result of Python float arithmetic on the products."""
    block, sa, sb = _block_scales(inputs, params)
    fmt = params["format"]
    a = np.vectorize(lambda c: _value(fmt, c), otypes=[object])(inputs["a"])
    b = np.vectorize(lambda c: _value(fmt, c), otypes=[object])(inputs["b"])
    alpha = Fraction(float(inputs["alpha"][0])) if "alpha" in inputs else Fraction(1)
    bias = inputs.get("bias")
    (M, K), N = a.shape, b.shape[1]
    out = np.empty((M, N))
    for m in range(M):
        for n in range(N):
            special, total = None, Fraction(0)
            for k in range(K):
                s = Fraction(float(sa[m, k // block])) * Fraction(float(sb[k // block, n]))
                x, y = a[m, k], b[k, n]
                if math.isfinite(x) and math.isfinite(y):
                    total += Fraction(x) * Fraction(y) * s
                else:
                    p = x * y  # Python float: inf * 0 = nan, nan propagates
                    special = p if special is None else special + p
            if special is not None:
                out[m, n] = special
                continue
            total = total * alpha + (Fraction(float(bias[n])) if bias is not None else 0)
            out[m, n] = round_fraction(total, "float32") if params["out_dtype"] == "float32" else \
                round_fraction(total, "bfloat16")
    return out


def fp32_oracle(params, inputs) -> np.ndarray:
    """The fp32 models written out in numpy float32, one product and one addition at a time (every
    element's own sequence of IEEE float32 operations, all elements at once)."""
    block, sa, sb = _block_scales(inputs, params)
    f32 = np.float32
    fmt = params["format"]
    a = np.vectorize(lambda c: _value(fmt, c))(inputs["a"]).astype(np.float32)
    b = np.vectorize(lambda c: _value(fmt, c))(inputs["b"]).astype(np.float32)
    sa, sb = sa.astype(np.float32), sb.astype(np.float32)
    (M, K), N = a.shape, b.shape[1]
    acc = np.zeros((M, N), np.float32)
    with np.errstate(all="ignore"):
        if params["scale_order"] == "operands":
            for k in range(K):
                x = (a[:, k] * sa[:, k // block]).astype(f32)
                y = (b[k, :] * sb[k // block, :]).astype(f32)
                acc = (acc + (x[:, None] * y[None, :]).astype(f32)).astype(f32)
        else:
            for k0 in range(0, K, block):
                part = np.zeros((M, N), np.float32)
                for k in range(k0, min(K, k0 + block)):
                    part = (part + (a[:, k, None] * b[None, k, :]).astype(f32)).astype(f32)
                s = (sa[:, k0 // block, None] * sb[None, k0 // block, :]).astype(f32)
                acc = (acc + (s * part).astype(f32)).astype(f32)
        if "alpha" in inputs:
            acc = (acc * f32(inputs["alpha"][0])).astype(f32)
        if inputs.get("bias") is not None:
            acc = (acc + np.asarray(inputs["bias"]).astype(f32)[None, :]).astype(f32)
    if params["out_dtype"] == "bfloat16":
        import ml_dtypes

        acc = acc.astype(ml_dtypes.bfloat16).astype(np.float32)
    return acc


def same(x, y) -> bool:
    """Bit for bit as float64 (signed zeros differ), every NaN equal to every NaN."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    return x.shape == y.shape and bool(np.all(((x == y) & (np.signbit(x) == np.signbit(y)))
                                              | (np.isnan(x) & np.isnan(y))))


def _got(case) -> np.ndarray:
    return np.asarray(OP.reference(case.params, case.inputs)["out"]).astype(np.float64)


@pytest.mark.parametrize("case", [c for c in CASES if c.params["accumulate"] == "exact"], ids=lambda c: c.name)
def test_exact_cases_equal_the_fraction_oracle(case):
    assert same(_got(case), fraction_oracle(case.params, case.inputs))


@pytest.mark.parametrize("case", [c for c in CASES if c.params["accumulate"] == "fp32"], ids=lambda c: c.name)
def test_fp32_cases_equal_the_scalar_float32_loop(case):
    assert same(_got(case), fp32_oracle(case.params, case.inputs))


def _exhaustive(fmt: str, scales: str, K: int, rng) -> dict:
    """Every pair of K-element code vectors of a small format as rows of a and columns of b (E2M1:
    all 16**K vectors), or every code pair at K = 1 (the 8-bit formats), with random scales."""
    f = get_format(fmt)
    codes = np.arange(f.n_codes, dtype=np.uint8)
    vecs = np.stack(np.meshgrid(*[codes] * K, indexing="ij"), -1).reshape(-1, K)
    block, sfmt, _ = BLOCK_SCALES[scales]
    ext = {"block16": [2.0 ** -9, 3 * 2.0 ** -9, 2.0 ** -6, 1.0, 1.5, 448.0],
           "block32": [2.0 ** -127, 2.0 ** -60, 0.5, 1.0, 2.0 ** 60, 2.0 ** 127]}[scales]
    sa = np.array(ext, np.float32)[rng.integers(0, len(ext), (vecs.shape[0], 1))]
    sb = np.array(ext, np.float32)[rng.integers(0, len(ext), (1, vecs.shape[0]))]
    inputs = {"a": vecs, "b": np.ascontiguousarray(vecs.T), "scale_a": sa, "scale_b": sb}
    if scales == "block16":
        inputs["alpha"] = np.array([0.0078125 * 1.3], np.float32)
    return inputs


@pytest.mark.parametrize("fmt,scales,K,out_dtype", [
    ("float4_e2m1fn", "block16", 1, "bfloat16"), ("float4_e2m1fn", "block16", 2, "float32"),
    ("float4_e2m1fn", "block32", 1, "bfloat16"), ("float4_e2m1fn", "block32", 2, "float32"),
    ("float8_e4m3fn", "block32", 1, "float32"), ("float8_e4m3fn", "block32", 1, "bfloat16"),
    ("float8_e5m2", "block32", 1, "float32"), ("float8_e5m2", "block32", 1, "bfloat16")])
def test_exhaustive_code_vectors_at_small_k(fmt, scales, K, out_dtype):
    inputs = _exhaustive(fmt, scales, K, np.random.default_rng(K))
    for acc, order in (("exact", "epilogue"), ("fp32", "epilogue"), ("fp32", "operands")):
        params = {"format": fmt, "scales": scales, "out_dtype": out_dtype, "accumulate": acc, "scale_order": order,
                  "bias": False, "shape": [inputs["a"].shape[0], K, inputs["a"].shape[0]]}
        got = np.asarray(OP.reference(params, inputs)["out"]).astype(np.float64)
        want = fraction_oracle(params, inputs) if acc == "exact" else fp32_oracle(params, inputs)
        assert same(got, want), (acc, order)


def test_the_suite_covers_tails_zero_blocks_scale_extremes_and_specials():
    kinds = {(c.params["format"], c.params["scales"]) for c in CASES}
    assert kinds == {("float4_e2m1fn", "block16"), ("float4_e2m1fn", "block32"), ("float8_e4m3fn", "block32"),
                     ("float8_e5m2", "block32")}
    assert {c.params["out_dtype"] for c in CASES} == {"float32", "bfloat16"}
    assert any(c.params["shape"][1] % BLOCK_SCALES[c.params["scales"]][0] for c in CASES)  # a cropped last block
    scales = {s: np.concatenate([np.concatenate([c.inputs["scale_a"].ravel(), c.inputs["scale_b"].ravel()])
                                 for c in CASES if c.params["scales"] == s]) for s in BLOCK_SCALES}
    assert {2.0 ** -127, 2.0 ** 127} <= set(scales["block32"].astype(np.float64).tolist())
    assert np.all(np.log2(scales["block32"].astype(np.float64)) % 1 == 0)  # E8M0: powers of two only
    assert {k * 2.0 ** -9 for k in range(1, 8)} | {448.0} <= set(scales["block16"].astype(np.float64).tolist())
    zero = [c for c in CASES if "zero-blocks" in c.name]
    assert zero and all((c.inputs["a"][:, :BLOCK_SCALES[c.params["scales"]][0]] == 0).all() for c in zero)
    specials = [c for c in CASES if "specials" in c.name]
    assert {c.params["format"] for c in specials} == {"float8_e4m3fn", "float8_e5m2"}  # E2M1 has no NaN/Inf
    assert all(np.isnan(_got(c)).any() for c in specials)
    assert any(np.isinf(_got(c)).any() for c in specials if c.params["format"] == "float8_e5m2")
    assert all(c.params["shape"][1] >= 3 * BLOCK_SCALES[c.params["scales"]][0]  # three whole blocks of K
               for c in CASES if "cancellation" in c.name)
    assert all("alpha" in c.inputs for c in CASES if c.params["scales"] == "block16")


def test_cancellation_shows_fp32_losing_the_small_block():
    diff = 0
    for c in CASES:
        if "cancellation" in c.name and c.params["accumulate"] == "fp32" and c.params["out_dtype"] == "float32":
            exact = OP.reference({**c.params, "accumulate": "exact"}, c.inputs)["out"]
            diff += int((np.asarray(exact) != np.asarray(OP.reference(c.params, c.inputs)["out"])).sum())
    assert diff > 0


def test_combinations_that_do_not_exist_are_not_cases():
    text = """
suite: t
seed: 1
operations:
  - op: scaled_mm
    formats: [float4_e2m1fn, float8_e4m3fn]
    shapes: {1: [[2, 40, 3]]}
    scales: [tensor, block16, block32]
    out_dtypes: [float32, float8_e4m3fn]
    accumulate: [exact, fp32, fp32-limited]
    patterns: [random, specials, cancellation, single-nonzero]
"""
    params = [p for _, _, _, p in cases(parse_suite(text), 1)]
    assert not [p for p in params if p["format"] == "float4_e2m1fn" and p["scales"] in ("tensor", "row")]
    assert not [p for p in params if p["format"] != "float4_e2m1fn" and p["scales"] == "block16"]
    blocked = [p for p in params if p["scales"] in BLOCK_SCALES]
    assert blocked and {p["accumulate"] for p in blocked} == {"exact", "fp32"}
    assert {p["out_dtype"] for p in blocked} == {"float32"}
    assert {p.get("pattern", "random") for p in blocked} == {"random", "specials"}  # K = 40: no 3 blocks; fp8


def test_kernel_models_rank_where_their_instruction_fits():
    def first(fmt, scales):
        return next(c for c in CASES if c.params["format"] == fmt and c.params["scales"] == scales
                    and c.params["accumulate"] == "exact" and "pattern" not in c.params)

    for fmt, scales, kernel in (("float4_e2m1fn", "block16", "blackwell-nvfp4"),
                                ("float4_e2m1fn", "block32", "blackwell-mxfp4"),
                                ("float8_e4m3fn", "block32", "blackwell-mxfp8")):
        outs, why = model_outputs(OP, first(fmt, scales).params, first(fmt, scales).inputs, kernel)
        assert outs is not None, why
    outs, why = model_outputs(OP, first("float8_e5m2", "block32").params, first("float8_e5m2", "block32").inputs,
                              "blackwell-mxfp8")
    assert outs is None and "float8_e5m2" in why
    outs, why = model_outputs(OP, first("float4_e2m1fn", "block16").params, first("float4_e2m1fn", "block16").inputs,
                              "hopper-promoted")
    assert outs is None and "block scales" in why


def _failing_patterns(result) -> set[str]:
    return {r.params.get("pattern", "random") for r in result.results if r.mismatches or r.status == "error"}


def test_the_naive_backend_is_judged_and_fails_only_where_its_operands_leave_fp32():
    result = run(NaiveBlockBackend(), SUITE)
    compared = [r for r in result.results if r.status != "not-implemented"]
    assert compared and {r.params["accumulate"] for r in compared} == {"fp32"}
    assert sum(r.in_bound for r in compared) > 0  # its BLAS order differs from the exact result, inside the bound
    assert _failing_patterns(result) == {"scale-extremes"}
    assert all(r.params["scales"] == "block32" for r in compared if r.mismatches)  # E8M0 2**+-127
    lines = []
    report.print_results(result.results, header="h", is_xfailed=result.xfailed, max_errors=1,
                         out=type("W", (), {"write": lambda self, s: lines.append(s), "flush": lambda self: None})())
    first = next(s for s in lines if s.startswith("scaled_mm"))
    assert "2x72x3" in first  # the smallest failing case first


@pytest.mark.parametrize("broken", [BlockIgnoresAlpha, BlockScaleShifted])
def test_broken_block_gemms_are_caught_on_random_blocks(broken):
    result = run(broken(), SUITE)
    assert "random" in _failing_patterns(result)
    outside = [m.bound_used for r in result.results if "pattern" not in r.params for m in r.mismatches]
    assert outside and all(u > 1 for u in outside)  # in the bound's domain, and outside the bound


def test_conform_adds_the_block_suite_where_declared_and_says_why_not():
    assert capability_suites(NaiveBlockBackend()) == (["block-scaled"], [])
    run_, skipped = capability_suites(TorchBackend())
    assert run_ == [] and skipped == ["suite block-scaled skipped: backend 'torch' declares no scaled_mm with "
                                      "scales block16 or block32"]


def test_conform_lists_why_cases_were_skipped(capsys):
    from fp8ref.cli import main

    main(["conform", "--backend", "naive_block", "--suite", "block-scaled", "--case", "*e5m2*.bias.2x72x3"])
    out = capsys.readouterr().out
    assert "not implemented, skipped: 4 case(s):" in out  # exact x 2 out_dtypes, fp32 epilogue x 2
    assert "naive_block scaled_mm does not implement scale_order='epilogue'" in out
    assert "naive_block scaled_mm does not implement accumulate='exact'" in out


def test_golden_check_judges_a_folder_of_block_cases(tmp_path):
    """generate, then outputs written by the naive backend (operands-order fp32 cases) and by the
    blackwell-mxfp4 kernel model (MXFP4 cases): golden check judges them as conform does."""
    from safetensors.numpy import save_file

    from fp8ref.golden import check, generate, open_golden
    from fp8ref.golden.accumulation import ModelJudge

    generate(SUITE, tmp_path / "g")
    naive, kernel = {}, {}
    for c, _ in open_golden(tmp_path / "g").iter_cases():  # the inputs as read back from the files
        ins = c.inputs
        if c.params["accumulate"] == "fp32" and c.params["scale_order"] == "operands":
            naive[f"{c.name}/out"] = np.asarray(OP.call(NaiveBlockBackend(), c.params, ins)["out"])
        if c.params["format"] == "float4_e2m1fn" and c.params["scales"] == "block32":
            kernel[f"{c.name}/out"] = np.asarray(OP.reference({**c.params, "accumulate": "blackwell-mxfp4"},
                                                              ins)["out"])
    save_file(naive, str(tmp_path / "naive.safetensors"))
    save_file(kernel, str(tmp_path / "kernel.safetensors"))
    results, problems = check(tmp_path / "g", tmp_path / "naive.safetensors", allow_missing=True,
                              accumulation_order="unspecified")
    checked = [r for r in results if r.status != "missing"]
    assert not problems and len(checked) == len(naive)
    assert {r.params.get("pattern", "random") for r in checked if r.mismatches} == {"scale-extremes"}
    assert sum(r.in_bound for r in checked) > 0
    judge = ModelJudge("blackwell-mxfp4")
    results, problems = check(tmp_path / "g", tmp_path / "kernel.safetensors", allow_missing=True,
                              accumulation=judge)
    checked = [r for r in results if r.status != "missing"]
    assert not problems and checked and not [r for r in checked if r.mismatches or r.status == "error"]
    assert judge.best().model == "blackwell-mxfp4"


def test_a_backend_declaring_block16_must_take_alpha():
    from fp8ref.conformance.backend import check_capabilities
    from fp8ref.errors import BackendError

    class NoAlpha(NaiveBlockBackend):
        name = "no-alpha"

        def scaled_mm(self, a, b, scale_a, scale_b, *, bias, fmt, out_dtype, accumulate, scale_order):
            raise AssertionError("never called")

    with pytest.raises(BackendError, match="scales block16, which pass alpha="):
        check_capabilities(NoAlpha())

    class MxOnly(NoAlpha):  # MX has no global scale: no alpha needed
        capabilities = {"scaled_mm": {**NaiveBlockBackend.capabilities["scaled_mm"], "scales": ("block32",)}}

    check_capabilities(MxOnly())
