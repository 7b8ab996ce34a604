"""``golden check --accumulation MODEL|best``: GEMM outputs judged bit for bit against a named
accumulation model, and the model that explains them named.

The outputs come from fp8ref's kernel models posing as GPUs (tests/support/model_backends.py:
``fp8ref.hardware.kernel_mm`` and its own epilogue), the expected ones from
``scaled_mm(accumulate=MODEL)``; K is long enough (> 128, several wgmma steps) that every
preset differs from every other on some element, so a wrong model must fail."""

import json

import numpy as np
import pytest

from fp8ref.errors import GoldenError
from fp8ref.golden import check, generate, open_golden, parse_suite
from fp8ref.golden.accumulation import ModelJudge
from fp8ref.golden.judge import CaseResult
from fp8ref.golden.ops import OPERATIONS
from fp8ref.io import safetensors as st
from tests.support import model_backends
from tests.support.cli import run_cli

SUITE = """\
suite: acctest
seed: 12
operations:
  - op: scaled_mm
    formats: [float8_e4m3fn]
    shapes: {1: [[6, 288, 12], [3, 160, 5]]}
    scales: [tensor, row]
    out_dtypes: [float32, bfloat16]
    accumulate: [exact]
    bias: [false, true]
  - op: linear
    schemes: [FP8_STATIC]
    recipes: [fp8ref]
    dtypes: [float32]
    shapes: {1: [[4, 384, 24]]}
    accumulate: [exact]
  - op: decode
    formats: [float8_e4m3fn]
"""
BACKENDS = {"hopper-fast-accum": model_backends.HopperFastAccum, "hopper-promoted": model_backends.HopperPromoted,
            "blackwell-fp8": model_backends.BlackwellFp8}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("acc") / "g"
    generate(parse_suite(SUITE, source="acctest.yaml"), path)
    return path


def _outputs(folder, backend, path):
    """What ``backend`` computes for every case (GEMMs), the stored expected outputs otherwise."""
    out = {}
    for case, expected in open_golden(folder).iter_cases():
        op = OPERATIONS[case.op]
        got = op.call(backend, case.params, case.inputs) if "accumulate" in op.params else expected
        out.update({f"{case.name}/{k}": np.asarray(v) for k, v in got.items()})
    st.save(path, out, {})
    return path


