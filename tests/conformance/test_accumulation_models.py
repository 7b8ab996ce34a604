"""``fp8ref conform --accumulation MODEL|best`` and ``pytest --fp8ref-accumulation=MODEL``: a live
backend's GEMMs judged bit for bit against a named accumulation model, the best-explaining
model named. Backends: fp8ref's kernel models posing as GPUs (tests/support/model_backends.py)."""

import json

import pytest

from fp8ref.conformance import Backend, run
from fp8ref.golden import parse_suite
from fp8ref.io import safetensors as st
from tests.support import model_backends
from tests.support.cli import run_cli
from tests.support.plugin import pytest_in

SUITE = """\
suite: accrun
seed: 4
operations:
  - op: scaled_mm
    formats: [float8_e4m3fn]
    shapes: {1: [[4, 288, 10]]}
    scales: [tensor, row]
    out_dtypes: [float32, bfloat16]
    accumulate: [exact, fp32]
  - op: linear
    schemes: [FP8_STATIC]
    recipes: [fp8ref]
    dtypes: [bfloat16]
    shapes: {1: [[3, 256, 16]]}
    accumulate: [exact]
"""
MODELS = {"hopper-fast-accum": "HopperFastAccum", "hopper-promoted": "HopperPromoted", "blackwell-fp8": "BlackwellFp8"}


@pytest.fixture(scope="module")
def suite_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("accrun") / "accrun.yaml"
    path.write_text(SUITE)
    return path


def _conform(capsys, backend, suite_file, *args):
    code = run_cli("conform", "--backend", f"tests.support.model_backends:{backend}", "--suite", suite_file,
                   "--quiet", *args)
    return code, capsys.readouterr()


@pytest.mark.parametrize("model", MODELS)
def test_passes_under_its_model_and_fails_under_exact(capsys, suite_file, model):
    code, cap = _conform(capsys, MODELS[model], suite_file, "--accumulation", model)
    assert code == 0 and "result: PASS; 9 case(s) compared" in cap.out, cap.out
    assert f"best: {model} (every element)" in cap.out
    code, cap = _conform(capsys, MODELS[model], suite_file, "--accumulation", "exact", "--max-errors", "1")
    assert code == 1 and "result: FAIL" in cap.out and f"best: {model} (every element)" in cap.out
    assert "accumulation='exact')" in cap.out  # the repro re-judges against the same model


@pytest.mark.parametrize("model", MODELS)
def test_best_names_the_model_in_json(capsys, suite_file, model):
    code, cap = _conform(capsys, MODELS[model], suite_file, "--accumulation", "best", "--json", "-")
    assert code == 0, cap.err
    acc = json.loads(cap.out)["runs"][0]["accumulation"]
    assert acc["best"] == acc["judged_against"] == model and acc["ranking"][0]["model"] == model
    assert acc["ranking"][0]["matched"] == acc["ranking"][0]["elements"] > acc["ranking"][1]["matched"]


def test_one_wrong_bit_fails_under_the_right_model(capsys, suite_file, tmp_path):
    code, cap = _conform(capsys, "FlippedLsb", suite_file, "--accumulation", "hopper-fast-accum",
                         "--dump-failing", tmp_path / "dump")
    assert code == 1 and "result: FAIL: 8 unexpected mismatch(es)" in cap.out, cap.out
    assert "best: hopper-fast-accum (" in cap.out and "every element" not in cap.out
    dumped = sorted(tmp_path.joinpath("dump").iterdir())
    assert len(dumped) == 8  # each failing case, its expected outputs those of the model judged against
    t = st.load(dumped[0])
    assert (t["expected/out"] != t["got/out"]).sum() == 1


class Asked(Backend):
    """Records the accumulate it is asked for; computes hopper-promoted."""

    name = "asked"
    capabilities = {"scaled_mm": {"accumulate": ("hopper-promoted", "exact")}}
    seen: list = []

    def scaled_mm(self, a, b, scale_a, scale_b, *, accumulate, **kw):
        self.seen.append(accumulate)
        return model_backends.HopperPromoted().scaled_mm(a, b, scale_a, scale_b, accumulate=accumulate, **kw)


def test_the_backend_is_asked_for_the_model(suite_file):
    """Under MODEL the backend is asked for accumulate=MODEL (and capabilities checked against it);
    under best, for each case's own accumulate. A declared unspecified order does not apply."""
    suite = parse_suite(SUITE, source="accrun.yaml")
    Asked.seen = []
    r = run(Asked(), suite, accumulation="hopper-promoted")
    assert set(Asked.seen) == {"hopper-promoted"} and r.exit_code == 0 and r.compared() == 8
    Asked.seen = []
    r = run(Asked(), suite, accumulation="best")
    assert set(Asked.seen) == {"exact"} and r.accumulation.judged_against == "hopper-promoted" and r.exit_code == 0
    assert sum(c.status == "not-implemented" for c in r.results) == 5  # fp32 cases, linear: not declared
    bounded = run("tests.support.broken_backends:ReverseOrderMM", suite, accumulation="fp32")
    assert bounded.exit_code == 1 and not any(c.in_bound for c in bounded.results)  # bit for bit, no bound


def test_unknown_model_is_one_usage_line(capsys, suite_file):
    code, cap = _conform(capsys, "HopperPromoted", suite_file, "--accumulation", "hopper-promotd")
    assert code == 2 and cap.out == "" and cap.err.count("\n") == 1
    assert "did you mean 'hopper-promoted'?" in cap.err


def test_plugin_judges_against_the_model(tmp_path, suite_file):
    args = ["--fp8ref-backend=tests.support.model_backends:BlackwellFp8", f"--fp8ref-suite={suite_file}"]
    code, out = pytest_in(tmp_path, *args, "--fp8ref-accumulation=blackwell-fp8")
    assert code == 0 and "10 passed" in out, out  # 9 cases and the project's own test
    code, out = pytest_in(tmp_path, *args, "--fp8ref-accumulation=exact")
    assert code == 1 and "best: blackwell-fp8 (every element) for this case" in out, out
    code, out = pytest_in(tmp_path, *args, "--fp8ref-accumulation=best")
    assert code == 4 and "fp8ref conform --accumulation best" in out
    code, out = pytest_in(tmp_path, *args, "--fp8ref-accumulation=blackwel-fp8")
    assert code == 4 and "did you mean 'blackwell-fp8'?" in out
