"""lm-eval-harness on fp8ref's model (tox -e eval): ``import fp8ref.eval`` registers the lm-eval
model "fp8ref"; on a tiny local task its producer-mode results equal lm-eval's own ``hf`` model on
transformers' reload of the same checkpoint (llm-compressor's through compressed-tensors, auto-round's
through auto-round), number for number."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.support.eval_examples import TASKS, write_tasks
from tests.support.tokenizers_fixture import CKPTS, CORPUS, checkpoint_with_tokenizer

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("transformers")

def _numbers(results: dict) -> dict:
    return {task: {k: v for k, v in r.items() if isinstance(v, float)} for task, r in results.items()}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """llm-compressor's FP8 checkpoint (transformers reloads it through compressed-tensors)."""
    tmp = tmp_path_factory.mktemp("lm_eval")
    return checkpoint_with_tokenizer(tmp), write_tasks(tmp / "tasks")


@pytest.fixture(scope="module")
def ar_world(tmp_path_factory):
    """auto-round's FP8_STATIC checkpoint (transformers reloads it through auto-round)."""
    pytest.importorskip("auto_round")
    tmp = tmp_path_factory.mktemp("lm_eval_ar")
    return checkpoint_with_tokenizer(tmp, "autoround_fp8_static"), write_tasks(tmp / "tasks")


@pytest.mark.parametrize("which", ["world", "ar_world"])
@pytest.mark.parametrize("softmax_dtype", [None, "float32"])
def test_producer_results_equal_lm_evals_hf_model_on_transformers_reload(request, which, softmax_dtype):
    """None: lm-eval's default, log-softmax in the model's bf16 (sums rounded to bf16); float32
    resolves the modes: reference mode's numbers then differ from producer's."""
    pytest.importorskip("compressed_tensors")
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    import fp8ref.eval  # noqa: F401  (registers "fp8ref")

    ck, tasks = request.getfixturevalue(which)
    manager = TaskManager(include_path=str(tasks))
    extra = f",softmax_dtype={softmax_dtype}" if softmax_dtype else ""

    def ours(mode):
        return _numbers(lm_eval.simple_evaluate(model="fp8ref", model_args=f"checkpoint={ck},mode={mode}{extra}",
                                                tasks=TASKS, task_manager=manager, batch_size=4)["results"])

    hf = HFLM(pretrained=str(ck), tokenizer=str(ck), device="cpu", dtype="bfloat16", batch_size=4,
              softmax_dtype=softmax_dtype)
    theirs = _numbers(lm_eval.simple_evaluate(model=hf, tasks=TASKS, task_manager=manager)["results"])
    producer = ours("producer")
    assert producer == theirs and math.isfinite(producer["tiny_ppl"]["word_perplexity,none"])
    assert len(producer["tiny_ppl"]) == 3 and 0 <= producer["tiny_mc"]["acc,none"] <= 1
    if softmax_dtype:
        assert ours("reference")["tiny_ppl"] != producer["tiny_ppl"]


def test_cli_tasks_in_reference_mode_answer(world, tmp_path, capsys):
    from fp8ref.cli import main

    ck, tasks = world
    out = tmp_path / "r.json"
    assert main(["eval", str(ck), "--tasks", "tiny_mc,tiny_ppl", "--include-path", str(tasks), "--mode",
                 "reference", "--limit", "4", "--json", str(out), "--quiet"]) == 0
    r = json.loads(out.read_text())
    assert r["mode"] == "reference" and r["tokenizer"] == str(ck / "tokenizer.json")
    assert 0 <= r["results"]["tiny_mc"]["acc,none"] <= 1
    assert math.isfinite(r["results"]["tiny_ppl"]["word_perplexity,none"])


def test_the_committed_examples_run_from_the_repository_root(world, tmp_path, monkeypatch):
    """The README's recipe: specs/examples/eval's tasks and tokenizer with the committed checkpoint give
    the numbers of the same data and tokenizer built in the test's folder."""
    from fp8ref.cli import main

    ck, tasks = world
    root = Path(__file__).resolve().parents[3]
    monkeypatch.chdir(root)
    runs = {}
    for name, argv in {"committed": [str(CKPTS / "llmc_fp8"), "--include-path", "specs/examples/eval",
                                     "--tokenizer", "specs/examples/eval/tokenizer"],
                       "built": [str(ck), "--include-path", str(tasks)]}.items():
        out = tmp_path / f"{name}.json"
        assert main(["eval", *argv, "--tasks", "tiny_mc,tiny_ppl", "--mode", "producer", "--json", str(out),
                     "--quiet"]) == 0
        runs[name] = _numbers(json.loads(out.read_text())["results"])
    assert runs["committed"] == runs["built"] and len(runs["committed"]["tiny_ppl"]) == 3


