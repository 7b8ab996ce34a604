"""The fused C quantize loops (fp8ref/_csrc/quant.c) against the numpy paths and the Fraction oracle.

The numpy paths (exact_quotient_codes, apply_scaled + the codec) are the reference: every test here
runs ``quantize`` twice, with the C loops and with ``FP8REF_NO_KERNELS`` set, and requires
the same codes and scales byte for byte. The exact ('fp8ref') loop is also checked against the
Fraction oracle where its range arguments matter (huge and tiny quotients, all modes).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from fp8ref import _arrays, _native, _native_quant, quant
from fp8ref.errors import EncodeError
from fp8ref.formats import FORMATS
from fp8ref.quant import QuantArgs, quantize
from fp8ref.scaling import reduce_amax
from tests.support.oracle import DETERMINISTIC as MODES
from tests.support.quant_oracle import oracle_codes

pytestmark = pytest.mark.skipif(not _native.kernels_available(), reason="C loops not built or FP8REF_NO_KERNELS set")

DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}


def both(monkeypatch, x, args, *, into=False, **kw):
    """(C result, numpy result) of the same quantize call; ``into``: the C one into a given out=
    (``"aligned"``: one that starts on a cache line, as the streamed band rows need)."""
    out = None
    if into:
        out = _arrays.aligned_empty(np.shape(x), np.uint8) if into == "aligned" else np.empty(np.shape(x), np.uint8)
        out.fill(0xAB)
    fast = quantize(x, args, out=out, **kw)
    with monkeypatch.context() as m:
        m.setenv("FP8REF_NO_KERNELS", "1")  # read at call time
        slow = quantize(x, args, **kw)
    return fast, slow


def assert_same(fast, slow):
    fc, sc = np.asarray(fast.codes), np.asarray(slow.codes)
    assert fc.dtype == np.uint8
    assert np.array_equal(fc, sc), f"{int((fc != sc).sum())} codes differ"
    assert fast.scale_dtype == slow.scale_dtype
    fs, ss = (np.asarray(v, np.float32) for v in (fast.scale, slow.scale))
    assert np.array_equal(fs.view(np.uint32), ss.view(np.uint32))


def weights(shape, dtype, seed, spread=True):
    """Normal weights whose rows span many binades (tiny to huge scales per row)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape)
    if spread:
        span = 8 if dtype == "float16" else 30  # float16 overflows past 2**16
        x *= 2.0 ** rng.integers(-span, span, size=shape[:-1] + (1,))
    x = x.astype(DTYPES[dtype])
    if x.size > 3:
        x.reshape(-1)[:2] = [0.0, -0.0]
    return x


def args_for(gran, **kw):
    extra = {"group": {"group_size": 24}, "block": {"block_shape": (8, 48)}}.get(gran, {})
    return QuantArgs(granularity=gran, **extra, **kw)


# --- every recipe, granularity, dtype: C loop == numpy path ------------------------------------
RECIPE_GRANS = [("fp8ref", g) for g in ("tensor", "channel", "token", "group", "block")] + \
    [("compressed-tensors", g) for g in ("tensor", "channel", "group", "block")] + \
    [("auto-round", g) for g in ("tensor", "channel")] + [("hf-fp8", "tensor"), ("vllm-dynamic", "token"),
                                                          ("fbgemm", "channel")]


@pytest.mark.parametrize("recipe,gran,shape", [(r, g, s) for r, g in RECIPE_GRANS
                                                for s in [(37, 100), (3, 19, 53), (1, 1), (250,)]
                                                if g != "block" or len(s) > 1])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_c_loop_matches_numpy(monkeypatch, recipe, gran, shape, dtype):
    x = weights(shape, dtype, seed=len(shape) * 7 + len(recipe))
    assert_same(*both(monkeypatch, x, args_for(gran), recipe=recipe))


def test_hf_fp8_blocks_match_numpy(monkeypatch):
    x = weights((64, 256), "bfloat16", seed=5)
    assert_same(*both(monkeypatch, x, QuantArgs(granularity="block", block_shape=(32, 128)), recipe="hf-fp8"))


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
                                 "float6_e2m3fn", "float4_e2m1fn"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("saturate", [True, False])
def test_exact_loop_every_mode_and_format(monkeypatch, fmt, mode, saturate):
    x = weights((24, 96), "bfloat16", seed=11)
    for gran in ("channel", "group"):
        assert_same(*both(monkeypatch, x, args_for(gran, format=fmt, rounding=mode, saturate=saturate)))


