"""YAML specs: loading, precedence, strict mode, CT config_groups, CLI."""

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from fp8ref.errors import SpecError
from fp8ref.io.yaml import format_path, load_yaml_string
from fp8ref.producers.compressed_tensors import from_ct_config, to_ct_config
from fp8ref.scheme import PRESETS
from fp8ref.spec import SpecWarning, load_spec, load_spec_dict, load_spec_string
from tests.support.cli import run_cli

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = sorted((ROOT / "specs" / "examples").glob("*.yaml"))
LLAMA = [f"model.layers.{i}.{m}" for i in range(2) for m in
         ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
          "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")] + ["lm_head"]


def test_examples_load_and_cover_required_kinds():
    assert {p.name for p in EXAMPLES} >= {"llama_w8a8_static.yaml", "fp8_block.yaml", "mixed.yaml"}
    for path in EXAMPLES:
        load_spec(path)


def test_static_llama_example():
    lc = load_spec(ROOT / "specs/examples/llama_w8a8_static.yaml")
    got = lc.resolve_all(LLAMA)
    assert got["lm_head"] is None
    assert all(got[n] == PRESETS["FP8_STATIC"] for n in LLAMA[:-1])


def test_mixed_example_precedence():
    lc = load_spec(ROOT / "specs/examples/mixed.yaml")
    assert lc.resolve("model.layers.0.self_attn.k_proj") == PRESETS["FP8"]  # later regex wins
    q = lc.resolve("model.layers.0.self_attn.q_proj")
    assert (q.act_granularity, q.act_dynamic, q.weight_granularity) == ("tensor", False, "channel")
    assert lc.resolve("model.layers.0.mlp.down_proj") is None  # exact name
    assert lc.resolve("model.layers.1.mlp.down_proj") == PRESETS["FP8_BLOCK"].replace(scale_dtype="float32")
    assert lc.resolve("model.layers.1.mlp.up_proj") == PRESETS["FP8_DYNAMIC"]
    assert lc.resolve("lm_head") is None


def test_exact_beats_regex_and_last_regex_wins_and_ignore_beats_all():
    lc = load_spec_string("""
scheme: FP8_DYNAMIC
layer_config:
  "re:.*proj": FP8
  a.proj: FP8_STATIC
  "re:.*b.proj": FP8_BLOCK
ignore: ["re:c\\\\."]
""")
    assert lc.resolve("a.proj") == PRESETS["FP8_STATIC"]
    assert lc.resolve("b.proj") == PRESETS["FP8_BLOCK"]
    assert lc.resolve("x.proj") == PRESETS["FP8"]
    assert lc.resolve("c.proj") is None
    assert lc.resolve("other") == PRESETS["FP8_DYNAMIC"]


def test_regex_is_re_match_like_compressed_tensors():
    lc = load_spec_dict({"scheme": "FP8", "layer_config": {"re:k_proj": "BF16"}})
    assert lc.resolve("k_proj_x") is None        # anchored at the start, open at the end
    assert lc.resolve("model.k_proj") == PRESETS["FP8"]


def test_strict_mode_disagreeing_regexes_and_unmatched_selectors():
    text = 'scheme: FP8\nlayer_config:\n  "re:.*proj": FP8_DYNAMIC\n  "re:.*k_proj": FP8_BLOCK\n  nothere: BF16\n'
    lenient = load_spec_string(text, source="x.yaml")
    assert lenient.resolve("a.k_proj") == PRESETS["FP8_BLOCK"]
    with pytest.warns(SpecWarning, match=r"x.yaml: selectors match no layer of the model: 'nothere' \(line 5\)"):
        lenient.resolve_all(["a.k_proj"])
    strict = load_spec_string(text, source="x.yaml", strict=True)
    with pytest.raises(SpecError) as info:
        strict.resolve("a.k_proj")
    assert str(info.value) == ("x.yaml: layer 'a.k_proj' is matched by regexes that disagree: "
                               "'re:.*proj' (line 3), 're:.*k_proj' (line 4) (strict mode)")
    agreeing = load_spec_string(text.replace("FP8_BLOCK", "FP8_DYNAMIC"), strict=True)
    assert agreeing.resolve("a.k_proj") == PRESETS["FP8_DYNAMIC"]
    with pytest.raises(SpecError, match="selectors match no layer of the model: 'nothere' .* \\(strict mode\\)"):
        agreeing.resolve_all(["a.k_proj"])


