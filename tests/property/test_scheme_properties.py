"""Hypothesis: scheme/spec round trips, vocabulary translations, order-independent resolution."""

import warnings

import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from fp8ref.codec import ROUNDING_MODES
from fp8ref.errors import SpecError
from fp8ref.producers.auto_round import from_autoround, to_autoround
from fp8ref.producers.compressed_tensors import from_ct_args, to_ct_args
from fp8ref.scheme import (
    KNOWN_RECIPES,
    PRESETS,
    QuantizationScheme,
)
from fp8ref.spec import load_spec_dict, load_spec_string

# Valid field combinations, written from the rules in docs/schemes.md (not from scheme.py tables).
FAMILY_FORMATS = {
    "fp": ["float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"],
    "mx_fp": ["float8_e4m3fn", "float8_e5m2", "float6_e2m3fn", "float6_e3m2fn", "float4_e2m1fn"],
    "nv_fp": ["float4_e2m1fn"],
}


@st.composite
def schemes(draw, recipe=None):
    family = draw(st.sampled_from(sorted(FAMILY_FORMATS)))
    f = {"data_type": family, "weight_format": draw(st.sampled_from(FAMILY_FORMATS[family]))}
    if family == "fp":
        f["group_size"] = draw(st.one_of(st.sampled_from([-1, 0]), st.integers(1, 512),
                                         st.tuples(st.integers(1, 256), st.integers(1, 256))))
        f["scale_dtype"] = draw(st.sampled_from(["model", "float32", "bfloat16", "float16", "float8_e8m0fnu"]))
    if draw(st.booleans()):
        f["act_format"] = draw(st.sampled_from(FAMILY_FORMATS[family]))
        if family == "fp":
            f["act_group_size"] = draw(st.one_of(st.sampled_from([-1, 0]), st.integers(1, 512)))
            f["act_dynamic"] = True if f["act_group_size"] == -1 else draw(st.booleans())
        elif family == "nv_fp":
            f["act_data_type"] = draw(st.sampled_from(["nv_fp", "nv_fp4_with_static_gs"]))
    f["rounding"] = draw(st.sampled_from(ROUNDING_MODES))
    f["saturate"] = draw(st.booleans())
    f["recipe"] = recipe or draw(st.sampled_from(KNOWN_RECIPES))
    return QuantizationScheme(**f)


def _expressible(make):
    try:
        return make()
    except SpecError:
        return None


@given(schemes())
def test_to_dict_from_dict_roundtrip(s):
    d = s.to_dict()
    assert QuantizationScheme.from_dict(d) == s
    assert QuantizationScheme.from_dict(d).to_dict() == d
    assert QuantizationScheme.from_dict(yaml.safe_load(yaml.safe_dump(d))) == s


# auto-round spells fp8 e4m3 "fp", e5m2 "fp8_e5m2"; mx_fp/nv_fp only their default element per width.
AR_FORMATS = {"fp": ("float8_e4m3fn", "float8_e5m2"),
              "mx_fp": ("float8_e4m3fn", "float6_e2m3fn", "float4_e2m1fn"), "nv_fp": ("float4_e2m1fn",)}


@given(schemes(recipe="auto-round"))
def test_autoround_roundtrip(s):
    fmts = AR_FORMATS[s.data_type]
    expressible = (s.rounding == "rne" and s.saturate and s.scale_dtype != "float8_e8m0fnu" or s.data_type == "mx_fp"
                   ) and s.rounding == "rne" and s.saturate and s.weight_format in fmts \
        and (s.act_format is None or s.act_format in fmts)
    d = _expressible(lambda: to_autoround(s))
    assert (d is not None) == expressible
    if d is not None:
        assert from_autoround(d) == s
        assert to_autoround(from_autoround(d)) == d


@given(schemes(recipe="compressed-tensors"))
def test_ct_roundtrip(s):
    w = _expressible(lambda: to_ct_args(s, "weights"))
    if w is None:
        assert (s.rounding != "rne" or not s.saturate or s.weight_format not in ("float8_e4m3fn", "float4_e2m1fn")
                or s.act_format not in (None, "float8_e4m3fn", "float4_e2m1fn")
                or (s.scale_dtype == "float8_e8m0fnu" and s.data_type != "mx_fp"))
        return
    a = to_ct_args(s, "input_activations")
    assert from_ct_args(w, a) == s
    # CT 0.20.1 drops null/empty keys: the same scheme must come back
    strip = lambda args: None if args is None else {k: v for k, v in args.items() if v not in (None, {})}  # noqa: E731
    assert from_ct_args(strip(w), strip(a)) == s


LAYER = st.text("abcdk_.0123", min_size=1, max_size=12)
PRESET = st.sampled_from(sorted(PRESETS))


@st.composite
def specs(draw):
    names = draw(st.lists(LAYER, min_size=0, max_size=5, unique=True))
    rules = {}
    for name in names:
        key = draw(st.sampled_from([name, "re:" + name.replace(".", "\\."), "re:.*" + name[-2:]]))
        rules[key] = draw(st.one_of(PRESET, schemes().map(lambda s: {k: v for k, v in s.to_dict().items()
                                                                      if v is not None})))
    ignore = draw(st.lists(LAYER.filter(lambda n: n not in rules), max_size=2, unique=True))
    return {"name": "gen", "strict": False, "scheme": draw(PRESET), "layer_config": rules, "ignore": ignore}


@settings(max_examples=60)
@given(specs(), st.lists(LAYER, min_size=1, max_size=8, unique=True), st.randoms())
def test_yaml_roundtrip_and_order_independent_resolution(spec, layers, rnd):
    from_dict = load_spec_dict(spec)
    from_yaml = load_spec_string(yaml.safe_dump(spec, sort_keys=False))
    assert from_yaml == from_dict
    assert load_spec_dict(from_dict.to_dict()) == from_dict
    assert load_spec_string(yaml.safe_dump(from_dict.to_dict(), sort_keys=False)) == from_dict
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # generated selectors often match none of the layers
        forward = from_dict.resolve_all(layers)
        shuffled = list(layers)
        rnd.shuffle(shuffled)
        backward = from_dict.resolve_all(shuffled)
    assert forward == backward
    assert forward == {n: from_dict.resolve(n) for n in reversed(layers)}