# --- every 16-bit input pattern, with scales that push quotients everywhere ----------------------
def all_patterns(dtype, finite_only):
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    x = bits.view(DTYPES[dtype])
    if finite_only:
        x = x[np.isfinite(x.astype(np.float32))]
    return x.reshape(1, -1)


SCALES = [1.0, 3.0, 0.7, 2.0, 2.0 ** 12, 2.0 ** -3, 1.3 * 2.0 ** -20, 1.1 * 2.0 ** 20, 2.0 ** -126, 1e-45]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("recipe", ["compressed-tensors", "auto-round", "hf-fp8", "vllm-static"])
def test_producer_loop_on_every_pattern(monkeypatch, dtype, recipe):
    """NaN/Inf/-0/subnormals propagate as the numpy model does; model-dtype rounding of the
    quotient (bf16 and fp16: subnormal results, ties, overflow to Inf) is exercised by the scales."""
    x = all_patterns(dtype, finite_only=False)
    for s in SCALES:
        scale = np.array([np.float32(s)])
        assert_same(*both(monkeypatch, x, QuantArgs(granularity="tensor", dynamic=False), recipe=recipe,
                          scale=scale))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("mode", MODES)
def test_exact_loop_on_every_pattern(monkeypatch, dtype, mode):
    x = all_patterns(dtype, finite_only=True)
    for s in SCALES:
        for fmt in ("float8_e4m3fn", "float8_e5m2"):
            args = QuantArgs(format=fmt, granularity="tensor", dynamic=False, rounding=mode, saturate=False)
            assert_same(*both(monkeypatch, x, args, scale=np.array([np.float32(s)])))


def test_float32_extremes_against_numpy(monkeypatch):
    """float32 subnormals, the largest finite values, exact ties of fp8 midpoints."""
    f32 = np.array([1e-45, -1e-45, 1.2e-38, 3.4028235e38, -3.4028235e38, 0.0, -0.0, 464.0, -464.0,
                    480.0, 0.001953125, 0.0009765625, 0.00146484375], np.float32).reshape(1, -1)
    for s in (1.0, 1e-45, 2.0 ** -126, 3.4e38, 0.5):
        for recipe in ("fp8ref", "compressed-tensors", "auto-round"):
            args = QuantArgs(granularity="tensor", dynamic=False)
            assert_same(*both(monkeypatch, f32, args, recipe=recipe, scale=np.array([np.float32(s)])))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2", "float4_e2m1fn"])
def test_exact_loop_against_oracle_at_range_ends(mode, fmt):
    """Quotients far above max and far below the smallest subnormal (the C loop's shift clamps),
    and exact ties, against the Fraction oracle."""
    x = np.array([3.4028235e38, -3.4028235e38, 1e-45, -1e-45, 448.0, -0.0, 0.0, 5.0, 0.75, 1.0 + 2.0 ** -23],
                 np.float32).reshape(1, -1)
    for s in (np.float32(1e-45), np.float32(3.4e38), np.float32(0.25), np.float32(2.0 ** -126)):
        for saturate in (True, False):
            q = quantize(x, QuantArgs(format=fmt, granularity="tensor", dynamic=False, rounding=mode,
                                      saturate=saturate), scale=np.array([s]))
            assert np.array_equal(q.codes, oracle_codes(x, s, FORMATS[fmt], saturate=saturate, rounding=mode))


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2", "float4_e2m1fn"])
@pytest.mark.parametrize("mode", MODES)
def test_exact_loop_on_and_beside_every_decision_point(fmt, mode):
    """The exact loop's float32 path (q = |x| * fp32(1/s), nearest decision point, exact residual
    sign) where it is hardest: quotients exactly on every grid point and midpoint, and one float32
    ulp either side, for scales that are not powers of two, against the Fraction oracle."""
    f = FORMATS[fmt]
    grid = np.unique(np.abs(quant.decode(np.arange(f.n_codes, dtype=np.uint8), f)))
    grid = grid[np.isfinite(grid)].astype(np.float64)
    points = np.unique(np.concatenate([grid, (grid[1:] + grid[:-1]) / 2, [grid[-1] * 1.0625]]))
    for s in (np.float32(3 * 2.0 ** -10), np.float32(0.7), np.float32(1.1 * 2.0 ** 20), np.float32(2.0 ** -100)):
        on = (points * np.float64(s)).astype(np.float32)  # exact where points * s fits float32
        x = np.concatenate([on, np.nextafter(on, np.float32(np.inf)), np.nextafter(on, np.float32(0))])
        x = np.concatenate([x, -x]).reshape(1, -1)
        for saturate in (True, False):
            q = quantize(x, QuantArgs(format=fmt, granularity="tensor", dynamic=False, rounding=mode,
                                      saturate=saturate), scale=np.array([s]))
            want = oracle_codes(x, s, f, saturate=saturate, rounding=mode)
            assert np.array_equal(q.codes, want), f"s={s} sat={saturate}: {int((q.codes != want).sum())} differ"


