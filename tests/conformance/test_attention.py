"""The attention operation: fp8ref.attention against an independent oracle (Python's decimal
arithmetic at 50 digits, ml_dtypes' float8 cast for the codes), exp64 against decimal's correctly
rounded exp, torch's SDPA passing the float64-order tolerance bit for bit here, and broken
attentions (fp32 softmax, truncated K codes, no causal mask) failing it."""

from __future__ import annotations

import decimal
from decimal import Decimal

import ml_dtypes
import numpy as np
import pytest

from fp8ref import attention as ref
from fp8ref.conformance import Backend, default_xfails, run
from fp8ref.golden import parse_suite
from fp8ref.golden.ops import OPERATIONS
from fp8ref.golden.suite import cases

torch = pytest.importorskip("torch")

SUITE = parse_suite("""\
suite: attention-meta
seed: 5
operations:
  - op: attention
    dtypes: [bfloat16, float32]
    quantize: [kv, qkv]
    causal: [true, false]
    shapes: {1: [[1, 2, 1, 3, 5, 8], [1, 2, 2, 4, 4, 16]]}
""", source="attention-meta.yaml")
OP = OPERATIONS["attention"]


def _cases():
    for op, entry, name, params in cases(SUITE, 1):
        yield op.make_case(name, params, entry, SUITE, 1)


def test_exp64_against_decimal():
    x = -np.concatenate([np.linspace(0, 745, 20001), np.ldexp(1.0, -np.arange(60)), [0.5 * np.log(2)]])
    got = ref.exp64(x)
    with decimal.localcontext() as ctx:
        ctx.prec = 40
        want = np.array([float(Decimal(float(v)).exp()) for v in x])
    normal = want >= np.finfo(np.float64).tiny
    ulp = np.abs(got[normal] - want[normal]) / np.spacing(want[normal])
    assert ulp.max() <= 4, ulp.max()
    assert np.abs(got[~normal] - want[~normal]).max() <= 4 * 2.0 ** -1074
    assert ref.exp64(np.array([-np.inf]))[0] == 0.0 and ref.exp64(np.array([0.0]))[0] == 1.0


def _fp8_oracle(x, scale):
    """ml_dtypes' saturating e4m3fn cast of fp32(x / s), as exact float values (the peer)."""
    y = (np.asarray(x, np.float32) / np.float32(scale)).astype(np.float32)
    y = np.clip(y, -448, 448)
    return y.astype(ml_dtypes.float8_e4m3fn).astype(np.float64)


def _decimal_attention(case):
    """The real-number attention of the dequantized codes, in 50-digit decimal."""
    p, x = case.params, case.inputs
    B, H, Hkv, Tq, Tk, d = p["shape"]
    k, v = _fp8_oracle(x["k"], x["k_scale"][0]), _fp8_oracle(x["v"], x["v_scale"][0])
    q = np.asarray(x["q"], np.float64) if "q_scale" not in x else _fp8_oracle(x["q"], x["q_scale"][0])
    qs = Decimal(float(x["q_scale"][0])) if "q_scale" in x else Decimal(1)
    c1 = qs * Decimal(float(x["k_scale"][0])) / Decimal(d).sqrt()
    vs = Decimal(float(x["v_scale"][0]))
    out = np.zeros((B, H, Tq, d))
    with decimal.localcontext() as ctx:
        ctx.prec = 50
        for b in range(B):
            for h in range(H):
                g = h // (H // Hkv)
                for i in range(Tq):
                    keys = [j for j in range(Tk) if not p["causal"] or j <= i + Tk - Tq]
                    s = [c1 * sum(Decimal(float(q[b, h, i, t])) * Decimal(float(k[b, g, j, t])) for t in range(d))
                         for j in keys]
                    m = max(s)
                    e = [(sj - m).exp() for sj in s]
                    z = sum(e)
                    for t in range(d):
                        o = sum(ej * Decimal(float(v[b, g, j, t])) for ej, j in zip(e, keys)) / z * vs
                        out[b, h, i, t] = float(o)  # correctly rounded to float64
    return out


@pytest.mark.parametrize("case", list(_cases()), ids=lambda c: c.name)
def test_reference_equals_the_decimal_oracle(case):
    o64 = OP._run(case.params, case.inputs, unrounded=True)
    want = _decimal_attention(case)
    # the declared float64 order sits within 2**-40 of the real value (relative to the row's magnitude)
    mag = OP._run(case.params, case.inputs, v=np.abs(np.asarray(case.inputs["v"], np.float32)), unrounded=True)
    assert (np.abs(o64 - want) <= 2.0 ** -40 * mag).all()
    got = OP.reference(case.params, case.inputs)["out"].astype(np.float64)
    from fp8ref.rounding import round_to

    # rounded once to D: equal to the oracle's rounding except where the two straddle a boundary
    want_d = round_to(want, case.params["dtype"]).astype(np.float64)
    assert (got != want_d).mean() <= 0.01


