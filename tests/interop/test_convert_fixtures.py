"""``fp8ref convert`` (issue #13) on the committed real-tool fixtures: exact conversions keep every
dequantized value and round-trip bytes (A -> B -> A is A's model.safetensors); lossy ones report a
requant cost that equals an independent count over the written tensors (read with safetensors'
own reader, dequantized with Fractions); --exact-only refuses and writes nothing; the CLI."""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.torch import load_file as torch_load

from fp8ref.checkpoint import load_checkpoint
from fp8ref.checkpoint.convert import convert_checkpoint
from fp8ref.cli import main
from fp8ref.errors import CheckpointError

pytestmark = pytest.mark.interop

ROOT = Path(__file__).resolve().parents[1] / "fixtures" / "interop" / "checkpoints"
CT, MO, QK, HF = "compressed-tensors", "modelopt", "quark", "hf-fp8"

# (fixture, via): the fixture converted to ``via`` and back to its own format gives its bytes
ROUND_TRIPS = [("llmc_fp8", MO), ("llmc_fp8", QK), ("llmc_fp8", HF), ("quark_fp8", MO), ("llmc_mxfp4", QK),
               ("quark_mxfp4", CT), ("llmc_mxfp8", MO), ("modelopt_mxfp8", CT), ("autoround_fp8_static", CT)]
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def load_file(path: Path) -> dict[str, np.ndarray]:
    """safetensors' own reader (torch): float8 tensors as their uint8 bytes, float scales as float32."""
    out = {}
    for n, t in torch_load(path).items():
        out[n] = t.view(torch.uint8).numpy() if t.dtype.itemsize == 1 else t.float().numpy()
    return out


@pytest.mark.parametrize("name, via", ROUND_TRIPS)
def test_exact_conversion_round_trips_bytes(name, via, tmp_path):
    src = load_checkpoint(ROOT / name)
    there = convert_checkpoint(src, tmp_path / "b", format=via, exact_only=True)
    assert there.exact and there.totals()["codes_changed"] == 0
    mid = load_checkpoint(tmp_path / "b")
    assert mid.format == via and mid.warnings == []
    for n, layer in src.items():  # every dequantized value, signed zeros included
        assert np.array_equal(mid[n].dequantize("float64").view(np.uint64), layer.dequantize("float64").view(np.uint64))
    back = convert_checkpoint(mid, tmp_path / "a", format=src.format, exact_only=True)
    assert back.exact
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (ROOT / name / "model.safetensors").read_bytes()


def test_kv_scales_travel_exactly_between_quark_and_modelopt(tmp_path):
    """Quark's shared BF16 k/v_proj.output_scale -> ModelOpt's F32 k_proj.k_scale / v_proj.v_scale."""
    report = convert_checkpoint(ROOT / "quark_fp8", tmp_path / "mo", format=MO)
    assert report.exact and [k["target"] for k in report.kv] == ["model.layers.0.self_attn.k_proj.k_scale",
                                                                 "model.layers.0.self_attn.v_proj.v_scale"]
    theirs, ours = load_file(ROOT / "quark_fp8" / "model.safetensors"), load_file(tmp_path / "mo" / "model.safetensors")
    raw = torch_load(tmp_path / "mo" / "model.safetensors")
    for which, name in (("k", "k_proj.k_scale"), ("v", "v_proj.v_scale")):
        mine = ours[f"model.layers.0.self_attn.{name}"]
        assert raw[f"model.layers.0.self_attn.{name}"].dtype == torch.float32 and mine.shape == ()
        assert mine == theirs[f"model.layers.0.self_attn.{which}_proj.output_scale"]


# --- lossy conversions: the report against an independent count ----------------------------------

def _codes(t: dict, name: str, packed: bool) -> np.ndarray:
    raw = t[name].view(np.uint8)
    if not packed:
        return raw
    out = np.empty((raw.shape[0], raw.shape[1] * 2), np.uint8)
    out[:, 0::2], out[:, 1::2] = raw & 0xF, raw >> 4
    return out


def _value(code: int, packed: bool) -> Fraction:
    if packed:
        v = Fraction(E2M1[code & 7])
        return -v if code & 8 else v
    return Fraction(float(np.array([code], np.uint8).view(ml_dtypes.float8_e4m3fn)[0]))


def _f32(a) -> list[Fraction]:
    return [Fraction(float(v)) for v in np.asarray(a, np.float32).reshape(-1)]