# --- threads and amax ---------------------------------------------------------------------------
@pytest.mark.parametrize("recipe", ["fp8ref", "compressed-tensors"])
def test_split_across_threads_matches_numpy(monkeypatch, recipe):
    x = weights((1100, 1024), "bfloat16", seed=2)  # > 2**20 elements: several row spans
    for gran in ("channel", "tensor", "block"):
        extra = {"block_shape": (128, 128)} if gran == "block" else {}
        assert_same(*both(monkeypatch, x, QuantArgs(granularity=gran, **extra), recipe=recipe))


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("gran,extra", [("tensor", {}), ("channel", {}), ("group", {"group_size": 7}),
                                        ("block", {"block_shape": (3, 5)})])
def test_c_amax_matches_reduce_amax(dtype, gran, extra):
    x = weights((2, 11, 23), dtype, seed=9)
    x[0, 4, 6], x[1, 2, 0], x[1, 9, 22] = np.nan, -np.inf, np.inf
    arr = x.view(np.uint16) if dtype == "bfloat16" else x  # what quantize hands over (_arrays.float_input)
    got = _native_quant.c_amax(arr, dtype, QuantArgs(granularity=gran, **extra))
    want = reduce_amax(x, gran, **extra)
    assert got.shape == want.shape and got.dtype == np.float64
    assert np.array_equal(got, want, equal_nan=True)


def test_nan_weights_are_rejected_by_the_fp8ref_recipe_with_the_c_loops():
    x = weights((4, 64), "bfloat16", seed=1)
    x[2, 5] = np.nan
    with pytest.raises(EncodeError, match=r"first at index \(2, 5\)"):
        quantize(x, QuantArgs(granularity="channel"))


@pytest.mark.parametrize("dtype,tie", [("float16", 2.0 ** -11), ("bfloat16", 2.0 ** -8)])
def test_model_dtype_ties_against_torch(monkeypatch, dtype, tie):
    """compressed-tensors rounds the fp32 quotient to D before e4m3: quotients exactly halfway between
    two D values next to an e4m3 midpoint (1.0625 + tie: RNE in D goes down to the midpoint, which e4m3
    then rounds down; any other D rounding gives 1.125). Checked against torch's own casts."""
    import torch

    tdtype = getattr(torch, dtype)
    x = torch.arange(1.0, 2.0, 2.0 ** -7).to(tdtype).float().numpy()
    xs, ss = [], []
    for target in (1.0625 + tie, 1.0625 - tie, 2.125 + 2 * tie, 1.1875 + tie):
        s = (x / np.float32(target)).astype(np.float32)
        hit = (x / s).astype(np.float32) == np.float32(target)  # fp32 quotient is exactly the D tie
        xs.append(x[hit])
        ss.append(s[hit])
    xv, sv = np.concatenate(xs), np.concatenate(ss)
    assert xv.size > 20
    w = torch.from_numpy(np.stack([xv, -xv], axis=1)).to(tdtype)
    scale = torch.from_numpy(sv.reshape(-1, 1))
    fast, slow = both(monkeypatch, w, QuantArgs(granularity="channel", dynamic=False), recipe="compressed-tensors",
                      scale=scale)
    assert_same(fast, slow)
    peer = ((w.float() / scale).to(tdtype) + 0).clamp(-448, 448).float().to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(fast.codes, peer)


# --- the one-pass loop (16-bit input, dynamic scales: amax, table operand, codes per tile) ---------
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("recipe,gran", [("fp8ref", "channel"), ("fp8ref", "block"), ("compressed-tensors", "channel"),
                                         ("compressed-tensors", "group"), ("auto-round", "channel"),
                                         ("hf-fp8", "block"), ("fbgemm", "channel"), ("vllm-dynamic", "token")])
