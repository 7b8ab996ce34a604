"""``convert_checkpoint`` on random checkpoints fp8ref exports: exact conversions of FP8 W8A8
(compressed-tensors bf16 scales into ModelOpt, Quark, hf-fp8 and back) return the source's bytes;
ModelOpt's F32 scales into compressed-tensors report a cost equal to an independent count (codes
compared byte by byte, errors of decode(q) * s with Fractions, the FP8 values from ml_dtypes)."""

from __future__ import annotations

import json
from fractions import Fraction

import ml_dtypes
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fp8ref.checkpoint import export_checkpoint, load_checkpoint
from fp8ref.checkpoint.convert import convert_checkpoint
from fp8ref.io.safetensors import open_store, write_safetensors

LAYERS = ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj",
          "model.layers.0.self_attn.o_proj")
RECIPE = {"compressed-tensors": "compressed-tensors", "modelopt": "modelopt-fp8"}


def _source(folder, seed: int, spread: float) -> dict[str, float]:
    rng = np.random.default_rng(seed)
    tensors = {}
    for i, name in enumerate(LAYERS):
        w = rng.standard_t(3, (32 if "k_proj" in name or "v_proj" in name else 64, 64)) * 10.0 ** (spread * i - 2)
        tensors[f"{name}.weight"] = ("BF16", w.astype(np.float32).astype(ml_dtypes.bfloat16))
    tensors["model.norm.weight"] = ("BF16", np.ones(64, ml_dtypes.bfloat16))
    folder.mkdir()
    write_safetensors(folder / "model.safetensors", tensors, {"format": "pt"})
    (folder / "config.json").write_text(json.dumps({"dtype": "bfloat16"}))  # else F32 scales outvote the model
    amax = [float(np.float32(ml_dtypes.bfloat16(v))) for v in rng.uniform(0.5, 8, len(LAYERS))]
    return dict(zip(LAYERS, amax))


def _export(tmp, fmt: str, seed: int, spread: float):
    calibration = _source(tmp / "src", seed, spread)
    export_checkpoint(tmp / "src", tmp / fmt, {"scheme": "FP8"}, format=fmt, recipe=RECIPE[fmt],
                      calibration=calibration)
    return tmp / fmt


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1), spread=st.floats(0, 2), via=st.sampled_from(["modelopt", "quark", "hf-fp8"]))
def test_exact_conversions_round_trip_bytes(tmp_path_factory, seed, spread, via):
    tmp = tmp_path_factory.mktemp("cv")
    src = _export(tmp, "compressed-tensors", seed, spread)
    assert convert_checkpoint(src, tmp / "b", format=via, exact_only=True).exact
    assert convert_checkpoint(tmp / "b", tmp / "a", format="compressed-tensors", exact_only=True).exact
    assert (tmp / "a" / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()


def _values(store, name: str, scale: str) -> list[Fraction]:
    codes = store.file_of(name + ".weight").read_bytes(name + ".weight").view(ml_dtypes.float8_e4m3fn)
    s = Fraction(float(np.asarray(store.get(f"{name}.{scale}"), np.float32).reshape(-1)[0]))
    return [Fraction(float(c)) * s for c in codes.astype(np.float32).reshape(-1)]


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1), spread=st.floats(0, 2))
def test_lossy_conversion_reports_an_independent_cost(tmp_path_factory, seed, spread):
    tmp = tmp_path_factory.mktemp("cv")
    src = _export(tmp, "modelopt", seed, spread)
    report = convert_checkpoint(src, tmp / "ct", format="compressed-tensors")
    a, b = open_store(src / "model.safetensors"), open_store(tmp / "ct" / "model.safetensors")
    assert load_checkpoint(tmp / "ct").warnings == []
    for c in report.layers:
        va, vb = _values(a, c.layer, "weight_scale"), _values(b, c.layer, "weight_scale")
        diff = [abs(y - x) for x, y in zip(va, vb, strict=True)]
        rel = [d / abs(x) for d, x in zip(diff, va, strict=True) if x != 0]
        assert c.max_abs_error == float(max(diff)) and c.max_rel_error == float(max(rel, default=Fraction(0)))
        qa = a.file_of(c.layer + ".weight").read_bytes(c.layer + ".weight")
        qb = b.file_of(c.layer + ".weight").read_bytes(c.layer + ".weight")
        assert c.codes_changed == int(np.count_nonzero(qa != qb))
        sa, sb = (float(np.asarray(s.get(c.layer + ".weight_scale"), np.float32).reshape(-1)[0]) for s in (a, b))
        assert c.exact == (c.codes_changed == 0 and sa == sb and not c.input_scale_changed)
        assert c.scales_changed == int(sa != sb)
