"""The KV-cache variant suites (fp8-attention-head, fp8-attention-token-head, nvfp4-kv-attention):
a backend running fp8ref.attention with the kv_cache it is passed conforms bit for bit; backends
that take one scale for every head, one scale per tensor where one per token and head is asked,
or the NVFP4 block scales without the global one fail; torch's adapter declares
none of them. The reference itself is checked against a scalar oracle in
tests/unit/test_attention_kv_cache_oracle.py."""

from __future__ import annotations

import numpy as np
import pytest

from fp8ref import attention as ref
from fp8ref.conformance import Backend, run
from fp8ref.errors import BackendError
from fp8ref.golden import load_suite

SUITES = {"fp8-attention-head": ("kv-head", "qkv-head"), "fp8-attention-token-head": ("kv-token-head",),
          "nvfp4-kv-attention": ("kv-nvfp4", "qkv-nvfp4", "kv-nvfp4-mult")}
ALL = tuple(q for qs in SUITES.values() for q in qs)


class Correct(Backend):
    name = "kv-correct"
    capabilities = {"attention": {"quantize": ALL}}

    def attention(self, q, k, v, k_scale, v_scale, *, q_scale, fmt, causal, kv_cache="fp8"):
        out = ref.attention(q, k, v, k_scale, v_scale, dtype=q.dtype.name, fmt=fmt, causal=causal, q_scale=q_scale,
                            kv_cache=kv_cache)
        return out.astype(q.dtype)


class FirstHeadScale(Correct):
    """Uses head 0's scale for every head (a per-tensor kernel handed per-head scales)."""

    name = "kv-first-head"

    def attention(self, q, k, v, k_scale, v_scale, *, q_scale, fmt, causal, kv_cache="fp8"):
        if kv_cache == "fp8":
            k_scale, v_scale = k_scale[:1], v_scale[:1]
            q_scale = None if q_scale is None else q_scale[:1]
        return super().attention(q, k, v, k_scale, v_scale, q_scale=q_scale, fmt=fmt, causal=causal,
                                 kv_cache=kv_cache)


class PerTensorInstead(Correct):
    """One scale for the whole K (V): fp32(amax / 448) of the tensor, where one per token and head was asked."""

    name = "kv-per-tensor"

    def attention(self, q, k, v, k_scale, v_scale, *, q_scale, fmt, causal, kv_cache="fp8"):
        if kv_cache == "fp8_per_token_head":
            k_scale, v_scale = (np.float32(np.abs(np.asarray(x, np.float32)).max() / np.float32(448)) for x in (k, v))
            kv_cache = "fp8"
        return super().attention(q, k, v, k_scale, v_scale, q_scale=q_scale, fmt=fmt, causal=causal,
                                 kv_cache=kv_cache)


class NoGlobal(Correct):
    """NVFP4 K/V quantized with G = 1 (the block scales alone), dequantized the same way."""

    name = "kv-no-global"

    def attention(self, q, k, v, k_scale, v_scale, *, q_scale, fmt, causal, kv_cache="fp8"):
        if kv_cache.startswith("nvfp4"):
            k_scale = v_scale = np.ones(1, np.float32)
        return super().attention(q, k, v, k_scale, v_scale, q_scale=q_scale, fmt=fmt, causal=causal,
                                 kv_cache=kv_cache)


@pytest.mark.parametrize("suite_name", sorted(SUITES))
def test_the_reference_backend_conforms_and_torch_declares_none(suite_name):
    suite = load_suite(suite_name)
    r = run(Correct(), suite)
    assert r.compared() == len(r.results) > 0 and r.unexpected == 0
    assert all(not x.mismatches for x in r.results)
    t = run("torch", suite)
    assert {x.status for x in t.results} == {"not-implemented"} and t.unexpected == 0


@pytest.mark.parametrize("bad, suite_name", [(FirstHeadScale(), "fp8-attention-head"),
                                             (PerTensorInstead(), "fp8-attention-token-head"),
                                             (NoGlobal(), "nvfp4-kv-attention")])
def test_a_backend_with_another_cache_rule_fails(bad, suite_name):
    r = run(bad, load_suite(suite_name))
    failed = sum(1 for x in r.results if x.mismatches)
    assert r.compared() == len(r.results) and failed >= len(r.results) // 2, (bad.name, failed, len(r.results))


def test_a_backend_declaring_a_kv_cache_variant_must_take_kv_cache():
    class NoKeyword(Backend):
        name = "kv-no-keyword"
        capabilities = {"attention": {"quantize": ("kv", "kv-nvfp4")}}

        def attention(self, q, k, v, k_scale, v_scale, *, q_scale, fmt, causal):
            raise AssertionError("not called")

    with pytest.raises(BackendError, match=r"quantize kv-nvfp4, which pass kv_cache="):
        run(NoKeyword(), load_suite("nvfp4-kv-attention"))