def test_one_pass_loop_on_zero_and_nonfinite_tiles(monkeypatch, dtype, recipe, gran):
    """All-zero rows/blocks (amax 0: the exact loop cannot take the operand, the general path runs),
    NaN/Inf rows (producer recipes: NaN operands), tiny and huge rows, partial blocks, 3-D."""
    x = weights((2, 21, 260), dtype, seed=4)
    x[0, 3] = 0.0
    x[1, 8:16, :128] = -0.0
    x[0, 5] *= 2.0 ** -20
    producer = recipe != "fp8ref"
    if producer:
        x[0, 7, 9], x[1, 2, 0], x[1, 20, 259] = np.nan, -np.inf, np.inf
    args = args_for(gran) if gran != "block" else QuantArgs(granularity="block", block_shape=(8, 128))
    if recipe == "hf-fp8":
        x = x[:, :16, :256]  # the recipe requires whole blocks
    assert_same(*both(monkeypatch, x, args, recipe=recipe))


def test_one_pass_loop_is_the_path_taken(monkeypatch):
    """Dynamic 16-bit channel/block quantize does not fall back to the two-pass loop (a silent
    fallback would halve the speed and leave the one-pass loop untested)."""
    def two_pass(*args, **kw):
        raise AssertionError("the two-pass loop ran")

    x = weights((64, 256), "bfloat16", seed=3)
    want = quantize(x, QuantArgs(granularity="channel"))
    monkeypatch.setattr(_native_quant, "c_quantize", two_pass)
    monkeypatch.setattr(quant, "_amax", two_pass)
    for gran in ("channel", "group", "block"):
        quantize(x, args_for(gran))
    assert np.array_equal(quantize(x, QuantArgs(granularity="channel")).codes, want.codes)


_FUSED_GRANS = {"channel": {}, "token": {}, "group": {"group_size": 24}, "block": {"block_shape": (3, 200)}}


def _element_recipes():
    from fp8ref.recipes import Recipe
    from fp8ref.registry import get_recipe, recipe_names

    return [n for n in recipe_names()
            if isinstance(get_recipe(n), Recipe) and set(get_recipe(n).granularities) & set(_FUSED_GRANS)]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("recipe", _element_recipes())
def test_one_pass_scales_of_every_recipe(monkeypatch, dtype, recipe):
    """The one-pass loop's stored scales come from a per-magnitude table (compute_scale once per
    recipe, format and dtype): every element-scale recipe's scales and codes, at each granularity
    it takes, against the numpy path, which computes the scales from its own amax. Rows span
    binades; one is all zero."""
    from fp8ref.registry import get_recipe

    rec = get_recipe(recipe)
    fmt = "float8_e4m3fn" if not rec.formats or "float8_e4m3fn" in rec.formats else rec.formats[0]
    x = weights((9, 600), dtype, seed=17)
    x[4] = 0.0
    for gran in set(rec.granularities) & set(_FUSED_GRANS):
        assert_same(*both(monkeypatch, x, QuantArgs(granularity=gran, format=fmt, **_FUSED_GRANS[gran]),
                          recipe=recipe))


# --- bfloat16 by thresholds (segment_tab in _csrc/quant.c) -------------------------------------
# Runs of >= 512 bfloat16 inputs sharing one operand, rounded to nearest even, take the table loop
# (VBMI where the CPU has it; FP8REF_NO_VBMI forces the portable one): both against the numpy path.
TABLE_RECIPES = ["fp8ref", "compressed-tensors", "auto-round", "hf-fp8", "vllm-static", "fbgemm", "modelopt-fp8"]


def _recipe_formats(name):
    from fp8ref.registry import get_recipe

    return [f for f in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
            if not get_recipe(name).formats or f in get_recipe(name).formats]


def _loop(monkeypatch, loop) -> bool:
    """The table loop's variants: VBMI, the loop without it (AVX-512BW in the x86-64-v4 object, else
    AVX2 or the compiler's), and the x86-64-v3 object's AVX2 loop (bound here as FP8REF_ISA would;
    the `level` fixture restores the level), each also writing around the cache (into an out=, the
    size threshold lowered to 0, so that every output streams). True: pass out=."""
    if loop.startswith(("portable", "avx2")):
        monkeypatch.setenv("FP8REF_NO_VBMI", "1")
    if loop.startswith("avx2"):
        if "x86-64-v3" not in _native.runnable_levels():
            pytest.skip("the x86-64-v3 loops are not built or this CPU does not run them")
        _native.use_level("x86-64-v3")
    if loop.endswith("-stream"):
        monkeypatch.setattr(_arrays, "STREAM_BYTES", 0)
    return loop.endswith("-stream")


@pytest.fixture(autouse=True)
def level():
    """The level bound before each test, bound again after it (_loop may bind x86-64-v3)."""
    bound = _native.build_info()["isa"] if _native.kernels_available() else None
    yield
    if bound and _native.build_info()["isa"] != bound:
        _native.use_level(bound)


