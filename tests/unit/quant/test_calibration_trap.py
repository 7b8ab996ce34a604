"""Scales and amax are told apart by type: ``write_calibration(path, calibrate_input_scales(...))``
used to store the scales as amax, and quantize then wrote input scales 448x too small (rc 0). The
scales are now a ``CalibratedScales`` of ``DequantScale`` arrays, refused in one line by everything
that takes amax; their ``.amax`` is what to store, and gives the right input scale end to end."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest
import torch

import fp8ref
from fp8ref.calibrate import CalibratedScales, DequantScale
from fp8ref.checkpoint import export_checkpoint, load_calibration, load_checkpoint, write_calibration
from fp8ref.errors import CheckpointError
from tests.support.checkpoint_builders import write
from tests.support.cli import run_cli

GAIN = 3.25  # every input element is +-GAIN: amax 3.25, input scale fp32(3.25) / 448


def model_and_batches():
    torch.manual_seed(0)
    model = torch.nn.Sequential()
    model.add_module("lm_head", torch.nn.Linear(32, 16))
    x = torch.full((2, 32), GAIN)
    x[0, ::2] = -GAIN
    return model, [x]


def source(folder):
    rng = np.random.default_rng(0)
    tensors = {"lm_head.weight": ("BF16", rng.standard_normal((16, 32)).astype(ml_dtypes.bfloat16))}
    write(folder, tensors, {"model_type": "llama", "dtype": "bfloat16"})
    return folder


def test_calibrate_input_scales_returns_scales_that_know_their_amax():
    model, batches = model_and_batches()
    scales = fp8ref.calibrate_input_scales(model, batches, ["lm_head"])
    assert isinstance(scales, CalibratedScales) and isinstance(scales["lm_head"], DequantScale)
    assert float(scales["lm_head"]) == float(np.float32(GAIN) / np.float32(448))
    assert float(scales.amax["lm_head"].amax) == GAIN
    assert isinstance(fp8ref.finalize(scales.amax["lm_head"]), DequantScale)


@pytest.mark.parametrize("given, message", [
    (lambda s: s, r"input_amax: these are calibrate_input_scales' scales \(amax / format max\), not amax; pass "
                  r"their \.amax \(calibrate_input_scales\(\.\.\.\)\.amax\)"),
    (lambda s: dict(s), r"input_amax\['lm_head'\]: a scale \(amax / format max, from finalize or "
                        r"calibrate_input_scales\), not an amax; pass the AmaxState"),
    (lambda s: {"lm_head": fp8ref.finalize(s.amax["lm_head"])}, r"input_amax\['lm_head'\]: a scale"),
    (lambda s: {"lm_head": s["lm_head"].reshape(1)}, r"input_amax\['lm_head'\]: a scale"),
])
def test_write_calibration_refuses_scales_and_writes_nothing(tmp_path, given, message):
    model, batches = model_and_batches()
    scales = fp8ref.calibrate_input_scales(model, batches, ["lm_head"])
    with pytest.raises(CheckpointError, match=message) as info:
        write_calibration(tmp_path / "cal.json", given(scales))
    assert "\n" not in str(info.value) and not (tmp_path / "cal.json").exists()


def test_arithmetic_on_a_scale_is_a_plain_array():
    """scale * 448 is an amax again (the caller converted it): not refused as a scale."""
    model, batches = model_and_batches()
    s = fp8ref.calibrate_input_scales(model, batches, ["lm_head"])["lm_head"]
    back = s * np.float32(448)
    assert type(back) is np.ndarray or type(back) is np.float32
    assert type(np.maximum(s, 0)) is not DequantScale
    inplace = s.copy()
    inplace *= np.float32(448)
    assert not isinstance(inplace, DequantScale)


def test_the_amax_route_gives_input_scales_of_amax_over_448(tmp_path, capsys):
    model, batches = model_and_batches()
    scales = fp8ref.calibrate_input_scales(model, batches, ["lm_head"])
    write_calibration(tmp_path / "cal.json", scales.amax)
    assert load_calibration(tmp_path / "cal.json") == {"lm_head": GAIN}
    (tmp_path / "spec.yaml").write_text("scheme: FP8_STATIC\n")
    assert run_cli("quantize", source(tmp_path / "src"), tmp_path / "out", "--spec", tmp_path / "spec.yaml",
                   "--calibration", tmp_path / "cal.json") == 0
    stored = np.asarray(load_checkpoint(tmp_path / "out")["lm_head"].input_scale, np.float32).reshape(-1)
    # compressed-tensors' rule: bf16(fp32(amax) / 448); the trap stored bf16(fp32(amax / 448) / 448)
    expected = np.float32(np.float32(GAIN) / np.float32(448)).astype(ml_dtypes.bfloat16).astype(np.float32)
    assert stored.tolist() == [expected]


def test_export_and_verify_refuse_scales_given_as_calibration(tmp_path):
    model, batches = model_and_batches()
    scales = fp8ref.calibrate_input_scales(model, batches, ["lm_head"])
    with pytest.raises(CheckpointError, match=r"^calibration: these are calibrate_input_scales' scales"):
        export_checkpoint(source(tmp_path / "src"), tmp_path / "out", {"scheme": "FP8_STATIC"}, calibration=scales)
    assert not (tmp_path / "out").exists()
    export_checkpoint(tmp_path / "src", tmp_path / "out", {"scheme": "FP8_STATIC"}, calibration=scales.amax)
    from fp8ref.nn.verify import verify

    ckpt, original = load_checkpoint(tmp_path / "out"), load_checkpoint(tmp_path / "src")
    with pytest.raises(CheckpointError, match=r"^calibration\['lm_head'\]: a scale"):
        verify(ckpt, original, calibration=dict(scales))
    # the amax route re-derives the input scale
    assert verify(ckpt, original, calibration=scales.amax)["layers"][0]["input_scale"] == "ok"


def test_files_written_before_the_change_still_load(tmp_path):
    """The fp8ref-calibration/1 document is unchanged: a file of an earlier fp8ref reads as before."""
    doc = {"format": "fp8ref-calibration/1", "holds": "amax", "fp8ref_version": "0.1.0",
           "input_amax": {"lm_head": 3.25}, "kv_amax": {}}
    (tmp_path / "old.json").write_text(json.dumps(doc, indent=1) + "\n")
    assert load_calibration(tmp_path / "old.json") == {"lm_head": 3.25}
