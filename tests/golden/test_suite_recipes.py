"""Every recipe of the registry is accepted by golden suites (the list used to be hard-coded
in the suite operations and rejected ``vllm-group``)."""

import numpy as np
import pytest
import torch

from fp8ref import encode
from fp8ref.errors import SpecError
from fp8ref.golden import generate, parse_suite, verify
from fp8ref.golden.folder import open_golden
from fp8ref.registry import recipe_names

VLLM_GROUP = """\
suite: vllm-group
seed: 5
operations:
  - op: quantize
    schemes: [FP8_BLOCK]
    roles: [activation]
    recipes: [vllm-group]
    dtypes: [bfloat16, float32]
    shapes: {1: [[3, 256]]}
  - op: dequantize
    schemes: [FP8_BLOCK]
    roles: [activation]
    recipes: [vllm-group]
    shapes: {1: [[2, 128]]}
"""


def test_a_vllm_group_suite_generates_and_verifies(tmp_path):
    manifest = generate(parse_suite(VLLM_GROUP), tmp_path / "g")
    names = [c["name"] for c in manifest["cases"]]
    assert names == ["quantize.FP8_BLOCK.vllm-group.activation.bfloat16.3x256",
                     "quantize.FP8_BLOCK.vllm-group.activation.float32.3x256",
                     "dequantize.FP8_BLOCK.vllm-group.activation.bfloat16.2x128"]
    assert verify(tmp_path / "g") == ([], [])
    # the expected bytes, recomputed step by step (REFERENCE.md 4.4) from the stored inputs:
    # per 1x128 group s = fp32(max(amax, 1e-10) / 448), q = e4m3(clamp(fp32(x / s)))
    for case, expected in open_golden(tmp_path / "g").iter_cases():
        if case.op != "quantize":
            continue
        x = case.inputs["x"]
        x32 = torch.from_numpy(x.view(np.uint16).astype(np.uint32) << 16).view(torch.float32) \
            if x.dtype.name == "bfloat16" else torch.from_numpy(x)
        g = x32.reshape(x.shape[0], -1, 128)
        s = g.abs().amax(dim=-1, keepdim=True).clamp_min(1e-10) / 448.0
        codes = encode((g / s).clamp(-448, 448).reshape(x.shape), "float8_e4m3fn").numpy()
        assert np.array_equal(expected["codes"], codes), case.name
        assert expected["scale"].tobytes() == s.reshape(x.shape[0], -1).numpy().tobytes(), case.name


@pytest.mark.parametrize("recipe", recipe_names())
def test_every_registered_recipe_is_a_valid_suite_value(recipe):
    suite = parse_suite(VLLM_GROUP.replace("[vllm-group]", f"[{recipe}]"))
    assert all(e.fields["recipes"] == (recipe,) for e in suite.entries)


def test_an_unknown_recipe_is_rejected_with_the_registry_list():
    where = r"<string>:\d+: operations\[0\]\.recipes\[0\]"
    with pytest.raises(SpecError, match=where + r": expected one of \[.*'vllm-group'.*got 'vllm-grup'"):
        parse_suite(VLLM_GROUP.replace("[vllm-group]", "[vllm-grup]", 1))


def test_mx_and_nvfp4_weight_quantize_cases_build_and_pass_their_reference():
    """quantize computes MX / NVFP4 block scales from x and refuses an amax: the golden quantize
    op gives those cases none (it used to pass the weight's own amax: InputTypeError)."""
    from fp8ref.golden.suite import build, parse_suite

    suite = parse_suite("""
suite: mx-weights
description: MX and NVFP4 weights through the golden quantize op
seed: 3
level: 1
operations:
  - op: quantize
    schemes: [MXFP4, MXFP8, NVFP4]
    recipes: [fp8ref, compressed-tensors-mx, quark-mxfp4, modelopt-mxfp8, compressed-tensors-nvfp4]
    roles: [weight]
    dtypes: [bfloat16]
    shapes: {1: [[8, 64]]}
""")
    from fp8ref.golden.ops import OPERATIONS

    cases = list(build(suite, 1))
    assert {c.params["recipe"] for c in cases} == {"fp8ref", "compressed-tensors-mx", "quark-mxfp4", "modelopt-mxfp8",
                                                    "compressed-tensors-nvfp4"}
    for case in cases:
        assert "amax" not in case.inputs
        out = OPERATIONS[case.op].reference(case.params, case.inputs)
        assert out["codes"].shape == (8, 64)