def test_several_modes_give_one_table_with_llm_compressors_recovery(world, tmp_path, capsys):
    """--mode reference,original: each mode's numbers are those of its own run; recovery is
    quantized / original (original / quantized for perplexities, where lower is better); the worst
    task's per-layer figures come from compare, worst layer first."""
    from fp8ref.cli import main

    ck, tasks = world
    common = ["--tasks", "tiny_mc,tiny_ppl", "--include-path", str(tasks), "--original",
              str(CKPTS / "original_bf16"), "--quiet"]
    single = {}
    for mode in ("reference", "original"):
        out = tmp_path / f"{mode}.json"
        assert main(["eval", str(ck), *common, "--mode", mode, "--json", str(out)]) == 0
        single[mode] = _numbers(json.loads(out.read_text())["results"])
    out = tmp_path / "both.json"
    assert main(["eval", str(ck), *common, "--mode", "reference,original", "--json", str(out)]) == 0
    both = json.loads(out.read_text())
    for mode in ("reference", "original"):
        assert both["metrics"][mode] == {t: {k: v for k, v in m.items() if k != "sample_len" and "_stderr" not in k}
                                         for t, m in single[mode].items()}
    rec, ref, orig = both["recovery"]["reference"], single["reference"], single["original"]
    assert rec["tiny_mc"]["acc,none"] == ref["tiny_mc"]["acc,none"] / orig["tiny_mc"]["acc,none"]
    ppl = "word_perplexity,none"
    assert rec["tiny_ppl"][ppl] == orig["tiny_ppl"][ppl] / ref["tiny_ppl"][ppl] != 1.0
    lowest = {t: min(r.values()) for t, r in rec.items()}
    w = both["worst_task"]
    assert w["task"] == min(lowest, key=lowest.get) and w["mode"] == "reference" and w["tokens"] >= 2
    rms = [x["rel_rms"] for x in w["layers"]]
    assert rms == sorted(rms, reverse=True) and rms[0] > 0 and all(x["name"].startswith("model.") for x in w["layers"])


def test_recovery_follows_each_metrics_direction():
    from fp8ref.eval import recovery, worst_task

    q = {"t": {"acc,none": 0.45, "word_perplexity,none": 12.0, "f1,none": 0.3}}
    o = {"t": {"acc,none": 0.5, "word_perplexity,none": 10.0, "f1,none": 0.0}}
    r = recovery(q, o, {"t": {"acc": True, "word_perplexity": False, "f1": True}})
    assert r == {"t": {"acc,none": 0.45 / 0.5, "word_perplexity,none": 10.0 / 12.0, "f1,none": None}}
    assert worst_task({"a": {"x": 0.99}, "b": {"x": 0.9, "y": None}, "c": {"y": None}}) == "b"


def test_remote_dataset_task_is_refused_offline(world, tmp_path, capsys):
    from fp8ref.cli import main

    ck, _ = world
    (tmp_path / "remote.yaml").write_text("task: remote_mc\ndataset_path: someone/some_dataset\ntest_split: test\n"
                                          "output_type: multiple_choice\ndoc_to_text: q\ndoc_to_choice: [a, b]\n"
                                          "doc_to_target: 0\n")
    code = main(["eval", str(ck), "--tasks", "remote_mc", "--include-path", str(tmp_path), "--quiet"])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1 and "dataset_path 'someone/some_dataset' is not a local dataset" in err


def test_fp8ref_model_refuses_trust_remote_code():
    import fp8ref.eval
    from fp8ref.errors import ModelError

    with pytest.raises(ModelError, match="trust_remote_code is refused"):
        fp8ref.eval.Fp8RefLM(checkpoint=str(CKPTS / "llmc_fp8"), trust_remote_code=True)


@pytest.mark.parametrize("which", ["world", "ar_world"])
@pytest.mark.parametrize("seq_len", [16, 64])
def test_eval_text_equals_lm_evals_rolling_loglikelihood_on_transformers_reload(request, which, tmp_path, capsys,
                                                                                  seq_len):
    """fp8ref eval --text in producer mode: its total NLL is -loglikelihood_rolling of lm-eval's hf
    model (softmax_dtype float64, max_length = --seq-len, same batch) on transformers' reload, bit for bit."""
    pytest.importorskip("compressed_tensors")
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from fp8ref.cli import main

    ck, _ = request.getfixturevalue(which)
    text = " ".join(CORPUS * 3)
    (tmp_path / "t.txt").write_text(text)
    out = tmp_path / "r.json"
    assert main(["eval", str(ck), "--text", str(tmp_path / "t.txt"), "--mode", "producer", "--seq-len", str(seq_len),
                 "--batch", "4", "--json", str(out), "--quiet"]) == 0
    ours = json.loads(out.read_text())
    hf = HFLM(pretrained=str(ck), tokenizer=str(ck), device="cpu", dtype="bfloat16", batch_size=4,
              max_length=seq_len, softmax_dtype="float64")
    [theirs] = hf.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])
    assert ours["tokens"] == len(hf.tok_encode(text)) and ours["sequences"] > 1
    assert ours["nll"] == -theirs
