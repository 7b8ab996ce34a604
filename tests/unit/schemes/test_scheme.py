"""QuantizationScheme: mapping API, validation, presets pinned to REFERENCE.md §7, translations."""
# ruff: noqa: E501  (tables of exact expected messages)

import copy

import pytest

from fp8ref.errors import SpecError
from fp8ref.producers.auto_round import from_autoround, to_autoround
from fp8ref.producers.compressed_tensors import from_ct_args, to_ct_args
from fp8ref.scheme import (
    AUTOROUND_FIELDS,
    FIELDS,
    PRESETS,
    QuantizationScheme,
    SchemeFieldError,
    UnknownFieldError,
)

# --- presets: numbers typed from REFERENCE.md, not read from specs/presets.yaml -------------------
# REFERENCE.md §7.1 auto-round presets table:
# preset: (bits, group, dtype, act_bits, act_group, act_dtype, act_dynamic); "–" written as None.
AUTOROUND_TABLE_7_1 = {
    "FP8_STATIC": (8, -1, "fp", 8, 0, "fp", False),
    "FPW8A16": (8, 0, "fp", 16, None, "fp", None),
    "FP8_BLOCK": (8, (128, 128), "fp", 8, 128, "fp", True),
    "MXFP8": (8, 32, "mx_fp", 8, 32, "mx_fp", True),
    "MXFP4": (4, 32, "mx_fp", 4, 32, "mx_fp", True),
    "NVFP4": (4, 16, "nv_fp", 4, 16, "nv_fp4_with_static_gs", True),
}
# REFERENCE.md §7.3 compressed-tensors presets table (+ §5.2 bullets for FP8_DYNAMIC/FP8_BLOCK):
# preset: (weight strategy, block, act strategy, act group, act dynamic)
CT_TABLE_7_3 = {
    "FP8": ("tensor", None, "tensor", None, False),
    "FP8_DYNAMIC": ("channel", None, "token", None, True),
    "FP8_BLOCK": ("block", [128, 128], "group", 128, True),
}


@pytest.mark.parametrize("name", sorted(AUTOROUND_TABLE_7_1))
def test_autoround_presets_match_reference_7_1(name):
    s = PRESETS[name]
    got = (s.bits, s.group_size, s.data_type, s.act_bits, s.act_group_size, s.act_data_type, s.act_dynamic)
    assert got == AUTOROUND_TABLE_7_1[name]
    assert s.sym is True


@pytest.mark.parametrize("name", sorted(CT_TABLE_7_3))
def test_ct_presets_match_reference_7_3(name):
    s = PRESETS[name]
    w, a = to_ct_args(s, "weights", "0.19"), to_ct_args(s, "input_activations", "0.19")
    got = (w["strategy"], w["block_structure"], a["strategy"], a["group_size"], a["dynamic"])
    assert got == CT_TABLE_7_3[name]
    assert (w["type"], w["num_bits"], a["type"], a["num_bits"]) == ("float", 8, "float", 8)


def test_preset_formats_and_scale_dtypes():
    # §3.3/§3.4: MX uses E8M0 scales over 32 elements; NVFP4 E2M1 elements with E4M3 block scales.
    assert (PRESETS["MXFP8"].weight_format, PRESETS["MXFP8"].scale_dtype) == ("float8_e4m3fn", "float8_e8m0fnu")
    assert (PRESETS["MXFP4"].weight_format, PRESETS["MXFP4"].scale_dtype) == ("float4_e2m1fn", "float8_e8m0fnu")
    assert (PRESETS["NVFP4"].weight_format, PRESETS["NVFP4"].scale_dtype) == ("float4_e2m1fn", "float8_e4m3fn")
    assert PRESETS["NVFP4"].weight_granularity == "tensor_group"
    assert PRESETS["FP8_BLOCK"].block_shape == (128, 128)


def test_unquantized_presets_and_case_insensitivity():
    assert PRESETS["BF16"] is None and PRESETS["none"] is None and PRESETS["bf16"] is None
    assert PRESETS["fp8_static"] == PRESETS["FP8_STATIC"]
    with pytest.raises(SpecError, match=r"unknown preset 'FP8_STATC'; did you mean 'FP8_STATIC'\?"):
        PRESETS["FP8_STATC"]
    assert "nope" not in PRESETS and "fp8" in PRESETS


# --- mapping API ------------------------------------------------------------------------------
def test_mapping_protocol():
    s = PRESETS["FP8_STATIC"]
    assert s["bits"] == 8 and s.bits == 8 and s.get("bits") == 8
    assert list(s) == list(FIELDS) and list(s.keys()) == list(FIELDS) and len(s) == len(FIELDS)
    assert dict(s) == dict(s.items()) and list(s.values()) == [s[k] for k in FIELDS]
    assert "bits" in s and "bitz" not in s and 0 not in s
    assert s.get("bitz", "dflt") == "dflt"
    fpw = PRESETS["FPW8A16"]
    assert fpw.get("act_group_size", "dflt") is None  # a stored None is returned, unlike auto-round