LOOPS = ["vbmi", "vbmi-stream", "portable", "portable-stream", "avx2", "avx2-stream"]


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("recipe,fmt", [(r, f) for r in TABLE_RECIPES for f in _recipe_formats(r)])
def test_table_loop_on_every_bf16_pattern(monkeypatch, loop, recipe, fmt):
    """All 65,536 bfloat16 patterns (NaN/Inf too where the recipe takes them) in runs of one operand
    each: scales that put the smallest-normal binade E_b anywhere (or nowhere), overflow in and
    out of reach, tiny and huge, saturating or not (where the recipe leaves it to the caller)."""
    into = _loop(monkeypatch, loop)
    x = all_patterns("bfloat16", finite_only=recipe == "fp8ref")
    scales = np.array([[s] for s in SCALES + [2.0 ** 100, 448.0, 3.5e-3, 1.7e-38]], np.float32)
    x = np.repeat(x, len(scales), axis=0)
    from fp8ref.registry import get_recipe

    grans = get_recipe(recipe).granularities
    if not grans or "channel" in grans:
        runs = [({"granularity": "channel"}, x, scales)]
    elif "block" in grans:
        runs = [({"granularity": "block", "block_shape": (1, x.shape[1])}, x, scales)]
    else:  # per tensor only: one call per scale
        runs = [({"granularity": "tensor"}, x[:1], s) for s in scales]
    for saturate in (True, False):
        for gran, xs, ss in runs:
            args = QuantArgs(format=fmt, dynamic=False, saturate=saturate, **gran)
            assert_same(*both(monkeypatch, xs, args, into=into, recipe=recipe, scale=ss))


def _window_scales() -> list[float]:
    """Scales that move the table's 2^M steps over the mantissa (the AVX2 loop's windows of 16,
    its three lookups) through many phases: 40 log-uniform draws and 16 mantissas of one binade;
    and scales that put the largest finite bfloat16 just below, at and just above the e4m3 maximum
    448 and the 464 midpoint past it (saturation and overflow). Every bfloat16 pattern meets each, so
    the inputs also fill the formats' subnormal range and its boundary."""
    rng = np.random.default_rng(26)
    draws = [float(np.float32(2.0 ** e)) for e in rng.uniform(-140.0, 120.0, 40)]
    phases = [float(np.float32(1.0 + i / 16)) for i in range(16)]
    big = float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)
    edges = [float(v) for t in (448.0, 464.0) for s in [np.float32(big / t)]
             for v in (np.nextafter(s, np.float32(0)), s, np.nextafter(s, np.float32(np.inf)))]
    return draws + phases + edges


@pytest.mark.parametrize("loop", ["portable", "portable-stream", "avx2", "avx2-stream"])
@pytest.mark.parametrize("recipe,fmt", [(r, f) for r in ("fp8ref", "compressed-tensors", "hf-fp8")
                                        for f in ("float8_e4m3fn", "float8_e5m2") if f in _recipe_formats(r)])
def test_table_windows_on_every_bf16_pattern(monkeypatch, loop, recipe, fmt):
    """The table loops without VBMI (tab_run_bw in the x86-64-v4 object, tab_run_avx2 in x86-64-v3's)
    on all 65,536 bfloat16 patterns x 62 scales, saturating or not, against the numpy path."""
    into = _loop(monkeypatch, loop)
    x = all_patterns("bfloat16", finite_only=recipe == "fp8ref")
    scales = np.array([[s] for s in _window_scales()], np.float32)
    x = np.repeat(x, len(scales), axis=0)
    from fp8ref.registry import get_recipe

    grans = get_recipe(recipe).granularities
    gran = {"granularity": "channel"} if not grans or "channel" in grans else \
        {"granularity": "block", "block_shape": (1, x.shape[1])}
    for saturate in (True, False):
        args = QuantArgs(format=fmt, dynamic=False, saturate=saturate, **gran)
        assert_same(*both(monkeypatch, x, args, into=into, recipe=recipe, scale=scales))


def _takes(recipe, gran):
    from fp8ref.registry import get_recipe

    grans = get_recipe(recipe).granularities
    return not grans or gran in grans


_WEIGHT_GRANS = [("channel", {}), ("tensor", {}), ("block", {"block_shape": (32, 128)}),
                 ("block", {"block_shape": (128, 128)}), ("group", {"group_size": 512})]


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("recipe,gran,extra", [(r, g, e) for r in ("fp8ref", "compressed-tensors", "hf-fp8")
                                               for g, e in _WEIGHT_GRANS if _takes(r, g)])
