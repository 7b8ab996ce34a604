"""compare --engine-logprobs and golden generate --model: the OpenAI completions logprobs format
read as vLLM and SGLang write it, the metrics on hand-computed cases, the golden file read back,
and bad files refused in one line with nothing written. (The acceptance against transformers'
reload of a checkpoint: tests/interop/test_engine_logprobs_interop.py.)"""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fp8ref.cli import main
from fp8ref.errors import ModelError
from fp8ref.nn.engine_compare import _position
from fp8ref.nn.engine_logprobs import read_engine_logprobs, top_entries
from tests.support.engine_files import engine_choices, token_id, write_response
from tests.support.tokenizers_fixture import CKPTS, checkpoint_with_tokenizer, save_tokenizer

CK = CKPTS / "llmc_fp8"


def run(capsys, *argv) -> tuple[int, str, str]:
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exc:  # argparse
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


def _no_tokenizer():
    raise AssertionError("token_id:N files need no tokenizer")


def _choice(tokens, lps, tops, **extra):
    return {"index": 0, "text": "", "logprobs": {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops},
            **extra}


GOOD = _choice(["token_id:1", "token_id:5", "token_id:7"], [None, -0.5, -2.0],
               [None, {"token_id:5": -0.5, "token_id:9": -1.25}, {"token_id:3": -0.25, "token_id:7": -2.0}])


def test_token_id_form_reads_without_a_tokenizer(tmp_path):
    path = write_response(tmp_path / "r.json", [GOOD, {**GOOD, "index": 1}])
    seqs, _ = read_engine_logprobs(path, vocab=128, tokenizer_loader=_no_tokenizer)
    assert len(seqs) == 2 and seqs[1].where == f"{path}: choices[1]"
    s = seqs[0]
    assert s.ids.tolist() == [1, 5, 7] and math.isnan(s.logprobs[0]) and s.logprobs[1:].tolist() == [-0.5, -2.0]
    assert s.top[0] is None and s.top[1][0].tolist() == [5, 9] and s.top[2][1].tolist() == [-0.25, -2.0]


def test_jsonl_and_a_json_list_read_alike(tmp_path):
    doc = {"choices": [GOOD]}
    (tmp_path / "a.jsonl").write_text(json.dumps(doc) + "\n\n" + json.dumps(doc) + "\n")
    (tmp_path / "b.json").write_text(json.dumps([doc, doc], indent=2))
    a, _ = read_engine_logprobs(tmp_path / "a.jsonl", vocab=128, tokenizer_loader=_no_tokenizer)
    b, _ = read_engine_logprobs(tmp_path / "b.json", vocab=128, tokenizer_loader=_no_tokenizer)
    assert [s.where for s in a] == [f"{tmp_path / 'a.jsonl'}:1: choices[0]", f"{tmp_path / 'a.jsonl'}:3: choices[0]"]
    assert [s.ids.tolist() for s in a] == [s.ids.tolist() for s in b] == [[1, 5, 7]] * 2


def test_vllm_prompt_logprobs_with_prompt_token_ids(tmp_path):
    """vLLM's prompt_logprobs (id -> Logprob objects) read as the same sequence as its echo form."""
    def entry(pairs):
        return {str(i): {"logprob": v, "rank": r, "decoded_token": "x"} for r, (i, v) in enumerate(pairs, 1)}

    pl = [None, entry([(5, -0.5), (9, -1.25)]), entry([(3, -0.25), (7, -2.0)])]
    path = write_response(tmp_path / "p.json", [{"index": 0, "text": "", "logprobs": None, "prompt_logprobs": pl,
                                                 "prompt_token_ids": [1, 5, 7]}])
    got = read_engine_logprobs(path, vocab=128, tokenizer_loader=_no_tokenizer)[0][0]
    want = read_engine_logprobs(write_response(tmp_path / "e.json", [GOOD]), vocab=128,
                                tokenizer_loader=_no_tokenizer)[0][0]
    assert got.ids.tolist() == want.ids.tolist() and got.logprobs[1:].tolist() == want.logprobs[1:].tolist()
    assert all(np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]) for a, b in zip(got.top[1:], want.top[1:]))
    path = write_response(tmp_path / "q.json", [{"index": 0, "prompt_logprobs": pl}])
    with pytest.raises(ModelError, match="prompt_logprobs without prompt_token_ids"):
        read_engine_logprobs(path, vocab=128, tokenizer_loader=_no_tokenizer)


