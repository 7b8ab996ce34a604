"""fp8ref.nn.experts with transformers (tox -e models): MoE experts placed and run from the
committed llm-compressor checkpoints and from a 64-expert model built here, the routed-only
forward, compare's per-expert rows, and the bad-input refusals. The tools' reloads are in
tests/interop/test_nn_moe_interop.py."""

from __future__ import annotations

import json
import re

import pytest

import fp8ref
from fp8ref.errors import ModelError
from tests.support.cli import run_cli
from tests.support.moe_checkpoints import CKPTS, rewrite

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
QWEN = CKPTS / "llmc_qwen3_moe_fp8_dynamic"
QWEN_BF16 = CKPTS / "moe_qwen3_moe_bf16"
IDS = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(3))


def _build(folder, mode="reference", **kw):
    from fp8ref.nn import build_model

    return build_model(folder, mode=mode, **kw)


@pytest.fixture(scope="module")
def wide_moe(tmp_path_factory):
    """A 64-expert top-2 Qwen3-MoE (one layer, random weights, seed 0) written by transformers and
    quantized FP8_DYNAMIC by fp8ref (the router left bf16)."""
    work = tmp_path_factory.mktemp("wide")
    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_experts=64,
                                      num_experts_per_tok=2, num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=1, head_dim=32, vocab_size=128, dtype="bfloat16")
    transformers.Qwen3MoeForCausalLM(cfg).to(torch.bfloat16).save_pretrained(work / "bf16")
    fp8ref.export_checkpoint(work / "bf16", work / "fp8", {"scheme": "FP8_DYNAMIC",
                                                           "ignore": ["lm_head", "re:.*mlp\\.gate$"]})
    return work / "fp8", work / "bf16"


def test_only_the_routed_experts_run(wide_moe):
    """64 experts, 2 x 9 tokens, top-2: each expert some token is routed to runs its three
    projections once, on exactly its tokens; no other expert runs."""
    from fp8ref.nn.experts import Fp8ExpertLinear

    model = _build(wide_moe[0])
    calls, routed = {}, {}
    for lin in model.modules():
        if isinstance(lin, Fp8ExpertLinear):
            lin.register_forward_hook(lambda m, a, y: calls.setdefault(m.name, []).append(a[0].shape[0]))
    router = model.model.layers[0].mlp.gate
    router.register_forward_hook(lambda m, a, out: routed.update(index=out[2]))
    with torch.no_grad():
        model(IDS)
    hit = torch.bincount(routed["index"].reshape(-1), minlength=64)
    expected = {f"model.layers.0.mlp.experts.{e}.{p}": [int(hit[e])] for e in range(64) if hit[e]
                for p in ("gate_proj", "up_proj", "down_proj")}
    assert calls == expected
    assert 0 < len(calls) // 3 < 64  # 18 tokens x 2: some experts are left out


def test_routed_forward_is_transformers_eager_forward(wide_moe):
    """The per-expert loop (what reference and backend modes run) is transformers' eager experts
    forward: on the original weights the two give the same bits."""
    model = _build(wide_moe[0], mode="original", original=wide_moe[1])
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(wide_moe[1]), dtype=torch.bfloat16,
                                                               experts_implementation="eager")
    ours, native = model.model.layers[0].mlp.experts, theirs.model.layers[0].mlp.experts
    g = torch.Generator().manual_seed(1)
    x = torch.randn(30, 64, generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(64, generator=g)[:2] for _ in range(30)])
    w = torch.rand(30, 2, generator=g).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(ours._routed(x, idx, w).view(torch.int16), native(x, idx, w).view(torch.int16))


def test_modes_run_and_differ_where_they_should():
    ref = _build(QWEN)
    with torch.no_grad():
        a = ref(IDS).logits
        fp8ref.nn.set_mode(ref, "producer")
        b = ref(IDS).logits
        fp8ref.nn.set_mode(ref, "reference:fp32")
        c = ref(IDS).logits
    assert torch.isfinite(a).all() and not torch.equal(a, b)
    # fp32 accumulation: at most a rounding apart from the exact sum, far less than the producer's arithmetic
    assert (a.float() - c.float()).abs().max() < (a.float() - b.float()).abs().max()


def test_compare_reports_experts_grouped_by_block():
    from fp8ref.nn.compare import compare

    model = _build(QWEN, original=QWEN_BF16)
    r = compare(model, IDS, ["reference", "producer", "original"])
    experts = [x for x in r["layers"] if ".experts." in x["name"]]
    assert len(experts) == 24 and len(r["layers"]) == 32  # 2 layers x 4 experts x 3 + 8 attention linears
    for x in experts:
        for mode in ("producer", "original"):
            assert 0 < x["teacher_forced"][mode]["rel_rms"] < 0.1
            assert 0 <= x["free_running"][mode]["routed_differ"] <= 1
    assert [g["experts"] for g in r["expert_groups"]] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert all(g["count"] == 4 and g["projections"] == 12 for g in r["expert_groups"])
    g = r["expert_groups"][0]["modes"]["producer"]["teacher_forced"]
    rows = [x["teacher_forced"]["producer"]["rel_rms"] for x in experts if ".layers.0." in x["name"]]
    assert g["worst_rel_rms"] == max(rows) and g["mean_rel_rms"] == pytest.approx(sum(rows) / len(rows))


