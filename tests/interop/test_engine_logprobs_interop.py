"""compare --engine-logprobs against files made by a real stack: transformers + compressed-tensors
reloading the committed llm-compressor fixture (with a tokenizer built in code) stands in for the
engine. Its logits equal fp8ref's producer mode bit for bit (test_nn_interop.py), so its file must
judge as KL 0 against producer; a copy with one layer's weight scale doubled (an "engine bug") must
not, and must stand well above the noise floor."""

from __future__ import annotations

import json
import shutil

import pytest

from fp8ref.cli import main
from tests.support.engine_files import engine_choices, token_id, write_response
from tests.support.tokenizers_fixture import CORPUS, checkpoint_with_tokenizer

pytestmark = pytest.mark.interop
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

BUGGED = "model.layers.0.mlp.down_proj.weight_scale"


def _tool_logits(folder, ids):
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16).eval()
    with torch.no_grad():
        return model(ids).logits


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("engine")
    ck = checkpoint_with_tokenizer(d)
    tok = transformers.AutoTokenizer.from_pretrained(str(ck), local_files_only=True)
    texts = (CORPUS[0], CORPUS[2] + " " + CORPUS[1])
    rows = [[tok.bos_token_id] + tok(text, add_special_tokens=False)["input_ids"] for text in texts]
    width = min(len(r) for r in rows)
    ids = torch.tensor([r[:width] for r in rows])
    assert ids[0, 0] == tok.bos_token_id and width >= 8
    return d, ck, tok, ids


def _compare(d, ck, path, *extra):
    out = d / (path.stem + ".report.json")
    assert main(["compare", str(ck), "--engine-logprobs", str(path), "--json", str(out), "--quiet", *extra]) == 0
    return json.loads(out.read_text())


@pytest.mark.parametrize("form", ["strings", "token_ids"])
def test_transformers_reload_judges_as_producer(setup, form):
    """Tokens as vLLM prints them by default (each id decoded by the checkpoint's tokenizer, here
    through transformers) or as token_id:N; K = 5 top entries plus the token itself."""
    d, ck, tok, ids = setup
    name = (lambda i: tok.decode([i])) if form == "strings" else token_id
    path = write_response(d / f"tool_{form}.json", engine_choices(_tool_logits(ck, ids), ids, 5, name))
    r = _compare(d, ck, path, "--against", "producer")
    assert r["kl_mean"] <= 1e-9 and r["top1_agreement"] == 1.0 and r["dnll_mean"] <= 1e-12
    assert r["overall"]["positions"] == ids.numel() - ids.shape[0] and r["noise_floor"]["mode"] == "reference"
    assert r["tokenizer"] == (str(ck / "tokenizer.json") if form == "strings" else None)


def test_golden_logits_are_the_tools_bit_for_bit(setup):
    """golden generate --model --mode producer --logits: transformers' own logits, bit for bit."""
    from safetensors.torch import load_file

    d, ck, tok, ids = setup
    (d / "ids.txt").write_text("\n".join(" ".join(map(str, row)) for row in ids.tolist()) + "\n")
    assert main(["golden", "generate", "--model", str(ck), "--tokens", str(d / "ids.txt"), "--mode", "producer",
                 "-o", str(d / "golden.json"), "--logits", str(d / "logits.safetensors")]) == 0
    got = load_file(str(d / "logits.safetensors"))["logits"]
    assert torch.equal(got.view(torch.int16), _tool_logits(ck, ids).view(torch.int16))


def test_a_doubled_weight_scale_is_reported_above_the_noise_floor(setup):
    from safetensors import safe_open
    from safetensors.torch import save_file

    d, ck, tok, ids = setup
    bug = d / "bugged"
    shutil.copytree(ck, bug)
    with safe_open(str(ck / "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        meta = f.metadata()
    tensors[BUGGED] = tensors[BUGGED] * 2
    save_file(tensors, str(bug / "model.safetensors"), metadata=meta)
    path = write_response(d / "bugged.json", engine_choices(_tool_logits(bug, ids), ids, 5, lambda i: tok.decode([i])))
    r = _compare(d, ck, path, "--against", "producer")
    floor = r["noise_floor"]  # "well above": an order of magnitude (measured: 60x, 2.9e-3 against 4.8e-5)
    assert r["top1_agreement"] < 1.0 and r["kl_mean"] > 10 * floor["kl_mean"] and floor["kl_mean"] > 0
    assert r["dnll_mean"] > floor["dnll_mean"]
    worst = r["worst"]
    assert len(worst) == 10 and worst[0]["kl"] == r["overall"]["kl_max"]
    assert any(w["engine_top1"] != w["reference_top1"] for w in worst)
    assert [w["kl"] for w in worst] == sorted((w["kl"] for w in worst), reverse=True)
    assert all(w["token"] == tok.decode([int(ids[int(w["sequence"].endswith("[1]")), w["position"]])])
               for w in worst)
