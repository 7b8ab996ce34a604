"""fp8ref's producer recipes reproduce every byte the real tools wrote.

Fixtures: tests/fixtures/interop/recipes/ (written by tools/make_interop_fixtures.py with
compressed-tensors, auto-round and transformers; versions in manifest.json). Each case is
checked on its codes (every byte) and on its stored scale (value, dtype and element count).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

from fp8ref.errors import ShapeError  # noqa: E402
from fp8ref.formats import FORMATS  # noqa: E402
from fp8ref.quant import QuantArgs, dequantize, fake_quant, quantize  # noqa: E402
from fp8ref.recipes import compute_scale  # noqa: E402
from fp8ref.registry import get_recipe  # noqa: E402

HERE = Path(__file__).resolve().parents[1] / "fixtures" / "interop" / "recipes"
MANIFEST = json.loads((HERE / "manifest.json").read_text()) if (HERE / "manifest.json").exists() else {"cases": []}
E4M3 = FORMATS["float8_e4m3fn"]
_FILES: dict[str, dict] = {}


def _file(name: str) -> dict:
    if name not in _FILES:
        _FILES[name] = safetensors_torch.load_file(str(HERE / name))
    return _FILES[name]


def _input(case: dict):
    fname, key = case["input"].split(":")
    return _file(fname)[key]


def _tensor(case: dict, suffix: str):
    return _file(case["file"])[f"{case['case']}.{suffix}"]


def _same_bits(got, want) -> None:
    """Equal dtype, equal element count and bit-identical values (NaN payloads included)."""
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    assert got.numel() == want.numel(), (tuple(got.shape), tuple(want.shape))
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[got.element_size()]
    g, w = got.reshape(-1).contiguous().view(width), want.reshape(-1).contiguous().view(width)
    bad = (g != w).nonzero().flatten()
    assert bad.numel() == 0, f"{bad.numel()} of {g.numel()} differ, first at flat index {bad[:5].tolist()}"


def _cases(tool: str, pred=lambda c: True):
    cases = [c for c in MANIFEST["cases"] if c["tool"] == tool and pred(c)]
    return pytest.mark.parametrize("case", cases, ids=[f"{c['dtype']}-{c.get('strategy') or c.get('kind')}-"
                                                       f"{c['case']}" for c in cases])


def test_manifest_has_cases_for_every_verified_tool():
    tools = {c["tool"] for c in MANIFEST["cases"]}
    assert {"compressed-tensors", "auto-round", "transformers"} <= tools


_CT_WEIGHT = {"tensor": QuantArgs(granularity="tensor"), "channel": QuantArgs(granularity="channel"),
              "block": QuantArgs(granularity="block", block_shape=(128, 128))}


@_cases("compressed-tensors", lambda c: c.get("strategy") in _CT_WEIGHT)
def test_compressed_tensors_weights(case):
    block = case["arguments"]["weights"]["block_structure"]
    args = _CT_WEIGHT[case["strategy"]]
    if block:
        args = QuantArgs(granularity="block", block_shape=tuple(block))
    q = quantize(_input(case), args, recipe="compressed-tensors")
    _same_bits(q.codes, _tensor(case, "codes"))
    _same_bits(q.scale, _tensor(case, "weight_scale"))
    assert tuple(q.scale.shape) == tuple(_tensor(case, "weight_scale").shape)


_CT_ACT = {"static_tensor": ("input_scale", QuantArgs(granularity="tensor")),
           "dynamic_token": ("scale", QuantArgs(granularity="token")),
           "dynamic_group128": ("scale", QuantArgs(granularity="group", group_size=128))}


@_cases("compressed-tensors", lambda c: c.get("kind") in _CT_ACT)
def test_compressed_tensors_activations(case):
    scale_key, args = _CT_ACT[case["kind"]]
    x = _input(case)
    q = quantize(x, args, recipe="compressed-tensors")
    _same_bits(q.codes, _tensor(case, "codes"))
    _same_bits(q.scale, _tensor(case, scale_key))
    _same_bits(dequantize(q), _tensor(case, "fake_quant"))
    _same_bits(fake_quant(x, args, recipe="compressed-tensors"), _tensor(case, "fake_quant"))


@_cases("compressed-tensors", lambda c: c.get("kind") == "static_tensor")
def test_compressed_tensors_static_input_with_calibrated_scale(case):
    static = QuantArgs(granularity="tensor", dynamic=False)
    q = quantize(_input(case), static, recipe="compressed-tensors", scale=_tensor(case, "input_scale"))
    _same_bits(q.codes, _tensor(case, "codes"))


@_cases("auto-round", lambda c: c.get("strategy") == "channel")
def test_auto_round_weights(case):
    x = _input(case)
    q = quantize(x, QuantArgs(granularity="channel"), recipe="auto-round")
    _same_bits(q.codes, _tensor(case, "codes"))
    _same_bits(q.scale, _tensor(case, "weight_scale"))  # auto-round stores [out]; fp8ref (out, 1)
    assert not (q.codes == 0x80).any()  # the STE turns -0 into +0


@_cases("auto-round", lambda c: c.get("strategy") == "channel")
def test_auto_round_fp32_scale_is_the_divisor(case):
    """scale_fp32 (auto-round's s32, the divisor) is the recipe's unrounded operand."""
    x = _input(case)
    amax = x.float().abs().amax(dim=1, keepdim=True).double().numpy()
    dtype = str(x.dtype).removeprefix("torch.")
    _, operand = compute_scale(amax, get_recipe("auto-round"), E4M3, dtype)
    _same_bits(torch.from_numpy(operand), _tensor(case, "scale_fp32"))


@_cases("auto-round", lambda c: c.get("kind") == "static_input_scale")
def test_auto_round_input_scale_from_act_max(case):
    act_max = _tensor(case, "act_max")
    q = quantize(_input(case), QuantArgs(granularity="tensor", dynamic=False), recipe="auto-round", amax=act_max)
    _same_bits(q.scale, _tensor(case, "input_scale"))


@_cases("transformers", lambda c: c.get("strategy") == "block")
def test_hf_finegrained_fp8(case):
    block = tuple(case["arguments"]["weight_block_size"])
    q = quantize(_input(case), QuantArgs(granularity="block", block_shape=block), recipe="hf-fp8")
    _same_bits(q.codes, _tensor(case, "codes"))
    _same_bits(q.scale, _tensor(case, "weight_scale_inv"))


@_cases("transformers", lambda c: c.get("passed_through_unquantized"))
def test_hf_finegrained_rejects_what_transformers_leaves_unquantized(case):
    block = tuple(case["arguments"]["weight_block_size"])
    with pytest.raises(ShapeError, match=r"x: recipe 'hf-fp8' requires the block"):
        quantize(_input(case), QuantArgs(granularity="block", block_shape=block), recipe="hf-fp8")


def test_fixture_total_size_is_small():
    total = sum(p.stat().st_size for p in HERE.iterdir() if p.is_file())
    assert total <= 2 * 1024 * 1024, total