def test_all_selectors_matched_no_warning():
    lc = load_spec(ROOT / "specs/examples/llama_w8a8_static.yaml")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lc.resolve_all(LLAMA)


def test_overrides_apply_to_default_or_named_preset():
    lc = load_spec_dict({"scheme": "FP8_STATIC", "layer_config": {
        "a": {"rounding": "rtz"}, "b": {"scheme": "FP8", "act_bits": 16}}})
    assert lc.resolve("a") == PRESETS["FP8_STATIC"].replace(rounding="rtz")
    assert lc.resolve("b") == PRESETS["FP8"].replace(act_bits=16)
    none_default = load_spec_dict({"scheme": "none", "layer_config": {"a": {"bits": 8, "act_bits": 8}}})
    assert none_default.resolve("a").act_bits == 8 and none_default.resolve("b") is None
    mapping_default = load_spec_dict({"scheme": {"scheme": "FP8", "saturate": False}})
    assert mapping_default.resolve("x") == PRESETS["FP8"].replace(saturate=False)


def test_dict_input_accepts_scheme_objects_and_roundtrips():
    lc = load_spec_dict({"scheme": PRESETS["FP8"], "layer_config": {"re:.*": PRESETS["NVFP4"]}, "ignore": ["x"]})
    assert lc.resolve("y") == PRESETS["NVFP4"]
    assert load_spec_dict(lc.to_dict()) == lc


def test_yamlio_lines_and_paths():
    doc = load_yaml_string("a:\n  b: [1, 2]\n  'c.d': 3\n", source="f.yaml")
    assert doc.lines[("a", "c.d")] == 3 and doc.lines[("a", "b", 1)] == 2
    assert doc.where(("a", "c.d", "zz")) == 'f.yaml:3: a."c.d".zz'
    assert format_path(("ignore", 2)) == "ignore[2]"
    assert format_path(("layer_config", "re:.*k_proj", "act_bits")) == 'layer_config."re:.*k_proj".act_bits'


# --- compressed-tensors config_groups ---------------------------------------------------------
def test_ct_config_single_scheme_matches_reference_5_2():
    lc = load_spec_dict({"scheme": "FP8", "ignore": ["lm_head"]})
    cfg = to_ct_config(lc)
    # REFERENCE.md §5.2 (CT 0.19.0 FP8): top-level and group keys
    assert cfg["ignore"] == ["lm_head"] and cfg["format"] == "float-quantized"
    assert cfg["quant_method"] == "compressed-tensors" and cfg["quantization_status"] == "compressed"
    group = cfg["config_groups"]["group_0"]
    assert group["targets"] == ["Linear"] and group["output_activations"] is None
    assert group["format"] == "float-quantized"
    assert from_ct_config(cfg) == lc.__class__(PRESETS["FP8"], (), lc.ignore, source="quantization_config")
    assert to_ct_config(load_spec_dict({"scheme": "FPW8A16"}))["format"] == "naive-quantized"


def test_ct_config_reference_5_4_autoround_export_parses():
    cfg = {"config_groups": {"group_0": {"format": None, "output_activations": None, "targets": ["Linear"],
           "input_activations": {"dynamic": False, "group_size": None, "num_bits": 8, "strategy": "tensor",
                                 "symmetric": True, "type": "float"},
           "weights": {"dynamic": False, "group_size": None, "num_bits": 8, "strategy": "channel",
                       "symmetric": True, "type": "float"}}},
           "format": "float-quantized", "global_compression_ratio": None, "ignore": [], "kv_cache_scheme": None,
           "moe_sparsity_config": None, "provider": "auto-round", "quant_method": "compressed-tensors",
           "quantization_status": "compressed"}
    lc = from_ct_config(cfg, recipe="auto-round")
    assert lc.default == PRESETS["FP8_STATIC"] and lc.ignore == ()