def test_table_loop_on_weights(monkeypatch, loop, recipe, gran, extra):
    """Dynamic scales on weights whose rows span 60 binades, with zeros, subnormals and a K that is
    not a multiple of the 64-input vector step nor of the block (128x128 blocks: whole tiles, which
    the amax pass gathers for the table loops, a band of 100 rows, gathered too, and a ragged last
    tile, which is not); per channel also rows longer than a loop call's 8,192 inputs (a whole piece
    and a ragged one)."""
    into = _loop(monkeypatch, loop)
    from fp8ref.registry import get_recipe

    divisible = get_recipe(recipe).require_divisible  # hf-fp8: whole blocks only
    shapes = [(256, 1152) if divisible else (228, 1100)] + ([(12, 8192 + 1100)] if gran == "channel" else [])
    for shape in shapes:
        x = weights(shape, "bfloat16", seed=3)
        x[5, :300] = 0.0
        x[7, 100:700] = (np.arange(600) * 2.0 ** -133).astype(ml_dtypes.bfloat16)  # bf16 subnormals
        x[9] *= ml_dtypes.bfloat16(2.0 ** -100)
        assert_same(*both(monkeypatch, x, QuantArgs(granularity=gran, **extra), into=into, recipe=recipe))


@pytest.mark.parametrize("loop", ["vbmi-stream", "portable-stream", "avx2-stream"])
@pytest.mark.parametrize("shape,block", [((300, 1152), (128, 128)), ((256, 8192 + 1024), (128, 128)),
                                         ((5, 64 * 600), (2, 64)), ((96, 640), (32, 64)),
                                         ((6, 256), (2, 128))])
def test_block_band_rows(monkeypatch, loop, shape, block):
    """Blocks whose codes stream from aligned lines go band by band, row by row through every
    group's table (bands_fused's band rows, band_row_* in _csrc/quant.c): a ragged last band, more
    than 64 groups in a row (a band's groups on the heap: unit_groups), more than UNIT_GROUPS (2x64
    blocks 600 to a row: units of 512 and 88 groups), 32x64 and 2x128 blocks; rows spanning 60
    binades, an all-zero tile (its scale 1, as the recipes' for an amax of 0) and bf16 subnormals."""
    _loop(monkeypatch, loop)
    x = weights(shape, "bfloat16", seed=11)
    x[: block[0], : block[1]] = 0.0
    x[1, 64:200] = (np.arange(136) * 2.0 ** -133).astype(ml_dtypes.bfloat16)
    args = QuantArgs(granularity="block", block_shape=block)
    whole = shape[0] % block[0] == 0 and shape[1] % block[1] == 0
    for recipe in ("fp8ref", "hf-fp8") if whole else ("fp8ref",):  # hf-fp8: whole blocks only
        fast = quantize(x, args, recipe=recipe, out=_arrays.aligned_empty(shape, np.uint8))
        with monkeypatch.context() as m:
            m.setenv("FP8REF_NO_KERNELS", "1")
            slow = quantize(x, args, recipe=recipe)
        assert_same(fast, slow)


@pytest.mark.parametrize("loop", ["vbmi-stream", "portable-stream", "avx2-stream"])
@pytest.mark.parametrize("gran", ["block", "channel"])
def test_band_rows_nonfinite(monkeypatch, loop, gran):
    """Band rows test each step for v = 0 alone (no v = 255 lanes) where every group's amax is below
    v = 255 (bands_fused's `ok`); a group holding an Inf or a NaN (and so an amax above it) goes by
    tiles, whose steps test both. Blocks and channels (a channel's NaN row within a fused run): a
    NaN, +-Inf, and the largest finite bfloat16 beside small inputs, one and two per group, in
    producer recipes (which keep NaN and Inf as their tools do)."""
    _loop(monkeypatch, loop)
    x = weights((256, 1024), "bfloat16", seed=19)
    big = ml_dtypes.finfo(ml_dtypes.bfloat16).max
    x[3, 5], x[130, 700], x[200, 300], x[201, 301] = np.nan, np.inf, -np.inf, big
    x[140, 900] = -big
    args = QuantArgs(granularity=gran, **({"block_shape": (128, 128)} if gran == "block" else {}))
    from fp8ref.registry import get_recipe

    for recipe in ("compressed-tensors", "hf-fp8", "auto-round"):  # fp8ref's recipe refuses NaN/Inf
        if gran not in get_recipe(recipe).granularities:
            continue
        fast = quantize(x, args, recipe=recipe, out=_arrays.aligned_empty(x.shape, np.uint8))
        with monkeypatch.context() as m:
            m.setenv("FP8REF_NO_KERNELS", "1")
            slow = quantize(x, args, recipe=recipe)
        assert_same(fast, slow)


