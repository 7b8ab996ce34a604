"""KV-cache quantization of fp8ref.nn.attention: the reference rule against torch's float8 cast,
the scales read from a compressed-tensors checkpoint fp8ref exports, and the attention hook in a
transformers model (skipped without transformers)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import fp8ref
from fp8ref.nn.attention import kv_scales, quantize_kv

CKPTS = Path(__file__).resolve().parents[1] / "fixtures" / "interop" / "checkpoints"
IDS = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(5))


@pytest.fixture(scope="module")
def kv_ckpt(tmp_path_factory):
    out = tmp_path_factory.mktemp("kv") / "out"
    cal = {f"model.layers.{i}.self_attn.{w}_scale": a for i in range(2) for w, a in (("k", 0.5), ("v", 0.25))}
    fp8ref.export_checkpoint(CKPTS / "original_bf16", out, {"scheme": "FP8_DYNAMIC", "ignore": ["lm_head"]},
                             calibration=cal)
    return fp8ref.load_checkpoint(out)


def test_reference_kv_rule_against_torch_cast():
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(2, 2, 12, 16, generator=g) * torch.exp(2 * torch.randn(2, 2, 12, 16, generator=g)))
    x = x.to(torch.bfloat16)
    x[0, 0, 0, :3] = torch.tensor([0.0, -0.0, 1e30])  # zero, negative zero, a value that saturates
    s = np.float32(0.0123)
    q = (x.float() / torch.tensor(s)).clamp(-448, 448).to(torch.float8_e4m3fn)
    expected = (q.double() * float(s)).to(torch.bfloat16)  # exact product, rounded once
    got = quantize_kv(x, s, "reference")
    assert got.dtype == torch.bfloat16 and torch.equal(got.view(torch.int16), expected.view(torch.int16))
    assert got[0, 0, 0, 2].item() == pytest.approx(448 * float(s), rel=2 ** -7)
    assert torch.equal(quantize_kv(x, s, "original"), x)


def test_kv_scales_of_an_exported_checkpoint(kv_ckpt):
    got = kv_scales(kv_ckpt)
    assert sorted(got) == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    for attn, d in got.items():
        for which in "kv":
            stored = np.asarray(kv_ckpt.tensor(f"{attn}.{which}_scale")).astype(np.float32).reshape(-1)
            assert d[which] == stored[0] and d[which].dtype == np.float32
    assert 0.5 / 448 * 0.99 < got["model.layers.1.self_attn"]["k"] < 0.5 / 448 * 1.01  # amax 0.5


def test_kv_attention_in_a_transformers_model(kv_ckpt):
    pytest.importorskip("transformers")
    from fp8ref.nn import build_model, set_mode

    orig = CKPTS / "original_bf16"
    model = build_model(kv_ckpt, mode="reference", original=orig)
    assert model.config._attn_implementation == "fp8ref_kv"
    plain = build_model(kv_ckpt, mode="reference", original=orig, kv_cache=False)
    assert plain.config._attn_implementation != "fp8ref_kv"
    with torch.no_grad():
        a, b = model(IDS).logits, plain(IDS).logits
        set_mode(model, "original")  # K and V unquantized in mode original
        set_mode(plain, "original")
        c, d = model(IDS).logits, plain(IDS).logits
    assert not torch.equal(a, b) and torch.equal(c, d)
