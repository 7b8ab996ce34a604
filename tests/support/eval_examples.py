"""Tiny lm-eval tasks over local JSONL (generated here, in code): what the lm-eval tests run and what
tools/make_eval_examples.py commits as specs/examples/eval/ for the README's recipe."""

from __future__ import annotations

import json
from pathlib import Path

from tests.support.tokenizers_fixture import CORPUS

QUESTIONS = [("the quick brown", ["fox", "dog", "scale"], 0), ("hello", ["world", "tensor", "even"], 0),
             ("round to nearest", ["even", "fox", "lazy"], 0), ("a scale per", ["tensor", "hello", "brown"], 0),
             ("jumps over the", ["lazy dog", "fp8", "channel"], 0), ("fp8 numbers", ["round", "jumps", "a"], 0)]


TASKS = ["tiny_mc", "tiny_ppl"]


def write_tasks(folder: Path, data_prefix: str | None = None) -> Path:
    """Two tasks over local JSONL: tiny_mc (multiple choice, acc) and tiny_ppl (rolling perplexity).
    The YAMLs name their data by absolute path, or as ``data_prefix/NAME`` (relative to where lm-eval
    runs: the committed examples use the repository root)."""
    folder.mkdir(parents=True, exist_ok=True)
    data = data_prefix or str(folder)
    with open(folder / "mc.jsonl", "w") as f:
        for q, choices, answer in QUESTIONS:
            f.write(json.dumps({"question": q, "choices": choices, "answer": answer}) + "\n")
    with open(folder / "ppl.jsonl", "w") as f:
        for i in range(3):
            f.write(json.dumps({"text": " ".join(CORPUS[i:] + CORPUS[:i]) * (i + 1)}) + "\n")
    (folder / "tiny_mc.yaml").write_text(f"""task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}/mc.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
""")
    (folder / "tiny_ppl.yaml").write_text(f"""task: tiny_ppl
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}/ppl.jsonl
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
""")
    return folder
