"""load_checkpoint: detection, schemes, laziness, producer quirks reported as warnings."""

from __future__ import annotations

import json
from fractions import Fraction

import numpy as np
import pytest

from fp8ref.checkpoint import load_checkpoint
from fp8ref.errors import CheckpointError
from fp8ref.formats import FORMATS
from tests.support.checkpoint_builders import BF16, build_autoround, build_ct, build_hf, codes, scales, write

Q = "model.layers.0.self_attn.q_proj"
D = "model.layers.0.mlp.down_proj"


@pytest.mark.parametrize("preset,granularity,act", [("FP8", "tensor", "tensor"), ("FP8_DYNAMIC", "channel", "token"),
                                                     ("FP8_BLOCK", "block", "group")])
def test_ct_schemes_are_dict_like(tmp_path, preset, granularity, act):
    tensors, cfg = build_ct(preset)
    ckpt = load_checkpoint(write(tmp_path / "c", tensors, cfg))
    s = ckpt.scheme(Q)
    assert s["weight_granularity"] == granularity and s["act_granularity"] == act
    assert s["bits"] == 8 and s["weight_format"] == "float8_e4m3fn" and s["recipe"] == "compressed-tensors"
    assert dict(s)["act_dynamic"] is (preset != "FP8")


def test_autoround_scheme_is_fp8_static(tmp_path):
    from fp8ref.scheme import PRESETS

    tensors, cfg = build_autoround()
    ckpt = load_checkpoint(write(tmp_path / "c", tensors, cfg))
    assert ckpt.format == "auto-round" and ckpt.scheme(Q) == PRESETS["FP8_STATIC"]