def test_unknown_key_lists_valid_fields():
    s = PRESETS["FP8"]
    with pytest.raises(UnknownFieldError) as info:
        s["bitz"]
    assert isinstance(info.value, KeyError) and isinstance(info.value, SpecError)
    assert str(info.value).startswith("bitz: unknown field (did you mean 'bits'?); valid fields: bits, group_size,")
    with pytest.raises(UnknownFieldError):
        QuantizationScheme(bitz=8)
    with pytest.raises(UnknownFieldError):
        s.replace(nope=1)
    with pytest.raises(AttributeError):
        _ = s.nope


def test_frozen_hashable_value_semantics():
    a = QuantizationScheme(bits=8, group_size=-1)
    b = QuantizationScheme(weight_granularity="channel")
    assert a == b and hash(a) == hash(b)
    assert {a: 1}[b] == 1
    assert a != PRESETS["FP8"] and a != dict(a)
    with pytest.raises(AttributeError, match="frozen"):
        a.bits = 4
    assert copy.deepcopy(a) == a and copy.copy(a) == a


def test_to_dict_from_dict_roundtrip_and_json_types():
    s = PRESETS["FP8_BLOCK"]
    d = s.to_dict()
    assert d["group_size"] == [128, 128] and d["block_shape"] == [128, 128]
    assert QuantizationScheme.from_dict(d) == s and QuantizationScheme.from_dict(d).to_dict() == d
    with pytest.raises(SpecError, match="expected a mapping"):
        QuantizationScheme.from_dict([("bits", 8)])


def test_replace_rederives_dependent_fields():
    s = PRESETS["FP8_STATIC"]
    g = s.replace(group_size=128)
    assert (g.weight_granularity, g.group_size, g.block_shape) == ("group", 128, None)
    b = s.replace(block_shape=[64, 32])
    assert (b.weight_granularity, b.group_size) == ("block", (64, 32))
    w = s.replace(act_bits=16)
    assert w.act_dynamic is None and w.act_format is None and not w.quantizes_activations
    assert s.replace(weight_format="float8_e5m2").bits == 8
    assert s.replace(rounding="rtz").rounding == "rtz" and s.rounding == "rne"


def test_defaults():
    s = QuantizationScheme()
    assert (s.bits, s.data_type, s.weight_format, s.weight_granularity, s.act_bits) == \
        (8, "fp", "float8_e4m3fn", "channel", 16)
    assert (s.scale_dtype, s.rounding, s.saturate, s.recipe) == ("model", "rne", True, "fp8ref")
    a = QuantizationScheme(act_bits=8)
    assert (a.act_granularity, a.act_group_size, a.act_dynamic, a.act_format) == \
        ("tensor", 0, True, "float8_e4m3fn")


def test_autoround_aliases():
    assert QuantizationScheme(data_type="fp8").data_type == "fp"
    e5 = QuantizationScheme(data_type="fp8_e5m2")
    assert (e5.data_type, e5.weight_format) == ("fp", "float8_e5m2")
    assert to_autoround(e5)["data_type"] == "fp8_e5m2"


