"""``fp8ref golden import onnx-node``: ONNX's own Cast / CastLike node tests (written from the onnx wheel's
generators by tools/make_onnx_node_vectors.py, committed in tests/fixtures/onnx_node) as golden folders.

The acceptance of issue #24: fp8ref's own rule agrees with every float8 and E8M0 vector bit for bit,
its ONNX profile with every vector; hostile node tests are refused with one ``fp8ref: error:`` line
and nothing written.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from fp8ref.golden import check, verify
from tests.support.cli import run_cli

pytestmark = pytest.mark.interop
onnx = pytest.importorskip("onnx")

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "onnx_node"


def _import(tmp_path, *extra, source=FIXTURE):
    out = tmp_path / "golden"
    code = run_cli("golden", "import", "onnx-node", source, "-o", out, *extra)
    return code, out


def _verdicts(out):
    results, problems = check(out, Path(f"{out}.onnx.safetensors"))
    assert problems == []
    return {r.case: r for r in results}


def test_fp8ref_rule_agrees_with_every_float8_and_e8m0_vector(tmp_path, capsys):
    code, out = _import(tmp_path)
    assert code == 0
    assert verify(out)[0] == []  # golden verify accepts the imported folder
    results = _verdicts(out)
    assert len(results) >= 20
    differ = {name: len(r.mismatches) for name, r in results.items() if r.mismatches or r.status != "compared"}
    assert {n for n in differ if "float4" not in n} == set(), differ
    text = capsys.readouterr().out
    assert "left out" in text and "FLOAT4E2M1" in text  # FP4 NaN inputs: fp8ref refuses them, said so


def test_onnx_profile_agrees_with_every_vector(tmp_path):
    code, out = _import(tmp_path, "--profile", "onnx")
    assert code == 0
    assert verify(out)[0] == []
    results = _verdicts(out)
    assert all(r.status == "compared" and not r.mismatches for r in results.values()), \
        {n: r.mismatches[:2] for n, r in results.items() if r.mismatches}


def _copy_test(tmp_path, name="test_cast_FLOAT_to_FLOAT8E4M3FN"):
    dst = tmp_path / "src" / name
    shutil.copytree(FIXTURE / name, dst)
    return dst


def _refused(tmp_path, capsys, source, needle):
    code, out = _import(tmp_path, source=source)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1 and err[0].startswith("fp8ref: error: ") and needle in err[0], err
    assert not out.exists() and not Path(f"{out}.onnx.safetensors").exists()


def test_a_graph_of_two_nodes_is_refused(tmp_path, capsys):
    src = _copy_test(tmp_path)
    model = onnx.load(src / "model.onnx")
    model.graph.node.append(onnx.helper.make_node("Identity", ["output"], ["extra"]))
    onnx.save(model, src / "model.onnx")
    _refused(tmp_path, capsys, src, "expected a graph of a single Cast or CastLike node")


def test_an_unsupported_node_is_refused(tmp_path, capsys):
    src = _copy_test(tmp_path)
    model = onnx.load(src / "model.onnx")
    model.graph.node[0].op_type = "Relu"
    onnx.save(model, src / "model.onnx")
    _refused(tmp_path, capsys, src, "['Relu']")


def test_a_tensor_of_the_wrong_type_is_refused(tmp_path, capsys):
    src = _copy_test(tmp_path)
    t = onnx.TensorProto.FromString((src / "test_data_set_0" / "input_0.pb").read_bytes())
    t.data_type = onnx.TensorProto.FLOAT16
    (src / "test_data_set_0" / "input_0.pb").write_bytes(t.SerializeToString())
    _refused(tmp_path, capsys, src, "element type 10 does not match the graph's 1")


def test_a_truncated_tensor_is_refused(tmp_path, capsys):
    src = _copy_test(tmp_path)
    t = onnx.TensorProto.FromString((src / "test_data_set_0" / "output_0.pb").read_bytes())
    t.raw_data = t.raw_data[:-1]
    (src / "test_data_set_0" / "output_0.pb").write_bytes(t.SerializeToString())
    _refused(tmp_path, capsys, src, "truncated or padded")


def test_a_truncated_protobuf_is_refused(tmp_path, capsys):
    src = _copy_test(tmp_path)
    data = (src / "test_data_set_0" / "input_0.pb").read_bytes()
    (src / "test_data_set_0" / "input_0.pb").write_bytes(data[: len(data) // 2])
    _refused(tmp_path, capsys, src, "input_0.pb")


def test_an_output_name_that_does_not_match_is_refused(tmp_path, capsys):
    src = _copy_test(tmp_path)
    t = onnx.TensorProto.FromString((src / "test_data_set_0" / "output_0.pb").read_bytes())
    t.name = "y"
    (src / "test_data_set_0" / "output_0.pb").write_bytes(t.SerializeToString())
    _refused(tmp_path, capsys, src, "tensor name 'y' does not match the graph's 'output'")


def test_one_bad_test_among_good_ones_imports_nothing(tmp_path, capsys):
    root = tmp_path / "src"
    _copy_test(tmp_path, "test_cast_FLOAT16_to_FLOAT8E5M2")
    bad = _copy_test(tmp_path)
    (bad / "test_data_set_0" / "output_0.pb").unlink()
    _refused(tmp_path, capsys, root, "expected exactly")


def test_an_existing_outputs_file_is_not_replaced_without_force(tmp_path, capsys):
    peer = tmp_path / "golden.onnx.safetensors"
    peer.write_bytes(b"mine")
    code, out = _import(tmp_path, source=FIXTURE / "test_cast_FLOAT_to_FLOAT8E4M3FN")
    err = capsys.readouterr().err
    assert code == 1 and "pass --force" in err and peer.read_bytes() == b"mine" and not out.exists()
    code, out = _import(tmp_path, "--force", source=FIXTURE / "test_cast_FLOAT_to_FLOAT8E4M3FN")
    assert code == 0 and peer.read_bytes() != b"mine" and verify(out)[0] == []
