"""fp8ref eval/compare --text with the checkpoint's own tokenizer: the ids are the tokenizer's,
the windows are lm-eval's rolling windows, and bad tokenizers are refused in one line."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fp8ref.cli import main
from fp8ref.errors import ModelError
from fp8ref.nn.tokenizer import load_tokenizer, rolling_windows
from tests.support.tokenizers_fixture import CKPTS, CORPUS, checkpoint_with_tokenizer, save_tokenizer

pytest.importorskip("tokenizers")



def run_in_process(capsys, *argv) -> tuple[int, str]:
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exc:  # argparse
        code = exc.code
    return code, capsys.readouterr().err


TEXTS = [" ".join(CORPUS), "hello", "fox " * 40, CORPUS[0] + "\n" + CORPUS[3] * 3]


@pytest.mark.parametrize("seq_len", [2, 5, 16, 64])
@pytest.mark.parametrize("n", [1, 2, 15, 16, 17, 33, 100])
def test_windows_equal_lm_evals(n, seq_len):
    utils = pytest.importorskip("lm_eval.utils")
    ids = np.arange(1000, 1000 + n)
    ours = rolling_windows(ids, 7, seq_len).pairs()
    theirs = [utils.make_disjoint_window(w)
              for w in utils.get_rolling_token_windows(ids.tolist(), prefix_token=7, max_seq_len=seq_len,
                                                       context_len=1)]
    assert ours == theirs
    # each token of the text is scored exactly once
    assert sum(len(c) for _, c in ours) == n


@pytest.mark.parametrize("text", TEXTS)
def test_text_windows_equal_lm_evals_on_the_tokenizer(tmp_path, text):
    utils = pytest.importorskip("lm_eval.utils")
    tok = load_tokenizer(save_tokenizer(tmp_path / "tok"))
    assert tok.prefix_token == "<s>" and tok.prefix_id == tok.backend.token_to_id("<s>")
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tmp_path / "tok", local_files_only=True)
    ids = tok.encode(text)
    assert ids.tolist() == hf(text, add_special_tokens=False)["input_ids"] and len(ids) > 0
    assert hf.bos_token_id == tok.prefix_id  # lm-eval's HFLM prefix_token_id
    for seq_len in (4, 16):
        theirs = [utils.make_disjoint_window(w) for w in utils.get_rolling_token_windows(
            ids.tolist(), prefix_token=hf.bos_token_id, max_seq_len=seq_len, context_len=1)]
        assert rolling_windows(ids, tok.prefix_id, seq_len).pairs() == theirs


def test_eos_is_the_prefix_without_bos(tmp_path):
    tok = load_tokenizer(save_tokenizer(tmp_path / "tok", bos_token=None))
    assert tok.prefix_token == "</s>"


def test_eval_text_uses_the_checkpoints_tokenizer(tmp_path, capsys):
    pytest.importorskip("transformers")
    ck = checkpoint_with_tokenizer(tmp_path)
    text = tmp_path / "t.txt"
    text.write_text(TEXTS[0] * 3)
    n = len(load_tokenizer(ck).encode(TEXTS[0] * 3))
    code, _ = run_in_process(capsys, "eval", ck, "--text", text, "--seq-len", "16", "--mode", "producer",
                             "--json", tmp_path / "r.json", "--quiet")
    r = json.loads((tmp_path / "r.json").read_text())
    assert code == 0 and r["tokenizer"] == str(ck / "tokenizer.json") and r["tokens"] == n
    assert r["sequences"] == -(-n // 16) and np.isfinite(r["perplexity"])
    # --tokenizer DIR: the same tokenizer from another folder gives the same numbers
    code, _ = run_in_process(capsys, "eval", CKPTS / "llmc_fp8", "--text", text, "--seq-len", "16", "--mode",
                             "producer", "--tokenizer", ck, "--json", tmp_path / "r2.json", "--quiet")
    r2 = json.loads((tmp_path / "r2.json").read_text())
    assert code == 0 and r2["perplexity"] == r["perplexity"] and r2["tokenizer"] == r["tokenizer"]
    code, _ = run_in_process(capsys, "compare", ck, "--text", text, "--seq-len", "16", "--json",
                             tmp_path / "c.json", "--quiet")
    c = json.loads((tmp_path / "c.json").read_text())
    assert code == 0 and c["tokenizer"] == str(ck / "tokenizer.json")


def test_byte_tokens_flag_keeps_the_byte_mapping(tmp_path, capsys):
    pytest.importorskip("transformers")
    (tmp_path / "t.txt").write_text("hello fp8 " * 30)
    code, _ = run_in_process(capsys, "eval", CKPTS / "llmc_fp8", "--text", tmp_path / "t.txt", "--byte-tokens",
                             "--json", tmp_path / "r.json", "--quiet")
    r = json.loads((tmp_path / "r.json").read_text())
    assert code == 0 and r["tokens"] == 2 * 127 and r["tokenizer"] == "bytes mod 128"


def _refused(capsys, argv, *parts):
    code, err = run_in_process(capsys, *argv)
    assert code != 0 and err.count("\n") == 1 and err.startswith("fp8ref: error: "), err
    for part in parts:
        assert part in err, err


def test_no_tokenizer_and_no_flag_says_what_to_pass(tmp_path, capsys):
    (tmp_path / "t.txt").write_text("hello")
    for cmd in ("eval", "compare"):
        _refused(capsys, [cmd, CKPTS / "llmc_fp8", "--text", tmp_path / "t.txt", "--quiet"],
                 "no tokenizer.json for --text; pass --tokenizer DIR", "--byte-tokens")


def test_tokenizer_flags_without_text_are_refused(tmp_path, capsys):
    (tmp_path / "ids.txt").write_text("1 2 3\n")
    _refused(capsys, ["compare", CKPTS / "llmc_fp8", "--random", "1x4", "--byte-tokens", "--quiet"],
             "--byte-tokens applies to --text FILE")
    _refused(capsys, ["eval", CKPTS / "llmc_fp8", "--tokens", tmp_path / "ids.txt", "--tokenizer", tmp_path,
                      "--quiet"], "--tokenizer applies to --text FILE")


def test_bad_tokenizers_are_refused_in_one_line(tmp_path, capsys):
    pytest.importorskip("transformers")
    (tmp_path / "t.txt").write_text("hello world")
    ck = CKPTS / "llmc_fp8"

    def tokenizer(name, **config):
        return save_tokenizer(tmp_path / name, **config)

    broken = tokenizer("broken")
    (broken / "tokenizer.json").write_text('{"model": {"type": "Nonsense"}}')
    _refused(capsys, ["eval", ck, "--text", tmp_path / "t.txt", "--tokenizer", broken, "--quiet"],
             f"{broken / 'tokenizer.json'}: not a tokenizer the tokenizers library reads")
    cut = tokenizer("cut")
    (cut / "tokenizer.json").write_bytes((cut / "tokenizer.json").read_bytes()[:200])
    _refused(capsys, ["eval", ck, "--text", tmp_path / "t.txt", "--tokenizer", cut, "--quiet"],
             f"{cut / 'tokenizer.json'}: tokenizer is not valid JSON")
    code = tokenizer("code", auto_map={"AutoTokenizer": ["evil.EvilTokenizer", None]})
    _refused(capsys, ["eval", ck, "--text", tmp_path / "t.txt", "--tokenizer", code, "--quiet"],
             "'auto_map' names Python code to import")
    fifo = tmp_path / "fifo"
    fifo.mkdir()
    import os

    os.mkfifo(fifo / "tokenizer.json")
    _refused(capsys, ["eval", ck, "--text", tmp_path / "t.txt", "--tokenizer", fifo, "--quiet"], "a FIFO")
    big = tokenizer("big", tok=_wide_tokenizer())
    _refused(capsys, ["eval", ck, "--text", tmp_path / "t.txt", "--tokenizer", big, "--quiet"],
             "outside the model's vocabulary [0, 128)")
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9")
    _refused(capsys, ["eval", ck, "--text", tmp_path / "latin1.txt", "--tokenizer", tokenizer("ok"), "--quiet"],
             "not UTF-8", "--byte-tokens")


def _wide_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 500, "world": 501}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok


def test_load_tokenizer_missing_file_names_it(tmp_path):
    with pytest.raises(ModelError, match="tokenizer.json: cannot read tokenizer"):
        load_tokenizer(tmp_path)


@pytest.mark.parametrize("seq_len", [2, 3, 8])
@pytest.mark.parametrize("n", [1, 2, 7, 8, 9, 30])
def test_windows_score_each_token_once_after_its_own_prefix(n, seq_len):
    """Without lm-eval: every window runs a contiguous slice of [prefix] + ids of at most L ids whose
    logits predict the next id, and the scored continuations tile ids exactly once, in order."""
    ids = np.arange(100, 100 + n)
    stream = [7] + ids.tolist()
    w = rolling_windows(ids, 7, seq_len)
    scored = []
    for inp, tgt, k in zip(w.inputs.tolist(), w.targets.tolist(), w.scored.tolist()):
        start = stream.index(inp[0]) if inp[0] != 7 else 0
        assert len(inp) <= seq_len and stream[start:start + len(inp) + 1] == inp + tgt[-1:]
        assert tgt == stream[start + 1:start + 1 + len(inp)] and 1 <= k <= len(inp)
        scored += tgt[len(tgt) - k:]
    assert scored == ids.tolist()