@pytest.mark.parametrize("loop", ["vbmi-stream", "portable-stream", "avx2-stream", "avx2"])
def test_band_rows_overflow(monkeypatch, loop):
    """The AVX2 and AVX-512BW band-row steps leave out the overflow rule where no group's amax codes
    past the overflow code (tab_no_overflow). compressed-tensors' scale amax / 448 is a float32 subnormal for
    amaxes near 2^-124: rounded there, it puts the amax, and the inputs beside it, past 448 (checked
    here), so those rows must saturate as the numpy path does."""
    _loop(monkeypatch, loop)
    x = weights((64, 1024), "bfloat16", seed=23, spread=False)
    for r in range(16):  # amaxes 2^-124 (1 + r/16): scales amax / 448, float32 subnormals near 2^-133
        x[r] *= ml_dtypes.bfloat16(2.0 ** -124 * (1 + r / 16) / float(np.abs(x[r].astype(np.float32)).max()))
    fast, slow = both(monkeypatch, x, QuantArgs(granularity="channel"), into="aligned", recipe="compressed-tensors")
    quotient = np.abs(x.astype(np.float64)) / np.asarray(slow.scale, np.float64).reshape(-1, 1)
    assert (quotient[:16] > 464).any()  # past 448 and the midpoint beyond it: the overflow rule decides
    assert_same(fast, slow)


@pytest.mark.parametrize("loop", ["vbmi-stream", "portable-stream", "avx2-stream", "avx2"])
def test_tensor_band_rows_overflow(monkeypatch, loop):
    """Per tensor, rows go by band rows under the tensor's amax (quant_job.bound), the overflow rule
    left out only where that amax codes past no overflow: whole weights scaled to amaxes 2^-124 (1 +
    r/16), some of which put inputs past 464 (checked), each against the numpy path."""
    _loop(monkeypatch, loop)
    base = weights((64, 1024), "bfloat16", seed=29, spread=False)
    top = float(np.abs(base.astype(np.float32)).max())
    past = 0
    for r in range(16):
        x = (base.astype(np.float32) * np.float32(2.0 ** -124 * (1 + r / 16) / top)).astype(ml_dtypes.bfloat16)
        fast, slow = both(monkeypatch, x, QuantArgs(granularity="tensor"), into="aligned", recipe="compressed-tensors")
        scale = float(np.asarray(slow.scale, np.float64).reshape(-1)[0])
        past += int((np.abs(x.astype(np.float64)) / scale > 464).any())
        assert_same(fast, slow)
    assert past  # the overflow rule decided somewhere


def _zero_heavy_rows(seed, top=250):
    """24 rows of 12,288: each holds every bfloat16 magnitude of the 41 binades up to its largest,
    (E_top, 127), E_top from 90 to `top`, with both signs, and 1,792 +-0, shuffled: every
    input below, at and above the table's first binade E_b (about E_top - 15 for e4m3), the inputs
    2^(7-M) binades or more below E_b (whose v saturates at -128) and those just above them."""
    rng = np.random.default_rng(seed)
    rows = []
    for e_top in np.linspace(90, top, 24).astype(int):
        mags = (np.arange(e_top - 40, e_top + 1)[:, None] << 7 | np.arange(128)).reshape(-1).astype(np.uint16)
        bits = np.concatenate([mags, mags | 0x8000, np.zeros(1536, np.uint16), np.full(1536, 0x8000, np.uint16)])
        rows.append(rng.permutation(np.resize(bits, 12288)))
    return np.stack(rows).view(ml_dtypes.bfloat16)


_ZERO_RECIPES = [("fp8ref", "float8_e4m3fn"), ("fp8ref", "float8_e5m2"), ("fp8ref", "float8_e4m3fnuz"),
                 ("compressed-tensors", "float8_e4m3fn"), ("auto-round", "float8_e4m3fn")]


@pytest.mark.parametrize("loop", ["vbmi-stream", "portable-stream", "avx2-stream", "avx2"])
@pytest.mark.parametrize("force", ["1", None])
@pytest.mark.parametrize("recipe,fmt,gran", [(r, f, g) for r, f in _ZERO_RECIPES
                                             for g in ("channel", "block", "tensor") if _takes(r, g)])