def test_modelopt_fidelity_check_records(tmp_path):
    """ModelOpt's fidelity_check.py collect-base / collect-quant JSONL (branch fridah/fidelity-check,
    examples/llm_eval): per record tokens and top_logprobs of one echo call, no token_logprobs;
    the token's own logprob is its top_logprobs entry; skipped records are passed over."""
    lp = GOOD["logprobs"]
    base = {"prompt_idx": 0, "prompt": "p", "gen_text": "g", "prompt_token_count": 2, "tokens": lp["tokens"],
            "top_logprobs": lp["top_logprobs"]}
    quant = {"prompt_idx": 2, "prompt_token_count": 2, "tokens": lp["tokens"], "top_logprobs": lp["top_logprobs"]}
    path = tmp_path / "quant.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in (base, {"prompt_idx": 1, "skipped": True, "reason": "x"},
                                                      quant)) + "\n")
    seqs, _ = read_engine_logprobs(path, vocab=128, tokenizer_loader=_no_tokenizer)
    assert [s.where for s in seqs] == [f"{path}:1: prompt_idx 0", f"{path}:3: prompt_idx 2"]
    assert seqs[1].ids.tolist() == [1, 5, 7] and seqs[1].logprobs[1:].tolist() == [-0.5, -2.0]
    missing = {**quant, "top_logprobs": [None, {"token_id:9": -1.0}, lp["top_logprobs"][2]]}
    path.write_text(json.dumps(missing) + "\n")
    with pytest.raises(ModelError, match="prompt_idx 2: position 1: the token's own logprob is not among its "
                                         "top_logprobs"):
        read_engine_logprobs(path, vocab=128, tokenizer_loader=_no_tokenizer)


def test_token_strings_map_through_the_tokenizer(tmp_path):
    """Strings as vLLM and SGLang print them (each id's decode), checked against the ids the
    tokenizer itself gives for the text; and vLLM's return_token_ids ids checked against them."""
    pytest.importorskip("tokenizers")
    from fp8ref.nn.tokenizer import load_tokenizer

    tok = load_tokenizer(save_tokenizer(tmp_path / "tok"))
    ids = [tok.prefix_id] + tok.encode("the quick brown fox jumps").tolist()
    names = [tok.backend.decode([i], skip_special_tokens=False) for i in ids]
    assert names[0] == "<s>" and "".join(names[1:]) == "thequickbrownfoxjumps"
    lps = [None] + [-1.0] * (len(ids) - 1)
    tops = [None] + [{names[t]: -1.0, "fox": -0.5} for t in range(1, len(ids))]
    path = write_response(tmp_path / "r.json", [_choice(names, lps, tops)])
    seqs, tokens = read_engine_logprobs(path, vocab=128, tokenizer_loader=lambda: tok)
    assert seqs[0].ids.tolist() == ids and tokens.name(ids[2]) == names[2]
    fox = tok.backend.token_to_id("fox")
    assert all(fox in top[0] for top in seqs[0].top[1:])
    # with vLLM's return_token_ids: the ids are the engine's, each string must be what the tokenizer gives
    path = write_response(tmp_path / "ids.json", [_choice(names, lps, tops, prompt_token_ids=ids, token_ids=[])])
    assert read_engine_logprobs(path, vocab=128, tokenizer_loader=lambda: tok)[0][0].ids.tolist() == ids
    swapped = ids[:1] + ids[2:3] + ids[1:2] + ids[3:]
    path = write_response(tmp_path / "bad.json", [_choice(names, lps, tops, prompt_token_ids=swapped)])
    with pytest.raises(ModelError, match=r"choices\[0\]: position 1: token 'the' is not what the tokenizer gives "
                                         rf"for id {ids[2]} \(prompt_token_ids\)"):
        read_engine_logprobs(path, vocab=128, tokenizer_loader=lambda: tok)


def test_a_string_several_ids_give_is_left_out_and_may_be_the_top1(tmp_path):
    """The model's ids past the tokenizer's (padding) all decode to "" (vLLM prints "" for them):
    a JSON object keeps one value for them, so that entry is left out of the KL and any of those
    ids may be the engine's top-1."""
    pytest.importorskip("tokenizers")
    from fp8ref.nn.tokenizer import load_tokenizer

    tok = load_tokenizer(save_tokenizer(tmp_path / "tok"))
    size = tok.backend.get_vocab_size(with_added_tokens=True)
    assert size < 128
    path = write_response(tmp_path / "r.json", [_choice(["<s>", "the"], [None, -2.0], [None, {"": -0.5, "the": -2.0}])])
    seq = read_engine_logprobs(path, vocab=128, tokenizer_loader=lambda: tok)[0][0]
    the = tok.backend.token_to_id("the")
    assert seq.top[1][0].tolist() == [the] and seq.dropped == 1 and seq.uncertain == 1
    assert seq.top1[1].tolist() == list(range(size, 128))


