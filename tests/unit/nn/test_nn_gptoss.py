"""A tiny gpt-oss (tests/fixtures/gptoss, tools/make_gptoss_fixture.py) as a whole model: fp8ref's
dequantized experts against transformers' own MXFP4 reload on CPU, and build_model's logits in
producer (bit for bit with that reload), original (bit for bit with transformers on the original)
and reference (close: relative RMS stated) modes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import fp8ref  # noqa: E402
from fp8ref.errors import ModelError  # noqa: E402
from fp8ref.nn.model import build_model  # noqa: E402

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "gptoss"
MXFP4, ORIGINAL = FIXTURE / "mxfp4", FIXTURE / "original_bf16"


def _ids():
    return torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def reloaded():
    """transformers' reload of the MXFP4 checkpoint: on CPU (no triton) Mxfp4Config.dequantize is forced."""
    pytest.importorskip("accelerate")  # transformers' MXFP4 quantizer refuses to run without it
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(MXFP4, dtype=torch.bfloat16).eval()


def _bf16(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a).view(np.uint16)).view(torch.bfloat16)


def test_dequantized_experts_equal_transformers_dequantize(reloaded):
    ckpt = fp8ref.load_checkpoint(MXFP4)
    assert ckpt.format == "gpt-oss" and len(ckpt) == 4
    for layer in range(2):
        experts = reloaded.model.layers[layer].mlp.experts
        for proj in ("gate_up_proj", "down_proj"):
            ours = _bf16(ckpt[f"model.layers.{layer}.mlp.experts.{proj}"].experts_weight("bfloat16"))
            assert torch.equal(ours, getattr(experts, proj).detach()), (layer, proj)


def test_producer_logits_equal_transformers_reload(reloaded):
    model = build_model(MXFP4, mode="producer")
    assert type(model.model.layers[0].mlp.experts).__module__ == "fp8ref.nn.gptoss"
    with torch.no_grad():
        assert torch.equal(model(_ids()).logits, reloaded(_ids()).logits)


def test_original_logits_equal_transformers_on_the_original():
    from transformers import AutoModelForCausalLM

    model = build_model(MXFP4, mode="original", original=ORIGINAL)
    plain = AutoModelForCausalLM.from_pretrained(ORIGINAL, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        assert torch.equal(model(_ids()).logits, plain(_ids()).logits)


def _rel_rms(a, b) -> float:
    d = a.double() - b.double()
    return float(d.pow(2).mean().sqrt() / b.double().pow(2).mean().sqrt())


def test_reference_is_close_and_runs_only_routed_experts():
    """Per experts call, reference and producer differ by bf16 rounding only: each is within 2**-7
    relative RMS of the float64 forward on the same (exactly dequantized) weights. Measured: 0.40 % /
    0.41 % per call, 2.2 % on the logits of this 2-layer random-weight model (bf16 all the way)."""
    model = build_model(MXFP4, mode="producer")
    experts = model.model.layers[0].mlp.experts
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 64, generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randint(0, 3, (16,), generator=g), torch.full((16,), 3)], 1)
    idx[:, 0][idx[:, 0] == 2] = 0  # expert 2 is never routed
    w = torch.softmax(torch.randn(16, 2, generator=g), -1).to(torch.bfloat16)
    t = experts._tensors("producer", torch.bfloat16)
    exact = torch.zeros(16, 64, dtype=torch.float64)
    for e in range(4):
        tok, pos = torch.where(idx == e)
        gu = x[tok].double() @ t["gate_up_proj"][e].double() + t["gate_up_proj_bias"][e].double()
        gate, up = gu[..., ::2].clamp(max=7.0), gu[..., 1::2].clamp(-7.0, 7.0)
        h = (up + 1) * gate * torch.sigmoid(gate * 1.702)
        exact.index_add_(0, tok, (h @ t["down_proj"][e].double() + t["down_proj_bias"][e].double())
                         * w[tok, pos, None].double())
    outs = {}
    for mode in ("producer", "reference"):
        experts.mode = mode
        outs[mode] = experts(x, idx, w)
        assert _rel_rms(outs[mode], exact) < 2**-7, mode
    assert not torch.equal(outs["producer"], outs["reference"])
    assert experts.calls.tolist() == [1, 1, 0, 1]  # the reference ran experts 0, 1 and 3, once each
    fp8ref.nn.linear.set_mode(model, "reference")
    assert str(experts.mode) == "reference"
    ref = build_model(MXFP4, mode="reference")
    with torch.no_grad():
        assert _rel_rms(ref(_ids()).logits, model(_ids()).logits) < 0.05