def test_compare_cli_prints_one_line_per_moe_block(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert run_cli("compare", QWEN, "--modes", "reference,producer", "--random", "1x6", "--no-progress",
                   "--json", out) == 0
    text = capsys.readouterr().out
    assert text.count("model.layers.0.mlp.experts (") == 1 and text.count("model.layers.1.mlp.experts (") == 1
    assert len(json.loads(out.read_text())["expert_groups"]) == 2


def test_mixtral_names_are_mapped_and_inspect_warns(capsys):
    ckpt = fp8ref.load_checkpoint(CKPTS / "llmc_mixtral_fp8_dynamic")
    assert any("transformers reads mixtral experts as w1/w3/w2" in w for w in ckpt.warnings)
    assert not any("transformers reads" in w for w in fp8ref.load_checkpoint(QWEN).warnings)
    model = _build(ckpt, original=CKPTS / "moe_mixtral_bf16")  # originals under w1/w3/w2
    with torch.no_grad():
        model(IDS)
    assert run_cli("inspect", CKPTS / "llmc_mixtral_fp8_dynamic") == 0
    assert "would not load these tensors" in capsys.readouterr().err


# --- bad input: one clear error naming the tensor or module, nothing written -------------------------

E3 = "model.layers.0.mlp.experts.3."


@pytest.mark.parametrize("edit, message", [
    ({"copy": {"model.layers.0.mlp.experts.4.": E3}},  # one expert more than the config's 4
     "model.layers.0.mlp.experts.4.down_proj: expert 4, but the model's model.layers.0.mlp.experts has 4 experts"),
    ({"drop": lambda n: n.startswith(E3 + "gate_proj")},
     "model.layers.0.mlp.experts.3.gate_proj: missing; the model's model.layers.0.mlp.experts has 4 experts"),
    ({"config": {"moe_intermediate_size": 32}},
     "model.layers.0.mlp.experts.0.down_proj: weight [128, 64], the model's model.layers.0.mlp.experts expects "
     "[128, 32]"),
])
def test_experts_disagreeing_with_the_config(tmp_path, capsys, edit, message):
    bad = rewrite(QWEN, tmp_path / "bad", **edit)
    with pytest.raises(ModelError, match=re.escape(message)):
        _build(bad)
    out = tmp_path / "r.json"
    assert run_cli("compare", bad, "--modes", "reference,producer", "--json", out, "--no-progress") == 1
    err = capsys.readouterr().err
    assert err.startswith("fp8ref: error: ") and err.count("\n") == 1 and message in err
    assert not out.exists()


def test_unquantized_experts_disagreeing_with_the_config(tmp_path):
    bad = rewrite(QWEN_BF16, tmp_path / "bad", copy={"model.layers.0.mlp.experts.4.": E3})
    with pytest.raises(ModelError, match=r"model\.layers\.0\.mlp\.experts\.4\.\w+_proj\.weight'?: expert beyond "
                                         r"the model's 4 experts"):
        _build(bad, mode="original", original=QWEN_BF16)


def test_a_router_without_experts(tmp_path, capsys):
    """The second block's experts left out, its router kept."""
    bad = rewrite(QWEN_BF16, tmp_path / "bad", drop=lambda n: n.startswith("model.layers.1.mlp.experts."))
    message = ("model.layers.1.mlp.experts: the model has 4 experts here and the checkpoint none (no "
               "model.layers.1.mlp.experts.N.gate_proj/up_proj/down_proj); it holds only "
               "model.layers.1.mlp.gate.weight")
    with pytest.raises(ModelError, match=re.escape(message)):
        _build(bad, mode="original", original=QWEN_BF16)
    (tmp_path / "ids.txt").write_text("1 2 3 4\n")
    assert run_cli("eval", bad, "--mode", "original", "--original", QWEN_BF16, "--tokens", tmp_path / "ids.txt",
                   "--quiet") == 1
    err = capsys.readouterr().err
    assert err.startswith("fp8ref: error: ") and err.count("\n") == 1 and "checkpoint none" in err


@pytest.mark.parametrize("config, message", [
    ({"model_type": "qwen9_moe", "architectures": ["Qwen9MoeForCausalLM"]},
     "cannot build a 'qwen9_moe' model"),
    ({"model_type": None}, "no 'model_type'"),
])
def test_a_config_naming_an_unknown_architecture(tmp_path, capsys, config, message):
    """One line naming config.json and the architecture; nothing written (compare's --json stays absent)."""
    bad = rewrite(QWEN, tmp_path / "bad", config=config)
    with pytest.raises(ModelError, match=re.escape(message)):
        _build(bad)
    out = tmp_path / "r.json"
    assert run_cli("compare", bad, "--modes", "reference,producer", "--json", out, "--no-progress") == 1
    err = capsys.readouterr().err
    assert err.startswith("fp8ref: error: ") and err.count("\n") == 1 and message in err and "config.json" in err
    assert "Should contain one of" not in err and len(err) < 400  # not transformers' list of every model type
    assert not out.exists()


@pytest.mark.parametrize("count", [3, 8])
def test_a_config_whose_expert_count_disagrees_with_the_router(tmp_path, capsys, count):
    """num_local_experts other than the checkpoint's 4: the router's rows disagree, and the line names
    the router's tensor and the expert-count key (not only the dense model's keys)."""
    bad = rewrite(QWEN, tmp_path / "bad", config={"num_local_experts": count})
    out = tmp_path / "r.json"
    assert run_cli("compare", bad, "--modes", "reference,producer", "--json", out, "--no-progress") == 1
    err = capsys.readouterr().err
    assert err.startswith("fp8ref: error: ") and err.count("\n") == 1 and not out.exists()
    assert f"model.layers.0.mlp.gate.weight of shape [{count}, 128], the checkpoint's is [4, 128]" in err
    assert "num_local_experts or moe_intermediate_size disagree" in err and "num_experts," not in err
