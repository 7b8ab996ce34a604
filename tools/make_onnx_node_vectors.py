"""Write ONNX's float8 / E8M0 / FP4 Cast and CastLike node tests from the generators in the onnx wheel.

The node-test data (``onnx/backend/test/data/node``) left the onnx wheel in onnx #7959 (the last
commit that has it: 6be0677f, opset 25); the generators still ship. Importing
``onnx.backend.test.case.node.cast`` and ``.castlike`` runs their ``export*`` functions (``Cast.export``,
``Cast.export_saturate_false``, ``Cast.export_e8m0``, ``CastLike.export``,
``CastLike.export_saturate_false``), whose ``expect(...)`` calls collect each test's model and data;
this script writes those whose input or output type is a float8, E8M0 or FP4 type as
``python -m onnx.backend.test.cmd_tools generate-data`` would (``model.onnx`` +
``test_data_set_0/{input,output}_K.pb``), into tests/fixtures/onnx_node/ by default.

    /work/venvs/engines/bin/python tools/make_onnx_node_vectors.py [OUT]
    python -m fp8ref golden import onnx-node tests/fixtures/onnx_node -o /tmp/onnx-node
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

CODED = {"FLOAT8E4M3FN", "FLOAT8E4M3FNUZ", "FLOAT8E5M2", "FLOAT8E5M2FNUZ", "FLOAT8E8M0", "FLOAT4E2M1"}
FLOATS = {"FLOAT", "FLOAT16", "BFLOAT16", "DOUBLE"}


def _type_name(value_info) -> str:
    from onnx import TensorProto

    return TensorProto.DataType.Name(value_info.type.tensor_type.elem_type)


def wanted(case) -> bool:
    """A Cast / CastLike between a float type and a float8 / E8M0 / FP4 type; not the ``_expanded``
    copies (CastLike's function body, the same data through several nodes)."""
    graph = case.model.graph
    if case.name.endswith("_expanded"):
        return False
    types = {_type_name(v) for v in [*graph.input, *graph.output]}
    return bool(types & CODED) and bool(types & FLOATS) and types <= CODED | FLOATS


def main(out: Path) -> int:
    import onnx
    import onnx.backend.test.case.node.cast  # noqa: F401 - runs Cast.export*: expect() collects
    import onnx.backend.test.case.node.castlike  # noqa: F401
    from onnx import numpy_helper
    from onnx.backend.test.case import node

    cases = sorted((c for c in node._NodeTestCases if wanted(c)), key=lambda c: c.name)
    if out.exists():
        shutil.rmtree(out)
    for case in cases:
        folder = out / case.name
        folder.mkdir(parents=True)
        (folder / "model.onnx").write_bytes(case.model.SerializeToString())
        for i, (inputs, outputs) in enumerate(case.data_sets):
            ds = folder / f"test_data_set_{i}"
            ds.mkdir()
            for kind, values, infos in (("input", inputs, case.model.graph.input),
                                        ("output", outputs, case.model.graph.output)):
                for j, v in enumerate(values):
                    t = v if isinstance(v, onnx.TensorProto) else numpy_helper.from_array(v, infos[j].name)
                    (ds / f"{kind}_{j}.pb").write_bytes(t.SerializeToString())
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"{len(cases)} node tests (onnx {onnx.__version__}) in {out}, {size} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1]
                  / "tests" / "fixtures" / "onnx_node"))