@pytest.fixture(scope="module")
def outputs(folder, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("outs")
    files = {m: _outputs(folder, cls(), tmp / f"{m}.safetensors") for m, cls in BACKENDS.items()}
    files["flipped"] = _outputs(folder, model_backends.FlippedLsb(), tmp / "flipped.safetensors")
    return files


def _check(capsys, folder, outputs, *args):
    code = run_cli("golden", "check", folder, "--outputs", outputs, *args)
    return code, capsys.readouterr()


@pytest.mark.parametrize("model", BACKENDS)
def test_passes_under_its_model_fails_under_exact_and_is_named(capsys, folder, outputs, model):
    code, cap = _check(capsys, folder, outputs[model], "--accumulation", model)
    assert code == 0, cap.out
    assert f"accumulation model {model!r}" in cap.out and "result: PASS" in cap.out
    assert f"best: {model} (every element)" in cap.out
    code, cap = _check(capsys, folder, outputs[model], "--accumulation", "exact", "--max-errors", "1")
    assert code == 1 and "result: FAIL" in cap.out, cap.out
    assert f"best: {model} (every element)" in cap.out  # the ranking names what the outputs are


@pytest.mark.parametrize("model", BACKENDS)
def test_every_other_kernel_model_is_rejected(capsys, folder, outputs, model):
    for other in BACKENDS:
        if other != model:
            code, cap = _check(capsys, folder, outputs[model], "--accumulation", other, "--max-errors", "1")
            assert code == 1, f"{model}'s outputs passed as {other}"


@pytest.mark.parametrize("model", BACKENDS)
def test_best_ranks_every_model_in_json(capsys, folder, outputs, model):
    code, cap = _check(capsys, folder, outputs[model], "--accumulation", "best", "--json", "-")
    assert code == 0, cap.err
    report = json.loads(cap.out)
    acc = report["accumulation"]
    assert acc["model"] == "best" and acc["best"] == acc["judged_against"] == model and acc["tied"] == []
    top, *rest = acc["ranking"]
    assert top["model"] == model and top["matched"] == top["elements"] == 8 * (6 * 12 + 3 * 5) + 4 * 24
    assert top["max_ulp"] is None and top["cases"] == 17 and top["not_applicable"] == 0
    assert all(r["matched"] < top["matched"] for r in rest)
    na = {r["model"] for r in rest if r["not_applicable"] == r["cases"]}
    # block-scale codes / FNUZ operands only
    assert na == {"blackwell-mxfp4", "blackwell-mxfp8", "blackwell-nvfp4", "cdna3"}
    gemm = [c for c in report["cases"] if c["op"] != "decode"]
    assert {c["rule"] for c in gemm} == {f"model {model}"} and {c["params"]["accumulate"] for c in gemm} == {model}
    assert [c["rule"] for c in report["cases"] if c["op"] == "decode"] == ["bit-exact"]


def test_one_wrong_bit_fails_and_is_counted(capsys, folder, outputs):
    code, cap = _check(capsys, folder, outputs["flipped"], "--accumulation", "hopper-fast-accum", "--json", "-")
    report = json.loads(cap.out)
    assert code == 1 and "result: FAIL" in cap.err
    flipped = [c for c in report["cases"] if c["op"] == "scaled_mm"]
    assert all(c["mismatches"] == 1 and c["examples"][0]["index"] == [0, 0] and c["examples"][0]["ulp"] == 1
               for c in flipped)
    top = report["accumulation"]["ranking"][0]
    assert top["model"] == "hopper-fast-accum" and top["matched"] == top["elements"] - len(flipped)
    assert top["max_ulp"] == 1
    code, cap = _check(capsys, folder, outputs["flipped"], "--accumulation", "best")
    assert code == 1 and "best: hopper-fast-accum (" in cap.out and "every element" not in cap.out


def test_a_model_that_cannot_compute_the_cases_is_an_error(capsys, folder, outputs):
    code, cap = _check(capsys, folder, outputs["hopper-fast-accum"], "--accumulation", "cdna3")
    assert code == 1 and "takes float8_e4m3fnuz x float8_e4m3fnuz operands" in cap.out
    assert cap.out.count("ERROR scaled_mm.") == 16 and "ERROR linear." in cap.out


def test_unknown_model_is_one_usage_line(capsys, folder, outputs):
    code, cap = _check(capsys, folder, outputs["hopper-fast-accum"], "--accumulation", "hoper-fast-accum")
    assert code == 2 and cap.out == ""
    assert cap.err.count("\n") == 1 and "did you mean 'hopper-fast-accum'?" in cap.err
    assert cap.err.startswith("fp8ref golden check: error: --accumulation: unknown model 'hoper-fast-accum'")


def test_exclusive_with_the_unspecified_order(capsys, folder, outputs):
    with pytest.raises(SystemExit) as exc:
        _check(capsys, folder, outputs["hopper-fast-accum"], "--accumulation", "exact",
               "--accumulation-order", "unspecified")
    assert exc.value.code == 2 and "not allowed with argument" in capsys.readouterr().err
    with pytest.raises(GoldenError, match="exclude each other"):
        check(folder, outputs["hopper-fast-accum"], accumulation="exact", accumulation_order="unspecified")
    with pytest.raises(GoldenError, match="did you mean 'fp32'"):
        check(folder, outputs["hopper-fast-accum"], accumulation="fp23")


class _Seed:
    seed = 3


@pytest.mark.parametrize("fmt, kernel", [("float8_e4m3fnuz", "cdna3"), ("float8_e4m3fn", "ada-fast-accum")])
def test_judge_names_cdna3_and_ada_on_their_operands(fmt, kernel):
    """The judge itself, on cases no shipped suite has (CDNA3 takes FNUZ codes): the model's own
    kernel_mm outputs pass under it, fail under exact, and best names it."""
    from fp8ref.hardware import kernel_mm

    op = OPERATIONS["scaled_mm"]
    params = {"format": fmt, "scales": "row", "out_dtype": "float32", "accumulate": "exact",
              "scale_order": "epilogue", "bias": False, "shape": [5, 256, 9]}
    case = op.make_case("judge-case", params, None, _Seed(), 1)
    got = {"out": kernel_mm(case.inputs["a"], case.inputs["b"], case.inputs["scale_a"].reshape(-1, 1),
                            case.inputs["scale_b"].reshape(1, -1), kernel=kernel)}
    verdicts = {}
    for model in (kernel, "exact", "best"):
        judge, result = ModelJudge(model), CaseResult("judge-case", "scaled_mm", params)
        judge.judge(result, op, "judge-case", params, case.inputs, got)
        judge.finish()
        verdicts[model] = (len(result.mismatches), result.status, judge.best().model, judge.judged_against)
    assert verdicts[kernel] == (0, "compared", kernel, kernel)
    assert verdicts["exact"][0] > 0 and verdicts["exact"][2] == kernel
    assert verdicts["best"] == (0, "compared", kernel, kernel)


def test_models_the_cases_cannot_tell_apart_are_named_as_ties():
    """With K <= 128 (one promotion interval) the three Hopper presets give the same bits: best is
    the first of them in registry order and the others are named, not hidden."""
    from fp8ref.hardware import kernel_mm

    op = OPERATIONS["scaled_mm"]
    params = {"format": "float8_e4m3fn", "scales": "row", "out_dtype": "float32", "accumulate": "exact",
              "scale_order": "epilogue", "bias": False, "shape": [5, 64, 9]}
    case = op.make_case("tie-case", params, None, _Seed(), 1)
    got = {"out": kernel_mm(case.inputs["a"], case.inputs["b"], case.inputs["scale_a"].reshape(-1, 1),
                            case.inputs["scale_b"].reshape(1, -1), kernel="hopper-promoted")}
    judge, result = ModelJudge("best"), CaseResult("tie-case", "scaled_mm", params)
    judge.judge(result, op, "tie-case", params, case.inputs, got)
    judge.finish()
    assert judge.judged_against == "hopper-fast-accum" and not result.mismatches
    assert judge.tied() == ["hopper-promoted", "deepgemm-1x128-128x128"]
    assert judge.report_lines()[-1].endswith("also every element (these cases do not tell them apart)")
