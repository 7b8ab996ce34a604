"""specs/examples/eval/ (the README's evaluation recipe) is what tools/make_eval_examples.py writes:
the task files byte for byte, the tokenizer the same vocabulary and the same encodings."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.support.tokenizers_fixture import CORPUS

ROOT = Path(__file__).resolve().parents[3]
COMMITTED = ROOT / "specs" / "examples" / "eval"


def _make(out: Path) -> None:
    spec = importlib.util.spec_from_file_location("make_eval_examples", ROOT / "tools" / "make_eval_examples.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(str(out))


def test_committed_examples_equal_the_generators_output(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    _make(tmp_path / "eval")
    for name in ("tiny_mc.yaml", "tiny_ppl.yaml", "mc.jsonl", "ppl.jsonl", "tokenizer/tokenizer_config.json"):
        assert (tmp_path / "eval" / name).read_bytes() == (COMMITTED / name).read_bytes(), name
    fresh = tokenizers.Tokenizer.from_file(str(tmp_path / "eval" / "tokenizer" / "tokenizer.json"))
    shipped = tokenizers.Tokenizer.from_file(str(COMMITTED / "tokenizer" / "tokenizer.json"))
    assert fresh.get_vocab() == shipped.get_vocab() and shipped.get_vocab_size() <= 128
    for text in [*CORPUS, "unseen words: 7 ⋅ 8"]:
        assert fresh.encode(text).ids == shipped.encode(text).ids
    assert "test: specs/examples/eval/mc.jsonl" in (COMMITTED / "tiny_mc.yaml").read_text()
