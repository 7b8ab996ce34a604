"""A tiny BPE tokenizer built in code (no download) and a checkpoint folder copy that carries it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

CKPTS = Path(__file__).resolve().parents[1] / "fixtures" / "interop" / "checkpoints"
CORPUS = ["the quick brown fox jumps over the lazy dog", "fp8 numbers round to nearest even",
          "a scale per tensor and a scale per channel", "hello world, hello fp8: 0123456789."]
SPECIAL = ["<unk>", "<s>", "</s>"]


def build_tokenizer(vocab_size: int = 120):
    """A BPE over the corpus' characters with whitespace pre-tokenization, ``vocab_size`` ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(CORPUS * 4, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                                            show_progress=False))
    assert tok.get_vocab_size() <= vocab_size
    return tok


def save_tokenizer(folder: Path, tok=None, **config) -> Path:
    """tokenizer.json + tokenizer_config.json (what transformers' PreTrainedTokenizerFast reads)."""
    folder.mkdir(parents=True, exist_ok=True)
    (tok or build_tokenizer()).save(str(folder / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
           "unk_token": "<unk>", "model_max_length": 64, **config}
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    return folder


def checkpoint_with_tokenizer(tmp_path: Path, name: str = "llmc_fp8", **config) -> Path:
    """A copy of a committed fixture checkpoint with the code-built tokenizer beside its weights."""
    ck = tmp_path / name
    shutil.copytree(CKPTS / name, ck)
    return save_tokenizer(ck, **config)