def test_metrics_at_one_position_by_hand():
    """KL over the engine's set, each side renormalised over it: a common shift is no difference."""
    ref = np.array([-1.0, -1.0 - math.log(2)])
    kl, agree, dnll = _position(ref, ref - 4.0, np.array([0]), np.array([0]), -0.7, -0.7)
    assert kl == 0.0 and agree and dnll == 0.0
    eng = np.array([-3.0 - math.log(2), -3.0])  # renormalised: p = (2/3, 1/3), q = (1/3, 2/3)
    kl, agree, dnll = _position(ref, eng, np.array([0]), np.array([1]), -0.7, -0.2)
    assert kl == pytest.approx((2 / 3) * math.log(2) + (1 / 3) * math.log(0.5), rel=1e-15) and not agree
    assert dnll == pytest.approx(0.5, rel=1e-15)
    assert _position(ref, eng, np.array([0, 1]), np.array([1]), 0.0, 0.0)[1]  # ties count as agreement


def test_top_entries_largest_first_ties_to_the_lower_id():
    lp = np.array([-3.0, -1.0, -2.0, -1.0, -5.0])
    assert top_entries(lp, 3).tolist() == [1, 3, 2] and top_entries(lp, 9).tolist() == [1, 3, 2, 0, 4]
    assert top_entries(np.array([-1.0, -2.0, -2.0, -2.0]), 2).tolist() == [0, 1]


@pytest.fixture(scope="module")
def golden_file(tmp_path_factory):
    pytest.importorskip("transformers")
    d = tmp_path_factory.mktemp("golden")
    ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(11))
    (d / "ids.txt").write_text("\n".join(" ".join(map(str, row)) for row in ids.tolist()) + "\n")
    assert main(["golden", "generate", "--model", str(CK), "--tokens", str(d / "ids.txt"), "--mode", "producer",
                 "--top-k", "5", "-o", str(d / "golden.json"), "--logits", str(d / "logits.safetensors")]) == 0
    return d, ids


def test_golden_full_logits_are_the_models_bit_for_bit(golden_file):
    from safetensors.torch import load_file

    from fp8ref.nn import build_model

    d, ids = golden_file
    with torch.no_grad():
        logits = build_model(CK, mode="producer")(ids).logits
    got = load_file(str(d / "logits.safetensors"))
    assert got["logits"].dtype == logits.dtype == torch.bfloat16 and torch.equal(got["input_ids"], ids)
    assert torch.equal(got["logits"].view(torch.int16), logits.view(torch.int16))


def test_golden_file_is_what_compare_reads_and_agrees_exactly(golden_file, capsys):
    d, ids = golden_file
    doc = json.loads((d / "golden.json").read_text())
    choice = doc["choices"][1]
    assert choice["prompt_token_ids"] == ids[1].tolist() and choice["logprobs"]["token_logprobs"][0] is None
    assert choice["logprobs"]["tokens"] == [token_id(i) for i in ids[1].tolist()]
    assert all(5 <= len(t) <= 6 for t in choice["logprobs"]["top_logprobs"][1:])
    code, out, _ = run(capsys, "compare", CK, "--engine-logprobs", d / "golden.json", "--against", "producer",
                       "--json", d / "r.json", "--quiet")
    r = json.loads((d / "r.json").read_text())
    assert code == 0 and r["kl_mean"] == 0.0 and r["top1_agreement"] == 1.0 and r["dnll_mean"] == 0.0
    assert r["noise_floor"]["mode"] == "reference" and r["overall"]["positions"] == 2 * 11
    assert len(r["worst"]) == 10 and r["tokenizer"] is None


def test_golden_values_are_the_models_log_softmax(golden_file):
    """Independent of fp8ref's float64 log-softmax: torch's, on the logits of build_model."""
    from fp8ref.nn import build_model

    d, ids = golden_file
    with torch.no_grad():
        logits = build_model(CK, mode="producer")(ids).logits
    expect = engine_choices(logits, ids, 5, token_id)
    got = json.loads((d / "golden.json").read_text())["choices"]
    for e, g in zip(expect, got):
        e, g = e["logprobs"], g["logprobs"]
        assert e["tokens"] == g["tokens"]
        np.testing.assert_allclose(e["token_logprobs"][1:], g["token_logprobs"][1:], rtol=0, atol=1e-12)
        for te, tg in zip(e["top_logprobs"][1:], g["top_logprobs"][1:]):
            assert set(te) == set(tg)
            np.testing.assert_allclose([te[k] for k in tg], list(tg.values()), rtol=0, atol=1e-12)