def test_ct_config_mixed_roundtrip_with_layer_names():
    lc = load_spec(ROOT / "specs/examples/mixed.yaml")
    cfg = to_ct_config(lc, LLAMA)
    assert cfg["ignore"] == ["model.layers.0.mlp.down_proj", "lm_head"]
    back = from_ct_config(json.loads(json.dumps(cfg)))
    assert back.resolve_all(LLAMA) == lc.resolve_all(LLAMA)
    with pytest.raises(SpecError, match="layer_names: needed"):
        to_ct_config(lc)


def test_ct_config_preset_key_and_errors():
    lc = from_ct_config({"config_groups": {"FP8_DYNAMIC": ["Linear"]}, "ignore": ["lm_head"]})
    assert lc.default == PRESETS["FP8_DYNAMIC"]
    with pytest.raises(SpecError, match="class name 'Embedding' is not expressible"):
        from_ct_config({"config_groups": {"g": {"targets": ["Embedding"], "weights": {"type": "float"}}}})
    with pytest.raises(SpecError, match="kv_cache_scheme: KV-cache quantization is not part of a LayerConfig"):
        from_ct_config({"config_groups": {"FP8": ["Linear"]}, "kv_cache_scheme": {"num_bits": 8}})


# --- CLI ------------------------------------------------------------------------------------
def test_cli_validate(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("scheme: FP8\nscheme: FP8\n")
    assert run_cli("spec", "validate", str(EXAMPLES[0])) == 0
    assert run_cli("spec", "validate", str(EXAMPLES[0]), str(bad)) == 1
    err = capsys.readouterr().err.splitlines()
    assert err == [f"{bad}:2: scheme: duplicate key (first defined on line 1)"]
    assert run_cli("spec", "validate", "--json", "-", str(bad)) == 1
    assert json.loads(capsys.readouterr().out)["files"][0]["ok"] is False


def test_cli_show_layers_and_checkpoint(tmp_path, capsys):
    names = tmp_path / "names.txt"
    names.write_text("# llama\nmodel.layers.0.self_attn.k_proj\nlm_head\n")
    mixed = str(ROOT / "specs/examples/mixed.yaml")
    assert run_cli("spec", "show", mixed, "--layers", str(names), "--json", "-") == 0
    out = json.loads(capsys.readouterr().out)
    assert out["lm_head"] is None and out["model.layers.0.self_attn.k_proj"] == PRESETS["FP8"].to_dict()
    save_file({"model.layers.0.self_attn.k_proj.weight": np.zeros((4, 8), np.float32),
               "model.layers.0.input_layernorm.weight": np.zeros(8, np.float32),
               "lm_head.weight": np.zeros((2, 8), np.float32)}, str(tmp_path / "model.safetensors"))
    assert run_cli("spec", "show", mixed, "--checkpoint", str(tmp_path)) == 0
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert lines[0].split()[:3] == ["layer", "preset", "weight"]
    assert [line.split()[:2] for line in lines[1:]] == [["lm_head", "BF16"],
                                                        ["model.layers.0.self_attn.k_proj", "FP8"]]
    assert "selectors match no layer" in captured.err
    assert run_cli("spec", "show", mixed) == 0
    assert "(default)" in capsys.readouterr().out


def test_cli_show_checkpoint_lists_what_export_quantizes(tmp_path, capsys):
    """embed_tokens is a 2-D weight, but export leaves embeddings alone: spec show does too."""
    save_file({"model.embed_tokens.weight": np.zeros((4, 8), np.float32),
               "model.layers.0.mlp.up_proj.weight": np.zeros((4, 8), np.float32)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "spec.yaml").write_text("scheme: FP8_DYNAMIC\n")
    assert run_cli("spec", "show", tmp_path / "spec.yaml", "--checkpoint", tmp_path, "--json", "-") == 0
    assert list(json.loads(capsys.readouterr().out)) == ["model.layers.0.mlp.up_proj"]