def test_experts_that_disagree_with_the_config_stay_unplaced(tmp_path):
    import json
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(MXFP4, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["num_local_experts"] = 8
    (bad / "config.json").write_text(json.dumps(cfg))
    # config.json is checked against the checkpoint's shapes before any expert is placed: the router
    # of 8 experts the config describes is the first tensor that disagrees
    with pytest.raises(ModelError, match=r"bad/config.json: the model it describes has "
                                         r"model.layers.0.mlp.router.weight of shape \[8, 64\], "
                                         r"the checkpoint's is \[4, 64\]"):
        build_model(bad)
    with pytest.raises(ModelError, match="mode 'original' needs the original weights"):
        build_model(MXFP4, mode="original")


def test_a_router_without_experts_names_the_experts(tmp_path, capsys):
    """The second layer's MXFP4 experts left out, its router kept: one line naming the experts module's
    tensor the checkpoint lacks (here the parameter count check fires first: the experts are half the
    model), and compare writes nothing."""
    import shutil

    from fp8ref.io.safetensors import SafetensorsFile, write_safetensors
    from tests.support.cli import run_cli

    f = SafetensorsFile(MXFP4 / "model.safetensors")
    kept = {n: (f.info(n).dtype, np.array(f.get(n))) for n in f.tensors
            if not n.startswith("model.layers.1.mlp.experts.")}
    assert "model.layers.1.mlp.router.weight" in kept
    bad = tmp_path / "bad"
    bad.mkdir()
    write_safetensors(bad / "model.safetensors", kept)
    for name in ("config.json", "generation_config.json"):
        shutil.copy(MXFP4 / name, bad)
    out = tmp_path / "r.json"
    assert run_cli("compare", bad, "--modes", "reference,producer", "--json", out, "--no-progress") == 1
    err = capsys.readouterr().err
    assert err.startswith("fp8ref: error: ") and err.count("\n") == 1 and not out.exists()
    assert "the checkpoint holds nothing for model.layers.1.mlp.experts.gate_up_proj (and 3 more)" in err


def test_compare_reports_per_expert_rows_grouped_per_block():
    """Each routed expert's gate_up and down projection is a row of compare (as for dense MoE models),
    grouped per experts module; the model's producer / original logits stay transformers' forward."""
    from fp8ref.nn.compare import compare

    model = build_model(MXFP4, mode="producer", original=ORIGINAL)
    with torch.no_grad():
        plain = model(_ids()).logits
    modes = ["producer", "reference", "reference:fp32", "original"]
    r = compare(model, _ids(), modes)
    names = [layer["name"] for layer in r["layers"]]
    experts = [n for n in names if ".mlp.experts." in n]
    assert experts and all(n.rsplit(".", 2)[-1] in ("gate_up_proj", "down_proj") for n in experts)
    assert {n.rsplit(".", 2)[0] for n in experts} <= {f"model.layers.{i}.mlp.experts" for i in range(2)}
    groups = {g["experts"]: g for g in r["expert_groups"]}
    assert sorted(groups) == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    g = groups["model.layers.0.mlp.experts"]
    assert g["count"] == 4 and g["projections"] == 8 and 0 < g["ran"] <= 8
    for mode in modes[1:]:
        tf = g["modes"][mode]["teacher_forced"]
        assert tf["worst"] in experts and tf["worst_rel_rms"] < (0.05 if mode != "original" else 1.0)
    for layer in r["layers"]:
        if layer["name"] in experts:  # reference and producer per expert differ by bf16 rounding only
            assert layer["teacher_forced"]["reference"]["rel_rms"] < 2 ** -6
    with torch.no_grad():
        fp8ref.nn.set_mode(model, "producer")
        assert torch.equal(model(_ids()).logits, plain)  # hooks gone, the output transformers' own


def test_original_experts_are_read_when_the_mode_runs_and_one_module_is_held():
    from fp8ref.nn import gptoss

    original = fp8ref.load_checkpoint(ORIGINAL)
    reads: list[str] = []
    tensor = original.tensor
    original.tensor = lambda name: reads.append(name) or tensor(name)
    model = build_model(MXFP4, mode="reference", original=original)
    assert [n for n in reads if ".experts." in n] == []  # nothing read to build
    fp8ref.nn.set_mode(model, "original")
    with torch.no_grad():
        model(_ids())
    assert sorted({n for n in reads if ".experts." in n}) == sorted(
        f"model.layers.{i}.mlp.experts.{k}" for i in range(2) for k in gptoss._KEYS)
    assert len(gptoss._HELD) == 1  # one experts module's originals, not the model's
    for i in range(2):  # the model's experts hold none of them past their forward
        params = model.model.layers[i].mlp.experts._model._parameters
        assert all(p is None or p.device.type == "meta" for p in params.values())