def test_torch_sdpa_passes_the_tolerance_up_to_its_double_rounding():
    """torch's SDPA in float64 is within the tolerance; its float64 -> bf16 conversion rounds twice,
    which the judge names (double-rounding) and only the shipped xfail entry excuses."""
    strict = run("torch", SUITE)
    assert all(r.status == "compared" and r.rule == "float64-order tolerance" for r in strict.results)
    bad = [m for r in strict.results for m in r.mismatches]
    assert bad and all(m.tags == ("double-rounding",) and m.params["dtype"] == "bfloat16" for m in bad)
    assert all(not r.mismatches for r in strict.results if r.params["dtype"] == "float32")
    assert run("torch", SUITE, xfails=default_xfails("torch")).exit_code == 0


class _Attention(Backend):
    capabilities = {"attention": {"dtype": ("bfloat16", "float32")}}
    accumulation_order = {"attention": "unspecified"}

    def attention(self, q, k, v, k_scale, v_scale, *, q_scale, fmt, causal):
        from fp8ref.conformance.adapters.torch_backend import TorchBackend

        return TorchBackend().attention(q, k, v, k_scale, v_scale, q_scale=q_scale, fmt=fmt, causal=causal)


class Fp32Softmax(_Attention):
    """The whole attention in float32 (what a default torch model does): outside the tolerance."""

    name = "fp32-attention"

    def attention(self, q, k, v, k_scale, v_scale, *, q_scale, fmt, causal):
        out = super().attention(q, k, v, k_scale, v_scale, q_scale=q_scale, fmt=fmt, causal=causal)
        if out.dtype != np.float32:
            return out
        tq = torch.from_numpy(np.asarray(q, np.float32))
        kd = torch.from_numpy(_fp8_oracle(k, k_scale[0]).astype(np.float32)) * float(k_scale[0])
        vd = torch.from_numpy(_fp8_oracle(v, v_scale[0]).astype(np.float32)) * float(v_scale[0])
        if q_scale is not None:
            tq = torch.from_numpy(_fp8_oracle(q, q_scale[0]).astype(np.float32)) * float(q_scale[0])
        Tq, Tk = tq.shape[2], kd.shape[2]
        mask = (torch.arange(Tk)[None, :] <= torch.arange(Tq)[:, None] + (Tk - Tq)) if causal else None
        return torch.nn.functional.scaled_dot_product_attention(tq, kd, vd, attn_mask=mask,
                                                                enable_gqa=kd.shape[1] != tq.shape[1]).numpy()


class TruncatedK(_Attention):
    """K's codes rounded toward zero instead of to nearest even."""

    name = "truncated-k"

    def attention(self, q, k, v, k_scale, v_scale, *, q_scale, fmt, causal):
        from fp8ref import codec

        k32 = np.asarray(k, np.float32)
        kt = codec.decode(codec.encode((k32 / np.float32(k_scale[0])).astype(np.float32), fmt, rounding="rtz"), fmt)
        k2 = (kt.astype(np.float64) * float(k_scale[0])).astype(np.float32)  # K whose RNE codes are the RTZ ones
        return super().attention(q, k2.astype(k.dtype) if k.dtype == np.float32 else k, v, k_scale, v_scale,
                                 q_scale=q_scale, fmt=fmt, causal=causal)


class NoCausalMask(_Attention):
    name = "no-causal-mask"

    def attention(self, q, k, v, k_scale, v_scale, *, q_scale, fmt, causal):
        return super().attention(q, k, v, k_scale, v_scale, q_scale=q_scale, fmt=fmt, causal=False)


@pytest.mark.parametrize("backend, dtype, causal", [(Fp32Softmax(), "float32", None),
                                                    (TruncatedK(), "float32", None),
                                                    (NoCausalMask(), None, True)])
def test_broken_attentions_fail(backend, dtype, causal):
    result = run(backend, SUITE, xfails=default_xfails("torch"))  # torch's double rounding excused
    failing = {r.case for r in result.results if any(not result.xfailed(m.case, m.tags) for m in r.mismatches)}
    targeted = {r.case for r in result.results if r.status == "compared"
                and (dtype is None or r.params["dtype"] == dtype) and (causal is None or r.params["causal"] == causal)}
    assert targeted and failing == targeted, (failing, targeted)
    assert result.exit_code == 1


def test_golden_folder_checks_torch_outputs(tmp_path):
    """golden check with --accumulation-order unspecified judges attention by the same tolerance."""
    from fp8ref.conformance.adapters.torch_backend import TorchBackend
    from fp8ref.golden import check, generate
    from fp8ref.io.safetensors import dtype_name, write_safetensors

    generate(SUITE, tmp_path / "g")
    be = TorchBackend()
    outs = {}
    for case in _cases():
        x = case.inputs
        out = be.attention(x["q"], x["k"], x["v"], x["k_scale"], x["v_scale"], q_scale=x.get("q_scale"),
                           fmt=case.params["format"], causal=case.params["causal"])
        outs[f"{case.name}/out"] = (dtype_name(out), out)
    write_safetensors(tmp_path / "mine.safetensors", outs)
    results, _ = check(tmp_path / "g", tmp_path / "mine.safetensors", accumulation_order="unspecified")
    assert results and all(r.rule == "float64-order tolerance" for r in results)
    bad = [m for r in results for m in r.mismatches]
    assert all(m.tags == ("double-rounding",) for m in bad)  # torch's float64 -> bf16, as in the live run
