"""DecodedCodes: an operand whose float64 forms the exact model keeps between calls (scaled_mm's b,
linear's weight, Fp8RefLinear's weight). Every result is compared byte for byte with the same call
on the plain codes, which the general-path and Fraction-oracle tests of test_matmul_fast.py pin."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import fp8ref
from fp8ref import encode
from fp8ref.errors import FormatError
from fp8ref.matmul import DecodedCodes, exact_fast, linear, scaled_mm

CKPTS = Path(__file__).resolve().parents[2] / "fixtures" / "interop" / "checkpoints"


def same(x, y) -> None:
    x, y = np.asarray(x), np.asarray(y)
    assert x.dtype == y.dtype and x.shape == y.shape
    np.testing.assert_array_equal(x.view(np.uint8), y.view(np.uint8))


def problem(M=9, K=300, N=70, seed=0):
    rng = np.random.default_rng(seed)
    a = encode(rng.standard_normal((M, K)).astype(np.float32) * 4, "float8_e4m3fn")
    b = encode(rng.standard_normal((K, N)).astype(np.float32) * 4, "float8_e4m3fn")
    kb = -(-K // 128)
    layouts = {"tensor": (np.float32(0.3), np.float32(0.02)),
               "row": (rng.uniform(0.5, 2, (M, 1)).astype(np.float32), rng.uniform(0.5, 2, (1, N)).astype(np.float32)),
               "block": (rng.uniform(0.5, 2, (M, kb)).astype(np.float32),
                         rng.uniform(0.5, 2, (kb, -(-N // 128))).astype(np.float32))}
    return a, b, layouts, rng.standard_normal(N).astype(np.float32)


@pytest.fixture
def decodes(monkeypatch):
    """Counts the decodes of b (exact_fast._decode_b calls)."""
    calls = []
    real = exact_fast._decode_b

    def counted(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(exact_fast, "_decode_b", counted)
    return calls


@pytest.mark.parametrize("layout", ["tensor", "row", "block"])
@pytest.mark.parametrize("out", ["float32", "bfloat16", "float16", "float8_e4m3fn"])
def test_scaled_mm_with_decoded_b_equals_plain_codes_and_decodes_once(layout, out, decodes):
    a, b, layouts, bias = problem()
    sa, sb = layouts[layout]
    rec = DecodedCodes(b)
    want = scaled_mm(a, b, sa, sb, bias=bias, out_dtype=out)
    assert len(decodes) == 1
    for _ in range(3):
        same(scaled_mm(a, rec, sa, sb, bias=bias, out_dtype=out), want)
    assert len(decodes) == 2  # the plain call, then the record's first call only
    norms = 8 * -(-b.shape[0] // 128) * b.shape[1] if layout == "block" else 0  # (KB, N) block norms
    assert rec.nbytes_kept == 8 * b.size + norms


def test_transposed_record_is_linears_weight_and_matches_codes(decodes):
    """linear with a (N, K) weight record equals linear with the codes (whose b is now a transposed
    view, no copy), for every weight-scale layout and with another accumulation model too."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 300)).astype(np.float32)
    w = encode(rng.standard_normal((70, 300)).astype(np.float32), "float8_e4m3fn")
    rec = DecodedCodes(w)
    for ws in (np.float32(0.01), rng.uniform(0.005, 0.02, (70, 1)).astype(np.float32),
               rng.uniform(0.005, 0.02, (1, 3)).astype(np.float32)):
        for kw in ({"dynamic": "token"}, {"dynamic": "group"}, {"input_scale": np.float32(0.05)}):
            if ws.shape == (1, 3) and kw.get("dynamic") != "group":
                continue
            for acc in ("exact", "fp32"):
                same(linear(x, rec, ws, accumulate=acc, **kw), linear(x, w, ws, accumulate=acc, **kw))
    assert np.shares_memory(rec.T.codes, rec.codes) and rec.T.T.shape == w.shape


def test_a_new_scale_replaces_the_kept_form_and_the_codes_are_a_private_copy():
    a, b, layouts, _ = problem()
    sa, sb = layouts["block"]
    rec = DecodedCodes(b)
    first = scaled_mm(a, rec, sa, sb)
    b[:] = 0  # the caller's array changes: the record's codes do not
    same(scaled_mm(a, rec, sa, sb), first)
    with pytest.raises(ValueError):
        rec.codes[0, 0] = 1
    kept = rec.nbytes_kept
    scaled_mm(a, rec, sa, sb * np.float32(2))
    assert rec.nbytes_kept == kept and len(rec._cache) == 1  # the new form replaced the old one


def test_format_is_checked():
    b = np.zeros((4, 3), np.uint8)
    rec = DecodedCodes(b, "float8_e5m2")
    with pytest.raises(FormatError, match="DecodedCodes of float8_e5m2"):
        scaled_mm(np.zeros((2, 4), np.uint8), rec, np.float32(1), np.float32(1), fmt_b="float8_e4m3fn")


@pytest.mark.parametrize("fixture", ["llmc_fp8", "llmc_fp8_block", "autoround_fp8_static"])
def test_fp8reflinear_keeps_its_decoded_weight_and_gives_the_same_bytes(fixture, decodes):
    torch = pytest.importorskip("torch")
    from fp8ref.nn import Fp8RefLinear

    ckpt = fp8ref.load_checkpoint(CKPTS / fixture)
    name = next(iter(ckpt))
    kept, plain = Fp8RefLinear(ckpt[name], keep_decoded=True), Fp8RefLinear(ckpt[name])
    x = torch.randn(12, kept.in_features, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)  # M > 8
    for _ in range(3):
        assert torch.equal(kept(x).view(torch.int16), plain(x).view(torch.int16))
    assert len(decodes) == 1 + 3  # kept: the first call only; plain (the default): every call
    assert kept.decoded_weight().nbytes_kept == 8 * int(np.prod(ckpt[name].shape))
    assert plain.decoded_weight().nbytes_kept == 0  # the codes only (1 byte each)
    kept.release_decoded()
    kept(x)
    assert len(decodes) == 5