def test_engine_against_another_mode_shows_above_a_zero_floor(golden_file, capsys):
    """golden (producer) judged against reference, the floor producer itself: the engine's KL is
    the producer/reference gap, and the floor mode equal to the engine gives KL 0."""
    d, _ = golden_file
    code, out, _ = run(capsys, "compare", CK, "--engine-logprobs", d / "golden.json", "--noise-floor", "producer",
                       "--json", d / "r2.json", "--quiet")
    r = json.loads((d / "r2.json").read_text())
    assert code == 0 and r["against"] == "reference" and r["kl_mean"] > 0
    assert r["kl_mean"] == pytest.approx(r["noise_floor"]["kl_mean"], rel=1e-9)
    code, out, _ = run(capsys, "compare", CK, "--engine-logprobs", d / "golden.json", "--quiet")
    assert code == 0 and "noise floor" in out and "reference:fp32 vs reference" in out and "worst positions" in out


def _refused(capsys, tmp_path, path, *parts, ck=CK, extra=()):
    out = tmp_path / "report.json"
    code, _, err = run(capsys, "compare", ck, "--engine-logprobs", path, "--json", out, "--quiet", *extra)
    assert code != 0 and err.count("\n") == 1 and err.startswith("fp8ref: error: "), err
    assert not out.exists()
    for part in parts:
        assert part in err, err


def _write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return p


def _bad(**logprobs):
    return json.dumps({"choices": [{**GOOD, "logprobs": {**GOOD["logprobs"], **logprobs}}]})


def test_bad_files_are_refused_in_one_line_and_nothing_is_written(tmp_path, capsys):
    pytest.importorskip("transformers")
    cases = [
        (_bad(tokens=["token_id:1", "token_id:500", "token_id:7"]), "position 1: token id 500 outside the model's "
                                                                   "vocabulary [0, 128)"),
        (_bad(token_logprobs=[None, -0.5]), "lists of different lengths: tokens 3, token_logprobs 2, top_logprobs 3"),
        (_bad(top_logprobs=[None, {"token_id:5": -0.5}]), "tokens 3, token_logprobs 3, top_logprobs 2"),
        (_bad(token_logprobs=[None, float("nan"), -2.0]), "token_logprobs[1]: nan is not a log-probability"),
        (_bad(token_logprobs=[None, -0.5, float("-inf")]), "token_logprobs[2]: -inf is not a log-probability"),
        (_bad(top_logprobs=[None, {"token_id:5": float("inf")}, {"token_id:7": -2.0}]),
         "top_logprobs[1]['token_id:5']: inf is not a log-probability"),
        (_bad(token_logprobs=[None, 0.25, -2.0]), "0.25 is not a log-probability (a finite number <= 0)"),
        (_bad(token_logprobs=[-0.1, -0.5, -2.0]), "position 0 has a logprob"),
        (_bad(top_logprobs=[None, {}, {"token_id:7": -2.0}]), "top_logprobs[1]: expected an object token -> logprob"),
        (_bad(tokens="token_id:1"), "logprobs.tokens: expected a list, got str"),
        (json.dumps({"choices": [{"index": 0, "text": "x", "logprobs": None}]}), "choices[0]: no 'logprobs' object"),
        (json.dumps({"object": "error", "message": "bad"}), "expected a completions response"),
        (json.dumps({"choices": []}), "no choices"),
        ("[" * 200 + "]" * 200, "nested deeper than 64 levels"),
        ('{"choices": [], "choices": []}', "duplicate key 'choices'"),
    ]
    for i, (text, part) in enumerate(cases):
        _refused(capsys, tmp_path, _write(tmp_path, f"bad{i}.json", text), part)
    line = json.dumps({"choices": [GOOD]})
    _refused(capsys, tmp_path, _write(tmp_path, "cut.jsonl", line + "\n" + line[:-20] + "\n"),
             "cut.jsonl:2: JSONL line is not valid JSON")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    _refused(capsys, tmp_path, fifo, "a FIFO, expected a regular file")
    _refused(capsys, tmp_path, tmp_path / "absent.json", "absent.json: cannot read engine logprobs")


JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=12),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=9), inner, max_size=4),
                    max_leaves=12)
