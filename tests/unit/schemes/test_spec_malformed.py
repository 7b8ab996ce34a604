"""Malformed specs: each case is the file text and the exact error message (source "x.yaml").

The messages were read and judged one by one: each names the file, the line, the key path,
what was given and what was expected.
"""
# ruff: noqa: E501  (tables of exact expected messages)

import pytest

from fp8ref.errors import SpecError
from fp8ref.spec import load_spec, load_spec_string

CASES = [
    ('duplicate_top_key', 'scheme: FP8\nscheme: FP8_STATIC\n',
     'x.yaml:2: scheme: duplicate key (first defined on line 1)'),
    ('duplicate_layer_key', 'scheme: FP8\nlayer_config:\n  a: FP8\n  a: BF16\n',
     'x.yaml:4: layer_config.a: duplicate key (first defined on line 3)'),
    ('act_bits_7', 'scheme: FP8\nlayer_config:\n  "re:.*k_proj":\n    act_bits: 7\n',
     'x.yaml:4: layer_config."re:.*k_proj".act_bits: expected one of 8, 16, got 7'),
    ('unknown_preset', 'scheme: FP8_STATC\n',
     "x.yaml:1: scheme: unknown preset 'FP8_STATC'; did you mean 'FP8_STATIC'? (known: FP8_STATIC, FP8, FP8_DYNAMIC, FP8_BLOCK, FPW8A16, MXFP8, MXFP4, NVFP4, MXFP6A16, MXFP6A8, MXFP4XFP8, BF16, none)"),
    ('unknown_preset_in_rule', 'scheme: FP8\nlayer_config:\n  a: nvfp5\n',
     "x.yaml:3: layer_config.a: unknown preset 'nvfp5'; did you mean 'NVFP4'? (known: FP8_STATIC, FP8, FP8_DYNAMIC, FP8_BLOCK, FPW8A16, MXFP8, MXFP4, NVFP4, MXFP6A16, MXFP6A8, MXFP4XFP8, BF16, none)"),
    ('bad_regex', 'scheme: FP8\nlayer_config:\n  "re:(unclosed": BF16\n',
     'x.yaml:3: layer_config."re:(unclosed": invalid regular expression \'(unclosed\': missing ), unterminated subpattern at position 0'),
    ('empty_regex', 'scheme: FP8\nignore: ["re:"]\n',
     'x.yaml:2: ignore[0]: empty regular expression'),
    ('top_level_list', '- scheme: FP8\n',
     'x.yaml:1: expected a mapping with keys name, description, strict, scheme, layer_config, ignore, got list'),
    ('empty_document', '# nothing\n',
     'x.yaml: expected a mapping with keys name, description, strict, scheme, layer_config, ignore, got an empty document'),
    ('scalar_document', 'FP8\n',
     'x.yaml:1: expected a mapping with keys name, description, strict, scheme, layer_config, ignore, got str'),
    ('missing_scheme', 'layer_config: {}\n',
     'x.yaml:1: scheme: required (a preset name such as FP8_STATIC, or a mapping of fields)'),
    ('unknown_top_key', 'scheme: FP8\nlayer_configs: {}\n',
     "x.yaml:2: layer_configs: unknown key (did you mean 'layer_config'?); expected one of name, description, strict, scheme, layer_config, ignore"),
    ('strict_not_bool', 'scheme: FP8\nstrict: maybe\n',
     "x.yaml:2: strict: expected true or false, got 'maybe'"),
    ('name_not_string', 'scheme: FP8\nname: [a]\n',
     "x.yaml:2: name: expected a string, got ['a']"),
    ('layer_config_list', 'scheme: FP8\nlayer_config: [a, b]\n',
     'x.yaml:2: layer_config: expected a mapping of selector -> preset or overrides, got list'),
    ('ignore_string', 'scheme: FP8\nignore: lm_head\n',
     "x.yaml:2: ignore: expected a list of layer names or 're:' patterns, got str"),
    ('ignore_duplicate', 'scheme: FP8\nignore: [lm_head, lm_head]\n',
     "x.yaml:2: ignore[1]: duplicate selector 'lm_head' (first at ignore[0])"),
    ('ignore_and_configured', 'scheme: FP8\nlayer_config:\n  lm_head: FP8\nignore:\n  - lm_head\n',
     "x.yaml:5: ignore[0]: 'lm_head' is also configured in layer_config (line 3)"),
    ('ignore_non_string', 'scheme: FP8\nignore: [3]\n',
     "x.yaml:2: ignore[0]: expected a layer name or 're:PATTERN', got 3"),
    ('unknown_field', 'scheme: FP8\nlayer_config:\n  a: {bitz: 8}\n',
     "x.yaml:3: layer_config.a.bitz: unknown field (did you mean 'bits'?); valid fields: scheme, bits, group_size, sym, data_type, act_bits, act_group_size, act_sym, act_data_type, act_dynamic, weight_format, weight_granularity, block_shape, act_format, act_granularity, scale_dtype, rounding, saturate, recipe"),
    ('group_with_tensor', 'scheme:\n  weight_granularity: tensor\n  group_size: 128\n',
     "x.yaml:3: scheme.group_size: weight_granularity 'tensor' needs group_size 0, got 128"),
    ('static_per_token', 'scheme: FP8_DYNAMIC\nlayer_config:\n  a:\n    act_dynamic: false\n',
     "x.yaml:4: layer_config.a.act_dynamic: static activations cannot be per token (a token's scale exists only at run time); use act_group_size 0 or act_dynamic true"),
    ('block_without_block', 'scheme: FP8_STATIC\nlayer_config:\n  a: {block_shape: [64, 64], weight_granularity: channel}\n',
     "x.yaml:3: layer_config.a.block_shape: only valid with weight_granularity 'block', got 'channel'"),
    ('bits_format', 'scheme: {weight_format: float8_e5m2, bits: 4}\n',
     'x.yaml:1: scheme.bits: weight_format float8_e5m2 holds 8 bits, got 4'),
    ('value_int', 'scheme: FP8\nlayer_config:\n  a: 8\n',
     'x.yaml:3: layer_config.a: expected a preset name or a mapping of scheme fields, got int 8'),
    ('value_null', 'scheme: FP8\nlayer_config:\n  a:\n',
     'x.yaml:3: layer_config.a: expected a preset name or a mapping of scheme fields, got null'),
    ('bf16_with_overrides', 'scheme: FP8\nlayer_config:\n  a: {scheme: BF16, bits: 8}\n',
     "x.yaml:3: layer_config.a.scheme: preset 'BF16' leaves the layer unquantized and takes no overrides, got bits"),
    ('scheme_key_not_string', 'scheme: FP8\nlayer_config:\n  a: {scheme: 8}\n',
     'x.yaml:3: layer_config.a.scheme: expected a preset name, got 8'),
    ('wrong_type_bits', 'scheme: {bits: eight}\n',
     "x.yaml:1: scheme.bits: expected an integer, got 'eight'"),
    ('wrong_type_act_dynamic', "scheme: FP8\nlayer_config:\n  a: {act_dynamic: 'no'}\n",
     "x.yaml:3: layer_config.a.act_dynamic: expected true or false, got 'no'"),
    ('rounding_unknown', 'scheme: {scheme: FP8, rounding: nearest_even}\n',
     "x.yaml:1: scheme.rounding: expected one of rne, rna, rtz, rup, rdown, rto, stochastic, got 'nearest_even'"),
    ('format_unknown', 'scheme: {weight_format: float8_e4m3}\n',
     "x.yaml:1: scheme.weight_format: expected one of float8_e4m3fn, float8_e5m2, float8_e4m3fnuz, float8_e5m2fnuz, float8_e4m3b11fnuz, float8_e8m0fnu, float4_e2m1fn, float6_e2m3fn, float6_e3m2fn, binary8p1, binary8p2, binary8p3, binary8p4, binary8p5, binary8p6, binary8p7, got 'float8_e4m3' (did you mean 'float8_e4m3fn'?)"),
    ('merge_key', 'base: &b {bits: 8}\nscheme:\n  <<: *b\n',
     "x.yaml:3: scheme: merge keys ('<<') are not supported; write the keys out"),
    ('python_tag', "scheme: !!python/object/apply:os.system ['true']\n",
     "x.yaml:1: scheme: unsupported tag 'tag:yaml.org,2002:python/object/apply:os.system'; only plain mappings and lists"),
    ('invalid_yaml', 'scheme: [FP8\n',
     "x.yaml:2: invalid YAML: while parsing a flow sequence expected ',' or ']', but got '<stream end>'"),
    ('non_string_key', 'scheme: FP8\nlayer_config:\n  8: BF16\n',
     "x.yaml:3: layer_config[8]: expected a layer name or 're:PATTERN', got 8"),
    ('mx_group', 'scheme: MXFP8\nlayer_config:\n  a: {group_size: 16}\n',
     "x.yaml:3: layer_config.a.group_size: OCP MX v1.0 scales blocks of 32 elements (weight_granularity 'group', group_size 32), got 16"),
    ('multiple_errors', 'scheme: FP8\nlayer_config:\n  a: {bits: 7}\n  b: nope\n',
     "x.yaml:3: layer_config.a.bits: expected one of 8, got 7\nx.yaml:4: layer_config.b: unknown preset 'nope'; did you mean 'none'? (known: FP8_STATIC, FP8, FP8_DYNAMIC, FP8_BLOCK, FPW8A16, MXFP8, MXFP4, NVFP4, MXFP6A16, MXFP6A8, MXFP4XFP8, BF16, none)"),
]


@pytest.mark.parametrize("name, text, message", CASES, ids=[c[0] for c in CASES])
def test_malformed_spec_message(name, text, message):
    with pytest.raises(SpecError) as info:
        load_spec_string(text, source="x.yaml")
    assert str(info.value) == message


def test_independent_errors_are_all_reported():
    with pytest.raises(SpecError) as info:
        load_spec_string("scheme: FP8\nlayer_config:\n  a: {bits: 7}\n  b: nope\nignore: 3\n", source="x.yaml")
    assert [e.split(":")[1] for e in info.value.errors] == ["3", "4", "5"]


def test_case_count():
    assert len(CASES) >= 25


def test_file_errors_name_the_path(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_text('scheme: FP8\nlayer_config:\n  "re:.*k_proj":\n    act_bits: 7\n')
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert str(info.value) == f'{path}:4: layer_config."re:.*k_proj".act_bits: expected one of 8, 16, got 7'
    with pytest.raises(SpecError, match="cannot read"):
        load_spec(tmp_path / "missing.yaml")