def _fp8_values(t: dict, layer: str, ws: str, shape) -> list[list[Fraction]]:
    """Per-tensor or per-channel FP8: decode(q) * s, exact."""
    q = t[f"{layer}.weight"].view(np.uint8)
    s = _f32(t[f"{layer}.{ws}"])
    return [[_value(int(q[i, j]), False) * (s[0] if len(s) == 1 else s[i]) for j in range(q.shape[1])]
            for i in range(q.shape[0])]


def _nvfp4_values(t: dict, layer: str, packed_name: str, global_name: str, divisor: bool) -> list[list[Fraction]]:
    q = _codes(t, f"{layer}.{packed_name}", True)
    sb = t[f"{layer}.weight_scale"]
    g = Fraction(float(np.asarray(t[f"{layer}.{global_name}"]).reshape(-1)[0]))
    out = []
    for i in range(q.shape[0]):
        row = []
        for j in range(q.shape[1]):
            v = _value(int(q[i, j]), True) * _value(int(sb[i, j // 16]), False)
            row.append(v / g if divisor else v * g)
        out.append(row)
    return out


def _cost(a: list[list[Fraction]], b: list[list[Fraction]]) -> tuple[Fraction, Fraction]:
    diffs = [(abs(y - x), x) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True)]
    return max(d for d, _ in diffs), max(d / abs(x) for d, x in diffs if x != 0)


def test_modelopt_fp8_to_compressed_tensors_reports_its_requant_cost(tmp_path):
    report = convert_checkpoint(ROOT / "modelopt_fp8", tmp_path / "ct", format=CT)
    assert not report.exact and all(not c.exact and c.recipe == CT for c in report.layers)
    src, dst = load_file(ROOT / "modelopt_fp8" / "model.safetensors"), load_file(tmp_path / "ct" / "model.safetensors")
    worst_abs = worst_rel = Fraction(0)
    for c in report.layers:
        a = _fp8_values(src, c.layer, "weight_scale", None)
        b = _fp8_values(dst, c.layer, "weight_scale", None)
        abs_err, rel_err = _cost(a, b)
        assert c.max_abs_error == float(abs_err) and c.max_rel_error == float(rel_err), c.layer
        qa, qb = src[f"{c.layer}.weight"].view(np.uint8), dst[f"{c.layer}.weight"].view(np.uint8)
        assert c.codes_changed == int(np.count_nonzero(qa != qb)) and c.elements == qa.size
        assert c.scales_changed == int(_f32(src[f"{c.layer}.weight_scale"]) != _f32(dst[f"{c.layer}.weight_scale"]))
        assert c.input_scale_changed == (_f32(src[f"{c.layer}.input_scale"]) != _f32(dst[f"{c.layer}.input_scale"]))
        worst_abs, worst_rel = max(worst_abs, abs_err), max(worst_rel, rel_err)
    t = report.totals()
    assert t["max_abs_error"] == float(worst_abs) and t["max_rel_error"] == float(worst_rel)
    assert t["codes_changed"] == sum(c.codes_changed for c in report.layers) > 0
    ct = load_checkpoint(tmp_path / "ct")
    assert ct.format == CT and ct.warnings == [] and set(ct.kv_scales) == {"model.layers.0.self_attn.k_scale",
                                                                           "model.layers.0.self_attn.v_scale"}
    assert t["kv_scales_changed"] == 2  # F32 k/v scales are not bf16 values


@pytest.mark.parametrize("name, fmt", [("llmc_nvfp4", MO), ("modelopt_nvfp4", CT)])
def test_nvfp4_global_vocabularies_requantize_with_exact_cost(name, fmt, tmp_path):
    """CT divisors and ModelOpt multipliers have no exact reciprocal: requantized; the error of
    q * s_b / g against q' * s_b' * m' (or the reverse) is computed with Fractions here."""
    report = convert_checkpoint(ROOT / name, tmp_path / "out", format=fmt)
    assert not report.exact and {c.why.split(":")[0] for c in report.layers} == {"weight_global"}
    src, dst = load_file(ROOT / name / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    names = {CT: ("weight_packed", "weight_global_scale", True), MO: ("weight", "weight_scale_2", False)}
    sfmt = CT if fmt == MO else MO
    for c in report.layers[:3]:  # three layers: Fractions over every element are slow
        a = _nvfp4_values(src, c.layer, *names[sfmt])
        b = _nvfp4_values(dst, c.layer, *names[fmt])
        abs_err, rel_err = _cost(a, b)
        assert c.max_abs_error == float(abs_err) and c.max_rel_error == float(rel_err), c.layer
        qa = _codes(src, f"{c.layer}.{names[sfmt][0]}", True)
        qb = _codes(dst, f"{c.layer}.{names[fmt][0]}", True)
        assert c.codes_changed == int(np.count_nonzero(qa != qb))
        sa, sb = src[f"{c.layer}.weight_scale"], dst[f"{c.layer}.weight_scale"]
        assert c.scales_changed == int(np.count_nonzero(sa != sb)) + 1  # and the global, always


def test_exact_only_refuses_a_lossy_conversion_and_writes_nothing(tmp_path):
    with pytest.raises(CheckpointError, match=r"not exact \(7 layer\(s\), 2 KV scale\(s\).*nothing written") as exc:
        convert_checkpoint(ROOT / "modelopt_fp8", tmp_path / "out", format=CT, exact_only=True)
    assert "\n" not in str(exc.value) and not (tmp_path / "out").exists()
    assert list(tmp_path.iterdir()) == []


def test_block_weights_into_a_per_channel_format(tmp_path):
    """hf-fp8-style 128x128 blocks have no ModelOpt layout: the first one keeping FP8 weights (channel,
    dynamic per token) is chosen and requantized by modelopt-fp8-pc."""
    report = convert_checkpoint(ROOT / "llmc_fp8_block", tmp_path / "mo", format=MO)
    assert {(c.target, c.recipe) for c in report.layers} == {("W float8_e4m3fn channel, input dynamic-token",
                                                              "modelopt-fp8-pc")}
    assert load_checkpoint(tmp_path / "mo").format == MO


def test_ue8m0_scales_convert_exactly_as_floats(tmp_path):
    report = convert_checkpoint(ROOT / "hf_fp8_ue8m0", tmp_path / "ct", format=CT, exact_only=True)
    assert report.exact
    ct, src = load_checkpoint(tmp_path / "ct"), load_checkpoint(ROOT / "hf_fp8_ue8m0")
    for n, layer in src.items():
        assert np.array_equal(ct[n].dequantize("float64"), layer.dequantize("float64"))


# --- the CLI ----------------------------------------------------------------------------------------

def test_cli_reports_requant_cost_and_json(tmp_path, capsys):
    assert main(["convert", str(ROOT / "modelopt_fp8"), str(tmp_path / "ct"), "--format", CT, "--quiet"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[-1].startswith("result: requant cost: 7/7 layers requantized, codes changed 61/36864")
    assert main(["convert", str(ROOT / "modelopt_fp8"), str(tmp_path / "ct"), "--format", CT]) == 1
    assert "already exists" in capsys.readouterr().err
    assert main(["convert", str(ROOT / "modelopt_fp8"), str(tmp_path / "ct"), "--format", CT, "--force",
                 "--json", "-"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["exact"] is False and doc["totals"]["codes_changed"] == 61 and len(doc["layers"]) == 7


def test_cli_json_with_kv_scales(tmp_path, capsys):
    assert main(["convert", str(ROOT / "quark_fp8"), str(tmp_path / "mo"), "--format", MO, "--json", "-"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["exact"] is True and [k["exact"] for k in doc["kv"]] == [True, True]
    assert main(["convert", str(ROOT / "quark_fp8"), str(tmp_path / "ct"), "--format", CT, "--json",
                 str(tmp_path / "r.json")]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("result: exact; 7 layers and 2 KV scales")
    assert json.loads((tmp_path / "r.json").read_text())["totals"]["layers"] == 7


def test_cli_exact_and_errors(tmp_path, capsys):
    assert main(["convert", str(ROOT / "llmc_fp8"), str(tmp_path / "mo"), "--format", MO, "--exact-only"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("result: exact; 14 layers")
    assert main(["convert", str(ROOT / "modelopt_fp8"), str(tmp_path / "x"), "--format", CT, "--exact-only"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("fp8ref: error: ") and err.count("\n") == 1 and not (tmp_path / "x").exists()
    assert main(["convert", str(ROOT / "original_bf16"), str(tmp_path / "y"), "--format", MO]) == 1
    assert "no quantized layers" in capsys.readouterr().err