FIELDS = [("choices",), ("choices", 0), ("choices", 0, "logprobs"), ("choices", 0, "prompt_token_ids"),
          ("choices", 0, "prompt_logprobs"), ("choices", 0, "logprobs", "tokens"),
          ("choices", 0, "logprobs", "tokens", 1), ("choices", 0, "logprobs", "token_logprobs"),
          ("choices", 0, "logprobs", "token_logprobs", 2), ("choices", 0, "logprobs", "top_logprobs"),
          ("choices", 0, "logprobs", "top_logprobs", 0), ("choices", 0, "logprobs", "top_logprobs", 1),
          ("choices", 0, "logprobs", "top_logprobs", 1, "token_id:5"), ("tokens",), ("top_logprobs",)]


@settings(max_examples=300, deadline=None)
@given(field=st.sampled_from(FIELDS), value=JSON)
def test_any_value_anywhere_is_read_or_refused_in_one_error(tmp_path_factory, field, value):
    """Whatever JSON value stands in any field, the reader returns sequences or raises ModelError
    (the CLI's one line): never another exception."""
    doc = json.loads(json.dumps({"choices": [GOOD]}))
    node = doc
    for key in field[:-1]:
        node = node[key]
    node[field[-1]] = value
    path = tmp_path_factory.mktemp("h") / "r.json"
    path.write_text(json.dumps(doc))
    try:
        read_engine_logprobs(path, vocab=128, tokenizer_loader=lambda: (_ for _ in ()).throw(ModelError("no tok")))
    except ModelError:
        pass


def test_token_strings_other_than_the_tokenizer_gives(tmp_path, capsys):
    pytest.importorskip("transformers")
    ck = checkpoint_with_tokenizer(tmp_path)
    text = _bad(tokens=["<s>", "the", "zebra"], top_logprobs=[None, {"the": -0.5}, {"zebra": -2.0}])
    _refused(capsys, tmp_path, _write(tmp_path, "s.json", text), "choices[0]: position 2: token 'zebra' is not a "
                                                                 "token of the tokenizer", ck=ck)
    _refused(capsys, tmp_path, _write(tmp_path, "n.json", text), "no tokenizer.json to map the engine's token strings",
             ck=CK)
    good = _bad(tokens=["<s>", "the", "fox"], top_logprobs=[None, {"the": -0.5}, {"fox": -2.0}])
    code, out, err = run(capsys, "compare", CK, "--engine-logprobs", _write(tmp_path, "g.json", good), "--tokenizer",
                         ck, "--json", "-", "--quiet")
    r = json.loads(out)
    assert code == 0 and r["tokenizer"] == str(ck / "tokenizer.json") and r["overall"]["positions"] == 2, err


def test_a_file_too_large_is_refused(tmp_path, capsys, monkeypatch):
    import fp8ref.nn.engine_logprobs as module

    pytest.importorskip("transformers")
    monkeypatch.setattr(module, "MAX_JSON_BYTES", 1000)
    _refused(capsys, tmp_path, _write(tmp_path, "big.json", " " * 1001), "more than the 1000 bytes fp8ref reads")


def test_options_that_do_not_apply_are_refused(tmp_path, capsys):
    pytest.importorskip("transformers")
    path = write_response(tmp_path / "r.json", [GOOD])
    for extra, part in ((["--random", "1x4"], "--random does not apply"), (["--modes", "producer"], "--modes"),
                        (["--against", "reference", "--noise-floor", "reference"], "the same mode as --against")):
        _refused(capsys, tmp_path, path, part, extra=extra)
    code, _, err = run(capsys, "compare", CK, "--against", "producer", "--quiet")
    assert code == 1 and "--against applies to --engine-logprobs FILE" in err
    code, _, err = run(capsys, "golden", "generate", "-o", tmp_path / "x.json", "--tokens", path)
    assert code == 1 and "golden generate: give a SUITE" in err and not (tmp_path / "x.json").exists()
    code, _, err = run(capsys, "golden", "generate", "--model", CK, "--tokens", path, "-o", tmp_path / "x.json",
                       "--logits", tmp_path / "x.json")
    assert code == 1 and "OUT and --logits name the same file" in err and not (tmp_path / "x.json").exists(), err
    code, _, err = run(capsys, "golden", "generate", "--model", CK, "--tokens", CK / "config.json", "-o",
                       tmp_path / "x.json")
    assert code == 1 and "config.json:1: expected whitespace-separated integer token ids" in err
    assert not (tmp_path / "x.json").exists()