@pytest.mark.parametrize("fields, message", [
    (dict(act_bits=8, act_group_size=-1, act_dynamic=False), "act_dynamic: static activations cannot be per token"),
    (dict(group_size=128, weight_granularity="tensor"), "group_size: weight_granularity 'tensor' needs group_size 0, got 128"),
    (dict(block_shape=[128, 128], weight_granularity="channel"), "block_shape: only valid with weight_granularity 'block', got 'channel'"),
    (dict(weight_format="float8_e4m3fn", bits=4), "bits: weight_format float8_e4m3fn holds 8 bits, got 4"),
    (dict(data_type="nv_fp", weight_format="float8_e4m3fn"), "weight_format: data_type 'nv_fp' allows float4_e2m1fn; got 'float8_e4m3fn'"),
    (dict(act_bits=7), "act_bits: expected one of 8, 16, got 7"),
    (dict(data_type="mx_fp", act_bits=5), "act_bits: expected one of 4, 6, 8, 16 with act_data_type 'mx_fp', got 5"),
    (dict(data_type="int"), "data_type: expected one of fp, mx_fp, nv_fp (fp8ref covers floating-point formats only), got 'int'"),
    (dict(sym=False), "sym: floating-point quantization is symmetric (no zero point), got False"),
    (dict(weight_granularity="group"), "group_size: weight_granularity 'group' needs a positive group_size"),
    (dict(weight_granularity="block"), "block_shape: weight_granularity 'block' needs block_shape [rows, cols]"),
    (dict(group_size=[128, 128], block_shape=[64, 64]), "block_shape: group_size says [128, 128], block_shape says [64, 64]"),
    (dict(group_size=-2), "group_size: expected 0 (tensor), -1 (channel), a positive group size or [rows, cols], got -2"),
    (dict(group_size=[128]), "group_size: expected an integer or [rows, cols] of positive integers, got [128]"),
    (dict(weight_granularity="tensor_group", group_size=16), "weight_granularity: 'tensor_group' is NVFP4's two-level scaling"),
    (dict(data_type="mx_fp", group_size=16), "group_size: OCP MX v1.0 scales blocks of 32 elements"),
    (dict(scale_dtype="float8_e4m3fn"), "scale_dtype: data_type 'fp' allows model, float32, bfloat16, float16, float8_e8m0fnu; got 'float8_e4m3fn'"),
    (dict(act_bits=8, act_data_type="mx_fp"), "act_data_type: must be of the same family as data_type 'fp'"),
    (dict(data_type="mx_fp", act_bits=8, act_dynamic=False), "act_dynamic: act_data_type 'mx_fp' computes its block scales at run time"),
    (dict(rounding="nearest"), "rounding: expected one of rne, rna, rtz, rup, rdown, rto, stochastic, got 'nearest'"),
    (dict(recipe="llmcompressor"), "recipe: expected one of auto-round, compressed-tensors, compressed-tensors-gpu, compressed-tensors-mx"),
    (dict(bits=True), "bits: expected an integer, got True"),
    (dict(saturate="yes"), "saturate: expected true or false, got 'yes'"),
    (dict(weight_format="float8_e4m3"), "weight_format: expected one of float8_e4m3fn"),
    (dict(act_bits=8, act_group_size=[1, 128]), "act_group_size: expected an integer, got [1, 128]"),
])
def test_validation_errors_name_field_and_rule(fields, message):
    with pytest.raises(SchemeFieldError) as info:
        QuantizationScheme(**fields)
    assert str(info.value).startswith(message)
    assert info.value.field == message.split(":")[0]


# --- compressed-tensors -----------------------------------------------------------------------
# REFERENCE.md §5.2: CT 0.19.0 FP8 preset, every QuantizationArgs key present.
CT_019_FP8_INPUT = {"actorder": None, "block_structure": None, "dynamic": False, "group_size": None,
                    "num_bits": 8, "observer": "static_minmax", "observer_kwargs": {}, "scale_dtype": None,
                    "strategy": "tensor", "symmetric": True, "type": "float", "zp_dtype": None}
CT_019_FP8_WEIGHTS = dict(CT_019_FP8_INPUT, observer="memoryless_minmax")
# REFERENCE.md §5.4: auto-round's llm_compressor export with CT 0.20.1 (null keys dropped).
CT_0201_AR_INPUT = {"dynamic": False, "group_size": None, "num_bits": 8, "strategy": "tensor",
                    "symmetric": True, "type": "float"}
CT_0201_AR_WEIGHTS = {"dynamic": False, "group_size": None, "num_bits": 8, "strategy": "channel",
                      "symmetric": True, "type": "float"}


def test_ct_019_fp8_args_written_exactly():
    s = PRESETS["FP8"]
    assert to_ct_args(s, "weights", "0.19") == CT_019_FP8_WEIGHTS
    assert to_ct_args(s, "input_activations", "0.19") == CT_019_FP8_INPUT


def test_ct_parses_019_and_0201_forms():
    assert from_ct_args(CT_019_FP8_WEIGHTS, CT_019_FP8_INPUT) == PRESETS["FP8"]
    assert from_ct_args(CT_0201_AR_WEIGHTS, CT_0201_AR_INPUT, recipe="auto-round") == PRESETS["FP8_STATIC"]
    minimal = {"num_bits": 8, "type": "float", "strategy": "channel"}  # dynamic/symmetric defaulted
    dyn = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}
    assert from_ct_args(minimal, dyn) == PRESETS["FP8_DYNAMIC"]


def test_ct_weight_only_and_nvfp4_local():
    assert to_ct_args(PRESETS["FPW8A16"], "input_activations") is None
    a = to_ct_args(PRESETS["NVFP4"], "input_activations")
    assert (a["strategy"], a["group_size"], a["dynamic"], a["num_bits"]) == ("tensor_group", 16, "local", 4)


