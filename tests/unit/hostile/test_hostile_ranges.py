"""Hostile corpus, issue #10 item 1: every integer a file can give has a declared range
(fp8ref.limits), checked at validation; nothing out of range reaches the C loops.

``block_shape: [128, 2**64]`` passed ``spec validate`` and then killed ``fp8ref quantize`` with
SIGFPE (2**63: SIGSEGV) inside the C loops: the size_t argument wrapped to 0."""

from __future__ import annotations

import json
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

from fp8ref import limits
from fp8ref._native_quant import c_amax, c_sizes
from fp8ref.checkpoint import load_checkpoint
from fp8ref.errors import CheckpointError, Fp8RefError, InputTypeError, ShapeError, SpecError
from fp8ref.io.safetensors import write_safetensors
from fp8ref.quant import QuantArgs, quantize
from fp8ref.scheme import QuantizationScheme
from fp8ref.spec import load_spec_string
from tests.support.checkpoint_builders import build_ct, build_hf, write

HUGE = (2**64, 2**63, 2**31, 10**400)


@pytest.mark.parametrize("value", HUGE)
def test_spec_block_shape_past_int32_is_refused_at_validation(value):
    with pytest.raises(SpecError) as exc:
        load_spec_string(f"scheme: {{scheme: FP8_BLOCK, block_shape: [128, {value}]}}\n", source="x.yaml")
    message = str(exc.value)
    assert message.startswith("x.yaml:1: scheme.block_shape: expected [rows, cols] of integers in 1..2147483647")
    assert "\n" not in message and len(message) < 300  # a 400-digit number is summarised, not printed


@pytest.mark.parametrize(("fields", "field"), [
    ({"group_size": 2**64}, "group_size"), ({"group_size": -(2**64)}, "group_size"),
    ({"bits": 2**64}, "bits"), ({"act_bits": 8, "act_group_size": 2**63}, "act_group_size"),
    ({"block_shape": [2**63, 128]}, "block_shape"),
])
def test_scheme_integer_fields_have_ranges(fields, field):
    with pytest.raises(SpecError, match=f"^{field}: expected .*integer"):
        QuantizationScheme(**fields)


@pytest.mark.parametrize("args", [dict(granularity="block", block_shape=(128, 2**64)),
                                  dict(granularity="group", group_size=2**63)])
def test_quant_args_refuse_sizes_the_c_loops_cannot_take(args):
    with pytest.raises(ShapeError, match="2147483647"):
        QuantArgs(**args)


def test_the_c_boundary_guard_refuses_a_wrapped_size():
    """Even a QuantArgs forged past its own validation does not reach C with a group of 0."""
    forged = QuantArgs(granularity="group", group_size=128)
    object.__setattr__(forged, "group_size", 2**64)
    x = np.ones((4, 256), np.float32)
    with pytest.raises(ShapeError, match="group_size: .* is outside 1..9223372036854775807"):
        if c_amax(x, "float32", forged) is None:  # no C loops built: the guard itself is checked
            c_sizes(group_size=2**64)
    with pytest.raises(ShapeError, match="row_length"):
        c_sizes(rows=1, row_length=0, group_size=1)


def test_scaled_mm_block_k_past_int32_is_refused():
    from fp8ref.matmul import scaled_mm

    a, b = np.zeros((4, 256), np.uint8), np.zeros((256, 4), np.uint8)
    with pytest.raises(InputTypeError, match="block_k: expected at most 2147483647"):
        scaled_mm(a, b, np.ones((4, 1), np.float32), np.ones((1, 4), np.float32), accumulate="fp32", block_k=2**64)


@pytest.mark.parametrize("value", [2**64, 2**63])
def test_quantize_command_with_a_huge_block_is_a_one_line_error_not_a_signal(tmp_path, value):
    src = tmp_path / "src"
    src.mkdir()
    w = np.random.default_rng(0).standard_normal((256, 256)).astype(ml_dtypes.bfloat16)
    write_safetensors(src / "model.safetensors", {"model.layers.0.mlp.up_proj.weight": ("BF16", w)})
    spec = tmp_path / "spec.yaml"
    spec.write_text(f"scheme: {{scheme: FP8_BLOCK, block_shape: [128, {value}]}}\n")
    run = subprocess.run([sys.executable, "-m", "fp8ref", "quantize", str(src), str(tmp_path / "out"),
                          "--spec", str(spec)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, (run.returncode, run.stderr[-500:])  # not -8 (SIGFPE) / -11 (SIGSEGV)
    assert run.stderr.count("\n") == 1 and f"{spec}:1: scheme.block_shape" in run.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["spec.yaml", "src"]  # no temporary folder left


def _ct_block(tmp, block):
    tensors, cfg = build_ct("FP8_BLOCK")
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["block_structure"] = block
    return write(tmp / "ckpt", tensors, cfg)


@pytest.mark.parametrize("block", [[16, 2**64], [2**63, 16], [16, 0]])
def test_checkpoint_block_structure_has_a_range(tmp_path, block):
    with pytest.raises(CheckpointError, match=r"config.json: quantization_config.config_groups.group_0.weights"
                                              r".block_structure: expected \[rows, cols\] of integers in 1..2147"):
        load_checkpoint(_ct_block(tmp_path, block))


def test_hf_weight_block_size_has_a_range(tmp_path):
    tensors, cfg = build_hf()
    cfg["quantization_config"]["weight_block_size"] = [16, 2**64]
    with pytest.raises(CheckpointError, match="weight_block_size: expected null or .* in 1..2147483647"):
        load_checkpoint(write(tmp_path / "ckpt", tensors, cfg))


@pytest.mark.parametrize("field", ["group_size", "bits", "act_bits", "act_group_size"])
def test_autoround_integer_fields_have_ranges(tmp_path, field):
    from tests.support.checkpoint_builders import build_autoround

    tensors, cfg = build_autoround()
    cfg["quantization_config"][field] = 2**64
    with pytest.raises(CheckpointError, match=f"config.json: quantization_config.{field}: expected an integer in"):
        load_checkpoint(write(tmp_path / "ckpt", tensors, cfg))


def test_num_hidden_layers_has_a_range(tmp_path):
    tensors, cfg = build_ct("FP8")
    cfg["num_hidden_layers"] = 2**64
    with pytest.raises(CheckpointError, match="num_hidden_layers: expected an integer in 1..2147483647"):
        load_checkpoint(write(tmp_path / "ckpt", tensors, cfg))


def test_calibration_amax_past_float64_is_refused(tmp_path):
    from fp8ref.checkpoint import load_calibration

    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"format": "fp8ref-calibration/1", "holds": "amax", "input_amax": {"a.b": 10**400}}))
    with pytest.raises(CheckpointError, match=r"cal.json: input_amax\['a.b'\]: expected a number \(activation amax\), "
                                              r"got <an int"):
        load_calibration(path)


def test_limits_table_is_what_the_checks_use():
    assert limits.MAX_GROUP == 2**31 - 1 and limits.MAX_DIM == 2**63 - 1
    assert limits.int_in(5, 1, 5) and not limits.int_in(True, 0, 1) and not limits.int_in(6.0, 1, 9)
    assert limits.shown(10**400) == "<an integer of 1329 bits>"
    with pytest.raises(Fp8RefError):
        quantize(np.ones((2, 2), np.float32), QuantArgs(granularity="group", group_size=limits.MAX_GROUP + 1))