def test_band_rows_take_zeros(monkeypatch, loop, force, recipe, fmt, gran):
    """Band rows of a task whose first row holds many +-0 take them without a branch (STEP_ZEROS in
    _csrc/quant.c: v signed, -128 taking +-0's codes), by zeros_heavy's choice or forced
    (FP8REF_BAND_ZEROS=1), on every magnitude around the table's first binade; per tensor the tiles
    take them so too (the amax bounds every input: quant_job.bound); e4m3fnuz, whose -0 is +0's
    code, keeps the test and branch (its zero_n)."""
    into = _loop(monkeypatch, loop)
    if force:
        monkeypatch.setenv("FP8REF_BAND_ZEROS", force)
    extra = {"block_shape": (2, 128)} if gran == "block" else {}
    # per tensor one scale: a largest E_top of 150 keeps the tables' vector loops (their windows
    # must reach 31 binades past E_b below the first infinite quotient)
    x = _zero_heavy_rows(seed=27, top=150 if gran == "tensor" else 250)
    assert_same(*both(monkeypatch, x, QuantArgs(format=fmt, granularity=gran, **extra), into=into, recipe=recipe))


@pytest.mark.parametrize("loop", ["vbmi-stream", "portable-stream", "avx2-stream"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape,gran,extra", [((300, 1152), "channel", {}), ((40, 1152), "group", {"group_size": 128}),
                                              ((24, 64 * 130), "group", {"group_size": 64}),
                                              ((4, 3, 640), "channel", {})])
def test_next_unit_amax(monkeypatch, loop, threads, shape, gran, extra):
    """Band rows whose units fit in the caches (a channel, a row of groups) read the next unit for
    its amaxes while they compute their own codes (BAND_ROW in _csrc/quant.c): every row's amax
    differs (rows span 60 binades), a row of bf16 subnormals alone, an all-zero row (its scale 1),
    zeros and subnormals elsewhere; 130 groups of 64 (runs of 64, 64 and 2 groups: the next run of
    another shape), a 3-D tensor; one and two threads (the last unit of each task has no next)."""
    _loop(monkeypatch, loop)
    import torch

    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    monkeypatch.setattr(_native, "_PARALLEL_MIN", 1)  # split even these small weights
    x = weights(shape, "bfloat16", seed=13).reshape(-1, shape[-1])
    x[4] = (np.arange(x.shape[1]) % 100 * 2.0 ** -133).astype(ml_dtypes.bfloat16)
    x[5] = 0.0
    x[6, 64:200] = (np.arange(136) * 2.0 ** -133).astype(ml_dtypes.bfloat16)
    x[7, :300] = 0.0
    x = x.reshape(shape)
    args = QuantArgs(granularity=gran, **extra)
    fast = quantize(x, args, out=_arrays.aligned_empty(shape, np.uint8))
    with monkeypatch.context() as m:
        m.setenv("FP8REF_NO_KERNELS", "1")
        slow = quantize(x, args)
    assert_same(fast, slow)


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("gran,extra", [("channel", {}), ("block", {"block_shape": (32, 128)})])
@pytest.mark.parametrize("slots", [0, 8, 1])
def test_table_cache_on_repeated_and_colliding_scales(monkeypatch, loop, gran, extra, slots):
    """A task keeps its tables by operand (open addressing: tab_cache in _csrc/quant.c): rows and
    tiles whose amax repeats, in turns (A B A C B A ...), so that a table is found built, and found
    again after others; and 300 distinct amaxes. With the default slots (twice a task's operands, up
    to 1,024) they all fit; with 8
    probes run out and a slot is rebuilt for another operand, a band's later group taking an earlier
    one's (the band then goes by tiles); with one slot, what a failed allocation leaves, every
    operand rebuilds it. Into out= the codes start on a cache line, so that streamed blocks take
    the band rows (bands_fused), which need every group's table held at once."""
    into = _loop(monkeypatch, loop)
    monkeypatch.setattr(_native_quant, "TAB_SLOTS", slots)
    rng = np.random.default_rng(7)
    x = rng.standard_normal((384, 1024)) * 0.02
    peaks = np.array([0.75, 0.5, 0.8125, 1.5, 3.0 ** -9], np.float64)
    x[:, 0] = peaks[rng.integers(0, len(peaks), 384)]  # the amax of each row and of each tile's first
    x[:300, 1] = 2.0 ** rng.uniform(1.0, 3.0, 300)  # ... and 300 distinct ones above them
    x = x.astype(ml_dtypes.bfloat16)
    args = QuantArgs(granularity=gran, **extra)
    fast = quantize(x, args, out=_arrays.aligned_empty(x.shape, np.uint8) if into else None)
    with monkeypatch.context() as m:
        m.setenv("FP8REF_NO_KERNELS", "1")
        slow = quantize(x, args)
    assert_same(fast, slow)