@pytest.mark.parametrize("scheme, message", [
    (dict(data_type="fp8_e5m2"), "weight_format: compressed-tensors float types are e4m3fn"),
    (dict(rounding="rtz"), "rounding: compressed-tensors rounds to nearest even only, got 'rtz'"),
    (dict(saturate=False), "saturate: compressed-tensors always clamps"),
    (dict(scale_dtype="float8_e8m0fnu", group_size=[128, 128]), "scale_dtype: compressed-tensors marks MX by uint8"),
])
def test_ct_untranslatable(scheme, message):
    with pytest.raises(SchemeFieldError) as info:
        to_ct_args(QuantizationScheme(**scheme), "weights")
    assert str(info.value).startswith(message)


@pytest.mark.parametrize("weights, message", [
    (dict(CT_019_FP8_WEIGHTS, type="int"), "weights.type: fp8ref covers floating-point formats only, got 'int'"),
    (dict(CT_019_FP8_WEIGHTS, observer="mse"), "weights.observer: only min/max observers are expressible, got 'mse'"),
    (dict(CT_019_FP8_WEIGHTS, symmetric=False), "weights.symmetric: asymmetric float quantization is not modelled"),
    (dict(CT_019_FP8_WEIGHTS, extra=1), "weights.extra: not a QuantizationArgs key"),
    (dict(CT_019_FP8_WEIGHTS, actorder="group"), "weights.actorder: activation reordering is not modelled"),
])
def test_ct_parse_errors(weights, message):
    with pytest.raises(SpecError) as info:
        from_ct_args(weights, None)
    assert str(info.value).startswith(message)


# --- auto-round ------------------------------------------------------------------------------
# REFERENCE.md §5.3: the scheme keys of auto-round 0.16.1's fp8_static quantization_config.
AR_0161_FP8_STATIC = {"act_bits": 8, "act_data_type": "fp", "act_dynamic": False, "act_group_size": 0,
                      "act_sym": True, "bits": 8, "data_type": "fp", "group_size": -1, "sym": True}


def test_autoround_config_maps_to_fp8_static():
    s = from_autoround(AR_0161_FP8_STATIC)
    assert s == PRESETS["FP8_STATIC"]
    assert to_autoround(s) == AR_0161_FP8_STATIC and tuple(to_autoround(s)) == AUTOROUND_FIELDS


def test_autoround_layer_config_value_forms():
    base = PRESETS["FP8_STATIC"]
    assert from_autoround("FP8_BLOCK") == PRESETS["FP8_BLOCK"]
    assert from_autoround("bf16") is None
    assert from_autoround({"scheme": "FP8_DYNAMIC", "act_bits": 16}) == PRESETS["FP8_DYNAMIC"].replace(act_bits=16)
    assert from_autoround({"group_size": 0}, base=base) == base.replace(group_size=0)
    assert from_autoround({"bits": 8, "group_size": [128, 128], "data_type": "fp"}).block_shape == (128, 128)
    # weight-only in auto-round's merged form: the act fields are ignored as auto-round's __eq__ does
    merged = {"bits": 8, "group_size": 0, "data_type": "fp", "act_bits": 16, "act_group_size": 0,
              "act_sym": True, "act_dynamic": True, "act_data_type": "fp", "super_bits": None}
    assert from_autoround(merged) == PRESETS["FPW8A16"]
    assert from_autoround({"scale_dtype": "torch.float32", "fixed_by_user": True}).scale_dtype == "float32"


@pytest.mark.parametrize("value, message", [
    ({"bitz": 8}, "bitz: not an auto-round field (did you mean 'bits'?)"),
    ({"super_bits": 6}, "super_bits: GGUF double quantization and rotations have no fp8ref equivalent"),
    ({"scheme": "BF16", "bits": 8}, "scheme: a preset that leaves the layer unquantized takes no overrides"),
    ({"data_type": "int", "bits": 4}, "data_type: expected one of fp, mx_fp, nv_fp"),
    ("W4A16", "scheme: unknown preset 'W4A16'"),
])
def test_autoround_errors(value, message):
    with pytest.raises(SpecError) as info:
        from_autoround(value)
    assert str(info.value).startswith(message)


def test_autoround_untranslatable():
    with pytest.raises(SchemeFieldError, match="^weight_format: auto-round has no data_type for float8_e4m3fnuz"):
        to_autoround(QuantizationScheme(weight_format="float8_e4m3fnuz"))
    with pytest.raises(SchemeFieldError, match="^rounding: auto-round rounds to nearest even only"):
        to_autoround(QuantizationScheme(rounding="stochastic"))
    with pytest.raises(SchemeFieldError, match="^scale_dtype: auto-round has no float8_e8m0fnu scales"):
        to_autoround(QuantizationScheme(scale_dtype="float8_e8m0fnu"))
    with pytest.raises(SpecError, match="expected a preset name, a dict"):
        from_autoround(8)
