"""fbgemm_fp8 checkpoints (transformers' FbgemmFp8Linear layout, built here in code: no download):
export -> load is bit-identical to ``quantize`` with the ``fbgemm-fp8`` recipe (FBGEMM's CUDA
per-row quantizer, checked against a Fraction oracle in tests/unit/schemes/test_recipes_te_deepgemm_fbgemm.py),
``forward`` quantizes inputs per token with the amax capped at ``activation_scale_ub``, and
load -> write -> load keeps the bytes and the config. Bad files are one-line CheckpointErrors."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fp8ref.checkpoint import load_checkpoint
from fp8ref.checkpoint.convert import write_checkpoint
from fp8ref.checkpoint.export import export_checkpoint
from fp8ref.checkpoint.layout import LayerQuant, to_scheme
from fp8ref.errors import CheckpointError
from fp8ref.io.safetensors import write_safetensors
from fp8ref.matmul import linear
from fp8ref.quant import QuantArgs, quantize
from fp8ref.recipes import with_amax_ub
from fp8ref.registry import get_recipe
from tests.support.quant_oracle import fbgemm_oracle

NP = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}
ST = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
QUANT = LayerQuant("channel", None, "dynamic-token")
NAME = "model.layers.0.self_attn.o_proj"


def _source(folder: Path, w: np.ndarray, dtype: str) -> None:
    folder.mkdir()
    head = np.ones((4, w.shape[1]), NP[dtype])
    tensors = {f"{NAME}.weight": (ST[dtype], w), "lm_head.weight": (ST[dtype], head)}
    write_safetensors(folder / "model.safetensors", tensors, {"format": "pt"})
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "dtype": dtype}))


def _bits(a) -> bytes:
    return np.ascontiguousarray(np.asarray(a)).tobytes()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dtype=st.sampled_from(sorted(NP)), out=st.integers(1, 24), inp=st.integers(1, 40),
       seed=st.integers(0, 2**32 - 1), scale_exp=st.integers(-24, 12), zero_row=st.booleans(),
       ub=st.sampled_from([1200.0, 0.75, 3.0e4]))
def test_export_load_forward_round_trip(dtype, out, inp, seed, scale_exp, zero_row, ub):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((out, inp)) * 2.0 ** scale_exp).astype(NP[dtype])
    if zero_row:
        w[rng.integers(0, out)] = 0
    w.reshape(-1)[rng.integers(0, w.size)] = -0.0
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        _source(tmp / "src", w, dtype)
        export_checkpoint(tmp / "src", tmp / "out", {"scheme": to_scheme(QUANT, "fbgemm-fp8"), "ignore": ["lm_head"]},
                          format="fbgemm-fp8")
        cfg = json.loads((tmp / "out" / "config.json").read_text())
        cfg["quantization_config"]["activation_scale_ub"] = ub  # as a checkpoint with another ub would say
        (tmp / "out" / "config.json").write_text(json.dumps(cfg))
        ckpt = load_checkpoint(tmp / "out")
        assert ckpt.format == "fbgemm-fp8" and list(ckpt) == [NAME] and ckpt.warnings == []
        layer = ckpt[NAME]
        assert layer.quant == QUANT and layer.scheme["recipe"] == "fbgemm-fp8"
        ref = quantize(w, QuantArgs(granularity="channel"), recipe="fbgemm-fp8")
        assert _bits(layer.weight_codes) == _bits(ref.codes)
        assert layer.weight_scale.dtype == np.float32 and layer.weight_scale.shape == (out, 1)
        assert _bits(layer.weight_scale) == _bits(ref.scale)
        if dtype == "bfloat16" and w.size <= 256:   # the CUDA kernel reads bf16: the oracle's domain
            codes, scales = fbgemm_oracle(w, None)
            assert _bits(layer.weight_codes) == _bits(codes) and _bits(layer.weight_scale) == _bits(scales)

        x = (rng.standard_normal((3, inp)) * 2.0 ** rng.integers(-4, 12)).astype(np.float32)
        rec = with_amax_ub(get_recipe("fbgemm-fp8"), ub)
        expect = linear(x, ref.codes, np.asarray(ref.scale, np.float32), dynamic="token", input_recipe=rec,
                        out_dtype="float32")
        assert _bits(layer.forward(x, out_dtype="float32")) == _bits(expect)

        write_checkpoint(ckpt, tmp / "again")
        assert (tmp / "again" / "model.safetensors").read_bytes() == (tmp / "out" / "model.safetensors").read_bytes()
        assert json.loads((tmp / "again" / "config.json").read_text())["quantization_config"] == \
            cfg["quantization_config"]


def _fixture(tmp: Path, *, qc=None, scale_shape=None, skip_lm_head=True) -> Path:
    src = tmp / "src"
    w = np.linspace(-3, 3, 64, dtype=np.float32).reshape(4, 16).astype(ml_dtypes.bfloat16)
    _source(src, w, "bfloat16")
    export_checkpoint(src, tmp / "out", {"scheme": to_scheme(QUANT, "fbgemm-fp8"), "ignore": ["lm_head"]},
                      format="fbgemm-fp8")
    cfg = json.loads((tmp / "out" / "config.json").read_text())
    if qc is not None:
        cfg["quantization_config"].update(qc)
    if not skip_lm_head:
        cfg["quantization_config"]["modules_to_not_convert"] = []
    (tmp / "out" / "config.json").write_text(json.dumps(cfg))
    if scale_shape is not None:
        ck = load_checkpoint(tmp / "out")
        tensors = {n: (ck.store.info(n).dtype, ck.store.get(n)) for n in ck.store}
        tensors[f"{NAME}.weight_scale"] = ("F32", np.asarray(tensors[f"{NAME}.weight_scale"][1]).reshape(scale_shape))
        write_safetensors(tmp / "out" / "model.safetensors", tensors, {"format": "pt"})
    return tmp / "out"


@pytest.mark.parametrize("qc,match", [({"activation_scale_ub": -1}, "activation_scale_ub"),
                                      ({"activation_scale_ub": "big"}, "activation_scale_ub"),
                                      ({"modules_to_not_convert": "lm_head"}, "modules_to_not_convert"),
                                      ({"modules_to_not_convert": [NAME]}, "config and tensors disagree")])
def test_bad_configs_are_one_line_errors(tmp_path, qc, match):
    out = _fixture(tmp_path, qc=qc)
    with pytest.raises(CheckpointError, match=match) as err:
        load_checkpoint(out)
    assert "\n" not in str(err.value)


def test_a_1d_weight_scale_is_refused(tmp_path):
    out = _fixture(tmp_path, scale_shape=(4,))
    with pytest.raises(CheckpointError, match="weight_scale"):
        load_checkpoint(out)


def test_an_unlisted_unquantized_linear_warns(tmp_path):
    ckpt = load_checkpoint(_fixture(tmp_path, skip_lm_head=False))
    assert any("lm_head" in w and "modules_to_not_convert" in w for w in ckpt.warnings)


def test_refuses_what_it_cannot_express(tmp_path):
    _source(tmp_path / "src", np.ones((8, 8), ml_dtypes.bfloat16), "bfloat16")
    with pytest.raises(CheckpointError, match="cannot express"):
        export_checkpoint(tmp_path / "src", tmp_path / "out",
                          {"scheme": to_scheme(LayerQuant("tensor", None, "static"), "fp8ref")}, format="fbgemm-fp8",
                          calibration={NAME: 1.0})