def test_dequantize_is_exact_product(tmp_path):
    """Checked against Fraction arithmetic on every element of a block-scaled layer."""
    tensors, cfg = build_hf()
    ckpt = load_checkpoint(write(tmp_path / "c", tensors, cfg))
    q, s = tensors[f"{D}.weight"][1], tensors[f"{D}.weight_scale_inv"][1]
    got = ckpt.dequantize(D, "float64")
    fmt = FORMATS["float8_e4m3fn"]
    for i in range(q.shape[0]):
        for j in range(q.shape[1]):
            exact = fmt.exact_value(int(q[i, j])) * Fraction(float(s[i // 16, j // 16]))
            assert Fraction(float(got[i, j])) == exact
    as_bf16 = ckpt.dequantize(D, "bfloat16")
    assert as_bf16.dtype == BF16
    assert all(Fraction(float(v)) == _round_fraction(x, *_PRECISION["bfloat16"])
               for v, x in zip(as_bf16.reshape(-1), got.reshape(-1), strict=True))


# (significand bits, minimum normal exponent): round-to-nearest-even on Fractions, no float cast
_PRECISION = {"bfloat16": (8, -126), "float16": (11, -14), "float32": (24, -126)}


def _round_fraction(x, p: int, emin: int) -> Fraction:
    x = Fraction(x)
    if x == 0:
        return x
    e = max(emin, abs(x.numerator).bit_length() - x.denominator.bit_length())
    while Fraction(2) ** e > abs(x):  # e = floor(log2 |x|), at least emin
        e -= 1
    while Fraction(2) ** (e + 1) <= abs(x):
        e += 1
    ulp = Fraction(2) ** (max(e, emin) - (p - 1))
    return round(x / ulp) * ulp  # Fraction.__round__ rounds half to even


def test_round_fraction_oracle_rounds_ties_to_even():
    assert _round_fraction(1 + Fraction(1, 256), 8, -126) == 1  # tie, 1.0 is even
    assert _round_fraction(1 + Fraction(3, 256), 8, -126) == 1 + Fraction(4, 256)
    assert _round_fraction(1 + Fraction(1, 256) + Fraction(1, 2 ** 24), 8, -126) == 1 + Fraction(1, 128)


# Scales chosen so that some products of an e4m3 code land exactly on, just above and just
# below a bf16/fp16 midpoint: the first is the issue's example (code 0x3c = 1.5 times it is
# 1 + 2**-8 + 2**-24, which bf16 rounds up but an fp32 intermediate rounds to the tie 1 + 2**-8).
_SCALES = [11228502 * 2.0 ** -24, 2.0 ** -3, (2 ** 24 - 1) * 2.0 ** -30, 0x81 * 2.0 ** -12, 0xAAAAAB * 2.0 ** -28,
           (1 + 2.0 ** -23) * 2.0 ** -5, 0x800001 * 2.0 ** -27, 0x7FFFFF * 2.0 ** -29, 3 * 2.0 ** -9,
           0x8080 * 2.0 ** -20, 0xFFFF01 * 2.0 ** -28, 1.0]


def _every_code_times_scales():
    """An hf-fp8 checkpoint whose every 16x16 weight block holds all 256 codes (NaN -> 0) and
    one scale of ``_SCALES``."""
    tensors, cfg = build_hf()
    block_codes = np.arange(256, dtype=np.uint8).reshape(16, 16)
    block_codes[(block_codes & 0x7F) == 0x7F] = 0
    k = 0
    for name in (Q, D):
        out, inp = tensors[f"{name}.weight"][1].shape
        tensors[f"{name}.weight"] = ("F8_E4M3", np.tile(block_codes, (out // 16, inp // 16)))
        s = np.array(_SCALES[k:k + (out // 16) * (inp // 16)], np.float32).reshape(out // 16, inp // 16)
        tensors[f"{name}.weight_scale_inv"] = ("F32", s)
        k += s.size
    assert k == len(_SCALES) and all(float(np.float32(v)) == v for v in _SCALES)
    return tensors, cfg


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_dequantize_rounds_once_every_code_times_scales(tmp_path, dtype):
    """Independent of any cast: each element equals the Fraction product rounded (RNE) to ``dtype``."""
    tensors, cfg = _every_code_times_scales()
    ckpt = load_checkpoint(write(tmp_path / "c", tensors, cfg))
    fmt = FORMATS["float8_e4m3fn"]
    for name in (Q, D):
        q, s = tensors[f"{name}.weight"][1], tensors[f"{name}.weight_scale_inv"][1]
        got = ckpt.dequantize(name, dtype)
        assert got.dtype == (BF16 if dtype == "bfloat16" else np.dtype(dtype))
        for (i, j), v in np.ndenumerate(got.astype(np.float64)):
            exact = fmt.exact_value(int(q[i, j])) * Fraction(float(s[i // 16, j // 16]))
            assert Fraction(v) == _round_fraction(exact, *_PRECISION[dtype]), (name, i, j, hex(q[i, j]))


def test_dequantize_bf16_issue_example(tmp_path):
    tensors, cfg = _every_code_times_scales()
    ckpt = load_checkpoint(write(tmp_path / "c", tensors, cfg))
    got = ckpt.dequantize(Q, "bfloat16")
    assert tensors[f"{Q}.weight"][1][3, 12] == 0x3C and float(got[3, 12]) == 1.0078125


def test_sharded_load_reads_no_tensor_data(tmp_path):
    tensors, cfg = build_ct()
    # poison every weight and scale: reading any of them would raise
    for name in list(tensors):
        if name.endswith(".weight") and tensors[name][0] == "F8_E4M3":
            tensors[name] = ("F8_E4M3", np.full(tensors[name][1].shape, 0x7F, np.uint8))
        if name.endswith("_scale"):
            tensors[name] = ("BF16", np.full(tensors[name][1].shape, np.nan, BF16))
    ckpt = load_checkpoint(write(tmp_path / "c", tensors, cfg, shards=3), check_values=False)
    assert len(ckpt.store.files) == 3 and sorted(ckpt) == sorted([Q, D])
    assert ckpt.store.bytes_read == 0
    with pytest.raises(CheckpointError, match="NaN codes"):
        _ = ckpt[Q].weight_codes
    with pytest.raises(CheckpointError, match="NaN"):
        load_checkpoint(tmp_path / "c")  # the default reads (only) the scales


def test_default_load_reads_scales_only(tmp_path):
    tensors, cfg = build_ct("FP8_BLOCK")
    ckpt = load_checkpoint(write(tmp_path / "c", tensors, cfg, shards=2))
    scale_bytes = sum(v[1].nbytes for k, v in tensors.items() if k.endswith("weight_scale"))
    assert ckpt.store.bytes_read == scale_bytes


def test_ignore_omitting_unquantized_layer_is_a_warning_with_fix(tmp_path):
    tensors, cfg = build_ct()
    cfg["quantization_config"]["ignore"] = []
    ckpt = load_checkpoint(write(tmp_path / "c", tensors, cfg))
    assert len(ckpt.warnings) == 1
    assert "'lm_head'" in ckpt.warnings[0] and "Fix: add 'lm_head' to ignore" in ckpt.warnings[0]


def test_autoround_quirks(tmp_path):
    tensors, cfg = build_autoround()
    del cfg["quantization_config"]["packing_format"]
    tensors[f"{Q}.input_scale"] = ("BF16", np.ones(1, BF16))
    ckpt = load_checkpoint(write(tmp_path / "c", tensors, cfg))
    assert any("packing_format" in w and "#1452" in w for w in ckpt.warnings)
    assert any(f"{Q}.input_scale" in w and "#1390" in w for w in ckpt.warnings)
    assert len(ckpt.warnings) == 2


def test_autoround_unquantized_linear_inside_blocks_warns(tmp_path):
    tensors, cfg = build_autoround()
    rng = np.random.default_rng(1)
    tensors["model.layers.0.mlp.up_proj.weight"] = ("BF16", rng.standard_normal((8, 32)).astype(BF16))
    ckpt = load_checkpoint(write(tmp_path / "c", tensors, cfg))
    assert len(ckpt.warnings) == 1 and "extra_config['model.layers.0.mlp.up_proj']" in ckpt.warnings[0]
    cfg["quantization_config"]["extra_config"] = {"model.layers.0.mlp.up_proj": {"bits": 16, "act_bits": 16}}
    assert load_checkpoint(write(tmp_path / "d", tensors, cfg)).warnings == []


def test_autoround_quantization_config_json_fallback(tmp_path):
    tensors, cfg = build_autoround()
    folder = write(tmp_path / "c", tensors, {"model_type": "llama"})
    (folder / "quantization_config.json").write_text(json.dumps(cfg["quantization_config"]))
    ckpt = load_checkpoint(folder)
    assert ckpt.format == "auto-round" and len(ckpt) == 2
    assert len(ckpt.warnings) == 1 and "quantization_config.json" in ckpt.warnings[0]


@pytest.mark.parametrize("build,fmt", [(build_ct, "compressed-tensors"), (build_autoround, "auto-round"),
                                       (build_hf, "hf-fp8")])
def test_no_config_is_inferred_with_a_warning(tmp_path, build, fmt):
    tensors, cfg = build()
    ckpt = load_checkpoint(write(tmp_path / "c", tensors, None))
    assert ckpt.format == fmt and sorted(ckpt) == sorted([Q, D])
    assert len(ckpt.warnings) == 1 and "no quantization_config" in ckpt.warnings[0]
    with_config = load_checkpoint(write(tmp_path / "d", tensors, cfg))
    assert {n: ckpt[n].quant for n in ckpt} == {n: with_config[n].quant for n in with_config}


def test_unquantized_checkpoint_has_no_layers(tmp_path):
    tensors = {"a.weight": ("BF16", np.ones((2, 2), BF16))}
    ckpt = load_checkpoint(write(tmp_path / "c", tensors, {"model_type": "llama"}))
    assert ckpt.format == "unquantized" and len(ckpt) == 0 and ckpt.unquantized == ["a.weight"]


def test_single_file_path_and_ct_kv_scales(tmp_path):
    tensors, cfg = build_ct()
    cfg["quantization_config"]["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "strategy": "tensor",
                                                     "dynamic": False, "symmetric": True}
    tensors["model.layers.0.self_attn.k_scale"] = ("BF16", scales(np.random.default_rng(2), (1,), BF16))
    folder = write(tmp_path / "c", tensors, cfg)
    ckpt = load_checkpoint(folder / "model.safetensors")
    assert ckpt.kv_scales == {"model.layers.0.self_attn.k_scale": "model.layers.0.self_attn.k_scale"}
    assert ckpt.warnings == []  # no k_proj/v_proj layers in this model, so no scale is missing
    tensors["model.layers.0.self_attn.k_scale"] = ("BF16", np.array([-1.0], BF16))
    with pytest.raises(CheckpointError, match="k_scale.*negative"):
        load_checkpoint(write(tmp_path / "d", tensors, cfg))


def test_legacy_autofp8_names(tmp_path):
    rng = np.random.default_rng(3)
    tensors = {f"{Q}.weight": ("F8_E4M3", codes(rng, (48, 32))), f"{Q}.weight_scale": ("F32", np.float32(0.01)),
               f"{Q}.input_scale": ("F32", np.float32(0.02))}
    tensors = {k: (dt, np.asarray(v)) for k, (dt, v) in tensors.items()}
    cfg = {"quantization_config": {"quant_method": "fp8", "activation_scheme": "static",
                                   "ignored_layers": ["lm_head"]}}
    ckpt = load_checkpoint(write(tmp_path / "c", tensors, cfg))
    layer = ckpt[Q]
    assert layer.quant.describe() == "W float8_e4m3fn tensor, input static"
    assert layer.tensors["input_scale"] == f"{Q}.input_scale" and float(layer.input_scale) == np.float32(0.02)


def test_reference_forward_uses_linear_with_stored_tensors(tmp_path):
    from fp8ref.matmul import linear

    tensors, cfg = build_ct("FP8")
    ckpt = load_checkpoint(write(tmp_path / "c", tensors, cfg))
    x = np.random.default_rng(4).standard_normal((5, 32)).astype(np.float32)
    expect = linear(x, tensors[f"{Q}.weight"][1], tensors[f"{Q}.weight_scale"][1].astype(np.float32),
                    input_scale=tensors[f"{Q}.input_scale"][1].astype(np.float32), out_dtype="float32")
    assert np.array_equal(ckpt[Q].forward(x, out_dtype="float32"), expect)
    with pytest.raises(CheckpointError, match="mode"):
        ckpt[Q].forward(x, mode="fast")


def test_producer_weight_is_the_named_double_rounding(tmp_path):
    """forward.producer_weight is D(fp32(q * s)) (what the producers' loaders compute): on the issue's
    example the fp32 product is the tie 1 + 2**-8, which bf16 rounds to even, 1.0; dequantize gives 1.0078125."""
    from fp8ref.checkpoint.forward import producer_weight

    tensors, cfg = _every_code_times_scales()
    layer = load_checkpoint(write(tmp_path / "c", tensors, cfg))[Q]
    assert float(producer_weight(layer, "bfloat16")[3, 12]) == 1.0
    assert float(layer.dequantize("bfloat16")[3, 12]) == 1.0078125


def test_a_checkpoint_one_folder_down_is_found_and_said(tmp_path):
    """auto-round writes OUT/<model>-fp-w8afp8/: loading OUT finds the one subfolder and warns."""
    tensors, cfg = build_autoround()
    inner = write(tmp_path / "out" / "tiny-fp-w8afp8", tensors, cfg)
    (tmp_path / "out" / "logs").mkdir()  # a folder without safetensors does not count
    ckpt = load_checkpoint(tmp_path / "out")
    assert ckpt.path == inner and ckpt.format == load_checkpoint(inner).format
    assert any("its only subfolder" in w and str(inner) in w for w in ckpt.warnings)


def test_two_subfolders_with_checkpoints_are_not_guessed(tmp_path):
    tensors, cfg = build_autoround()
    write(tmp_path / "out" / "a", tensors, cfg)
    write(tmp_path / "out" / "b", tensors, cfg)
    with pytest.raises(CheckpointError, match="found none"):
        load_checkpoint(tmp_path / "out")
