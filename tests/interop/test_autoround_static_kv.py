"""auto-round 0.16.1's static KV (``static_kv_dtype="fp8"``), produced by the real tool (interop env):
what it writes, that fp8ref's reference attention reads those scales, and that auto-round's own
reload drops them (docs/models.md, "auto-round's static KV")."""

from __future__ import annotations

import json

import numpy as np
import pytest

import fp8ref

pytestmark = pytest.mark.interop
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("auto_round")
pytest.importorskip("tokenizers")


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(128)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", pad_token="t0",
                                                eos_token="t1", bos_token="t2")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from auto_round import AutoRound

    root = tmp_path_factory.mktemp("ar_kv")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=128, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(root / "base")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(root / "base"), dtype=torch.bfloat16).eval()
    g = torch.Generator().manual_seed(77)
    data = [torch.randint(0, 128, (1, 16), generator=g) for _ in range(4)]
    ar = AutoRound(model, tokenizer=_tokenizer(), scheme="FP8_STATIC", iters=0, dataset=data, nsamples=4, seqlen=16,
                   batch_size=1, static_kv_dtype="fp8")
    ar.quantize_and_save(output_dir=str(root / "out"), format="auto_round")
    out = root / "out"
    return out if (out / "config.json").exists() else next(p for p in out.iterdir() if (p / "config.json").exists())


def test_auto_round_writes_per_tensor_kv_scales_that_fp8ref_reads(checkpoint):
    from safetensors.torch import load_file

    from fp8ref.nn.attention import kv_scales

    qc = json.loads((checkpoint / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "auto-round" and qc["static_kv_dtype"] == "fp8"
    assert qc["static_kv_granularity"] == "tensor"
    stored = {k: v for f in checkpoint.glob("*.safetensors") for k, v in load_file(str(f)).items()
              if k.endswith((".k_scale", ".v_scale"))}
    assert sorted(stored) == [f"model.layers.{i}.self_attn.{w}_scale" for i in range(2) for w in "kv"]
    assert all(v.dtype == torch.float32 and v.shape == (1,) and float(v) > 0 for v in stored.values())
    scales = kv_scales(fp8ref.load_checkpoint(checkpoint))
    assert sorted(scales) == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    for attn, s in scales.items():
        assert set(s) == {"k", "v"}  # no q_scale without static_attention_dtype
        for w in "kv":
            assert np.float32(s[w]).tobytes() == stored[f"{attn}.{w}_scale"].numpy().tobytes()


def test_auto_rounds_own_reload_drops_the_kv_scales(checkpoint):
    """transformers + auto-round 0.16.1 reload: k_scale / v_scale are unexpected keys, the attention
    modules get no scale and run unquantized K and V (no reload arithmetic to emulate)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.bfloat16).eval()
    for layer in model.model.layers:
        attn = layer.self_attn
        assert not hasattr(attn, "k_scale") and not hasattr(attn, "v_scale")
        assert [n for n, _ in attn.named_parameters(recurse=False)] == []


def test_producer_mode_is_auto_rounds_reload_and_reference_mode_uses_the_scales(checkpoint):
    """``producer``: bit for bit transformers + auto-round's reload (K and V unquantized, the scales
    dropped); ``reference``: the reference attention with the stored k/v scales, which changes the
    logits against the same model without KV quantization."""
    from fp8ref.nn import build_model
    from fp8ref.nn.attention import NAME

    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(5))
    tool = transformers.AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.bfloat16).eval()
    with torch.no_grad():
        theirs = tool(ids).logits
        producer = build_model(checkpoint, mode="producer")
        assert producer.config._attn_implementation == NAME  # the KV hook is installed, and passes K, V through
        ours = producer(ids).logits
        ref_kv = build_model(checkpoint, mode="reference")(ids).logits
        ref_plain = build_model(checkpoint, mode="reference", kv_cache=False)(ids).logits
    assert ours.dtype == theirs.dtype == torch.bfloat16
    assert torch.equal(ours.view(torch.int16), theirs.view(torch.int16))
    assert not torch.equal(ref_kv, ref_plain)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_producer_layers_equal_auto_rounds_reload_in_every_model_dtype(checkpoint, dtype):
    """auto-round's reload holds weight and scales as bfloat16 whatever the model dtype and the stored
    dtype (this checkpoint stores F32 scales: auto-round disables amp on a CPU without bf16; the
    committed fixture stores BF16): mode="producer" of every layer equals its QuantLinear bit for bit."""
    from pathlib import Path

    fixture = Path(__file__).resolve().parents[1] / "fixtures" / "interop" / "checkpoints" / "autoround_fp8_static"
    dt = getattr(torch, dtype)
    for folder in (checkpoint, fixture):
        ckpt = fp8ref.load_checkpoint(folder)
        tool = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=dt).eval()
        g = torch.Generator().manual_seed(1)
        for name in ckpt:
            lin = tool.get_submodule(name)
            assert lin.weight_scale.dtype == lin.input_scale.dtype == torch.bfloat16
            shape = (3, 7, lin.in_features)
            x = (torch.randn(shape, generator=g) * torch.exp(torch.randn(shape, generator=g))).to(dt)
            with torch.no_grad():
                want = lin(x)
            got = ckpt[name].forward(x, mode="producer")
            assert got.dtype == want.dtype and torch.equal(got, want), (folder.name, name)
